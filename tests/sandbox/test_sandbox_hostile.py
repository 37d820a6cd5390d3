"""The sandbox against hostile code (bombs, floods, escapes), each case on bubblewrap: contained, its outcome counted,
and the sandbox healthy afterwards (the next call answers). Network cases address only this machine's
loopback: listeners started here, which must receive nothing.

Without bubblewrap these skip (install: apt-get install bubblewrap), except where MGRPO_REQUIRE_SANDBOX=1
(.ci/run installs it and sets that): there a skip is a failure."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import pytest

from mgrpo.config.schema import SandboxConfig
from mgrpo.net import free_port
from tests.helpers import ROOT
from tests.helpers.procs import processes_mentioning
from tests.helpers.sandbox import require_level

pytestmark = pytest.mark.integration

CFG = SandboxConfig(isolation="bwrap", cpu_time_s=1, wall_time_s=6.0, memory_mb=512, max_processes=16,
                    max_open_files=32, max_file_size_mb=8, scratch_mb=32, max_output_bytes=4096, pool_size=1,
                    max_concurrency=2)


@pytest.fixture(scope="module")
def sandbox():
    require_level("bwrap")
    from mgrpo.sandbox import Sandbox

    with Sandbox(CFG) as sb:
        yield sb


@pytest.fixture(scope="module")
def victim():
    """A process of the host (the 'trainer'), which no sandboxed code may signal or trace."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def run_counted(sandbox, code: str, **kw):
    """Run `code`; check the result was counted once under its outcome (and limit), and that the sandbox still
    answers a normal call afterwards."""
    sandbox.counts.drain()
    result = sandbox.run(code, **kw)
    counts = sandbox.counts.drain()
    assert counts["sandbox/calls"] == 1 and counts[f"sandbox/{result.outcome}"] == 1, counts
    if result.limit:
        assert counts[f"sandbox/limit/{result.limit}"] == 1, counts
    after = sandbox.run("print(6 * 7)")
    assert (after.outcome, after.stdout) == ("ok", "42\n"), after
    return result


def test_a_normal_call_and_the_libraries(sandbox):
    r = run_counted(sandbox, "import sys, numpy, sympy\nx = sympy.symbols('x')\n"
                             "print(sys.stdin.read().strip(), int(numpy.arange(10).sum()), sympy.factor(x**2 - 1))",
                    stdin="hello")
    assert (r.outcome, r.stdout, r.isolation) == ("ok", "hello 45 (x - 1)*(x + 1)\n", "bwrap")


def test_the_program_is_main(sandbox):
    # its own __main__ module: multiprocessing pickles the program's functions by name
    r = run_counted(sandbox, "import multiprocessing as mp\ndef square(x):\n    return x * x\n"
                             "if __name__ == '__main__':\n    with mp.get_context('fork').Pool(2) as pool:\n"
                             "        print(pool.map(square, [1, 2, 3]))")
    assert (r.outcome, r.stdout) == ("ok", "[1, 4, 9]\n"), r


def test_large_code_and_stdin_pass_whole(sandbox):
    # both larger than a pipe's buffer (64 KiB): the code pipe and stdin are written while the program reads
    code = "data = " + repr("x" * 200_000) + "\nimport sys\nprint(len(data), len(sys.stdin.read()))"
    r = run_counted(sandbox, code, stdin="y" * 300_000)
    assert (r.outcome, r.stdout) == ("ok", "200000 300000\n"), r
    r = run_counted(sandbox, "print('ignores its stdin')", stdin="z" * 1_000_000)
    assert (r.outcome, r.stdout) == ("ok", "ignores its stdin\n"), r


def test_the_python_tool_answers_and_counts():
    require_level("bwrap")
    from mgrpo.sandbox import tool

    tool.configure(CFG)
    try:
        tool.counts()
        assert tool.python("print(sum(range(10)))") == "45"
        assert tool.python("import time\ntime.sleep(100)") == "[timeout: wall_time]"
        answer = tool.python("1 / 0")
        assert answer.startswith("Traceback")
        assert answer.endswith("ZeroDivisionError: division by zero\n[exit status 1]")
        got = {k: v for k, v in tool.counts().items() if v}
        assert got == {"sandbox/calls": 3, "sandbox/ok": 1, "sandbox/error": 1, "sandbox/timeout": 1,
                       "sandbox/limit/wall_time": 1}, got
    finally:
        tool.close()


