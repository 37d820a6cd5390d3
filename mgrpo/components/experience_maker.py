"""Prompts in, samples out: n responses per prompt from the rollout engines, scored by the judges.

The loop asks for the batch of a step (`next`) and gets it in one of two states:
  - generated, not judged: the plain synchronous case. The loop starts the step's log-prob forwards on
    the Megatron ranks first and judges while they run (`start_judging`, then `Judging.collect`): by rules on the
    driver's own thread, with reward models, judges or services in a driver thread so that the step's split shows
    the overlap;
  - judged already: when a whole batch must be judged before it exists (dynamic sampling keeps only prompt
    groups whose rewards differ, generating rounds until the batch is full) or when an asynchronous
    producer made it ahead of time (`rollout.async_mode`, components/rollout_pipeline.py).
The evaluator (components/evaluator.py) uses the same `generate` and `judge` on the validation prompts.

Every call returns what it measured (times, retries, restarts, judge failures) next to its result; the loop
merges those into the step's metrics and the run-long counters.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from mgrpo.components.rollout_pipeline import RolloutPipeline
from mgrpo.config import MGRPOConfig, layout, seeds
from mgrpo.config.choices import AsyncMode
from mgrpo.experience import Experience
from mgrpo.observe.metrics import summed
from mgrpo.observe.timing import PhaseTimer
from mgrpo.rollout.factory import returns_routes
from mgrpo.rollout.types import SamplingParams

log = logging.getLogger("mgrpo")

class ExperienceMaker:
    def __init__(self, cfg: MGRPOConfig, *, tokenizer, train_data, rubric, rollout, tools=None):
        self.cfg = cfg
        self.agent = None
        """rollout.multi_turn: the `mgrpo.agent.runner.AgentRunner` that makes every sample a trajectory."""
        if cfg.rollout.multi_turn.enable:
            from mgrpo.agent.runner import AgentRunner
            from mgrpo.agent.tools import load_object

            mt = cfg.rollout.multi_turn
            env = load_object(mt.environment, "rollout.multi_turn.environment") if mt.environment else None
            if mt.interaction_config_path:  # veRL's interactions: one episode per trajectory, shared instances
                from mgrpo.agent.interaction import InteractionEnvironment, load_interactions

                env = functools.partial(InteractionEnvironment, load_interactions(mt.interaction_config_path))
            self.agent = AgentRunner(mt, tokenizer, tools, max_response_length=cfg.data.max_response_length,
                                     engines=layout(cfg).num_engines, enable_thinking=cfg.data.enable_thinking,
                                     environment=env)
        self.sandbox = None
        """The code tool's module (mgrpo.sandbox.tool) when the run gives that tool: its sandbox is made from
        cfg.sandbox now (refusing a level the machine cannot give; the line names the isolation in force) and
        its per-call outcomes are drained into every step's metrics."""
        from mgrpo.sandbox import tool as sandbox_tool

        if self.agent is not None and sandbox_tool.gives_code_tool(cfg.rollout.multi_turn):
            sandbox_tool.configure(cfg.sandbox)
            self.sandbox = sandbox_tool
        self.tokenizer, self.train_data, self.rubric = tokenizer, train_data, rubric
        """`mgrpo.rewards.Rubric`: every scorer of the run, weighted per data_source."""
        self.rollout = rollout
        """`mgrpo.cluster.rollout_group.RolloutGroup`."""
        self._judging: Optional[ThreadPoolExecutor] = None
        """The driver thread that judges while the loop waits for the trainer's log-prob forwards (`start_judging`)."""
        self.pipeline: Optional[RolloutPipeline] = None
        """The asynchronous producer (rollout.async_mode != off), from `start`."""
        r = cfg.rollout
        if cfg.algorithm.logprob_support == "sampled" and not (0 < r.top_k < cfg.model.vocab_size or r.top_p < 1):
            log.info("algorithm.logprob_support=sampled changes nothing here: without rollout.top_k or rollout.top_p "
                     "every token is sampled from the whole vocabulary")

    # --- training batches ---------------------------------------------------------------------------
    def start(self, first_batch: int, pending: Optional[dict]) -> None:
        """Start the asynchronous producer, if the config asks for one, at batch `first_batch` with the
        batches a checkpoint saved as ready (`pending`)."""
        r = self.cfg.rollout
        if r.async_mode == AsyncMode.off:
            return
        bound = 1 if r.async_mode == AsyncMode.one_step_off else r.max_staleness
        self.pipeline = RolloutPipeline(self.generate_and_judge, max_staleness=bound, first_batch=first_batch)
        if pending is not None:
            self.pipeline.load_state_dict(pending, self.train_data.items)
        self.pipeline.start()

    def next(self, step: int, weight_version: int) -> tuple[Experience, dict]:
        """The samples step `step` trains on (see the module docstring for whether they are judged), and
        what making them measured."""
        if self.pipeline is not None:
            return self.pipeline.next(weight_version)
        if self.cfg.algorithm.filter_groups.enable:
            return self.generate_and_judge(step)
        return self.generate(self.train_data.next_batch(), self.cfg.rollout.n, self.sampling(step))

    def step_done(self) -> None:
        if self.pipeline is not None:
            self.pipeline.step_done()

    def idle(self):
        """A context in which no generation runs: the batch in flight finishes on the weights it started
        with and no new one starts (weight syncs, evaluations and checkpoints hold it)."""
        return self.pipeline.paused() if self.pipeline is not None else contextlib.nullcontext()

    def state_dict(self) -> Optional[dict]:
        """Batches the producer has ready (saved with a checkpoint, replayed on resume); call while idle."""
        return self.pipeline.state_dict() if self.pipeline is not None else None

    def close(self) -> None:
        if self._judging is not None:  # a judge still running (the step failed meanwhile) ends at its timeouts
            self._judging.shutdown(wait=False, cancel_futures=True)
        if self.pipeline is not None:
            self.pipeline.close()
        if self.sandbox is not None:
            self.sandbox.close()  # its pre-started sandboxes

    # --- generate and judge ---------------------------------------------------------------------------
    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              stop=tuple(r.stop), stop_regex=tuple(r.stop_regex),
                              max_new_tokens=self.cfg.data.max_response_length,
                              seed=seeds.sampling_seed(self.cfg.trainer.seed, step, round_),
                              return_support=self.cfg.algorithm.logprob_support == "sampled",
                              return_routed_experts=returns_routes(self.cfg))

    def generate(self, items, n: int, sampling: SamplingParams, desc: str = "rollout", *, training: bool = True
                 ) -> tuple[Experience, dict]:
        """n samples per prompt of `items`, and the generation's time, retries, restarts and refused requests.
        `training`: a training batch (rollout.over_sample_rate cuts only those, as veRL's; a validation runs
        every trajectory to its end)."""
        if self.agent is not None:
            return self._generate_trajectories(items, n, sampling, desc, training)
        results, stats = self.rollout.generate([it.prompt_ids for it in items], n, sampling, desc=desc)
        measured = {"rollout/retries": stats.retries, "rollout/restarts": stats.restarts,
                    "rollout/auth_refused": stats.auth_refused, "timing_s/gen": stats.seconds}
        return Experience.from_rollout(items, results, n, want_support=sampling.return_support), measured

    def _generate_trajectories(self, items, n: int, sampling: SamplingParams, desc: str, training: bool
                               ) -> tuple[Experience, dict]:
        """Multi-turn: one trajectory per sample, each turn through the rollout group (`mgrpo/agent/runner.py`).
        Failed trajectories (tool or trajectory timeout, generation or environment failure, aborted) stay in
        place, marked failed (`Experience.from_trajectories`): no reward, no loss, no baseline, counted by
        finish reason here and by outcome where the judging counts every failure."""
        from mgrpo.agent.episode import AgentTask

        t0 = time.perf_counter()

        def generate(prompts, params, sessions=None, seeds=None, routes_from=None):  # a session: one trajectory's
            # turns, to one engine; routes_from: each turn's routed_experts_start_len (the rows it lacks)
            results, stats = self.rollout.generate(prompts, 1, params, desc=desc, sessions=sessions,
                                                   **({"request_seeds": seeds} if seeds is not None else {}),
                                                   **({"routes_from": routes_from} if routes_from is not None else {}))
            return results, {"rollout/retries": stats.retries, "rollout/restarts": stats.restarts,
                             "rollout/auth_refused": stats.auth_refused}

        rate = self.cfg.rollout.over_sample_rate if training else 0.0
        trajs, measured = self.agent.run([AgentTask(it.prompt_ids, it.extra_info, it.where, it.messages)
                                          for it in items for _ in range(n)],
                                         sampling, generate, over_sample_rate=rate,
                                         abort=getattr(self.rollout, "abort_all", None),
                                         group_size=n if training else 0)  # required_per_group: training only
        drift = [self.agent.drift(t, items[t.uid // n].messages, items[t.uid // n].tools) for t in trajs
                 if not t.failed]
        measured["multi_turn/template_drift_tokens"] = sum(drift)
        measured["multi_turn/template_drift_trajectories"] = sum(d > 0 for d in drift)
        if all(t.failed for t in trajs):
            reasons = sorted({t.finish_reason for t in trajs})
            why = next((f"; the first error: {t.counts[k]}" for t in trajs for k in ("generation_error", "env_error")
                        if k in t.counts), "")  # a dead engine's or Megatron rank's name is in the group's error
            raise RuntimeError(f"every one of {len(trajs)} multi-turn trajectories failed ({', '.join(reasons)}): "
                               "nothing to train on; see rollout.multi_turn.tool_timeout_s / trajectory_timeout_s"
                               + why[:2000])
        if self.sandbox is not None:
            measured.update(self.sandbox.counts())  # sandbox/calls, sandbox/<outcome>, sandbox/limit/<limit>
        measured["timing_s/gen"] = time.perf_counter() - t0
        return Experience.from_trajectories(items, trajs, n, want_support=sampling.return_support,
                                           want_routes=sampling.return_routed_experts), measured

    def judge(self, exp: Experience, *, training: bool = True) -> dict:
        """Score every sample with the rubric and apply the judgement; return the counts (`judge_experience`)."""
        return judge_experience(self.rubric, exp, self.tokenizer, self.cfg, training=training)

    def start_judging(self, exp: Experience) -> "Judging":
        """Start judging a batch the loop has just sent to the trainer's forwards; `collect()` the counts after them.
        Rules alone are judged here, on the driver's own thread (a rule takes ms: no thread hop); reward models,
        judges or services score in a driver thread while the loop waits for the forwards. A batch judged already
        (dynamic sampling, the asynchronous producer) has nothing left to judge."""
        if exp.judged:
            return Judging(None, {}, {})
        if not self.rubric.models_score:
            t0 = time.perf_counter()
            judged = self.judge(exp)
            return Judging(None, judged, {"reward": time.perf_counter() - t0})
        if self._judging is None:
            self._judging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgrpo-judge")

        def run() -> dict:
            t0 = time.perf_counter()
            judged = self.judge(exp)
            return {**judged, "timing_s/reward": time.perf_counter() - t0}

        return Judging(self._judging.submit(run), {}, {})

    def generate_and_judge(self, step: int) -> tuple[Experience, dict]:
        """The judged samples of batch `step`, and what making them measured; with dynamic sampling only the
        prompt groups whose rewards differ, generating more rounds until the batch is full."""
        cfg = self.cfg
        if not cfg.algorithm.filter_groups.enable:
            return self._judged(self.train_data.next_batch(), cfg.rollout.n, self.sampling(step))
        from mgrpo.algorithms.filtering import GroupAccumulator

        acc = GroupAccumulator(cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches)
        rounds: list[Experience] = []
        measured: list[dict] = []
        while not acc.full and not acc.exhausted:
            exp, made = self._judged(self.train_data.next_batch(), cfg.rollout.n, self.sampling(step, len(rounds)))
            acc.add([(len(rounds), i) for i in range(len(exp))],  # a masked sample carries no signal
                    [None if m else r for r, m in zip(exp.rewards, exp.reward_masked)], exp.group_index)
            rounds.append(exp)
            measured.append(made)
        groups = acc.take()
        measured.append(acc.metrics())
        if not groups:
            # Every group of every round scored alike (all solved, or all failed): no sample carries an
            # advantage. veRL raises here; a run that has learned its data would then die. The step trains on
            # the last round as it is (zero advantages: only the KL term moves the weights), said and counted.
            log.warning("step %d: dynamic sampling kept no prompt group in %d rounds (every group scored alike); "
                        "training on the last round unfiltered", step + 1, acc.num_gen_batches)
            return rounds[-1], summed(*measured, {"dynamic_sampling/unfiltered_steps": 1})
        return Experience.concat([rounds[g[0][0]].select([i for _, i in g]) for g in groups]), summed(*measured)

    def _judged(self, items, n: int, sampling: SamplingParams) -> tuple[Experience, dict]:
        exp, generated = self.generate(items, n, sampling)
        timer = PhaseTimer()
        with timer("reward"):
            judged = self.judge(exp)
        return exp, summed(generated, judged, timer.metrics())


def judge_experience(scorer, exp: Experience, tokenizer, cfg: MGRPOConfig, *, training: bool = True) -> dict:
    """Score every sample of `exp` with `scorer` (`mgrpo.rewards.judge_batch`) and apply the judgement; return the
    counts. A sample without a reward (its scorer failed or timed out) is masked and counted, never scored 0."""
    from mgrpo.rewards import judge_batch

    judgement = judge_batch(scorer, exp.score_requests(tokenizer), exp.group_index, exp.outcomes, exp.failed_by,
                            cfg.reward.failed, training=training)
    return exp.apply_judgement(judgement, cfg)


class Judging:
    """A batch being judged (`ExperienceMaker.start_judging`). `beside`: in a driver thread (models score), and the
    loop then also waits for a reference forward the ranks keep, so that timing_s/reward_wait shows what the
    forwards did not hide; rules alone send the update behind it at once."""

    def __init__(self, future: Optional[Future], judged: dict, seconds: dict):
        self.future, self.judged, self.seconds = future, judged, seconds
        self.beside = future is not None

    def collect(self) -> tuple[dict, dict]:
        """The counts, and the phases to put into the step's timer: rules' own time (timing_s/reward), or the wait
        for the thread beyond the forwards (timing_s/reward_wait; its own time, timing_s/reward, is in the counts).
        Every call the thread makes has its own timeout; what it raised (FailureRateExceeded) is raised here."""
        if self.future is None:
            return self.judged, self.seconds
        t0 = time.perf_counter()
        judged = self.future.result()
        return judged, {"reward_wait": time.perf_counter() - t0}
