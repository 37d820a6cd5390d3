"""The sandbox from an interpreter wherever it lives: a virtual environment made under /tmp (the sandbox mounts
its own /tmp, which must not hide the interpreter), run through `mgrpo-sandbox` as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.helpers import ROOT as HELPERS_ROOT
from tests.helpers.sandbox import require_level

pytestmark = pytest.mark.integration

ROOT = str(HELPERS_ROOT)


@pytest.fixture
def tmp_venv():
    """A venv under /tmp itself (not only under some folder of /tmp), removed afterwards."""
    folder = tempfile.mkdtemp(prefix="mgrpo-venv-", dir="/tmp")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", folder],
                       check=True, timeout=120)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_bwrap_runs_code_from_an_interpreter_in_a_venv_under_tmp(tmp_venv):
    require_level("bwrap")
    python = os.path.join(tmp_venv, "bin", "python")
    code = "import json, os, sys\nprint(json.dumps([6 * 7, sys.prefix, sorted(os.listdir('/tmp'))]))"
    env = {**os.environ, "PYTHONPATH": ROOT}  # mgrpo from this checkout; the sandbox itself runs with -I
    done = subprocess.run([python, "-m", "mgrpo_launchers.sandbox", "--isolation", "bwrap"], input=code,
                          capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert (line["outcome"], line["isolation"], line["stderr"]) == ("ok", "bwrap", ""), line
    answer, prefix, in_tmp = json.loads(line["stdout"])
    assert answer == 42 and prefix == tmp_venv
    # the sandbox's /tmp is its own tmpfs: only the venv's (read-only) mount point shows there
    assert in_tmp == [os.path.basename(tmp_venv)]
