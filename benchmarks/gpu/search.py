"""The largest size that runs under a memory budget, found with few probes.

Each probe is expensive (a fresh process that builds the model and runs
several steps), so the search is bounded in count: it gallops from a starting
size that usually fits (doubling while probes pass, halving while they fail)
until it has a passing and a failing size, then bisects between them. It
assumes that whatever fits at size n fits at every smaller size.

A probe returns a status: "ok" (ran), "oom" (out of memory); anything else
(an error, a crash, a time-out) stops the search, since it says nothing about
memory.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple, Union

ProbeResult = Union[str, Tuple[str, Dict[str, Any]]]


def largest_passing(probe: Callable[[int], ProbeResult], start: int, hi: int, lo: int = 1,
                    max_probes: int = 8, rel_tol: float = 0.0) -> Dict[str, Any]:
    """Searches [lo, hi] for the largest size whose probe is "ok".

    The search ends when the answer is exact, when `max_probes` probes have
    run, or when the passing and failing sizes are within `rel_tol` of each
    other (0.03: the answer is known to 3%).

    `probe(size)` returns a status, or (status, details) whose details are kept
    in the record of that probe. Returns:
      largest:          the largest size that passed (lo - 1 when none did)
      smallest_failing: the smallest size that ran out of memory (None when none did)
      exact:            True when the two are adjacent, or hi passed, or lo failed
      probes:           [{"size", "status", ...details}] in the order they ran
      stopped:          why the search ended: "found", "tolerance", "max_probes" or "error"
    """
    if not lo <= hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    if max_probes < 1:
        raise ValueError("max_probes must be at least 1")
    good, bad = lo - 1, hi + 1  # invariant: good passed (or is lo - 1), bad failed (or is hi + 1)
    probes: List[Dict[str, Any]] = []
    stopped = "found"
    while good + 1 < bad:
        if lo <= good and bad <= hi and bad - good <= rel_tol * good:
            stopped = "tolerance"
            break
        if len(probes) == max_probes:
            stopped = "max_probes"
            break
        size = _next_size(good, bad, lo, hi, min(max(start, lo), hi))
        answer = probe(size)
        status, details = (answer, {}) if isinstance(answer, str) else answer
        probes.append({"size": size, "status": status, **details})
        if status == "ok":
            good = size
        elif status == "oom":
            bad = size
        else:
            stopped = "error"
            break
    return {
        "largest": good,
        "smallest_failing": bad if bad <= hi else None,
        "exact": good + 1 == bad,
        "probes": probes,
        "stopped": stopped,
        "range": [lo, hi],
        "rel_tol": rel_tol,
    }


def _next_size(good: int, bad: int, lo: int, hi: int, start: int) -> int:
    found_good, found_bad = good >= lo, bad <= hi
    if found_good and found_bad:
        return (good + bad) // 2
    if found_good:  # everything so far fits: double
        return min(2 * good, hi)
    if found_bad:  # nothing so far fits: halve
        return max(bad // 2, lo)
    return start
