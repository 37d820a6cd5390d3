"""benchmarks/tools/perf_history.py: a number more than 10% worse than the previous line's is named, with the
previous commit and load; 10% or less, a better number, or a comparison that failed or was not run is not."""

from __future__ import annotations

import json

from benchmarks.tools.perf_history import last_line, regressions


def _line(commit, step, pss, ttfs, kernel_s):
    return {"commit": commit, "load_1m_at_start": 1.5,
            "tiny": {"step_ratio": step, "pss_ratio": pss, "mgrpo_time_to_first_step_s": ttfs},
            "kernel": {"chunked_median_s": kernel_s, "chunked_peak_extra_mib": 594.0}}


def test_more_than_ten_percent_worse_is_named_and_nothing_else():
    before = _line("aaa", step=1.00, pss=1.80, ttfs=20.0, kernel_s=5.0)
    after = _line("bbb", step=1.11, pss=1.98, ttfs=12.0, kernel_s=5.4)  # +11%, +10% exactly, better, +8%
    found = regressions(before, after)
    assert len(found) == 1 and found[0].startswith("tiny step_ratio: 1 -> 1.11 (+11%, previous line aaa at load 1.5)")
    failed = {**after, "tiny": {"error": "exit 1: ..."}}
    assert regressions(before, failed) == []  # a failed comparison is reported as failed, not as a regression
    assert regressions(before, {"commit": "ccc"}) == []  # --only kernel after a full run: nothing to compare


def test_last_line_reads_the_history_file(tmp_path):
    path = tmp_path / "perf_history.jsonl"
    assert last_line(str(path)) is None
    path.write_text(json.dumps(_line("aaa", 1, 1, 1, 1)) + "\n" + json.dumps(_line("bbb", 2, 2, 2, 2)) + "\n\n")
    assert last_line(str(path))["commit"] == "bbb"
