"""The chaos harness: one long run with a seeded schedule of faults of every kind, healed in the run or survived by
resuming (as a SLURM requeue would), and at the end the same records and the same final weights as the run
without faults.

    python -m benchmarks.jobs.chaos                     # every job, 200 steps, 12 faults each (of the kinds it has)
    python -m benchmarks.jobs.chaos --job default --steps 20 --faults 3 --kinds engine_kill,router_kill,driver_kill

Per job, the harness first runs the job once without faults (the reference), then again under the schedule.
A fault fires once the run's console has shown step `at_step` (of the attempt running), `delay_s` later
(`delay_s` < 1, scaled by the last step's duration where a step takes less than a second):

| kind | what | expected |
|---|---|---|
| engine_kill | SIGKILL one engine's server | healed: restarted, re-synced, its requests resent (`rollout/restarts`) |
| engine_hang | SIGSTOP one engine's server | healed: its health check times out, then as above |
| router_kill | SIGKILL SGLang's router (2 engines) | healed: a new router in front of the engines (`rollout/restarts`) |
| reward_worker_kill | SIGKILL a reward worker | healed: replaced, its call sent again (`reward/worker_restarts`) |
| judge_kill | SIGKILL a reward model's (judge's) server (job reward_model) | healed: started again in its bundle, its call sent again (`reward/model_restarts`) |
| megatron_rank_kill | SIGKILL a Megatron rank | fatal: the run fails naming the rank and its pid; resumed |
| driver_kill | SIGKILL the driver | fatal (nothing is said); the job's processes are killed; resumed |
| preempt | SIGTERM the driver (SLURM preemption) | the step finishes, a checkpoint, exit 75; resumed |
| tool_hang | the user's tool hangs on its next call (multi_turn job) | healed: its trajectory generated again with the same seeds (`multi_turn/trajectory_retries`) |
| env_crash | the user's environment raises on its next step (multi_turn job) | healed: as tool_hang |

tool_hang and env_crash happen where they happen in reality, in user code: the multi_turn job's tool and
environment are a user's file (tests/helpers/chaos_tools.py, given by import path), and the harness asks
for the fault by writing a file named after the kind into the folder in the run's $MGRPO_CHAOS_FAULTS.

Processes are found by what belongs to this run only: the CPU servers by their model folder
(<run>/init_hf), every other process by the run's private RAY_TMPDIR in its environment (each attempt has
its own), reward workers also by their parent (the driver). A resumed attempt runs with
`trainer.resume=auto`, exactly as slurm/train.sbatch does after a requeue.

`python -m benchmarks.jobs.chaos` runs the long soak with it; tests/e2e/test_chaos.py runs it in short. Checked at the
end and written to the benchmark's --out (benchmarks/results/chaos_cpu.json): every step exactly once in
metrics.jsonl, TensorBoard and trajectories.jsonl, every step's samples complete (each prompt n times),
every fault accounted for (in the harness's events and, for healed ones, in the run's counters), and the
final HF export against the reference run's (max abs difference; bit-exact or not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from benchmarks import REPO
from tests.helpers.chaos_tools import FAULTS_ENV
from tests.helpers.procs import until_none

EXIT_STOPPED = 75  # mgrpo_launchers.train.EXIT_STOPPED

COMMON = ["rollout.num_engines=2", "rollout.health_check_interval_s=1", "rollout.health_check_timeout_s=10",
          "rollout.request_timeout_s=60", "trainer.save_freq=10", "trainer.logger=[console,tensorboard]",
          "reward.isolate_builtin_rules=true"]
"""Every job: two engines behind the router; fast health checks and a checkpoint every 10 steps; the built-in
rules judged in the reward workers (which `reward_worker_kill` kills; by default they run in the driver) (all
result-neutral keys, components/run_folder.py::RESULT_NEUTRAL)."""

RM_DIR = "<reward-model>"
"""Stands for the job's reward model (a tiny random sequence classifier, written beside its runs by `soak_job`)."""
MULTI_TURN_USER_CODE = ["rollout.multi_turn.tool_config_path=tests/helpers/chaos_tools.yaml",
                        "rollout.multi_turn.environment=tests.helpers.chaos_tools:PeekEnvironment",
                        "rollout.multi_turn.tool_timeout_s=2"]
