"""Regression tests for bugs found in the allocator core, named after the bug."""
import pyalloc


def test_free_merges_with_its_own_stream_beyond_an_absorbed_neighbour():
    a = pyalloc.Allocator("virtual")
    # Four adjacent 512 B blocks of one small-pool chunk: x, y (stream 2), z, guard.
    x = a.malloc(512, 1)
    y = a.malloc(512, 2)
    z = a.malloc(512, 1)
    guard = a.malloc(512, 1)
    assert [p - x for p in (y, z, guard)] == [512, 1024, 1536]
    a.free(x)  # free on stream 1
    a.free(y)  # free on stream 2; not merged with x: neither is safe for the other's stream yet
    a.malloc(1024, 3)  # stream 3 looks at stream 2's free blocks: y becomes safe everywhere
    a.check_invariants()
    a.free(z)  # z absorbs y (safe), and now lies next to x, a free block of its own stream
    a.check_invariants()
