"""Process groups of one Megatron rank.

`init_parallel` is the only place that touches megatron's global `parallel_state`: it creates the
tensor/pipeline/context/data-parallel groups and hands them back in a `ParallelContext`, which the
rest of the trainer passes explicitly (models, schedules, kernels, weight sync never look groups up).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mgrpo.training.cpu_compat import apply_cpu_patches, needs_patches


@dataclass
class ParallelContext:
    world_size: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    device: torch.device
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    ep: int = 1
    """Expert-parallel size: each group of ep ranks (within tp x cp x dp) splits every MoE layer's experts."""
    ep_rank: int = 0
    expt_dp_rank: int = 0
    """Rank among the ranks holding the same experts (tp x cp x dp / ep of them)."""

    @property
    def tp_group(self):
        return self.pg_collection.tp

    @property
    def pp_group(self):
        return self.pg_collection.pp

    @property
    def dp_group(self):
        return self.pg_collection.dp

    @property
    def cp_group(self):
        return self.pg_collection.cp

    @property
    def dp_cp_group(self):
        """Ranks that hold identical weights (data-parallel replicas x CP ranks): gradients and the
        metric sums of the loss are reduced over it, since each CP rank holds part of every sample."""
        return self.pg_collection.dp_cp

    @property
    def ep_group(self):
        return self.pg_collection.ep

    @property
    def expt_dp_group(self):
        """Ranks holding the same experts: expert gradients are reduced over it."""
        return self.pg_collection.expt_dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    # --- rank roles: which rank does what, written once -----------------------------------------------
    @property
    def reports(self) -> bool:
        """Returns its data-parallel replica's per-sample results: the last stage holds them, and every TP
        and CP rank of it holds the same values, so one of each answers."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0

    @property
    def exports_weights(self) -> bool:
        """Takes part in exporting its stage's weights (weight sync, HF export): replica 0's TP ranks, since
        gathering a TP-sharded tensor is a collective. Other replicas and CP ranks hold the same weights.
        (A mixture-of-experts stage's experts: `exports_experts`.)"""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def is_weight_source(self) -> bool:
        """Sends (or writes) its pipeline stage's gathered weights: one exporting rank per stage."""
        return self.exports_weights and self.tp_rank == 0

    @property
    def exports_experts(self) -> bool:
        """Takes part in streaming the stage's experts out: the weight source's expert-parallel group,
        which holds every expert once, gathers them to it (its expert-data-parallel replicas do not)."""
        return self.expt_dp_rank == 0


def init_parallel(*, rank: int, world_size: int, master_addr: str, master_port: int, tp: int, pp: int,
                  cp: int = 1, ep: int = 1, seed: int = 1, timeout_s: float = 600.0) -> ParallelContext:
    """Join the trainer's process group (NCCL on GPU, gloo on CPU) and build megatron's groups
    (`ep`: expert-parallel size, expert tensor parallelism 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mgrpo.models.rope import install as install_thd_rope

    cuda = not needs_patches()
    if not cuda:
        apply_cpu_patches()
    install_thd_rope()  # megatron's unfused THD RoPE without its per-sequence loop (exact; any device)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    if not dist.is_initialized():
        dist.init_process_group(
            # NCCL for CUDA tensors; gloo too, for the few small CPU tensors ranks agree on (skip flags, metrics).
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
    # Same seed on every rank for replicated parameters; megatron offsets the TP-rank streams.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelContext(
        world_size=world_size,
        rank=rank,
        tp=tp,
        pp=pp,
        cp=cp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        pg_collection=pgs,
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        expt_dp_rank=ps.get_expert_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
