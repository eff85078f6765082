"""torch.compile's CUDA-graph trees across checkpoint restores, through the bridge.

The tree restores its pool (setCheckpointPoolState, through the bridge) only
when a warm-up or a recording starts while a recorded path is executing, that
is after a replay whose outputs are still alive. A new input shape does it: with
dynamic=False it is a new function, warmed up at once, on top of the replayed
path. Each restore here follows a replay, so it meets the two things only a
real tree shows:
- A replayed output kept alive across the restore is a block live both before
  and after it: the bridge must list it in both ptrs_freed and dataptrs_allocd,
  or its storage never gets its deleter back (torch's slow-path asserts check
  _has_Standard_Deleter), its block leaks when the tensor dies, and the next
  restore's check of the pool (check_memory_pool) finds an allocation no tensor
  accounts for.
- record_stream() on a replayed output (a storage with deleteNothing over the
  pool's block) must not pin that block with an event: the restore would find
  the block's memory not free and fail.
Both run while a side stream has queued work, as overlapping copies do.
"""
import torch
import torch._inductor.config as inductor_config
from torch._inductor import cudagraph_trees

import pyalloc
from gpu_common import bridge_only

# Each shape is warmed up once, recorded once, then replayed.
SHAPES = (16, 32, 48)
STEPS = 12
# From this step on, every output is a replay's (a storage that owns nothing,
# over the tree's pool).
REPLAYS_FROM = 6
# Shapes first seen after the replays, each while a replayed output lives: each
# starts a warm-up on the executing path, so the tree restores its pool.
NEW_SHAPES = (24, 40)


def make_input(rows, g):
    return torch.randn(rows, 64, device="cuda", generator=g)


def read_on_side_stream(out, side):
    """Work on another stream reads `out`, and says so with record_stream."""
    main = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000)  # keeps the side stream's work queued a while
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _ = out.sum()
    out.record_stream(side)


def checkpoints_so_far():
    manager = cudagraph_trees.get_container(0).tree_manager
    assert manager is not None, "torch.compile made no CUDA-graph tree on device 0"
    return manager.debug_checkpointing_counter


def main():
    bridge_only("torch.compile's CUDA-graph trees")
    inductor_config.triton.slow_path_cudagraph_asserts = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    side = torch.cuda.Stream()
    kept = []  # (output, expected) pairs held across later steps, and so across restores

    def step(x, on_side_stream):
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(x)
        expected = model(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        if on_side_stream:
            read_on_side_stream(out, side)
        kept.append((out, expected))
        if len(kept) > 2:
            kept.pop(0)

    with torch.no_grad():
        for i in range(STEPS):
            step(make_input(SHAPES[i % 3], g), on_side_stream=i >= REPLAYS_FROM)
        for n, rows in enumerate(NEW_SHAPES, start=1):
            # A replay, its output read on the side stream and kept alive...
            step(make_input(SHAPES[n % 3], g), on_side_stream=True)
            replayed, replayed_expected = kept[-1]
            before = checkpoints_so_far()
            # ...then a shape never seen: a warm-up on the executing path, after a restore.
            step(make_input(rows, g), on_side_stream=False)
            assert checkpoints_so_far() > before, (
                f"no pool restore after new shape {rows}: the check did not exercise setCheckpointPoolState")
            # The output live across the restore still holds its values (nothing
            # reused its block), and the tree's own asserts found it with its deleter.
            torch.testing.assert_close(replayed, replayed_expected, rtol=1e-4, atol=1e-4)
            # Replays of the old shapes again, so the next restore also follows a replay;
            # the outputs kept here die, giving their blocks back through their deleters.
            for i in range(3):
                step(make_input(SHAPES[i], g), on_side_stream=True)
    restores = checkpoints_so_far()
    kept.clear()
    side.synchronize()
    torch.cuda.synchronize()
    pools = pyalloc._C.cuda_graph_pools(0)
    assert pools, "no CUDA graph was recorded into a private pool"
    pyalloc._C.cuda_check_invariants(0)
    print(f"OK ({restores} pool restores)")


if __name__ == "__main__":
    main()
