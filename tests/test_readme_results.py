"""The README's measured numbers are the committed results files' (benchmarks/readme_table.py renders the
main job's sentence, the planner's table and the Results table from benchmarks/results/)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_what_the_results_files_say():
    text = (ROOT / "README.md").read_text()
    assert readme_table().render(text) == text, \
        "README.md disagrees with benchmarks/results/: run `python benchmarks/readme_table.py --write`"


def test_a_changed_results_file_changes_the_readme(tmp_path, monkeypatch):
    """The check can fail: the main job's last-10 reward edited in a copy of the results shows in the render."""
    module = readme_table()
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").iterdir():
        if f.is_file():
            (results / f.name).write_bytes(f.read_bytes())
    main_job = json.loads((results / "main_job_cpu.json").read_text())
    main_job["reward_last10"] = 0.123456
    (results / "main_job_cpu.json").write_text(json.dumps(main_job))
    monkeypatch.setattr(module, "RESULTS", str(results))
    text = (ROOT / "README.md").read_text()
    rendered = module.render(text)
    assert rendered != text and "0.123 over the last 10" in rendered
    with pytest.raises(ValueError, match="readme_table:results"):
        module.render(text.replace("<!-- /readme_table:results -->", ""))


def test_plan_table_writes_tracked_files_only_when_asked(tmp_path):
    import subprocess
    import sys

    tracked = ROOT / "benchmarks" / "results" / "plan_qwen3_8x80gb.json"
    before = tracked.read_bytes()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_table.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert tracked.read_bytes() == before
    written = json.loads((tmp_path / "plan_qwen3_8x80gb.json").read_text())
    # the committed file is what the planner says today (the README's table is rendered from it)
    assert written["rows"] == json.loads(before)["rows"] and written["recipe"] == json.loads(before)["recipe"]
