"""The README's measured numbers are the committed results files' (benchmarks/tools/readme_table.py renders the
main job's sentence, the planner's table and the Results table from benchmarks/results/)."""

from __future__ import annotations

import json

import pytest

from benchmarks.tools import readme_table
from tests.helpers import ROOT


def test_readme_is_what_the_results_files_say():
    text = (ROOT / "README.md").read_text()
    assert readme_table.render(text) == text, \
        "README.md disagrees with benchmarks/results/: run `python -m benchmarks.tools.readme_table --write`"


def test_a_changed_results_file_changes_the_readme(tmp_path, monkeypatch):
    """The check can fail: the main job's last-10 reward edited in a copy of the results shows in the render."""
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").iterdir():
        if f.is_file():
            (results / f.name).write_bytes(f.read_bytes())
    main_job = json.loads((results / "main_job_cpu.json").read_text())
    main_job["reward_last10"] = 0.123456
    (results / "main_job_cpu.json").write_text(json.dumps(main_job))
    monkeypatch.setattr(readme_table, "RESULTS", str(results))
    text = (ROOT / "README.md").read_text()
    rendered = readme_table.render(text)
    assert rendered != text and "0.123 over the last 10" in rendered
    with pytest.raises(ValueError, match="readme_table:results"):
        readme_table.render(text.replace("<!-- /readme_table:results -->", ""))


@pytest.mark.integration
def test_plan_table_writes_tracked_files_only_when_asked(tmp_path):
    import subprocess
    import sys

    tracked = ROOT / "benchmarks" / "results" / "plan_qwen3_8x80gb.json"
    before = tracked.read_bytes()
    out = subprocess.run([sys.executable, "-m", "benchmarks.measure.plan_table", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert tracked.read_bytes() == before
    written = json.loads((tmp_path / "plan_qwen3_8x80gb.json").read_text())
    # the committed file is what the planner says today (the README's table is rendered from it)
    assert written["rows"] == json.loads(before)["rows"] and written["recipe"] == json.loads(before)["recipe"]