def test_fork_bomb(sandbox):
    r = run_counted(sandbox, "import os\nwhile True:\n    os.fork()")
    assert (r.outcome, r.limit) == ("limit", "processes"), r
    # the bomb that swallows the error spins until the wall time, then its whole tree is killed
    r = run_counted(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert (r.outcome, r.limit) == ("timeout", "wall_time") and r.wall_s < CFG.wall_time_s + 2, r


def test_memory_bomb(sandbox):
    r = run_counted(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))")
    assert (r.outcome, r.limit) == ("limit", "memory"), r
    r = run_counted(sandbox, "import numpy\nnumpy.ones((1 << 30,))")
    assert (r.outcome, r.limit) == ("limit", "memory"), r


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    r = run_counted(sandbox, "while True:\n    pass")
    assert (r.outcome, r.limit, r.exit_status) == ("limit", "cpu_time", -24), r  # SIGXCPU


def test_output_flood(sandbox):
    r = run_counted(sandbox, "while True:\n    print('flood' * 20)")
    assert (r.outcome, r.limit, r.exit_status) == ("limit", "output", None), r
    assert len(r.stdout.encode()) == CFG.max_output_bytes and r.stdout_truncated and r.stdout.startswith("flood")


def test_ten_gigabyte_file(sandbox):
    r = run_counted(sandbox, "with open('big', 'wb') as f:\n    for _ in range(10 * 1024):\n"
                             "        f.write(b'0' * (1 << 20))")
    assert (r.outcome, r.limit) == ("limit", "file_size"), r
    # many files below the per-file limit fill the scratch tmpfs instead, which is bounded too
    r = run_counted(sandbox, "for i in range(100):\n    with open(f'f{i}', 'wb') as f:\n"
                             "        f.write(b'0' * (7 << 20))")
    assert (r.outcome, r.limit) == ("limit", "file_size") and "No space left" in r.stderr, r


def test_reading_secrets_and_the_run(sandbox, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "api_key").write_text("sk-secret-123")
    monkeypatch.setenv("MGRPO_ROLLOUT_API_KEY", "sk-secret-123")
    for path in ("/etc/shadow", str(run / "api_key"), str(run), os.getcwd()):
        r = run_counted(sandbox, f"import os\np = {path!r}\n"
                                 "print(os.listdir(p) if os.path.isdir(p) else open(p).read())")
        assert r.outcome == "error" and ("FileNotFoundError" in r.stderr or "PermissionError" in r.stderr), (path, r)
    # the home folder: absent, or (an interpreter installed under it, as pyenv's) holding only the way to it
    from mgrpo.sandbox.isolation import interpreter_paths

    home = os.path.expanduser("~")
    r = run_counted(sandbox, f"import os\nprint(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else [])")
    ways = {p[len(home) + 1:].split("/")[0] for p in interpreter_paths() if p.startswith(home + "/")}
    assert set(eval(r.stdout)) == ways, r
    r = run_counted(sandbox, "import os\nprint(sorted(os.environ))\nprint(open('/proc/1/environ').read())")
    assert "sk-secret" not in r.stdout + r.stderr and "MGRPO" not in r.stdout, r
    r = run_counted(sandbox, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert r.outcome == "ok" and len(eval(r.stdout)) <= 3, r  # its own pid namespace: init, itself, a child


def test_writing_outside_scratch(sandbox, tmp_path):
    target = tmp_path / "planted"
    for path in (str(target), "/usr/planted", os.path.join(sys.prefix, "planted"), "/planted"):
        r = run_counted(sandbox, f"open({path!r}, 'w').write('x')")
        assert r.outcome == "error", (path, r)
        assert not os.path.exists(path)
    r = run_counted(sandbox, "open('/tmp/mine', 'w').write('x')\nimport os\nprint(os.listdir('/tmp'))")
    assert r.stdout == "['mine']\n"
    r = run_counted(sandbox, "import os\nprint(os.listdir('/tmp'))")  # the scratch of a call is gone after it
    assert r.stdout == "[]\n"


class Listener:
    """A TCP and a UDP socket on 127.0.0.1 that record anything they receive."""

    def __init__(self):
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen()
        self.tcp.settimeout(0.2)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(0.2)
        self.got: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            for sock, take in ((self.tcp, lambda s: s.accept()), (self.udp, lambda s: s.recvfrom(65536))):
                try:
                    self.got.append(take(sock))
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)
        self.tcp.close()
        self.udp.close()


