"""veRL command lines: `mgrpo-train` and `mgrpo-plan` take veRL's keys (see translate.py).

  translate.py    veRL's Hydra keys -> mgrpo's, before Hydra composes
  rules.py        the key table: what becomes of each veRL key
  kit.py          the table's building blocks (rules over a key's value and the command line's other values)
  layout.py       veRL's layout keys: parallel sizes, offloading, Megatron settings, engine count
  reward.py       veRL's reward keys, both layouts (reward_model.* / reward.reward_model.*)
  multi_turn.py   veRL's multi-turn keys -> rollout.multi_turn.*
  distill.py      veRL's on-policy distillation keys (distillation.*) -> teacher.*, algorithm.opd.*
lora.py         veRL's LoRA keys (both layouts) -> actor.lora.*
  tools.py        veRL's own tools and interactions by the class names its configs write
  user_config.py  a user's veRL config behind --config-path / --config-name
"""

from mgrpo.compat.verl.translate import Translation, VerlKeyError, translate

__all__ = ["Translation", "VerlKeyError", "translate"]
