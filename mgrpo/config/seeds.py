"""Every seed a run derives from its config, in one place.

A resumed run must draw exactly what the uninterrupted run would have drawn, so each random stream
is a pure function of (config seed, step, round/epoch/chunk), never of wall time or process state.
The large odd multipliers keep the streams of neighbouring steps and rounds apart.
"""

from __future__ import annotations

_STEP = 1_009
_RUN = 1_000_003

RUN_DEFAULT = 1
"""trainer.seed's default."""


def stream_seed(seed: int | None) -> int:
    """A stream's own seed (data.seed, actor.seed): a run sets it from trainer.seed when unset; a group used on its
    own (a DataConfig outside a run) takes the run's default."""
    return RUN_DEFAULT if seed is None else seed


def sampling_seed(seed: int, step: int, round_: int = 0) -> int:
    """Rollout sampling of training step `step` (0-based), dynamic-sampling round `round_`."""
    return seed * _RUN + step * _STEP + round_


def chunk_seed(seed: int | None, chunk: int) -> int | None:
    """One generation chunk of a rollout call (chunks may land on different engines)."""
    return None if seed is None else seed + chunk


def minibatch_seed(seed: int, step: int, epoch: int) -> int:
    """The shuffle of prompt groups into mini-batches at `step`, PPO epoch `epoch`."""
    return seed * _RUN + step * 101 + epoch


def eval_seed(seed: int) -> int:
    """Validation sampling (the same prompts get the same draws at every evaluation)."""
    return seed + 7_919


def data_seed(seed: int, epoch: int) -> int:
    """The order of the training records in data epoch `epoch`."""
    return seed * _RUN + epoch


def turn_seed(seed: int, trajectory: int, turn: int) -> int:
    """One assistant turn of a multi-turn trajectory: a function of the step's sampling seed, the trajectory's
    index in the step and the turn, never of which dispatch batch carried the turn (that depends on timing).
    Sent as the request's own seed (SGLang's sampling_params.sampling_seed); a regenerated trajectory
    (rollout.multi_turn.trajectory_retries) draws the same seeds again."""
    return (seed * _RUN + trajectory * 7_919 + turn * 104_729 + 3) % (2 ** 63)


def request_seed(seed: int, uid: int) -> int:
    """One request inside a batch: the n copies of a prompt must not share a seed, or an engine
    with a per-request deterministic sampler (SGLang's) returns n identical responses."""
    return (seed * _RUN + uid * 7_919 + 1) % (2 ** 63)
