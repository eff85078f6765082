"""Watching a run for out-of-memory errors: ``pyalloc.watch_oom()``, behind ``pyalloc oom``.

Armed, it records the allocator's history from the first allocation and, at each
out-of-memory error (raised to the program or caught by it), writes a snapshot
and starts a verdict on it in a child process. It works under the allocator the
program runs:

- PyTorch's own (default or expandable segments, as PYTORCH_ALLOC_CONF /
  PYTORCH_CUDA_ALLOC_CONF set it): ``torch.cuda.memory._record_memory_history``
  and ``torch._C._cuda_attach_out_of_memory_observer``. Both act on the
  allocators of the devices CUDA has initialised (NativeCachingAllocator's
  ``recordHistory`` and ``attachOutOfMemoryObserver`` loop over its
  ``device_allocator``, which ``init(device_count)`` fills for every device at
  CUDA's initialisation), and torch's ``_record_memory_history`` initialises
  CUDA itself, on the current device: under torchrun that is a context on GPU 0
  for every rank. So both are queued with ``torch.cuda._lazy_call``, which
  runs them when the program initialises CUDA (before its first allocation),
  or at once where it already has; nothing here starts the driver before the
  program does (see ``_torch_has_cuda``). PyTorch's cudaMallocAsync backend keeps no
  history and refuses observers: the program then runs unwatched, and a line
  says so;
- pyalloc's (``pyalloc.record_history``, ``pyalloc.cuda.attach_oom_observer``),
  where pyalloc is installed or its pools exist.

The observer (``OomWatch.observe``; PyTorch calls it with the device, the bytes
the allocator tried to reserve, the device's total memory or the cap a memory
fraction sets, and the device's free bytes, after releasing its lock) takes the
snapshot, keeps the failing device's trace and segments, adds the
``pyalloc_oom`` metadata that the verdict reads, and writes a plain pickle
(pytorch.org/memory_viz reads it) named ``oom-rank{RANK}-cuda{DEV}-{k}.pickle``,
k the first number not yet used in the folder (the file is written whole under
a hidden name, then renamed to it, so that no reader, and no process killed
while writing, leaves a truncated one). At most ``max_snapshots`` are
kept per process; later errors are counted and named in one line when the
watch closes. Nothing the observer does raises into the allocator: a failure is
one line on stderr, and the program goes on exactly as it would have.

The verdict runs in ``python -m pyalloc._oom_verdict`` (its own session, no
GPU, lowered priority, a time limit of its own): the failing program is never
held up or killed by it, and never waits for it.
"""
from __future__ import annotations

import atexit
import datetime
import os
import shlex
import subprocess
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _children, _torch_conf
from .replay.snapshot_io import write_snapshot

__all__ = ["ALLOCATORS", "DEFAULT_DIR", "OomWatch", "start_verdict", "verdict_paths", "watch_oom"]

#: Where snapshots go unless told.
DEFAULT_DIR = "pyalloc-oom"
#: The allocators a watch can record: PyTorch's own, or pyalloc.
ALLOCATORS = ("torch", "pyalloc")
MAX_SNAPSHOTS = 3
HISTORY_ENTRIES = 100_000
VERDICT_TIMEOUT = 300.0
PREFIX = "pyalloc oom: "


