"""Reading and writing PyTorch memory snapshots, safely.

A memory snapshot is the dict ``torch.cuda.memory._snapshot()`` returns, pickled
by ``torch.cuda.memory._dump_snapshot`` (section 3 of the snapshot format:
``segments`` and one trace per device in ``device_traces``). Files come from
users, so they are read with an unpickler that refuses every class: a snapshot
holds only dicts, lists, tuples, strings and numbers, and a pickle that names a
class or function (``os.system``...) is rejected before anything runs. Gzip is
detected by its magic bytes, decompressed output is capped, memo indices no
pickler would write are refused before CPython's unpickler sizes its memo by them
(nine bytes could take gigabytes: csrc/replay/pickle_scan.h), a pickle whose
objects would take more memory than is available is refused before they are
built, and every field the replay uses is checked, so a bad file ends in one
``TraceError`` naming the file and the problem.

Current PyTorch also writes snapshots with no ``device_traces`` (taken with
``include_traces=False``: final segments only), pinned host memory in
``host_segments`` and ``host_traces`` (``record_pinned_host_memory=True``), and a
compile context on each entry. All are read: the host data is counted and left
aside (a replay is of device memory), extra keys of an entry are ignored, and a
device with no event at all is a trace without history (``Trace.has_history``),
which a replay refuses rather than judge a run by its final blocks.

``read_trace`` reduces a snapshot to what a replay needs: the events of one
device as flat integer arrays, the blocks that are live in its final
segments, and the out-of-memory errors the device recorded (PyTorch's ``oom``
event carries the size of the block it could not get: the request rounded up
as its allocator rounds it, not the bytes asked for). An ``oom`` event
that cannot be read (no size, a negative one, no ``device_free``...) is left
out of those and counted, rather than failing the whole replay over it.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import reprlib
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple, Union

from .. import _C
from .settings import TorchSettings, torch_settings

__all__ = [
    "ACTIONS",
    "MAX_SNAPSHOT_BYTES",
    "Trace",
    "TraceError",
    "check_snapshot",
    "device_traces",
    "devices_of",
    "load_snapshot",
    "recorded_device_total",
    "memory_fraction",
    "read_trace",
    "write_snapshot",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Decompressed size past which a file is refused (a gzip bomb, or not a snapshot).
MAX_SNAPSHOT_BYTES = 16 << 30

# Event codes in Trace.actions, by PyTorch's trace action names. OTHER stands for
# entries a replay ignores ("snapshot", "user_defined", actions of newer releases).
ALLOC, FREE_REQUESTED, FREE_COMPLETED = 0, 1, 2
SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = 3, 4, 5, 6
OOM, OTHER = 7, 8

ACTIONS: Dict[str, int] = {
    "alloc": ALLOC,
    "free_requested": FREE_REQUESTED,
    "free_completed": FREE_COMPLETED,
    "segment_alloc": SEGMENT_ALLOC,
    "segment_free": SEGMENT_FREE,
    "segment_map": SEGMENT_MAP,
    "segment_unmap": SEGMENT_UNMAP,
    "oom": OOM,
}

_U64 = 1 << 64
_MAX_SIZE = 1 << 63
_ACTIVE_STATES = ("active_allocated", "active_pending_free")
#: Unreadable oom events whose problem a Trace keeps (all are counted).
_OOM_PROBLEMS_KEPT = 10
_GZIP_MAGIC = b"\x1f\x8b"

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40


class TraceError(ValueError):
    """A trace that cannot be replayed. The message is one line: "FILE: problem"."""


# ---------------------------------------------------------------------------
# Loading


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; refuses everything else."""

    def find_class(self, module: str, name: str) -> Any:
        # Every route to a class or callable (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*)
        # comes through here, so refusing here means nothing in the file can run.
        raise pickle.UnpicklingError(
            f"refers to {_short.repr(module)[1:-1]}.{_short.repr(name)[1:-1]}; "
            "a memory snapshot holds only plain data, so classes and functions are refused"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("uses persistent ids, which a memory snapshot never does")


class _TooLarge(Exception):
    pass


class _CappedReader:
    """A read-only view of a binary stream that raises _TooLarge past `limit` bytes."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self._f = f
        self._left = limit

    def read(self, n: Optional[int] = -1) -> bytes:
        want = self._left + 1 if n is None or n < 0 else min(n, self._left + 1)
        data = self._f.read(want)
        self._left -= len(data)
        if self._left < 0:
            raise _TooLarge()
        return data


class _Progress:
    """Passes reads through to a file and reports how many bytes were read."""

    def __init__(self, f: BinaryIO, report: Callable[[int], None]) -> None:
        self._f = f
        self._report = report

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._report(len(data))
        return data



def load_snapshot(
    path: PathLike,
    *,
    max_bytes: int = MAX_SNAPSHOT_BYTES,
    progress: Optional[Callable[[int], None]] = None,
    max_memory: Optional[int] = None,
) -> Dict[str, Any]:
    """Loads a memory snapshot (``.pickle`` or gzip-compressed ``.pickle.gz``).

    Only plain data is built; a file that names any class or function, is
    truncated, is not a pickle, decompresses to more than ``max_bytes``, would
    take more than ``max_memory`` bytes to load (by default the memory available
    now), or is not a snapshot dict raises TraceError("PATH: problem").
    ``progress`` is called with the number of file bytes read, as they are read.
    """
    name = os.fspath(path)
    try:
        f = open(name, "rb")
    except OSError as e:
        raise TraceError(f"{name}: cannot open: {e.strerror or e}") from None
    with f:
        head = f.read(2)
        f.seek(0)
        if not head:
            raise TraceError(f"{name}: the file is empty")
        compressed = head == _GZIP_MAGIC
        raw: Any = _Progress(f, progress) if progress is not None else f
        stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
        try:
            # Uncompressed, the pickle is no longer than its file.
            limit = max_bytes if compressed else min(max_bytes, os.fstat(f.fileno()).st_size)
            memory = available_memory() if max_memory is None else max_memory
            blob = _read_scanned(_CappedReader(stream, max_bytes), limit, memory)
            unread = io.BytesIO(blob)  # a copy: the reader's goes before any object is built
            del blob
            data = _PlainDataUnpickler(unread).load()
        except _TooLarge:
            what = "decompresses to" if compressed else "is"
            raise TraceError(
                f"{name}: {what} more than {max_bytes} bytes; not a memory snapshot this "
                "tool will read"
            ) from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise TraceError(f"{name}: corrupt gzip data ({_one_line(e)})") from None
        except EOFError:
            kind = "gzip stream" if compressed else "pickle"
            raise TraceError(f"{name}: truncated {kind}: the file ends too early") from None
        except pickle.UnpicklingError as e:
            problem = _pickle_problem(e, head, compressed)
            if max_memory is None and "bytes of memory to load" in problem:
                problem += " (the memory available now; load_snapshot(max_memory=...) sets another)"
            raise TraceError(f"{name}: {problem}") from None
        except MemoryError:
            raise TraceError(f"{name}: the pickle asks for more memory than there is") from None
        except Exception as e:  # the unpickler's other complaints about malformed input
            raise TraceError(
                f"{name}: not a valid pickle ({type(e).__name__}: {_one_line(e)})"
            ) from None
    check_snapshot(data, name)
    return data


def available_memory() -> Optional[int]:
    """The memory this process may still take: the machine's available memory
    (Linux's MemAvailable, else its physical memory), or less where a cgroup (a
    container) caps it; None if none of these is known."""
    found: List[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):
            pass
    try:  # cgroup v2: the cap, less what the group holds
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(cap) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _read_scanned(reader: "_CappedReader", limit: int, memory: Optional[int] = None,
                  chunk: int = 1 << 20) -> bytearray:
    """The pickle's bytes, read a chunk at a time up to its STOP (or an opcode the
    unpickler will refuse), each chunk's opcodes checked first (csrc/replay/
    pickle_scan.h): CPython's unpickler sizes its memo by the largest index stored,
    so nine bytes could ask for gigabytes, and one byte can build a 216-byte set,
    so a small compressed file can build more than ``memory`` bytes of objects.
    Raises UnpicklingError saying why."""
    data = bytearray()
    scan = _C.PickleScan(limit, (1 << 64) - 1 if memory is None else memory)
    while not scan.end:
        more = reader.read(chunk)
        if not more:
            break  # the unpickler finds what is missing
        data += more
        _C.scan_pickle(data, scan)
    if scan.why:
        raise pickle.UnpicklingError(scan.why)
    return data


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200] if text else type(e).__name__


def _pickle_problem(e: pickle.UnpicklingError, head: bytes, compressed: bool) -> str:
    text = _one_line(e)
    if text.startswith(("refers to ", "uses persistent", "stores memo entry ", "stores a memo entry ",
                        "takes at least ")):
        return "refused: the pickle " + text
    if "truncated" in text:
        return "truncated pickle: the file ends too early"
    if not compressed and head[:1] != b"\x80":
        return f"not a pickle or gzip file (it starts with {head!r}): {text}"
    return f"not a valid pickle: {text}"


def check_snapshot(data: Any, name: str) -> None:
    """The top-level layout of a memory snapshot, or TraceError. A snapshot taken
    without traces (no ``device_traces``) is one; a dict with neither
    ``segments`` nor ``device_traces`` is not."""
    if not isinstance(data, dict):
        raise TraceError(
            f"{name}: not a memory snapshot: the pickle holds a {type(data).__name__}, "
            "not a dict with 'segments' and 'device_traces'"
        )
    if "device_traces" not in data and "segments" not in data:
        raise TraceError(
            f"{name}: not a memory snapshot: neither 'segments' nor 'device_traces' (was it "
            "written by torch.cuda.memory._dump_snapshot()?)"
        )
    traces = data.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceError(f"{name}: 'device_traces' must be a list of lists of events")
    for key in ("segments", "host_segments", "host_traces"):
        if not isinstance(data.get(key, []), list):
            raise TraceError(f"{name}: '{key}' must be a list")


def device_traces(snapshot: Dict[str, Any]) -> List[List[Any]]:
    """A checked snapshot's event lists, one a device ([] where it was taken without them)."""
    return snapshot.get("device_traces", [])


