"""Random operation sequences checked against a plain reference model.

After every operation: check_invariants(), the live byte counts equal the
model's, and no two live allocations overlap. On the host backend every live
block carries its own byte pattern, checked when it is freed.
"""
import ctypes
import random
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pyalloc

KiB = 1 << 10
MiB = 1 << 20
STREAMS = (0, 1, 2)


def rounded(n):
    return (n + 511) // 512 * 512


class Model:
    """What any correct allocator must agree with: the set of live allocations."""

    def __init__(self, alloc, pattern):
        self.a = alloc
        self.pattern = pattern
        # A block may exceed its rounded request by an unsplit remainder: at most
        # small_size, or for oversize blocks (max_split_size) up to 20 MiB.
        cfg = alloc.config
        self.slack = cfg["small_size"] + (20 * MiB if cfg["max_split_size"] else 0)
        self.live = {}  # ptr -> (requested, stream, byte)
        self.counter = 0

    def malloc(self, size, stream):
        before = self.a.stats()
        live_requested = self.live_requested()
        try:
            p = self.a.malloc(size, stream)
        except pyalloc.OutOfMemoryError:
            after = self.a.stats()
            for key in ("allocation.all.current", "allocated_bytes.all.current"):
                assert after[key] == before[key], key
            # Pending frees may complete meanwhile: what the live blocks asked for stays.
            assert self.live_requested() == live_requested
            return None
        if size == 0:
            assert p == 0
            return None
        assert p % 512 == 0 and p not in self.live
        self.counter += 1
        byte = self.counter % 251 + 1
        if self.pattern:
            ctypes.memset(p, byte, size)
        self.live[p] = (size, stream, byte)
        return p

    def free(self, p):
        size, _, byte = self.live.pop(p)
        if self.pattern:
            assert ctypes.string_at(p, size) == bytes([byte]) * size, "live block was overwritten"
        self.a.free(p)

    def live_requested(self):
        """requested_bytes less the pending frees' requests: it counts a request until
        its block is reusable, as active does (PyTorch's)."""
        pending = sum(b["requested_size"] for seg in self.a.snapshot()["segments"]
                      for b in seg["blocks"] if b["state"] == "active_pending_free")
        return self.a.stats()["requested_bytes.all.current"] - pending

    def check(self):
        self.a.check_invariants()
        s = self.a.stats()
        assert s["allocation.all.current"] == len(self.live)
        assert self.live_requested() == sum(v[0] for v in self.live.values())
        need = sum(rounded(v[0]) for v in self.live.values())
        assert need <= s["allocated_bytes.all.current"] <= need + len(self.live) * self.slack
        assert s["active_bytes.all.current"] >= s["allocated_bytes.all.current"]
        assert s["reserved_bytes.all.current"] >= s["active_bytes.all.current"]
        spans = sorted((p, p + v[0]) for p, v in self.live.items())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "two live allocations overlap"


def random_size(rng):
    kind = rng.random()
    if kind < 0.6:
        return rng.randint(1, 64 * KiB)
    if kind < 0.8:
        return rng.randint(64 * KiB, MiB + 4 * KiB)
    return rng.randint(MiB, 12 * MiB)


def run_random(alloc, seed, steps, pattern, check_every=1):
    rng = random.Random(seed)
    m = Model(alloc, pattern)
    for step in range(steps):
        op = rng.random()
        if op < 0.5 or not m.live:
            m.malloc(random_size(rng), rng.choice(STREAMS))
        elif op < 0.85:
            m.free(rng.choice(list(m.live)))
        elif op < 0.9:
            p = rng.choice(list(m.live))
            alloc.record_stream(p, rng.choice(STREAMS))
        elif op < 0.95:
            alloc.stream_set_busy(rng.choice(STREAMS))
        elif op < 0.99:
            alloc.stream_complete(rng.choice(STREAMS))
        else:
            alloc.empty_cache()
        if step % check_every == 0:
            m.check()
    for p in list(m.live):
        m.free(p)
    for s in STREAMS:
        alloc.stream_complete(s)
    alloc.empty_cache()
    m.check()
    s = alloc.stats()
    # empty_cache() keeps pool_size reserved (whole pages under vmm).
    assert s["reserved_bytes.all.current"] == alloc.config["pool_size"]
    assert s["active.all.current"] == 0


@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_host_with_patterns(seed, strategy):
    a = pyalloc.Allocator("host", capacity=96 * MiB, segment_size=8 * MiB, strategy=strategy)
    run_random(a, seed, steps=1500, pattern=True)


@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
@pytest.mark.parametrize("conf", [
    "",
    "pool_size:32MiB,max_pool_size:128MiB",
    "max_split_size:4MiB,segment_size:2MiB",
    "small_size:64KiB,small_chunk_size:512KiB",
])
def test_random_sequences_virtual_configs(conf, strategy):
    a = pyalloc.Allocator("virtual", conf, capacity=160 * MiB, strategy=strategy)
    run_random(a, zlib.crc32(conf.encode()), steps=2500, pattern=False)


@settings(max_examples=40, stateful_step_count=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
class AllocatorMachine(RuleBasedStateMachine):
    """Hypothesis explores op sequences and shrinks any failure to a minimal one."""

    @initialize(backend=st.sampled_from(["host", "virtual"]),
                capacity=st.sampled_from([0, 24 * MiB, 64 * MiB]),
                strategy=st.sampled_from(["bestfit", "vmm"]))
    def setup(self, backend, capacity, strategy):
        a = pyalloc.Allocator(backend, capacity=capacity, segment_size=4 * MiB, strategy=strategy)
        self.model = Model(a, pattern=backend == "host")

    @rule(size=st.one_of(st.integers(0, 2 * MiB), st.integers(MiB, 16 * MiB)),
          stream=st.sampled_from(STREAMS))
    def malloc(self, size, stream):
        self.model.malloc(size, stream)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def free(self, data):
        self.model.free(data.draw(st.sampled_from(sorted(self.model.live))))

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def record_stream(self, data, stream):
        self.model.a.record_stream(data.draw(st.sampled_from(sorted(self.model.live))), stream)

    @rule(stream=st.sampled_from(STREAMS), busy=st.booleans())
    def stream_work(self, stream, busy):
        if busy:
            self.model.a.stream_set_busy(stream)
        else:
            self.model.a.stream_complete(stream)

    @rule()
    def empty_cache(self):
        self.model.a.empty_cache()

    @rule(n=st.integers(0, 32 * MiB))
    def reserve(self, n):
        try:
            self.model.a.reserve(n)
        except pyalloc.OutOfMemoryError:
            pass

    @invariant()
    def consistent(self):
        if hasattr(self, "model"):
            self.model.check()


TestAllocatorMachine = AllocatorMachine.TestCase
