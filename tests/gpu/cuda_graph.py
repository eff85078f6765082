"""A CUDA graph captured and replayed with pyalloc installed.

torch.cuda.graph() empties the cache before it captures, and a capture can use
only memory already reserved, so pool_size keeps memory for it.
"""
import torch

import pyalloc

MiB = 1 << 20


def main():
    pyalloc.install(pool_size="256MiB")
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
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = model(static_in)
    blocks, held = pyalloc.graph_memory()
    assert blocks > 0 and held > 0, (blocks, held)

    for seed in range(5):
        x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        # Eager allocations between replays must never land on the graph's memory.
        clutter = [torch.full((n,), float("nan"), device="cuda") for n in (1000, 70_000, 300_000)]
        static_in.copy_(x)
        graph.replay()
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(static_out, expected, rtol=1e-4, atol=1e-4)
        # Had the clutter landed on graph memory, the replay would have written into it.
        assert all(bool(torch.isnan(c).all()) for c in clutter)
        del clutter

    # A capture needing more than is reserved fails clearly, and the process goes on.
    graph2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph2):
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        raise AssertionError("a capture grew the pool")
    except RuntimeError as e:
        message = str(e)
        assert "CUDA out of memory." in message and "pool_size" in message, message
    del graph2
    torch.cuda.synchronize()
    assert float(torch.ones(MiB, device="cuda").sum()) == MiB

    del graph, static_out
    # What PyTorch freed comes back; what it keeps (e.g. the capture stream's
    # cuBLAS workspace) stays allocated.
    assert 0 < pyalloc.release_graph_memory() <= held
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
