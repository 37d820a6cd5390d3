"""The mismatch doctor: where do the rollout engine's and the trainer's log-probs of the same tokens part?

`mgrpo-doctor run <run folder>` reads a run's trajectories (token ids and both sides' per-token log-probs,
written with trainer.log_token_logprobs) and says how the difference is distributed over steps, which
sequences and tokens are worst, and whether it concentrates by position, token, response length or engine
(`run_report.py`, reading `trajectories.py`).

`mgrpo-doctor layers ...` runs one sequence through the engine's model (transformers, as the CPU server and the
in-process engine run it: `engine_side.py`) and the trainer's (megatron-core's GPTModel loaded by the trainer's
own loaders, on CPU, one rank: `trainer_side.py`), hooks every layer on both, and names the first place where
they part beyond what the dtypes' rounding explains (`compare.py`; `layers.py` puts it together).

This room builds models (models, training) and reads runs' files; it never starts Ray or a cluster.

  run_report.py     `mgrpo-doctor run`: the log-prob difference over steps, sequences, tokens
  trajectories.py   a run's trajectory lines with token log-probs, read and checked
  layers.py         `mgrpo-doctor layers`: both models on one sequence, layer by layer
  engine_side.py    the engine's model (transformers), every layer hooked
  trainer_side.py   the trainer's model (megatron-core), every layer hooked
  compare.py        where two traces part, beyond what the dtypes' rounding explains
"""

from mgrpo.config import InputError


class DoctorError(InputError):
    """Input the doctor cannot use (a missing folder, trajectories without token log-probs, shapes that do not
    match): `mgrpo-doctor` prints it in a line or two and exits 2."""


SUPPORTS = ("full", "sampled")
"""What a log-prob is normalised over (`engine_side.Support`; the trainer's algorithm.logprob_support)."""