def test_no_network(sandbox):
    listener = Listener()
    engine_port = free_port("127.0.0.1")  # the run's engine port: an SGLang server would listen here
    engine = socket.socket()
    engine.bind(("127.0.0.1", engine_port))
    engine.listen()
    engine.settimeout(0.5)
    try:
        tcp, udp = listener.tcp.getsockname()[1], listener.udp.getsockname()[1]
        for port in (tcp, engine_port):
            r = run_counted(sandbox, f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)"
                                     "\nprint('connected')")
            assert r.outcome == "error" and "connected" not in r.stdout and "Connection refused" in r.stderr, r
        r = run_counted(sandbox, f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                 f"print(s.sendto(b'hello', ('127.0.0.1', {udp})))")
        # the datagram leaves into the sandbox's own loopback, where nothing listens
        assert r.outcome == "ok", r
        r = run_counted(sandbox, "import socket\nprint([i[1] for i in socket.if_nameindex()])")
        assert r.stdout == "['lo']\n", r
        time.sleep(0.5)
        with pytest.raises(OSError):
            engine.accept()
        assert listener.got == []
    finally:
        listener.close()
        engine.close()


def test_signals_and_ptrace_reach_nothing_outside(sandbox, victim):
    me = os.getpid()
    for code in ("import os\nos.kill(os.getppid(), 9)", "import os\nos.kill(1, 9)", f"import os\nos.kill({me}, 9)",
                 f"import os\nos.kill({victim.pid}, 9)",
                 "import os\nfor p in range(1, 1 << 16):\n    try:\n        os.kill(p, 9)\n    except OSError:\n"
                 "        pass\nos.kill(-1, 9)"):
        run_counted(sandbox, code)
        assert victim.poll() is None
    r = run_counted(sandbox, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                             "print([(libc.ptrace(16, p, 0, 0), ctypes.get_errno()) "
                             f"for p in (1, {victim.pid}, {me})])")
    assert r.stdout == "[(-1, 1), (-1, 3), (-1, 3)]\n", r  # EPERM for its init, ESRCH: no such process outside
    assert victim.poll() is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the machine code below is x86-64")
def test_executable_memory_runs_but_stays_inside(sandbox, victim):
    # kill(-1, SIGKILL) as a raw syscall from an RWX page: native code, no Python-level filter could stop it;
    # namespaces do: it reaches only its own pid namespace
    code = ("import ctypes, mmap\n"
            "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "page.write(bytes.fromhex('b83e000000' 'bfffffffff' 'be09000000' '0f05' 'c3'))\n"
            "addr = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
            "print('syscall returned', ctypes.CFUNCTYPE(ctypes.c_long)(addr)())")
    r = run_counted(sandbox, code)
    assert r.outcome == "ok" and r.stdout.startswith("syscall returned"), r
    assert victim.poll() is None


def test_sleep_past_the_wall_time(sandbox):
    r = run_counted(sandbox, "import time\ntime.sleep(100)")
    assert (r.outcome, r.limit, r.exit_status) == ("timeout", "wall_time", None), r
    assert CFG.wall_time_s <= r.wall_s < CFG.wall_time_s + 2


def test_a_detached_daemon_is_gone_after_the_call(sandbox):
    marker = f"mgrpo-daemon-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.closerange(0, 3)\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])\n"
            "    os._exit(0)\nimport time\ntime.sleep(0.5)\nprint('started')")
    r = run_counted(sandbox, code)
    assert (r.outcome, r.stdout) == ("ok", "started\n"), r
    deadline = time.monotonic() + 5
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(marker) == []


def test_concurrent_calls_are_capped_and_isolated(sandbox):
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(sandbox.run(
        f"import os, time\nopen('/tmp/x', 'a').write('{i}')\ntime.sleep(0.3)\nprint(open('/tmp/x').read())")))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(r.stdout for r in results) == ["0\n", "1\n", "2\n", "3\n"]  # no scratch shared


