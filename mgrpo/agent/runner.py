"""Runs multi-turn trajectories, each advancing on its own.

Every trajectory is a state machine (mgrpo/agent/episode.py), one short handler per state: generate an
assistant turn from its accumulated ids, parse the calls with SGLang's parser, run the tools (concurrently,
each under `tool_timeout_s`) or step the environment, append the replies as the chat template renders them
(context ids), and go on until a turn makes no call or a bound ends it; finish releases its tools. A trajectory
waiting on a slow tool holds nobody else: generation requests are gathered by one dispatcher, which sends
whatever is ready as one batch through the `generate` callable it was given (the rollout group: chunks,
retries, health checks and restarts as for single-turn rollouts; or an engine directly) and hands each
result back to its trajectory. At most `max_concurrent_per_engine x engines` trajectories are in flight.

Bounds, each with its finish reason (trajectory.FINISH_REASONS) and counted: turns, the response budget
(per-turn new tokens clamped to what is left of data.max_response_length; tool replies that would not fit
end the trajectory as `length`), tool-reply truncation, the per-call tool timeout and the per-trajectory
wall-clock timeout. A call that cannot run (malformed, unknown tool, bad arguments, the tool raised) gets
an error as its reply: the model sees it, the run counts it per tool. Sync tools run in worker threads: a
hung one is abandoned at its timeout (Python cannot kill a thread; it is a daemon thread, so it never holds
the process at exit: mgrpo/agent/threads.py), its trajectory ends as tool_timeout.

Constrained calls (rollout.multi_turn.tool_choice, stop_after_call) are mgrpo/agent/constrain.py's: the
grammar each turn's request carries, and which of a returned turn's tokens it restricted (context).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional, Sequence

from mgrpo.agent.calls import ToolCalls, ToolTimeout, step_reward
from mgrpo.agent.constrain import CallConstraints
from mgrpo.agent.environment import EnvironmentSession, call_maybe_sync
from mgrpo.agent import threads
from mgrpo.agent.episode import AgentTask, Batch, Episode, Request, State
from mgrpo.agent.parse import ToolCallParser, call_cannot_fit, shortest_call_tokens
from mgrpo.agent.turn_routes import add_turn_routes, finish_routes
from mgrpo.agent.template import ChatTemplate, count_drift
from mgrpo.agent.tools import ToolSet
from mgrpo.agent.trajectory import FAULT_COUNTS, RETRIED, Trajectory, batch_metrics, warn_invalid_calls  # noqa: F401 - FAULT_COUNTS: re-exported
from mgrpo.config import InputError, seeds
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import GenerateResult, SamplingParams

log = logging.getLogger("mgrpo")

Generate = Callable[..., tuple[list[GenerateResult], dict]]
"""(prompts, sampling, sessions=[one key per prompt][, seeds=[one per prompt]][, routes_from=[one per prompt]])
-> one result per prompt (in order), and what the call measured (summed into metrics). A session is one
trajectory: its turns go to one engine (the rollout group's `sessions`, for the engine's prefix cache). `seeds`
(given when the sampling has a seed): each request's own sampling seed, `seeds.turn_seed` of its trajectory and
turn (the rollout group's `request_seeds`, SGLang's per-request sampling_seed). `routes_from` (given when the
sampling asks for routed experts): each request's SGLang routed_experts_start_len, the routed positions its
trajectory already holds, so a turn returns only the rows it adds (mgrpo/agent/turn_routes.py)."""

class AgentRunner:
    def __init__(self, cfg: MultiTurnConfig, tokenizer, tools: ToolSet, *, max_response_length: int,
                 engines: int = 1, enable_thinking: bool = True, environment: Optional[Callable] = None):
        """`environment`: a class (mgrpo/agent/environment.py's `Environment` protocol) built once per
        trajectory, or None."""
        self.cfg, self.tok, self.tools = cfg, tokenizer, tools
        self.calls = ToolCalls(cfg, tools)
        self.environment = environment
        self.template = ChatTemplate(tokenizer, enable_thinking=enable_thinking)
        self.max_response_length = max_response_length
        self.cap = cfg.max_concurrent_per_engine * max(engines, 1)
        self.eos = tokenizer.eos_token_id
        self.constraints = CallConstraints(cfg, tokenizer)
        self.stop = self.constraints.stop
        self.shortest_call = shortest_call_tokens(cfg.format, tools, tokenizer)
        """Tokens of the shortest call of any tool (a call with no arguments), 0 when there is no tool."""
        self.turn_budget = min(max_response_length, cfg.max_tokens_per_turn or max_response_length)
        cannot_fit = call_cannot_fit(cfg, tools, tokenizer, max_response_length, self.shortest_call)
        if cannot_fit:
            log.warning(cannot_fit)
        self.handlers = {State.GENERATE: self._generate, State.PARSE: self._parse, State.CALL_TOOLS: self._call_tools,
                         State.ENV_STEP: self._env_step, State.APPEND: self._append}

    # --- the batch ----------------------------------------------------------------------------------
    def run(self, prompts: Sequence, sampling: SamplingParams, generate: Generate, *,
            over_sample_rate: float = 0.0, abort: Optional[Callable[[], None]] = None, group_size: int = 0
            ) -> tuple[list[Trajectory], dict]:
        """One trajectory per prompt (an `AgentTask`, or a (prompt ids, extra_info, where[, prompt messages])
        tuple) in order, and the batch's metrics.

        `group_size` (rollout.n; training batches only, 0 otherwise): the prompts come in groups of that many
        samples of one prompt, and the first rollout.multi_turn.required_per_group of each group are forced:
        their first turn is under tool_choice=required (`Trajectory.forced`).

        `over_sample_rate` (veRL's rollout.over_sample_rate; training batches only): once int(N x (1 - rate))
        trajectories have finished, the others end as 'aborted' and `abort` (the engines' abort_all, SGLang's
        /abort_request) stops their requests in flight; the generate calls already sent are waited for (bounded
        by trajectory_timeout_s) so that nothing of this batch runs on into the next."""
        tasks = [AgentTask.of(p) for p in prompts]
        # Not asyncio.run: at its end it waits for every worker thread, and a hung sync tool would hold the
        # batch forever. Its threads are abandoned instead (counted as tool_timeout where they hung).
        pool = ThreadPoolExecutor(max_workers=2 * min(self.cap, len(tasks)) + 4, thread_name_prefix="mgrpo-agent")
        loop = asyncio.new_event_loop()
        loop.set_default_executor(pool)
        try:
            return loop.run_until_complete(self._run(tasks, sampling, generate, over_sample_rate, abort, group_size))
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, tasks: list[AgentTask], sampling: SamplingParams, generate: Generate,
                   over_sample_rate: float, abort, group_size: int):
        batch = Batch(sampling, uuid.uuid4().hex[:12])
        dispatcher = asyncio.create_task(self._dispatch(batch, generate))
        gate = asyncio.Semaphore(self.cap)  # a slot freed by a finished trajectory starts the next one at once
        k = self.cfg.required_per_group if group_size > 0 else 0
        trajs = [Trajectory(uid=i, prompt_ids=t.prompt_ids, forced=i % group_size < k if k else False)
                 for i, t in enumerate(tasks)]
        running = [asyncio.create_task(self._one(trajs, i, task, batch, gate)) for i, task in enumerate(tasks)]
        try:
            await self._wait(running, trajs, batch, over_sample_rate, abort)
        finally:
            dispatcher.cancel()
        if sampling.return_routed_experts:
            finish_routes(trajs, batch.measured, self.cfg.recheck_routes)
        batch_version = min((t.weight_version for t in trajs if t.weight_version is not None), default=0)
        for t in trajs:
            if t.weight_version is None:
                t.weight_version = batch_version
        metrics = batch_metrics(trajs, batch.measured, self.cfg.tool_choice == "auto")
        warn_invalid_calls(metrics)
        metrics["multi_turn/call_cannot_fit"] = int(self.shortest_call > self.turn_budget)
        metrics["multi_turn/hung_tool_threads"] = threads.running()
        return trajs, metrics

    async def _wait(self, running: list[asyncio.Task], trajs: list[Trajectory], batch: Batch,
                    over_sample_rate: float, abort) -> None:
        """Every trajectory to its end; with over_sample_rate, veRL's cut (sglang_rollout.py, PR 2929): wait for
        int(N x (1 - rate)) completions, then abort the rest."""
        target = int(len(running) * (1 - over_sample_rate)) if over_sample_rate > 0 else len(running)
        pending, finished = set(running), 0
        while pending and finished < target:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished += len(done)
        aborted = 0
        if pending:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for i, task in enumerate(running):
                if task.cancelled() or not trajs[i].finish_reason:
                    trajs[i].finish_reason = "aborted"
                    aborted += 1
            await self._abort_in_flight(batch, abort)
        batch.measured["rollout/aborted"] = aborted
        for task in running:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _abort_in_flight(self, batch: Batch, abort) -> None:
        t0, measured = time.perf_counter(), batch.measured
        if abort is not None:
            try:
                await asyncio.to_thread(abort)
            except Exception as err:  # noqa: BLE001 - counted; their results are dropped anyway
                measured["rollout/abort_errors"] = measured.get("rollout/abort_errors", 0) + 1
                log.warning("aborting the long tail's requests failed (%s: %s); waiting for them instead",
                            type(err).__name__, err)
        if batch.in_flight:  # no generation of this batch may run on into the next
            _, late = await asyncio.wait(set(batch.in_flight), timeout=self.cfg.trajectory_timeout_s)
            measured["rollout/abort_unfinished_calls"] = len(late)
        measured["timing_s/abort_wait"] = time.perf_counter() - t0

    async def _one(self, trajs: list[Trajectory], i: int, task: AgentTask, batch: Batch,
                   gate: asyncio.Semaphore) -> None:
        """Trajectory i with its retries, under the wall-clock bound (which covers every attempt)."""
        async with gate:
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(self._attempts(trajs, i, task, batch), self.cfg.trajectory_timeout_s)
            except asyncio.TimeoutError:
                trajs[i].finish_reason = "trajectory_timeout"
            except _GenerationFailed as err:
                trajs[i].finish_reason = "generation_error"
                trajs[i].counts["generation_error"] = str(err)  # what the rollout group raised (engine, retries)
            finally:
                trajs[i].counts["seconds"] = time.perf_counter() - t0

    async def _attempts(self, trajs: list[Trajectory], i: int, task: AgentTask, batch: Batch) -> None:
        """rollout.multi_turn.trajectory_retries: a trajectory that ended tool_timeout or env_failed is generated
        again from its prompt (a restarted trajectory), with the same per-turn seeds (its uid and turns), so a
        fault that does not recur gives the trajectory the fault-free run drew; each retry counted, by reason.
        What the failed attempts counted of their faults stays counted."""
        for n in range(self.cfg.trajectory_retries + 1):
            traj = trajs[i]
            await self._attempt(self._episode(traj, task, batch))
            if traj.finish_reason not in RETRIED or n == self.cfg.trajectory_retries:
                return
            trajs[i] = traj.restarted()
            log.info("trajectory %d ended %s; generating it again (retry %d of %d)", traj.uid, traj.finish_reason,
                     n + 1, self.cfg.trajectory_retries)

    async def _attempt(self, ep: Episode) -> None:
        """One attempt: its states run from GENERATE to FINISH; a transient fault (a tool or environment past
        tool_timeout_s, an environment that raised) ends it failed."""
        traj = ep.traj
        try:
            await self._drive(ep)
        except ToolTimeout:
            traj.finish_reason = "tool_timeout"
        except _EnvFailed as err:
            traj.finish_reason = "env_failed"
            traj.count("multi_turn/env_errors")
            traj.counts["env_error"] = str(err)

    # --- one trajectory: the state machine ---------------------------------------------------------
    def _episode(self, traj: Trajectory, task: AgentTask, batch: Batch) -> Episode:
        names = self.tools.for_record(task.extra_info, task.where)
        parser = ToolCallParser(self.cfg.format, self.tools.schemas(names))
        first = "required" if traj.forced else self.cfg.tool_choice  # rollout.multi_turn.required_per_group
        env = EnvironmentSession(self.environment()) if self.environment is not None else None
        return Episode(task, traj, batch, f"{batch.key}-{traj.uid}", names, parser,
                       {choice: self.constraints.tag(parser, choice) for choice in {first, "auto"}}, first, env)

    async def _drive(self, ep: Episode) -> None:
        """The states from the first turn's GENERATE to FINISH, whose handler (release the tools, close the
        environment) runs however the attempt ends. Bounded: each turn passes at most four states."""
        try:
            if ep.env is not None:
                try:
                    await self._env_call(ep.traj, ep.env.reset, ep.task.extra_info)
                except InputError as err:
                    raise InputError(f"{ep.task.where}: {err}") from None
            state = State.GENERATE
            for _ in range(4 * self.cfg.max_assistant_turns + 1):
                if state is State.FINISH:
                    return
                state = await self.handlers[state](ep)
            raise RuntimeError(f"trajectory {ep.traj.uid} did not finish in {self.cfg.max_assistant_turns} turns")
        finally:
            await self._finish(ep)

    async def _generate(self, ep: Episode) -> State:
        """Send the turn's request (its budget, constraint, seed) and take the engine's answer as a sampled turn."""
        traj, cfg, sampling = ep.traj, self.cfg, ep.batch.sampling
        left = self.max_response_length - len(traj.response_ids)
        if left <= 0:
            return ep.end("length")
        budget = min(left, cfg.max_tokens_per_turn or left, sampling.max_new_tokens)
        ep.tag = ep.tags["auto" if ep.called and cfg.reset_tool_choice else ep.first]
        fed = traj.prompt_ids + traj.response_ids
        seed = seeds.turn_seed(sampling.seed, traj.uid, ep.turn) if sampling.seed is not None else None
        # routed experts: only the rows of positions this trajectory has no route for yet (all of them with
        # recheck_routes, to compare the earlier turns' rows with this turn's copy)
        known = 0 if traj.routes is None or cfg.recheck_routes else traj.routes.shape[0]
        t0, future = time.perf_counter(), asyncio.get_running_loop().create_future()
        await ep.batch.queue.put(Request(fed, budget, future, ep.tag, self.stop, ep.session, seed, known))
        res: GenerateResult = await future
        if res.routed_experts is not None:  # what the engine sent (before any cut)
            traj.count("multi_turn/route_rows_received", res.routed_experts.shape[0])
        res = self.constraints.cut_after_call(res, traj)
        if sampling.return_support and res.support is None:
            traj.supports_missing = True
        if sampling.return_routed_experts:
            add_turn_routes(traj, res, len(fed), known)
        ep.versions.append(res.weight_version)
        traj.engine = res.engine
        ep.result, ep.text = res, self.tok.decode(res.token_ids, skip_special_tokens=False)  # for parsing only
        free = self.constraints.free(ep.tag, res.token_ids, traj)
        ep.current = traj.add(list(res.token_ids), list(res.logprobs), "assistant", text=ep.text,
                              latency_s=time.perf_counter() - t0, sampled=free, support=res.support)
        traj.count("turns")
        return State.PARSE

    async def _parse(self, ep: Episode) -> State:
        """The turn's calls (SGLang's parser); a turn the budget cut runs nothing, one without calls goes to the
        environment, the last turn's calls are not run."""
        traj = ep.traj
        parsed = ep.parsed = ep.parser.parse(ep.text.removesuffix(self.tok.eos_token))
        ep.current.calls = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
        ep.called = traj.called = ep.called or bool(parsed.calls or parsed.malformed)
        traj.messages.append(_assistant_message(parsed))
        if ep.result.finish_reason != "stop":
            return ep.end("length")  # cut by the budget: whatever it was writing is not run
        ep.context_t0 = time.perf_counter()
        if not parsed.calls and not parsed.malformed:
            return State.ENV_STEP
        if ep.turn + 1 == self.cfg.max_assistant_turns:
            return ep.end("max_turns")
        return State.CALL_TOOLS

    async def _call_tools(self, ep: Episode) -> State:
        replies = await self.calls.run(ep.traj, ep.parsed, ep.names, ep.kwargs, ep.instances)
        ep.role, ep.context = "tool", [{"role": "tool", "content": r} for r in replies]
        return State.APPEND

    async def _env_step(self, ep: Episode) -> State:
        """A turn without calls: the environment's (if there is one) next messages, reward and whether it is done."""
        cfg = self.cfg
        if ep.env is None:
            return ep.end("stop")
        if cfg.max_user_turns and ep.user_turns >= cfg.max_user_turns:
            return ep.end("max_turns")  # veRL's max_user_turns
        # an environment that reads the conversation (veRL's interactions) gets all of it
        step = await self._env_call(ep.traj, ep.env.step, ep.text.removesuffix(self.tok.eos_token),
                                    ep.task.messages + ep.traj.messages)
        ep.user_turns += 1
        if step is not None and step.reward is not None:
            reward, why = step_reward(step.reward)
            if why:  # the environment's fault, not a score
                raise _EnvFailed(f"its step reward {why}")
            ep.traj.tool_reward += reward
        if step is None or step.done or not step.messages:
            return ep.end("stop")
        if ep.turn + 1 == cfg.max_assistant_turns:
            return ep.end("max_turns")
        ep.role, ep.context = "environment", list(step.messages)
        return State.APPEND

    async def _append(self, ep: Episode) -> State:
        """The replies as the chat template renders them after the turn (context), if they and a next turn fit."""
        traj, res = ep.traj, ep.result
        ids = self.template.suffix(ep.context)
        if res.token_ids and res.token_ids[-1] != self.eos:
            # a turn a stop string ended (after a call, or rollout.stop): its end of turn is the template's,
            # context, not sampled
            ids = [self.eos] + ids
        if len(traj.response_ids) + len(ids) >= self.max_response_length:
            return ep.end("length")  # no room for the replies and a next turn
        traj.add(ids, None, ep.role, text="\n".join(str(m.get("content", "")) for m in ep.context),
                 latency_s=time.perf_counter() - ep.context_t0)
        traj.messages.extend(ep.context)
        ep.turn += 1
        return State.GENERATE

    async def _finish(self, ep: Episode) -> None:
        """FINISH, however the attempt ended: its weight version, its tools' rewards and release, the
        environment closed (each bounded and counted; nothing here can fail the trajectory)."""
        traj = ep.traj
        traj.weight_version = min(ep.versions) if ep.versions else None
        await self.calls.release(traj, ep.instances, ep.kwargs)
        if ep.env is not None:
            try:
                await asyncio.wait_for(ep.env.close(), self.cfg.tool_timeout_s)
            except Exception as err:  # noqa: BLE001 - counted; the trajectory is already over
                traj.count("multi_turn/env_close_errors")
                log.warning("environment close failed: %s: %s", type(err).__name__, err)

    async def _env_call(self, traj: Trajectory, method, *args):
        """One environment call under tool_timeout_s: a hang is tool_timeout, a raise env_failed."""
        try:
            return await asyncio.wait_for(method(*args), self.cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            traj.count("multi_turn/env_timeouts")
            raise ToolTimeout("environment") from None
        except InputError:
            raise  # a record the environment cannot read is bad input (file, line, field), not its failure
        except Exception as err:  # noqa: BLE001 - the environment's failure fails its trajectory, counted
            raise _EnvFailed(f"{type(err).__name__}: {err}") from err

    # --- the dispatcher ------------------------------------------------------------------------------
    async def _dispatch(self, batch: Batch, generate: Generate):
        """Send the ready requests as soon as they are ready, one call per token budget, without waiting for
        the calls already in flight (the engines batch concurrent calls continuously, as SGLang's scheduler
        does); wake each trajectory with its own result."""
        sampling = batch.sampling
        while True:
            ready = [await batch.queue.get()]
            await asyncio.sleep(0)  # trajectories woken by the same result put their next requests first
            while not batch.queue.empty():
                ready.append(batch.queue.get_nowait())
            ready = [r for r in ready if not r.future.done()]  # its trajectory was cut or timed out meanwhile
            by_budget: dict[tuple, list[Request]] = {}
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
                batch.in_flight.add(call)
                call.add_done_callback(lambda f, reqs=reqs: _deliver(f, reqs, batch))

    # --- the drift check and the batch's metrics -------------------------------------------------------
    def drift(self, traj: Trajectory, prompt_messages: list[dict], schemas: list[dict]) -> int:
        """Tokens by which the tokenizer's own rendering of the finished conversation differs from the ids."""
        theirs = self.template.render_ids(list(prompt_messages) + traj.messages, schemas or None)
        tail = self.template.end_tail()
        if tail and traj.response_ids and traj.response_ids[-1] == self.eos and theirs[-len(tail):] == tail:
            theirs = theirs[:-len(tail)]  # the template's text after the final end-of-turn token
        return count_drift(traj.prompt_ids + traj.response_ids, theirs)


def _deliver(call: asyncio.Future, reqs: list[Request], batch: Batch) -> None:
    """A generate call's results to the trajectories waiting on them (its error, when it raised, to each)."""
    batch.in_flight.discard(call)
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
        batch.measured[k] = batch.measured.get(k, 0) + v
    for r, res in zip(reqs, results):
        if not r.future.done():  # (a trajectory that timed out or was aborted meanwhile is gone)
            r.future.set_result(res)


class _GenerationFailed(Exception):
    pass


class _EnvFailed(Exception):
    pass


def _assistant_message(parsed) -> dict:
    msg: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}}
                             for c in parsed.calls]
    return msg


