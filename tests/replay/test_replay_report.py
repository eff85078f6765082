"""What the replay's report says on a terminal: names that stay apart, a table within
100 columns, sentences on where pyalloc wins, ties and loses computed from the figures,
and the plot of the three measures."""
from __future__ import annotations

import pytest

from pyalloc._C import format_bytes
from pyalloc.replay.report import (TABLE_LEGEND, TIE, WIDTH, format_names, format_table, short_names,
                                   verdicts, wrap)
from pyalloc.replay.result import ReplayResult

GiB = 1 << 30
ALLOCATORS = ("pyalloc", "native", "native_expandable")


def made_up(trace, device=0, budget=(1.0, 1.0, 1.0), reserved=(1.0, 1.0, 1.0), calls=(10, 10, 10), live=GiB):
    """A result with the given figures (budget and reserved as ratios to peak live), p/n/e."""
    r = ReplayResult(trace=trace, device=device, events=0, allocs=0, frees=0, streams=1, peak_live_bytes=live,
                     pyalloc_peak_reserved_bytes=0, pyalloc_ratio=None, pyalloc_min_budget_bytes=None,
                     recorded_peak_reserved_bytes=None, recorded_ratio=None, fragmentation_at_peak={},
                     preexisting_blocks=0, preexisting_bytes=0, missed_frees=0, stray_frees=0, frees_at_request=0,
                     native_ooms=0, config="")
    for a, b, res, c in zip(ALLOCATORS, budget, reserved, calls):
        setattr(r, f"{a}_min_budget_bytes", None if b is None else int(b * live))
        setattr(r, f"{a}_peak_reserved_bytes", None if res is None else int(res * live))
        setattr(r, f"{a}_driver_calls", c)
    return r


# -- names -------------------------------------------------------------------

def test_long_names_that_begin_alike_stay_apart():
    traces = ["shared/traces/gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle",
              "shared/traces/gpu/constructor-sun-code_location-qwen3emb-gnn-1gpu-train.pickle",
              "shared/traces/gpu/maphsge4-select_n-llama7b-offload-infer-10streams.pickle",
              "benchmarks/traces/tiny-gpt-varlen-train.pickle.gz",
              "random-1-stream-seed0"]
    names = short_names(traces)
    # Alike for 26 columns: numbered, never cut with a mark that leaves them alike.
    assert (names[traces[0]], names[traces[1]]) == ("constructor-sun-code_loc#1", "constructor-sun-code_loc#2")
    assert names[traces[2]] == "maphsge4-select_n"  # two words keep it apart
    assert short_names(traces[:1] + traces[2:])[traces[0]] == "constructor-sun"
    assert names[traces[3]] == "tiny-gpt-varlen-train" and names[traces[4]] == "random-1-stream-seed0"
    narrow = short_names(traces, width=20)
    assert len(set(narrow.values())) == len(traces) and all(len(n) <= 20 for n in narrow.values())
    assert "~" not in "".join(narrow.values())


def test_the_same_file_name_in_two_folders_is_numbered():
    traces = ["a/run.pickle", "b/run.pickle", "b/other.pickle"]
    names = short_names(traces)
    assert names == {"a/run.pickle": "run#1", "b/run.pickle": "run#2", "b/other.pickle": "other"}


def test_the_table_fits_100_columns_and_lists_the_names_it_shortened():
    results = [made_up("shared/traces/gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle",
                       device=d, calls=(123456, 40, 987654), live=78 * GiB) for d in range(3)]
    results.append(made_up("random-3-streams-seed2"))
    table = format_table(results)
    assert max(len(line) for line in table.splitlines()) <= WIDTH
    assert [line.split()[:2] for line in table.splitlines()[3:]] == [
        ["constructor-sun", "0"], ["constructor-sun", "1"], ["constructor-sun", "2"], ["random-3-streams-seed2", "0"]]
    names = format_names(results).splitlines()
    assert names[1].split() == ["constructor-sun", "constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom"]
    assert len(names) == 2  # once each, and only the shortened ones
    assert max(len(line) for line in wrap(TABLE_LEGEND).splitlines()) <= WIDTH


# -- where pyalloc wins, ties and loses --------------------------------------

