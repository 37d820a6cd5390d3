"""Megatron forward steps of the actor and the reference: hidden states in, log-probs and loss out.

The last pipeline stage never computes the `[tokens x vocab]` logits through megatron's output
layer. Its output layer is switched to hand back the final hidden states; the response positions
are gathered and passed, with the output weight (this rank's vocabulary shard), to the fused
chunked kernel in `mgrpo_kernels`, which combines statistics across the tensor-parallel group. With
sampling supports in the micro-batch (algorithm.logprob_support=sampled) every forward here, old-policy,
reference and training alike, renormalises each token over its own support.
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch

import mgrpo_kernels
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn, policy_loss
from mgrpo.algorithms.registry import POLICY_LOSSES
from mgrpo.config import MGRPOConfig
from mgrpo.training.batch import MicroBatch
from mgrpo.training.parallel import ParallelContext


def _return_hidden(self, hidden_states, weight=None, runtime_gather_output=None):
    if self.sequence_parallel:  # each TP rank holds 1/tp of the tokens; the kernel takes them all, and the
        # gradient it returns is already summed over TP, so backward keeps this rank's slice of it
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                             group=self.tp_group)
    return hidden_states, None


def emit_hidden_states(gpt) -> None:
    """Make GPTModel return final hidden states [b, s, h] instead of logits (last stage only).

    The output layer keeps its parameters (and their gradients, DDP hooks and checkpoints); only
    its matmul is skipped, because the kernel does that matmul chunk by chunk.
    """
    if gpt.post_process:
        gpt.output_layer.forward = types.MethodType(_return_hidden, gpt.output_layer)


def output_weight(gpt) -> torch.Tensor:
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class LogProbHead:
    """Log-probs / loss of response tokens from the last stage's hidden states."""

    def __init__(self, cfg: MGRPOConfig, ctx: ParallelContext):
        self.cfg = cfg
        self.ctx = ctx
        self.temperature = cfg.rollout.temperature
        """The rollout temperature: every forward (old-policy, reference, training) takes log-probs of the
        tempered distribution the rollout sampled from."""

    def _kernel_kwargs(self, weight: torch.Tensor, mb: MicroBatch) -> dict:
        v_local = weight.shape[0]
        return dict(
            temperature=self.temperature,
            impl=self.cfg.actor.logprob_impl,
            chunk_size=self.cfg.actor.logprob_chunk_tokens(v_local),
            tp_group=self.ctx.tp_group if self.ctx.tp > 1 else None,
            vocab_start=self.ctx.tp_rank * v_local,
            vocab_size=self.cfg.model.vocab_size,
            support_offsets=mb.support_offsets,
            support_ids=mb.support_ids,
        )

    @staticmethod
    def _gather(hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return hidden.reshape(-1, hidden.shape[-1])[mb.positions]

    def topk(self, hidden, weight, mb: MicroBatch, k: int):
        """(log-probs [T, k], ids [T, k]) of the k likeliest tokens at each response position, at the rollout
        temperature (forward_kl_topk's teacher side; `mgrpo_kernels.linear_topk`, a chunk of logits at a time)."""
        kw = self._kernel_kwargs(weight, mb)
        return mgrpo_kernels.linear_topk(self._gather(hidden, mb), weight, k, temperature=kw["temperature"],
                                         chunk_size=kw["chunk_size"], tp_group=kw["tp_group"],
                                         vocab_start=kw["vocab_start"], vocab_size=kw["vocab_size"])

    def distill_term(self, h, weight, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        """forward_kl_topk's loss term of one micro-batch: coef x sum over loss tokens of token_weight x the
        per-token forward KL over the teacher's top-k (`algorithms/distill.py::forward_kl_topk`), the student's
        log-probs of those ids differentiable; and its metric sums (global token means, as the policy loss's)."""
        from mgrpo.algorithms.distill import forward_kl_topk

        f, opd = mb.fields, self.cfg.algorithm.opd
        kw = {k: v for k, v in self._kernel_kwargs(weight, mb).items() if not k.startswith("support_")}
        student = mgrpo_kernels.linear_ids_logprobs(h, weight, f["teacher_topk_ids"], **kw)
        kl = forward_kl_topk(student, f["teacher_topk_logprobs"], opd)
        w = f["token_weight"]
        m = (w != 0).float() * mb.metric_weight
        metrics = {"opd/forward_kl": (m * kl).sum().detach(),
                   "opd/student_topk_mass": (m * student.detach().exp().sum(-1)).sum(),
                   "opd/teacher_topk_mass": (m * f["teacher_topk_logprobs"].exp().sum(-1)).sum()}
        return opd.coef * (w * kl).sum(), metrics

    def logprobs(self, hidden, weight, mb: MicroBatch, entropy: bool = True):
        """Per-token log-probs and entropy (None unless `entropy`: the reference needs none, and at a
        real vocabulary the entropy is a second pass over every chunk's logits)."""
        return mgrpo_kernels.linear_logprobs(self._gather(hidden, mb), weight, mb.labels, compute_entropy=entropy,
                                             **self._kernel_kwargs(weight, mb))

    def loss(self, hidden, weight, mb: MicroBatch, per_token: Optional[dict] = None, grad_scale: Optional[float] = None):
        """Policy loss of one micro-batch (already weighted for the global mini-batch) and metric sums.
        `grad_scale`: the gradient the returned loss will receive in the backward (see `train_step`); with it and
        a weight under Megatron's DDP, the kernel adds dWeight to weight.main_grad during the forward.

        A micro-batch without old log-probs trains on-policy (the actor client sends none when exactly
        one optimizer step follows the rollout): pi_old is this forward's own log-probs, detached, which
        is what a separate old-policy forward would have computed. `per_token`, when given, receives
        this forward's detached per-token 'logprobs' and 'entropy' (this rank's tokens)."""
        f = mb.fields
        on_policy = "old_logprobs" not in f
        inputs = TokenLossInputs(
            old_logprob=torch.zeros_like(f["advantages"]) if on_policy else f["old_logprobs"],
            ref_logprob=f.get("ref_logprobs"),
            advantages=f["advantages"],
            rollout_logprob=f.get("rollout_logprobs"),
            token_weight=f["token_weight"],
            metric_weight=torch.full_like(f["token_weight"], mb.metric_weight),
            seq_index=f.get("seq_index"),
        )
        algo = self.cfg.algorithm
        h = self._gather(hidden, mb)
        # A token-level loss runs inside the kernel chunk by chunk (never the full logits); a
        # sequence-level one (or the naive oracle) needs all log-probs first. A micro-batch without
        # response tokens on this rank (under CP the responses may all lie in other ranks' chunks)
        # takes the direct path too: the kernel reports no metrics for no tokens, and every rank
        # must sum the same metric keys.
        chunked = (POLICY_LOSSES[algo.policy_loss].token_level and self.cfg.actor.logprob_impl != "naive"
                   and mb.num_tokens > 0)
        if chunked:
            token_loss = make_token_loss_fn(inputs, algo)
            if on_policy:
                token_loss = _on_policy(token_loss, inputs.old_logprob)
            # Under Megatron's DDP the weight has an fp32 main_grad: the kernel adds dWeight there itself, in the
            # forward where it computes it (Megatron's gradient-accumulation fusion), so the rank never holds a
            # [vocab x hidden] fp32 gradient of its own (155 MiB at Qwen3's vocabulary and hidden 256). The actor's
            # DDP reduces every bucket after the backward (overlap_grad_reduce=False, actor.py), so a weight whose
            # grad bypasses autograd is reduced too.
            into = getattr(weight, "main_grad", None) if grad_scale is not None else None
            loss, metrics, lp, ent = mgrpo_kernels.fused_linear_loss(
                h, weight, mb.labels, token_loss, grad_weight_into=into,
                grad_scale=grad_scale if into is not None else None, **self._kernel_kwargs(weight, mb))
        else:
            lp, ent = mgrpo_kernels.linear_logprobs(h, weight, mb.labels, compute_entropy=True,
                                                    **self._kernel_kwargs(weight, mb))
            if on_policy:
                inputs.old_logprob = lp.detach()
            loss, metrics = policy_loss(lp, ent, inputs, algo)
        if "teacher_topk_ids" in f:  # on-policy distillation's forward_kl_topk: a loss term of its own
            term, more = self.distill_term(h, weight, mb)
            loss = loss + term
            metrics = {**metrics, **more}
        if per_token is not None:
            per_token.update(logprobs=lp.detach(), entropy=ent.detach())  # both paths compute entropy
        return loss, metrics


def _on_policy(token_loss, old_logprob: torch.Tensor):
    """The chunked kernel hands the loss one chunk of log-probs at a time: pi_old of those tokens is
    written just before (a constant of the update: the buffer never takes part in autograd)."""

    def fn(logprob, entropy, sl):
        old_logprob[sl] = logprob.detach()
        return token_loss(logprob, entropy, sl)

    return fn


def run_model(model, mb: MicroBatch, routing=None):
    """The stage's forward on one micro-batch: padded rows, or THD-packed with its PackedSeqParams.
    Mixture-of-experts stages also get the padding mask (padding stays out of the load-balancing loss), and
    their routers this micro-batch's routing replay (`routing`: training/router_replay.py::ModelRouting)."""
    from mgrpo.models.gpt import stage_padding_mask

    mask = stage_padding_mask(model, mb.padding_mask)
    extra = {} if mask is None else {"padding_mask": mask}
    if routing is not None:
        routing.begin(mb)
    out = model(mb.tokens, mb.position_ids, attention_mask=None, packed_seq_params=mb.packed_seq_params, **extra)
    if routing is not None:
        routing.end(mb)
    return out


def in_sample_order(values: torch.Tensor, mb: MicroBatch, cp_group) -> torch.Tensor:
    """This CP rank's per-token values -> the whole micro-batch's, in sample order, on every CP rank.
    Each response token is held by exactly one CP rank, so scattering into zeros and summing over
    the group is exact."""
    if mb.token_order is None:
        return values
    full = values.new_zeros((sum(mb.response_lens), *values.shape[1:]))
    full[mb.token_order] = values
    torch.distributed.all_reduce(full, group=cp_group)
    return full


def forward_only_step(head: LogProbHead, get_weight: Callable[[], torch.Tensor], entropy: bool = True,
                      routing=None, topk: int = 0):
    """forward_step_func for megatron's schedules collecting per-token log-probs (and, with `entropy`,
    entropy; with `topk`, each position's top-k log-probs and ids), in sample order (gathered over the CP
    group). `routing`: see `run_model`."""

    def step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        out = run_model(model, mb, routing)

        def collect(hidden):
            lp, ent = head.logprobs(hidden, get_weight(), mb, entropy=entropy)
            lp, ent = (None if x is None else in_sample_order(x.detach(), mb, head.ctx.cp_group) for x in (lp, ent))
            out = {"logprobs": lp, "entropy": ent}
            if topk:
                k_lp, k_ids = head.topk(hidden, get_weight(), mb, topk)
                out.update(topk_logprobs=in_sample_order(k_lp, mb, head.ctx.cp_group),
                           topk_ids=in_sample_order(k_ids, mb, head.ctx.cp_group))
            return torch.zeros((), dtype=torch.float32), out

        return out, collect

    return step


def train_step(head: LogProbHead, get_weight: Callable[[], torch.Tensor], loss_scale: float, per_token: Optional[list] = None, routing=None,
               num_microbatches: Optional[int] = None):
    """forward_step_func for training. `loss_scale` undoes megatron's averaging over micro-batches and
    data-parallel ranks: our token weights already normalise by the global mini-batch. Under CP each
    rank's loss covers the response tokens it holds; megatron multiplies the loss by cp and averages
    gradients over the dp x cp ranks, so the same scale makes the gradient the sum over CP ranks.
    So the kernel's loss receives loss_scale * cp / num_microbatches in the backward (megatron's forward_step
    with a loss_func returning two values, and no grad_scale_func): given `num_microbatches` the head announces
    that to the kernel (LogProbHead.loss's grad_scale), which checks it in the backward.
    `per_token`, when given, collects each micro-batch's detached {'logprobs', 'entropy'} of this
    forward, in sample order (as `forward_only_step` returns them). `routing`: see `run_model`."""
    grad_scale = None if num_microbatches is None else loss_scale * head.ctx.cp / num_microbatches

    def step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        out = run_model(model, mb, routing)

        def loss_func(hidden):
            got: Optional[dict] = {} if per_token is not None else None
            loss, metrics = head.loss(hidden, get_weight(), mb, per_token=got, grad_scale=grad_scale)
            if got is not None:
                per_token.append({k: in_sample_order(v, mb, head.ctx.cp_group) for k, v in got.items()})
            reported = {k: v.detach().float() for k, v in metrics.items()}
            reported["loss"] = loss.detach().float()
            return loss * loss_scale, reported

        return out, loss_func

    return step


def moe_metrics(model_cfg, ctx, num_microbatches: int) -> dict:
    """The step's load-balancing loss (without its coefficient, averaged over layers) from megatron's
    aux-loss tracker: every layer's loss per micro-batch, summed over the TP and CP ranks that share a
    sequence, averaged over this rank's micro-batches and then over DP ranks, as the gradient weighs it
    (megatron scales each micro-batch's aux-loss gradient by 1/micro-batches; DDP averages over DP)."""
    if not (model_cfg.num_experts and model_cfg.router_aux_loss_coef > 0):
        return {}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    name = "load_balancing_loss"
    tracked = get_moe_layer_wise_logging_tracker().get(name)
    if tracked is not None:  # micro-batch counts differ between DP ranks: average them locally first
        tracked["values"] /= max(num_microbatches, 1)
    totals: dict = {}
    track_moe_metrics(loss_scale=1.0, iteration=0, total_loss_dict=totals, force_initialize=True, track_names=[name],
                      num_layers=model_cfg.num_layers, pg_collection=ctx.pg_collection)
    return {"actor/moe_load_balancing_loss": float(totals[name])}
