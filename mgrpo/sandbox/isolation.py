"""Which isolation this machine can give, and the command line that gives it.

Two levels, strongest first, chosen by trying them (a capability check at call time, never a guess from the
kernel version: containers and clusters forbid namespaces in ways only a try reveals):

- `bwrap`: Debian's bubblewrap. New user (when not root), pid, network, ipc, uts and cgroup namespaces
  (`--unshare-all`; the network namespace has only its own loopback), a fresh root holding read-only binds of
  /usr (and the /lib, /bin links), the dynamic linker's files and the interpreter's prefixes, a new /proc
  (this pid namespace's processes only) and a minimal /dev, a size-capped tmpfs at /tmp as the scratch
  directory (gone with the namespace), a new session, and death with its parent.
- `unshare`: util-linux `unshare`: the same namespaces, but the host's filesystem stays visible with the
  sandbox user's permissions (when run by root that user is `sandbox.uid`, so root-only files such as
  /etc/shadow and 0700 homes are out of reach, but world-readable ones are not; run by a user, the code has
  that user's rights: it can read and WRITE the user's files, the run's included), and the scratch directory
  is a host folder removed afterwards, bounded per file (RLIMIT_FSIZE) but not in total. A much weaker level:
  used only when bwrap is missing or refused (name `sandbox.isolation=bwrap` to refuse it), and named, with a
  warning for a user's run, in the start-up line.

Either way the stub (stub.py) then sets the rlimits and, when the sandbox would run as root, moves into a
user namespace of its own as `sandbox.uid` before any of the model's code runs.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import sys

from mgrpo.config.choices import Isolation
from mgrpo.config.schema import SandboxConfig

RANK = {Isolation.unshare: 1, Isolation.bwrap: 2}
"""Stronger levels rank higher; `auto` takes the highest that works."""

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
       # one thread per numerical library: a sandbox is one call among many on the node, and OpenBLAS's
       # per-thread buffers would eat the address-space limit
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLCONFIGDIR": "/tmp"}
"""The whole environment of a sandbox: nothing of the run's (keys such as MGRPO_ROLLOUT_API_KEY stay out)."""

_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub.py")


@functools.lru_cache(maxsize=1)
def stub_source() -> str:
    with open(_STUB) as f:
        return f.read()


def interpreter_paths() -> list[str]:
    """The folders the interpreter and its libraries live in (venv and base prefixes, site-packages), each
    once, outside /usr (bound whole). Nothing else of sys.path: an editable install's source tree is the
    project's checkout, which holds the run's folders."""
    paths = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages(),
              os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.isdir(q) and not q.startswith("/usr/") and q not in ("/", "/usr"):
                paths.append(q)
    paths = sorted(set(paths))
    return [p for p in paths if not any(p.startswith(q + "/") for q in paths)]  # parents cover children


def _system_dirs() -> list[str]:
    """Bind arguments for /usr and the top-level links (merged /usr) or folders into it."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--perms", "0755", "--dir", "/etc"]  # created with the mode bwrap would copy otherwise
    for etc in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"):
        args += ["--ro-bind-try", etc, etc]
    return args


def stub_args(cfg: SandboxConfig, code_fd: int, ready_fd: int) -> list[str]:
    limits = [cfg.cpu_time_s, cfg.memory_mb << 20, cfg.max_processes, cfg.max_open_files,
              cfg.max_file_size_mb << 20, cfg.uid, code_fd, ready_fd]
    return [sys.executable, "-I", "-c", stub_source(), ",".join(str(int(x)) for x in limits)]


def bwrap_argv(cfg: SandboxConfig) -> list[str]:
    # Run by root, --unshare-all would add a user namespace mapping only uid 0 (so the code would stay the host's
    # root for the kernel, exempt from RLIMIT_NPROC, and the stub could not map another uid): root leaves the
    # user namespace to the stub. Anyone else needs bwrap's user namespace for the rest.
    spaces = (["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
              if os.getuid() == 0 else ["--unshare-all"])
    scratch = ["--perms", "01777", "--size", str(cfg.scratch_mb << 20), "--tmpfs"]
    # /dev/shm too: bwrap's /dev has it root-only, and multiprocessing's locks live there. The scratch mounts
    # come BEFORE the interpreter's binds (bwrap applies its arguments in order): an interpreter under /tmp
    # (a venv made there) is bound on top of the fresh tmpfs instead of being hidden by it.
    argv = [shutil.which("bwrap") or "bwrap", *spaces, "--die-with-parent", "--new-session",
            "--hostname", "sandbox", *_system_dirs(), "--proc", "/proc", "--dev", "/dev", *scratch, "/dev/shm",
            *scratch, "/tmp"]
    made = {"/tmp", "/dev", "/dev/shm", "/proc"}
    for path in interpreter_paths():
        # bwrap would copy the mode of a parent it creates from the host (/root is 0700, which the sandbox
        # user could not pass through to a pyenv interpreter): create the parents traversable
        parent = os.path.dirname(path)
        chain = []
        while parent not in ("/", "") and parent not in made:
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
        argv += ["--ro-bind", path, path]
    return argv + ["--chdir", "/tmp", "--"]


def unshare_argv(cfg: SandboxConfig, scratch: str) -> list[str]:
    """util-linux: setpriv ties the sandbox to this process (SIGKILL when it dies, as bwrap's
    --die-with-parent); unshare forks the stub as pid 1 of a new pid namespace, so when it ends every process
    it left behind ends too, and --kill-child takes it down when unshare is killed."""
    user = [] if os.getuid() == 0 else ["--map-current-user"]  # unprivileged: a user namespace makes the rest
    return [shutil.which("setpriv") or "setpriv", "--pdeathsig", "KILL", "--",
            shutil.which("unshare") or "unshare", *user, "--pid", "--fork", "--kill-child", "--mount-proc",
            "--net", "--ipc", "--uts", "--wd", scratch, "--"]


def describe(level: str, cfg: SandboxConfig) -> str:
    """The start-up line's words for a level."""
    who = f"as uid {cfg.uid if os.getuid() == 0 else os.getuid()}"
    if level == Isolation.bwrap:
        return (f"bwrap (no network, own pid/ipc/uts namespaces, read-only interpreter and /usr only, "
                f"tmpfs scratch, rlimits, {who})")
    # run by a user (not root) the code has that user's rights on the host's files: reading AND writing them
    files = ("host files readable by uid " + str(cfg.uid) if os.getuid() == 0
             else "WARNING: host files readable and writable with this user's rights")
    return f"unshare (no network, own pid/ipc/uts namespaces, {files}, rlimits, {who})"