def test_verdicts_count_wins_ties_and_losses_and_name_the_losses():
    results = [
        made_up("a.pickle", budget=(1.00, 1.20, 1.10), reserved=(1.10, 1.30, 1.05), calls=(100, 20, 200)),
        made_up("b.pickle", budget=(1.00, 1.20, 1.004), reserved=(1.20, 1.30, 1.20), calls=(100, 20, 100)),
        made_up("c.pickle", budget=(1.02, 1.20, 1.00), reserved=(1.00, 1.30, 1.10), calls=(10, 20, 300)),
    ]
    budget, reserved, calls, loses = verdicts(results)
    assert budget == ("Budget: against PyTorch's allocator, pyalloc wins on all 3; against expandable segments, "
                      "it wins on 1, ties on 1 (b), loses on 1 (c: 1.020 against 1.000).")
    assert reserved == ("Uncapped reserved: against PyTorch's allocator, pyalloc wins on all 3; against "
                        "expandable segments, it wins on 1, ties on 1 (b), loses on 1 (a: 1.100 against 1.050).")
    assert calls == ("Driver calls: against PyTorch's allocator, pyalloc wins on 1, loses on 2 (a: 100 against 20, "
                     "b: 100 against 20); against expandable segments, it wins on 2, ties on 1 (b).")
    assert loses == ("Where pyalloc loses: budget against expandable segments on 1 of 3 (worst: c, 1.020 against "
                     "1.000); uncapped reserved against expandable segments on 1 of 3 (worst: a, 1.100 against "
                     "1.050); driver calls against PyTorch's allocator on 2 of 3 (worst: a, 100 against 20).")


def test_a_tie_is_within_the_budget_searchs_precision():
    from pyalloc.replay.result import BUDGET_PRECISION

    assert TIE == BUDGET_PRECISION
    just_in = made_up("t.pickle", budget=(1.0049, 1.0, 1.0), reserved=(1.0, 1.0, 1.0), calls=(10, 10, 10))
    assert verdicts([just_in])[0].startswith("Budget: against PyTorch's allocator, pyalloc ties (1.005 against")
    out = made_up("t.pickle", budget=(1.0060, 1.0, 1.0))
    assert verdicts([out])[-1].startswith("Where pyalloc loses: budget against PyTorch's allocator (1.006 against")


def test_verdicts_say_where_nothing_was_measured_and_where_pyalloc_never_loses():
    unsearched = made_up("u.pickle", budget=(None, None, None), reserved=(1.0, 1.1, 1.2), calls=(1, 2, 3))
    searched = made_up("s.pickle", budget=(1.0, 1.1, None), reserved=(1.0, 1.1, 1.2), calls=(1, 2, 3))
    budget, *_, last = verdicts([unsearched, searched])
    assert budget == ("Budget: against PyTorch's allocator, pyalloc wins on 1, has no figure to compare on 1; "
                      "against expandable segments, no figure to compare.")
    assert last == "pyalloc loses nowhere on these 2 traces and devices."


def test_verdicts_read_the_rows_of_the_json_too():
    r = made_up("x/y-z.pickle.gz", budget=(1.0, 1.2, 1.1), reserved=(1.3, 1.2, 1.1), calls=(5, 6, 7))
    assert verdicts([r.to_dict()]) == verdicts([r])
    assert "uncapped reserved against PyTorch's allocator (1.300 against 1.200)" in verdicts([r])[-1]


def test_several_devices_of_one_trace_are_told_apart_in_sentences():
    results = [made_up("big.pickle", device=d, calls=(50, 10, 60)) for d in range(2)]
    assert "(worst: big dev 0, 50 against 10)" in verdicts(results)[-1]


# -- the plot ----------------------------------------------------------------

def test_the_plot_has_the_three_measures_side_by_side():
    pytest.importorskip("matplotlib")
    from pyalloc.replay.report import comparison_figure

    results = [made_up("a.pickle", budget=(1.01, 1.2, 1.1), reserved=(1.3, 1.2, 1.1), calls=(500, 20, 200)),
               made_up("b.pickle", budget=(1.02, 1.3, 1.05), reserved=(1.1, 1.4, 1.2), calls=(30, 10, 90))]
    fig = comparison_figure(results)
    axes = fig.axes
    assert len(axes) == 3
    assert [ax.get_xscale() for ax in axes] == ["linear", "linear", "log"]
    assert "budget" in axes[0].get_xlabel() and "reserved" in axes[1].get_xlabel()
    assert "driver calls" in axes[2].get_xlabel()
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["pyalloc", "PyTorch default", "PyTorch expandable_segments"]

    def widths(ax):  # bar widths per allocator, traces in order
        bars = [p for p in ax.patches]
        return [[round(b.get_width(), 3) for b in bars[k * 2:(k + 1) * 2]] for k in range(3)]

    # Each panel draws each allocator's figure, the losses too: a's reserved and calls.
    assert widths(axes[0]) == [[1.01, 1.02], [1.2, 1.3], [1.1, 1.05]]
    assert widths(axes[1]) == [[1.3, 1.1], [1.2, 1.4], [1.1, 1.2]]
    assert widths(axes[2]) == [[500, 30], [20, 10], [200, 90]]


