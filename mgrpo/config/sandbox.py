"""Typed configuration of the sandbox for model-written code (`sandbox:` in a run's config; mgrpo/sandbox/).
Part of `MGRPOConfig` (mgrpo.config.schema); its checks are `mgrpo.config.checks.sandbox_errors`."""

from __future__ import annotations

from dataclasses import dataclass

from mgrpo.config.choices import Isolation


@dataclass
class SandboxConfig:
    """The sandbox that runs model-written code (the `python` tool, mgrpo-sandbox, a user's reward function):
    mgrpo/sandbox/. Every call is a fresh process; these are its limits. mgrpo-sandbox's flags default to them."""

    isolation: Isolation = "auto"
    """auto (bwrap where it works, else unshare, else refuse) | bwrap | unshare: a named level is required, and a
    machine that cannot give it is refused before anything starts."""
    cpu_time_s: int = 10
    """CPU seconds of each process (RLIMIT_CPU: SIGXCPU, SIGKILL a second later)."""
    wall_time_s: float = 10.0
    """Wall-clock seconds of a call, from the code's arrival; then the whole process tree is killed."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS), MiB."""
    max_processes: int = 32
    """Processes and threads of the sandbox (RLIMIT_NPROC, counted in the sandbox's own user namespace)."""
    max_open_files: int = 64
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    max_file_size_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE), MiB."""
    scratch_mb: int = 64
    """Size of the private tmpfs at /tmp, the working directory, and of the one at /dev/shm (bwrap; the unshare
    level has no total cap)."""
    max_output_bytes: int = 16384
    """Bytes kept of stdout and of stderr each; a program that writes more is killed (outcome limit: output)."""
    pool_size: int = 2
    """Sandboxes started ahead of the calls (each a fresh process used once), so a call pays for its code
    only. 0 = start each at its call."""
    max_concurrency: int = 8
    """Calls running at once; more wait for a slot, at most wall_time_s (then outcome timeout, limit queue)."""
    uid: int = 65534
    """The uid the code runs as when mgrpo runs as root (nobody); otherwise the code runs as the user, in a
    user namespace of its own."""
