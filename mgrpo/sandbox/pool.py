"""`Sandbox`: run code in fresh isolated processes, a few started ahead, at most `max_concurrency` at once.

Starting a sandbox (namespaces, mounts, an interpreter) costs tens of milliseconds; the pool pays that ahead
of the calls. Each pre-started sandbox is a fresh process used for one call and then killed: nothing carries
from one call to the next (no forked zygote whose children share its memory, no reused interpreter).

All launchers are started by one thread, the spawner, which lives as long as the Sandbox: bwrap's
--die-with-parent and setpriv's --pdeathsig kill a sandbox when the thread that forked it ends, so a caller's
short-lived thread must not be that parent.
"""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Optional

from mgrpo.config.schema import SandboxConfig
from mgrpo.config.checks import sandbox_errors
from mgrpo.config.validate import raise_errors
from mgrpo.sandbox import process
from mgrpo.sandbox.counts import OutcomeCounts
from mgrpo.sandbox.isolation import describe
from mgrpo.sandbox.probe import resolve
from mgrpo.sandbox.result import Limit, Outcome, SandboxResult

_IDLE_POLL_S = 1.0
"""The spawner looks for a close this often while idle."""


class Sandbox:
    """Thread-safe: `run` from any number of threads. `close` (or `with`) when done."""

    def __init__(self, cfg: Optional[SandboxConfig] = None, *, announce: bool = True):
        cfg = cfg or SandboxConfig()
        raise_errors(sandbox_errors(cfg))
        self.cfg = cfg
        self.level = resolve(cfg.isolation)
        """the isolation in force: bwrap | unshare"""
        self.counts = OutcomeCounts()
        self._slots = threading.BoundedSemaphore(cfg.max_concurrency)
        self._warm: queue.Queue = queue.Queue()
        self._requests: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._spawner = threading.Thread(target=self._spawn_loop, name="sandbox-spawner", daemon=True)
        self._spawner.start()
        self._requests.put("refill")
        if announce:
            print(f"sandbox: isolation {describe(self.level, cfg)}; limits: cpu {cfg.cpu_time_s} s, wall "
                  f"{cfg.wall_time_s} s, memory {cfg.memory_mb} MiB, processes {cfg.max_processes}, open files "
                  f"{cfg.max_open_files}, file size {cfg.max_file_size_mb} MiB, output {cfg.max_output_bytes} B; "
                  f"pool {cfg.pool_size}, concurrency {cfg.max_concurrency}", file=sys.stderr, flush=True)

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code` (Python source) in a fresh sandbox with `stdin` as its standard input. The outcome is
        counted (self.counts); a sandbox that fails itself raises process.SandboxError (counted too)."""
        if self._closed.is_set():
            raise process.SandboxError("the sandbox is closed")
        if not self._slots.acquire(timeout=self.cfg.wall_time_s):
            result = SandboxResult(Outcome.timeout, Limit.queue, None, "", "", False, False,
                                   self.cfg.wall_time_s, self.level)
            self.counts.add(result)
            return result
        try:
            try:
                result = process.run(self._take(), self.cfg, code, stdin)
            except process.SandboxError:
                self.counts.add_sandbox_error()
                raise
            self.counts.add(result)
            return result
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop the spawner and kill the sandboxes waiting for calls (calls still running are killed with it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._requests.put(None)
        self._spawner.join(timeout=process.START_TIMEOUT_S)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the spawner ------------------------------------------------------------------------------------
    def _take(self) -> process.Started:
        try:
            started = self._warm.get_nowait()
        except queue.Empty:  # none ready: ask the spawner for one now
            wanted: Future = Future()
            self._requests.put(wanted)
            try:
                started = wanted.result(timeout=process.START_TIMEOUT_S)
            except FuturesTimeout:
                raise process.SandboxError(f"no sandbox started within {process.START_TIMEOUT_S:.0f} s") from None
        self._requests.put("refill")
        return started

    def _spawn_loop(self) -> None:
        try:
            while True:
                try:
                    request = self._requests.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    if self._closed.is_set():
                        break
                    continue
                if request is None:
                    break
                if isinstance(request, Future):
                    try:
                        request.set_result(process.start(self.cfg, self.level))
                    except BaseException as e:
                        request.set_exception(process.SandboxError(f"could not start a sandbox: {e}"))
                    continue
                # refill, unless a caller is waiting for a sandbox of its own
                while self._warm.qsize() < self.cfg.pool_size and self._requests.empty():
                    try:
                        self._warm.put(process.start(self.cfg, self.level))
                    except Exception as e:  # counted when a call finds no sandbox and starts its own
                        print(f"sandbox: could not pre-start a sandbox: {e}", file=sys.stderr, flush=True)
                        break
        finally:
            while True:
                try:
                    process.discard(self._warm.get_nowait())
                except queue.Empty:
                    break
