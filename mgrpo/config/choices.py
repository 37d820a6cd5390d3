"""The closed choices of config fields, declared once: the schema types its fields with them, Hydra refuses
anything else while composing (naming the key and the choices), and every room reads them from here.

They are `StrEnum`s: a member equals its string (`RolloutMode.HYBRID == "hybrid"`), prints as it, and is
written to JSON as it, so a config built in Python with plain strings behaves the same. Member names are
the values Hydra accepts on the command line (OmegaConf looks enum values up by name).

Open choices, whose names are registered by the room that implements them (advantage estimators, policy
losses, KL estimators, loss aggregation modes, model families, synthetic tasks, reward functions), are not
here: their registries are the one source of their names (mgrpo.config.registry), and mgrpo/preflight.py
checks them.
"""

from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(StrEnum):
    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class LogprobImpl(StrEnum):
    """The log-prob / loss kernel path (mgrpo_kernels)."""

    fused = "fused"
    """Triton; GPU (CPU under TRITON_INTERPRET=1)."""
    chunked = "chunked"
    """torch, one chunk of logits at a time."""
    naive = "naive"
    """full [tokens x vocab] logits: the oracle, small vocabularies only."""


class LogprobSupport(StrEnum):
    """The distribution the trainer's log-probs are taken over (algorithm.logprob_support)."""

    full = "full"
    """the whole tempered vocabulary"""
    sampled = "sampled"
    """each token's sampling support under rollout.top_k / rollout.top_p, renormalised"""


class Recompute(StrEnum):
    full = "full"
    selective = "selective"


class LrDecayStyle(StrEnum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Fp8Format(StrEnum):
    e4m3 = "e4m3"
    hybrid = "hybrid"


class Fp8Recipe(StrEnum):
    delayed = "delayed"
    tensorwise = "tensorwise"
    blockwise = "blockwise"
    mxfp8 = "mxfp8"


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""TransformerConfig.cp_comm_type (Transformer Engine's CP exchange); a tuple, not an enum, because
'a2a+p2p' is not a name Hydra could look up."""


class Engine(StrEnum):
    sglang = "sglang"
    hf = "hf"


class RouterReplay(StrEnum):
    """Whose expert choices the trainer's MoE routers follow (megatron-core's RouterReplay)."""

    off = "off"
    """each forward routes by itself"""
    rollout = "rollout"
    """R3: the experts the rollout engine routed each token to, in every trainer forward (old policy,
    reference, update)"""
    old = "old"
    """R2: the experts the trainer's own old-policy forward chose, replayed in the update"""


class RolloutMode(StrEnum):
    colocated = "colocated"
    hybrid = "hybrid"
    disaggregated = "disaggregated"


class Isolation(StrEnum):
    """How model-written code is isolated (mgrpo/sandbox/isolation.py); a named level is required."""

    auto = "auto"
    """the strongest level this machine gives: bwrap, else unshare; refuse when neither works"""
    bwrap = "bwrap"
    """bubblewrap: namespaces, no network, a read-only view of the interpreter only, tmpfs scratch"""
    unshare = "unshare"
    """util-linux unshare: namespaces and no network, but the host's files visible to the sandbox user"""


class AsyncMode(StrEnum):
    off = "off"
    one_step_off = "one_step_off"
    bounded_staleness = "bounded_staleness"


class TruncateSide(StrEnum):
    """Which part of a too long tool reply is kept (rollout.multi_turn.tool_response_truncate_side), as veRL."""

    left = "left"
    """the start"""
    right = "right"
    """the end"""
    middle = "middle"
    """both ends"""


class OnToolError(StrEnum):
    """A malformed call, an unknown tool or bad arguments (rollout.multi_turn.on_tool_error)."""

    reply = "reply"
    """the error goes back as the tool's reply, counted"""
    mask = "mask"
    """the same, and the trajectory is kept out of the loss"""


class ToolChoice(StrEnum):
    """OpenAI's and SGLang's tool_choice for an assistant turn (rollout.multi_turn.tool_choice)."""

    auto = "auto"
    """the model decides; only tools marked `strict: true` are constrained"""
    required = "required"
    """the turn calls a tool: the grammar writes the call"""


class Logger(StrEnum):
    console = "console"
    tensorboard = "tensorboard"


class Gsm8kMethod(StrEnum):
    """Where the GSM8K judge finds the answer (veRL's verl/utils/reward_score/gsm8k.py)."""

    strict = "strict"
    """after the last '#### ' (veRL's default): the answer format is part of the score"""
    flexible = "flexible"
    """the last number in the response"""


class RewardModelKind(StrEnum):
    """What a reward.models entry serves."""

    classifier = "classifier"
    """a sequence classifier (Bradley-Terry reward model), SGLang --is-embedding, scored through /classify"""
    generative = "generative"
    """a chat model used as a judge (reward.models.<name>.judge): a prompt template, its answer parsed to a score"""


class RewardPlacement(StrEnum):
    """Where a reward.models entry's engines run (reward.models.<name>.placement)."""

    own = "own"
    """accelerators of their own, beside the trainer's and the rollout's"""
    shared = "shared"
    """on the rollout engines' accelerators, holding gpu_memory_utilization of each card all run long"""


class JudgeParser(StrEnum):
    """How a generative judge's answer becomes a score (mgrpo/rewards/judge.py)."""

    number = "number"
    """the last match of judge.pattern, within judge.range"""
    json = "json"
    """judge.json_key of the last JSON object in the answer, within judge.range"""
    yes_no = "yes_no"
    """P(yes) / (P(yes) + P(no)) at the first answer position, from the engine's top log-probs"""


class SmallGroup(StrEnum):
    """What happens to a prompt group left with too few scored samples after reward failures
    (reward.failed.small_group)."""

    drop = "drop"
    """the whole group leaves the loss (counted as reward/dropped_groups)"""
    rejudge = "rejudge"
    """its failed samples are scored again (reward.failed.rejudge_attempts rounds), then dropped if still short"""


def values(choice: type[StrEnum]) -> list[str]:
    """The accepted strings of a choice, in declaration order (for messages)."""
    return [m.value for m in choice]


def is_choice(value, choice: type[StrEnum]) -> bool:
    """`value` is one of `choice`'s strings (a plain string from a Python-built config counts)."""
    return value in {m.value for m in choice}


def plain(cfg):
    """A copy of a config dataclass whose choices are plain strings. Hydra hands back enum members; the
    rooms below receive what a Python-built config holds (the values travel into megatron's state, Ray
    messages and checkpoints, where a class of ours must not be needed to read them back)."""
    import dataclasses

    def convert(value):
        if isinstance(value, StrEnum):
            return str(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: convert(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return convert(cfg)


class TeacherMode(StrEnum):
    """Where the on-policy distillation teacher runs (teacher.mode)."""

    megatron = "megatron"
    """A frozen Megatron model in the actor's ranks, laid out like the reference."""
    sglang = "sglang"
    """An auxiliary SGLang engine returning the log-probs of the student's tokens."""


class OpdLossMode(StrEnum):
    """The on-policy distillation signal (algorithm.opd.loss_mode)."""

    reverse_kl = "reverse_kl"
    """Per sampled token, log pi_student - log pi_teacher, subtracted from the advantage (x coef)."""
    forward_kl_topk = "forward_kl_topk"
    """Per response position, sum over the teacher's top-k tokens of p_teacher (log p_teacher - log p_student),
    a loss term of its own (x coef), differentiated through the student's log-probs (veRL's forward_kl_topk)."""
