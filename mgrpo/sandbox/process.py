"""One sandboxed process: started ahead of its call, given the code once, watched until its whole tree ends.

The process is the launcher of the isolation level (bwrap, or setpriv + unshare) running the stub, which sets
the limits, writes one byte to the ready pipe and blocks reading the code pipe. A call writes the code,
closes the pipe, feeds stdin and reads stdout and stderr with bounds until the tree has ended, the wall time
has run out, or an output passed its limit; then it kills the tree (the pid namespace's init dies with its
launcher, and every process of the namespace with it) and reaps the launcher.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from mgrpo.config.choices import Isolation
from mgrpo.config.schema import SandboxConfig
from mgrpo.sandbox.isolation import ENV, bwrap_argv, stub_args, unshare_argv
from mgrpo.sandbox.result import Limit, SandboxResult, classify

START_TIMEOUT_S = 30.0
"""A sandbox not ready this long after its start (a loaded machine takes well under a second) failed to start."""

REAP_TIMEOUT_S = 10.0
"""After SIGKILL the launcher is reaped within this (the kernel tears a pid namespace down in milliseconds)."""

_READ = 1 << 16


class SandboxError(RuntimeError):
    """The sandbox itself failed (it could not start, its launcher died): never the code's outcome."""


@dataclass
class Started:
    """A sandbox waiting for its code."""

    proc: subprocess.Popen
    pidfd: int
    code_w: int
    ready_r: int
    level: str
    scratch: Optional[str]
    """the unshare level's host scratch folder, removed afterwards (bwrap's is a tmpfs in its namespace)"""
    started_at: float


def start(cfg: SandboxConfig, level: str) -> Started:
    """Start one sandbox up to the point where it waits for code. Call it from a thread that outlives the
    sandbox: bwrap --die-with-parent and setpriv --pdeathsig fire when the *thread* that forked them ends."""
    code_r, code_w = os.pipe()
    ready_r, ready_w = os.pipe()
    scratch = None
    try:
        if level == Isolation.bwrap:
            argv = bwrap_argv(cfg)
        else:
            scratch = tempfile.mkdtemp(prefix="mgrpo-sandbox-")
            if os.getuid() == 0:
                os.chown(scratch, cfg.uid, cfg.uid)
            argv = unshare_argv(cfg, scratch)
        proc = subprocess.Popen(argv + stub_args(cfg, code_r, ready_w), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(code_r, ready_w),
                                env=ENV, start_new_session=True)
    except BaseException:
        for fd in (code_w, ready_r):
            os.close(fd)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        os.close(code_r)
        os.close(ready_w)
    return Started(proc, os.pidfd_open(proc.pid), code_w, ready_r, level, scratch, time.monotonic())


def discard(s: Started) -> None:
    """Kill a sandbox that will not be used (the pool's close) and release what it holds."""
    _kill(s)
    _reap(s)
    _release(s)


def run(s: Started, cfg: SandboxConfig, code: str, stdin: str = "") -> SandboxResult:
    """Run `code` in the started sandbox `s` (once: a sandbox is never reused) and return what happened."""
    try:
        _wait_ready(s)
        t0 = time.monotonic()
        try:
            _write_all(s.code_w, code.encode())
        except BrokenPipeError:
            raise SandboxError(f"the sandbox died before its code arrived: {_stderr_now(s)}") from None
        os.close(s.code_w)
        s.code_w = -1
        out, err, killed_for = _watch(s, cfg, stdin.encode(), t0 + cfg.wall_time_s)
        if killed_for is not None:
            _kill(s)
        returncode = _reap(s)
        wall_s = time.monotonic() - t0
    finally:
        if s.proc.returncode is None:  # something above failed: no process of it outlives the call
            _kill(s)
            try:
                _reap(s)
            except SandboxError:
                pass
        _release(s)
    outcome, limit, status = classify(killed_for=killed_for, returncode=returncode, stderr=err.text)
    return SandboxResult(outcome, limit, status, out.text, err.text, out.truncated, err.truncated,
                         round(wall_s, 6), s.level)


