"""SLURM discovery (node lists, GPU/CPU counts, the allocation) and the Ray join check, against a real
local Ray head. The sbatch script itself is checked in tests/cluster/test_slurm_sbatch.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from mgrpo.cluster.slurm import (
    SlurmEnv,
    SlurmEnvError,
    cpus_per_node,
    expand_hostlist,
    gpus_per_node,
    hostnames,
)
from mgrpo.cluster.ray_nodes import missing_hosts
from mgrpo.net import NodeAddressError, free_port, node_ip
from tests.helpers.procs import machine_wide, processes_mentioning

pytestmark = machine_wide  # see tests/helpers/procs.py


# --- node lists ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("gpu-[01-03,7],cpu5", ["gpu-01", "gpu-02", "gpu-03", "gpu-7", "cpu5"]),
    ("gpu-[1-3]", ["gpu-1", "gpu-2", "gpu-3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),                       # no padding: widths grow
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),              # padding of the lower bound
    ("n[1,3-4],m[2]", ["n1", "n3", "n4", "m2"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("ib-[1-2]-eth", ["ib-1-eth", "ib-2-eth"]),
    ("host.example.com,gpu[5-6].example.com", ["host.example.com", "gpu5.example.com", "gpu6.example.com"]),
    ("a,a", ["a"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-2", "n1-2]", "n[]", "n[3-1]", "n[a-b]", "n[1-2[3]]"])
def test_expand_hostlist_rejects_malformed_lists(spec):
    with pytest.raises(ValueError, match="node list"):
        expand_hostlist(spec)


def _fake_scontrol(tmp_path, body: str):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/usr/bin/env bash\n" + body + "\n")
    (bindir / "scontrol").chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.integration
def test_hostnames_prefers_scontrol_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, 'echo from-scontrol-1; echo from-scontrol-2'))
    assert hostnames("n[1-2]") == ["from-scontrol-1", "from-scontrol-2"]
    assert hostnames("n[1-2]", use_scontrol=False) == ["n1", "n2"]
    (tmp_path / "bin" / "scontrol").write_text("#!/usr/bin/env bash\nexit 3\n")
    assert hostnames("n[1-2]") == ["n1", "n2"]  # scontrol failed: pure-Python expansion


# --- counts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env, expected", [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "h100:4"}, (8, "SLURM_GPUS_ON_NODE")),
    ({"SLURM_GPUS_PER_NODE": "8"}, (8, "SLURM_GPUS_PER_NODE")),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, (4, "SLURM_GPUS_PER_NODE")),
    ({"SLURM_GPUS_PER_NODE": "gpu:a100:2,v100:1"}, (3, "SLURM_GPUS_PER_NODE")),
    ({"SLURM_JOB_GPUS": "0,1,2,3"}, (4, "SLURM_JOB_GPUS")),
    ({"SLURM_JOB_GPUS": "0-3,6"}, (5, "SLURM_JOB_GPUS")),
    ({}, (0, "")),
])
def test_gpus_per_node(env, expected):
    assert gpus_per_node(env) == expected


def test_bad_gpu_count_names_the_variable():
    with pytest.raises(SlurmEnvError, match="SLURM_GPUS_PER_NODE='h100:many'"):
        gpus_per_node({"SLURM_GPUS_PER_NODE": "h100:many"})


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "128"}, 32),
    ({"SLURM_CPUS_ON_NODE": "128"}, 128),
    ({"SLURM_JOB_CPUS_PER_NODE": "72(x2),36"}, 36),
    ({}, None),
])
def test_cpus_per_node(env, expected):
    assert cpus_per_node(env) == expected


# --- the allocation ----------------------------------------------------------------------------------
JOB = {"SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "mgrpo", "SLURM_JOB_NODELIST": "gpu-[01-03]",
       "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "112",
       "SLURMD_NODENAME": "gpu-01"}


def test_from_env_reads_a_job():
    env = SlurmEnv.from_env(JOB, use_scontrol=False)
    assert env.job_id == "777" and env.nnodes == 3
    assert env.hosts == ("gpu-01", "gpu-02", "gpu-03")
    assert env.head == "gpu-01" and env.workers == ["gpu-02", "gpu-03"]
    assert (env.gpus_per_node, env.gpus_source, env.cpus_per_node) == (8, "SLURM_GPUS_ON_NODE", 112)
    assert env.restart_count == 0


def test_from_env_requeued_job_and_head_is_the_batch_node():
    env = SlurmEnv.from_env(JOB | {"SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "gpu-02",
                                   "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:4"}, use_scontrol=False)
    assert env.restart_count == 2
    assert env.head == "gpu-02" and env.workers == ["gpu-01", "gpu-03"]
    assert env.gpus_per_node == 4


@pytest.mark.parametrize("env, message", [
    ({}, "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST is not set"),
    (JOB | {"SLURM_JOB_NUM_NODES": "4"}, "SLURM_JOB_NUM_NODES=4 but SLURM_JOB_NODELIST='gpu-[01-03]' expands to 3"),
    (JOB | {"SLURM_JOB_NODELIST": "gpu-[01-03"}, "SLURM_JOB_NODELIST"),
    (JOB | {"SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x' is not an integer"),
])
def test_from_env_errors_name_the_variable(env, message):
    with pytest.raises(SlurmEnvError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SlurmEnv.from_env(env, use_scontrol=False)


@pytest.mark.integration
def test_env_shell_output_evaluates_in_bash():
    env = os.environ | {k: v for k, v in JOB.items()} | {"MGRPO_HEAD_IP": "10.1.2.3", "PATH": os.environ["PATH"]}
    env.pop("SLURM_RESTART_COUNT", None)
    script = ('out=$(python -m mgrpo.cluster.slurm env --shell) && eval "$out" && '
              'echo "$MGRPO_SLURM_HEAD|$MGRPO_SLURM_HEAD_IP|$MGRPO_SLURM_WORKERS|$MGRPO_SLURM_GPUS_PER_NODE|'
              '$MGRPO_SLURM_HOSTS|$MGRPO_SLURM_NUM_WORKERS"')
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "gpu-01|10.1.2.3|gpu-02,gpu-03|8|gpu-01 gpu-02 gpu-03|2"


def test_node_ip_is_not_loopback_for_this_host():
    ip = node_ip(environ={})  # the rule itself ($MGRPO_NODE_IP, which local runs set to loopback, aside)
    socket.inet_aton(ip)
    assert not ip.startswith("127.") or _only_loopback()


def _resolving(monkeypatch, table: dict, route="10.9.9.9"):
    """`socket.gethostbyname` answers from `table` (OSError for other names); the default route is `route`."""
    import mgrpo.net as net

    def lookup(name):
        if name in table:
            return table[name]
        raise OSError(f"unknown host {name}")

    monkeypatch.setattr(net.socket, "gethostbyname", lookup)
    monkeypatch.setattr(net.socket, "gethostname", lambda: "me")
    monkeypatch.setattr(net.socket, "getfqdn", lambda: "me.cluster")
    monkeypatch.setattr(net, "route_ip", lambda: route)


def test_node_ip_precedence_for_this_node(monkeypatch):
    """One rule (mgrpo/net.py) for SLURM discovery, the servers and the weight senders: $MGRPO_NODE_IP, else
    the host name's address unless loopback, else the default route's source, else the loopback address."""
    _resolving(monkeypatch, {"me": "10.0.0.5"})
    assert node_ip(environ={"MGRPO_NODE_IP": "127.0.0.1"}) == "127.0.0.1"
    assert node_ip("me.cluster", environ={"MGRPO_NODE_IP": "10.1.1.1"}) == "10.1.1.1"  # own name: this node
    assert node_ip(environ={}) == "10.0.0.5"
    _resolving(monkeypatch, {"me": "127.0.1.1"})
    assert node_ip(environ={}) == "10.9.9.9"
    _resolving(monkeypatch, {"me": "127.0.1.1"}, route=None)
    assert node_ip(environ={}) == "127.0.1.1"
    _resolving(monkeypatch, {}, route=None)
    with pytest.raises(NodeAddressError, match="'me'"):
        node_ip(environ={})


def test_node_ip_of_another_node_is_what_its_name_resolves_to(monkeypatch):
    _resolving(monkeypatch, {"gpu-02": "10.0.0.2", "gpu-03": "127.0.0.1"})
    env = {"MGRPO_NODE_IP": "10.1.1.1"}  # this node's address: never another node's
    assert node_ip("gpu-02", environ=env) == "10.0.0.2"
    assert node_ip("gpu-03", environ=env) == "127.0.0.1"  # no route fallback for another node
    with pytest.raises(NodeAddressError, match="gpu-04"):
        node_ip("gpu-04", environ=env)


def _only_loopback() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0].startswith("127.")
        except OSError:
            return True


# --- matching SLURM hosts to Ray nodes --------------------------------------------------------------
def _node(host, ip, alive=True):
    return {"NodeManagerHostname": host, "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 1}}


def test_missing_hosts_matching_rules():
    nodes = [_node("gpu-01.cluster.local", "10.0.0.1"), _node("gpu-02", "10.0.0.2", alive=False),
             _node("weird-name", "10.0.0.3")]
    resolve = {"gpu-03": {"10.0.0.3"}}.get
    assert missing_hosts(["gpu-01", "gpu-02", "gpu-03", "10.0.0.1", "gpu-04"], nodes,
                         resolve=lambda h: resolve(h) or set()) == ["gpu-02", "gpu-04"]


# --- against a real Ray head ------------------------------------------------------------------------------


def stop_process_group(proc: subprocess.Popen, marker: str) -> None:
    """Stop a `ray start --block` we started in its own session, then anything left that uses our temp dir."""
    if proc.poll() is None:
        proc.terminate()  # ray start --block drains and stops its node's processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    for pid in processes_mentioning(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def ray_head():
    tmp = tempfile.mkdtemp(prefix="mgw-", dir="/tmp")  # short: Ray's socket paths live under it
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    ip, port = node_ip(), free_port()
    log = open(os.path.join(tmp, "head.log"), "w")
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", f"--node-ip-address={ip}", "--num-cpus=1",
         "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"address": f"{ip}:{port}", "env": env}
    finally:
        stop_process_group(proc, tmp)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_cli(ray_head, *args, timeout=120):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mgrpo.cluster.slurm", "wait", f"--address={ray_head['address']}",
                          *args], env=ray_head["env"], capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


@pytest.mark.integration
def test_wait_for_nodes_passes_when_this_host_joined(ray_head):
    out, _ = _wait_cli(ray_head, "--hosts", socket.gethostname(), "--timeout=60")
    assert out.returncode == 0, out.stderr
    assert "all 1 node(s) joined" in out.stderr and socket.gethostname() in out.stderr


@pytest.mark.integration
def test_wait_for_nodes_names_the_missing_host_after_the_timeout(ray_head):
    code = f"""