def test_a_call_that_finds_no_slot_is_a_counted_timeout():
    require_level("bwrap")
    from mgrpo.sandbox import Sandbox

    with Sandbox(SandboxConfig(isolation="bwrap", wall_time_s=1.0, pool_size=0, max_concurrency=1)) as sb:
        assert sb._slots.acquire(timeout=1)  # a call in flight, holding the only slot
        try:
            r = sb.run("print(1)")
        finally:
            sb._slots.release()
        assert (r.outcome, r.limit, r.exit_status) == ("timeout", "queue", None)
        assert sb.counts.drain()["sandbox/limit/queue"] == 1
        assert sb.run("print(6 * 7)").stdout == "42\n"


def test_the_command_prints_one_json_line(tmp_path):
    require_level("bwrap")
    (tmp_path / "in.txt").write_text("7")
    out = subprocess.run([sys.executable, "-m", "mgrpo_launchers.sandbox", "--wall-time-s", "5", "--stdin",
                          str(tmp_path / "in.txt")], input="print(int(input()) * 6)", capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert (line["outcome"], line["stdout"], line["isolation"]) == ("ok", "42\n", "bwrap")
    assert "sandbox: isolation bwrap" in out.stderr


def test_the_unshare_level():
    require_level("unshare")
    from mgrpo.sandbox import Sandbox

    listener = Listener()
    try:
        with Sandbox(SandboxConfig(isolation="unshare", wall_time_s=6.0, max_processes=16, pool_size=0)) as sb:
            r = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {listener.tcp.getsockname()[1]}), 2)")
            assert r.outcome == "error" and "Connection refused" in r.stderr, r
            r = sb.run("import os\nwhile True:\n    os.fork()")
            assert (r.outcome, r.limit) == ("limit", "processes"), r
            assert sb.run("print(6 * 7)").stdout == "42\n"
        assert listener.got == []
    finally:
        listener.close()


UNPRIVILEGED = """
import json, sys
root, port, path = sys.argv[1:4]
sys.path.insert(0, root)
from mgrpo.config.sandbox import SandboxConfig
from mgrpo.sandbox import Sandbox
from mgrpo.sandbox.probe import probe

out = {"probe": {str(k): v for k, v in probe().items()}}
codes = ("import os; print(os.getuid())",
         f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)",
         "import os\\nwhile True: os.fork()",
         f"print(len(open({path!r}).read()) > 0)")
for level in ("bwrap", "unshare"):
    with Sandbox(SandboxConfig(isolation=level, wall_time_s=5, max_processes=16, pool_size=0), announce=False) as sb:
        out[level] = [[r.outcome, r.limit, r.stdout] for r in (sb.run(code) for code in codes)]
print(json.dumps(out))
"""


def test_as_an_unprivileged_user_both_levels_work():
    """What a cluster user gets: bwrap makes its own user namespace, and the unshare level works (its weaker view:
    the host's world-readable files). Run as uid 65534 with Debian's own interpreter, which that user can read
    (the test interpreter may sit under a 0700 home); needs root to switch user."""
    system_python = "/usr/bin/python3"
    if os.getuid() != 0 or not os.path.exists(system_python):
        pytest.skip("needs root (to run as uid 65534) and Debian's /usr/bin/python3")
    require_level("bwrap")
    listener = Listener()
    repo = str(ROOT)
    readable = os.path.join(repo, "README.md")  # the checkout (world-readable here), where runs keep outputs/
    try:
        out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env", "-i",
                              "PATH=/usr/bin:/bin", "HOME=/tmp", system_python, "-c", UNPRIVILEGED, repo,
                              str(listener.tcp.getsockname()[1]), str(readable)],
                             capture_output=True, text=True, timeout=180, cwd="/")
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["probe"] == {"bwrap": None, "unshare": None}, got
    for level in ("bwrap", "unshare"):
        uid, net, bomb, read = got[level]
        assert uid == ["ok", None, "65534\n"] and net[0] == "error" and bomb[:2] == ["limit", "processes"], got
        # bwrap shows none of the host's files; the unshare level shows the world-readable ones
        assert read == (["error", None, ""] if level == "bwrap" else ["ok", None, "True\n"]), (level, read)
    assert listener.got == []
