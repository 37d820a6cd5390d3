"""SLURM allocation discovery, and the command line the sbatch scripts use.

`slurm/train.sbatch` uses this module through its command line:

    python -m mgrpo.cluster.slurm env --shell       # MGRPO_SLURM_HEAD=... (KEY=value lines for eval)
    python -m mgrpo.cluster.slurm hostnames 'gpu-[01-03,7]'
    python -m mgrpo.cluster.slurm ip                # this node's address on the cluster network (mgrpo.net.node_ip)
    python -m mgrpo.cluster.slurm wait --address 10.0.0.1:6379 --hosts gpu-01 gpu-02 --timeout 600

`SlurmEnv.from_env(os.environ)` reads the allocation (job id, expanded node list, GPUs and CPUs per
node, requeue count) without talking to the controller, except for `scontrol show hostnames` when it
is installed; a pure-Python expansion of compressed node lists stands in for it otherwise.
The `wait` command runs `mgrpo.cluster.ray_nodes.wait_for_nodes`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from mgrpo.net import NodeAddressError, is_this_host, node_ip


class SlurmEnvError(RuntimeError):
    """The environment is not a usable SLURM allocation; the message names the variable."""


# --- node lists ---------------------------------------------------------------------------------------
def _split_top_level(spec: str) -> list[str]:
    """Split at commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            if depth:
                raise ValueError(f"node list {spec!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"node list {spec!r}: ']' without '['")
            depth = 0
        if ch == "," and not depth:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"node list {spec!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_set(body: str, spec: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']. A range keeps the zero padding of its lower bound (as
    SLURM does: [08-10] -> 08 09 10, [8-10] -> 8 9 10)."""
    out: list[str] = []
    for piece in body.split(","):
        piece = piece.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not m:
            raise ValueError(f"node list {spec!r}: bad range {piece!r} in [{body}]")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"node list {spec!r}: range {piece!r} runs backwards")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Expand a compressed SLURM node list in pure Python, in SLURM's order.

    'gpu-[01-03,7],cpu5' -> ['gpu-01', 'gpu-02', 'gpu-03', 'gpu-7', 'cpu5'];
    several bracket groups in one name multiply: 'r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2.
    Duplicates are kept out (SLURM never lists a node twice)."""
    hosts: list[str] = []
    for item in _split_top_level(spec.strip()):
        names = [""]
        for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            literal, body = m.group(1), m.group(2)
            if body is not None:
                names = [n + literal + suffix for n in names for suffix in _expand_range_set(body, spec)]
            elif literal:
                names = [n + literal for n in names]
        for n in names:
            if n not in hosts:
                hosts.append(n)
    return hosts