"""The peek task with a user's tool and environment that fail when asked (tool_hang, env_crash)."""

JOBS = {
    "default": ["trainer.n_gpus_per_node=2"],
    "async_tp2": ["rollout.async_mode=one_step_off", "rollout.mode=disaggregated", "actor.tp=2",
                  "trainer.n_gpus_per_node=4"],
    "reward_model": ["trainer.n_gpus_per_node=2", f"reward.models={{rm: {{hf_path: '{RM_DIR}', engines: 2}}}}",
                     "reward.compose={mgrpo/sum: {rm: 1.0}}"],
    "multi_turn": ["recipe=tool-peek-tiny-cpu", "trainer.n_gpus_per_node=2", *MULTI_TURN_USER_CODE,
                   "rollout.multi_turn.required_per_group=${rollout.n}"],
}
"""The default job (colocated; two engines share the two CPU bundles of two data-parallel Megatron ranks);
one-step-off asynchronous rollout at TP=2 (two Megatron ranks, two engines of their own); the default job rewarded by
a reward model of two servers (reward.models.rm, its own bundles) alone; multi-turn rollouts of the tool task
(recipe=tool-peek-tiny-cpu: two in-process engines in the two Megatron ranks; every sample's first turn under
tool_choice=required, required_per_group=rollout.n, whatever n the soak runs: every trajectory reaches the tool)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    target: str
    sig: int
    fatal: bool
    counter: Optional[str] = None
    """The run-long counter a healed fault increases."""
    jobs: tuple[str, ...] = ()
    """The jobs it can hit (a process only they have); empty: every job."""


KINDS = {
    "engine_kill": Kind("engine", signal.SIGKILL, False, "rollout/restarts_total"),
    "engine_hang": Kind("engine", signal.SIGSTOP, False, "rollout/restarts_total"),
    "router_kill": Kind("router", signal.SIGKILL, False, "rollout/restarts_total"),
    "reward_worker_kill": Kind("reward_worker", signal.SIGKILL, False, "reward/worker_restarts_total"),
    "judge_kill": Kind("reward_engine", signal.SIGKILL, False, "reward/model_restarts_total", ("reward_model",)),
    "megatron_rank_kill": Kind("megatron_rank", signal.SIGKILL, True),
    "driver_kill": Kind("driver", signal.SIGKILL, True),
    "preempt": Kind("driver", signal.SIGTERM, True),
    "tool_hang": Kind("user_code", 0, False, "multi_turn/trajectory_retries_total", ("multi_turn",)),
    "env_crash": Kind("user_code", 0, False, "multi_turn/trajectory_retries_total", ("multi_turn",)),
}


def job_kinds(job: str, kinds: list[str]) -> list[str]:
    """The kinds of `kinds` that have a target in `job`: a kind with `jobs` only in those (the reward model's
    servers, the user's tool file); the CPU servers and the router not in the multi_turn job (its engines are
    in-process, in the Megatron ranks)."""
    in_process = MULTI_TURN_USER_CODE[0] in JOBS[job]
    return [k for k in kinds if (not KINDS[k].jobs or job in KINDS[k].jobs)
            and not (in_process and KINDS[k].target in ("engine", "router"))]


@dataclasses.dataclass
class Fault:
    kind: str
    at_step: int
    delay_s: float
    pick: int
    """Which of the matching processes (engines, ranks, workers), modulo how many there are."""


def make_schedule(seed: int, steps: int, count: int, kinds: list[str]) -> list[Fault]:
    """`count` faults, every kind at least once, at distinct steps spread over the run (one per equal slot
    of [3, steps - 2], so that each has room to heal and a fatal one has steps to redo)."""
    if count < len(kinds):
        raise SystemExit(f"--faults {count} cannot cover {len(kinds)} kinds")
    rng = random.Random(seed)
    chosen = list(kinds) + [rng.choice(kinds) for _ in range(count - len(kinds))]
    rng.shuffle(chosen)
    lo, hi = 3, steps - 2
    if hi - lo + 1 < 2 * count:
        raise SystemExit(f"--steps {steps} is too short for {count} faults (two steps each at least)")
    width = (hi - lo + 1) / count
    return [Fault(k, lo + int(i * width) + rng.randrange(max(1, int(width) - 1)), round(rng.uniform(0.0, 1.0), 2),
                  rng.randrange(1000)) for i, k in enumerate(chosen)]


# --- processes of this run ---------------------------------------------------------------------------
def _proc(pid: int, what: str) -> str:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())


def marked(marker: str) -> list[int]:
    """Processes whose environment holds this attempt's private RAY_TMPDIR (the driver's children, Ray's
    processes and everything they started)."""
    return [p for p in _pids() if f"RAY_TMPDIR={marker}\0" in _proc(p, "environ") + "\0"]


def targets(kind: Kind, run_dir: str, marker: str, driver: int) -> list[int]:
    if kind.target == "driver":
        return [driver]
    if kind.target in ("engine", "reward_engine"):  # a reward model's servers: its folder beside the job's runs
        model = os.path.join(run_dir, "init_hf") if kind.target == "engine" else reward_model_dir(run_dir)
        tag = f"mgrpo.rollout.sglang.cpu.server\0--model-path\0{model}\0"
        return [p for p in _pids() if tag in _proc(p, "cmdline")]
    mine = marked(marker)
    if kind.target == "router":  # it renames itself (sglang::router), which overwrites its environment
        return [p for p in children(driver) if _proc(p, "cmdline").startswith("sglang::router")]
    if kind.target == "reward_worker":
        return [p for p in children(driver) if "mgrpo.rewards.worker" in _proc(p, "cmdline")]
    if kind.target == "megatron_rank":
        return [p for p in mine if _proc(p, "cmdline").startswith("ray::MegatronRank")]
    raise ValueError(kind.target)


def reward_model_dir(run_dir: str) -> str:
    """The job's reward model (RM_DIR), beside its reference and chaos runs."""
    return os.path.join(os.path.dirname(run_dir), "rm")


