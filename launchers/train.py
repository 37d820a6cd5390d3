"""mgrpo-train: the Hydra front door onto `Trainer(config).fit()`.

    mgrpo-train                                   # the default CPU job (tiny Qwen3 learns sums)
    mgrpo-train actor.lr=1e-5 rollout.n=8 trainer.total_training_steps=50
    mgrpo-train actor.tp=2                        # same job on two tensor-parallel Megatron ranks
    mgrpo-train recipe=qwen3-8b-gsm8k-grpo        # a ready recipe from configs/recipe/
    mgrpo-train --cfg job                         # print the composed config and exit
    mgrpo-train actor_rollout_ref.actor.optim.lr=1e-6 data.train_batch_size=1024 ...   # a veRL command line
    mgrpo-train --hf-checkpoint DIR --use-opd --opd-type megatron --opd-teacher-load DIR ...   # a slime one

slime's flags (mgrpo.compat.slime), then veRL's keys (mgrpo.compat.verl), are translated into mgrpo's before
Hydra composes: the table of what became of each is printed to stderr, and flags or keys mgrpo cannot honour
are refused by name (exit status 2).

The YAML in configs/ is composed onto the typed dataclasses of `mgrpo.config` (structured configs):
unknown keys and wrong types fail while composing, naming the key; cross-field problems fail in
`mgrpo.config.validate` with the field's name, all before any process is spawned.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mgrpo.config import InputError, MGRPOConfig
from mgrpo.observe import logs
from mgrpo_launchers import overrides
from mgrpo.config.choices import plain
from mgrpo.config.vocab import register_resolver

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
EXIT_STOPPED = 75
"""Exit status after a requested stop (SIGTERM, SIGUSR1) with a checkpoint written: resume continues the run."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (with a checkpoint written after the first, nothing more after a second)."""

ConfigStore.instance().store(name="mgrpo_schema", node=MGRPOConfig)
# configs/model/ size the vocabulary from model.tokenizer (`${tokenizer_vocab:...}`). Registered here, where
# configs are composed, not on `import mgrpo.config`: light importers (the sandbox, the GPU checks) stay
# free of OmegaConf.
register_resolver()


def to_config(cfg: DictConfig) -> MGRPOConfig:
    """The composed Hydra config as the typed dataclass the library takes (closed choices as plain strings,
    exactly as a config built in Python holds them)."""
    return plain(OmegaConf.to_object(cfg))


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from mgrpo.loop import StopRequested, Trainer

    logging.basicConfig(level=logging.INFO, format=logs.FORMAT, datefmt=logs.DATEFMT, stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        Trainer(to_config(cfg)).fit()
    except InputError as err:  # a config, data file or run folder the run cannot use: named, no traceback
        fail(err)
    except StopRequested as stop:
        print(f"mgrpo-train: {stop}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED if stop.interrupted else EXIT_STOPPED)
    except KeyboardInterrupt:
        print("mgrpo-train: aborted; Ray shut down and files flushed (see the line above for what is kept)",
              file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def fail(err: Exception) -> None:
    print(f"mgrpo-train: {err}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    from mgrpo.compat import slime
    from mgrpo.compat.verl import translate

    try:
        from_slime = slime.translate(sys.argv[1:])
        if from_slime.rows:
            print(f"mgrpo-train: {slime.render(from_slime)}", file=sys.stderr)
        translation = translate(from_slime.args)
        if translation.is_verl:
            print(f"mgrpo-train: {translation.render()}", file=sys.stderr)
        args = overrides.shaped(translation.args)
        overrides.check(str(CONFIG_DIR), args)
    except InputError as err:
        fail(err)
    sys.argv = [sys.argv[0], *args]  # Hydra reads its command line from sys.argv
    _main()


if __name__ == "__main__":
    main()
