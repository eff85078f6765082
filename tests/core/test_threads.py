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


def _stat_identities(s):
    """What any read of torch.cuda.memory_stats() must satisfy, however many threads are at work."""
    from test_stats_fidelity import FAMILIES

    for fam in FAMILIES:
        cur = {p: s[f"{fam}.{p}.current"] for p in ("all", "small_pool", "large_pool")}
        assert cur["all"] == cur["small_pool"] + cur["large_pool"], fam
        assert min(cur.values()) >= 0, fam
        assert all(s[f"{fam}.{p}.peak"] >= c for p, c in cur.items()), fam
    assert s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"]
    assert s["allocated_bytes.all.current"] <= s["active_bytes.all.current"]


def test_device_pools_from_many_threads(fake):
    """PyTorch's calls from many threads at once over two fake devices: allocations
    and frees through the hooks (with and without the device), record_stream,
    buffers, graph pools routed, ended and released while other threads
    allocate into them, and every reader and maintenance call meanwhile. Every
    read of the stats is consistent; at the end every count is back at zero."""
    import ctypes

    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    routed = 0x5000
    errors, done = [], threading.Event()

    def guarded(fn):
        def run(seed):
            try:
                fn(random.Random(seed), seed)
            except Exception as e:  # surfaced below, with the thread's seed
                errors.append((seed, repr(e)))
        return run

    def malloc(size, device, stream):
        try:
            return _C._testing_hook_malloc(size, device, stream)
        except RuntimeError as e:  # no cache is given back while a route is open
            assert "out of memory" in str(e)
            return 0

    @guarded
    def worker(rng, seed):
        live, bufs = [], []
        for _ in range(1500):
            r = rng.random()
            if live and (r < 0.4 or len(live) > 24):
                p, d = live.pop(rng.randrange(len(live)))
                lib.pyalloc_free(p, 0, rng.choice((d, -1, 1 - d)), None)
            elif live and r < 0.5:
                lib.pyalloc_record_stream(rng.choice(live)[0], rng.randint(1, 3))
            elif r < 0.55:
                if len(bufs) < 2:
                    bufs.append(pyalloc.reserve_buffer(rng.randint(1, MiB), rng.randint(0, 1)))
                else:
                    bufs.clear()
            else:
                d = rng.randint(0, 1)
                p = malloc(rng.choice((rng.randint(1, 32 * KiB), rng.randint(KiB, 2 * MiB))), d,
                           rng.choice((1, 2, 3, routed)))
                if p:
                    live.append((p, d))
        for p, d in live:
            lib.pyalloc_free(p, 0, d, None)

    @guarded
    def grapher(rng, seed):
        for _ in range(150):
            d, pid = rng.randint(0, 1), (rng.randint(1, 3), seed)
            if rng.random() < 0.5:
                _C._testing_pool_hook("begin_allocate_to_pool", d, pid, [routed])
                got = [malloc(rng.randint(1, MiB), d, routed) for _ in range(3)]
                _C._testing_pool_hook("end_allocate_to_pool", d, pid)
                for p in got:
                    lib.pyalloc_free(p, 0, d, None)
                _C._testing_pool_hook("release_pool", d, pid)
            else:
                _C._testing_pool("create_or_incref", d, pid)
                _C.cuda_graph_pools(d)
                _C.cuda_pool_live_blocks(d, pid)
                _C._testing_pool("release", d, pid)

    @guarded
    def reader(rng, seed):
        calls = (
            lambda d: _stat_identities(pyalloc.memory_stats(d)),
            lambda d: _stat_identities(_C.cuda_stats(d, "general")),
            lambda d: pyalloc.snapshot(),
            lambda d: pyalloc.empty_cache(d),
            lambda d: pyalloc.reset_peak_memory_stats(d),
            lambda d: pyalloc.reset_accumulated_memory_stats(d),
            lambda d: pyalloc.fragmentation(d),
            lambda d: pyalloc.record_history(rng.random() < 0.5, 200),
            lambda d: _C.cuda_check_invariants(d),
        )
        while not done.is_set():
            rng.choice(calls)(rng.randint(0, 1))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    threads.append(threading.Thread(target=grapher, args=(10,)))
    readers = [threading.Thread(target=reader, args=(20,))]
    for t in threads + readers:
        t.start()
    for t in threads:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not errors
    for d in (0, 1):
        pyalloc.empty_cache(d)
        _C.cuda_check_invariants(d)
        s = pyalloc.memory_stats(d)
        _stat_identities(s)
        assert {k: v for k, v in s.items() if k.endswith(".current") and v} == {}
        assert _C.cuda_graph_pools(d) == []
