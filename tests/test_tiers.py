"""The tier rule of tests/conftest.py, tested on a suite of its own run by pytest in a child process: a unit test
that starts a process, a multiprocessing child, a server or a gloo group fails with the marker message (even where
the code under test catches `Exception`), the same under `integration` passes, an unmarked test is selected by
`-m unit`, and every test's tier, seconds and what it started are written to the durations file."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.integration
def test_unit_tier_refuses_processes_servers_and_groups(pytester, monkeypatch):
    durations = pytester.path / "durations.json"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("MGRPO_TEST_DURATIONS", str(durations))
    monkeypatch.delenv("MGRPO_TIER_AUDIT", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # the short summary's lines whole
    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403  (the hooks under test)\n")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", timeout=300)
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

    # An unmarked test is `unit`: selected by -m unit, deselected by the README's -m "not system" never.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "unit", "-k", "plain or integration",
                                           timeout=300)
    assert result.parseoutcomes() == {"passed": 1, "deselected": 6}, result.stdout.str()[-2000:]
