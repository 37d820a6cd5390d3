"""The rollout server process: which server, its command line, start with readiness wait, watchdog, stop.

Two servers speak the same HTTP protocol and take the same command line:
- `sglang.launch_server` (SGLang itself; needs CUDA and SGLang's GPU kernels),
- `mgrpo.rollout.sglang.cpu.server` (transformers on CPU; tests, CI and the CPU job).
`choose_server` picks one by capability at call time; the client does not know which it talks to.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence, TypeVar

from mgrpo.net import free_port
from mgrpo.rollout.sglang.http import ENGINE_HINT, SGLangUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}
SGLANG_MODULE = "sglang.launch_server"
CPU_MODULE = "mgrpo.rollout.sglang.cpu.server"
SERVERS = {"sglang": SGLANG_MODULE, "cpu": CPU_MODULE}

def sglang_runtime_missing() -> Optional[str]:
    """None when SGLang's own server can run here, else why not. SGLang's server needs the
    `sglang` package with its GPU kernels (`sgl_kernel`, from sglang-kernel) and a CUDA device; the
    test extra installs the `sglang` wheel alone (for its request classes), which is not enough."""
    missing = [m for m in ("sglang", "sgl_kernel") if importlib.util.find_spec(m) is None]
    if missing:
        return f"python module(s) {missing} not installed (pip install -e '.[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None

def choose_server(server: Optional[str] = None) -> str:
    """The module to run: `server` = 'sglang' | 'cpu' | None (SGLang where it can run, else the CPU server)."""
    if server is None:
        return SGLANG_MODULE if sglang_runtime_missing() is None else CPU_MODULE
    if server not in SERVERS:
        raise ValueError(f"rollout server must be one of {sorted(SERVERS)} or None (auto), got {server!r}")
    if server == "sglang":
        why = sglang_runtime_missing()
        if why:
            raise SGLangUnavailableError(f"SGLang's server cannot run here: {why}. {ENGINE_HINT}.")
    return SERVERS[server]

def launch_command(module: str, hf_dir: str, *, tp: int, host: str, port: int, mem_fraction_static: float,
                   weight_version: int, enable_memory_saver: bool, extra_args: Sequence[str] = (), ep: int = 1,
                   return_routed_experts: bool = False, key_file: Optional[str] = None) -> list[str]:
    """`python -m <module> ...` with SGLang's launch arguments (the CPU server accepts the same).
    `key_file`: the YAML file holding the API keys (auth.key_config_file), read through `--config` so
    that the keys never appear on the command line."""
    cmd = [sys.executable, "-m", module, "--model-path", hf_dir, "--tp-size", str(tp), "--host", host, "--port",
           str(port), "--mem-fraction-static", str(mem_fraction_static), "--weight-version", str(weight_version)]
    if ep != 1:
        cmd += ["--ep-size", str(ep)]  # expert parallelism inside the engine's TP group (MoE models)
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")  # lets colocated mode release and resume GPU memory
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")  # otherwise SGLang silently drops the request field
    if key_file:
        cmd += ["--config", key_file]
    return cmd + list(extra_args)

def check_host(host: str) -> str:
    if host.strip() in WILDCARD_HOSTS:
        raise ValueError(f"refusing to bind the SGLang server to {host!r}: rollout servers listen on the "
                         "node's cluster address only; pass host=<node IP> or leave it "
                         "unset to use this node's address")
    return host

def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

def log_tail(path: Optional[str], lines: int = 40, since: int = 0) -> str:
    """The last `lines` lines of the log, from byte `since` on."""
    if not path or not os.path.exists(path):
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(since, f.tell() - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])

# Kills the server's process group once the process that launched it is gone (a Ray actor killed
# with SIGKILL runs no cleanup, and an orphaned server would keep its GPUs), and removes the key file the
# launcher would have removed (argv[3], if given) when it goes itself.
_WATCHDOG = """
import atexit, os, shutil, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:
    atexit.register(shutil.rmtree, os.path.dirname(sys.argv[3]), True)
def alive(pid):
    try:
        os.kill(pid, 0); return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while True:
    time.sleep(2)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
    if not alive(parent):
        try:
            os.killpg(pgid, signal.SIGTERM); time.sleep(15); os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""

def terminate_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `timeout_s`. A stopped (SIGSTOPped)
    group gets SIGCONT too, so that it can act on the SIGTERM."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

class PortInUseError(RuntimeError):
    """The server exited during startup because another process held its port (Errno 98)."""


# uvicorn: "[Errno 98] error while attempting to bind on address ...: address already in use";
# the router (Rust): "Address already in use (os error 98)"
_PORT_IN_USE = re.compile(r"address already in use", re.IGNORECASE)

PORT_ATTEMPTS = 3


def start_on_free_port(start: Callable[[int], T], host: str, port: Optional[int] = None,
                       attempts: int = PORT_ATTEMPTS) -> tuple[T, int, int]:
    """`start(port)`, on `port` when given, else on a port `free_port(host)` chooses. A chosen port that another
    process bound first (PortInUseError) is replaced by a fresh one, `attempts` starts in all; a given port is
    the caller's and is never replaced. Returns (what `start` returned, the port, how many starts were retried)."""
    for attempt in range(attempts):
        chosen = port or free_port(host)
        try:
            return start(chosen), chosen, attempt
        except PortInUseError as e:
            if port or attempt + 1 >= attempts:
                raise
            log.warning("port %d on %s was taken before the server bound it (start %d of %d); choosing another: %s",
                        chosen, host, attempt + 1, attempts, str(e).splitlines()[0])
    raise AssertionError("unreachable")


def start_server(cmd: Sequence[str], url: str, log_path: str, *, startup_timeout_s: float,
                 env: Optional[dict] = None, poll_s: float = 0.1, ready_path: str = "/health_generate",
                 key_file: Optional[str] = None) -> subprocess.Popen:
    """Start `cmd` in its own process group with its output in `log_path`; return once
    GET {url}{ready_path} answers 200. On death or timeout: kill it and raise with the log tail.
    `key_file` (auth.key_config_file): removed by the watchdog at the latest, should this process die
    before removing it. `poll_s`: a refused connection costs well under a millisecond, and the server's readiness
    is on the path to the first step (a 1 s poll waited 0.5 s on average past it)."""
    import requests

    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    # This user only: SGLang logs its server arguments, API keys included.
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logf:
        since = logf.tell()  # this start's lines: an earlier start on the same port may have logged there
        proc = subprocess.Popen(list(cmd), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    watch = [str(os.getpid()), str(proc.pid), *([key_file] if key_file else [])]
    subprocess.Popen([sys.executable, "-c", _WATCHDOG, *watch], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            try:  # children it left behind
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            tail = log_tail(log_path, since=since)
            error = PortInUseError if _PORT_IN_USE.search(tail) else RuntimeError
            raise error(f"SGLang server exited with code {rc} during startup.\ncommand: {' '.join(cmd)}\n"
                        f"last lines of {log_path}:\n{tail}")
        try:
            if requests.get(f"{url}{ready_path}", timeout=min(30.0, startup_timeout_s)).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            terminate_group(proc)
            raise TimeoutError(f"SGLang server at {url} not healthy within startup_timeout_s={startup_timeout_s}; "
                               f"killed it.\ncommand: {' '.join(cmd)}\nlast lines of {log_path}:\n{log_tail(log_path)}")
        time.sleep(poll_s)
