"""Finding and killing processes of a test's own runs by their command line (and environment), as a
machine failure would: nothing gets to clean up. Only processes that carry the test's own marker (a
private temp dir, port or model folder) are touched, never other runs on the machine."""

from __future__ import annotations

import os
import signal

import pytest

machine_wide = pytest.mark.xdist_group("machine-wide")
"""For tests that use something only one test on the machine can use at a time: the one-node SLURM cluster (a job
asks for the whole node) and `ray start --head` (its Ray client server takes the fixed port 10001). Under xdist
(`--dist loadgroup`) they run one after another on one worker; without xdist the mark does nothing."""


def _read(pid: str, what: str) -> str:
    with open(f"/proc/{pid}/{what}", "rb") as f:
        return f.read().decode(errors="replace")


def pids_where(*markers: str, environ: bool = False) -> list[int]:
    """Processes (not this one) whose NUL-separated command line contains any marker (or, with `environ`,
    whose environment does)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            text = _read(pid, "cmdline") + ("\0" + _read(pid, "environ") if environ else "")
        except OSError:
            continue
        if any(m in text for m in markers):
            out.append(int(pid))
    return out


def until_none(find, wait_s: float, poll_s: float = 0.25) -> list:
    """`find()` again every `poll_s` until it returns nothing or `wait_s` has passed; its last answer."""
    import time

    deadline = time.monotonic() + wait_s
    found = find()
    while found and time.monotonic() < deadline:
        time.sleep(poll_s)
        found = find()
    return found


def still_running(*markers: str, environ: bool = False, wait_s: float = 15.0) -> dict[int, str]:
    """What `pids_where` still finds after waiting up to `wait_s` for it to find nothing: {pid: command line}. A
    run's processes may still be on their way out when it returns (a watchdog polls its parent every 2 s; a
    SIGKILLed process is visible until its memory is unmapped), so a test asking 'is anything left' waits, boundedly."""
    out = {}
    for pid in until_none(lambda: pids_where(*markers, environ=environ), wait_s):
        try:
            cmdline = _read(pid, "cmdline").replace("\0", " ").strip()
        except OSError:
            continue  # gone since
        if cmdline:  # an empty one: a zombie, exited
            out[pid] = cmdline
    return out


def kill(pids, sig: int = signal.SIGKILL) -> int:
    """Send `sig` to each pid that still exists; return how many got it."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (our private Ray temp dir): ours to clean up."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL `pid` and wait until it has exited: gone, or a zombie its parent (a Ray actor that started it, which
    reaps it only when it next looks) has not collected yet."""
    import time

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    raise TimeoutError(f"pid {pid} still runs {timeout_s}s after SIGKILL")
