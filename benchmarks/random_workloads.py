"""Random workloads: the traces no program recorded, for the targets that must
hold on work pyalloc was not tuned on (issue 19: "and on traces you have not
seen").

Each is 20000 calls: with a block live, a free of a random live block half the
time (always once 2 GiB is live), otherwise an allocation of a log-uniform size
from 512 B to 64 MiB (rounded up to 512 B) on one of `streams` streams, chosen
at random. Nothing repeats, so holes left by frees are not reused by the same
shapes, as they are in a training step.

`random_ops` gives the calls, for driving an allocator directly;
`random_snapshot` the same calls as a PyTorch memory snapshot (alloc,
free_requested and free_completed events, no segments) that `pyalloc replay`
and benchmarks/fragmentation.py replay like a recorded one.
"""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterator, List, Tuple

MiB, GiB = 1 << 20, 1 << 30

#: (streams, seed) of the workloads the fragmentation benchmark and the targets use.
WORKLOADS: List[Tuple[int, int]] = [(streams, seed) for streams in (1, 2, 3, 4) for seed in range(4)]

CALLS = 20000
MAX_LIVE = 2 * GiB
MIN_SIZE, MAX_SIZE = 512, 64 * MiB


def name(streams: int, seed: int) -> str:
    """The workload's name in results."""
    return f"random-{streams}-stream{'s' if streams > 1 else ''}-seed{seed}"


def random_ops(seed: int, streams: int) -> Iterator[Tuple[str, int, int, int]]:
    """The calls, in order: ("alloc", id, size, stream) or ("free", id, size, stream)."""
    rng = random.Random(seed)
    live: List[Tuple[int, int, int]] = []
    cur, next_id = 0, 0
    for _ in range(CALLS):
        if live and (rng.random() < 0.5 or cur > MAX_LIVE):
            id_, size, stream = live.pop(rng.randrange(len(live)))
            cur -= size
            yield "free", id_, size, stream
        else:
            size = -(-int(math.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE)))) // 512) * 512
            stream = rng.randrange(streams)
            live.append((next_id, size, stream))
            cur += size
            yield "alloc", next_id, size, stream
            next_id += 1


def random_snapshot(seed: int, streams: int) -> Dict[str, Any]:
    """The calls of random_ops as a memory snapshot of one device. Addresses are
    never reused, so each names one allocation."""
    events: List[Dict[str, Any]] = []
    addr_of: Dict[int, int] = {}
    next_addr = 1 << 40
    for t, (kind, id_, size, stream) in enumerate(random_ops(seed, streams)):
        if kind == "alloc":
            addr_of[id_] = next_addr
            next_addr += size
            events.append(_event("alloc", next_addr - size, size, stream, t))
        else:
            addr = addr_of.pop(id_)
            events.append(_event("free_requested", addr, size, stream, t))
            events.append(_event("free_completed", addr, size, stream, t))
    return {"segments": [], "device_traces": [events]}


def _event(action: str, addr: int, size: int, stream: int, t: int) -> Dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}
