"""The `actor.lora` section's targets and checks (no torch: the validator and the veRL front door use them).

Megatron names the linears an adapter can sit on linear_qkv, linear_proj, linear_fc1 and linear_fc2 (the
output layer is never adapted); HF/PEFT names map onto them, and since megatron fuses q/k/v and gate/up into
one linear each, a fused group is named whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names of the linear layers an adapter can sit on (the output layer is never adapted)."""
HF_NAMES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
            "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""HF/PEFT module names -> the megatron linear that holds them (megatron fuses q/k/v and gate/up)."""
FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
EXPERTS = "experts"
"""Target name for the routed experts' fc1 and fc2 only (a mixture-of-experts model)."""
ALL = "all-linear"
SAVED = {"embed_tokens": "embedding.word_embeddings", "lm_head": "output_layer"}
"""PEFT's `modules_to_save` names this actor can train whole -> the megatron module (with tied embeddings both
name the one shared matrix)."""
SYNC = ("auto", "adapter", "merged")
"""actor.lora.sync: how the engines get the trained policy (see LoraConfig.sync)."""
INIT_A = ("kaiming", "xavier", "uniform")
"""lora_A initialisations: PEFT's kaiming_uniform(a=sqrt(5)), Megatron-Bridge's xavier (normal) and uniform
(xavier-uniform)."""


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (megatron, dotted) is an adapter's."""
    return name.rsplit(".", 1)[-1].startswith("lora_")


@dataclass(frozen=True)
class Targets:
    linears: frozenset
    """Megatron linear names adapted everywhere (dense MLPs and experts alike), and `experts`: the routed
    experts' fc1 and fc2."""

    def matches(self, path: str) -> bool:
        parts = path.split(".")
        leaf = parts[-1]
        if leaf not in LINEARS or not any(p == "layers" for p in parts):
            return False
        if leaf in self.linears:
            return True
        return "local_experts" in parts and EXPERTS in self.linears and leaf in ("linear_fc1", "linear_fc2")


