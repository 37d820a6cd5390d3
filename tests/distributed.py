"""Run a function on N local gloo ranks (one process each) and collect what each returns.

Used by every multi-rank test (TP/PP/DP parity). Each rank's function runs in a fresh spawned
process, so megatron's global parallel state never leaks between tests.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world_size, port, *args)))
    except BaseException:  # report the rank's traceback to the test instead of hanging
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Call `fn(rank, world_size, port, *args)` on `world_size` processes; return results by rank.

    `fn` must be a module-level function (it is pickled) and may use `port` to join a process group
    at tcp://127.0.0.1:port. Any rank's exception fails the call with that rank's traceback.
    Return plain Python values (`tensor.tolist()`): torch tensors travel between processes as
    shared-memory handles that die with the rank's process.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
