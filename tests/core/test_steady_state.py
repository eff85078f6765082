"""The steady state calls the backend never: an allocation loop that repeats
exactly reserves, maps, unmaps and releases nothing after its first pass.

The stats count every such call (num_device_alloc: segments reserved and page
ranges mapped; num_device_free: segments released and page ranges unmapped;
num_driver_calls: the CUDA driver calls behind them, handle by handle).
The same loop on the stand-in CUDA driver is in tests/cuda_stub/checks.py.
"""
import random

import pytest

import pyalloc

KiB, MiB = 1 << 10, 1 << 20


def device_calls(a):
    s = a.stats()
    return s["num_device_alloc"], s["num_device_free"], s["num_driver_calls"]


def passes(a, loop, n):
    """Runs loop(a) n times; the device calls after each pass."""
    out = []
    for _ in range(n):
        loop(a)
        a.check_invariants()
        out.append(device_calls(a))
    return out


def issue_sequence(a):
    p = a.malloc(2 * MiB)
    q = a.malloc(3 * MiB)
    a.free(p)
    s = a.malloc(7 * MiB // 2)
    a.free(q)
    a.free(s)


def test_vmm_mapped_one_range_and_unmapped_another_on_every_pass(make):
    """Each pass of this loop mapped a page and unmapped another under vmm,
    forever: the pages of p's hole were moved to fit s although the pool could
    grow. Now pages leave holes only at the cap or when the device is full."""
    a = make()
    calls = passes(a, issue_sequence, 10)
    assert calls[0][0] >= 1
    assert calls[1:] == [calls[0]] * 9, calls


LAYERS = 12


def weight_size(i):
    return MiB + i * 700 * KiB + 123


def fixed_shape_training_step(a):
    """One step of a small model with fixed shapes: activations kept for the
    backward pass, small and large temporaries, gradients, an optimizer update."""
    saved = []
    for i in range(LAYERS):
        saved.append(a.malloc(3 * MiB + i * 257 * KiB))  # the layer's output
        saved.append(a.malloc(40 * KiB + i * 512))  # a small saved tensor (norm statistics)
        a.free(a.malloc(5 * MiB + i * MiB))  # a workspace
    grads = []
    for i in reversed(range(LAYERS)):
        grad_out = a.malloc(3 * MiB + i * 257 * KiB)
        grads.append(a.malloc(weight_size(i)))
        grads.append(a.malloc(2 * KiB + i * 512))  # the bias gradient
        a.free(saved.pop())
        a.free(saved.pop())
        a.free(grad_out)
    for i in range(LAYERS):
        a.free(a.malloc(weight_size(i)))  # the optimizer's temporary
    for g in grads:
        a.free(g)


def test_a_fixed_shape_training_step_makes_no_device_call_after_the_first(make):
    a = make()
    params = [a.malloc(weight_size(i)) for i in range(LAYERS)] + [a.malloc(4 * KiB) for _ in range(LAYERS)]
    calls = passes(a, fixed_shape_training_step, 8)
    assert calls[1:] == [calls[0]] * 7, calls
    for p in params:
        a.free(p)


def random_loop(rng, sizes):
    """A fixed sequence of mallocs and frees that frees everything it allocates."""
    ops, live = [], []
    for i in range(rng.randrange(5, 60)):
        if live and rng.random() < 0.45:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            ops.append(("malloc", i, rng.choice(sizes)(rng)))
            live.append(i)
    ops += [("free", i) for i in live]

    def loop(a):
        ptrs = {}
        for op in ops:
            if op[0] == "malloc":
                ptrs[op[1]] = a.malloc(op[2])
            else:
                a.free(ptrs.pop(op[1]))
    return loop


LARGE = (lambda r: r.randrange(MiB, 64 * MiB), lambda r: r.randrange(256 * KiB, 4 * MiB))


@pytest.mark.parametrize("seed", range(40))
def test_random_loops_of_large_blocks_under_vmm_map_nothing_after_the_first_pass(seed):
    """The pool grows at its frontier (the free block beside unmapped pages),
    which is taken only when no other free block fits: each later pass then
    puts every block where the first pass did, into pages it mapped."""
    a = pyalloc.Allocator("virtual", strategy="vmm")
    a.malloc(3 * MiB + 5)  # something live across the passes
    calls = passes(a, random_loop(random.Random(seed), LARGE), 5)
    assert calls[1:] == [calls[0]] * 4, calls


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
def test_random_loops_settle_and_give_nothing_back(seed, strategy):
    """Where best fit puts a block differently in a later pass (under bestfit,
    into a segment the first pass added later; under vmm, beside a small-pool
    chunk lent elsewhere), that pass may add memory; the additions stop within
    a few passes, and nothing is ever unmapped or released."""
    sizes = LARGE + (lambda r: r.randrange(512, 256 * KiB),)
    a = pyalloc.Allocator("virtual", strategy=strategy)
    a.malloc(3 * MiB + 5)
    calls = passes(a, random_loop(random.Random(seed), sizes), 8)
    assert calls[4:] == [calls[3]] * 4, calls
    assert all(frees == 0 for _, frees, _ in calls), calls


def test_with_room_to_grow_pages_stay_in_their_holes(backend):
    a = pyalloc.Allocator(backend, strategy="vmm")
    p = a.malloc(8 * MiB)
    q = a.malloc(8 * MiB)
    a.free(p)
    # Fits no hole: mapped beside q (on to the next 20 MiB boundary), p's pages stay.
    a.malloc(10 * MiB)
    assert device_calls(a)[:2] == (2, 0)
    assert a.stats()["reserved_bytes.all.current"] == 40 * MiB
    a.free(q)
    a.check_invariants()


@pytest.mark.parametrize("limit", ["cap", "device"])
def test_at_the_cap_or_on_a_full_device_pages_leave_the_holes(backend, limit):
    kw = {"max_pool_size": 8 * MiB} if limit == "cap" else {"capacity": 8 * MiB}
    a = pyalloc.Allocator(backend, strategy="vmm", **kw)
    p = a.malloc(2 * MiB)
    q = a.malloc(3 * MiB)
    a.free(p)
    s = a.malloc(7 * MiB // 2)  # within 8 MiB only with p's page moved
    assert a.stats()["num_device_free"] == 1
    assert a.stats()["reserved_bytes.all.peak"] <= 8 * MiB
    a.free(q)
    a.free(s)
    a.check_invariants()