def _ppid(pid: int) -> str:
    """The parent's pid as /proc/<pid>/stat gives it ('' for a process gone)."""
    return (_proc(pid, "stat").rsplit(")", 1)[-1].split()[1:2] or [""])[0]


def children(pid: int) -> list[int]:
    return [p for p in _pids() if _ppid(p) == str(pid)]


def descendants(pid: int) -> list[int]:
    """Everything below `pid` in the process tree now: Ray's agents are the raylet's children, not the driver's,
    and they rename themselves (setproctitle), which can overwrite the environment that carries the marker."""
    parent = {p: _ppid(p) for p in _pids()}
    out, frontier = [], {str(pid)}
    while frontier:
        below = [p for p, pp in parent.items() if pp in frontier]
        out += below
        frontier = {str(p) for p in below}
    return out


def started(pid: int) -> str:
    """The process's start time (with its pid, what identifies it: pids are reused)."""
    return (_proc(pid, "stat").rsplit(")", 1)[-1].split()[19:20] or [""])[0]


def kill_all(pids) -> int:
    n = 0
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


# --- one run under a schedule --------------------------------------------------------------------------
class Soak:
    def __init__(self, run_dir: str, overrides: list[str], schedule: list[Fault], workdir: str, log=print):
        self.run_dir, self.overrides, self.schedule, self.workdir = run_dir, overrides, schedule, workdir
        self.log = log
        self.events: list[dict] = []
        self.attempts: list[dict] = []
        self.faults: list[dict] = []

    def event(self, what: str, **kw) -> None:
        e = {"t": round(time.time() - self.t0, 2), "event": what, **kw}
        self.events.append(e)
        self.log("chaos | " + " ".join(f"{k}={v}" for k, v in e.items()))

    def run(self, max_attempts: int = 20) -> None:
        self.t0 = time.time()
        todo = list(self.schedule)
        # Each attempt's private RAY_TMPDIR (what marks its processes) under a short path: Ray's socket paths
        # must fit in 107 bytes.
        self.ray_tmp = tempfile.mkdtemp(prefix="mgrpo-chaos-", dir="/tmp")
        os.makedirs(self.workdir, exist_ok=True)
        self.fault_dir = os.path.join(self.workdir, "faults")  # what the user's code reads (tool_hang, env_crash)
        os.makedirs(self.fault_dir, exist_ok=True)
        try:
            while len(self.attempts) < max_attempts:
                rc = self._attempt(len(self.attempts), todo)
                if rc == 0:
                    if todo:
                        self.event("unfired", faults=[f.kind for f in todo])
                    return
        finally:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
        raise RuntimeError(f"the run did not finish in {max_attempts} attempts")

    def _attempt(self, k: int, todo: list[Fault]) -> int:
        marker = os.path.join(self.ray_tmp, f"a{k}")
        os.makedirs(marker, exist_ok=True)
        args = list(self.overrides) + (["trainer.resume=auto"] if k else [])
        env = {**os.environ, "RAY_TMPDIR": marker, "PYTHONUNBUFFERED": "1", FAULTS_ENV: self.fault_dir}
        out_path = os.path.join(self.workdir, f"attempt{k}.log")
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={self.run_dir}",
                                 *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)
        self.event("start", attempt=k, pid=proc.pid, resume=bool(k))
        seen = {"step": None, "at": 0.0, "dt": 1.0}
        lines: list[str] = []

        def read():
            with open(out_path, "w", buffering=1) as f:  # line by line: readable while the run goes
                for line in proc.stdout:
                    f.write(line)
                    lines.append(line)
                    m = re.match(r"step (\d+)/\d+ \|", line)
                    if m:
                        now = time.time()
                        if seen["step"] is not None:
                            seen["dt"] = now - seen["at"]
                        seen["step"], seen["at"] = int(m.group(1)), now

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        fatal: Optional[dict] = None
        crossed: Optional[float] = None  # when the next fault's step was reached
        # the driver's descendants, each with its start time (the router's and Ray agents' environments may not
        # carry the marker; a SIGKILLed raylet's agents outlive it by up to a minute, waiting on the dead GCS)
        kids: dict[int, str] = {}
        last_scan = 0.0
        while proc.poll() is None:
            f = todo[0] if todo else None
            if f is not None and fatal is None and seen["step"] is not None and seen["step"] >= f.at_step:
                crossed = crossed or time.time()
                # at most one step late: on a fast (idle) machine a second spans several steps, and a fault
                # that lands after the last one is never noticed
                if time.time() - crossed >= f.delay_s * min(1.0, seen["dt"]):
                    todo.pop(0)
                    crossed = None
                    kids.update((p, started(p)) for p in descendants(proc.pid))
                    record = self._inject(f, k, seen["step"], marker, proc.pid)
                    if record is not None and KINDS[f.kind].fatal:
                        fatal = record
            if time.time() - last_scan > 2.0:
                kids.update((p, started(p)) for p in descendants(proc.pid))
                last_scan = time.time()
            time.sleep(0.02)
        reader.join(timeout=30)
        rc = proc.returncode
        output = "".join(lines)
        # What the job left behind (on a cluster the node's job processes go with it): the processes that
        # carry the marker, and the driver's children still running (the same processes: same start time).
        def left() -> list[int]:
            return sorted(set(marked(marker)) | {p for p, t in kids.items() if t and started(p) == t})

        # watchdogs notice their parent's end within a few seconds; the SIGKILLed are gone once the kernel has
        # torn them down
        killed = kill_all(until_none(left, 0 if fatal is not None and fatal["kind"] == "driver_kill" else 20, 0.5))
        until_none(left, 10, 0.2)
        resumed = re.search(r"resumed from (\S+) at step (\d+)", output)
        self.attempts.append({"attempt": k, "exit_code": rc, "wall_s": round(time.time() - t0, 1),
                              "last_step": seen["step"], "resumed_from_step": int(resumed.group(2)) if resumed else None,
                              "processes_left_behind": killed})
        self.event("end", attempt=k, exit_code=rc, last_step=seen["step"], left_behind=killed)
        if rc != 0 and fatal is None:
            raise RuntimeError(f"attempt {k} failed (exit {rc}) without a fatal fault:\n{output[-4000:]}")
        shutil.copy(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.workdir, f"metrics{k}.jsonl"))
        if fatal is not None:
            fatal["exit_code"] = rc
            fatal["message"] = _last_error(output)
            fatal["names_the_process"] = fatal["kind"] != "megatron_rank_kill" or f"pid {fatal['pid']}" in output
            fatal["expected_exit"] = rc == (EXIT_STOPPED if fatal["kind"] == "preempt" else
                                           -signal.SIGKILL if fatal["kind"] == "driver_kill" else 1)
        return rc

    def _inject(self, f: Fault, attempt: int, step: int, marker: str, driver: int) -> Optional[dict]:
        kind = KINDS[f.kind]
        if kind.target == "user_code":  # the user's tool or environment fails on its next call
            with open(os.path.join(self.fault_dir, f.kind), "w") as fh:
                fh.write("1")
            record = {"kind": f.kind, "scheduled_step": f.at_step, "step_seen": step, "attempt": attempt,
                      "pid": None, "process": f"user code ({FAULTS_ENV}/{f.kind})", "signal": None, "fatal": False,
                      "candidates": 1}
            self.faults.append(record)
            self.event("fault", kind=f.kind, step=step, attempt=attempt)
            return record
        found = targets(kind, self.run_dir, marker, driver)
        if not found:
            self.event("no_target", kind=f.kind, at_step=step)
            return None
        pid = found[f.pick % len(found)]
        cmd = _proc(pid, "cmdline").replace("\0", " ")[:120]
        os.kill(pid, kind.sig)
        record = {"kind": f.kind, "scheduled_step": f.at_step, "step_seen": step, "attempt": attempt, "pid": pid,
                  "process": cmd, "signal": signal.Signals(kind.sig).name, "fatal": kind.fatal,
                  "candidates": len(found)}
        self.faults.append(record)
        self.event("fault", kind=f.kind, pid=pid, step=step, attempt=attempt)
        return record


