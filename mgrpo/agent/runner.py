"""Runs multi-turn trajectories, each advancing on its own.

Every trajectory is a coroutine: generate an assistant turn from its accumulated ids, parse the calls with
SGLang's parser, run the tools (concurrently, each under `tool_timeout_s`), append their replies as the chat
template renders them (context ids), and go on until a turn makes no call or a bound ends it. A trajectory
waiting on a slow tool holds nobody else: generation requests are gathered by one dispatcher, which sends
whatever is ready as one batch through the `generate` callable it was given (the rollout group: chunks,
retries, health checks and restarts as for single-turn rollouts; or an engine directly) and hands each
result back to its trajectory. At most `max_concurrent_per_engine x engines` trajectories are in flight.

Bounds, each with its finish reason (trajectory.FINISH_REASONS) and counted: turns, the response budget
(per-turn new tokens clamped to what is left of data.max_response_length; tool replies that would not fit
end the trajectory as `length`), tool-reply truncation, the per-call tool timeout and the per-trajectory
wall-clock timeout. A call that cannot run (malformed, unknown tool, bad arguments, the tool raised) gets
an error as its reply: the model sees it, the run counts it per tool. Sync tools run in worker threads: a
hung one is abandoned at its timeout (Python cannot kill a thread), its trajectory ends as tool_timeout.

Constrained calls (rollout.multi_turn.tool_choice, stop_after_call) are mgrpo/agent/constrain.py's: the
grammar each turn's request carries, and which of a returned turn's tokens it restricted (context).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.turn_routes import RoutesError, extend_routes, trajectory_routes
from mgrpo.agent.template import ChatTemplate, count_drift
from mgrpo.agent.calls import ToolCalls, ToolTimeout
from mgrpo.agent.constrain import CallConstraints
from mgrpo.agent.tools import ToolSet
from mgrpo.agent.trajectory import RETRIED, Trajectory, batch_metrics
from mgrpo.config import InputError, seeds
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import GenerateResult, SamplingParams

log = logging.getLogger("mgrpo")

FAULT_COUNTS = ("multi_turn/tool_timeouts", "multi_turn/env_timeouts", "multi_turn/env_errors",
                "multi_turn/trajectory_retries")
"""What a failed attempt counted that stays counted when its trajectory is generated again (the faults
themselves and the retries); the rest of its counts (turns, calls) belong to the attempt that was dropped."""

Generate = Callable[..., tuple[list[GenerateResult], dict]]
"""(prompts, sampling, sessions=[one key per prompt][, seeds=[one per prompt]][, routes_from=[one per prompt]])
-> one result per prompt (in order), and what the call measured (summed into metrics). A session is one
trajectory: its turns go to one engine (the rollout group's `sessions`, for the engine's prefix cache). `seeds`
(given when the sampling has a seed): each request's own sampling seed, `seeds.turn_seed` of its trajectory and
turn (the rollout group's `request_seeds`, SGLang's per-request sampling_seed). `routes_from` (given when the
sampling asks for routed experts): each request's SGLang routed_experts_start_len, the routed positions its
trajectory already holds, so a turn returns only the rows it adds (mgrpo/agent/turn_routes.py)."""


@dataclass
class _Request:
    ids: list[int]
    max_new: int
    future: asyncio.Future
    structural_tag: Optional[str] = None
    stop: tuple[str, ...] = ()
    session: str = ""
    seed: Optional[int] = None
    routes_from: int = 0


class AgentRunner:
    def __init__(self, cfg: MultiTurnConfig, tokenizer, tools: ToolSet, *, max_response_length: int,
                 engines: int = 1, enable_thinking: bool = True, environment: Optional[type] = None):
        """`environment`: a class (mgrpo/agent/environment.py) built once per trajectory, or None."""
        self.cfg, self.tok, self.tools = cfg, tokenizer, tools
        self.calls = ToolCalls(cfg, tools)
        self.environment = environment
        self.template = ChatTemplate(tokenizer, enable_thinking=enable_thinking)
        self.max_response_length = max_response_length
        self.cap = cfg.max_concurrent_per_engine * max(engines, 1)
        self.eos = tokenizer.eos_token_id
        self.constraints = CallConstraints(cfg, tokenizer)
        self.stop = self.constraints.stop

    # --- the batch ----------------------------------------------------------------------------------
    def run(self, prompts: Sequence[tuple], sampling: SamplingParams, generate: Generate, *,
            over_sample_rate: float = 0.0, abort: Optional[Callable[[], None]] = None, group_size: int = 0
            ) -> tuple[list[Trajectory], dict]:
        """One trajectory per (prompt ids, extra_info, where[, prompt messages]) in order, and the batch's
        metrics. The prompt's messages are what an environment that reads the conversation is given first.

        `group_size` (rollout.n; training batches only, 0 otherwise): the prompts come in groups of that many
        samples of one prompt, and the first rollout.multi_turn.required_per_group of each group are forced:
        their first turn is under tool_choice=required (`Trajectory.forced`).

        `over_sample_rate` (veRL's rollout.over_sample_rate; training batches only): once int(N x (1 - rate))
        trajectories have finished, the others end as 'aborted' and `abort` (the engines' abort_all, SGLang's
        /abort_request) stops their requests in flight; the generate calls already sent are waited for (bounded
        by trajectory_timeout_s) so that nothing of this batch runs on into the next."""
        # Not asyncio.run: at its end it waits for every worker thread, and a hung sync tool would hold the
        # batch forever. Its threads are abandoned instead (counted as tool_timeout where they hung).
        pool = ThreadPoolExecutor(max_workers=2 * min(self.cap, len(prompts)) + 4, thread_name_prefix="mgrpo-agent")
        loop = asyncio.new_event_loop()
        loop.set_default_executor(pool)
        try:
            return loop.run_until_complete(self._run(prompts, sampling, generate, over_sample_rate, abort,
                                                     group_size))
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, prompts, sampling: SamplingParams, generate: Generate, over_sample_rate: float, abort,
                   group_size: int = 0):
        queue: asyncio.Queue[_Request] = asyncio.Queue()
        measured: dict = {}
        in_flight: set[asyncio.Future] = set()
        dispatcher = asyncio.create_task(self._dispatch(queue, sampling, generate, measured, in_flight))
        gate = asyncio.Semaphore(self.cap)  # a slot freed by a finished trajectory starts the next one at once
        k = self.cfg.required_per_group if group_size > 0 else 0
        trajs = [Trajectory(uid=i, prompt_ids=list(p[0]), forced=i % group_size < k if k else False)
                 for i, p in enumerate(prompts)]
        batch = uuid.uuid4().hex[:12]  # sessions are unique to this batch's trajectories

        async def attempt(traj: Trajectory, extra: dict, where: str, messages: list) -> None:
            """One generation of the trajectory from its prompt; a transient fault (a tool or environment past
            tool_timeout_s, an environment that raised) ends it failed."""
            try:
                await self._trajectory(traj, extra or {}, where, queue, sampling, messages, f"{batch}-{traj.uid}")
            except ToolTimeout:
                traj.finish_reason = "tool_timeout"
            except _EnvFailed as err:
                traj.finish_reason = "env_failed"
                traj.count("multi_turn/env_errors")
                traj.counts["env_error"] = str(err)

        async def attempts(traj: Trajectory, extra: dict, where: str, messages: list) -> None:
            """rollout.multi_turn.trajectory_retries: a trajectory that ended tool_timeout or env_failed is
            generated again from its prompt, with the same per-turn seeds (its uid and turns), so a fault that
            does not recur gives the trajectory the fault-free run drew; each retry counted, by reason. What
            the failed attempts counted of their faults stays counted."""
            for n in range(self.cfg.trajectory_retries + 1):
                await attempt(traj, extra, where, messages)
                if traj.finish_reason not in RETRIED or n == self.cfg.trajectory_retries:
                    return
                kept = {k: v for k, v in traj.counts.items() if k.startswith(FAULT_COUNTS)}
                reason = traj.finish_reason
                traj.__dict__.update(Trajectory(uid=traj.uid, prompt_ids=traj.prompt_ids, forced=traj.forced).__dict__)
                traj.counts.update(kept)
                traj.count("multi_turn/trajectory_retries")
                traj.count(f"multi_turn/trajectory_retries/{reason}")
                log.info("trajectory %d ended %s; generating it again (retry %d of %d)", traj.uid, reason, n + 1,
                         self.cfg.trajectory_retries)

        async def one(traj: Trajectory, extra: dict, where: str, messages: list) -> None:
            async with gate:
                t0 = time.perf_counter()
                try:  # the wall-clock bound covers every attempt of the trajectory
                    await asyncio.wait_for(attempts(traj, extra, where, messages), self.cfg.trajectory_timeout_s)
                except asyncio.TimeoutError:
                    traj.finish_reason = "trajectory_timeout"
                except _GenerationFailed as err:
                    traj.finish_reason = "generation_error"
                    traj.counts["generation_error"] = str(err)  # what the rollout group raised (engine, retries)
                finally:
                    traj.counts["seconds"] = time.perf_counter() - t0

        tasks = [asyncio.create_task(one(t, p[1], p[2], list(p[3]) if len(p) > 3 else [])) for t, p in zip(trajs, prompts)]
        # veRL's cut (sglang_rollout.py, PR 2929): wait for int(N x (1 - rate)) completions, then abort the rest
        target = int(len(tasks) * (1 - over_sample_rate)) if over_sample_rate > 0 else len(tasks)
        try:
            pending, finished = set(tasks), 0
            while pending and finished < target:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finished += len(done)
            aborted = 0
            if pending:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for t, task in zip(trajs, tasks):
                    if task.cancelled() or not t.finish_reason:
                        t.finish_reason = "aborted"
                        aborted += 1
                t_abort = time.perf_counter()
                if abort is not None:
                    try:
                        await asyncio.to_thread(abort)
                    except Exception as err:  # noqa: BLE001 - counted; their results are dropped anyway
                        measured["rollout/abort_errors"] = measured.get("rollout/abort_errors", 0) + 1
                        log.warning("aborting the long tail's requests failed (%s: %s); waiting for them instead",
                                    type(err).__name__, err)
                if in_flight:  # no generation of this batch may run on into the next
                    _, late = await asyncio.wait(set(in_flight), timeout=self.cfg.trajectory_timeout_s)
                    measured["rollout/abort_unfinished_calls"] = len(late)
                measured["timing_s/abort_wait"] = time.perf_counter() - t_abort
            measured["rollout/aborted"] = aborted
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            dispatcher.cancel()
        if sampling.return_routed_experts:
            _finish_routes(trajs, measured, self.cfg.recheck_routes)
        batch_version = min((t.weight_version for t in trajs if t.weight_version is not None), default=0)
        for t in trajs:
            if t.weight_version is None:
                t.weight_version = batch_version
        return trajs, batch_metrics(trajs, measured, self.cfg.tool_choice == "auto")

    async def _dispatch(self, queue: asyncio.Queue, sampling: SamplingParams, generate: Generate, measured: dict,
                        in_flight: set):
        """Send the ready requests as soon as they are ready, one call per token budget, without waiting for
        the calls already in flight (the engines batch concurrent calls continuously, as SGLang's scheduler
        does); wake each trajectory with its own result."""
        while True:
            ready = [await queue.get()]
            await asyncio.sleep(0)  # trajectories woken by the same result put their next requests first
            while not queue.empty():
                ready.append(queue.get_nowait())
            ready = [r for r in ready if not r.future.done()]  # its trajectory was cut or timed out meanwhile
            by_budget: dict[tuple, list[_Request]] = {}
            for r in ready:  # one batch per budget and constraint
                by_budget.setdefault((r.max_new, r.structural_tag or "", r.stop), []).append(r)
            for (budget, tag, stops), reqs in sorted(by_budget.items()):
                # Each request carries its own seed (its trajectory's and turn's): what a turn samples never
                # depends on which batch the dispatcher put it in, which depends on timing.
                params = replace(sampling, max_new_tokens=budget, structural_tag=tag or None,
                                 stop=tuple(sampling.stop) + stops)
                per = {"seeds": [r.seed for r in reqs]} if sampling.seed is not None else {}
                if sampling.return_routed_experts:
                    per["routes_from"] = [r.routes_from for r in reqs]
                call = asyncio.ensure_future(asyncio.to_thread(generate, [r.ids for r in reqs], params,
                                                               sessions=[r.session for r in reqs], **per))
                in_flight.add(call)
                call.add_done_callback(lambda f, reqs=reqs: self._deliver(f, reqs, measured, in_flight))

    @staticmethod
    def _deliver(call: asyncio.Future, reqs: list, measured: dict, in_flight: set) -> None:
        in_flight.discard(call)
        if call.cancelled():
            return
        err = call.exception()
        if err is not None:  # the group retried already: every trajectory waiting on it fails
            for r in reqs:
                if not r.future.done():
                    r.future.set_exception(_GenerationFailed(f"{type(err).__name__}: {err}"))
            return
        results, stats = call.result()
        for k, v in stats.items():
            measured[k] = measured.get(k, 0) + v
        for r, res in zip(reqs, results):
            if not r.future.done():  # (a trajectory that timed out or was aborted meanwhile is gone)
                r.future.set_result(res)

    # --- one trajectory -------------------------------------------------------------------------------
    async def _trajectory(self, traj: Trajectory, extra: dict, where: str, queue: asyncio.Queue,
                          sampling: SamplingParams, prompt_messages: list, session: str) -> None:
        names = self.tools.for_record(extra, where)
        parser = ToolCallParser(self.cfg.format, self.tools.schemas(names))
        kwargs = extra.get("tools_kwargs") or {}
        instances: dict[str, str] = {}
        versions: list[int] = []
        env = self.environment() if self.environment is not None else None
        first = "required" if traj.forced else self.cfg.tool_choice  # rollout.multi_turn.required_per_group
        tags = {choice: self.constraints.tag(parser, choice) for choice in {first, "auto"}}
        called, user_turns = False, 0
        try:
            if env is not None:
                try:
                    await self._env(traj, env.reset, extra)
                except InputError as err:
                    raise InputError(f"{where}: {err}") from None
            for turn in range(self.cfg.max_assistant_turns):
                left = self.max_response_length - len(traj.response_ids)
                if left <= 0:
                    traj.finish_reason = "length"
                    return
                budget = min(left, self.cfg.max_tokens_per_turn or left, sampling.max_new_tokens)
                tag = tags["auto" if called and self.cfg.reset_tool_choice else first]
                fut = asyncio.get_running_loop().create_future()
                t0 = time.perf_counter()
                fed = traj.prompt_ids + traj.response_ids
                seed = seeds.turn_seed(sampling.seed, traj.uid, turn) if sampling.seed is not None else None
                # routed experts: only the rows of positions this trajectory has no route for yet (all of
                # them with recheck_routes, to compare the earlier turns' rows with this turn's copy)
                known = 0 if traj.routes is None or self.cfg.recheck_routes else traj.routes.shape[0]
                await queue.put(_Request(fed, budget, fut, tag, self.stop, session, seed, known))
                res: GenerateResult = await fut
                if res.routed_experts is not None:  # what the engine sent (before any cut)
                    traj.count("multi_turn/route_rows_received", res.routed_experts.shape[0])
                res = self.constraints.cut_after_call(res, traj)
                if sampling.return_support and res.support is None:
                    traj.supports_missing = True
                if sampling.return_routed_experts:
                    _add_routes(traj, res, len(fed), known)
                versions.append(res.weight_version)
                traj.engine = res.engine
                text = self.tok.decode(res.token_ids, skip_special_tokens=False)  # for parsing only
                free = self.constraints.free(tag, res.token_ids, traj)
                t = traj.add(list(res.token_ids), list(res.logprobs), "assistant", text=text,
                             latency_s=time.perf_counter() - t0, sampled=free, support=res.support)
                traj.count("turns")
                parsed = parser.parse(text.removesuffix(self.tok.eos_token))
                t.calls = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
                called = called or bool(parsed.calls or parsed.malformed)
                traj.called = called
                traj.messages.append(_assistant_message(parsed))
                if res.finish_reason != "stop":
                    traj.finish_reason = "length"  # cut by the budget: whatever it was writing is not run
                    return
                t1 = time.perf_counter()
                if not parsed.calls and not parsed.malformed:  # a turn for the environment, if there is one
                    if env is not None and self.cfg.max_user_turns and user_turns >= self.cfg.max_user_turns:
                        traj.finish_reason = "max_turns"  # veRL's max_user_turns
                        return
                    said = text.removesuffix(self.tok.eos_token)
                    # an environment that reads the conversation (veRL's interactions) gets all of it
                    args = (said, prompt_messages + traj.messages) if getattr(env, "wants_messages", False) \
                        else (said,)
                    step = await self._env(traj, env.step, *args) if env else None
                    user_turns += 1
                    if step is not None and step.reward is not None:
                        traj.tool_reward += float(step.reward)
                    if step is None or step.done or not step.messages:
                        traj.finish_reason = "stop"
                        return
                    role, msgs = "environment", list(step.messages)
                else:
                    role, msgs = "tool", None
                if turn + 1 == self.cfg.max_assistant_turns:
                    traj.finish_reason = "max_turns"
                    return
                if msgs is None:
                    msgs = [{"role": "tool", "content": r}
                            for r in await self.calls.run(traj, parsed, names, kwargs, instances)]
                ids = self.template.suffix(msgs)
                if res.token_ids and res.token_ids[-1] != self.eos:
                    # a turn a stop string ended (after a call, or rollout.stop): its end of turn is the
                    # template's, context, not sampled
                    ids = [self.eos] + ids
                if len(traj.response_ids) + len(ids) >= self.max_response_length:
                    traj.finish_reason = "length"  # no room for the replies and a next turn
                    return
                traj.add(ids, None, role, text="\n".join(str(m.get("content", "")) for m in msgs),
                         latency_s=time.perf_counter() - t1)
                traj.messages.extend(msgs)
        finally:
            traj.weight_version = min(versions) if versions else None
            await self.calls.release(traj, instances, kwargs)
            if env is not None and hasattr(env, "close"):
                try:
                    await asyncio.wait_for(_call_maybe_sync(env.close), self.cfg.tool_timeout_s)
                except Exception as err:  # noqa: BLE001 - counted; the trajectory is already over
                    traj.count("multi_turn/env_close_errors")
                    log.warning("environment close failed: %s: %s", type(err).__name__, err)

    async def _env(self, traj: Trajectory, method, *args):
        """One environment call under tool_timeout_s: a hang is tool_timeout, a raise env_failed."""
        try:
            return await asyncio.wait_for(_call_maybe_sync(method, *args), self.cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            traj.count("multi_turn/env_timeouts")
            raise ToolTimeout("environment") from None
        except InputError:
            raise  # a record the environment cannot read is bad input (file, line, field), not its failure
        except Exception as err:  # noqa: BLE001 - the environment's failure fails its trajectory, counted
            raise _EnvFailed(f"{type(err).__name__}: {err}") from err

    # --- the drift check and the batch's metrics -------------------------------------------------------
    def drift(self, traj: Trajectory, prompt_messages: list[dict], schemas: list[dict]) -> int:
        """Tokens by which the tokenizer's own rendering of the finished conversation differs from the ids."""
        theirs = self.template.render_ids(list(prompt_messages) + traj.messages, schemas or None)
        tail = self.template.end_tail()
        if tail and traj.response_ids and traj.response_ids[-1] == self.eos and theirs[-len(tail):] == tail:
            theirs = theirs[:-len(tail)]  # the template's text after the final end-of-turn token
        return count_drift(traj.prompt_ids + traj.response_ids, theirs)


def _add_routes(traj: Trajectory, res: GenerateResult, fed: int, start: int) -> None:
    """The turn's routed experts (positions [start, fed + output - 1)) into the trajectory's (each position from
    the turn that first computed it)."""
    if res.routed_experts is None:
        traj.routes_missing = True
        return
    try:
        traj.routes, differ = extend_routes(traj.routes, res.routed_experts, fed, len(res.token_ids), start)
    except RoutesError as err:
        raise RoutesError(f"trajectory {traj.uid}, turn {traj.counts.get('turns', 0) + 1}: {err}") from None
    if differ:
        traj.count("multi_turn/route_rows_recomputed_differ", differ)


def _finish_routes(trajs: Sequence[Trajectory], measured: dict, rechecked: bool) -> None:
    """Every trajectory's routes to [prompt + response - 1, L, K] (a failed one's positions that no engine
    forward computed filled and counted, mgrpo/agent/turn_routes.py); skipped when no turn returned any."""
    shape = next((t.routes.shape[1:] for t in trajs if t.routes is not None), None)
    unrouted = 0
    for t in trajs:
        if shape is not None and not t.routes_missing:
            t.routes, n = trajectory_routes(t.routes, len(t.prompt_ids) + len(t.response_ids), t.failed, shape,
                                            t.uid)
            unrouted += n
    measured["multi_turn/unrouted_positions"] = unrouted
    measured.setdefault("multi_turn/route_rows_received", 0)
    if rechecked:  # only then does a turn return rows an earlier turn returned (to compare)
        measured.setdefault("multi_turn/route_rows_recomputed_differ", 0)


class _GenerationFailed(Exception):
    pass


class _EnvFailed(Exception):
    pass


async def _call_maybe_sync(method, *args):
    import inspect

    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


def _assistant_message(parsed) -> dict:
    msg: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}}
                             for c in parsed.calls]
    return msg


def new_instance_id() -> str:
    return str(uuid.uuid4())
