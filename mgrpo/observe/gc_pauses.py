"""Python's cycle collector in a long-lived process: frozen once start-up is over, its pauses measured.

A full (generation-2) collection walks every object the collector tracks. The driver imports Ray, Hydra and the
run's parts and builds them; a rank imports torch, megatron and transformers besides. One full collection then
stops the process for a fifth of a second: `python -m benchmarks.measure.gc_pauses --steps 150` (the tiny
workload's job) saw one in the driver's 148 timed steps, 178 ms, and the step that took it 318 ms against a median
of 125. Nearly all of the objects it walks are modules, functions, classes and configs made at start-up that live
as long as the process. `freeze()` moves them to the permanent generation (`gc.freeze`, what SGLang's scheduler
and tokenizer manager do on /freeze_gc), so later collections walk only what the run made since; garbage is
still collected as before. With it the same run had no full collection, its longest step 152 ms; the median
and mean step did not change (benchmarks/results/gc_pauses_cpu.json): it is the tail that the freeze removes.

`GCPauses` counts the collections and their wall time, so a pause shows in the step's metrics
(`perf/gc_full_collections`, `perf/gc_pause_s`) instead of as an unexplained slow phase.
"""

from __future__ import annotations

import gc
import time
from typing import Optional


def freeze() -> int:
    """Collect what start-up left as garbage, then exempt every object alive now from later collections;
    return how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


class GCPauses:
    """This process's collections since the last `take()`: how many reached generation 2 and how long all took."""

    def __init__(self):
        self._started: Optional[float] = None
        self.full = 0
        self.seconds = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2
            self._started = None

    def take(self) -> dict[str, float]:
        out = {"perf/gc_full_collections": float(self.full), "perf/gc_pause_s": self.seconds}
        self.full, self.seconds = 0, 0.0
        return out

    def close(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)
