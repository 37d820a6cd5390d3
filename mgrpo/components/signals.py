"""Stop requests: SLURM sends SIGUSR1 ahead of the time limit (when the script asks for it) and SIGTERM
on preemption or at the limit. Either one lets the current step finish, then the run checkpoints and
exits with EXIT_STOPPED so the job can be requeued and resumed."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("mgrpo")

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    def __init__(self):
        self.requested = False
        self.signum = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. not under a notebook runner)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        log.warning("signal %s: finishing this step, then checkpoint and exit", signal.Signals(signum).name)
        self.requested, self.signum = True, signum

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
