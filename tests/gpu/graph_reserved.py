"""torch.cuda.memory_reserved() counts CUDA graphs' pools, through the bridge: the
definition of PyTorch's own allocator, and of torch 2.14's cudaMallocAsync backend,
which from 2.14 on adds the graph memory its captures reserve (pytorch 186809).

A graph capturing 64 MiB raises memory_reserved() by its pool's reserved bytes
(reserved_bytes_by_private_pools too, from torch 2.13 on); once the graph is gone
and its pool released, empty_cache() takes them out of memory_reserved() again.
"""
import gc

import torch
from torch.torch_version import TorchVersion

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def main():
    bridge_only("torch.cuda.memory_reserved() through the bridge")
    side = torch.cuda.Stream()
    x = torch.ones(MiB, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    assert before == pyalloc.memory_reserved(), (before, pyalloc.memory_reserved())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        y.fill_(1)
    g.replay()
    torch.cuda.synchronize()
    [pool] = pyalloc._C.cuda_graph_pools(0)
    during = torch.cuda.memory_reserved()
    assert pool["reserved_bytes"] >= 64 * MiB, pool
    assert during >= before + pool["reserved_bytes"] and during == pyalloc.memory_reserved(), (before, during, pool)
    if TorchVersion(torch.__version__) >= "2.13":
        pid = tuple(pool["id"])
        key = f"reserved_bytes_by_private_pools.{pid[0]}_{pid[1]}.all.current"
        assert torch.cuda.memory_stats()[key] == pool["reserved_bytes"], torch.cuda.memory_stats()
    del y, g
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before, (torch.cuda.memory_reserved(), before)
    assert float(x.sum()) == MiB
    print("OK")


if __name__ == "__main__":
    main()
