"""actor.offload: the actor's and the reference's memory in host memory while the rollout engines that share their
accelerators generate (a module of its own to keep schema.py small; the mechanism is mgrpo/training/offload.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OffloadConfig:
    """What the Megatron ranks move to host memory (pinned on CUDA) while colocated or hybrid engines generate,
    and bring back before the step's first forward. Each trades host<->device copies per step (perf/offload_s,
    perf/offload_bytes) for device memory the engines' KV cache can use (mgrpo-plan shows both). The results
    are bit for bit those of a run without offload (the bytes come back as they left). veRL's param_offload,
    grad_offload and optimizer_offload (FSDP and Megatron, actor and reference) translate to these."""

    params: bool = False
    """The actor's parameters: copied to host after the weight sync's step, restored after generation."""
    grads: bool = False
    """The actor's gradient buffers: released during generation and restored as zeros (every update starts by
    zeroing them, so nothing is copied)."""
    optimizer: bool = False
    """The optimizer's states and fp32 master weights: copied to host during generation, restored after."""
    ref_params: bool = False
    """The reference's parameters: in host memory except during its own forward (frozen, so the host copy is
    made once and only the host-to-device copy recurs)."""

    @property
    def actor_any(self) -> bool:
        return self.params or self.grads or self.optimizer

    @property
    def any(self) -> bool:
        return self.actor_any or self.ref_params
