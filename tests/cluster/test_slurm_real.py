"""slurm/train.sbatch on a real one-node SLURM: slurmctld and slurmd from Debian's slurm-wlm, brought up on
this machine by `slurm/testing/local_cluster.sh up` (.ci/run does, and `down` after the tests; the tests
themselves install and start nothing, and skip without the cluster unless MGRPO_REQUIRE_SLURM is set). A job is submitted with `sbatch`, waited for, and checked: its steps in metrics.jsonl
and its state in `scontrol show job`. A longer job is interrupted mid-run by `scontrol requeue`, then by
the time-limit warning the script asks for (`--signal=B:USR1@...`, sent here with `scancel --signal=USR1
--batch`); each requeued run resumes from its checkpoint and the job finishes with every step logged
exactly once. A SIGTERM to the batch script stops and requeues a third job, `scancel` ends it.

There is no accounting database (sacct does not work): the job record stays in `scontrol show job` for
MinJobAge seconds and jobcomp/filetxt logs one line per finished run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mgrpo.net import free_port
from tests.helpers import ROOT
from tests.helpers.procs import machine_wide, processes_mentioning


SCRIPT = ROOT / "slurm" / "train.sbatch"
CLUSTER = ROOT / "slurm" / "testing" / "local_cluster.sh"
STATE = Path(os.environ.get("MGRPO_SLURM_STATE", "/var/spool/mgrpo-slurm"))
JOB_NAME = "mgrpo-test-real"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}

pytestmark = [pytest.mark.system, machine_wide]


def _run(*args: str, timeout: float = 60, check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {out.returncode}:\n{out.stdout}{out.stderr}")
    return out.stdout


REQUIRE = "MGRPO_REQUIRE_SLURM"
"""Set (to 1) by .ci/run, which brings the local cluster up around the tests: there a missing cluster fails."""
MARKER = "mgrpo local test cluster"  # in the slurm.conf local_cluster.sh writes: never submit to another cluster
CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))


def _cluster_problem() -> str | None:
    """Why the local test cluster is not there to use, or None when it is up and idle."""
    if not all(shutil.which(b) for b in ("sbatch", "sinfo", "scontrol", "squeue", "scancel")):
        return "SLURM's client commands are not installed"
    if not CONF.is_file() or MARKER not in CONF.read_text(errors="replace"):
        return f"{CONF} is not the local test cluster's (written by {CLUSTER.relative_to(ROOT)})"
    try:
        out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%T"], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    states = out.stdout.split()
    if out.returncode != 0 or not states or not all(s in ("idle", "mixed", "allocated", "completing")
                                                    for s in states):
        return f"the node is not up (sinfo: {(out.stdout + out.stderr).strip()[:200]!r})"
    return None


@pytest.fixture(scope="module")
def slurm():
    """The local cluster, already up: the tests never install packages or start daemons. Without it they skip
    (how to enable them is in the reason), except under .ci/run, where a skip would be a failure."""
    problem = _cluster_problem()
    if problem:
        how = f"as root: bash {CLUSTER.relative_to(ROOT)} up (and ... down after)"
        if os.environ.get(REQUIRE):
            pytest.fail(f"{REQUIRE} is set but the local SLURM cluster is not usable: {problem}; {how}")
        pytest.skip(f"no local SLURM cluster ({problem}); to run these: {how}")
    # A job left by an interrupted earlier session would hold the node (the script asks for --exclusive).
    stale = _run("squeue", "--noheader", f"--name={JOB_NAME}", "--format=%i").split()
    if stale:
        _run("scancel", *stale)
        _wait_for(lambda: not _run("squeue", "--noheader", f"--name={JOB_NAME}", "--format=%i").split(), 120,
                  "stale test jobs to leave the queue")
    return STATE


def _wait_for(predicate, timeout: float, what: str, job: "Job | None" = None, poll: float = 0.5):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n" + (job.diagnostics() if job else ""))


class Job:
    """One `sbatch slurm/train.sbatch` job, run as this machine's one-node allocation."""

    def __init__(self, tmp_path: Path, *overrides: str, steps: int, save_freq: int, **env: str):
        self.dir = tmp_path
        self.run_dir = tmp_path / "run"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "MGRPO_"))}
        self.env.update({
            # Ray stays on loopback; a port of its own (other Ray clusters may run on this machine).
            "MGRPO_HEAD_IP": "127.0.0.1", "MGRPO_RAY_PORT": str(free_port()),
            "MGRPO_RAY_HEAD_ARGS": f"--ray-client-server-port={free_port()} "
                                   f"--dashboard-agent-listen-port={free_port()}",
            "MGRPO_JOIN_TIMEOUT_S": "120",
        } | env)
        self.overrides = [f"trainer.output_dir={self.run_dir}", f"trainer.total_training_steps={steps}",
                          f"trainer.save_freq={save_freq}", "data.train_batch_size=8", "rollout.n=4",
                          "trainer.save_hf=false", "trainer.logger=[tensorboard]", *overrides]
        # The script's header asks for 2 nodes with 8 GPUs each: this cluster has one node and no GPU.
        out = subprocess.run(["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--nodes=1", "--gpus-per-node=0",
                              f"--output={tmp_path}/job-%j.log", str(SCRIPT), *self.overrides],
                             env=self.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        self.id = out.stdout.strip().split(";")[0]
        self.log = tmp_path / f"job-{self.id}.log"
        self.t0 = time.monotonic()
        self.marks: list[str] = []

    def mark(self, what: str) -> None:
        """Note how long the job took to reach `what` (printed: the test's timings on a shared machine)."""
        self.marks.append(f"{time.monotonic() - self.t0:6.1f}s {what}")
        print(f"job {self.id}: {self.marks[-1]}")

    # --- what SLURM says ------------------------------------------------------------------------------
    def info(self) -> dict:
        out = _run("scontrol", "show", "job", "--oneliner", self.id)
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def state(self) -> str:
        return self.info()["JobState"]

    def restarts(self) -> int:
        return int(self.info()["Restarts"])

    def jobcomp(self) -> list[dict]:
        """One record per finished run of this job (jobcomp/filetxt)."""
        path = STATE / "jobcomp.log"
        records = [dict(f.split("=", 1) for f in line.split() if "=" in f)
                   for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in records if r.get("JobId") == self.id]

    # --- what the job wrote --------------------------------------------------------------------------
    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if line.strip().endswith("}")]  # a line being written

    def latest(self) -> str:
        path = self.run_dir / "checkpoints" / "latest"
        return path.read_text().strip() if path.exists() else ""

    def ray_processes(self) -> list[int]:
        return processes_mentioning(f"/tmp/mgrpo-ray-{self.id}-")  # the script's default Ray temp dir

    def diagnostics(self) -> str:
        parts = [f"job {self.id}, {time.monotonic() - self.t0:.0f}s since submit", *self.marks]
        for cmd in (["squeue", "--all"], ["scontrol", "show", "job", self.id], ["sinfo", "--Node", "--long"]):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            parts.append(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
        parts.append(f"jobcomp: {self.jobcomp()}")
        parts.append(f"metrics steps: {self.steps()}  latest: {self.latest()!r}")
        parts.append("--- job log (last 60 lines)\n" + "\n".join(self.text().splitlines()[-60:]))
        for name in ("slurmctld", "slurmd"):
            log = STATE / "log" / f"{name}.log"
            if log.exists():
                parts.append(f"--- {log} (last 15 lines)\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    # --- waiting -------------------------------------------------------------------------------------
    def wait_end(self, timeout: float) -> dict:
        """Wait until the job is finished for good (not running, not requeued), return its record."""
        _wait_for(lambda: self.state() in TERMINAL, timeout, f"job {self.id} to finish", self)
        return self.info()

    def wait_running_with_steps(self, restarts: int, more_than: int, timeout: float) -> list[int]:
        """Wait until run `restarts` (0 = the first) is running and has logged a step past `more_than`."""
        def ready():
            info = self.info()
            if info["JobState"] in TERMINAL:
                pytest.fail(f"job {self.id} ended ({info['JobState']}) before it was interrupted\n"
                            + self.diagnostics())
            steps = self.steps()
            ok = info["JobState"] == "RUNNING" and int(info["Restarts"]) == restarts and steps and steps[-1] > more_than
            return steps if ok else None
        return _wait_for(ready, timeout, f"run {restarts} of job {self.id} to log a step after {more_than}", self)

    def wait_requeued(self, restarts: int, timeout: float) -> None:
        """Wait until run `restarts - 1` has ended and the job is back in the queue (or already running again)."""
        def requeued():
            info = self.info()
            return int(info["Restarts"]) == restarts and info["JobState"] in ("PENDING", "RUNNING")
        _wait_for(requeued, timeout, f"job {self.id} to be requeued (Restarts={restarts})", self)

    def cancel(self) -> None:
        subprocess.run(["scancel", self.id], capture_output=True, timeout=30)
        try:
            _wait_for(lambda: self.state() in TERMINAL, 90, f"job {self.id} to end after scancel")
        except BaseException:  # cleanup must not hide the test's own failure
            pass


def _run_once(job: Job) -> None:
    """Every step 1..N logged exactly once, in order, and the trajectories agree."""
    n = int(next(o for o in job.overrides if o.startswith("trainer.total_training_steps=")).split("=")[1])
    assert job.steps() == list(range(1, n + 1)), job.diagnostics()
    per_step: dict[int, int] = {}
    for line in (job.run_dir / "trajectories.jsonl").read_text().splitlines():
        step = json.loads(line)["step"]
        per_step[step] = per_step.get(step, 0) + 1
    assert per_step == {s: 8 * 4 for s in range(1, n + 1)}  # train_batch_size x rollout.n samples, once each


def _no_ray_left(job: Job) -> None:
    _wait_for(lambda: not job.ray_processes(), 30, f"the Ray processes of job {job.id} to exit", job)


# --- submit and finish ---------------------------------------------------------------------------------
def test_submit_runs_to_completion(slurm, tmp_path):
    job = Job(tmp_path, steps=4, save_freq=2)
    try:
        info = job.wait_end(timeout=150)
        job.mark(f"finished: {info['JobState']}")
        text = job.text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnostics()
        assert info["Restarts"] == "0" and info["NodeList"] == socket.gethostname().split(".")[0]
        _run_once(job)
        assert job.latest() == "step_000004"
        assert sorted(p.name for p in (job.run_dir / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
        assert f"job {job.id} ({JOB_NAME}), first run" in text
        port = job.env["MGRPO_RAY_PORT"]
        assert (f"running: mgrpo-train trainer.nnodes=1 trainer.ray_address=127.0.0.1:{port} trainer.resume=auto "
                f"trainer.output_dir={job.run_dir}") in text
        assert "mgrpo-train exited with status 0" in text
        assert [r["JobState"] for r in job.jobcomp()] == ["COMPLETED"]
        _no_ray_left(job)
    finally:
        job.cancel()


# --- requeued twice, resumed twice -------------------------------------------------------------------
def test_requeue_and_time_limit_signal_resume_from_the_checkpoint(slurm, tmp_path):
    n = 16
    job = Job(tmp_path, steps=n, save_freq=1)
    run = job.run_dir
    try:
        # Run 0: the administrator's `scontrol requeue`. SLURM kills the run (SIGTERM to every process,
        # SIGKILL after KillWait) and queues the job again; the step in progress is lost.
        job.wait_running_with_steps(restarts=0, more_than=1, timeout=150)
        job.mark(f"run 0 at step {job.steps()[-1]}: scontrol requeue")
        _run("scontrol", "requeue", job.id)
        job.wait_requeued(restarts=1, timeout=90)
        job.mark("requeued")
        logged, ckpt = job.steps(), job.latest()
        k = int(ckpt.split("_")[-1])
        # save_freq=1: the kill loses at most the step whose metrics were logged before its checkpoint.
        assert k >= 1 and 0 <= logged[-1] - k <= 1, (logged, ckpt)
        assert "SIGTERM: SLURM is requeueing job" in job.text()

        # Run 1 resumes from that checkpoint; then the time-limit warning (what --signal=B:USR1@300 sends
        # to the batch script): mgrpo-train finishes its step, checkpoints, and the script requeues.
        steps = job.wait_running_with_steps(restarts=1, more_than=logged[-1], timeout=150)  # a new step
        assert steps[:k] == list(range(1, k + 1))  # the resumed run appended after step k
        assert f"resumed from {run}/checkpoints/step_{k:06d} at step {k}" in job.text()
        job.mark(f"run 1 at step {job.steps()[-1]}: scancel --signal=USR1 --batch")
        _run("scancel", "--signal=USR1", "--batch", job.id)
        job.wait_requeued(restarts=2, timeout=150)
        job.mark("requeued")
        text = job.text()
        assert "SIGUSR1: the time limit is near" in text and f"requeueing job {job.id}; the next run resumes" in text
        j = int(job.latest().split("_")[-1])
        assert f"stopped at step {j} on request; checkpoint {run}/checkpoints/step_{j:06d}" in text, job.diagnostics()
        assert job.steps()[-1] == j < n  # nothing lost: the stop came after the step's checkpoint

        # Run 2 resumes and finishes.
        info = job.wait_end(timeout=240)
        job.mark(f"run 2 finished: {info['JobState']}")
        text = job.text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnostics()
        assert info["Restarts"] == "2"
        assert "requeued 2 time(s): resuming from the latest checkpoint" in text
        assert f"resumed from {run}/checkpoints/step_{j:06d} at step {j}" in text
        assert job.latest() == f"step_{n:06d}"
        _run_once(job)
        assert [r["JobState"] for r in job.jobcomp()][-1] == "COMPLETED" and len(job.jobcomp()) == 3
        _no_ray_left(job)
    finally:
        job.cancel()


# --- SIGTERM ----------------------------------------------------------------------------------------------
def test_sigterm_stops_and_requeues(slurm, tmp_path):
    """A SIGTERM to the batch script alone (the job stays RUNNING) is handled like SIGUSR1: mgrpo-train is
    asked to stop, the job is requeued; `scancel` then ends it without a requeue. MGRPO_STOP_SIGNAL=TERM
    makes the script pass SIGTERM on to mgrpo-train, as SLURM itself does at the time limit and on
    preemption: a driver that treats it like SIGUSR1 finishes its step and checkpoints (save_freq is larger
    than the run, so a checkpoint can only come from the stop)."""
    job = Job(tmp_path, steps=1000, save_freq=1000, MGRPO_STOP_SIGNAL="TERM")
    try:
        job.wait_running_with_steps(restarts=0, more_than=0, timeout=150)
        job.mark(f"at step {job.steps()[-1]}: scancel --signal=TERM --batch")
        _run("scancel", "--signal=TERM", "--batch", job.id)
        job.wait_requeued(restarts=1, timeout=150)
        job.mark("requeued")
        text = job.text()
        assert "SIGTERM (RUNNING): stopping and requeueing" in text, job.diagnostics()
        assert "stopping mgrpo-train (pid" in text and ") with SIGTERM, up to 25s" in text  # KillWait 30 - 5
        assert f"requeueing job {job.id}; the next run resumes from the latest checkpoint" in text
        # The requeued run, cancelled by the user: it stops for good, no requeue.
        _wait_for(lambda: job.text().count("running: mgrpo-train") == 2, 150, "run 1 to start mgrpo-train", job)
        job.mark("run 1 started mgrpo-train: scancel")
        _run("scancel", job.id)
        info = job.wait_end(timeout=90)
        job.mark(f"finished: {info['JobState']}")
        assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "1"), job.diagnostics()
        assert f"SIGTERM: job {job.id} cancelled (state COMPLETING); stopping without requeue" in job.text()
        _no_ray_left(job)

        # The driver's side: it must stop at the end of its step with a checkpoint, not die at once.
        latest = job.latest()
        assert latest, job.diagnostics()  # the driver handles SIGTERM like SIGUSR1 (components/signals.py)
        j = int(latest.split("_")[-1])
        assert f"stopped at step {j} on request; checkpoint {job.run_dir}/checkpoints/step_{j:06d}" in text
        assert job.steps()[-1] == j
    finally:
        job.cancel()
