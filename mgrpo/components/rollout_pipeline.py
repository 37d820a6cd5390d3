"""Asynchronous rollout: generation of the next batches overlaps training of the current one.

A producer thread on the driver generates and judges batch after batch (the loop's own
`generate_and_judge`, so dynamic sampling and judging are unchanged) while the trainer trains. Two
rules bound how far it runs ahead and how old a sample may be when it is trained:

- Look-ahead (`may_start`): batch b is started only once b <= steps_done + max_staleness. With max_staleness=1
  (`rollout.async_mode=one_step_off`) batch k+1 is generated while step k trains, with the weights
  of step k-1: the samples of every step are exactly one weight version behind the policy.
- Staleness bound: when a batch is taken for training, samples produced by a weight version older than
  `current - max_staleness` are dropped, counted (`rollout/stale_dropped`) and never trained; if a
  whole batch is dropped the next one is taken.

Weight updates wait for every batch the look-ahead already allows (the one in flight and those it may still
start), then hold the engine lock, which the producer holds for the length of one batch: every batch is generated
with one weight version, which each sample records, and that version is a function of the batch's index
(max(0, index - max_staleness)), never of which thread takes the engines first. (Waiting only for the batch in
flight left a race at the start of bounded staleness: batch 2 went out with version 0 or 1, whichever thread won the
lock, and one seed's last-10 reward was 0.787, 0.858 or 0.886 from run to run.)
A checkpoint pauses the producer the same way and saves the batches that are ready (they are replayed
on resume, so no sample is lost or generated twice); the data position saved with it is the producer's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextlib import contextmanager
from typing import Callable, Optional

from mgrpo.algorithms.support import SampleSupport
from mgrpo.config import InputError
from mgrpo.experience import Experience, routes_from_json, routes_to_json
from mgrpo.observe.metrics import summed

log = logging.getLogger("mgrpo")


@dataclasses.dataclass
class Produced:
    index: int
    """Which batch of the run (the step that will train it, if nothing is dropped)."""
    exp: Experience
    metrics: dict
    """What producing it logged (generation and judging times, counts)."""


class RolloutPipeline:
    def __init__(self, produce: Callable[[int], tuple[Experience, dict]], *, max_staleness: int,
                 first_batch: int = 0):
        self.produce = produce
        """batch index -> the judged experience of that batch, and what producing it measured."""
        self.max_staleness = max_staleness
        self.next_index = first_batch
        self.steps_done = first_batch
        self.ready: list[Produced] = []
        self.engines = threading.Lock()
        """Held while a batch is generated; a weight sync or an evaluation holds it to wait for the
        batch in flight and keep the next one from starting."""
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    # --- producer ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mgrpo-rollout-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self.may_start(self.next_index))
                    if self._stop:
                        return
                    index = self.next_index
                with self.engines:
                    exp, metrics = self.produce(index)
                with self._cond:
                    self.ready.append(Produced(index, exp, metrics))
                    self.next_index += 1
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer thread, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def may_start(self, index: int) -> bool:
        """The look-ahead rule: batch `index` may start once it is at most max_staleness batches past the
        steps trained, so none of its samples is beyond the staleness bound when it is trained."""
        return index <= self.steps_done + self.max_staleness

    # --- consumer ---------------------------------------------------------------------------------
    def next(self, current_version: int) -> tuple[Experience, dict]:
        """The next batch to train, with samples older than the staleness bound dropped (and counted), and
        what producing it measured (summed over the batches dropped whole before it)."""
        dropped, measured = 0, []
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.ready or self._error is not None)
                if isinstance(self._error, InputError):  # its one line names the key to change: said as it is
                    raise self._error
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                item = self.ready.pop(0)
            measured.append(item.metrics)
            exp = item.exp
            keep = [i for i, v in enumerate(exp.weight_versions) if current_version - v <= self.max_staleness]
            dropped += len(exp) - len(keep)
            if keep:
                exp = exp if len(keep) == len(exp) else exp.select(keep)
                stale = [current_version - v for v in exp.weight_versions]
                return exp, summed(*measured, {"rollout/stale_dropped": dropped,
                                               "rollout/staleness_mean": sum(stale) / len(stale),
                                               "rollout/staleness_max": float(max(stale)),
                                               "rollout/staleness_min": float(min(stale))})
            log.warning("batch %d: all %d samples are older than rollout.max_staleness=%d; dropped",
                         item.index, len(exp), self.max_staleness)
            with self._cond:  # a dropped batch frees a place for one more
                self.steps_done += 1
                self._cond.notify_all()

    def step_done(self) -> None:
        with self._cond:
            self.steps_done += 1
            self._cond.notify_all()

    @contextmanager
    def paused(self):
        """No generation runs inside. First every batch the look-ahead allows now is made (on the weights they
        started with): the weights a batch gets never depend on thread timing. The producer's own calls are
        bounded (request timeouts, retries), so this wait ends: with the batches, a stop or the producer's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop or self._error is not None or not self.may_start(self.next_index))
        with self.engines:
            yield

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Call while paused: the batches that are ready, and where the producer and trainer stand."""
        with self._cond:
            return {"next_index": self.next_index, "steps_done": self.steps_done,
                    "ready": [{"index": p.index, "metrics": p.metrics, "exp": experience_to_json(p.exp)}
                              for p in self.ready]}

    def load_state_dict(self, state: dict, items: list) -> None:
        """Before `start`: `items` are the training prompts (a saved experience refers to them by index)."""
        self.next_index, self.steps_done = int(state["next_index"]), int(state["steps_done"])
        self.ready = [Produced(p["index"], experience_from_json(p["exp"], items), p["metrics"]) for p in state["ready"]]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)


def experience_to_json(exp: Experience) -> dict:
    out = {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp) if f.name not in ("items", "support")}
    out["items"] = [it.index for it in exp.items]
    out["support"] = None if exp.support is None else [s.to_json() for s in exp.support]
    out["routed_experts"] = routes_to_json(exp.routed_experts)
    return out


def experience_from_json(data: dict, items: list) -> Experience:
    support = data.get("support")
    return Experience(**{**data, "items": [items[i] for i in data["items"]],
                         "support": None if support is None else [SampleSupport.from_json(s) for s in support],
                         "routed_experts": routes_from_json(data.get("routed_experts"))})