def test_the_sentences_and_the_plot_read_one_list_of_measures(monkeypatch):
    """A measure dropped from MEASURES leaves both the sentences and the plot."""
    pytest.importorskip("matplotlib")
    from pyalloc.replay import report as replay_report

    monkeypatch.setattr(replay_report, "MEASURES", replay_report.MEASURES[:2])
    results = [made_up("a.pickle", budget=(1.01, 1.2, 1.1), reserved=(1.0, 1.2, 1.1), calls=(500, 20, 200))]
    said = verdicts(results)
    assert [s.split(":")[0] for s in said] == ["Budget", "Uncapped reserved", "pyalloc loses nowhere on this trace."]
    axes = replay_report.comparison_figure(results).axes
    assert [ax.get_title() for ax in axes] == ["Equal budgets: the smallest device each completes on",
                                               "With no cap: peak reserved"]

# -- the verdict the out-of-memory recorder prints -----------------------------

def test_format_verdict_is_the_replays_sentence_and_the_command(tmp_path):
    import shlex

    from pyalloc.replay import replay_devices
    from pyalloc.replay.report import format_ooms, format_verdict
    from pyalloc.replay.snapshot_io import write_snapshot
    from test_replay_oom import cli, fragmented

    path = tmp_path / "a dir" / "rank0-dev0.pickle"
    path.parent.mkdir()
    write_snapshot(fragmented(), path)
    results = replay_devices(str(path), search=False)
    lines = format_verdict(results, str(path))
    # Within WIDTH columns, but for the command, which stays whole to be copied.
    assert 2 <= len(lines) <= 8 and all(len(line) <= WIDTH for line in lines[:-1])
    assert lines[-1].endswith("pyalloc replay " + shlex.quote(str(path)))
    assert shlex.split(lines[-1][lines[-1].index("pyalloc replay"):]) == ["pyalloc", "replay", str(path)]
    # The same figures as `pyalloc replay` prints: its sentence, line for line.
    printed = format_ooms(replay_devices(str(path), search=True)).splitlines()
    assert lines[:len(printed)] == printed
    p = cli(path)  # the command the verdict names, run as it says
    assert p.returncode == 0, p.stderr
    assert "\n".join(printed) in p.stdout
    # And those figures are the recorded_ooms' (JSON): what was reserved, each allocator's margin.
    [oom] = results[0].recorded_ooms
    said = " ".join(line.strip() for line in lines)
    need = oom["min_capacity_bytes"]
    assert (oom["reserved_bytes"], oom["unused_bytes"], oom["largest_free_block_bytes"]) == \
        (100 << 20, 50 << 20, 2 << 20)
    assert ("100.00 MiB reserved, 50.00 MiB of it not live, the largest free block of its pool and stream "
            "2.00 MiB") in said
    assert f"pyalloc ({format_bytes(oom['capacity_bytes'] - need['pyalloc'])} to spare) would have served it" in said
    if need["native"] is not None:
        assert f"PyTorch ({format_bytes(need['native'] - oom['capacity_bytes'])} short)" in said


def test_format_verdict_of_an_inferred_cap_and_of_many_errors(tmp_path):
    from pyalloc.replay import replay_devices
    from pyalloc.replay.report import VERDICT_LINES, format_ooms, format_verdict
    from test_replay_oom import full_segments, oom_event

    [r] = replay_devices(full_segments(), search=False)
    lines = format_verdict([r], "cap.pickle")
    said = " ".join(line.strip() for line in lines)
    assert "not fragmentation: 116.00 MiB needed on 100.00 MiB (16.00 MiB short)" in said
    assert ("a cap was in force: 40.00 GiB free on the device, more than the 16.00 MiB segment it wanted; "
            "taken as the 100.00 MiB reserved (it lay below 116.00 MiB)") in said
    # Three errors, then the one the snapshot was taken at: that one, and a count of the others.
    snapshot = full_segments()
    snapshot["device_traces"][0][-1:-1] = [oom_event(64 << 20, 1 << 20) for _ in range(3)]
    results = replay_devices(snapshot, search=False)
    lines = format_verdict(results, "cap.pickle")
    assert len(lines) <= VERDICT_LINES and all(len(line) <= WIDTH for line in lines)
    last = format_ooms(results).splitlines()
    assert lines[0].startswith("<snapshot>, event 58: a 16.00 MiB allocation")
    assert lines[0] in last
    assert lines[-2] == "  (3 more out-of-memory error(s) in this file: pyalloc replay lists each)"
    assert lines[-1] == "to replay it again, with the table and every error: pyalloc replay cap.pickle"


def test_format_verdict_says_nothing_without_an_oom():
    from pyalloc.replay import replay_devices
    from pyalloc.replay.report import format_verdict
    from test_replay_oom import ev, free

    clean = {"segments": [], "device_traces": [[ev("alloc", 1, 10)] + free(1, 10)]}
    assert format_verdict(replay_devices(clean, search=False), "clean.pickle") == []
