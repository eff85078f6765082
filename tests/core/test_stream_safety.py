"""Random multi-stream sequences checked for the one rule that matters most:
no stream is handed memory that another stream's queued work may still use.

The model knows which streams are busy (stream_set_busy / stream_complete on
the simulated streams). A block freed while its stream is busy may go only
to that stream until the stream completes; a block record_stream()'d to a busy
stream may go to nobody. Whenever the allocator waits for every stream
(num_sync_all_streams rises), all work is done and every range is safe again.
Under vmm, pages under such a range must also stay mapped.
"""
import random

import pytest

import pyalloc

KiB, MiB = 1 << 10, 1 << 20
STREAMS = (0, 1, 2)


def mapped_ranges(a):
    return sorted((b["address"], b["address"] + b["size"])
                  for seg in a.snapshot()["segments"] for b in seg["blocks"])


def covered(ranges, lo, hi):
    cur = lo
    for mlo, mhi in ranges:
        if mlo <= cur < mhi:
            cur = mhi
        if cur >= hi:
            return True
    return cur >= hi


def run(seed, backend, strategy, conf, steps=1500):
    rng = random.Random(seed)
    a = pyalloc.Allocator(backend, conf, capacity=96 * MiB, strategy=strategy, segment_size=4 * MiB)
    busy = {s: False for s in STREAMS}
    live = {}  # ptr -> (size, stream, streams from record_stream)
    unsafe = []  # (lo, hi, busy stream, the one stream that may reuse it or None)
    for step in range(steps):
        op = rng.random()
        if op < 0.45 or not live:
            k = rng.random()
            size = (rng.randint(1, 64 * KiB) if k < 0.6 else
                    rng.randint(64 * KiB, MiB) if k < 0.8 else rng.randint(MiB, 12 * MiB))
            t = rng.choice(STREAMS)
            syncs = a.stats()["num_sync_all_streams"]
            try:
                p = a.malloc(size, t)
            except pyalloc.OutOfMemoryError:
                p = None
            if a.stats()["num_sync_all_streams"] != syncs:
                unsafe = []  # the allocator waited for every stream
            if p is None:
                continue
            for lo, hi, blocker, owner in unsafe:
                assert not (p < hi and p + size > lo and owner != t), (
                    f"step {step}: stream {t} got {p:#x}+{size}, still in use on stream {blocker}")
            live[p] = (size, t, set())
        elif op < 0.8:
            p = rng.choice(list(live))
            size, t, uses = live.pop(p)
            if busy[t]:
                unsafe.append((p, p + size, t, t))
            unsafe += [(p, p + size, u, None) for u in uses if busy[u]]
            a.free(p)
        elif op < 0.86:
            p = rng.choice(list(live))
            u = rng.choice(STREAMS)
            if u != live[p][1]:
                live[p][2].add(u)
            a.record_stream(p, u)
        elif op < 0.94:
            s = rng.choice(STREAMS)
            busy[s] = True
            a.stream_set_busy(s)
        elif op < 0.99:
            s = rng.choice(STREAMS)
            busy[s] = False
            a.stream_complete(s)
            unsafe = [x for x in unsafe if x[2] != s]
        else:
            a.empty_cache()  # waits for every stream
            busy = {s: False for s in STREAMS}
            unsafe = []
        if strategy == "vmm" and unsafe and step % 5 == 0:
            ranges = mapped_ranges(a)
            for lo, hi, blocker, _ in unsafe:
                assert covered(ranges, lo, hi), f"step {step}: pages unmapped under stream {blocker}'s work"
        a.check_invariants()


@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
@pytest.mark.parametrize("conf", ["", "max_split_size:4MiB", "small_size:64KiB,small_chunk_size:512KiB",
                                  "max_pool_size:48MiB"])
@pytest.mark.parametrize("seed", [13, 21, 34])
def test_no_stream_gets_memory_another_stream_may_still_use(seed, conf, strategy):
    run(seed, "virtual", strategy, conf)


@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
def test_no_stream_gets_memory_another_stream_may_still_use_host(strategy):
    run(7, "host", strategy, "max_pool_size:48MiB")
