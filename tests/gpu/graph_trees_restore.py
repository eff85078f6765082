"""torch.compile's CUDA-graph trees across checkpoint restores, through the bridge.

Two things only a real tree shows:
- A graph output kept alive while the tree switches paths is a block live both
  before and after the pool's restore: the bridge must list it in both
  ptrs_freed and dataptrs_allocd, or its storage never gets its deleter back,
  its block leaks when the tensor dies, and the tree's own check of the pool
  (slow_path_cudagraph_asserts) finds an allocation no tensor accounts for.
- record_stream() on a replayed output (a storage with deleteNothing over the
  pool's block) must not pin that block with an event: the next restore would
  find the block's memory not free and fail.
Both run while a side stream has queued work, as overlapping copies do.
"""
import torch
import torch._inductor.config as inductor_config

import pyalloc
from gpu_common import bridge_only

STEPS = 12
# Each shape is warmed up once, recorded once, then replayed: from step 6 every
# output is a replay's (a storage that owns nothing, over the tree's pool).
REPLAYS_FROM = 6


def step_input(step, g):
    # Three shapes in turn: each switch to another recorded path restores the pool.
    return torch.randn((16, 32, 48)[step % 3], 64, device="cuda", generator=g)


def main():
    bridge_only("torch.compile's CUDA-graph trees")
    inductor_config.triton.slow_path_cudagraph_asserts = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    side = torch.cuda.Stream()
    kept = []  # outputs held across later steps (and so across restores)
    with torch.no_grad():
        for step in range(STEPS):
            x = step_input(step, g)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x)
            expected = model(x)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            if step >= REPLAYS_FROM:
                # Work on another stream reads a replayed output, and says so.
                main = torch.cuda.current_stream()
                torch.cuda._sleep(1_000_000)  # keeps the side stream's work queued a while
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    _ = out.sum()
                out.record_stream(side)
            # Kept (never read again: a later replay may reuse its memory, as
            # the trees allow), then dropped two steps later.
            kept.append(out)
            del out
            if len(kept) > 2:
                kept.pop(0)
    side.synchronize()
    torch.cuda.synchronize()
    pools = pyalloc._C.cuda_graph_pools(0)
    assert pools, "no CUDA graph was recorded into a private pool"
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