def _last_error(output: str) -> str:
    """The line a failed run ends with (the exception's message, or mgrpo-train's own line)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"(RuntimeError|mgrpo-train|.*Error): ", ln):
            return ln[:400]
    return lines[-1][:400] if lines else ""


# --- checks --------------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_records(run_dir: str, steps: int, batch: int, n: int) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    rows = read_jsonl(os.path.join(run_dir, "trajectories.jsonl"))
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tb = [e.step for e in events.Scalars("actor/pg_loss")]
    by_step: dict[int, list] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["group"])
    complete = all(sorted(by_step.get(s, [])) == sorted(g for g in range(batch) for _ in range(n))
                   for s in range(1, steps + 1))
    return {"metrics_steps_once": [m["step"] for m in metrics] == list(range(1, steps + 1)),
            "tensorboard_steps_once": tb == list(range(1, steps + 1)),
            "trajectory_steps_once": sorted(by_step) == list(range(1, steps + 1)) and len(rows) == steps * batch * n,
            "samples_complete": complete}


COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
            "rollout/weight_version", "actor/lr")


def compare_runs(run_dir: str, ref_dir: str) -> dict:
    """The final HF export and every step's metrics and samples against the run without faults."""
    from safetensors.torch import load_file

    a = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
    b = load_file(os.path.join(ref_dir, "hf", "model.safetensors"))
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in b) if set(a) == set(b) else float("inf")
    ma, mb = read_jsonl(os.path.join(run_dir, "metrics.jsonl")), read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    first_metric = next((x["step"] for x, y in zip(ma, mb) if any(x.get(k) != y.get(k) for k in COMPARED)), None)
    keys = ("prompt", "response", "reward", "advantage", "weight_version", "group")
    ta = [{k: r[k] for k in keys} | {"step": r["step"]} for r in read_jsonl(os.path.join(run_dir, "trajectories.jsonl"))]
    tb = [{k: r[k] for k in keys} | {"step": r["step"]} for r in read_jsonl(os.path.join(ref_dir, "trajectories.jsonl"))]
    first_sample = next((x["step"] for x, y in zip(ta, tb) if x != y), None)
    return {"hf_tensors": len(b), "hf_max_abs_diff": diff, "hf_bit_exact": diff == 0.0,
            "first_step_metrics_differ": first_metric, "first_step_samples_differ": first_sample,
            **logprobs_differ(run_dir, ref_dir, first_sample)}


