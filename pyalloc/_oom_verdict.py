"""The verdict on an out-of-memory snapshot, in a process of its own.

    python -m pyalloc._oom_verdict FILE --device DEV --timeout SECONDS

``pyalloc oom`` and ``pyalloc.watch_oom()`` start it (oom_watch.start_verdict)
for each snapshot they keep, and never wait for it. It replays the device's
trace (``replay_devices(FILE, device=DEV, search=False)``: the recorded
out-of-memory errors need no search for the smallest device) and prints
``replay.report.format_verdict``'s few lines on stderr, each prefixed
"pyalloc oom: ", figures exactly those ``pyalloc replay FILE`` prints; the same
lines go beside the snapshot in FILE-stem.verdict.txt, and the oom dicts of
``ReplayResult.recorded_ooms`` with file, device, seconds and status ("done",
"timeout", "failed") in FILE-stem.verdict.json, each written whole or not at all.

A watchdog thread ends the process after SECONDS, whatever the replay is doing
(the replay's C++ loops run without the GIL): it says in one line, and in both
files, that the verdict could not finish, and names the command that replays
the snapshot again. A replay that fails says so the same way. The snapshot is
never touched.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from .oom_watch import replay_command, say, verdict_paths

#: Exit statuses: the verdict written, the watchdog's limit reached, the replay failed.
DONE, TIMEOUT, FAILED = 0, 3, 4


class _Outcome:
    """Which of the replay and the watchdog writes the files: the first to get here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.written = False


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _finish(outcome: _Outcome, args: argparse.Namespace, started: float, status: str,
            lines: List[str], ooms: List[Dict[str, Any]]) -> bool:
    """Writes the verdict files and prints the lines; False where the other side already did."""
    with outcome.lock:
        if outcome.written:
            return False
        outcome.written = True
        txt, js = verdict_paths(args.file)
        record = {"file": args.file, "device": args.device, "status": status,
                  "seconds": round(time.monotonic() - started, 3), "ooms": ooms, "verdict": lines}
        try:
            _write_atomically(txt, "".join(line + "\n" for line in lines))
            _write_atomically(js, json.dumps(record, indent=1) + "\n")
        except OSError as e:
            say(f"could not write the verdict beside {args.file}: {e}")
        for line in lines:
            say(line)
        return True


def _watchdog(outcome: _Outcome, args: argparse.Namespace, started: float) -> None:
    line = (f"the verdict on {args.file} could not finish within {args.timeout:g} s; the snapshot "
            f"is kept: {replay_command(args.file)}")
    if _finish(outcome, args, started, "timeout", [line], []):
        os._exit(TIMEOUT)


def verdict_lines(results: List[Any], path: str) -> List[str]:
    """format_verdict's lines; where the snapshot recorded no out-of-memory error
    on the device, one line that says so, with the command."""
    from .replay.report import format_verdict

    lines = list(format_verdict(results, path))
    if not lines:
        lines = [f"{path}: the snapshot recorded no out-of-memory error on this device (the "
                 f"program's own history recording may have replaced the watch's): {replay_command(path)}"]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyalloc._oom_verdict")
    parser.add_argument("file")
    parser.add_argument("--device", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    started = time.monotonic()
    outcome = _Outcome()
    watchdog = threading.Timer(args.timeout, _watchdog, (outcome, args, started))
    watchdog.daemon = True
    watchdog.start()
    try:
        os.nice(10)  # the failing program, and its neighbours, come first
    except OSError:
        pass
    try:
        from .replay import NoHistoryError, replay_devices

        results = replay_devices(args.file, device=args.device, search=False, progress=False)
        lines = verdict_lines(results, args.file)
    except NoHistoryError:
        # The watch recorded from the first allocation: an empty trace is the program's
        # doing (torch's _record_memory_history(enabled=None) clears it).
        line = (f"no verdict on {args.file}: the snapshot holds no history of cuda:{args.device}: the "
                "recording was turned off or emptied by the program (torch.cuda.memory."
                "_record_memory_history(enabled=None) clears it); the snapshot is kept")
        return FAILED if _finish(outcome, args, started, "failed", [line], []) else TIMEOUT
    except Exception as e:
        line = (f"no verdict on {args.file}: {type(e).__name__}: {e}; the snapshot is kept: "
                f"{replay_command(args.file)}")
        return FAILED if _finish(outcome, args, started, "failed", [line], []) else TIMEOUT
    ooms = [oom for r in results for oom in r.recorded_ooms]
    return DONE if _finish(outcome, args, started, "done", lines, ooms) else TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
