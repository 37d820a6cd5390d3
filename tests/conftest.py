"""Test tiers by cost, enforced: a test's tier is what it may start, not a label.

- `unit` (the default for an unmarked test): in-process only. Starting a process (subprocess, multiprocessing,
  fork, spawn), a torch.distributed group (gloo) or a listening server fails the test, naming the marker to use.
- `integration`: one process tree per test, one case per parallel axis. The README's test command runs
  unit + integration (`python -m pytest -m "not system" -n 2`).
- `system`: learning runs, soaks, chaos, SLURM, fuzz, full layout matrices, kill/stop matrices. `.ci/run` runs
  it after the README's command.

Every run writes each test's tier, outcome, seconds and what it started to `outputs/tests/durations.json`,
so that tiers move by data (`python -m benchmarks.tools.test_suite --update-results` keeps a committed summary
and the per-test seconds in `tests/durations_cpu.json`). pytest-timeout is the backstop against a hang: each tier has a default
budget per test, a `@pytest.mark.timeout(...)` overrides it.

With pytest-xdist (`-n 2 --dist loadgroup`, as `.ci/run` runs) a module's tests go to one worker (its
module-scoped fixtures are built once), modules are handed out longest first by those committed seconds, so the
longest do not start last and leave a worker idle at the end, and tests that share a machine-wide resource carry one
`xdist_group` (`tests/helpers/procs.py::machine_wide`) and run one after another. Each worker
sends its records with its reports, and the controller writes the one durations file.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import _posixsubprocess
import pytest

from tests.helpers.sglang_cpu import Reference, launch, tiny_checkpoint

pytest_plugins = ["pytester"]  # tests/repo/test_tiers.py runs a suite of its own

TIERS = ("unit", "integration", "system")
# Per-test backstops (seconds), well above the slowest test of each tier as measured; a hang ends, named.
TIMEOUT_S = {"unit": 120, "integration": 900, "system": 2400}
DURATIONS = os.environ.get("MGRPO_TEST_DURATIONS") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "outputs", "tests", "durations.json")
COMMITTED_DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations_cpu.json")

# MGRPO_TIER_AUDIT=1 records what each test starts without failing any or timing any out: how tiers are first
# assigned by data.
AUDIT = os.environ.get("MGRPO_TIER_AUDIT") == "1"

MARKER_HELP = ("unit tests run in-process only. Mark it @pytest.mark.integration (one process tree per test) or "
               "@pytest.mark.system (learning runs, soaks, chaos, SLURM, fuzz, full matrices): see tests/conftest.py")


class TierViolation(BaseException):
    """Raised where a unit test starts a process, group or server. A BaseException, so that code under test
    that catches `Exception` (retry loops, health checks) cannot swallow it; the hook below also fails the test
    from its record in case something catches even this."""


def pytest_configure(config):
    # Also registered in pyproject.toml; here too, so that a suite run with this conftest alone knows them.
    for line in ("unit: in-process only (the default)", "integration: one process tree per test",
                 "system: learning runs, soaks, chaos, SLURM, fuzz, full matrices"):
        config.addinivalue_line("markers", line)


def tier_of(item) -> str:
    # The closest marker wins: a function's marker overrides its module's `pytestmark`.
    for mark in item.iter_markers():
        if mark.name in TIERS:
            return mark.name
    return "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: the tier marker must be on each item before `-m` deselects by it.
    for item in items:
        tier = tier_of(item)
        if not any(m.name in TIERS for m in item.iter_markers()):
            item.add_marker(tier)
        if item.get_closest_marker("timeout") is None and not AUDIT:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[tier]))
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands tests out in this order
        for item in items:
            # A module's tests stay on one worker, so its module-scoped fixtures (a shared run, a server) are
            # built once, as in a serial run.
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(item.module.__name__.rsplit(".", 1)[-1]))
        items[:] = longest_first(items, _committed_seconds())


def _committed_seconds() -> dict[str, float]:
    try:
        with open(COMMITTED_DURATIONS) as f:
            return json.load(f)["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """Items ordered by their recorded seconds, longest first; a group (xdist_group) counts as the sum of its
    tests, since one worker runs it whole. A test with no record counts as the median one. Stable, and the same
    in every worker (xdist requires identical collections)."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 0.0

    def group(item):
        mark = item.get_closest_marker("xdist_group")
        return (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else item.nodeid

    cost: dict[str, float] = {}
    for item in items:
        cost[group(item)] = cost.get(group(item), 0.0) + seconds.get(item.nodeid, default)
    return sorted(items, key=lambda item: -cost[group(item)])


# ---------------------------------------------------------------------------------------------------------------
# What a test starts. The patches wrap the lowest-level entry points, so every route is seen: subprocess.Popen
# (and so asyncio, Ray's launcher, shell-outs) reaches `subprocess._fork_exec`; multiprocessing's spawn and
# forkserver reach `_posixsubprocess.fork_exec`; its fork context reaches `os.fork`; uvicorn, http.server and
# socketserver reach `socket.socket.listen`; gloo groups start at `torch.distributed.init_process_group`.
# `os.system` is left alone: tests pickle it (a payload that would run a command,
# tests/rollout/sglang/test_sglang_fuzz.py), and pickle finds a function by its name, which a wrapper cannot keep.
# ---------------------------------------------------------------------------------------------------------------

class _Watch:
    def __init__(self):
        self.enforce = False
        self.started: list[str] = []

    def saw(self, what: str):
        self.started.append(what)
        if self.enforce:
            raise TierViolation(f"this test started {what}: {MARKER_HELP}")


_watch = _Watch()
_originals: dict = {}


def _wrap(owner, name: str, describe):
    original = getattr(owner, name)
    _originals[(owner, name)] = original

    def wrapper(*args, **kwargs):
        _watch.saw(describe(*args, **kwargs))
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def _argv(args) -> str:
    return " ".join(os.fsdecode(a) for a in (args or [])[:4])


def _install():
    if _originals:
        return
    _wrap(subprocess, "_fork_exec", lambda args, *a, **k: f"a process ({_argv(args)})")
    _wrap(_posixsubprocess, "fork_exec", lambda args, *a, **k: f"a process ({_argv(args)})")
    _wrap(os, "fork", lambda *a, **k: "a process (os.fork)")
    _wrap(os, "posix_spawn", lambda path, *a, **k: f"a process (posix_spawn {path})")
    _wrap(os, "posix_spawnp", lambda path, *a, **k: f"a process (posix_spawnp {path})")
    _wrap(socket.socket, "listen", lambda sock, *a, **k: f"a server (listening on {sock.getsockname()})")
    import torch.distributed as dist
    if dist.is_available():
        describe = lambda *a, backend=None, **k: f"a torch.distributed group ({backend or (a[0] if a else '')})"
        _wrap(dist, "init_process_group", describe)
        _wrap(dist.distributed_c10d, "init_process_group", describe)


def _uninstall():
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


_records: dict[str, dict] = {}


def pytest_sessionstart(session):
    _install()


def pytest_sessionfinish(session, exitstatus):
    _uninstall()
    records = _records
    if not records or hasattr(session.config, "workerinput"):  # xdist: the controller writes the file
        return
    totals = {t: round(sum(r["seconds"] for r in records.values() if r["tier"] == t), 1) for t in TIERS}
    # One file per selection, so the README's command and the system tier keep theirs side by side.
    selection = session.config.option.markexpr
    path = DURATIONS if not selection else DURATIONS.replace(".json", "_" + re.sub(r"\W+", "_", selection) + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "selection": selection or "",
                   "load_1m_at_end": os.getloadavg()[0],
                   "tier_seconds": totals, "tests": records}, f, indent=1)