def logprobs_differ(run_dir: str, ref_dir: str, upto: Optional[int]) -> dict:
    """Over the steps whose samples are the same tokens in both runs: how many samples' engine (rollout) and
    trainer log-probs differ at all (where a difference starts, when the tokens still agree)."""
    def rows(d):
        out = [r for r in read_jsonl(os.path.join(d, "trajectories.jsonl")) if upto is None or r["step"] < upto]
        return sorted(out, key=lambda r: (r["step"], r["group"], r["response_ids"]))
    a, b = rows(run_dir), rows(ref_dir)
    same = [(x, y) for x, y in zip(a, b) if x["response_ids"] == y["response_ids"]]
    first = {f: next((x["step"] for x, y in same if x.get(f) != y.get(f)), None)
             for f in ("rollout_logprobs", "trainer_logprobs")}
    return {"samples_same_tokens": len(same),
            "rollout_logprobs_differ": sum(x.get("rollout_logprobs") != y.get("rollout_logprobs") for x, y in same),
            "trainer_logprobs_differ": sum(x.get("trainer_logprobs") != y.get("trainer_logprobs") for x, y in same),
            "first_step_rollout_logprobs_differ": first["rollout_logprobs"],
            "first_step_trainer_logprobs_differ": first["trainer_logprobs"]}


