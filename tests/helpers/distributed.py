"""Run a function on N local gloo ranks (one process each) and collect what each returns.

Used by every multi-rank test (TP/PP/DP parity): `mgrpo.training.spawn.spawn_ranks` with one thread
per rank, and a failing rank's traceback in the error so the test report shows where it broke.
"""

from __future__ import annotations

from mgrpo.net import free_port
from mgrpo.training.spawn import RankError, spawn_ranks


__all__ = ["free_port", "run_ranks"]


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Call `fn(rank, world_size, port, *args)` on `world_size` processes; return results by rank.

    `fn` must be a module-level function returning plain Python values (`tensor.tolist()`)."""
    try:
        return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, threads=1)
    except RankError as err:
        raise RuntimeError(f"{err}\n{err.rank_traceback}") from None
