"""Front doors for other projects' command lines and configs, translated into mgrpo's typed config.

  verl/      veRL's Hydra keys (`python3 -m verl.trainer.main_ppo ...` lines) -> mgrpo overrides
  slime.py   slime's train.py flags (`python3 train.py --hf-checkpoint ... --use-opd ...`) -> mgrpo overrides

A compat module depends on `mgrpo.config` (and reads model families for checkpoints it is pointed at);
nothing below the launchers imports it.
"""
