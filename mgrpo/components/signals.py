"""Stop requests. SLURM sends SIGUSR1 ahead of the time limit (when the script asks for it) and SIGTERM on
preemption or at the limit; a person presses Ctrl-C (SIGINT). Each one lets the current step finish, then the
run checkpoints and exits with the command that resumes it. A second Ctrl-C aborts at once: nothing after the
last checkpoint is kept, and the message says so."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("mgrpo")

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


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

    @property
    def interrupted(self) -> bool:
        """The stop came from Ctrl-C (a person at the terminal), not from the scheduler."""
        return self.signum == signal.SIGINT

    def _on_signal(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = " (Ctrl-C again to abort at once, keeping nothing after the last checkpoint)" \
            if signum == signal.SIGINT else ""
        log.warning("%s: finishing this step, then checkpoint and exit%s", name, again)
        self.requested, self.signum = True, signum

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
