"""One Megatron rank: a pipeline stage of the trainable actor and of the frozen reference model.

Everything here is plain Python over megatron-core and torch.distributed; `mgrpo.cluster` wraps
this class in a Ray actor and calls its methods on every rank at once. Process groups come from
`init_parallel` and are passed explicitly to the model, the schedules, the kernel and weight sync.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mgrpo.config import MGRPOConfig
from mgrpo.data.packing import over_budget, pack_by_tokens, pack_micro_batches
from mgrpo.heap import trim_before_backward_of
from mgrpo.models import bucketize, iter_megatron_to_hf, load_hf_into_megatron
from mgrpo.models.gpt import build_gpt_model, transformer_config
from mgrpo.training.batch import RankBatch, batch_key, batch_layout, build_micro_batch, by_sample
from mgrpo.training.forward import (LogProbHead, emit_hidden_states, forward_only_step, moe_metrics, output_weight,
                                    train_step)
from mgrpo.training.offload import HostOffload, grad_storages, optimizer_storages, unique_storages
from mgrpo.training.optim import build_optimizer, build_scheduler, optimizer_steps_per_step, torch_optimizers
from mgrpo.training.parallel import destroy_parallel, init_parallel
from mgrpo.training.router_replay import RECORD, REPLAY, ModelRouting, routing_metrics


class MegatronActor:
    def __init__(self, cfg: MGRPOConfig, *, rank: int, world_size: int, master_addr: str, master_port: int,
                 init_hf_dir: str, total_steps: int, need_ref: bool, num_threads: Optional[int] = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.init_hf_dir = init_hf_dir
        a = cfg.actor
        self.ctx = init_parallel(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                                 tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, seed=a.seed)
        use_cpu = self.ctx.device.type == "cpu"
        bf16 = a.dtype == "bf16"
        self.tf_config = transformer_config(cfg.model, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, use_cpu=use_cpu,
                                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                            fp8=a.fp8, fp8_recipe=a.fp8_recipe, fp8_param=a.fp8_param,
                                            cp_comm_type=a.cp_comm_type, recompute=a.recompute,
                                            routing_replay=bool(cfg.model.num_experts))
        # micro-batch layout: padded rows or THD-packed, this rank's CP share, FP8 slot multiples
        self.layout = batch_layout(packed=a.pack_sequences, cp=a.cp, cp_rank=self.ctx.cp_rank,
                                   fp8_recipe=a.fp8_recipe if a.fp8 is not None else None,
                                   sp=a.tp if self.tf_config.sequence_parallel else 1)
        self.head = LogProbHead(cfg, self.ctx)

        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        gpt = self._build_stage(self.tf_config, init_hf_dir)
        self.lora = None
        if a.lora.enabled:  # adapters trained, the base frozen (before DDP: it buffers trainable parameters only)
            from mgrpo.training.lora import attach_lora

            self.lora = attach_lora(gpt, a.lora, num_experts=cfg.model.num_experts, seed=a.seed)
        if gpt.pre_process:  # the heap's freed activations go back before the embedding's dense gradient comes
            trim_before_backward_of(gpt.embedding)
        self.actor = DistributedDataParallel(
            config=self.tf_config,
            # overlap_grad_reduce=False: every bucket is reduced after the backward, also one whose weight's grad
            # the log-prob kernel adds to main_grad itself, in its forward, without autograd's hook (forward.py)
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=a.use_distributed_optimizer),
            module=gpt,
        )
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = self.actor.no_sync
        self.optimizer = build_optimizer(a, [self.actor], bf16=bf16)  # bf16: fp32 master weights inside
        # total_steps counts RL steps; the scheduler advances once per optimizer step
        self.scheduler = build_scheduler(a, self.optimizer, total_steps, optimizer_steps_per_step(cfg))

        self.ref = None
        if need_ref and self.lora is None:  # frozen copy of the initial weights; forward-only, no DDP, no optimizer
            # (nor the actor's DDP hooks: megatron's expert MLP deep-copies its config, and a DDP does not copy)
            self.ref = self._build_stage(replace(self.tf_config, no_sync_func=None, finalize_model_grads_func=None),
                                         init_hf_dir)
            self.ref.requires_grad_(False)
            self.ref.eval()
        self.teacher = self._build_teacher() if cfg.teacher.hf_path and cfg.teacher.mode == "megatron" else None
        # mixture of experts: each model's routers, driven per micro-batch (routing replay and its metrics)
        self.routing = self._routing(gpt)
        self.ref_routing = self._routing(self.ref) if self.ref is not None else None
        if self.lora is not None:  # the reference is the actor's base: its adapters off, its routers
            self.ref_routing = self.routing
        self.skipped_steps = 0
        self.host = HostOffload(pinned=self.ctx.device.type == "cuda")
        """actor.offload: what is in host memory now, and the seconds and bytes moved since the last report."""
        if self.ref is not None and a.offload.ref_params:  # in host memory except during its forwards
            self.host.offload("ref", unique_storages(self.ref.parameters()), frozen=True)
            self.host.take()  # start-up's copy, not a step's
        self._kept_ref: Optional[tuple] = None
        """(batch key, per-sample reference log-probs or None off the last stage, seconds): kept for the update."""

    # --- construction ---------------------------------------------------------------------------
    def _build_stage(self, tf_config, hf_dir: str, model_cfg=None):
        c = self.ctx
        model_cfg = model_cfg or self.cfg.model
        gpt = build_gpt_model(model_cfg, tf_config, pre_process=c.is_first_stage, post_process=c.is_last_stage,
                              pg_collection=c.pg_collection, packed=self.layout.packed)
        load_hf_into_megatron(gpt, hf_dir, model_cfg, tp_rank=c.tp_rank, tp_size=c.tp,
                                            pp_rank=c.pp_rank, pp_size=c.pp)
        emit_hidden_states(gpt)
        return gpt

    def _build_teacher(self):
        """On-policy distillation's Megatron teacher: frozen, forward-only, in the actor's processes and parallel
        layout like the reference, with an architecture of its own (teacher.hf_path's config.json; the
        vocabulary is the student's, checked at start)."""
        from mgrpo.models.hf_config import teacher_model

        model = teacher_model(self.cfg.teacher.hf_path)
        tf = self.tf_config
        tf_config = transformer_config(model, tp=self.ctx.tp, pp=self.ctx.pp, cp=self.ctx.cp, ep=self.ctx.ep,
                                       use_cpu=self.ctx.device.type == "cpu", params_dtype=tf.params_dtype,
                                       fp8=self.cfg.actor.fp8, fp8_recipe=self.cfg.actor.fp8_recipe,
                                       fp8_param=self.cfg.actor.fp8_param, cp_comm_type=self.cfg.actor.cp_comm_type,
                                       recompute=None, routing_replay=False)
        teacher = self._build_stage(tf_config, self.cfg.teacher.hf_path, model)
        teacher.requires_grad_(False)
        teacher.eval()
        return teacher

    def _routing(self, model) -> Optional[ModelRouting]:
        if not self.cfg.model.num_experts:
            return None
        sp = self.ctx.tp if self.tf_config.sequence_parallel else 1
        return ModelRouting(model, sp=sp, sp_rank=self.ctx.tp_rank if sp > 1 else 0)

    def _routing_pass(self, routing: Optional[ModelRouting], batch: RankBatch, which: str, measure: bool = False):
        """Start `routing`'s pass over `batch`: replay the routes the batch carries; the actor's old-policy
        forward under actor.router_replay=old records its own. Returns the action (None: plain routing)."""
        if routing is None:
            return None
        mode = str(self.cfg.actor.router_replay)
        if batch.routed_experts is not None:
            action = REPLAY
        elif mode == "old" and which == "actor":
            action = RECORD
        elif mode == "rollout" or (mode == "old" and which == "update"):
            raise ValueError(f"actor.router_replay={mode!r}: the {which} forward got a batch without routed experts")
        else:
            action = None
        routing.start(action, measure=measure)
        return action

    @property
    def gpt(self):
        """The unwrapped actor stage."""
        return self.actor.module

    def info(self) -> dict:
        from mgrpo.models.capability import fused_paths, resolve_use_te

        c, a = self.ctx, self.cfg.actor
        use_te = resolve_use_te(None, use_cpu=c.device.type == "cpu")  # as the model build resolves it
        return dict(rank=c.rank, tp_rank=c.tp_rank, pp_rank=c.pp_rank, cp_rank=c.cp_rank, dp_rank=c.dp_rank,
                    ep_rank=c.ep_rank, is_last_stage=c.is_last_stage, is_weight_source=c.is_weight_source,
                    paths=fused_paths(use_te=use_te, logprob_impl=a.logprob_impl, fp8=a.fp8,
                                      adam_fused=any(o.defaults.get("fused") for o in torch_optimizers(self.optimizer))))

    # --- megatron schedule plumbing ---------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        """Slots of one micro-batch over the CP group: each CP rank holds 1/cp of them."""
        return self.cfg.actor.max_tokens_per_gpu * self.ctx.cp

    def _micro_batches(self, batch: RankBatch):
        lay = self.layout
        slots = [lay.slots(n) for n in batch.lengths()]
        groups = (pack_by_tokens if lay.packed else pack_micro_batches)(slots, self.token_budget)
        return [build_micro_batch(batch.select(idx), lay).to(self.ctx.device) for idx in groups], groups

    def _run(self, model, step_fn, micro_batches, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=step_fn,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
            forward_only=forward_only,
        )

    # --- log-probs ------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, batch: RankBatch, which: str, keep: bool = False) -> Optional[dict]:
        """Per-response-token log-probs of `which` in {'actor', 'ref', 'teacher'}, and the actor's entropy (None
        per sample for the reference and the teacher, whose entropy nothing reads).

        Returned by the last pipeline stage (one TP and CP rank suffices; all hold the same values).
        `keep` (the reference only): nothing is returned; every rank keeps its values for the update of
        the same batch that follows (`train_mini_batch` without reference log-probs), so they never
        travel to the driver and back."""
        if which == "ref" and self.lora is not None:  # the base with the adapters switched off
            with self.lora.disabled():
                return self._logprobs(self.actor, self.gpt, batch, which, keep)
        model = {"actor": self.actor, "ref": self.ref, "teacher": self.teacher}[which]
        if model is None:
            raise RuntimeError(f"{which} log-probs requested but no {which} model was built")
        gpt = model.module if which == "actor" else model
        if which == "ref":
            self.host.restore("ref")
        try:
            return self._logprobs(model, gpt, batch, which, keep)
        finally:
            if which == "ref" and self.cfg.actor.offload.ref_params:
                self.host.offload("ref", unique_storages(self.ref.parameters()), frozen=True)

    def _logprobs(self, model, gpt, batch: RankBatch, which: str, keep: bool) -> Optional[dict]:
        t0 = time.perf_counter()
        mbs, groups = self._micro_batches(batch)
        # the teacher routes its own experts: the routes the student's engine recorded are not its routers'
        routing = {"actor": self.routing, "ref": self.ref_routing}.get(which)
        action = self._routing_pass(routing, batch, which)
        step = forward_only_step(self.head, lambda: output_weight(gpt), entropy=which == "actor", routing=routing,
                                 topk=self.cfg.algorithm.opd.teacher_topk if which == "teacher" else 0)
        try:
            out = self._run(model, step, mbs, True)
            routes = (routing.recorded_per_sample(mbs, groups, batch.lengths(), self.ctx, self.cfg.model.num_layers)
                      if action == RECORD else None)
        finally:
            if routing is not None:
                routing.finish()  # a forward-only pass leaves no targets behind
        if keep:
            if which != "ref":
                raise ValueError("only the reference's log-probs are kept for the update")
            values = by_sample(len(batch), mbs, groups, out)["logprobs"] if self.ctx.is_last_stage else None
            self._kept_ref = (batch_key(batch), values, time.perf_counter() - t0)
            return None
        if not self.ctx.reports:
            return None
        result = by_sample(len(batch), mbs, groups, out)
        if action == RECORD:  # actor.router_replay=old: what the update replays
            result["routed_experts"] = routes
        return result

    # --- training -------------------------------------------------------------------------------
    def train_mini_batch(self, batch: RankBatch) -> dict:
        """One optimizer step on this rank's share of a mini-batch. Returns the step's metrics from the
        last pipeline stage, already summed over micro-batches and data-parallel ranks.

        A batch without old log-probs trains on-policy (pi_old = this forward, detached; see
        `LogProbHead.loss`); the reporting rank then also returns the forward's per-sample log-probs
        and entropy under 'per_sample', as `compute_logprobs` would have."""
        ref_seconds = None
        if batch.ref_logprobs is None and self._kept_ref is not None:  # computed just before, kept here
            key, values, ref_seconds = self._kept_ref
            self._kept_ref = None
            if key != batch_key(batch):
                raise RuntimeError("the kept reference log-probs belong to another batch than this update's")
            batch = replace(batch, ref_logprobs=values)
        self.actor.train()
        self.actor.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs, groups = self._micro_batches(batch)
        per_token = [] if batch.old_logprobs is None else None
        # megatron divides each micro-batch loss by num_microbatches and averages gradients over DP;
        # our token weights are already normalised by the global mini-batch, so both are undone.
        scale = float(len(mbs) * self.ctx.dp)
        t0 = time.perf_counter()
        action = self._routing_pass(self.routing, batch, "update", measure=True)
        step_fn = train_step(self.head, lambda: output_weight(self.gpt), scale, per_token=per_token,
                             routing=self.routing, num_microbatches=len(mbs))
        try:
            metrics = self._reduce_metrics(self._run(self.actor, step_fn, mbs, False))
            metrics.update(moe_metrics(self.cfg.model, self.ctx, len(mbs)))
            if self.routing is not None:
                metrics.update(routing_metrics(self.routing, self.ctx, num_layers=self.cfg.model.num_layers,
                                               num_experts=self.cfg.model.num_experts, replayed=action == REPLAY))
        finally:
            if self.routing is not None:
                self.routing.finish()
        finite = torch.tensor([float(all(map(math.isfinite, metrics.values())))])
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank must agree to step or to skip
        ok, grad_norm = False, float("nan")
        if finite.item() == 1.0:
            ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        else:  # a non-finite loss or gradient: no update, counted in metrics
            self.skipped_steps += 1
            self.optimizer.zero_grad()
        metrics = {(k if k.startswith("actor/") else "actor/" + k): v for k, v in metrics.items()}
        metrics.update({
            "actor/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/skipped_steps": float(self.skipped_steps),
            "actor/micro_batches": float(len(mbs)),
            # samples longer than actor.max_tokens_per_gpu: each ran alone in a micro-batch over budget
            "actor/over_budget_samples": float(len(over_budget(batch.lengths(), self.token_budget))),
            "timing_s/fwd_bwd": time.perf_counter() - t0,
        })
        if ref_seconds is not None:  # the kept reference forward, on the ranks while the driver judged
            metrics["timing_s/ref_on_ranks"] = ref_seconds
        if per_token is not None and self.ctx.reports:
            metrics["per_sample"] = by_sample(len(batch), mbs, groups, per_token)
        return metrics

    def _reduce_metrics(self, out: Sequence[dict]) -> dict:
        """Sum the per-micro-batch metric sums on the last stage, then over DP and CP (each CP rank's sums
        cover the tokens it holds); share along the pipeline."""
        c = self.ctx
        metrics: dict = {}
        if c.is_last_stage:
            keys = sorted(out[0]) if out else []
            vec = torch.tensor([sum(float(m[k]) for m in out) for k in keys], dtype=torch.float64)
            dist.all_reduce(vec, group=c.dp_cp_group)
            metrics = dict(zip(keys, vec.tolist()))
        if c.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=dist.get_global_rank(c.pp_group, c.pp - 1), group=c.pp_group)
            metrics = box[0]
        return metrics

    # --- host memory while the engines generate (actor.offload) ----------------------------------
    def offload(self) -> dict:
        """Move what actor.offload names to host memory (before the engines generate); the seconds and bytes
        moved since the last report (a reference release after its last forward included)."""
        o = self.cfg.actor.offload
        if o.optimizer:  # first: which storages are the optimizer's own is told apart from resident ones
            self.host.offload("optimizer", optimizer_storages(self.optimizer, self.actor, self.gpt))
        if o.grads:  # zeroed at the start of every update: nothing worth copying
            self.host.offload("grads", grad_storages(self.actor, self.gpt), copy=False)
        if o.params:
            self.host.offload("params", unique_storages(self.gpt.parameters()))
        return self.host.take()

    def restore(self) -> dict:
        """Bring the actor's offloaded memory back (after generation, before the step's first forward), and the
        reference's, whose forward comes next (so that its copy is counted in this step)."""
        for name in ("params", "grads", "optimizer", "ref"):
            self.host.restore(name)
        return self.host.take()

    def offloaded_bytes(self) -> dict:
        return self.host.held()

    # --- weight sync ----------------------------------------------------------------------------
    def _export_stream(self):
        """This rank's part in streaming its pipeline stage out in HF layout, or None if it takes none.

        The weight source (TP rank 0 of data-parallel replica 0, CP rank 0) emits the whole stage: its TP
        group gathers the dense weights and, in a mixture-of-experts model, its expert-parallel group
        (expert-data-parallel rank 0) gathers the experts to it. One sender per stage, as for a dense
        model: the engines' transports, buckets and update protocol do not change with EP (every EP
        rank a sender would multiply the senders each engine must wait for and split the update's close)."""
        c = self.ctx
        experts = bool(self.tf_config.num_moe_experts) and c.exports_experts
        if not (c.exports_weights or experts):
            return None
        named = iter_megatron_to_hf(self.gpt, self.cfg.model, tp_group=c.tp_group, tp_size=c.tp, pp_rank=c.pp_rank,
                                   pp_size=c.pp, ep_group=c.ep_group, ep_size=c.ep, dense=c.exports_weights,
                                   experts=experts)
        # LoRA: the engines and HF exports take base + scaling * B @ A, merged while the stream runs
        return named if self.lora is None else self.lora.merged_stream(named)

    def shareable_weights(self) -> list:
        """(HF name, tensor) of the weights that export as this rank's own parameter memory (no TP, PP or EP
        split, no conversion: the embedding, norms, output projections), for an engine in this process to
        use in place of its copies (`HFRolloutEngine.share`); empty elsewhere."""
        c = self.ctx
        if c.tp * c.pp * c.ep != 1 or not c.exports_weights:
            return []
        ptrs = {p.data_ptr() for p in self.gpt.parameters()}
        return [(n, t) for n, t in self._export_stream() if t.data_ptr() in ptrs]

    @torch.no_grad()
    def sync_weights(self, receivers: Sequence, bucket_bytes: int, finish_version: Optional[int] = None) -> dict:
        """Stream this stage's weights in HF layout to every rollout engine.

        The ranks of `_export_stream` iterate (the TP and EP gathers are collectives); the weight-source
        ranks (one per pipeline stage) send. Other replicas hold identical weights and do nothing.
        `finish_version`: this rank is the only sender (one pipeline stage), so once its buckets are in
        it closes the update on every engine itself ('finished' in the result), sparing the driver a
        round trip."""
        c = self.ctx
        sent, tensors, t0 = 0, 0, time.perf_counter()
        failed: Optional[Exception] = None
        named = self._export_stream()
        if named is not None:
            for bucket in bucketize(named, bucket_bytes):
                if c.is_weight_source and failed is None:
                    try:
                        for r in receivers:
                            r.update_weights(bucket)
                    except Exception as err:  # noqa: BLE001 - an engine died or hung while taking the weights:
                        failed = err  # the stream goes on (its TP/EP gathers are collectives), raised after it
                        continue
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    tensors += len(bucket)
        if failed is not None:
            raise failed
        finished = finish_version is not None and c.is_weight_source
        if finished:
            for r in receivers:
                r.finish_weight_update(finish_version)
        return {"bytes": sent, "tensors": tensors, "seconds": time.perf_counter() - t0, "finished": finished}

    def save_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Write the actor as an HF checkpoint: the weight source of each pipeline stage (TP rank 0 of
        replica 0) streams its stage's shards to disk; no rank ever holds the whole model."""
        from mgrpo.models.weight_iter import save_hf_checkpoint_distributed

        c = self.ctx
        named = self._export_stream()
        save_hf_checkpoint_distributed(out_dir, named if named is not None else iter(()), self.cfg.model,
                                       writer=c.is_weight_source, stage=c.pp_rank, tokenizer_dir=tokenizer_dir)
        if self.lora is not None and not self.cfg.model.num_experts:
            self.save_peft(os.path.join(out_dir, "lora_adapter"))

    def save_peft(self, out_dir: str) -> None:
        """The adapters as a PEFT adapter (adapter_config.json, adapter_model.safetensors) for the initial
        HF weights."""
        from mgrpo.models.peft_export import write_peft_adapter

        tensors = self.peft_tensors()
        if tensors is not None:
            write_peft_adapter(out_dir, tensors, self.cfg.actor.lora, self.init_hf_dir,
                               tied=self.cfg.model.tie_word_embeddings)

    def peft_tensors(self) -> Optional[dict]:
        """{PEFT key: CPU tensor} of every adapter on global rank 0, None elsewhere (every rank takes part)."""
        from mgrpo.training.lora import gather_peft

        return gather_peft(self.gpt, self.cfg.model, self.ctx)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        from mgrpo.training.checkpoint import save_checkpoint

        save_checkpoint(self, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        from mgrpo.training.checkpoint import load_checkpoint

        load_checkpoint(self, ckpt_dir)

    def shutdown(self) -> None:
        destroy_parallel()
