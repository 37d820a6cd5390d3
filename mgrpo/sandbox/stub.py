"""The first code that runs inside a sandbox, before the model's: it becomes an unprivileged user, sets the
limits, waits for the code on fd 3 and runs it as `__main__`.

It is run as `python -I -c <this file's text> <limits>` (never imported by mgrpo), so it uses the standard
library only and keeps no state the code could use: the code runs in a fresh dict of globals. A pre-started
sandbox (mgrpo/sandbox/pool.py) has done everything up to the read of fd 3, so a call pays for its code only.

argv[1]: comma-separated integers: cpu_s, memory_bytes, processes, open_files, file_size_bytes, uid, code_fd,
ready_fd (one byte is written to ready_fd once the limits are set, then it is closed).
"""

import os
import resource
import sys
import traceback  # imported before the limits and the code: the error path must not depend on either


def _own_user_namespace(uid: int) -> None:
    """Root in the sandbox (bwrap or unshare run by root keep the host's uid 0, which the kernel exempts from
    RLIMIT_NPROC) moves into a user namespace of its own as `uid` (a non-root uid outside too). The map must be
    written from the parent namespace, so a helper child writes it; then the limits bind, the process count is
    this namespace's alone, and host files owned by root (0700 homes, /etc/shadow) are out of reach even where
    the filesystem is visible (the unshare level)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ready, done = os.pipe()
    child = os.fork()
    if child == 0:  # the helper: waits for the parent to unshare, writes its maps from outside
        try:
            os.read(ready, 1)
            parent = os.getppid()
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{uid} {uid} 1")):
                with open(f"/proc/{parent}/{name}", "w") as f:
                    f.write(text)
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.setgroups([])  # root's supplementary groups (gid 0) would follow it; cleared while it still may
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        err = ctypes.get_errno()
        os.kill(child, 9)
        raise OSError(err, "sandbox: unshare(CLONE_NEWUSER) failed")
    os.write(done, b"x")
    _, status = os.waitpid(child, 0)
    if status != 0:
        raise OSError("sandbox: could not write the user namespace's uid/gid maps")
    os.close(ready)
    os.close(done)
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _limit() -> int:
    cpu_s, memory, processes, open_files, file_size, uid, code_fd, ready_fd = (int(x) for x in sys.argv[1].split(","))
    if os.getuid() == 0:
        _own_user_namespace(uid)
    # soft CPU limit -> SIGXCPU, hard one second later -> SIGKILL (a program that catches SIGXCPU)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    return code_fd


def _run(code_fd: int) -> None:
    chunks = []
    while True:  # blocks here until the call comes; EOF ends the code
        chunk = os.read(code_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(code_fd)
    source = b"".join(chunks)
    sys.argv = ["main.py"]
    # a module of its own as __main__ (not this stub's): pickle and multiprocessing find the program's names there
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # the model's traceback without this file's frame
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


_run(_limit())
