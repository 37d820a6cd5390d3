"""One step's experience on the driver: sampled responses, their scores (a judgement applied here, with overlong
shaping), log-probs and advantages, and the mini-batches the trainer steps on.

How a mini-batch is cut into data-parallel shards is the actor client's business
(`mgrpo/components/actor_client.py`), not the experience's.

Everything here is per sample, in rollout order: sample i*n + j is the j-th response to prompt i.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

import numpy as np

from mgrpo.algorithms.advantages import compute_advantages, scores_to_token_rewards
from mgrpo.algorithms.distill import add_teacher_term
from mgrpo.algorithms.filtering import apply_overlong_buffer, overlong_filter
from mgrpo.algorithms.kl import apply_kl_in_reward
from mgrpo.algorithms.support import SampleSupport
from mgrpo.config import MGRPOConfig
from mgrpo.rewards import failed as failed_samples
from mgrpo.rollout.types import GenerateResult
from mgrpo.training.rank_batch import compact_routes

log = logging.getLogger("mgrpo")


@dataclass
class ForwardResults:
    """What the trainer's forwards over an experience gave back, per sample in the experience's order
    (`ActorClient`); None: not computed by that call."""

    old_logprobs: Optional[list[list[float]]] = None
    """pi_old: the weights that sampled, recomputed by the trainer (or the on-policy update's own)."""
    entropy: Optional[list[list[float]]] = None
    ref_logprobs: Optional[list[list[float]]] = None
    teacher_logprobs: Optional[list[list[float]]] = None
    """On-policy distillation (teacher.hf_path): the teacher's log-probs of each sampled token."""
    teacher_topk_logprobs: Optional[list[np.ndarray]] = None
    teacher_topk_ids: Optional[list[np.ndarray]] = None
    """algorithm.opd.loss_mode=forward_kl_topk: per sample [response length, topk] the teacher's top log-probs at
    each response position (float32, highest first) and their token ids (int32)."""
    routed_experts: Optional[list[np.ndarray]] = None
    """actor.router_replay=old: the routes the old-policy forward recorded (what the update replays)."""


@dataclass
class Experience:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_versions: list[int]
    group_index: list[int]
    """Which prompt of this step's batch a response answers (its GRPO group)."""
    items: list = field(default_factory=list)
    """The PromptItem of each sample (data_source, ground_truth, extra_info, text)."""
    response_texts: list[str] = field(default_factory=list)
    scores: list[Optional[float]] = field(default_factory=list)
    """Judged reward of each response; None: it has none (its outcome says why)."""
    rewards: list[Optional[float]] = field(default_factory=list)
    """Reward used for advantages: score plus shaping (overlong buffer); None where the score is."""
    in_loss: list[bool] = field(default_factory=list)
    """False for responses masked out of the loss (overlong filtering, failed rewards)."""
    outcomes: list[str] = field(default_factory=list)
    """Per sample: 'ok', or why it has no reward ('failed', 'timeout', or a producer's own kind such as
    'env_failed', set with `mark_failed` before judging). [] = all ok (nothing marked, not judged yet)."""
    failed_by: list[str] = field(default_factory=list)
    """Per sample: who failed it ('rule:<data_source>', 'model:<name>', a producer's name); '' when ok."""
    reward_masked: list[bool] = field(default_factory=list)
    """Per sample: left out of the loss and its group's baseline because it, or too many of its group, have no
    reward (mgrpo/rewards/failed.py). Filled by `apply_judgement`."""
    support: Optional[list[SampleSupport]] = None
    """Each response's per-token sampling supports (algorithm.logprob_support=sampled; CSR, compact), or
    None: the rollout and trainer log-probs are over the whole tempered vocabulary."""
    old_logprobs: Optional[list[list[float]]] = None
    ref_logprobs: Optional[list[list[float]]] = None
    teacher_logprobs: Optional[list[list[float]]] = None
    """On-policy distillation: the teacher's log-probs of each response token (the teacher's forward)."""
    teacher_topk_logprobs: Optional[list[np.ndarray]] = None
    teacher_topk_ids: Optional[list[np.ndarray]] = None
    """forward_kl_topk: the teacher's top-k per response position ([length, topk] each; `ForwardResults`)."""
    entropy: Optional[list[list[float]]] = None
    advantages: Optional[list[list[float]]] = None
    engines: list = field(default_factory=list)
    """Which engine produced each sample (`GenerateResult.engine`: an index, or 'router')."""
    routed_experts: Optional[list[np.ndarray]] = None
    """Mixture of experts, actor.router_replay != off: per sample [prompt + response - 1, layers, top_k] expert
    ids (`compact_routes`), one row per position that was fed to the model; from the rollout engine
    (actor.router_replay=rollout) or the trainer's old-policy forward (old). What the trainer replays."""
    sampled_mask: Optional[list[list[int]]] = None
    """Multi-turn rollouts (rollout.multi_turn): per response token 1 where the policy sampled it, 0 for
    context (tool replies, template tokens). `response_mask` multiplies it in, so context tokens carry no
    loss, no advantage and no metric on every trainer path (their token weight is 0). None: all sampled."""
    turns: Optional[list[dict]] = None
    """Multi-turn: each sample's turns and finish reason (`Trajectory.to_json`), for the trajectory lines."""
    tool_rewards: Optional[list[float]] = None
    """Multi-turn: the reward the tools gave each sample (veRL's execute and calc_reward), added to its score."""

    @classmethod
    def from_rollout(cls, items: Sequence, results: Sequence[GenerateResult], n: int,
                     want_support: bool = False) -> "Experience":
        """`want_support`: the engine was asked for sampling supports (SamplingParams.return_support)."""
        support = None
        if want_support:
            missing = [r.uid for r in results if r.support is None]
            if missing:
                raise RuntimeError(f"algorithm.logprob_support=sampled asked the rollout engine for sampling supports "
                                   f"but {len(missing)} of {len(results)} results came without one (uid "
                                   f"{missing[0]}): this rollout.engine does not implement return_support")
            support = []
            for r in results:
                if len(r.support) != len(r.token_ids):
                    raise RuntimeError(f"rollout result uid {r.uid}: {len(r.support)} supports for "
                                       f"{len(r.token_ids)} tokens")
                support.append(SampleSupport.from_tokens(r.support))
        return cls(
            prompt_ids=[items[i // n].prompt_ids for i in range(len(results))],
            response_ids=[r.token_ids for r in results],
            rollout_logprobs=[r.logprobs for r in results],
            finish_reasons=[r.finish_reason for r in results],
            weight_versions=[r.weight_version for r in results],
            group_index=[i // n for i in range(len(results))],
            items=[items[i // n] for i in range(len(results))],
            in_loss=[True] * len(results),
            engines=[r.engine for r in results],
            support=support,
            routed_experts=_rollout_routes(results),
        )

    @classmethod
    def from_trajectories(cls, items: Sequence, trajs: Sequence, n: int, want_support: bool = False,
                          want_routes: bool = False) -> "Experience":
        """Multi-turn samples (`mgrpo.agent.trajectory.Trajectory`, in rollout order: trajectory i*n + j is the
        j-th of prompt i), every one of them: a failed trajectory (tool or trajectory timeout, generation or
        environment failure, aborted as the long tail) keeps its place and is marked failed with its finish
        reason as the outcome, so its group keeps its shape and the judgement leaves it unscored, out of the loss and
        out of the baseline, counted with every other failure (rewards/failed.py). `want_support`: the engine
        was asked for sampling supports; each trajectory carries them per token (context tokens: the whole
        vocabulary, they carry no loss). `want_routes`: the engine was asked for routed experts
        (actor.router_replay=rollout); each trajectory carries them assembled over its turns
        (mgrpo/agent/turn_routes.py)."""
        support = None
        if want_support:
            missing = [t.uid for t in trajs if t.supports_missing]
            if missing:
                raise RuntimeError(f"algorithm.logprob_support=sampled asked the rollout engine for sampling supports "
                                   f"and {len(missing)} multi-turn trajectories got a turn without them (e.g. "
                                   f"{missing[0]}): this rollout.engine does not implement return_support")
            support = [SampleSupport.from_tokens(t.supports) for t in trajs]
        routes = _trajectory_routes(trajs) if want_routes else None
        exp = cls(
            prompt_ids=[t.prompt_ids for t in trajs],
            response_ids=[t.response_ids for t in trajs],
            rollout_logprobs=[t.logprobs for t in trajs],
            # 'length' keeps its meaning for overlong filtering and clip metrics; the other endings are in turns
            finish_reasons=["length" if t.finish_reason == "length" else "stop" for t in trajs],
            weight_versions=[t.weight_version for t in trajs],
            group_index=[t.uid // n for t in trajs],
            items=[items[t.uid // n] for t in trajs],
            in_loss=[not t.masked for t in trajs],
            engines=[t.engine for t in trajs],
            sampled_mask=[t.sampled for t in trajs],
            turns=[t.to_json() for t in trajs],
            tool_rewards=[t.tool_reward for t in trajs],
            support=support,
            routed_experts=routes,
        )
        for i, t in enumerate(trajs):
            if t.failed:
                exp.mark_failed(i, t.finish_reason, failed_samples.ROLLOUT_CUT if t.finish_reason == failed_samples.ABORTED
                                else "multi_turn")
        return exp

    @classmethod
    def concat(cls, parts: Sequence["Experience"]) -> "Experience":
        """Join experiences (dynamic sampling joins kept groups of several rounds); group ids are
        renumbered so that groups of different parts never merge."""
        out = cls([], [], [], [], [], [])
        out.support = [] if parts and all(p.support is not None for p in parts) else None
        if parts and all(p.routed_experts is not None for p in parts):
            out.routed_experts = [x for p in parts for x in p.routed_experts]
        for name in ("sampled_mask", "turns", "tool_rewards"):
            if parts and all(getattr(p, name) is not None for p in parts):
                setattr(out, name, [x for p in parts for x in getattr(p, name)])
        for p in parts:
            for name in ("prompt_ids", "response_ids", "rollout_logprobs", "finish_reasons", "weight_versions",
                         "items", "response_texts", "scores", "rewards", "in_loss", "engines"):
                getattr(out, name).extend(getattr(p, name))
            for name, none in (("outcomes", failed_samples.OK), ("failed_by", ""), ("reward_masked", False)):
                getattr(out, name).extend(getattr(p, name) or [none] * len(p))  # []: nothing marked in that part
            if out.support is not None:
                out.support.extend(p.support)
            remap: dict[int, int] = {}
            offset = len(set(out.group_index))
            out.group_index.extend(offset + remap.setdefault(g, len(remap)) for g in p.group_index)
        return out

    def select(self, idx: Sequence[int]) -> "Experience":
        # a field not filled yet (None, or [] before judging: the trainer may start on an unjudged batch) stays so
        pick = lambda xs: xs if not xs else [xs[i] for i in idx]  # noqa: E731
        return Experience(**{name: pick(getattr(self, name)) for name in self.__dataclass_fields__})

    def __len__(self) -> int:
        return len(self.response_ids)

    def with_results(self, got: ForwardResults) -> "Experience":
        """This experience with the trainer's results that `got` carries (the others as they were)."""
        return replace(self, **{f.name: getattr(got, f.name) for f in fields(got) if getattr(got, f.name) is not None})

    @property
    def judged(self) -> bool:
        """Every sample has its score (a judgement was applied to this batch)."""
        return len(self.scores) == len(self.response_ids)

    # --- arrays ---------------------------------------------------------------------------------
    # numpy float32 (the driver never imports torch), built from Python lists in one call each: a
    # write per row costs more than the step's arithmetic on the default job's 256 short responses
    def _width(self) -> int:
        return max(max((len(r) for r in self.response_ids), default=0), 1)

    def response_mask(self, *, loss_only: bool = False) -> np.ndarray:
        """[N, L] 1 on response tokens the policy sampled (and, with loss_only, only of responses in the loss);
        a multi-turn sample's context tokens are 0 (`sampled_mask`)."""
        width = self._width()
        sampled = self.sampled_mask or [None] * len(self)
        rows = [([1.0] * len(r) if m is None else [float(x) for x in m]) + [0.0] * (width - len(r))
                if not loss_only or keep else [0.0] * width
                for r, m, keep in zip(self.response_ids, sampled, self.in_loss or [True] * len(self))]
        return np.array(rows, dtype=np.float32) if rows else np.zeros((0, width), dtype=np.float32)

    def padded(self, values: list[list[float]]) -> np.ndarray:
        width = self._width()
        rows = [list(v) + [0.0] * (width - len(v)) for v in values]
        return np.array(rows, dtype=np.float32) if rows else np.zeros((0, width), dtype=np.float32)

    def unpadded(self, values: np.ndarray) -> list[list[float]]:
        return [row[:len(r)] for row, r in zip(values.tolist(), self.response_ids)]

    # --- phases -----------------------------------------------------------------------------------
    def apply_overlong_filter(self) -> int:
        truncated = np.array([f == "length" for f in self.finish_reasons], dtype=bool)
        mask, dropped = overlong_filter(self.response_mask(), truncated)
        self.in_loss = [bool(row.any()) and keep for row, keep in zip(mask, self.in_loss)]
        return dropped

    def mark_failed(self, i: int, kind: str, by: str) -> None:
        """Sample i has no reward, for a reason found before judging (a producer's generation or environment
        failure): `kind` its outcome (not 'ok'), `by` who failed it. The judgement leaves it unscored and masked."""
        if kind == failed_samples.OK:
            raise ValueError("mark_failed: the outcome of a failed sample cannot be 'ok'")
        if not self.outcomes:
            self.outcomes, self.failed_by = [failed_samples.OK] * len(self), [""] * len(self)
        self.outcomes[i], self.failed_by[i] = kind, by

    def score_requests(self, tokenizer) -> list:
        """What the rubric scores, one request per sample (decoding every response into `response_texts`)."""
        from mgrpo.rewards import ScoreRequest

        self.response_texts = tokenizer.batch_decode(self.response_ids, skip_special_tokens=True)
        answers, extra = self._judged_texts(tokenizer)
        return [ScoreRequest(data_source=it.data_source, response=answers[i], ground_truth=it.ground_truth,
                             prompt=it.prompt, extra_info={**(it.extra_info or {}), **extra[i],
                                                           "finish_reason": self.finish_reasons[i]})
                for i, it in enumerate(self.items)]

    def apply_judgement(self, judgement, cfg: MGRPOConfig) -> dict:
        """Take a `mgrpo.rewards.Judgement` of this batch: scores (plus a tool's own reward, veRL's calc_reward;
        a failed judgement stays None), outcomes and masks, then DAPO's overlong shaping into `rewards`. Returns
        the judgement's metrics and the shaping's count."""
        n = len(self)
        bonus = self.tool_rewards or [0.0] * n
        self.scores = [None if s is None else s + b for s, b in zip(judgement.scores, bonus)]
        self.outcomes, self.failed_by = list(judgement.outcomes), list(judgement.failed_by)
        self.reward_masked = list(judgement.masked)
        self.in_loss = [keep and not m for keep, m in zip(self.in_loss or [True] * n, self.reward_masked)]
        scored = [i for i in range(n) if self.scores[i] is not None]
        # float32, as the advantages are computed: the reward a sample trains on is the score in float32
        shaped, penalised = apply_overlong_buffer(np.array([self.scores[i] for i in scored], dtype=np.float32),
                                                  np.array([len(self.response_ids[i]) for i in scored], dtype=np.int64),
                                                  cfg.data.max_response_length, cfg.algorithm.overlong_buffer)
        self.rewards = [None] * n
        for i, r in zip(scored, shaped.tolist()):
            self.rewards[i] = r
        return {**judgement.measured, "reward/overlong_penalised": penalised}

    def _judged_texts(self, tokenizer) -> tuple[list[str], list[dict]]:
        """What each judge scores and what it sees besides. Multi-turn: the last assistant turn (a tool's reply
        in the context must not pass for the model's answer), with the whole conversation in extra_info."""
        if self.turns is None:
            return self.response_texts, [{} for _ in self.response_ids]
        return ([_last_answer(t, tokenizer) for t in self.turns],
                [{"conversation": text, "turns": t} for text, t in zip(self.response_texts, self.turns)])

    def compute_advantages(self, cfg: MGRPOConfig) -> None:
        """Advantages over the samples that keep a reward; a masked sample (no reward, or a dropped group) gets
        0 and is out of the loss already, so the baselines are the remaining members' alone."""
        al = cfg.algorithm
        keep = [i for i, m in enumerate(self.reward_masked or [False] * len(self)) if not m]
        sub = self if len(keep) == len(self) else self.select(keep)
        adv_rows: list[list[float]] = [[0.0] * len(r) for r in self.response_ids]
        if keep:
            mask = sub.response_mask()
            rewards = np.array(sub.rewards, dtype=np.float32)
            token_rewards = None
            if al.use_kl_in_reward:
                token_rewards = scores_to_token_rewards(rewards, mask)
                token_rewards = apply_kl_in_reward(token_rewards, sub.padded(sub.old_logprobs),
                                                   sub.padded(sub.ref_logprobs), mask, al.kl_coef, al.kl_penalty)
            adv = sub.unpadded(compute_advantages(rewards, np.array(sub.group_index), mask, al, token_rewards))
            for i, row in zip(keep, adv):
                adv_rows[i] = row
        self.advantages = adv_rows
        if self.teacher_logprobs is not None and al.opd.loss_mode == "reverse_kl":  # distillation's advantage term
            self.advantages = self.unpadded(add_teacher_term(self.padded(adv_rows), self.teacher_kl(al.opd), al.opd))

    def student_logprobs(self) -> list[list[float]]:
        """The student's log-probs of its sampled tokens for the distillation term: pi_old when the trainer
        computed it before the update, else the engine's (the same weights, measured within 1e-6 in fp32)."""
        return self.old_logprobs if self.old_logprobs is not None else self.rollout_logprobs

    def teacher_kl(self, opd) -> np.ndarray:
        """[N, L] per-token reverse KL (student - teacher log-prob) on the loss tokens (`algorithms/distill.py`)."""
        from mgrpo.algorithms.distill import reverse_kl

        return reverse_kl(self.padded(self.student_logprobs()), self.padded(self.teacher_logprobs),
                          self.response_mask(loss_only=True), opd)

    def opd_metrics(self, opd) -> dict[str, float]:
        """opd/* over the loss tokens (`algorithms/distill.py::opd_metrics`); {} without teacher log-probs."""
        if self.teacher_logprobs is None:
            return {}
        from mgrpo.algorithms.distill import opd_metrics

        return opd_metrics(self.teacher_kl(opd), self.padded(self.student_logprobs()),
                           self.padded(self.teacher_logprobs), self.response_mask(loss_only=True))

    # --- cuts for the trainer ------------------------------------------------------------------------
    def mini_batches(self, cfg: MGRPOConfig, epoch_seed: int) -> list[list[int]]:
        """Sample indices of each mini-batch (whole prompt groups, shuffled with a seeded generator
        when there are several mini-batches). numpy's generator, not torch's (the driver has no torch): a given
        seed puts other groups together than torch.randperm did when the driver used torch."""
        groups = sorted(set(self.group_index))
        per = cfg.actor.ppo_mini_batch_size or len(groups)
        if per < len(groups):
            order = np.random.default_rng(epoch_seed).permutation(len(groups)).tolist()
            groups = [groups[i] for i in order]
        members: dict[int, list[int]] = {}
        for i, g in enumerate(self.group_index):
            members.setdefault(g, []).append(i)
        return [[i for g in groups[k:k + per] for i in members[g]] for k in range(0, len(groups), per)]


def _last_answer(turns: dict, tokenizer) -> str:
    text = next((t["text"] for t in reversed(turns["turns"]) if t["role"] == "assistant"), "")
    for special in (tokenizer.eos_token, tokenizer.pad_token):
        if special:
            text = text.replace(special, "")
    return text


# --- routed experts ------------------------------------------------------------------------------------
def _rollout_routes(results: Sequence[GenerateResult]) -> Optional[list[np.ndarray]]:
    have = [r.routed_experts is not None for r in results]
    if not any(have):
        return None
    if not all(have):  # never silently train part of a batch without its routes
        raise RuntimeError(f"{have.count(False)} of {len(results)} rollout results came back without routed_experts")
    for r in results:
        if r.routed_experts.ndim != 3:
            raise ValueError(f"sample {r.uid}: routed_experts has shape {r.routed_experts.shape}, "
                             "expected [positions, layers, top_k]")
    return [compact_routes(r.routed_experts) for r in results]


def _trajectory_routes(trajs: Sequence) -> list[np.ndarray]:
    """Each multi-turn trajectory's routes [prompt + response - 1, layers, top_k], compact, as the runner
    assembled them over its turns (mgrpo/agent/turn_routes.py); a turn answered without routes refuses the batch
    (never replayed partially)."""
    missing = [t.uid for t in trajs if t.routes_missing]
    if missing:
        raise RuntimeError(f"actor.router_replay=rollout asked the rollout engine for routed experts and "
                           f"{len(missing)} multi-turn trajectories got a turn without them (e.g. {missing[0]}): "
                           "this rollout.engine does not return routed_experts (SGLang: launch it with "
                           "--enable-return-routed-experts)")
    for t in trajs:
        want = len(t.prompt_ids) + len(t.response_ids) - 1
        if t.routes is None or t.routes.ndim != 3 or t.routes.shape[0] != want:
            raise RuntimeError(f"multi-turn trajectory {t.uid}: routed experts of shape "
                               f"{None if t.routes is None else t.routes.shape} for {want + 1} ids (expected "
                               f"[{want}, layers, top_k])")
    return [compact_routes(t.routes) for t in trajs]


def routes_to_json(routes: Optional[list[np.ndarray]]) -> Optional[list[dict]]:
    """Per-sample routes as JSON (a checkpoint's pending asynchronous batches): dtype, shape, base64 bytes."""
    import base64

    if routes is None:
        return None
    return [{"dtype": str(r.dtype), "shape": list(r.shape), "data": base64.b64encode(r.tobytes()).decode()}
            for r in routes]


def routes_from_json(data: Optional[list[dict]]) -> Optional[list[np.ndarray]]:
    import base64

    if data is None:
        return None
    return [np.frombuffer(base64.b64decode(d["data"]), dtype=d["dtype"]).reshape(d["shape"]).copy() for d in data]
