"""Run a function on N local processes that can join one process group (gloo on CPU).

Used where a command needs several Megatron ranks without Ray: `mgrpo-convert`, and the multi-rank
tests. Each rank is a fresh spawned process, so megatron's global parallel state never leaks
between calls.
"""

from __future__ import annotations

import os
import traceback
from typing import Optional

from mgrpo.net import free_port

# Errors a rank raises for bad input (a missing file, a wrong config): the caller reports the message,
# not a traceback.
INPUT_ERRORS = (ValueError, FileNotFoundError)


class RankError(RuntimeError):
    """A rank failed; `rank_traceback` holds its traceback, `expected` is True for bad input."""

    def __init__(self, rank: int, summary: str, rank_traceback: str, expected: bool):
        super().__init__(f"rank {rank} failed: {summary}")
        self.rank, self.rank_traceback, self.expected = rank, rank_traceback, expected


def _rank_main(rank, world_size, port, threads, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    import torch

    torch.set_num_threads(threads)
    try:
        queue.put((rank, None, fn(rank, world_size, port, *args)))
    except BaseException as e:  # noqa: BLE001  (sent to the caller instead of hanging the other ranks)
        queue.put((rank, (f"{type(e).__name__}: {e}", isinstance(e, INPUT_ERRORS)), traceback.format_exc()))


def spawn_ranks(fn, world_size: int, *args, timeout_s: float = 24 * 3600, threads: Optional[int] = None) -> list:
    """Call `fn(rank, world_size, port, *args)` on `world_size` fresh processes; return results by rank.

    `fn` must be a module-level function (it is pickled) and may join a process group at
    tcp://127.0.0.1:port. It should return plain Python values: torch tensors travel between processes
    as shared-memory handles that die with the rank's process. The first failing rank raises RankError.
    """
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, threads, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(world_size):
            rank, error, value = queue.get(timeout=timeout_s)
            if error:
                raise RankError(rank, error[0], value, error[1])
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world_size else 1)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
