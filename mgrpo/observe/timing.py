"""Phase timers: `with timer("gen"):` records seconds under `timing_s/gen`.

Phases nest. The outermost phase (the loop's `step`) also gets `timing_s/other`: its time minus that
of the phases directly inside it, i.e. what the step spends outside every named phase.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []
        self._inside: dict[str, float] = {}  # seconds of the phases directly inside each phase
        self._roots: set[str] = set()

    @contextmanager
    def __call__(self, name: str):
        parent = self._open[-1] if self._open else None
        if parent is None:
            self._roots.add(name)
        self._open.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self._open.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            if parent is not None:
                self._inside[parent] = self._inside.get(parent, 0.0) + dt

    def took(self, seconds: dict[str, float]) -> None:
        """Phases a part timed itself (its `PhaseTimer.seconds`), recorded as if they ran here, inside the
        phase open now."""
        parent = self._open[-1] if self._open else None
        for name, dt in seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            if parent is None:
                self._roots.add(name)
            else:
                self._inside[parent] = self._inside.get(parent, 0.0) + dt

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        if len(self._roots) == 1 and not self._open and "other" not in self.seconds:
            root = next(iter(self._roots))
            if root in self._inside:
                out["timing_s/other"] = self.seconds[root] - self._inside[root]
        return out