class _Bounded:
    """One output stream: the first `limit` bytes, and whether there was more."""

    def __init__(self, limit: int):
        self.limit, self.data, self.truncated = limit, bytearray(), False

    def add(self, chunk: bytes) -> bool:
        """Keep what fits; True when the stream went past its limit."""
        room = self.limit - len(self.data)
        self.data += chunk[:max(room, 0)]
        self.truncated = self.truncated or len(chunk) > room
        return self.truncated

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _wait_ready(s: Started) -> None:
    sel = selectors.DefaultSelector()
    sel.register(s.ready_r, selectors.EVENT_READ)
    try:
        remaining = START_TIMEOUT_S - (time.monotonic() - s.started_at)
        if not sel.select(max(remaining, 0.0)):
            raise SandboxError(f"the sandbox did not start within {START_TIMEOUT_S:.0f} s: {_stderr_now(s)}")
        if not os.read(s.ready_r, 1):
            raise SandboxError(f"the sandbox failed to start: {_stderr_now(s)}")
    finally:
        sel.close()


def _watch(s: Started, cfg: SandboxConfig, stdin: bytes, deadline: float):
    """Feed stdin, read both outputs, until the tree ended (pidfd readable, outputs closed), the deadline, or
    an output limit. Returns (stdout, stderr, why it was killed or None)."""
    out, err = _Bounded(cfg.max_output_bytes), _Bounded(cfg.max_output_bytes)
    sel = selectors.DefaultSelector()
    streams = {s.proc.stdout.fileno(): out, s.proc.stderr.fileno(): err}
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = s.proc.stdin.fileno()
    if stdin:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        s.proc.stdin.close()
    sel.register(s.pidfd, selectors.EVENT_READ)
    exited, sent = False, 0
    try:
        while streams or not exited:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return out, err, Limit.wall_time
            for key, _ in sel.select(timeout):
                fd = key.fd
                if fd == s.pidfd:
                    exited = True
                    sel.unregister(fd)
                elif fd == stdin_fd:
                    try:
                        sent += os.write(fd, stdin[sent:sent + _READ])
                    except BrokenPipeError:  # the program stopped reading: the rest is not wanted
                        sent = len(stdin)
                    if sent >= len(stdin):
                        sel.unregister(fd)
                        s.proc.stdin.close()
                else:
                    chunk = os.read(fd, _READ)
                    if not chunk:
                        sel.unregister(fd)
                        del streams[fd]
                    elif streams[fd].add(chunk):
                        return out, err, Limit.output
        return out, err, None
    finally:
        sel.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _kill(s: Started) -> None:
    if s.proc.returncode is not None:  # reaped: its pid may belong to someone else now
        return
    for kill in (os.killpg, os.kill):  # the launcher's group, then the launcher (its namespace dies with it)
        try:
            kill(s.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(s: Started) -> Optional[int]:
    """The launcher's exit code, waiting at most REAP_TIMEOUT_S."""
    if s.proc.returncode is not None:
        return s.proc.returncode
    sel = selectors.DefaultSelector()
    sel.register(s.pidfd, selectors.EVENT_READ)
    try:
        if not sel.select(REAP_TIMEOUT_S):
            _kill(s)
            if not sel.select(REAP_TIMEOUT_S):
                raise SandboxError(f"the sandbox's launcher (pid {s.proc.pid}) did not end after SIGKILL")
    finally:
        sel.close()
    _, status = os.waitpid(s.proc.pid, 0)
    s.proc.returncode = os.waitstatus_to_exitcode(status)
    return s.proc.returncode


def _stderr_now(s: Started) -> str:
    """The launcher's last words (bwrap says why it failed) once it has ended."""
    _kill(s)
    _reap(s)
    try:
        os.set_blocking(s.proc.stderr.fileno(), False)
        text = (s.proc.stderr.read() or b"").decode(errors="replace").strip()
    except (OSError, ValueError):
        text = ""
    return text.splitlines()[-1] if text else f"exit status {s.proc.returncode}"


def _release(s: Started) -> None:
    for fd in (s.code_w, s.ready_r, s.pidfd):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    s.code_w = s.ready_r = s.pidfd = -1
    for stream in (s.proc.stdin, s.proc.stdout, s.proc.stderr):
        try:
            stream.close()
        except (OSError, ValueError):
            pass
    if s.scratch:
        shutil.rmtree(s.scratch, ignore_errors=True)
        s.scratch = None
