"""The tier rule of tests/conftest.py, tested on a suite of its own run by pytest in a child process: a unit test
that starts a process, a multiprocessing child, a server or a gloo group fails with the marker message (even where
the code under test catches `Exception`), the same under `integration` passes, an unmarked test is selected by
`-m unit`, and every test's tier, seconds and what it started are written to the durations file, also when
pytest-xdist runs the suite on two workers; under xdist, tests go out longest first, a group as one."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import ROOT
from tests.conftest import longest_first


SUITE = '''
import multiprocessing
import socket
import subprocess

import pytest
import torch.distributed as dist


def test_plain():
    assert 1 + 1 == 2


def test_subprocess():
    subprocess.run(["true"], check=True)


def test_subprocess_swallowed():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


def test_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


def test_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_gloo_group():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


@pytest.mark.integration
def test_subprocess_in_integration():
    assert subprocess.run(["true"]).returncode == 0
'''


def _child_suite(pytester, monkeypatch):
    durations = pytester.path / "durations.json"
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("MGRPO_TEST_DURATIONS", str(durations))
    monkeypatch.delenv("MGRPO_TIER_AUDIT", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # the short summary's lines whole
    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403  (the hooks under test)\n")
    pytester.makepyfile(test_suite=SUITE)
    return durations


@pytest.mark.integration
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_unit_tier_refuses_processes_servers_and_groups(pytester, monkeypatch, workers):
    durations = _child_suite(pytester, monkeypatch)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", *workers, timeout=300)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2 and outcomes.get("failed") == 5, result.stdout.str()[-3000:]
    text = result.stdout.str()
    for name, what in [("test_subprocess", "a process (true)"), ("test_subprocess_swallowed", "a process (true)"),
                       ("test_multiprocessing", "a process ("), ("test_server", "a server (listening on"),
                       ("test_gloo_group", "a torch.distributed group (gloo)")]:
        line = next(x for x in text.splitlines() if x.startswith(f"FAILED test_suite.py::{name} "))
        assert f"this test started {what}" in line and "@pytest.mark.integration" in line, line

    record = json.loads(durations.read_text())["tests"]
    assert record["test_suite.py::test_plain"]["tier"] == "unit"
    assert record["test_suite.py::test_plain"]["started"] == []
    assert record["test_suite.py::test_subprocess_in_integration"] == {
        **record["test_suite.py::test_subprocess_in_integration"], "tier": "integration", "outcome": "passed",
        "started": ["a process"]}
    assert record["test_suite.py::test_server"]["outcome"] == "failed in call"
    assert len(record) == 7  # under xdist too: the controller writes every worker's tests, the workers nothing
    if workers:
        return

    # An unmarked test is `unit`: selected by -m unit, deselected by the README's -m "not system" never.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "unit", "-k", "plain or integration",
                                           timeout=300)
    assert result.parseoutcomes() == {"passed": 1, "deselected": 6}, result.stdout.str()[-2000:]


def test_xdist_hands_out_the_longest_first_and_a_group_as_one(pytester):
    # Collected in this process (no child pytest); pytest-benchmark off, since it runs `git` when configured.
    items = pytester.genitems([pytester.getmodulecol("""
import pytest

def test_short(): pass
def test_long(): pass
def test_unknown(): pass

@pytest.mark.xdist_group("g")
def test_grouped_a(): pass

@pytest.mark.xdist_group("g")
def test_grouped_b(): pass
""", configargs=("-p", "no:benchmark"))])
    mod = items[0].nodeid.split("::")[0]
    seconds = {f"{mod}::test_short": 1.0, f"{mod}::test_long": 50.0, f"{mod}::test_grouped_a": 30.0,
               f"{mod}::test_grouped_b": 30.0, "elsewhere::test_median": 5.0}
    order = [item.name for item in longest_first(items, seconds)]
    # The group's 60 s beat the longest single test; an unrecorded test counts as the median (5 s).
    assert order == ["test_grouped_a", "test_grouped_b", "test_long", "test_unknown", "test_short"]
    assert [i.name for i in longest_first(items, {})] == [i.name for i in items]  # no record: as collected
