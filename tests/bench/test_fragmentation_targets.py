"""The budget target of benchmarks/fragmentation.py: one rule for the misses it lists
and for the marks of its strategies' table."""
from __future__ import annotations

from benchmarks import fragmentation as frag


def _never_asked():
    raise AssertionError("a budget within the tie needs no replay on theirs")


def test_a_budget_is_missed_only_above_the_tie_and_where_pyalloc_fails_on_theirs():
    theirs = 1000 << 20
    over = int(theirs * (1 + frag.BUDGET_TIE)) + (1 << 20)
    assert not frag.budget_missed(theirs, theirs, _never_asked)
    assert not frag.budget_missed(int(theirs * (1 + frag.BUDGET_TIE)), theirs, _never_asked)
    assert frag.budget_missed(over, theirs, lambda: False)
    assert not frag.budget_missed(over, theirs, lambda: True)
    assert not frag.budget_missed(None, theirs, _never_asked) and not frag.budget_missed(over, None, _never_asked)


def _row(budget_ratio, missed):
    strategy = {"budget_ratio": budget_ratio, "budget_missed": missed, "reserved_ratio": 1.1,
                "second_half_device_calls": 0, "driver_calls": 10}
    return {"trace": "t", "peak_live_bytes": 1 << 20, "recorded_on_gpu": False, "vmm": strategy,
            "native_expandable": {"budget_ratio": 1.0, "reserved_ratio": 1.1, "second_half_device_calls": 0,
                                  "driver_calls": 10}}


def test_the_strategies_mark_the_budget_by_the_rule_the_misses_follow():
    # Above expandable segments' by more than the tie, yet complete on theirs: no miss
    # listed, so the table marks the target met too; failing on theirs, neither.
    assert frag.strategy_marks(_row(1.01, missed=False), "vmm")["budget"]
    assert not frag.strategy_marks(_row(1.01, missed=True), "vmm")["budget"]
    assert not frag.strategy_marks(_row(None, missed=False), "vmm")["budget"]