def _host_counts(snapshot: Dict[str, Any]) -> Tuple[int, int]:
    """(host segments, host events) of a checked snapshot; host_traces is one list of
    events, or a list of them."""
    traces = snapshot.get("host_traces", [])
    events = sum(len(t) if isinstance(t, list) else 1 for t in traces)
    return len(snapshot.get("host_segments", [])), events


def write_snapshot(snapshot: Dict[str, Any], path: PathLike) -> None:
    """Writes a snapshot as torch does (a pickle); gzip-compressed if the name ends in .gz."""
    name = os.fspath(path)
    data = pickle.dumps(snapshot, protocol=4)
    if name.endswith(".gz"):
        # No name and mtime 0 in the header: the same snapshot always gives the same bytes.
        with open(name, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
            f.write(data)
    else:
        with open(name, "wb") as f:
            f.write(data)


# ---------------------------------------------------------------------------
# Reduction to arrays


@dataclass
class Trace:
    """One device's events from a snapshot, as flat arrays (index = event order).

    ``actions`` holds the codes of ``ACTIONS`` (OTHER for entries a replay
    ignores); ``addrs``, ``sizes`` (bytes; the requested size for alloc/free)
    and ``streams`` are 0 where an action has none. ``live_blocks`` are the
    final segments' active blocks as (address, requested bytes, stream).
    ``ooms`` are the device's ``oom`` events as (event index, bytes, device_free
    bytes, stream), the bytes being what PyTorch records: the failed request
    rounded up to its block size (``params.size()``), not the bytes requested;
    ``skipped_ooms`` counts those that could not be
    read, and ``oom_problems`` says why for the first few.
    """

    name: str
    device: int
    actions: array
    addrs: array
    sizes: array
    streams: array
    live_blocks: List[Tuple[int, int, int]] = field(default_factory=list)
    segments: int = 0
    segments_bytes: int = 0
    #: The final segments: (address, total bytes, stream, small pool, expandable).
    segment_list: List[Tuple[int, int, int, bool, bool]] = field(default_factory=list)
    #: The final segments' free ("inactive") blocks: (bytes, stream, small pool); one
    #: whose size is not a byte count is left out (only a figure of the verdict uses them).
    free_blocks: List[Tuple[int, int, bool]] = field(default_factory=list)
    ignored_actions: Dict[str, int] = field(default_factory=dict)
    metadata: Dict[str, Any] = field(default_factory=dict)
    ooms: List[Tuple[int, int, int, int]] = field(default_factory=list)
    skipped_ooms: int = 0
    oom_problems: List[str] = field(default_factory=list)
    #: Whether the snapshot had device_traces at all (False: taken with include_traces=False).
    traces_recorded: bool = True
    #: The snapshot's pinned host memory, counted and left aside.
    host_segments: int = 0
    host_events: int = 0
    #: The settings of PyTorch's allocator the snapshot records, as its model takes them.
    torch_settings: TorchSettings = field(default_factory=TorchSettings)

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def has_history(self) -> bool:
        """Whether any event was recorded: without one, only the final segments are known."""
        return len(self.actions) > 0


def read_trace(
    source: Union[PathLike, Dict[str, Any]],
    device: Optional[int] = None,
    *,
    name: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Trace:
    """The trace of one device of a snapshot file (or an already loaded snapshot dict).

    ``device`` defaults to the device with the most events. Raises TraceError
    naming the file and the first malformed entry.
    """
    if isinstance(source, dict):
        label = name or "<snapshot>"
        check_snapshot(source, label)
        snapshot = source
    else:
        label = name or os.fspath(source)
        snapshot = load_snapshot(source)
    traces = device_traces(snapshot)
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    elif not (0 <= device < max(len(traces), 1) or device in _segment_devices(snapshot)):
        raise TraceError(f"{label}: no device {device}; the snapshot has {len(traces)}")
    # A device may have segments and no trace list of its own (fewer lists than devices).
    entries = traces[device] if 0 <= device < len(traces) else []
    trace = Trace(label, device, array("B"), array("Q"), array("Q"), array("Q"))
    _read_events(trace, entries, progress)
    _read_segments(trace, snapshot.get("segments", []), device)
    trace.traces_recorded = "device_traces" in snapshot
    trace.host_segments, trace.host_events = _host_counts(snapshot)
    trace.metadata = {
        k: v for k, v in snapshot.items()
        if k not in ("segments", "device_traces", "host_segments", "host_traces")
    }
    trace.torch_settings = torch_settings(snapshot)
    return trace


def _read_events(trace: Trace, entries: List[Any], progress: Optional[Callable[[int], None]]) -> None:
    actions, addrs, sizes, streams = trace.actions, trace.addrs, trace.sizes, trace.streams
    ignored: Counter = Counter()
    where = f"{trace.name}: device_traces[{trace.device}]"
    step = 1 << 14
    for i, e in enumerate(entries):
        if type(e) is not dict:
            raise TraceError(f"{where}[{i}]: an event must be a dict, got {type(e).__name__}")
        action = e.get("action")
        code = ACTIONS.get(action) if type(action) is str else None
        addr = size = stream = 0
        if code is None:
            if type(action) is not str:
                raise TraceError(f"{where}[{i}]: 'action' must be a string, got {_short.repr(action)}")
            code = OTHER
            ignored[action] += 1
        elif code == OOM:
            _read_oom(trace, i, e, where)
        else:
            addr, size, stream = e.get("addr"), e.get("size"), e.get("stream", 0)
            if type(addr) is not int or not 0 <= addr < _U64:
                raise TraceError(f"{where}[{i}] ({action}): 'addr' must be an address, got {_short.repr(addr)}")
            if type(size) is not int or not 0 <= size < _MAX_SIZE:
                raise TraceError(f"{where}[{i}] ({action}): 'size' must be a byte count, got {_short.repr(size)}")
            if type(stream) is not int or not -_MAX_SIZE <= stream < _U64:
                raise TraceError(f"{where}[{i}] ({action}): 'stream' must be an integer handle, got {_short.repr(stream)}")
            stream %= _U64
        actions.append(code)
        addrs.append(addr)
        sizes.append(size)
        streams.append(stream)
        if progress is not None and i % step == step - 1:
            progress(step)
    if progress is not None:
        progress(len(entries) % step)
    trace.ignored_actions = dict(ignored)


def _read_oom(trace: Trace, i: int, e: Dict[str, Any], where: str) -> None:
    """Keeps a readable oom event; counts (and says why) one that is not."""
    size, free, stream = e.get("size"), e.get("device_free"), e.get("stream", 0)
    problem = None
    for key, v in (("size", size), ("device_free", free)):
        if key not in e:
            problem = f"no '{key}'"
        elif type(v) is not int or not 0 <= v < _MAX_SIZE:
            problem = f"'{key}' must be a byte count, got {_short.repr(v)}"
        if problem:
            break
    if problem is None and (type(stream) is not int or not -_MAX_SIZE <= stream < _U64):
        problem = f"'stream' must be an integer handle, got {_short.repr(stream)}"
    if problem is not None:
        trace.skipped_ooms += 1
        if len(trace.oom_problems) < _OOM_PROBLEMS_KEPT:
            trace.oom_problems.append(f"{where}[{i}] (oom): {problem}")
        return
    trace.ooms.append((i, size, free, stream % _U64))


def devices_of(snapshot: Dict[str, Any]) -> List[int]:
    """The devices of a (checked) snapshot that recorded anything: events in
    ``device_traces`` or segments in ``segments``. [0] when none did, so that an
    empty snapshot still reads as one empty device."""
    traces = device_traces(snapshot)
    # Devices past the end of device_traces count too: a snapshot may list
    # segments of a device that has no trace list.
    found = {d for d in range(len(traces)) if traces[d]} | _segment_devices(snapshot)
    return sorted(found) or [0]


def memory_fraction(snapshot: Dict[str, Any]) -> Optional[float]:
    """The per-process memory fraction a snapshot's ``allocator_settings`` record
    (a snapshot dict, or a Trace's ``metadata``), or None where they record none.

    torch 2.13's snapshot writes the allocator's configuration at top level as
    ``allocator_settings``, with the ``PYTORCH_CUDA_ALLOC_CONF`` string it was
    given; that string may set ``per_process_memory_fraction`` (torch 2.13's
    CUDAAllocatorConfig accepts it), which caps what the allocator reserves at that
    fraction of the device's memory. A ``per_process_memory_fraction`` key of
    its own is read first, should a release write one. A fraction set with
    ``torch.cuda.set_per_process_memory_fraction()`` is recorded nowhere in a
    snapshot. Anything unreadable, and fractions outside (0, 1) (1 caps nothing),
    are None."""
    settings = snapshot.get("allocator_settings")
    if type(settings) is not dict:
        return None
    value: Any = settings.get("per_process_memory_fraction")
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if value is None and type(conf) is str:
        for option in conf.split(","):
            key, _, text = option.partition(":")
            if key.strip() == "per_process_memory_fraction":
                value = text.strip()
    if type(value) not in (int, float, str):
        return None
    try:
        fraction = float(value)
    except ValueError:
        return None
    return fraction if 0.0 < fraction < 1.0 else None


#: The top-level key under which pyalloc's out-of-memory recorder (pyalloc oom,
#: pyalloc.watch_oom) writes what the snapshot itself does not say: device,
#: device_total_bytes (torch.cuda.mem_get_info), device_limit_bytes (a memory
#: fraction's cap, where PyTorch's observer reported one), device_free_bytes, rank,
#: world_size, allocator, command, time, torch, pyalloc; ``requested_bytes``: the
#: bytes the caller asked for, where the observer knows them (pyalloc's; None under
#: PyTorch's allocator); ``segment_bytes``: under PyTorch's allocator, the segment it
#: tried to reserve, which its observer gets instead (DeviceCachingAllocator::malloc's
#: alloc_size); the trace's ``oom`` event holds the request rounded to its block;
#: ``history_set_by_program`` (PyTorch's allocator): the program's own
#: _record_memory_history call replaced the watch's recording.
RECORDER_KEY = "pyalloc_oom"


def recorded_device_total(snapshot: Dict[str, Any], device: int,
                          key: str = "device_total_bytes") -> Optional[int]:
    """The total memory of `device` in bytes, as pyalloc's out-of-memory recorder
    wrote it beside the snapshot (``pyalloc_oom["device_total_bytes"]``, from
    torch.cuda.mem_get_info), or None: no such record, another device's (its
    ``device`` names the one it measured), or not a positive byte count. A snapshot
    dict, or a Trace's ``metadata``. `key` "device_limit_bytes": the per-process
    cap PyTorch's out-of-memory observer reported instead, under a memory fraction."""
    record = snapshot.get(RECORDER_KEY)
    if type(record) is not dict:
        return None
    total, measured = record.get(key), record.get("device")
    if type(measured) is int and measured != device:
        return None
    return total if type(total) is int and 0 < total < _MAX_SIZE else None


def _segment_devices(snapshot: Dict[str, Any]) -> set:
    """The devices (non-negative integers) that segments of `snapshot` name."""
    return {
        seg.get("device", 0) for seg in snapshot.get("segments", [])
        if type(seg) is dict and type(seg.get("device", 0)) is int and seg.get("device", 0) >= 0
    }


def _read_segments(trace: Trace, segments: List[Any], device: int) -> None:
    where = f"{trace.name}: segments"
    for i, seg in enumerate(segments):
        if type(seg) is not dict:
            raise TraceError(f"{where}[{i}]: a segment must be a dict, got {type(seg).__name__}")
        if seg.get("device", device) != device:
            continue
        total, stream, blocks = seg.get("total_size"), seg.get("stream", 0), seg.get("blocks", [])
        if type(total) is not int or not 0 <= total < _MAX_SIZE:
            raise TraceError(f"{where}[{i}]: 'total_size' must be a byte count, got {_short.repr(total)}")
        if type(stream) is not int or not -_MAX_SIZE <= stream < _U64:
            raise TraceError(f"{where}[{i}]: 'stream' must be an integer handle, got {_short.repr(stream)}")
        if type(blocks) is not list:
            raise TraceError(f"{where}[{i}]: 'blocks' must be a list")
        trace.segments += 1
        trace.segments_bytes += total
        address = seg.get("address", 0)
        if type(address) is not int or not 0 <= address < _U64:
            raise TraceError(f"{where}[{i}]: 'address' must be an address, got {_short.repr(address)}")
        small = seg.get("segment_type") == "small"
        trace.segment_list.append((address, total, stream % _U64, small, seg.get("is_expandable") is True))
        for j, b in enumerate(blocks):
            if type(b) is not dict:
                raise TraceError(f"{where}[{i}].blocks[{j}]: a block must be a dict")
            if b.get("state") == "inactive" and type(b.get("size")) is int and 0 <= b["size"] < _MAX_SIZE:
                trace.free_blocks.append((b["size"], stream % _U64, small))
            if b.get("state") not in _ACTIVE_STATES:
                continue
            addr, size = b.get("address"), b.get("size")
            requested = b.get("requested_size", size)  # absent before torch 2.1
            for key, v, limit in (("address", addr, _U64), ("size", size, _MAX_SIZE),
                                  ("requested_size", requested, _MAX_SIZE)):
                if type(v) is not int or not 0 <= v < limit:
                    raise TraceError(f"{where}[{i}].blocks[{j}]: '{key}' must be a non-negative integer, got {_short.repr(v)}")
            trace.live_blocks.append((addr, requested, stream % _U64))
