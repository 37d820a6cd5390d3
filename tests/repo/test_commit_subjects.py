""".ci/commit_subjects on a repository of its own: subjects over 72 characters after the base commit are named
(merges too), 72 is allowed, commits up to the base are not judged, and a clone without the base skips, saying so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = str(ROOT / ".ci" / "commit_subjects")
ENV = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
           GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")


def git(repo, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def commit(repo, subject: str) -> str:
    git(repo, "commit", "-q", "--allow-empty", "-m", subject)
    return git(repo, "rev-parse", "--short", "HEAD")


def check(repo, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=repo, env=ENV, capture_output=True, text=True,
                          timeout=60)


def test_subjects_over_72_after_the_base_are_named_merges_too(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "old: " + "x" * 100)  # before the base: not judged
    base = commit(repo, "base")
    commit(repo, "a" * 72)
    git(repo, "checkout", "-q", "-b", "side")
    long_side = commit(repo, "b" * 73)
    git(repo, "checkout", "-q", "main")
    commit(repo, "fine")
    git(repo, "merge", "-q", "--no-ff", "side", "-m", "Merge " + "m" * 80)
    merge = git(repo, "rev-parse", "--short", "HEAD")

    out = check(repo, base)
    assert out.returncode == 1, out.stdout + out.stderr
    named = [line.split()[0] for line in out.stdout.splitlines() if " subject of " in line]
    assert sorted(named) == sorted([long_side, merge])
    assert "subject of 73 characters" in out.stdout and "subject of 86 characters" in out.stdout
    assert "4 commits after" in out.stdout.splitlines()[-1]

    git(repo, "reset", "-q", "--hard", "HEAD^1")  # main without the merge: the 73-character side commit goes too
    out = check(repo, base)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip().endswith("0 with a subject over 72 characters")


def test_a_clone_without_the_base_skips_saying_so(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    base = commit(repo, "base")
    commit(repo, "c" * 90)
    commit(repo, "head")
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", "shallow")
    out = check(tmp_path / "shallow", base)
    assert out.returncode == 0
    assert out.stdout.strip() == f"commit_subjects: base commit {base} is not in this clone (shallow?): check skipped"
    assert check(repo, base).returncode == 1  # the full clone judges the same history
