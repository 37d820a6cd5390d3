"""What a person watching a run sees: the console line (tool columns for multi-turn runs, the time left from
the recent pace) and TensorBoard's Custom Scalars page (a multi-turn page; one run per series of a multi-line
chart, so that each line has its own colour and its name)."""

from __future__ import annotations

import io
import os

import pytest

from mgrpo.observe import tracker as tracker_module
from mgrpo.observe.tracker import Tracker, chart_tag

MULTI_TURN_STEP = {"critic/score/mean": 0.25, "response_length/mean": 40.0, "multi_turn/turns_mean": 2.5,
                   "multi_turn/tool_calls_per_trajectory": 1.25, "multi_turn/free_call_rate": 0.75,
                   "multi_turn/tool_errors": 3, "multi_turn/failed": 1, "multi_turn/tool_response_truncated": 2}


def test_multi_turn_runs_show_tool_columns_after_the_length(tmp_path):
    line = Tracker(str(tmp_path), ["console"], multi_turn=True, stream=io.StringIO()).format_line(MULTI_TURN_STEP, 1)
    assert ("reward 0.250 | len 40.00 | turns 2.50 | calls 1.25 | call_rate 0.75 | tool_err 3 | failed 1 | cut 2 |"
            in line)
    plain = Tracker(str(tmp_path), ["console"], stream=io.StringIO()).format_line(MULTI_TURN_STEP, 1)
    assert "turns" not in plain and "reward 0.250 | len 40.00 | elapsed" in plain


def test_the_time_left_follows_the_recent_steps_not_the_start_up(tmp_path, monkeypatch):
    clock = iter([0.0, 60.0, 61.0, 62.0, 63.0, 64.0, 65.0, 66.0, 67.0, 68.0, 69.0, 70.0, 71.0, 72.0])
    monkeypatch.setattr(tracker_module.time, "monotonic", lambda: next(clock))
    t = Tracker(str(tmp_path), ["console"], total_steps=100, stream=io.StringIO())
    # step 1 took 60 s (start-up, compilation), then every step 1 s
    lines = [t.format_line({}, step) for step in range(1, 8)]
    assert lines[0].endswith("elapsed 1:00 | eta 1:39:00")  # one step seen: its pace is all there is
    # step 7: the last 5 steps took 1 s each -> 93 s left (the mean since the start would say 15:20)
    assert lines[6].endswith("elapsed 1:06 | eta 1:33")


def _events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(path), size_guidance={"tensors": 0, "scalars": 0}).Reload()


def test_custom_scalars_has_a_multi_turn_page_and_a_run_per_series(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2

    t = Tracker(str(tmp_path), ["tensorboard"], multi_turn=True)
    for step in (1, 2):
        t.log({**MULTI_TURN_STEP, "actor/pg_loss": 0.1 * step, "actor/kl_loss": 0.01 * step,
               "timing_s/gen": 2.0, "timing_s/step": 3.0}, step=step)
    t.close()
    tb = tmp_path / "tensorboard"
    layout = layout_pb2.Layout()
    layout.ParseFromString(_events(tb).Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    pages = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    assert list(pages) == ["mgrpo", "multi-turn"]
    assert list(pages["multi-turn"]) == [
        "turns and tool calls per trajectory", "call rate (trajectories that call a tool, unforced)",
        "failures (trajectories, tool errors, timeouts, retries)",
        "truncations (tool replies, tokens cut, finish reasons)", "tool seconds"]
    assert pages["mgrpo"]["losses"] == ["^chart/losses$"]  # several series: read from their own runs
    assert pages["mgrpo"]["response length"] == ["response_length/mean"]  # one series: as it is
    # each series of a multi-line chart is a run of its own (its colour, its name) holding the chart's tag
    for key, tag, values in (("actor/pg_loss", chart_tag("losses"), [0.1, 0.2]),
                             ("actor/kl_loss", "chart/losses", [0.01, 0.02]),
                             ("timing_s/gen", "chart/step_time", [2.0, 2.0]),
                             ("multi_turn/tool_errors", chart_tag("failures (trajectories, tool errors, timeouts, "
                                                                  "retries)"), [3.0, 3.0])):
        series = _events(tb / "series" / key)
        assert series.Tags()["scalars"] == [tag]
        assert [e.value for e in series.Scalars(tag)] == pytest.approx(values)
    assert not os.path.exists(tb / "series" / "response_length")  # a single-series chart needs no run
    # the plain tags are still in the main run (the Scalars tab, metrics.jsonl's names)
    assert "multi_turn/turns_mean" in _events(tb).Tags()["scalars"]
    # a single-turn run has no multi-turn page
    single = Tracker(str(tmp_path / "single"), ["tensorboard"])
    single.close()
    layout = layout_pb2.Layout()
    layout.ParseFromString(_events(tmp_path / "single" / "tensorboard").Tensors("custom_scalars__config__")[0]
                           .tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["mgrpo"]