import json, socket, time
from mgrpo.cluster.ray_nodes import NodesMissingError, wait_for_nodes
t0 = time.monotonic()
try:
    wait_for_nodes({ray_head['address']!r}, [socket.gethostname(), "ghost-node-7"], timeout_s=4, poll_s=0.5)
    print(json.dumps({{"raised": False}}))
except NodesMissingError as err:
    print(json.dumps({{"raised": True, "missing": err.missing, "joined": [j["host"] for j in err.joined],
                      "message": str(err), "seconds": time.monotonic() - t0}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=ray_head["env"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["raised"], "wait_for_nodes returned although ghost-node-7 never joined"
    assert res["missing"] == ["ghost-node-7"]
    assert res["joined"] == [socket.gethostname()]
    assert "ghost-node-7" in res["message"] and "1 of 2" in res["message"]
    assert 4 <= res["seconds"] < 4 + 30  # waited for the timeout, then gave up


@pytest.mark.integration
def test_wait_cli_fails_early_when_a_ray_start_step_died(ray_head):
    dead = subprocess.Popen(["true"])
    dead.wait()
    out, seconds = _wait_cli(ray_head, "--hosts", "ghost-node-7", "--timeout=300", f"--watch-pid={dead.pid}")
    assert out.returncode == 1
    assert "ghost-node-7" in out.stderr and f"pid {dead.pid} exited" in out.stderr
    assert seconds < 60


@pytest.mark.integration
def test_wait_cli_reports_a_head_that_never_listens():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mgrpo.cluster.slurm", "wait", f"--address=127.0.0.1:{free_port()}",
                          "--hosts", "gpu-01", "gpu-02", "--timeout=2", "--poll=0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "did not accept connections" in out.stderr and "gpu-01 gpu-02" in out.stderr
    assert time.monotonic() - t0 < 30
