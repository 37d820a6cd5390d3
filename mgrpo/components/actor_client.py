"""The loop's view of the actor (and its frozen reference) on the Megatron ranks: whole experiences in,
per-sample results and metrics out.

The client owns data-parallel sharding. It cuts what the loop hands it into one `RankBatch` per
data-parallel replica (balanced by tokens), gives every token its loss-aggregation weight normalised
over the *whole* mini-batch (so the gradient does not depend on how the mini-batch is cut into
replicas and micro-batches), and puts per-sample results back in the experience's order. The loop
never shards and never reaches into ranks.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from mgrpo.algorithms.aggregation import effective_loss_agg_mode, global_counts, token_weights
from mgrpo.config import MGRPOConfig, seeds
from mgrpo.experience import Experience, ForwardResults
from mgrpo.observe.timing import PhaseTimer
from mgrpo.training.rank_batch import RankBatch


class StepForwards:
    """The log-prob forwards of one step's experience, decided once, when its samples are generated.

    pi_old gets a forward of its own only when the update needs it before it starts
    (`ActorClient.needs_old_logprobs`); otherwise the one update takes pi_old from its own detached
    log-probs. The reference's log-probs stay on the ranks when only that one update reads them (no KL in
    the reward): they never travel to the driver and back. Both forwards are sent at once, so the ranks
    compute while the driver judges; `collect` waits for what the driver needs and `update` trains.
    """

    def __init__(self, client: "ActorClient", exp: Experience, need_ref: bool):
        self.client = client
        self.old = client.needs_old_logprobs(exp)
        self.keep_ref = need_ref and not self.old
        self._old = client.send_logprobs(exp, "actor") if self.old else None
        self._ref = client.send_logprobs(exp, "ref", keep=self.keep_ref) if need_ref else None
        # on-policy distillation: the teacher's forward goes with the reference's (the ranks run them back to
        # back while the driver judges; an SGLang teacher's engines run beside the ranks)
        self._teacher = client.teacher.send(exp) if client.teacher is not None else None

    def collect(self, *, kept: bool = False) -> tuple[ForwardResults, dict[str, float]]:
        """Wait for the forwards the driver reads; return them, and the seconds spent waiting for each
        (`old_logprob`, `ref`). `kept`: also wait until a reference forward the ranks keep is done (its values
        stay there). The loop asks for it while a driver thread judges, so that what it then waits for the
        judge is what scoring took beyond the forwards (timing_s/reward_wait); otherwise the update waits for
        it on the ranks, its own shards already sent (`update`)."""
        got, timer = ForwardResults(), PhaseTimer()
        if self._old is not None:
            with timer("old_logprob"):  # pi_old: the weights that sampled, recomputed by the trainer
                out = self._old()
            got.old_logprobs, got.entropy = out["logprobs"], out["entropy"]
            got.routed_experts = out.get("routed_experts")  # actor.router_replay=old: the routes the update replays
        if self._ref is not None and (kept or not self.keep_ref):
            with timer("ref"):
                out = self._ref()
            if not self.keep_ref:
                got.ref_logprobs = out["logprobs"]
        if self._teacher is not None:
            with timer("teacher"):
                out = self._teacher()
            got.teacher_logprobs = out["logprobs"]
            got.teacher_topk_logprobs, got.teacher_topk_ids = out.get("topk_logprobs"), out.get("topk_ids")
        return got, timer.seconds

    def update(self, exp: Experience, step: int) -> tuple[dict, ForwardResults]:
        """The step's optimizer updates over `exp` (with its advantages and what `collect` gave back;
        `ActorClient.train`); a kept reference forward runs first on the ranks."""
        return self.client.train(exp, step, kept_ref=self._ref if self.keep_ref else None)


class ActorClient:
    def __init__(self, group, cfg: MGRPOConfig, dp: int, teacher=None):
        self.group = group
        """`mgrpo.cluster.megatron_group.MegatronGroup`: fans calls out to every Megatron rank."""
        self.cfg = cfg
        self.dp = dp
        self.need_ref = cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.teacher = teacher
        """On-policy distillation's teacher (`components/teacher.py`): `send(exp)` -> a wait for its log-probs; an
        SGLang teacher is given, a Megatron one made here (it is the ranks')."""
        if cfg.teacher.hf_path and cfg.teacher.mode == "megatron":
            from mgrpo.components.teacher import MegatronTeacher

            self.teacher = MegatronTeacher(self)

    # --- log-probs ----------------------------------------------------------------------------------
    def begin(self, exp: Experience) -> StepForwards:
        """Send the log-prob forwards `exp` needs to the ranks and return at once (see StepForwards)."""
        return StepForwards(self, exp, self.need_ref)

    def send_logprobs(self, exp: Experience, which: str, keep: bool = False) -> Callable[[], dict]:
        """Start `which`'s forward over `exp` and return a function that waits for {'logprobs', 'entropy'}
        per sample. With `keep` the ranks keep the values for the update that follows and the function only
        waits."""
        shards = self._shards(exp, range(len(exp)), for_training=False)
        wait = self.group.compute_logprobs(shards, which, keep=keep)

        def collect() -> dict:
            outs = wait()
            if keep:
                return {}
            keys = ["logprobs", "entropy"] + [k for k in ("routed_experts", "topk_logprobs", "topk_ids")
                                              if all(k in o for o in outs)]
            return {k: in_sample_order(shards, [o[k] for o in outs]) for k in keys}

        return collect

    def needs_old_logprobs(self, exp: Experience) -> bool:
        """Whether pi_old needs a forward of its own before the update. With exactly one optimizer step
        per rollout (one epoch, one mini-batch) the policy before that step is the one the training
        forward runs, so the update takes pi_old from its own detached log-probs (TRL does the same)
        and fills `exp.old_logprobs` / `exp.entropy` from that forward. They are needed earlier when
        the KL penalty goes into the reward (advantages use them), or when actor.recompute_old_logprob
        asks for the separate forward, or actor.router_replay=old, whose update replays the routes that forward
        records."""
        cfg = self.cfg
        return (cfg.actor.recompute_old_logprob or cfg.algorithm.use_kl_in_reward or cfg.actor.ppo_epochs != 1
                or str(cfg.actor.router_replay) == "old" or len(exp.mini_batches(cfg, epoch_seed=0)) != 1)

    # --- training -----------------------------------------------------------------------------------
    def train(self, exp: Experience, step: int, kept_ref: Optional[Callable[[], dict]] = None
              ) -> tuple[dict, ForwardResults]:
        """`actor.ppo_epochs` passes over `exp`, one optimizer step per mini-batch. Returns the metrics (the
        mean over those optimizer steps; cumulative counters keep their last value) and, when the update was
        on-policy (no `exp.old_logprobs`, see `needs_old_logprobs`), its forward's log-probs and entropy as
        pi_old. `kept_ref`: the reference forward whose values the ranks kept for this update (it runs first)."""
        on_policy = exp.old_logprobs is None
        if on_policy and self.needs_old_logprobs(exp):
            raise RuntimeError("the update needs pi_old (exp.old_logprobs): more than one optimizer step per "
                               "rollout, use_kl_in_reward or actor.recompute_old_logprob; compute it first")
        updates, got = [], ForwardResults()
        for epoch in range(self.cfg.actor.ppo_epochs):
            for idx in exp.mini_batches(self.cfg, epoch_seed=seeds.minibatch_seed(self.cfg.trainer.seed, step, epoch)):
                shards = self._shards(exp, idx, for_training=True)
                updates.append(self.group.train_mini_batch(shards, while_sent=kept_ref))
                kept_ref = None
                if on_policy:  # the one mini-batch holds every sample
                    per_sample = updates[-1].pop("per_sample")
                    got.old_logprobs, got.entropy = ([None] * len(exp), [None] * len(exp))
                    for key, dest in (("logprobs", got.old_logprobs), ("entropy", got.entropy)):
                        for i, v in zip(idx, in_sample_order(shards, [p[key] for p in per_sample])):
                            dest[i] = v
        out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        out["actor/skipped_steps"] = updates[-1]["actor/skipped_steps"]
        out["actor/updates"] = float(len(updates))
        return out, got

    # --- sharding -----------------------------------------------------------------------------------
    def _shards(self, exp: Experience, idx: Sequence[int], *, for_training: bool) -> list[RankBatch]:
        sub = exp.select(idx)
        token_weight, metric_weight = None, 0.0
        if for_training:
            loss_mask = sub.response_mask(loss_only=True)
            tokens, seqs = global_counts(loss_mask)
            w = token_weights(loss_mask, effective_loss_agg_mode(self.cfg.algorithm), global_tokens=tokens,
                              global_seqs=seqs, max_response_length=self.cfg.data.max_response_length)
            token_weight, metric_weight = sub.unpadded(w), 1.0 / max(tokens, 1)
        batches = []
        for shard in balanced_split(_lengths(sub, range(len(sub))), self.dp):
            pick = lambda xs: None if xs is None else [xs[i] for i in shard]  # noqa: E731
            batches.append(RankBatch(
                input_ids=[sub.prompt_ids[i] + sub.response_ids[i] for i in shard],
                prompt_lens=[len(sub.prompt_ids[i]) for i in shard],
                seq_index=list(shard),
                advantages=pick(sub.advantages) if for_training else None,
                old_logprobs=pick(sub.old_logprobs) if for_training else None,
                ref_logprobs=pick(sub.ref_logprobs) if for_training else None,
                rollout_logprobs=pick(sub.rollout_logprobs) if for_training else None,
                token_weight=pick(token_weight),
                metric_weight=metric_weight,
                support=pick(sub.support),  # every forward of a sample renormalises over its supports
                routed_experts=pick(sub.routed_experts),  # routing replay: whichever forward has them replays
                teacher_topk_logprobs=pick(sub.teacher_topk_logprobs) if for_training else None,
                teacher_topk_ids=pick(sub.teacher_topk_ids) if for_training else None,
            ))
        return batches

    # --- weights and checkpoints (every rank takes part) ---------------------------------------------
    def sync_weights(self, receivers: list, version: int | None = None, watch=None) -> dict:
        """Push the weights through `receivers`. With `version`, and when one rank sends everything (one
        pipeline stage) and every receiver can close an update, that rank also closes it on the engines
        ('finished': True); otherwise the caller does. `watch` runs every rollout.health_check_interval_s
        while the ranks send."""
        single_sender = self.cfg.actor.pp == 1
        can_finish = version is not None and single_sender and all(hasattr(r, "finish_weight_update")
                                                                     for r in receivers)
        return self.group.sync_weights(receivers, self.cfg.rollout.update_weights_bucket_mb << 20,
                                       version if can_finish else None, watch=watch,
                                       every_s=self.cfg.rollout.health_check_interval_s)

    # --- host memory while the engines generate (actor.offload) ---------------------------------------
    def offload(self) -> dict:
        """The actor's memory to host before generation (what actor.offload names; engines on its devices only:
        the validator refuses it otherwise); the seconds and bytes moved."""
        return self.group.offload() if self.cfg.actor.offload.any else {}

    def restore(self) -> dict:
        """Back to the accelerators after generation, before the step's first forward."""
        return self.group.offload(back=True) if self.cfg.actor.offload.any else {}

    def save_checkpoint(self, path: str) -> None:
        self.group.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.group.load_checkpoint(path)

    def save_hf(self, out_dir: str, tokenizer_dir: str | None) -> None:
        self.group.save_hf(out_dir, tokenizer_dir)

    def adapter(self) -> tuple[dict, dict]:
        """The LoRA adapters as a PEFT adapter: ({PEFT key: tensor}, adapter_config.json's fields)."""
        from mgrpo.models.peft_export import peft_config

        tensors = self.group.peft_tensors()
        return tensors, peft_config(tensors, self.cfg.actor.lora, "")

    def shutdown(self) -> None:
        if hasattr(self.teacher, "close"):  # an SGLang teacher's engines
            self.teacher.close()
        self.group.shutdown()


def in_sample_order(shards: Sequence[RankBatch], shard_values: Sequence[list]) -> list:
    """Per-sample values of each shard (in the shard's own order) -> one list in the order the shards were cut
    from: each shard's `seq_index` says where its samples came from."""
    out: list = [None] * sum(len(s.seq_index) for s in shards)
    for shard, values in zip(shards, shard_values):
        for pos, v in zip(shard.seq_index, values):
            out[pos] = v
    return out


def _lengths(exp: Experience, idx) -> list[int]:
    return [len(exp.prompt_ids[i]) + len(exp.response_ids[i]) for i in idx]


def balanced_split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Deterministic longest-first greedy split of sample indices into `parts` lists of similar total
    length; indices inside a part stay in ascending order. Every part gets at least one sample."""
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} samples cannot be split over {parts} data-parallel replicas")
    if parts == 1:
        return [list(range(len(lengths)))]
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda k: (load[k], len(out[k]), k))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(o) for o in out]
