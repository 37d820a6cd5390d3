"""veRL's LoRA keys -> mgrpo's actor.lora.*; part of the key table in rules.py.

Both of veRL's layouts: the older flat keys (actor_rollout_ref.model.lora_rank / lora_alpha / target_modules,
its FSDP path, rank 0 = off) and the Megatron section actor_rollout_ref.model.lora.* (Megatron-Bridge's PEFT
settings: rank 0 = off, lora_A_init_method, ...). Keys that only tune veRL's engine are accepted with the reason;
settings mgrpo does not have are refused with what to do instead.
"""

from __future__ import annotations

from mgrpo.compat.verl.kit import M, Refuse, Rule, falsy, ignore, only

L = M + "lora."


def _rank(v, ctx):
    if falsy(v):  # veRL: 0 = no LoRA
        return [("", "0: full fine-tuning, as in mgrpo without actor.lora.rank")]
    return [("actor.lora.rank", int(v))]


def _alpha(v, ctx):
    return [("actor.lora.alpha", float(v))]


def _targets(v, ctx):
    names = [v] if isinstance(v, str) else list(v or [])
    return [("actor.lora.target_modules", names)]


def _init_a(v, ctx):
    name = str(v).lower()
    if name not in ("kaiming", "xavier", "uniform"):
        raise Refuse(f"{v!r}: mgrpo initialises lora_A as kaiming (PEFT's), xavier or uniform")
    return [("actor.lora.init_a", name)]


def _type(v, ctx):
    if str(v).lower() != "lora":
        raise Refuse(f"{v!r}: mgrpo trains plain LoRA adapters (type: lora)")
    return [("", "lora, as mgrpo")]


def _merge(v, ctx):
    return [("", "mgrpo sends the engines base + alpha/rank * B @ A (merged) whatever this says; the engines' "
                 "outputs are those of the adapted model either way")]


LORA_RULES: dict[str, Rule] = {
    M + "lora_rank": _rank,
    M + "lora_alpha": _alpha,
    M + "target_modules": _targets,
    M + "exclude_modules": only(falsy, "none excluded, as in mgrpo",
                                "mgrpo has no exclude list: name the linears to adapt in target_modules"),
    M + "lora_adapter_path": only(falsy, "null: adapters start at B = 0",
                                  "mgrpo does not load a saved adapter as the start; merge it into the base first"),
    L + "rank": _rank,
    L + "alpha": _alpha,
    L + "dropout": lambda v, ctx: [("actor.lora.dropout", float(v))],
    L + "target_modules": _targets,
    L + "exclude_modules": only(falsy, "none excluded, as in mgrpo",
                                "mgrpo has no exclude list: name the linears to adapt in target_modules"),
    L + "lora_A_init_method": _init_a,
    L + "lora_B_init_method": only(lambda v: str(v).lower() in ("zero", "zeros"), "zero, as mgrpo",
                                   "mgrpo starts lora_B at zero (the adapted model starts as the base)"),
    L + "dropout_position": only(lambda v: str(v).lower() == "pre", "pre (on the adapter's input), as mgrpo",
                                 "mgrpo applies LoRA dropout on the adapter's input (pre), as PEFT does"),
    L + "type": _type,
    L + "merge": _merge,
    L + "a2a_experimental": ignore("Megatron-Bridge's expert communication for adapters (speed only)"),
    L + "dtype": only(falsy, "null: the training dtype, as mgrpo",
                      "mgrpo keeps adapters in the training dtype (actor.dtype)"),
    L + "adapter_path": only(falsy, "null: adapters start at B = 0",
                             "mgrpo does not load a saved adapter as the start; merge it into the base first"),
    L + "freeze_vision_model": ignore("mgrpo trains text models"),
    L + "freeze_vision_projection": ignore("mgrpo trains text models"),
    L + "freeze_language_model": only(falsy, "false", "mgrpo trains the language model's adapters"),
}
