"""Many threads allocating and freeing at once."""
import random
import threading

import pyalloc
from pyalloc import _C

KiB = 1 << 10
MiB = 1 << 20


def test_four_threads_100k_operations_leave_every_stat_at_zero(backend):
    a = pyalloc.Allocator(backend, segment_size=8 * MiB)
    threads, ops_per_thread = 4, 25_000
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        live = []
        stream = seed % 2  # two threads per stream: cross-stream reuse under contention
        try:
            for _ in range(ops_per_thread):
                if live and (rng.random() < 0.5 or len(live) > 64):
                    a.free(live.pop(rng.randrange(len(live))))
                else:
                    size = rng.choice((rng.randint(1, 32 * KiB), rng.randint(MiB, 6 * MiB)))
                    live.append(a.malloc(size, stream))
            for p in live:
                a.free(p)
        except Exception as e:  # surfaced below, with the thread's seed
            errors.append((seed, e))

    pool = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    a.check_invariants()
    a.empty_cache()
    s = a.stats()
    nonzero = {k: v for k, v in s.items() if k.endswith(".current") and v != 0}
    assert nonzero == {}
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] > 0


def test_core_threads_without_the_gil():
    """The C++ loop hammers one allocator from 4 threads with no Python in between."""
    a = pyalloc.Allocator("virtual", segment_size=8 * MiB)
    sizes = [512, 4 * KiB, 100 * KiB, 2 * MiB, 3 * MiB + 512, 20 * MiB]
    _C.bench_pairs(a._core, sizes, 50_000, threads=4, window=16)
    a.check_invariants()
    s = a.stats()
    assert s["allocation.all.current"] == 0
    assert s["allocation.all.allocated"] == 4 * 50_000
