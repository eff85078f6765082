"""CUDA graphs' private pools: two graphs sharing one, and a released pool's memory
going back to the device for the general pool to reuse."""
import gc

import torch

import pyalloc
from gpu_common import graph_pools_reach_pyalloc

MiB = 1 << 20


def pools():
    return {tuple(p["id"]): p for p in pyalloc._C.cuda_graph_pools(0)}


def main():
    pyalloc.install()
    if not graph_pools_reach_pyalloc():
        print(f"OK (torch {torch.__version__} has no graph-pool hooks: nothing to check)")
        return
    side = torch.cuda.Stream()
    x = torch.ones(MiB, device="cuda")
    torch.cuda.synchronize()

    # Two graphs sharing a pool: the second reuses what the first freed in its capture.
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=side):
        tmp = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        tmp.fill_(1)
        out1 = x * 2 + tmp[: x.numel()].float()
        del tmp
    assert len(pools()) == 1, pools()
    (pid, p), = pools().items()
    assert p["use_count"] == 1 and p["reserved_bytes"] >= 64 * MiB, p
    assert out1.data_ptr() in pyalloc._C.cuda_pool_live_blocks(0, pid)
    reserved = p["reserved_bytes"]
    with torch.cuda.graph(g2, stream=side, pool=g1.pool()):
        tmp = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        tmp.fill_(2)
        out2 = out1 + tmp[: x.numel()].float()
        del tmp
    assert list(pools()) == [pid] and pools()[pid]["use_count"] == 2, pools()
    assert pools()[pid]["reserved_bytes"] < reserved + 64 * MiB, (pools(), reserved)
    for i in range(3):
        x.fill_(float(i))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(out1, x * 2 + 1) and torch.equal(out2, x * 2 + 3)

    # Released: the pool stays while its outputs live, then its memory goes back.
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    pool_bytes = pools()[pid]["reserved_bytes"]
    del g1
    assert pools()[pid]["use_count"] == 1
    del g2
    assert pools()[pid]["use_count"] == 0
    del out1, out2
    gc.collect()
    # The last free only leaves the pool marked (no device sync inside a
    # deleter): empty_cache gives it back.
    assert list(pools()) == [pid] and pools()[pid]["allocated_bytes"] == 0, pools()
    torch.cuda.empty_cache()
    assert pools() == {}, pools()
    assert torch.cuda.mem_get_info()[0] >= free_before + pool_bytes - 2 * MiB
    # The general pool takes it up again.
    y = torch.full((pool_bytes // 4,), 5.0, device="cuda")
    assert float(y[-1]) == 5.0
    del y
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