def parse_targets(names, *, num_experts: int, key: str = "actor.lora.target_modules") -> Targets:
    """The adapted linears for `names` (megatron names, HF/PEFT names, 'all-linear', 'experts'); a
    ValueError naming `key` for a name that adapts nothing in this model."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"{key} is empty: name the linears to adapt, e.g. all-linear")
    chosen: set = set()
    for n in names:
        if n == ALL:
            chosen.update(LINEARS)
        elif n in LINEARS:
            chosen.add(n)
        elif n in HF_NAMES:
            fused = HF_NAMES[n]
            group = FUSED.get(fused, (n,))
            missing = [g for g in group if g not in names and ALL not in names and fused not in names]
            if missing:
                raise ValueError(f"{key}: {n} without {', '.join(missing)}: megatron computes {'/'.join(group)} in "
                                 f"one linear ({fused}), so name all of them (or {fused})")
            chosen.add(fused)
        elif n == EXPERTS:
            if not num_experts:
                raise ValueError(f"{key}: {EXPERTS!r} matches no module: the model has no experts "
                                 "(model.num_experts=0)")
            chosen.add(EXPERTS)
        else:
            raise ValueError(f"{key}: {n!r} matches no module; choose from {ALL}, {', '.join(LINEARS)}, "
                             f"{', '.join(HF_NAMES)}" + (f", {EXPERTS}" if num_experts else ""))
    return Targets(frozenset(chosen))


def check_lora(lora, *, num_experts: int) -> Optional[str]:
    """The one-line problem with an `actor.lora` section, or None."""
    if lora.rank is None:
        return None
    if int(lora.rank) < 1:
        return f"actor.lora.rank={lora.rank}: a LoRA rank is at least 1 (leave it unset to train every weight)"
    if not lora.alpha > 0:
        return f"actor.lora.alpha={lora.alpha}: must be > 0 (the adapters' scaling is alpha / rank)"
    if lora.init_a not in INIT_A:
        return f"actor.lora.init_a={lora.init_a!r}: choose from {', '.join(INIT_A)}"
    if not 0.0 <= lora.dropout < 1.0:
        return f"actor.lora.dropout={lora.dropout}: must be in [0, 1)"
    try:
        parse_targets(lora.target_modules, num_experts=num_experts)
    except ValueError as err:
        return str(err)
    unknown = [m for m in lora.modules_to_save if m not in SAVED]
    if unknown:
        return (f"actor.lora.modules_to_save: {unknown[0]!r} is not a module this actor can train whole; "
                f"choose from {', '.join(SAVED)}")
    if lora.sync not in SYNC:
        return f"actor.lora.sync={lora.sync!r}: choose from {', '.join(SYNC)}"
    return None


def adapter_sync_problem(lora, *, engine: str, num_experts: int) -> Optional[str]:
    """Why the engines cannot take the adapters alone (SGLang's LoRA protocol) in this job, or None."""
    engine = getattr(engine, "value", engine)
    if engine != "sglang":
        return (f"rollout.engine={engine}: only SGLang engines load adapters (/load_lora_adapter_from_tensors); "
                "the in-process engine takes merged weights")
    linears = parse_targets(lora.target_modules, num_experts=num_experts).linears
    if num_experts and linears & {EXPERTS, "linear_fc1", "linear_fc2"}:
        return ("adapters on a mixture-of-experts model's experts: the PEFT layout mgrpo exports has no per-expert "
                "adapters (transformers fuses the experts) and the CPU server does not apply expert adapters")
    if lora.modules_to_save:
        return (f"actor.lora.modules_to_save={list(lora.modules_to_save)}: SGLang's LoRA adapters carry low-rank "
                "factors only (a module trained whole is not part of what /load_lora_adapter_from_tensors loads)")
    return None


def hf_targets(lora, *, num_experts: int) -> list[str]:
    """The HF/PEFT module names the adapters sit on (megatron's fused linears split as PEFT names them)."""
    linears = parse_targets(lora.target_modules, num_experts=num_experts).linears
    by = {"linear_qkv": FUSED["linear_qkv"], "linear_proj": ("o_proj",), "linear_fc1": FUSED["linear_fc1"],
          "linear_fc2": ("down_proj",)}
    return [n for lin in LINEARS if lin in linears for n in by[lin]]


def sync_mode(lora, *, engine: str, num_experts: int) -> str:
    """'adapter' or 'merged': actor.lora.sync resolved (auto: adapter where the engines can take it)."""
    if lora.sync != "auto":
        return lora.sync
    return "merged" if adapter_sync_problem(lora, engine=engine, num_experts=num_experts) else "adapter"


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (PEFT's formula: y = W x + alpha/rank * B A dropout(x)); the base weights are
    frozen, the optimizer and gradient clipping see the adapters only, and the reference policy is the base
    with the adapters switched off (no second model)."""

    rank: Optional[int] = None
    """Adapter rank; None trains every weight (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator (PEFT's lora_alpha; veRL's default 16): the adapter's output is scaled by alpha/rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linears to adapt: all-linear, megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF names
    (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; megatron fuses q/k/v and gate/up, so name a
    fused group whole), or experts (a mixture-of-experts model's routed experts' fc1 and fc2). linear_fc1/fc2
    adapt the experts too."""
    init_a: str = "kaiming"
    """kaiming | xavier | uniform: lora_A's initialisation (PEFT's kaiming-uniform with a=sqrt(5); Megatron-Bridge's
    and veRL's xavier-normal and xavier-uniform); lora_B starts at zero."""
    modules_to_save: list[str] = field(default_factory=list)
    """PEFT's modules_to_save: modules trained whole beside the adapters: embed_tokens (the input embedding) and
    lm_head (the output layer; with tied embeddings both are the one shared matrix). The reference keeps their
    initial weights."""
    sync: str = "auto"
    """How the engines get the trained policy after each step: adapter (only the adapters, in PEFT layout, through
    SGLang's /load_lora_adapter_from_tensors under a versioned name that generate requests name), merged (base +
    alpha/rank * B A through the full-weight path), or auto (adapter where it can be used: SGLang engines, no
    adapters on experts, no modules_to_save; else merged)."""

    @property
    def enabled(self) -> bool:
        return self.rank is not None