def say(text: str) -> None:
    """One line on stderr; a closed stderr loses it rather than raising."""
    try:
        print(PREFIX + text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def verdict_paths(snapshot: str) -> Tuple[str, str]:
    """The verdict's text and JSON files beside a snapshot: FILE-stem.verdict.txt/.json."""
    stem = snapshot[: -len(".pickle")] if snapshot.endswith(".pickle") else snapshot
    return stem + ".verdict.txt", stem + ".verdict.json"


def replay_command(snapshot: str) -> str:
    """The command that replays a snapshot again."""
    return f"pyalloc replay {shlex.quote(snapshot)}"


def start_verdict(snapshot: str, device: int, timeout: float, cwd: Optional[str] = None) -> subprocess.Popen:
    """Starts the verdict on ``snapshot`` (a path from ``cwd``) in a child process,
    and returns at once.

    Its own session, so that a signal to the program's process group (torchrun
    ending a failed job) spares it; no GPU (CUDA_VISIBLE_DEVICES=""), since a
    replay needs none; stdin closed, stderr shared (its lines are the verdict).
    It imports the pyalloc this process runs (_child_pythonpath)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    pythonpath = _child_pythonpath(env.get("PYTHONPATH", ""))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    argv = [sys.executable, "-m", "pyalloc._oom_verdict", snapshot,
            "--device", str(device), "--timeout", str(float(timeout))]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=cwd,
                            env=env, start_new_session=True, close_fds=True)


def _child_pythonpath(pythonpath: str) -> str:
    """The child's PYTHONPATH: as it is where the folder holding this pyalloc is on
    the child's default path (site-packages, the user's site, PYTHONPATH), else
    with that folder (a source checkout) after what is there. Never first: for an
    installed pyalloc it is site-packages, which would then come before the
    standard library."""
    import site

    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    entries = [p for p in pythonpath.split(os.pathsep) if p]
    default = list(getattr(site, "getsitepackages", list)()) + [site.getusersitepackages()] + entries
    if any(os.path.realpath(p) == root for p in default):
        return pythonpath
    return os.pathsep.join(entries + [root])


# ---------------------------------------------------------------------------
# The snapshot


def only_device(snapshot: Dict[str, Any], device: int) -> Dict[str, Any]:
    """The snapshot with the other devices' segments and traces left out (their
    traces emptied, so that the device keeps its index)."""
    out = dict(snapshot)
    out["segments"] = [s for s in snapshot.get("segments") or [] if s.get("device") == device]
    traces = snapshot.get("device_traces") or []
    out["device_traces"] = [t if i == device else [] for i, t in enumerate(traces)]
    return out


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _versions() -> Tuple[Optional[str], str]:
    torch = sys.modules.get("torch")
    from . import __version__

    return (str(torch.__version__) if torch is not None else None), __version__


def check_folder(directory: str) -> None:
    """Creates ``directory`` and writes (and removes) a file there: OSError, with a
    message that names the folder, where snapshots could not be written. Asked when
    the watch is armed, not at the first error hours later."""
    probe = os.path.join(directory, f".pyalloc-oom-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"cannot write snapshots to {directory}: {e.strerror or e}") from e


def reserve_name(directory: str, rank: Optional[int], device: int, base: str = ".") -> str:
    """Creates and returns DIR/oom-rank{rank}-cuda{device}-{k}.pickle (DIR taken from
    ``base`` where relative), k the first number whose file does not exist (created
    exclusively: two processes never get the same name, and no earlier file is
    overwritten)."""
    os.makedirs(os.path.join(base, directory), exist_ok=True)
    k = 1
    while True:
        path = os.path.join(directory, f"oom-rank{rank or 0}-cuda{device}-{k}.pickle")
        try:
            os.close(os.open(os.path.join(base, path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            k += 1


# ---------------------------------------------------------------------------
# The recorders: how each allocator is armed, snapshot and disarmed


class _TorchRecorder:
    """PyTorch's own allocator, through torch's entry points (module docstring)."""

    def __init__(self, frames: bool, history: int) -> None:
        self.frames, self.history = frames, history
        self.started = False
        self.reached = False  # CUDA initialised in this process: the queued arm ran
        # torch's recordHistory (c10/cuda/CUDACachingAllocator.cpp) replaces the record
        # settings and max entries of every call before it, and enabled=None clears the
        # buffer: the program's own calls, noticed through a wrapper while armed, win,
        # and close() then leaves the recording as the program set it.
        self.program_recorded = False
        self._record: Optional[Callable[..., None]] = None

    def label(self, snapshot: Dict[str, Any]) -> str:
        """"pytorch expandable_segments" where the allocator ran them: as the snapshot's
        settings record (a program may turn them on itself), else as the variable says."""
        settings = snapshot.get("allocator_settings")
        if isinstance(settings, dict) and isinstance(settings.get("expandable_segments"), bool):
            expandable = settings["expandable_segments"]
        else:
            expandable = _torch_setting("expandable_segments") in ("True", "true", "1")
        return "pytorch expandable_segments" if expandable else "pytorch"

    def arm(self, watch: "OomWatch") -> None:
        import torch

        record = self._record = torch.cuda.memory._record_memory_history

        def program_records(*args: Any, **kwargs: Any) -> None:
            self.program_recorded = True
            return record(*args, **kwargs)

        program_records.__wrapped__ = record  # type: ignore[attr-defined]
        torch.cuda.memory._record_memory_history = program_records

        def start() -> None:  # at CUDA's initialisation
            self.reached = True
            if not watch.armed:
                return
            try:
                # context=None: no stack frames, the history alone; "alloc": frames of
                # each allocation. stacks="python": no C++ unwinding. A program whose own
                # call started CUDA records as it asked.
                if not self.program_recorded:
                    record(enabled="all", context="alloc" if self.frames else None, stacks="python",
                           max_entries=self.history)
                    self.started = True
                torch._C._cuda_attach_out_of_memory_observer(watch.observe)
            except Exception as e:  # a failure here must not fail CUDA's initialisation
                say(f"could not watch PyTorch's allocator ({type(e).__name__}: {e}); "
                    "the program runs unwatched")

        torch.cuda._lazy_call(start)

    def snapshot(self) -> Dict[str, Any]:
        import torch

        return torch.cuda.memory._snapshot()

    def device_total(self, device: int, reported: int) -> Optional[int]:
        import torch

        try:
            return int(torch.cuda.mem_get_info(device)[1])
        except Exception:
            return reported

    def disarm(self, observer: Callable[..., None]) -> None:
        # torch has no way to detach an observer: the watch's ignores calls once closed.
        import torch

        record, self._record = self._record, None
        if record is None:
            return
        if getattr(torch.cuda.memory._record_memory_history, "__wrapped__", None) is record:
            torch.cuda.memory._record_memory_history = record
        if self.program_recorded:
            say("the program records the allocator's history itself: its recording is left as it set it")
            return
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if self.started and (enabled is None or enabled()):
            record(enabled=None)

    def metadata(self, requested: int) -> Dict[str, Any]:
        """PyTorch's observer gets the segment the allocator tried to reserve
        (DeviceCachingAllocator::malloc's alloc_size), not the caller's bytes; and
        whether the program's own _record_memory_history replaced the watch's recording."""
        return {"requested_bytes": None, "segment_bytes": requested,
                "history_set_by_program": self.program_recorded}


class _PyallocRecorder:
    """pyalloc's pools (pyalloc.cuda): its history and its out-of-memory observers."""

    reached = True  # its history and observers act at once, whatever the driver does

    def __init__(self, frames: bool, history: int) -> None:
        self.history = history
        if frames:
            say("pyalloc's history keeps no stack frames: frames are not recorded")

    def arm(self, watch: "OomWatch") -> None:
        from . import cuda

        cuda.record_history(True, self.history)
        cuda.attach_oom_observer(watch.observe)

    def snapshot(self) -> Dict[str, Any]:
        from . import cuda

        return cuda.snapshot()

    def label(self, snapshot: Dict[str, Any]) -> str:
        return "pyalloc"

    def device_total(self, device: int, reported: int) -> Optional[int]:
        # pyalloc's observers get the device's own total (0 where the driver said none).
        return reported or None

    def disarm(self, observer: Callable[..., None]) -> None:
        from . import cuda

        cuda.detach_oom_observer(observer)
        cuda.record_history(False)

    def metadata(self, requested: int) -> Dict[str, Any]:
        return {"requested_bytes": requested}  # pyalloc's observers get the caller's bytes


def _torch_setting(key: str) -> Optional[str]:
    """The value PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) gives ``key``; None
    where unset or unreadable (PyTorch itself then refuses the string)."""
    found = _torch_conf.torch_conf()
    if found is None:
        return None
    try:
        taken = _torch_conf.translate(*found)
    except ValueError:
        return None
    values = [t.value for t in taken if t.key == key]
    return values[-1] if values else None


# ---------------------------------------------------------------------------
# The handle


class OomWatch:
    """What ``watch_oom()`` armed; a context manager whose exit is ``close()``.

    ``snapshots``: the snapshot files written so far. ``verdicts``: the verdict
    processes started (subprocess.Popen, in the same order; each writes
    ``verdict_paths(snapshot)``; a snapshot whose verdict could not start has
    none). ``allocator``: "torch", "pyalloc", or None where there is nothing to
    watch. ``command``: the command line written into
    each snapshot's metadata."""

    def __init__(self, directory: str, allocator: Optional[str], frames: bool, max_snapshots: int,
                 history: int, verdict_timeout: float) -> None:
        self.directory = directory
        # A relative folder is the one the watch started in, wherever the program goes.
        self.base = os.getcwd()
        self.allocator = allocator
        self.frames, self.max_snapshots, self.history = frames, max_snapshots, history
        self.verdict_timeout = verdict_timeout
        self.command: Optional[List[str]] = [os.path.basename(sys.executable)] + sys.argv
        # [snapshot, its verdict process or None], appended under _lock: a verdict that
        # could not start, or two threads failing at once, pair no file with another's.
        self._kept: List[List[Any]] = []
        self.skipped: Dict[int, int] = {}  # device -> out-of-memory errors past max_snapshots
        self.failed: Dict[int, int] = {}  # device -> snapshots that could not be written
        self._taken = 0
        self._lock = threading.Lock()
        self._armed = False
        self._said_pending: set = set()
        self._said_overridden = False
        self._said_unwatched = False
        self._recorder: Any = None

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def snapshots(self) -> List[str]:
        with self._lock:
            return [path for path, _ in self._kept]

    @property
    def verdicts(self) -> List[subprocess.Popen]:
        with self._lock:
            return [proc for _, proc in self._kept if proc is not None]

    def child_settings(self) -> Dict[str, Any]:
        """watch_oom()'s arguments for the same watch in a multiprocessing child."""
        return {"directory": os.path.join(self.base, self.directory), "allocator": self.allocator,
                "frames": self.frames, "max_snapshots": self.max_snapshots, "history": self.history,
                "verdict_timeout": self.verdict_timeout}

    def settings(self) -> Tuple[Any, ...]:
        return (os.path.join(self.base, self.directory), self.allocator, self.frames, self.max_snapshots,
                self.history, self.verdict_timeout)

    def say_overridden(self, other: "OomWatch") -> None:
        """Once: a second watch_oom() with other settings runs under this watch's."""
        if self._said_overridden:
            return
        self._said_overridden = True
        say(f"pyalloc.watch_oom() is already watching ({self.allocator}'s allocator, snapshots to "
            f"{os.path.join(self.base, self.directory)}, at most {self.max_snapshots} snapshots, "
            f"history {self.history:,} events, frames {'on' if self.frames else 'off'}, verdicts "
            f"within {self.verdict_timeout:g} s): those stay in force; these settings are not "
            f"applied ({other.allocator}'s allocator, snapshots to "
            f"{os.path.join(other.base, other.directory)}, at most {other.max_snapshots} snapshots)")

    def __enter__(self) -> "OomWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _arm(self, recorder: Any) -> None:
        self._recorder = recorder
        self._armed = True
        try:
            recorder.arm(self)
        except BaseException:
            self._armed = False
            try:  # what was armed before the failure
                recorder.disarm(self.observe)
            except Exception:
                pass
            raise

    def close(self) -> None:
        """Stops recording and detaches the observer (PyTorch's, which cannot be
        detached, then does nothing); names any verdict still running and the
        out-of-memory errors not kept. A second call does nothing more."""
        if self._armed:
            self._armed = False
            _children.forget(CHILD_KEY)
            try:
                self._recorder.disarm(self.observe)
            except Exception as e:
                say(f"could not stop recording ({type(e).__name__}: {e})")
        self.say_unfinished()

    def say_unwatched(self) -> None:
        """Once, where this process never initialised CUDA: the program's GPU work, if
        any, was in processes it started, which no watch here sees."""
        if self._recorder is None or self._recorder.reached or self._said_unwatched:
            return
        self._said_unwatched = True
        say("this process never initialised CUDA: nothing was watched here. Processes it started with "
            "multiprocessing's spawn or forkserver (torch.multiprocessing.spawn, spawn-context workers) "
            "watch themselves, each to the same folder; others it started (subprocesses, torchrun's "
            "workers) are not watched: call pyalloc.watch_oom() in them, or run each under pyalloc oom "
            "(under torchrun: torchrun --nproc-per-node=N -m pyalloc oom -o DIR -- train.py)")

    # -- the observer ----------------------------------------------------------------

    def observe(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        """The allocator's out-of-memory observer: never raises into it."""
        try:
            self._on_oom(int(device), int(requested), int(device_total), int(device_free))
        except BaseException as e:  # noqa: B036 - nothing may reach the allocator
            say(f"could not keep the snapshot of the out-of-memory error on cuda:{device} "
                f"({type(e).__name__}: {e}); the program goes on")

    def _on_oom(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        if not self._armed:
            return
        with self._lock:
            if self._taken >= self.max_snapshots:
                self.skipped[device] = self.skipped.get(device, 0) + 1
                return
            self._taken += 1
        try:
            path = self._keep(device, requested, device_total, device_free)
        except BaseException:
            # A snapshot not written uses up no slot: the next error may be kept.
            with self._lock:
                self._taken -= 1
                self.failed[device] = self.failed.get(device, 0) + 1
            raise
        self._start_verdict(path, device)

    def _keep(self, device: int, requested: int, device_total: int, device_free: int) -> str:
        """Writes the device's snapshot; its path."""
        snapshot = only_device(self._recorder.snapshot(), device)
        snapshot["pyalloc_oom"] = self._metadata(snapshot, device, requested, device_total, device_free)
        # Written whole under a name of its own, then given its name: a process killed
        # half-way (torchrun's SIGTERM to the other ranks) leaves no truncated pickle
        # that pyalloc replay cannot read, and the name stays empty only for the rename.
        folder = os.path.join(self.base, self.directory)
        tmp = os.path.join(folder, f".oom-cuda{device}-{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            write_snapshot(snapshot, tmp)
            path = reserve_name(self.directory, _env_int("RANK"), device, self.base)
            try:
                os.replace(tmp, os.path.join(self.base, path))
            except BaseException:
                os.unlink(os.path.join(self.base, path))  # no empty file left under the name
                raise
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    def _start_verdict(self, path: str, device: int) -> None:
        kept = [path, None]
        with self._lock:
            self._kept.append(kept)
        txt = verdict_paths(path)[0]
        try:
            proc = start_verdict(path, device, self.verdict_timeout, cwd=self.base)
        except OSError as e:
            say(f"snapshot {path}; the verdict could not start ({e}): {replay_command(path)}")
            return
        with self._lock:
            kept[1] = proc
        say(f"out of memory on cuda:{device}: snapshot {path}; its verdict follows "
            f"(also in {os.path.basename(txt)})")

    def _metadata(self, snapshot: Dict[str, Any], device: int, requested: int, reported_total: int,
                  device_free: int) -> Dict[str, Any]:
        """What the verdict reads beside the trace (snapshot_io.RECORDER_KEY).
        ``device_limit_bytes`` is the observer's own figure where it is below the
        device's memory: PyTorch then reports the cap a memory fraction set."""
        total = self._recorder.device_total(device, reported_total)
        torch_version, pyalloc_version = _versions()
        meta = {
            "device": device,
            "device_total_bytes": total,
            "rank": _env_int("RANK"),
            "world_size": _env_int("WORLD_SIZE"),
            "allocator": self._recorder.label(snapshot),
            "device_free_bytes": device_free,
            "command": list(self.command) if self.command is not None else None,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch_version,
            "pyalloc": pyalloc_version,
        }
        if total is not None and 0 < reported_total < total:
            meta["device_limit_bytes"] = reported_total
        meta.update(self._recorder.metadata(requested))
        return meta

    # -- at the end ------------------------------------------------------------------

    def say_unfinished(self) -> None:
        """One line for each verdict still running, once; one for the errors not kept;
        one where nothing was watched."""
        self.say_unwatched()
        with self._lock:
            kept = [(path, proc) for path, proc in self._kept if proc is not None]
        for path, proc in kept:
            if proc.poll() is None and path not in self._said_pending:
                self._said_pending.add(path)
                say(f"the verdict on {path} is still running (process {proc.pid}); "
                    f"it will be written to {verdict_paths(path)[0]}")
        skipped = sum(self.skipped.values())
        if skipped:
            where = ", ".join(f"cuda:{d} x{n}" for d, n in sorted(self.skipped.items()))
            errors = "error was" if skipped == 1 else "errors were"
            say(f"{skipped} later out-of-memory {errors} not kept ({where}): at most "
                f"{self.max_snapshots} snapshots per process (--max-snapshots)")
            self.skipped.clear()
        failed = sum(self.failed.values())
        if failed:
            where = ", ".join(f"cuda:{d} x{n}" for d, n in sorted(self.failed.items()))
            errors = "error" if failed == 1 else "errors"
            say(f"{failed} out-of-memory {errors} could not be kept ({where}): see the lines above")
            self.failed.clear()


# ---------------------------------------------------------------------------
# Arming


_current: Optional[OomWatch] = None
_handles: List[OomWatch] = []


def watch_oom(directory: "str | os.PathLike[str]" = DEFAULT_DIR, *, allocator: Optional[str] = None,
              frames: bool = False, max_snapshots: int = MAX_SNAPSHOTS, history: int = HISTORY_ENTRIES,
              verdict_timeout: float = VERDICT_TIMEOUT) -> OomWatch:
    """Records the CUDA allocator's history and, at each out-of-memory error, keeps
    a snapshot in ``directory`` and starts a verdict on it; returns the handle.

    For programs that handle their out-of-memory errors themselves (a loop that
    catches the error and lowers the batch): call it before the first CUDA work,
    so that the history starts with the first allocation.

    allocator: "torch" (PyTorch's own, as its settings make it), "pyalloc", or
    None: pyalloc where it is installed or its pools exist, else PyTorch's.
    frames: record Python stack frames with each allocation (PyTorch's allocator;
    pyalloc records none). max_snapshots: snapshots kept per process, the first
    error's and those after it. history: events kept per device (pyalloc: per
    pool). verdict_timeout: seconds each verdict may take before it stops (the
    snapshot stays).

    A second call while a watch is armed returns that watch; where its settings
    differ (a program that arms its own watch, run under ``pyalloc oom -o DIR``),
    a line on stderr, once, says which settings stay in force: the program goes
    on, under the first watch (close() it first to watch otherwise). A folder
    where snapshots cannot be written raises OSError, before anything is armed.
    Without a CUDA device (and pyalloc's pools) there is nothing to watch: a
    warning, and a handle that does nothing.
    """
    global _current
    if allocator not in (None,) + ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)} or None, not {allocator!r}")
    if not isinstance(max_snapshots, int) or max_snapshots < 1:
        raise ValueError(f"max_snapshots must be a positive number, not {max_snapshots!r}")
    if not isinstance(history, int) or history < 1:
        raise ValueError(f"history must be a positive number of events, not {history!r}")
    if not verdict_timeout > 0:
        raise ValueError(f"verdict_timeout must be a positive number of seconds, not {verdict_timeout!r}")
    chosen = allocator or _default_allocator()
    watch = OomWatch(os.fspath(directory), chosen, bool(frames), max_snapshots, history,
                     float(verdict_timeout))
    if _current is not None and _current.armed:
        if _current.settings() != watch.settings():
            _current.say_overridden(watch)
        return _current
    recorder = _recorder(watch)
    if recorder is None:
        watch.allocator = None
        return watch
    check_folder(os.path.join(watch.base, watch.directory))
    watch._arm(recorder)
    _current = watch
    _children.carry(CHILD_KEY, _WatchOnArrival(watch.child_settings()))
    if not _handles:
        atexit.register(_at_exit)
    _handles.append(watch)
    return watch


#: The key of the watch in a multiprocessing child's preparation data (_children).
CHILD_KEY = "pyalloc_watch_oom"


class _WatchOnArrival:
    """Pickled into a spawn or forkserver child's preparation data; unpickling it arms
    the parent's watch there, before the child runs anything of the program."""

    def __init__(self, settings: Dict[str, Any]) -> None:
        self.settings = dict(settings)

    def __reduce__(self):
        return watch_in_child, (self.settings,)


def watch_in_child(settings: Dict[str, Any]) -> str:
    """Arms the parent's watch in a multiprocessing child, which carries it on to its
    own children; says so, naming the process, where it cannot."""
    try:
        watch = watch_oom(**settings)
    except Exception as e:  # the child still runs: say that it is not watched
        say(f"process {os.getpid()}, started by multiprocessing, is not watched: {e}")
        return f"not watched: {e}"
    watch._said_unwatched = True  # a child that does no CUDA work (a DataLoader worker) says nothing
    return "watched"


def _default_allocator() -> str:
    from . import _C, cuda

    fake = getattr(_C, "_testing_fake_devices", lambda: False)()
    return "pyalloc" if cuda.is_installed() or _C.cuda_devices() or fake else "torch"


def _recorder(watch: OomWatch) -> Any:
    """The recorder for the watch's allocator; None where there is nothing to watch."""
    if watch.allocator == "pyalloc":
        return _PyallocRecorder(watch.frames, watch.history)
    from . import cuda

    if cuda.is_installed():
        raise RuntimeError("pyalloc is PyTorch's CUDA allocator in this process: watch it with "
                           "allocator='pyalloc' (pyalloc oom --allocator pyalloc)")
    if _torch_setting("backend") == "cudaMallocAsync":
        say("PyTorch's cudaMallocAsync backend (backend:cudaMallocAsync in its allocator settings) "
            "keeps no allocation history to replay: the program runs unwatched")
        return None
    import torch

    if not _torch_has_cuda(torch):
        warnings.warn("pyalloc.watch_oom: torch sees no CUDA device and pyalloc holds no pools: "
                      "nothing to watch", stacklevel=3)
        return None
    return _TorchRecorder(watch.frames, watch.history)


def _torch_has_cuda(torch: Any) -> bool:
    """Whether torch may use a CUDA device. Before the program has started CUDA, only
    whether this torch was built with it: asking for devices would start the driver,
    which reads CUDA_VISIBLE_DEVICES once, then (a program that sets it first thing
    would be ignored) and cannot be used in a process forked after it."""
    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    return torch.cuda._is_compiled()


def _at_exit() -> None:
    for watch in _handles:
        watch.say_unfinished()


def _reset_for_tests() -> None:
    """Closes every watch this process armed (tests arm one after another)."""
    global _current
    for watch in _handles:
        if watch.armed:
            watch.close()
    _current = None
