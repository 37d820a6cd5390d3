"""The GRPO loop: the one place where every room meets (docs/architecture.md: one step, as data flows).

    generate -> begin log-prob forwards -> judge -> collect them -> advantages -> update -> weight sync -> observe

`Trainer(config).fit()` is the Python front door; `mgrpo-train` builds the same config from Hydra. The
Trainer holds parts that each have one job (`mgrpo/components/`, built by `assemble.build`): the experience
maker (rollout engines and judges), the actor client (the actor and its reference on the Megatron ranks),
the weight sync, the checkpointer, the evaluator, the observer and the log-prob guard. The step below only
calls them.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from mgrpo.components.assemble import Parts, Prepared, build, prepare
from mgrpo.components.checkpoint import RunState
from mgrpo.components.signals import StopSignal
from mgrpo.config import MGRPOConfig, output_dir, resolve_device
from mgrpo.observe import gc_pauses
from mgrpo.observe.logs import default_logging
from mgrpo.observe.metrics import run_summary, step_metrics, summed
from mgrpo.observe.timing import PhaseTimer
from mgrpo.preflight import preflight

log = logging.getLogger("mgrpo")


class StopRequested(Exception):
    """The run stopped early on request (Ctrl-C, SIGTERM, SIGUSR1) after writing a checkpoint; resume continues it."""

    def __init__(self, message: str, interrupted: bool):
        super().__init__(message)
        self.interrupted = interrupted
        """A person pressed Ctrl-C (else the scheduler asked)."""


class Trainer:
    def __init__(self, config: MGRPOConfig):
        self.cfg = config = resolve_device(config)
        checked = preflight(config)  # every config error, and a run that cannot fit, fail here: no process yet
        self.layout, self.memory = checked.layout, checked.memory
        self.run_dir = output_dir(config)
        self.state = RunState()
        """Progress on the driver (step, weight version, counters); restored from a checkpoint by `_start`."""
        self.parts: Optional[Parts] = None
        """Everything with a process or a file behind it, built by `_start` and taken down by `_close`."""
        self.stop = StopSignal()
        self.gc: Optional[gc_pauses.GCPauses] = None
        """The driver's garbage-collector pauses while `fit` trains, in each step's metrics."""
        self._frozen = 0
        """Objects `gc_pauses.freeze` exempted at start-up (trainer.gc_freeze), given back by `_close`."""

    def fit(self) -> dict:
        """Train; return the last step's metrics. A first Ctrl-C (or SIGTERM/SIGUSR1) finishes the step, saves a
        checkpoint and raises StopRequested; a second Ctrl-C aborts (files flushed, Ray shut down)."""
        default_logging()
        prepared = prepare(self.cfg, self.run_dir)  # data and the run folder's verdict: still no process
        if prepared.decision.message:
            log.info("%s", prepared.decision.message)
        if prepared.decision.finished:  # what the run ended with, as when it ended
            final, line = run_summary(self.run_dir)
            log.info("%s", line)
            return final
        self.gc = gc_pauses.GCPauses()  # listens until `_close`
        try:
            self._start(prepared)
            p = self.parts
            self.stop.install()  # after Ray's init, which installs a SIGTERM handler of its own
            if self.cfg.trainer.gc_freeze:  # start-up's objects (imports, configs, parts) live until the end
                self._frozen = gc_pauses.freeze()
            self.gc.take()  # the steps' pauses, not start-up's
            if p.evaluator.before_training(self.state.step):
                p.observer.log(self.evaluate(), step=0)
            p.experiences.start(self.state.step, self.state.pending)
            metrics: dict = {}
            first = self.state.step
            while self.state.step < p.total_steps:
                metrics = self.train_step()
                if self.state.step == first:
                    log.info("start | first step in %.1fs (rollout %.1fs)", metrics["timing_s/step"],
                             metrics["timing_s/rollout"])
                self.state.step += 1
                p.observer.log(metrics, step=self.state.step)
                p.guard.enforce(self.state.step)  # engine and trainer disagree: stop, naming mgrpo-doctor
                p.experiences.step_done()
                if self.stop.requested:
                    path = self.save_checkpoint()
                    how = "(Ctrl-C)" if self.stop.interrupted else "on request"  # slurm/README quotes this line
                    raise StopRequested(f"stopped at step {self.state.step} {how}; checkpoint {path}; run again "
                                        "with trainer.resume=auto to continue", self.stop.interrupted)
                if p.checkpointer.due(self.state.step, p.total_steps):
                    self.save_checkpoint()
                if p.evaluator.due(self.state.step, p.total_steps):
                    val = self.evaluate()
                    p.observer.log(val, step=self.state.step)
                    metrics.update(val)
            self._finish()
            log.info("%s", run_summary(self.run_dir)[1])
            return metrics
        except KeyboardInterrupt:
            last = self.parts.checkpointer.latest() if self.parts is not None else None
            log.warning("interrupted at step %d: aborting; nothing after %s is kept", self.state.step,
                        f"the last checkpoint ({last})" if last else "the start (no checkpoint was written)")
            raise
        finally:
            self._close()

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One step. Each part returns what it measured; they are merged once, at the end."""
        p, state, timer = self.parts, self.state, PhaseTimer()
        version = state.weight_version  # the weights the trainer's log-probs of this step are computed with
        filtered = {}
        with timer("step"):
            offloaded = p.actor.offload()  # actor.offload: the actor hands its memory to the engines...
            with timer("rollout"):  # generation, or waiting for a batch generated (and judged) ahead
                exp, made = p.experiences.next(state.step, state.weight_version)
            released = p.weights.release_engines()  # engines on the actor's devices hand it their memory
            restored = p.actor.restore()  # ...and takes it back
            forwards = p.actor.begin(exp)  # reference (and pi_old) log-probs start on the ranks...
            judging = p.experiences.start_judging(exp)  # ...while the driver judges (models: in a thread)
            got, waited = forwards.collect(kept=judging.beside)
            timer.took(waited)
            judged, took = judging.collect()  # rules' time (reward), or scoring beyond the forwards (reward_wait)
            timer.took(took)
            if self.cfg.algorithm.overlong_filter:
                filtered = {"response_length/overlong_filtered": exp.apply_overlong_filter()}
            exp = exp.with_results(got)
            with timer("adv"):
                exp.compute_advantages(self.cfg)
            with timer("update_actor"):  # one optimizer step per mini-batch, ppo_epochs passes
                trained, got = forwards.update(exp, state.step)
            exp = exp.with_results(got)  # an on-policy update's own log-probs are pi_old
            with timer("update_weights"), p.experiences.idle():  # asynchronous rollout: the batch in flight first
                state.weight_version += 1
                synced = p.weights.sync(state.weight_version)
        paused = self.gc.take() if self.gc is not None else {}
        metrics = summed(made, released, offloaded, restored, judged, filtered, trained, synced, timer.metrics(),
                         paused)
        state.count(metrics)  # the run-long counters, logged below as <name>_total
        metrics.update(step_metrics(exp, metrics, self.cfg, self.layout, p.experiences.train_data, state.counters))
        metrics.update(p.guard.measure(exp, version))
        p.observer.write_trajectories(state.step + 1, exp)  # the step its metrics are logged under
        return metrics

    # --- around the steps ---------------------------------------------------------------------------
    def _start(self, prepared: Prepared) -> None:
        self.parts = build(self.cfg, self.layout, self.run_dir, prepared)
        self.state = self.parts.state

    def evaluate(self) -> dict:
        val, measured = self.parts.evaluator.run()
        self.state.count(measured)  # a validation's retries and judge failures count in the run's totals
        return val

    def save_checkpoint(self) -> str:
        p = self.parts
        with p.experiences.idle():  # the data position and the batches ready agree
            return p.checkpointer.save(self.state, p.actor, p.experiences.train_data, p.observer,
                                       p.experiences.state_dict())

    def _finish(self) -> None:
        p = self.parts
        if p.checkpointer.saves_at_end:
            self.save_checkpoint()
        if self.cfg.trainer.save_hf:
            out, tokenizer_dir = os.path.join(self.run_dir, "hf"), os.path.join(self.run_dir, "tokenizer")
            p.experiences.tokenizer.save_pretrained(tokenizer_dir)
            p.actor.save_hf(out, tokenizer_dir)  # Megatron ranks stream their stages to disk
            log.info("HF checkpoint written to %s", out)

    def _close(self) -> None:
        self.stop.uninstall()
        if self.gc is not None:
            self.gc.close()
            self.gc = None
        if self._frozen:  # a process that goes on (a notebook, a test) gets its collector back as it was
            gc_pauses.unfreeze()
            self._frozen = 0
        if self.parts is not None:
            self.parts.close()


def train(config: MGRPOConfig) -> dict:
    """Convenience: validate, train, return the final metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Trainer(config).fit()
