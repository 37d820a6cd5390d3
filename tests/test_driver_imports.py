"""What the driver imports before Ray starts: torch comes with the run's parts, in a thread of `build`'s while
ray.init waits for its processes (components/assemble.py), not on the path to the first step before it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_driver_checks_config_and_data_without_torch(tmp_path):
    code = ("import dataclasses, sys\n"
            "from mgrpo.config import MGRPOConfig\n"
            "from mgrpo.loop import Trainer\n"
            "from mgrpo.components.assemble import _import_parts, prepare\n"
            "cfg = MGRPOConfig()\n"
            f"cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir={str(tmp_path)!r}, "
            "device='cpu'))\n"
            "t = Trainer(cfg)\n"
            "p = prepare(t.cfg, t.run_dir)\n"
            "print(len(p.train_data) > 0, 'torch' in sys.modules)\n"
            "_import_parts()\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["True", "False", "True"], out.stdout
