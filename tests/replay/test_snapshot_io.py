"""Loading memory snapshots safely: round trips, and every kind of bad file
ending in one TraceError that names the file, with nothing in the file run."""
import glob
import gzip
import os
import pickle
import pickletools

import pytest

from pyalloc.replay.snapshot_io import (
    ALLOC,
    FREE_COMPLETED,
    OTHER,
    TraceError,
    devices_of,
    load_snapshot,
    memory_fraction,
    read_trace,
    write_snapshot,
)
from shared_dir import SHARED_DIR


def event(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0, "frames": []}


SNAPSHOT = {
    "segments": [],
    "device_traces": [[event("alloc", 4096, 100), event("free_requested", 4096, 100),
                       event("free_completed", 4096, 100)]],
}


def open_head(path):
    with open(path, "rb") as f:
        return f.read(2)


def write_bytes(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def assert_one_line_error(path, match, **kwargs):
    with pytest.raises(TraceError) as info:
        load_snapshot(path, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
    assert match in message, message
    return message


# -- round trips -------------------------------------------------------------


@pytest.mark.parametrize("name", ["s.pickle", "s.pickle.gz"])
def test_write_then_load_gives_the_same_snapshot(tmp_path, name):
    path = str(tmp_path / name)
    write_snapshot(SNAPSHOT, path)
    assert load_snapshot(path) == SNAPSHOT
    assert (open_head(path) == b"\x1f\x8b") == name.endswith(".gz")


def test_gzip_is_recognised_by_content_not_name(tmp_path):
    path = write_bytes(tmp_path, "plain-name.pickle", gzip.compress(pickle.dumps(SNAPSHOT)))
    assert load_snapshot(path) == SNAPSHOT


def test_gzip_output_is_reproducible(tmp_path):
    a, b = tmp_path / "a.pickle.gz", tmp_path / "b.pickle.gz"
    write_snapshot(SNAPSHOT, a)
    write_snapshot(SNAPSHOT, b)
    assert a.read_bytes() == b.read_bytes()


def test_progress_reports_every_byte(tmp_path):
    path = str(tmp_path / "s.pickle.gz")
    write_snapshot(SNAPSHOT, path)
    seen = []
    load_snapshot(path, progress=seen.append)
    assert sum(seen) == os.path.getsize(path)


# -- bad files ---------------------------------------------------------------


def test_missing_file(tmp_path):
    assert_one_line_error(str(tmp_path / "nope.pickle"), "cannot open")


def test_directory(tmp_path):
    assert_one_line_error(str(tmp_path), "cannot open")


def test_empty_file(tmp_path):
    assert_one_line_error(write_bytes(tmp_path, "e.pickle", b""), "empty")


def test_not_a_pickle(tmp_path):
    assert_one_line_error(write_bytes(tmp_path, "t.pickle", b"hello world\n" * 10), "not a pickle")


def test_json_instead_of_pickle(tmp_path):
    assert_one_line_error(write_bytes(tmp_path, "j.pickle", b'{"segments": []}'), "not a pickle")


def test_truncated_pickle(tmp_path):
    data = pickle.dumps(SNAPSHOT, protocol=4)
    assert_one_line_error(write_bytes(tmp_path, "t.pickle", data[: len(data) // 2]), "truncated")


def test_truncated_gzip(tmp_path):
    data = gzip.compress(pickle.dumps(SNAPSHOT))
    assert_one_line_error(write_bytes(tmp_path, "t.pickle.gz", data[:-12]), "truncated")


def test_gzip_garbage(tmp_path):
    data = b"\x1f\x8b" + bytes(range(256)) * 4
    assert_one_line_error(write_bytes(tmp_path, "g.pickle.gz", data), "gzip")


def test_decompressed_size_is_capped(tmp_path):
    bomb = gzip.compress(pickle.dumps({"segments": [], "device_traces": [[0] * 200_000]}))
    path = write_bytes(tmp_path, "b.pickle.gz", bomb)
    assert_one_line_error(path, "decompresses to more than 10000 bytes", max_bytes=10_000)
    assert load_snapshot(path)  # well within the default cap


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Plain:
    pass


def test_a_pickle_that_calls_os_system_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps({"segments": [], "device_traces": [[RunsACommand(marker)]]})
    message = assert_one_line_error(write_bytes(tmp_path, "evil.pickle", data), "refused")
    assert "system" in message
    assert not marker.exists()


def test_a_pickle_that_calls_eval_is_refused(tmp_path):
    # Protocol 0 by hand: builtins.eval("...") via GLOBAL + REDUCE.
    data = b"cbuiltins\neval\n(S'__import__(\"os\").getcwd()'\ntR."
    assert [op.name for op, _, _ in pickletools.genops(data)][-2:] == ["REDUCE", "STOP"]
    assert_one_line_error(write_bytes(tmp_path, "eval.pickle", data), "builtins.eval")


def test_any_class_is_refused_even_a_harmless_one(tmp_path):
    data = pickle.dumps({"segments": [], "device_traces": [[Plain()]]})
    assert_one_line_error(write_bytes(tmp_path, "c.pickle", data), "refused")


def test_persistent_ids_are_refused(tmp_path):
    data = b"\x80\x02P0\n."  # PERSID "0"
    assert_one_line_error(write_bytes(tmp_path, "p.pickle", data), "persistent")


# Everything a pickle of plain data can hold, so that every opcode's argument is stepped over.
RICH = {
    "short": "x", "long": "y" * 300, "bytes": b"z" * 70000, "small_bytes": b"ab", "ints": [0, 7, 300, -2**31,
    2**70, -(10**40)], "float": 2.5, "flags": (None, True, False), "tuple": (1,), "pair": (1, 2),
    "triple": (1, 2, 3), "set": {1, 2}, "frozen": frozenset([3]), "array": bytearray(b"q" * 10),
    "unicode": "\u00e9\n\u4e2d" * 100, "nested": [[{"a": [()]}]],
}
RICH["again"] = [RICH["nested"], RICH["long"]]  # memo gets


def _store_at(index, protocol):
    """A memo store at `index`: PUT for the text protocol, LONG_BINPUT for the others."""
    return b"p%d\n" % index if protocol == 0 else b"r" + index.to_bytes(4, "little")


def scan(data, chunk=None, limit=None, memory=None):
    """The pass over `data`, fed `chunk` bytes more at each call (all at once by default)."""
    from pyalloc import _C

    state = _C.PickleScan(*([(1 << 64) - 1 if limit is None else limit] + ([memory] if memory else [])))
    step = chunk or max(len(data), 1)
    for end in range(step, len(data) + step, step):
        _C.scan_pickle(data[:end], state)
        if state.end:
            break
    return state


WILD = 1 << 27  # a memo index no pickler writes near the start: 2 GiB of memo


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("chunk", [None, 1, 7, 4096])
def test_every_opcode_of_plain_data_is_stepped_over_and_a_wild_memo_index_found_after_them(protocol, chunk):
    data = pickle.dumps(RICH, protocol=protocol)
    state = scan(data, chunk)
    assert (state.end, state.why, state.done) == (True, "", len(data))  # up to its STOP, in any chunks
    assert pickle.loads(data) == RICH
    # A store at an index no pickler would write, after every opcode of the pickle: the
    # pass finds it only by stepping over each of them.
    bad = data[:-1] + _store_at(WILD, protocol) + b"."
    state = scan(bad, chunk)
    assert state.end and state.why.startswith(f"stores memo entry {WILD} at byte {len(data) - 1} after ")


@pytest.mark.parametrize("op", [op for op in pickletools.opcodes if op.name != "STOP"], ids=lambda op: op.name)
def test_each_opcodes_argument_is_stepped_over_as_pickletools_lays_it_out(op):
    # An argument of each kind pickletools knows (a byte of data where it takes a length),
    # then a wild memo store: found only if the argument was stepped over exactly.
    n = op.arg.n if op.arg is not None else 0
    if n > 0:
        arg = b"\0" * n
    elif n == pickletools.UP_TO_NEWLINE:
        arg = b"a\nb\n" if op.arg.name == "stringnl_noescape_pair" else b"0\n"
    elif n == pickletools.TAKEN_FROM_ARGUMENT1:
        arg = b"\x01A"
    elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
        arg = (1).to_bytes(4, "little") + b"A"
    else:
        assert n in (0, pickletools.TAKEN_FROM_ARGUMENT8U), op
        arg = (1).to_bytes(8, "little") + b"A" if n else b""
    data = b"\x80\x05" + op.code.encode("latin-1") + arg + b"r" + WILD.to_bytes(4, "little") + b"."
    assert scan(data).why.startswith(f"stores memo entry {WILD} at byte {3 + len(arg)} after "), op.name


@pytest.mark.parametrize("put", [b"p+16777216\n", b"p 16777216\n", b"p16_777_216\n", b"p16777216 \n",
                                 b"p99999999999999999999999\n"])
def test_a_text_memo_index_written_as_no_pickler_writes_it_is_refused(tmp_path, put):
    # CPython's unpickler reads a sign, spaces and '_' in PUT's index too: 542 MB for 15 bytes.
    data = b"\x80\x02}" + put + b"."
    assert_one_line_error(write_bytes(tmp_path, "p.pickle", data),
                          "refused: the pickle stores a memo entry at byte 3 whose index is not plain decimal digits")


def test_reading_stops_at_the_pickles_stop(tmp_path):
    # A snapshot followed by 64 MiB of zeros (64 KiB once compressed): only the chunk
    # holding its STOP is read, as the unpickler alone read no further than STOP.
    from pyalloc.replay import snapshot_io

    data = pickle.dumps(SNAPSHOT, protocol=4)
    path = write_bytes(tmp_path, "s.pickle.gz", gzip.compress(data + bytes(64 << 20)))
    assert load_snapshot(path) == SNAPSHOT
    with gzip.open(path) as f:
        read = snapshot_io._read_scanned(snapshot_io._CappedReader(f, 1 << 30), 1 << 30)
    assert bytes(read[:len(data)]) == data and len(read) <= 1 << 20


def test_an_argument_longer_than_the_file_may_be_ends_the_reading(tmp_path):
    # BINBYTES8 of 2^40 bytes, then zeros: refused as truncated without reading to the cap.
    data = b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + bytes(8 << 20)
    state = scan(data[:1 << 20], limit=len(data))
    assert state.end and state.why == f"an argument at byte 2 of {1 << 40} bytes is longer than the file: truncated"
    assert_one_line_error(write_bytes(tmp_path, "t.pickle.gz", gzip.compress(data)),
                          "truncated pickle: the file ends too early", max_bytes=64 << 20)


@pytest.mark.parametrize("name", ["sets.pickle.gz", "dicts.pickle.gz"])
def test_a_small_file_that_would_build_more_objects_than_memory_allows_is_refused_early(tmp_path, name):
    # 4 MiB of EMPTY_SET (or EMPTY_DICT) compresses to 4 KiB and builds 900 MB (270 MB)
    # of objects on the unpickler's stack: refused once the least they take passes
    # max_memory, a few hundred thousand opcodes in.
    op = b"\x8f" if name.startswith("sets") else b"}"
    path = write_bytes(tmp_path, name, gzip.compress(b"\x80\x04" + op * (4 << 20) + b"."))
    assert os.path.getsize(path) < 16 << 10
    message = assert_one_line_error(path, "refused: the pickle takes at least ", max_memory=64 << 20)
    assert message.endswith("), more than the 67108864 bytes it may take"), message
    at = int(message.split(" by byte ")[1].split(")")[0])
    assert at < 2 << 20, at  # in the first chunks read


def test_an_argument_too_large_for_the_memory_is_refused_before_its_bytes_are_read(tmp_path):
    # 400 MiB of bytes in one argument (400 KB once compressed), 10 MB allowed.
    from pyalloc.replay import snapshot_io

    data = b"\x80\x04\x8e" + (400 << 20).to_bytes(8, "little") + bytes(400 << 20) + b"."
    path = write_bytes(tmp_path, "big.pickle.gz", gzip.compress(data, compresslevel=1))
    assert_one_line_error(path, "refused: the pickle takes at least ", max_memory=10 << 20)
    with gzip.open(path) as f:
        with pytest.raises(pickle.UnpicklingError, match="takes at least "):
            snapshot_io._read_scanned(snapshot_io._CappedReader(f, 1 << 40), 1 << 40, 10 << 20)
        assert f.tell() <= 1 << 20  # the first chunk: its length alone was too much


def test_a_memo_grown_by_repeated_stores_counts_as_cpython_sizes_it():
    # Stores at 0, a million times (2 MB), then one at 2 million: CPython's memo takes
    # 32 MB for it, which the pass counts, so 16 MiB refuses it and 64 MiB does not.
    data = b"\x80\x02N" + b"q\x00" * 1_000_000 + b"r" + (2_000_000).to_bytes(4, "little") + b"."
    assert scan(data, limit=len(data)).why == ""
    refused = scan(data, 1 << 20, memory=16 << 20)
    assert refused.why.startswith("takes at least ") and refused.why.endswith(" more than the 16777216 bytes it may take")
    assert scan(data, 1 << 20, memory=64 << 20).why == ""


SHARED_TRACES = sorted(glob.glob(os.path.join(SHARED_DIR, "traces", "**", "*.pickle"), recursive=True))


# Objects CPython takes less memory for than their pickle's bytes suggest: characters
# of two or three UTF-8 bytes (one or two in memory), escapes of a text pickle, ints
# written as digits, objects it shares (strings and bytes of one character, the empty
# tuple, small ints).
EDGE = {"latin": ["\u00e9" * k for k in range(1, 200, 7)], "cjk": ["\u4e2d" * k for k in range(1, 200, 7)],
        "big": [2**47 + k for k in range(50)] + [10**200, -(10**90)], "shared": ["", "a", "\u00e9", b"", b"b", (),
        0, 1, 255, -5, 300], "empty": [[(), ()] for _ in range(50)]}


@pytest.mark.parametrize("source", ["rich-%d" % p for p in range(pickle.HIGHEST_PROTOCOL + 1)] +
                         ["edge-%d" % p for p in range(pickle.HIGHEST_PROTOCOL + 1)] +
                         [pytest.param(os.path.basename(p), marks=pytest.mark.shared) for p in SHARED_TRACES])
def test_the_least_memory_the_pass_counts_is_no_more_than_loading_takes(source):
    # A lower bound: a snapshot that loads in the memory there is is never refused for it.
    import tracemalloc

    from pyalloc import _C

    if source.startswith(("rich-", "edge-")):
        data = pickle.dumps(RICH if source.startswith("rich") else EDGE, protocol=int(source.split("-")[1]))
    else:
        with open(next(p for p in SHARED_TRACES if os.path.basename(p) == source), "rb") as f:
            data = f.read()
    state = _C.PickleScan()
    _C.scan_pickle(data, state)
    assert state.end and not state.why and state.objects > 0
    tracemalloc.start()
    try:
        loaded = pickle.loads(data)
        _, peak = tracemalloc.get_traced_memory()  # the memo's slots are gone once loaded
    finally:
        tracemalloc.stop()
    del loaded
    assert state.objects <= peak, (state.objects, peak)


@pytest.mark.parametrize("name", ["m.pickle", "m.pickle.gz"])
def test_a_memo_index_far_past_the_entries_stored_is_refused_before_the_unpickler_reads_it(tmp_path, name):
    # Nine bytes: CPython's unpickler would take 2 GiB for this memo (16 GiB at 2^30).
    data = b"\x80\x04}r" + (1 << 27).to_bytes(4, "little") + b"."
    if name.endswith(".gz"):
        data = gzip.compress(data)
    message = assert_one_line_error(write_bytes(tmp_path, name, data), "refused: the pickle stores memo entry "
                                    "134217728 at byte 3 after 0 entries")
    assert "pickler numbers its memo in order" in message


def test_memo_indices_a_little_out_of_order_still_load(tmp_path):
    # Stores at 5 first and at 0 last, a short way past the entries stored (a pickler writes
    # 0 to 5 in order): a little slack costs nothing and refuses nothing real.
    data = pickle.dumps({"device_traces": [[]], "segments": []}, protocol=2)
    data = data.replace(b"}q\x00", b"}q\x05", 1).replace(b"]q\x05u", b"]q\x00u", 1)
    assert data.count(b"q\x05") == 1 and data.index(b"q\x05") < data.index(b"q\x00")
    assert pickle.loads(data) == {"device_traces": [[]], "segments": []}
    assert load_snapshot(write_bytes(tmp_path, "ok.pickle", data)) == {"device_traces": [[]], "segments": []}


@pytest.mark.parametrize(
    "obj, match",
    [
        ([1, 2, 3], "not a memory snapshot"),
        ({"allocator_settings": {}}, "neither 'segments' nor 'device_traces'"),
        ({"device_traces": "abc"}, "'device_traces' must be a list"),
        ({"device_traces": [{"a": 1}]}, "'device_traces' must be a list"),
        ({"device_traces": [[]], "segments": 5}, "'segments' must be a list"),
    ],
)
def test_wrong_structure(tmp_path, obj, match):
    assert_one_line_error(write_bytes(tmp_path, "w.pickle", pickle.dumps(obj)), match)


# -- reduction to arrays -----------------------------------------------------


def read(tmp_path, snapshot, **kwargs):
    path = str(tmp_path / "s.pickle")
    write_snapshot(snapshot, path)
    return read_trace(path, **kwargs)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("not a dict", "an event must be a dict"),
        ({"action": 7, "addr": 1, "size": 1}, "'action' must be a string"),
        ({"action": "alloc", "addr": -1, "size": 1}, "'addr' must be an address"),
        ({"action": "alloc", "addr": True, "size": 1}, "'addr' must be an address"),
        ({"action": "alloc", "size": 1}, "'addr' must be an address"),
        ({"action": "alloc", "addr": 1, "size": "big"}, "'size' must be a byte count"),
        ({"action": "alloc", "addr": 1, "size": -5}, "'size' must be a byte count"),
        ({"action": "alloc", "addr": 1, "size": 2**70}, "'size' must be a byte count"),
        ({"action": "free_completed", "addr": 1, "size": 1, "stream": 1.5}, "'stream'"),
    ],
)
def test_bad_events_are_named(tmp_path, bad, match):
    snapshot = {"segments": [], "device_traces": [[event("alloc", 1, 1), bad]]}
    with pytest.raises(TraceError, match=match) as info:
        read(tmp_path, snapshot)
    assert "device_traces[0][1]" in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "s.pickle"))


@pytest.mark.parametrize(
    "segment, match",
    [
        ("x", "a segment must be a dict"),
        ({"total_size": "x", "blocks": []}, "'total_size'"),
        ({"total_size": 10, "blocks": 3}, "'blocks' must be a list"),
        ({"total_size": 10, "blocks": [{"state": "active_allocated", "address": 1, "size": None}]},
         "'size'"),
    ],
)
def test_bad_segments_are_named(tmp_path, segment, match):
    with pytest.raises(TraceError, match=match):
        read(tmp_path, {"segments": [segment], "device_traces": [[]]})


def test_events_become_arrays(tmp_path):
    snapshot = {
        "segments": [],
        "device_traces": [[event("alloc", 10, 5, stream=-1), {"action": "snapshot"},
                           event("free_completed", 10, 5, stream=-1), {"action": "oom", "device_free": 0},
                           {"action": "something_new"}]],
    }
    t = read(tmp_path, snapshot)
    assert len(t) == 5
    assert list(t.actions)[:3] == [ALLOC, OTHER, FREE_COMPLETED]
    assert t.streams[0] == 2**64 - 1  # a negative handle, as unsigned
    assert t.ignored_actions == {"snapshot": 1, "something_new": 1}


def test_device_defaults_to_the_busiest_and_can_be_chosen(tmp_path):
    snapshot = {"segments": [], "device_traces": [[event("alloc", 1, 1)], [event("alloc", 1, 1)] * 3]}
    assert read(tmp_path, snapshot).device == 1
    assert read(tmp_path, snapshot, device=0).device == 0
    with pytest.raises(TraceError, match="no device 5"):
        read(tmp_path, snapshot, device=5)


def test_live_blocks_of_the_device_with_requested_size(tmp_path):
    blocks = [
        {"address": 100, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
        {"address": 1124, "size": 512, "requested_size": 7, "state": "active_pending_free"},
        {"address": 1636, "size": 512, "requested_size": 0, "state": "inactive"},
        {"address": 2148, "size": 512, "state": "active_allocated"},  # before torch 2.1
    ]
    snapshot = {
        "segments": [
            {"device": 0, "address": 100, "total_size": 2 << 20, "stream": 3, "blocks": blocks},
            {"device": 1, "address": 900, "total_size": 2 << 20, "stream": 0,
             "blocks": [{"address": 900, "size": 512, "requested_size": 1, "state": "active_allocated"}]},
        ],
        "device_traces": [[], []],
    }
    t = read(tmp_path, snapshot, device=0)
    assert t.live_blocks == [(100, 1000, 3), (1124, 7, 3), (2148, 512, 3)]
    assert (t.segments, t.segments_bytes) == (1, 2 << 20)


def test_devices_with_segments_but_no_trace_list_are_devices():
    """Regression: only devices below len(device_traces) were looked at, so the
    segments of a device without a trace list were neither a row nor readable."""
    seg = {"device": 2, "address": 900, "total_size": 2 << 20, "stream": 0,
           "blocks": [{"address": 900, "size": 512, "requested_size": 100, "state": "active_allocated"}]}
    snapshot = {"segments": [seg], "device_traces": [[event("alloc", 1, 1)]]}
    assert devices_of(snapshot) == [0, 2]
    assert devices_of({"segments": [seg], "device_traces": []}) == [2]
    t = read_trace(snapshot, 2)
    assert (len(t), t.device, t.segments, t.live_blocks) == (0, 2, 1, [(900, 100, 0)])
    with pytest.raises(TraceError, match="no device 3"):
        read_trace(snapshot, 3)


def test_memory_fraction_from_the_recorded_allocator_settings():
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, per_process_memory_fraction: 0.8"}
    assert memory_fraction({"allocator_settings": conf}) == 0.8
    assert memory_fraction({"allocator_settings": {**conf, "per_process_memory_fraction": 0.6}}) == 0.6
    # Torch 2.13 writes no such key today; nothing recorded, nothing assumed.
    assert memory_fraction({"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1}}) is None
    assert memory_fraction({"segments": [], "device_traces": []}) is None


def test_a_loaded_dict_is_checked_too():
    with pytest.raises(TraceError, match="<snapshot>: not a memory snapshot: neither 'segments' nor 'device_traces'"):
        read_trace({"allocator_settings": {}})
