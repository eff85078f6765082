"""A CUDA graph captured and replayed with pyalloc installed, nothing reserved beforehand.

torch.cuda.graph() empties the cache right before it captures, so the capture
itself must grow the pool (in relaxed capture mode, as PyTorch's allocator does).
"""
import gc

import torch

import pyalloc
from gpu_common import graph_pools_reach_pyalloc

MiB = 1 << 20


def main():
    pyalloc.install()  # no pool_size; the route PYALLOC_BRIDGE selects
    pool_hooks = graph_pools_reach_pyalloc()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda()
    static_in = torch.randn(64, 512, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):  # warm up (cuBLAS handles, workspaces) outside the capture
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=side):
        static_out = model(static_in)
        big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # fresh memory
        big.fill_(1)
        total = big.sum()
    if pool_hooks:  # the graph's own pool holds what it allocated
        pools = pyalloc._C.cuda_graph_pools(0)
        assert len(pools) == 1, pools
        assert pools[0]["use_count"] == 1 and pools[0]["reserved_bytes"] >= 256 * MiB, pools
    else:
        blocks, held = pyalloc.graph_memory()
        assert held >= 256 * MiB, (blocks, held)

    for seed in range(5):
        x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        # Eager allocations between replays must never land on the graph's memory.
        clutter = [torch.full((n,), float("nan"), device="cuda") for n in (1000, 70_000, 300_000)]
        static_in.copy_(x)
        big.zero_()
        graph.replay()
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(static_out, expected, rtol=1e-4, atol=1e-4)
        assert int(total) == 256 * MiB
        # Had the clutter landed on graph memory, the replay would have written into it.
        assert all(bool(torch.isnan(c).all()) for c in clutter)
        del clutter

    torch.cuda.synchronize()
    del graph
    if pool_hooks:
        assert pyalloc._C.cuda_graph_pools(0)[0]["use_count"] == 0
        del static_out, big, total
        gc.collect()
        # Nothing of the pool is live any more (the workspaces were made on
        # `side` before the capture). The last free only marks the released pool
        # (no device sync inside a tensor's deleter); empty_cache() gives its
        # memory back, as PyTorch's allocator does (or the out-of-memory path).
        pools = pyalloc._C.cuda_graph_pools(0)
        assert len(pools) == 1 and pools[0]["use_count"] == 0 and pools[0]["allocated_bytes"] == 0, pools
        reserved = pyalloc.memory_reserved()
        torch.cuda.empty_cache()
        assert pyalloc._C.cuda_graph_pools(0) == [], pyalloc._C.cuda_graph_pools(0)
        assert pyalloc.memory_reserved() <= reserved - pools[0]["reserved_bytes"], (reserved, pools)
    else:
        del static_out, big, total
        assert pyalloc.release_graph_memory() > 0
    assert float(torch.ones(MiB, device="cuda").sum()) == MiB
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
