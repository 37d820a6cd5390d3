"""teacher.* and algorithm.opd.*: on-policy distillation (a teacher's per-token signal on the student's own
samples), in a module of its own to keep schema.py small."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mgrpo.config.choices import OpdLossMode, TeacherMode


@dataclass
class TeacherConfig:
    """The frozen teacher of on-policy distillation (slime's --opd-type megatron|sglang, veRL's
    distillation.teacher_models). It must share the student's tokenizer (vocabulary and chat template)."""

    hf_path: Optional[str] = None
    """HF checkpoint directory of the teacher (config.json + safetensors + tokenizer), as model.hf_path.
    None: no teacher, no distillation. Its architecture may differ from the student's (size, depth, width)."""
    mode: TeacherMode = "megatron"
    """megatron (a frozen Megatron model in the actor's ranks, placed and laid out like the reference: same
    tp/pp/cp/dp, its forward sent with the reference's) | sglang (an auxiliary SGLang engine that returns the
    log-probs of the student's tokens: SGLang's `return_logprob` with `logprob_start_len`; no accelerator of
    the actor's is used for it)"""
    tp: int = 1
    """mode=sglang: tensor-parallel size of one teacher engine (SGLang's --tp-size)."""
    num_engines: int = 1
    """mode=sglang: teacher engines; a step's samples are split over them."""
    gpu_memory_utilization: float = 0.5
    """mode=sglang: SGLang's --mem-fraction-static of a teacher engine (accelerators of its own)."""
    request_timeout_s: float = 600.0
    """mode=sglang: the longest one teacher request may take; a request past it fails the step (counted)."""


@dataclass
class OpdConfig:
    """The distillation signal (algorithm.opd.*; slime's --opd-kl-coef, veRL's distillation.distillation_loss)."""

    coef: float = 1.0
    """Weight of the per-token reverse-KL term: advantage += -coef * (log pi_student - log pi_teacher) on each
    sampled token (slime's opd_kl_coef). With algorithm.adv_estimator=none it is the whole advantage (pure
    distillation, no reward in the loss)."""
    loss_mode: OpdLossMode = "reverse_kl"
    """reverse_kl (the sampled-token reverse KL as an advantage term, which the policy loss turns into a
    policy gradient: slime's OPD and veRL's use_policy_gradient form) | forward_kl_topk (veRL's: the teacher
    returns its top `topk` log-probs at every response position, and the loss gains
    coef x sum_k p_teacher(k) (log p_teacher(k) - log p_student(k)) per loss token, aggregated like the policy
    loss and differentiated through the student's log-probs of those k tokens)."""
    topk: int = 8
    """loss_mode=forward_kl_topk: how many of the teacher's likeliest tokens each position's term covers (veRL's
    distillation_loss.topk)."""
    log_prob_min_clamp: Optional[float] = None
    """Clamp both log-probs from below before the difference (veRL's log_prob_min_clamp; for forward_kl_topk both
    sides' top-k log-probs); None: no clamp."""
    loss_max_clamp: Optional[float] = None
    """Clamp the per-token reverse KL to [-this, this], the per-token forward_kl_topk term to at most this (veRL's
    loss_max_clamp; the top-k term is also clamped at 0 from below, as veRL does: over a top-k support it can go
    negative); None: no clamp."""

    @property
    def teacher_topk(self) -> int:
        """How many top log-probs per position the teacher returns: topk under forward_kl_topk, else 0."""
        return self.topk if self.loss_mode == "forward_kl_topk" else 0