def before_first_fault(soak: "Soak", ref_dir: str) -> dict:
    """The first attempt's steps before its first fault against the reference: two runs without any fault
    so far, so a difference here is the job's own run-to-run nondeterminism, not a fault's."""
    first = min((f["step_seen"] for f in soak.faults if f["attempt"] == 0), default=10 ** 9)
    ref = {m["step"]: m for m in read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))}
    mine = [m for m in read_jsonl(os.path.join(soak.workdir, "metrics0.jsonl")) if m["step"] < first]
    differ = next((m["step"] for m in mine if any(m.get(k) != ref[m["step"]].get(k) for k in COMPARED)), None)
    return {"steps_compared": len(mine), "first_step_differs": differ}


def account(soak: Soak, run_dir: str) -> list[dict]:
    """For every healed fault: the first step after it whose run-long counter rose (read from the metrics of
    the attempt it happened in), and whether that step survived into the final records (a later fatal fault
    makes the run redo the steps after its last checkpoint, and with them their counts)."""
    final = {m["step"]: m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    kept_upto = {}  # attempt -> the last of its steps still in the final records
    for a in soak.attempts:
        nxt = next((b for b in soak.attempts if b["attempt"] == a["attempt"] + 1), None)
        # (an attempt that found no checkpoint started over: nothing of the one before it was kept)
        kept_upto[a["attempt"]] = (nxt["resumed_from_step"] or 0) if nxt is not None else 10 ** 9
    for f in soak.faults:
        kind = KINDS[f["kind"]]
        if kind.fatal:
            f["counted"] = "harness events (the run ended; resumed)"
            continue
        metrics = {m["step"]: m for m in read_jsonl(os.path.join(soak.workdir, f"metrics{f['attempt']}.jsonl"))}
        before = metrics.get(f["step_seen"], {}).get(kind.counter, 0.0)
        after = next((s for s in sorted(metrics) if s > f["step_seen"] and metrics[s].get(kind.counter, 0.0) > before),
                     None)
        f["counter"] = kind.counter
        f["counted_at_step"] = after
        f["in_final_records"] = after is not None and after <= kept_upto[f["attempt"]] and after in final
        f["counted"] = ("run metrics" if after is not None else "harness events only (the attempt ended before "
                        "its next step was logged)")
    return soak.faults


# --- main ----------------------------------------------------------------------------------------------
def run_once(run_dir: str, overrides: list[str], workdir: str, log=print) -> float:
    soak = Soak(run_dir, overrides, [], workdir, log)
    t0 = time.time()
    soak.run(max_attempts=1)
    return time.time() - t0


def _finished(run_dir: str, steps: int) -> bool:
    path = os.path.join(run_dir, "metrics.jsonl")
    return (os.path.isfile(os.path.join(run_dir, "hf", "model.safetensors")) and os.path.isfile(path)
            and [m["step"] for m in read_jsonl(path)] == list(range(1, steps + 1)))


def soak_job(name: str, overrides: list[str], *, steps: int, faults: int, seed: int, kinds: list[str], batch: int,
             n: int, workdir: str, log=print) -> dict:
    overrides = [*COMMON, *JOBS[name], f"trainer.total_training_steps={steps}", f"data.train_batch_size={batch}",
                 f"rollout.n={n}", *overrides]
    kinds = job_kinds(name, kinds)  # --kinds all: what the job has
    if not kinds:
        raise SystemExit(f"job {name} has none of the fault kinds asked for (judge_kill needs --job reward_model; "
                         "tool_hang and env_crash --job multi_turn)")
    schedule = make_schedule(seed, steps, faults, kinds)
    ref_dir, run_dir = os.path.join(workdir, name, "reference"), os.path.join(workdir, name, "chaos")
    if any(RM_DIR in o for o in overrides):
        from tests.helpers.reward_models import tiny_classifier

        rm = reward_model_dir(run_dir)
        if not os.path.isdir(rm):  # seeded: a kept --workdir's reference run scored with the same model
            tiny_classifier(rm)
        overrides = [o.replace(RM_DIR, rm) for o in overrides]
    load0 = os.getloadavg()
    ref_s, reused = None, _finished(ref_dir, steps)
    if reused:  # a --workdir kept from an earlier call with the same arguments: its finished reference run
        log(f"chaos | {name}: reusing the reference run in {ref_dir}")
    else:
        log(f"chaos | {name}: reference run without faults ({steps} steps)")
        ref_s = run_once(ref_dir, overrides, os.path.join(workdir, name, "ref-attempts"), log)
    log(f"chaos | {name}: {len(schedule)} faults: " + ", ".join(f"{f.kind}@{f.at_step}" for f in schedule))
    soak = Soak(run_dir, overrides, schedule, os.path.join(workdir, name, "attempts"), log)
    os.makedirs(soak.workdir, exist_ok=True)
    t0 = time.time()
    soak.run()
    chaos_s = time.time() - t0
    final = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[-1]
    counters = {k: v for k, v in final.items() if k.endswith("_total")}
    untaken = sorted(os.listdir(soak.fault_dir))  # a user-code fault the run never reached (no call after it)
    return {
        "overrides": overrides, "seed": seed, "steps": steps,
        "schedule": [dataclasses.asdict(f) for f in schedule],
        "faults": account(soak, run_dir),
        "fault_kinds": sorted({f["kind"] for f in soak.faults}),
        "user_code_faults_not_taken": untaken,
        "attempts": soak.attempts,
        "records": check_records(run_dir, steps, batch, n),
        "final_counters": counters,
        "vs_uninterrupted": compare_runs(run_dir, ref_dir),
        "fault_free_steps_vs_reference": before_first_fault(soak, ref_dir),
        "events": soak.events,
        "reference_wall_s": None if ref_s is None else round(ref_s, 1), "reference_reused": reused,
        "chaos_wall_s": round(chaos_s, 1),
        "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
    }
