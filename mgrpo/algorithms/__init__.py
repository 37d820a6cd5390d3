"""Advantages, policy losses, KL estimators and loss aggregation: no process groups. What the driver computes
(advantages, KL in the reward, aggregation weights, overlong shaping) is numpy, so the driver never imports torch;
the losses, which need autograd, are torch; kl.py's estimators take either.

Everything here sees whole batches handed to it (arrays or tensors); nothing communicates. Normalisation
over the global batch is carried by per-token weights (aggregation.py), so the trainer only needs
to SUM losses and gradients across micro-batches and data-parallel ranks.

  registry.py        the estimators, losses, KL estimators and aggregation modes a config may name, with
                     what each one is (needs groups of n >= 2, token- or sequence-level); imports no torch
  advantages.py      advantage estimators (compute_advantages)
  policy_loss.py     PPO-clip / GSPO token losses with KL and entropy terms (policy_loss, make_token_loss_fn)
  kl.py              per-token KL estimators (kl_estimate, apply_kl_in_reward)
  aggregation.py     loss aggregation as per-token weights over the global mini-batch (token_weights)
  filtering.py       DAPO's dynamic sampling and overlong filtering / shaping
  distill.py         on-policy distillation's per-token reverse-KL term on the advantages
  support.py         sampling supports of response tokens (logprob_support=sampled), kept compactly

This package imports none of its modules: import from them directly. That keeps registry.py
importable without torch (mgrpo.preflight asks it, and the planner validates without torch).
"""