def hostnames(nodelist: str, *, use_scontrol: bool = True) -> list[str]:
    """The hosts of a node list: `scontrol show hostnames` when available (the authority), else the
    pure-Python expansion."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=60, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError) as err:
            print(f"mgrpo.cluster.slurm: scontrol show hostnames failed ({err}); expanding in Python",
                  file=sys.stderr)
    return expand_hostlist(nodelist)


# --- counts -------------------------------------------------------------------------------------------
def _int(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SlurmEnvError(f"{name}={value!r} is not an integer") from None


def gpus_per_node(environ: Mapping[str, str]) -> tuple[int, str]:
    """GPUs on each node and the variable they came from (0, '' when the job has none).

    SLURM_GPUS_ON_NODE='8' (set on the node), SLURM_GPUS_PER_NODE='8' | 'h100:8' | 'a100:2,v100:1'
    (the request), SLURM_JOB_GPUS='0,1,2,3' (the indices granted on this node)."""
    n = _int(environ, "SLURM_GPUS_ON_NODE")
    if n is not None:
        return n, "SLURM_GPUS_ON_NODE"
    spec = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if spec:
        total = 0
        for part in spec.split(","):
            count = part.strip().split(":")[-1]
            count = re.sub(r"\(.*\)$", "", count)  # a socket annotation such as '4(S:0-1)'
            if not count.isdigit():
                raise SlurmEnvError(f"SLURM_GPUS_PER_NODE={spec!r}: cannot read a GPU count from {part!r}")
            total += int(count)
        return total, "SLURM_GPUS_PER_NODE"
    ids = environ.get("SLURM_JOB_GPUS", "").strip()
    if ids:
        try:
            return len(_expand_range_set(ids, ids)), "SLURM_JOB_GPUS"
        except ValueError:
            raise SlurmEnvError(f"SLURM_JOB_GPUS={ids!r} is not a list of GPU indices") from None
    return 0, ""


def cpus_per_node(environ: Mapping[str, str]) -> Optional[int]:
    """CPUs Ray may use on a node: the task's CPUs (one task per node), else the node's allocation.

    SLURM_JOB_CPUS_PER_NODE looks like '72(x2),36': the smallest count is taken (Ray gets the same
    number on every node)."""
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        n = _int(environ, name)
        if n is not None:
            return n
    spec = environ.get("SLURM_JOB_CPUS_PER_NODE", "").strip()
    if spec:
        counts = [int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", spec)]
        if counts:
            return min(counts)
    return None


# --- the allocation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmEnv:
    job_id: str
    job_name: str
    nodelist: str
    """The compressed list as SLURM gives it, e.g. 'gpu-[01-04]'."""
    hosts: tuple[str, ...]
    nnodes: int
    gpus_per_node: int
    """0 when the job has no GPUs (a CPU allocation)."""
    gpus_source: str
    cpus_per_node: Optional[int]
    restart_count: int
    """How many times the job was requeued (SLURM_RESTART_COUNT; 0 on the first run)."""
    node_name: Optional[str]
    """The node this process runs on (SLURMD_NODENAME)."""

    @property
    def head(self) -> str:
        """The Ray head: the node running the batch script (SLURM runs it on the allocation's first
        node), so the driver started by the script is on the head."""
        return self.node_name if self.node_name in self.hosts else self.hosts[0]

    @property
    def workers(self) -> list[str]:
        return [h for h in self.hosts if h != self.head]

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, *, use_scontrol: bool = True) -> "SlurmEnv":
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise SlurmEnvError("not inside a SLURM job: SLURM_JOB_ID is not set (run under sbatch or salloc)")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise SlurmEnvError(f"SLURM job {job_id}: SLURM_JOB_NODELIST is not set")
        try:
            hosts = tuple(hostnames(nodelist, use_scontrol=use_scontrol))
        except ValueError as err:
            raise SlurmEnvError(f"SLURM_JOB_NODELIST: {err}") from None
        if not hosts:
            raise SlurmEnvError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
        nnodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
        if nnodes is not None and nnodes != len(hosts):
            raise SlurmEnvError(f"SLURM_JOB_NUM_NODES={nnodes} but SLURM_JOB_NODELIST={nodelist!r} "
                                f"expands to {len(hosts)} hosts: {' '.join(hosts)}")
        gpus, source = gpus_per_node(env)
        return cls(job_id=str(job_id), job_name=env.get("SLURM_JOB_NAME", ""), nodelist=nodelist, hosts=hosts,
                   nnodes=len(hosts), gpus_per_node=gpus, gpus_source=source, cpus_per_node=cpus_per_node(env),
                   restart_count=_int(env, "SLURM_RESTART_COUNT") or 0, node_name=env.get("SLURMD_NODENAME") or None)

    def shell(self, head_ip: Optional[str] = None) -> str:
        """`KEY=value` lines (shell-quoted) for `eval` in a batch script."""
        values = {
            "MGRPO_SLURM_JOB_ID": self.job_id,
            "MGRPO_SLURM_RESTART_COUNT": self.restart_count,
            "MGRPO_SLURM_NNODES": self.nnodes,
            "MGRPO_SLURM_HOSTS": " ".join(self.hosts),
            "MGRPO_SLURM_HEAD": self.head,
            "MGRPO_SLURM_WORKERS": ",".join(self.workers),
            "MGRPO_SLURM_NUM_WORKERS": len(self.workers),
            "MGRPO_SLURM_GPUS_PER_NODE": self.gpus_per_node,
            "MGRPO_SLURM_GPUS_SOURCE": self.gpus_source or "none",
            "MGRPO_SLURM_CPUS_PER_NODE": "" if self.cpus_per_node is None else self.cpus_per_node,
        }
        if head_ip is not None:
            values["MGRPO_SLURM_HEAD_IP"] = head_ip
        return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items())


# --- command line -------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    from mgrpo.cluster.ray_nodes import NodesMissingError, wait_for_nodes

    p = argparse.ArgumentParser(prog="python -m mgrpo.cluster.slurm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="print the SLURM allocation (JSON, or KEY=value lines with --shell)")
    e.add_argument("--shell", action="store_true", help="MGRPO_SLURM_* KEY=value lines for eval, including the head's IP")
    h = sub.add_parser("hostnames", help="expand a compressed node list, one host a line")
    h.add_argument("nodelist")
    h.add_argument("--no-scontrol", action="store_true", help="use the pure-Python expansion only")
    i = sub.add_parser("ip", help="a node's address on the cluster network (default: this node)")
    i.add_argument("host", nargs="?")
    w = sub.add_parser("wait", help="wait until every host has joined the Ray cluster")
    w.add_argument("--address", required=True, help="HOST:PORT of the Ray head")
    g = w.add_mutually_exclusive_group(required=True)
    g.add_argument("--hosts", nargs="+", help="expected hosts")
    g.add_argument("--nodelist", help="expected hosts as a (compressed) SLURM node list")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    w.add_argument("--poll", type=float, default=2.0, help="seconds between checks (default 2)")
    w.add_argument("--watch-pid", type=int, action="append", default=[],
                   help="fail early when this process (a 'ray start' step) has exited; repeatable")
    args = p.parse_args(argv)
    prog = "mgrpo.cluster.slurm"
    try:
        if args.cmd == "env":
            env = SlurmEnv.from_env()
            if args.shell:
                head_ip = os.environ.get("MGRPO_HEAD_IP") or node_ip(None if is_this_host(env.head) else env.head)
                sys.stdout.write(env.shell(head_ip))
            else:
                print(json.dumps(asdict(env) | {"head": env.head, "workers": env.workers}, indent=1))
        elif args.cmd == "hostnames":
            print("\n".join(hostnames(args.nodelist, use_scontrol=not args.no_scontrol)))
        elif args.cmd == "ip":
            print(node_ip(args.host))
        else:
            expected = args.hosts or hostnames(args.nodelist)
            t0 = time.monotonic()
            joined = wait_for_nodes(args.address, expected, args.timeout, poll_s=args.poll,
                                    watch_pids=args.watch_pid)
            print(f"all {len(expected)} node(s) joined the Ray cluster at {args.address} "
                  f"in {time.monotonic() - t0:.1f}s:", file=sys.stderr)
            for j in joined:
                print(f"  {j['host']:<24} {j['ip']:<16} CPU {j['cpus']:g}  GPU {j['gpus']:g}", file=sys.stderr)
    except (SlurmEnvError, NodeAddressError, NodesMissingError, ValueError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