def _record(nodeid: str, tier: str) -> dict:
    return _records.setdefault(nodeid, {"tier": tier, "outcome": "passed", "seconds": 0.0, "started": []})


def _run_watched(item):
    _watch.enforce = tier_of(item) == "unit" and not AUDIT
    _watch.started = []
    try:
        result = yield
    finally:
        _watch.enforce = False
        started = list(dict.fromkeys(_watch.started))
        # On the report (user_properties travel with it), so that under xdist the controller has them too.
        item.user_properties.append(("mgrpo_test", {"tier": tier_of(item),
                                                    "started": [s.split(" (")[0] for s in started]}))
    if tier_of(item) == "unit" and started and not AUDIT:
        # Reached when the code under test caught the TierViolation: still a failure of the tier rule.
        pytest.fail(f"this test started {started[0]}: {MARKER_HELP}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _run_watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _run_watched(item))


def pytest_runtest_logreport(report):
    ours = [v for k, v in report.user_properties if k == "mgrpo_test"]
    if not ours:
        return
    # Under `--dist loadgroup` xdist appends "@<group>" to a grouped test's id; the record keeps the test's own.
    rec = _record(re.sub(r"@[\w-]+$", "", report.nodeid), ours[-1]["tier"])
    rec["started"] = list(dict.fromkeys(rec["started"] + [s for o in ours for s in o["started"]]))
    rec["seconds"] = round(rec["seconds"] + report.duration, 3)
    if report.outcome != "passed" and rec["outcome"] == "passed":
        rec["outcome"] = f"{report.outcome} in {report.when}"


# ---------------------------------------------------------------------------------------------------------------
# Shared fixtures. The CPU rollout server (a subprocess launched as the rollout group starts it), one per test
# module that asks for it, with a transformers reference on the same weights.
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    eng = launch(ckpt, str(tmp_path_factory.mktemp("logs")))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def ref(ckpt):
    return Reference(ckpt)
