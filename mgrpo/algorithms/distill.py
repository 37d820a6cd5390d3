"""On-policy distillation's signal: the teacher's per-token log-probs of the student's own samples.

Per sampled token t of a response, reverse KL's one-sample estimate is log pi_student(t) - log pi_teacher(t)
(the student drew t, so its expectation over the student's draws is KL(student || teacher)). As slime's OPD
does, it enters the advantage: advantage -= coef * (log pi_student - log pi_teacher), which the policy loss
turns into the policy gradient of -coef x reverse KL. Context tokens of a multi-turn sample (mask 0) and
samples out of the loss carry none. With algorithm.logprob_support=sampled both log-probs are over the
support the token was drawn from: the engine returns the student's so, and the teacher's forward renormalises
over the same supports.
"""

from __future__ import annotations

import numpy as np

from mgrpo.config.teacher import OpdConfig


def reverse_kl(student: np.ndarray, teacher: np.ndarray, mask: np.ndarray, cfg: OpdConfig) -> np.ndarray:
    """[N, L] log pi_student - log pi_teacher on the tokens of `mask` (0 elsewhere), with veRL's clamps."""
    s, t = np.asarray(student, dtype=np.float64), np.asarray(teacher, dtype=np.float64)
    if cfg.log_prob_min_clamp is not None:
        s, t = np.maximum(s, cfg.log_prob_min_clamp), np.maximum(t, cfg.log_prob_min_clamp)
    kl = s - t
    if cfg.loss_max_clamp is not None:
        kl = np.clip(kl, -cfg.loss_max_clamp, cfg.loss_max_clamp)
    return (kl * np.asarray(mask, dtype=np.float64)).astype(np.float32)


def add_teacher_term(advantages: np.ndarray, kl: np.ndarray, cfg: OpdConfig) -> np.ndarray:
    """The advantages with the distillation term: advantage - coef x reverse KL, per token."""
    return (np.asarray(advantages, dtype=np.float32) - np.float32(cfg.coef) * kl).astype(np.float32)


def opd_metrics(kl: np.ndarray, student: np.ndarray, teacher: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """opd/reverse_kl (mean over the masked tokens: the sampled estimate of KL(student || teacher) per token)
    and its per-token statistics, the two models' mean log-probs and the tokens counted."""
    m = np.asarray(mask) > 0
    if not m.any():
        return {"opd/tokens": 0.0}
    k, s, t = kl[m].astype(np.float64), np.asarray(student)[m], np.asarray(teacher)[m]
    return {"opd/reverse_kl": float(k.mean()), "opd/reverse_kl_std": float(k.std()),
            "opd/reverse_kl_max": float(k.max()), "opd/reverse_kl_min": float(k.min()),
            "opd/student_logprob": float(s.mean()), "opd/teacher_logprob": float(t.mean()),
            "opd/teacher_better_frac": float((k < 0).mean()), "opd/tokens": float(m.sum())}


def forward_kl_topk(student_topk, teacher_topk, cfg: OpdConfig):
    """veRL's forward_kl_topk per token: sum_k p_teacher(k) (log p_teacher(k) - log p_student(k)) over the
    teacher's top-k ids ([T, k] log-probs each, torch; differentiable through the student's), with veRL's
    clamps: both sides' log-probs from below at log_prob_min_clamp, the term to at most loss_max_clamp, and to at
    least 0 (over a top-k support the two distributions do not sum to 1, so the sum can go negative). [T]."""
    s, t = student_topk.float(), teacher_topk.float().detach()
    if cfg.log_prob_min_clamp is not None:
        s, t = s.clamp_min(cfg.log_prob_min_clamp), t.clamp_min(cfg.log_prob_min_clamp)
    kl = (t.exp() * (t - s)).sum(-1)
    if cfg.loss_max_clamp is not None:
        kl = kl.clamp_max(cfg.loss_max_clamp)
    return kl.clamp_min(0.0)
