"""Where the rollout group's chunks go: to the engines in turn as Ray calls (`ToEngines`), or through SGLang's
router (`ViaRouter`); and which engine a session (a multi-turn trajectory's turns) lives on. `group` is the
`RolloutGroup` sending them (not imported: it imports this module)."""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import ray

from mgrpo.rollout.types import GenerateResult, from_columns, to_columns


def _results(call: Future) -> Future:
    """A future of the GenerateResults of an engine call, which answers them as columns (EngineSlot.generate); the
    call's error (a dead engine's RayActorError) is this future's."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(from_columns(GenerateResult, f.result()))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(err)

    call.add_done_callback(done)
    return out


def session_engine(session: Optional[str], engines: int) -> int:
    """The engine of a session: a stable hash (the same in every process and run), so a trajectory's turns
    meet its context in that engine's prefix cache; sessions spread evenly over the engines."""
    return zlib.crc32((session or "").encode()) % engines


class ToEngines:
    """Chunks sent to the engines in turn, as Ray calls. A failed chunk restarts its engine if it died and
    goes back to it; the periodic check restarts a dead or hung engine holding chunks and resends them
    (their old futures are dropped, so a late answer from the old engine is never taken)."""

    where = ""
    retryable = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)

    def __init__(self, group: Any, chunks: list, params: list, home: Optional[list[int]] = None):
        self.group, self.chunks, self.params, self.home = group, chunks, params, home

    def send(self, k: int, engine: Optional[int]) -> tuple[Future, int]:
        if engine is None:
            engine = self.home[k] if self.home is not None else k % len(self.group.engines)
        e = engine
        return _results(self.group.engines[e].generate.remote(to_columns(self.chunks[k]), self.params[k]).future()), e

    def recover(self, e: int) -> int:
        with self.group._heal_lock:  # (another call may have restarted it meanwhile: then it is alive)
            if self.group._alive(e):
                return 0
            self.group._restart(e)
            return 1

    def check(self, pending: dict, retry: Callable) -> int:
        restarted = 0
        for e in sorted({e for _, e, _ in pending.values()}):
            with self.group._heal_lock:
                if self.group._alive(e):
                    continue
                lost = [(f, v) for f, v in pending.items() if v[1] == e]
                for f, _ in lost:
                    del pending[f]
                self.group._restart(e)
                restarted += 1
            for _, (k, _, attempt) in lost:
                retry(k, e, attempt, "engine failed its health check")
        return restarted

    def close(self) -> None:
        pass


class ViaRouter:
    """Chunks sent through SGLang's router (which picks an engine per request) from a thread pool. A failed
    chunk, and the periodic check, health-check every engine (restarting and re-registering a dead or hung
    one) before the chunk is resent."""

    where = " through the router"
    retryable = (Exception,)

    def __init__(self, group: Any, chunks: list, params: list):
        self.group, self.chunks, self.params = group, chunks, params
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(len(chunks), 4 * len(group.engines))),
                                       thread_name_prefix="mgrpo-rollout")

    def send(self, k: int, engine: Optional[int]) -> tuple[Future, None]:
        return self.pool.submit(self.group.front.generate, self.chunks[k], self.params[k]), None

    def recover(self, e: None) -> int:
        return self.group.health_check()

    def check(self, pending: dict, retry: Callable) -> int:
        return self.group.health_check()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
