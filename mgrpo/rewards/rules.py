"""The rules: score responses with the reward function of their data_source, safely and in parallel.

Reward functions are arbitrary code (user functions, symbolic math that can hang), so each call is
isolated: with reward.num_workers > 0 they run in that many worker processes (mgrpo.rewards.worker).
Each worker gets its share of a step's requests as one message and answers call by call, so a step
costs one round trip per worker, not one per response. A call that raises (or returns something that is
not a finite number) has no score (None) and the outcome `failed`; a call that runs past reward.timeout_s
(timed from the worker's previous answer) gets its worker killed and restarted and has no score, outcome
`timeout`; the calls after it in that share go to the fresh worker. A failed call is never scored 0: the
experience leaves it out of the loss and its group's baseline (mgrpo/rewards/failed.py).
Nothing a reward function does can crash the run or stall it for longer than the timeout.

A worker that dies (killed from outside, out of memory, or a function that ends the interpreter) is
replaced and counted (`worker_restarts`); the call it was running goes to the fresh worker once more,
so a worker lost to something outside costs no score, and only a call that kills its worker twice
is `failed`.

With num_workers=0 functions run in the calling process: cheaper, but a hung function cannot be
interrupted; a call that took longer than timeout_s still has no score and counts as a timeout. The built-in
string rules (mgrpo/sum, mgrpo/peek, openai/gsm8k; `registry.runs_in_process`) always run there, unless
reward.isolate_builtin_rules: they cannot hang or end the interpreter, and a worker's round trip cost 13x the
rule's own time on the tiny job. Workers start when a call first needs one, so a run of such rules alone has none.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import time
from collections import deque

from mgrpo.config.schema import RewardConfig
from mgrpo.rewards.registry import (absolute_spec, get_reward_fn, gsm8k_options, reward_functions, runs_in_process,
                                    to_score)
from mgrpo.rewards.scoring import FAILED, TIMEOUT, ScoreRequest, ScoreResult

log = logging.getLogger("mgrpo.rewards")

STARTUP_TIMEOUT_S = 120.0


class _Worker:
    """One reward worker subprocess, its line buffer and the requests it owes answers for."""

    def __init__(self, cfg: RewardConfig):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", "mgrpo.rewards.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=os.getcwd())
        config = {"custom_functions": {src: absolute_spec(spec) for src, spec in cfg.custom_functions.items()},
                  "gsm8k": gsm8k_options(cfg)}
        self.proc.stdin.write((json.dumps(config) + "\n").encode())
        self.proc.stdin.flush()
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.todo: deque[int] = deque()
        """Request indices given to this worker, not sent yet."""
        self.sent: deque[int] = deque()
        """Sent and not answered yet, in the order the worker scores them; the first is running."""
        self.since = 0.0
        """When the running call started (the batch was sent, or the previous call answered)."""

    def send_todo(self, requests: list[ScoreRequest]) -> None:
        """All of `todo` as one message."""
        batch = [{"id": i, "data_source": requests[i].data_source, "response": requests[i].response,
                  "ground_truth": requests[i].ground_truth, "extra_info": requests[i].extra_info} for i in self.todo]
        self.proc.stdin.write((json.dumps({"requests": batch}, default=str) + "\n").encode())
        self.proc.stdin.flush()
        self.sent, self.todo = self.todo, deque()
        self.since = time.monotonic()

    def read_lines(self) -> Optional[list[dict]]:
        """Complete messages received so far; None once the worker has exited (EOF)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the worker's read loop ends
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class Rules:
    """The scorer of rules: each request's reward function by its data_source (mgrpo/rewards/registry.py)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self._fns = reward_functions(cfg)  # imports custom functions now: a bad spec fails here
        self._workers: list[_Worker] = []

    # --- public ------------------------------------------------------------------------------------
    def score(self, requests: list[ScoreRequest]) -> ScoreResult:
        result = ScoreResult.empty(len(requests))
        here = [i for i, r in enumerate(requests)
                if self.cfg.num_workers == 0 or runs_in_process(r.data_source, self.cfg)]
        if here:
            self._score_in_process(requests, here, result)
        if len(here) < len(requests):
            mine = set(here)
            self._score_in_workers(requests, [i for i in range(len(requests)) if i not in mine], result)
        if result.failed or result.timeout:  # the experience warns past reward.failed.warn_rate
            log.info("reward: %d failed, %d timed out of %d; e.g. %s", result.failed, result.timeout,
                        len(requests), result.errors[:2])
        if result.worker_restarts:
            log.warning("reward: %d worker(s) found dead and replaced", result.worker_restarts)
        return result

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self) -> "Rules":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _record(result: ScoreResult, idx: int, status: str, error: str, req: ScoreRequest) -> None:
        result.fail(idx, status, f"rule:{req.data_source}", error)

    def _score_in_process(self, requests: list[ScoreRequest], idx: list[int], result: ScoreResult) -> None:
        for i in idx:
            req = requests[i]
            t0 = time.monotonic()
            try:
                fn = get_reward_fn(req.data_source, self._fns)
                score = to_score(fn(req.data_source, req.response, req.ground_truth, req.extra_info))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a reward function must not end the run
                self._record(result, i, FAILED, f"{type(e).__name__}: {e}", req)
                continue
            if time.monotonic() - t0 > self.cfg.timeout_s:
                self._record(result, i, TIMEOUT, f"took longer than reward.timeout_s={self.cfg.timeout_s}", req)
            else:
                result.scores[i] = score

    def _score_in_workers(self, requests: list[ScoreRequest], idx: list[int], result: ScoreResult) -> None:
        """Score requests[i] for i in `idx` in the worker processes."""
        # Workers persist between calls; dead ones are replaced (and counted).
        alive = [w for w in self._workers if w.proc.poll() is None]
        for w in self._workers:
            if w not in alive:
                w.kill()  # closes its pipes
        result.worker_restarts += len(self._workers) - len(alive)
        self._workers = alive
        retried: set[int] = set()  # requests sent again after their worker died: a second death fails them
        while len(self._workers) < self.cfg.num_workers:
            self._workers.append(_Worker(self.cfg))
        for k, w in enumerate(self._workers):  # strided shares: neighbouring (similar) requests spread out
            w.todo, w.sent = deque(idx[k::len(self._workers)]), deque()
        sel = selectors.DefaultSelector()
        for w in self._workers:
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        try:
            while any(w.todo or w.sent for w in self._workers):
                for w in list(self._workers):  # hand out each share as one message
                    if w.ready and w.todo and not w.sent:
                        try:
                            w.send_todo(requests)
                        except OSError:  # died since its last answer: nothing ran, the share moves on
                            self._replace(w, sel, result, requests, "exited", retried)
                now = time.monotonic()
                deadlines = [w.since + self.cfg.timeout_s for w in self._workers if w.sent] + \
                            [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
                wait = max(0.0, min(deadlines) - now) if deadlines else 0.0
                for key, _ in sel.select(timeout=wait):
                    w = key.data
                    msgs = w.read_lines()
                    if msgs is None:  # the worker died (killed, or a reward function ended the interpreter)
                        self._replace(w, sel, result, requests, "exited", retried)
                        continue
                    for msg in msgs:
                        if msg.get("ready"):
                            w.ready = True
                            continue
                        if not w.sent or msg["id"] != w.sent[0]:
                            raise RuntimeError(f"reward worker answered request {msg['id']}, expected "
                                               f"{w.sent[0] if w.sent else None}")
                        i = w.sent.popleft()
                        if msg["error"] is None:
                            result.scores[i] = float(msg["score"])
                        else:
                            self._record(result, i, FAILED, msg["error"], requests[i])
                    w.since = time.monotonic()  # the next call started at the latest now
                now = time.monotonic()
                for w in list(self._workers):
                    if w.sent and now > w.since + self.cfg.timeout_s:
                        self._replace(w, sel, result, requests, "timeout", retried)
                    elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                        raise RuntimeError(f"reward worker did not start within {STARTUP_TIMEOUT_S:.0f}s")
        finally:
            sel.close()

    def _replace(self, w: _Worker, sel, result, requests, why: str, retried: set) -> None:
        """Kill `w` and give the calls it had not finished to a fresh worker in its place. `why`: 'timeout'
        (the running call times out) or 'exited' (the worker died: counted as a restart; its running call goes
        to the fresh worker once more, and fails if it was sent again already)."""
        if not w.ready:
            raise RuntimeError(f"reward worker failed to start (exit code {w.proc.poll()}); see its stderr above")
        sel.unregister(w.proc.stdout)
        w.kill()
        todo = w.sent + w.todo
        if why == "exited":
            result.worker_restarts += 1
            code = w.proc.returncode
            if w.sent and w.sent[0] in retried:
                i = todo.popleft()
                self._record(result, i, FAILED, f"reward worker exited (code {code}) twice on this call",
                             requests[i])
            elif w.sent:
                retried.add(w.sent[0])
                log.warning("reward worker exited (code %s) during a call; sending it to a fresh worker", code)
        elif w.sent:
            i = todo.popleft()
            self._record(result, i, TIMEOUT, f"exceeded reward.timeout_s={self.cfg.timeout_s}", requests[i])
        fresh = _Worker(self.cfg)
        fresh.todo = todo
        self._workers[self._workers.index(w)] = fresh
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
