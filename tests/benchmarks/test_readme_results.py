"""The docs' measured numbers are the committed results files' (benchmarks/tools/readme_table.py renders the
main job's sentence, the planner's table, the Results table, the test tiers and the performance history from
benchmarks/results/ into the pages readme_table.PAGES names)."""

from __future__ import annotations

import json

import pytest

from benchmarks.tools import readme_table
from tests.helpers import ROOT


def test_the_pages_are_what_the_results_files_say():
    assert sorted(n for names in readme_table.PAGES.values() for n in names) == sorted(readme_table.BLOCKS)
    for page, names in readme_table.PAGES.items():
        text = (ROOT / page).read_text()
        assert readme_table.render(text, names, page) == text, \
            f"{page} disagrees with benchmarks/results/: run `python -m benchmarks.tools.readme_table --write`"


def test_a_changed_results_file_changes_the_readme(tmp_path, monkeypatch):
    """The check can fail: the main job's wall time edited in a copy of the results, and a learning-history line
    with other rewards, show in the render."""
    from benchmarks.tools import learning_history

    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").iterdir():
        if f.is_file():
            (results / f.name).write_bytes(f.read_bytes())
    main_job = json.loads((results / "main_job_cpu.json").read_text())
    main_job["wall_s"] = 1234.0
    (results / "main_job_cpu.json").write_text(json.dumps(main_job))
    runs = {str(s): {"first10": 0.01, "last10": 0.123456, "steps": 150, "wall_s": 60.0, "load_1m_at_start": 1.0}
            for s in (1, 2, 3)}
    line = {"commit": "abc", "date_utc": "2026-12-06T00:00:00Z", "overrides": [], "machine": {"cpu_model": "X"},
            "recipes": {"main": learning_history.summarise("main", runs)}}
    with open(results / "learning_history.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    monkeypatch.setattr(readme_table, "RESULTS", str(results))
    page = "docs/results.md"
    names = readme_table.PAGES[page]
    text = (ROOT / page).read_text()
    rendered = readme_table.render(text, names, page)
    assert rendered != text and "1234 s of wall time" in rendered and "| 3 | 0.123 / 0.123 / 0.123 |" in rendered
    readme = (ROOT / "README.md").read_text()
    assert "**0.123 to 0.123, median 0.123**" in readme_table.render(readme, readme_table.PAGES["README.md"])
    with pytest.raises(ValueError, match="readme_table:results"):
        readme_table.render(text.replace("<!-- /readme_table:results -->", ""), names, page)


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
