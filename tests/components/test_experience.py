"""The experience's array views and the actor client's split, against per-row constructions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mgrpo.components.actor_client import balanced_split
from mgrpo.experience import Experience


def _experience(lengths: list[int], in_loss: list[bool]) -> Experience:
    n = len(lengths)
    return Experience(prompt_ids=[[1, 2]] * n, response_ids=[[3] * k for k in lengths],
                      rollout_logprobs=[[-1.0] * k for k in lengths], finish_reasons=["stop"] * n,
                      weight_versions=[0] * n, group_index=[i // 2 for i in range(n)], in_loss=in_loss)


def test_masks_and_padding_match_row_by_row():
    rng = random.Random(0)
    lengths = [rng.randint(0, 9) for _ in range(33)]
    in_loss = [rng.random() < 0.7 for _ in lengths]
    exp = _experience(lengths, in_loss)
    values = [[rng.uniform(-5, 5) for _ in range(k)] for k in lengths]
    width = max(lengths)
    mask, loss_mask, padded = (np.zeros((len(lengths), width), dtype=np.float32) for _ in range(3))
    for i, k in enumerate(lengths):
        mask[i, :k] = 1.0
        loss_mask[i, :k] = 1.0 if in_loss[i] else 0.0
        padded[i, :k] = values[i]
    assert np.array_equal(exp.response_mask(), mask) and exp.response_mask().dtype == np.float32
    assert np.array_equal(exp.response_mask(loss_only=True), loss_mask)
    assert np.array_equal(exp.padded(values), padded) and exp.padded(values).dtype == np.float32
    assert exp.unpadded(padded) == [np.array(v, dtype=np.float32).tolist() for v in values]
    empty = _experience([], [])
    assert empty.response_mask().shape == empty.padded([]).shape == (0, 1)


def test_balanced_split_is_a_partition_by_length():
    lengths = [7, 3, 9, 1, 4, 4, 8, 2]
    assert balanced_split(lengths, 1) == [list(range(8))]
    parts = balanced_split(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sample


def test_shards_carry_where_their_samples_came_from_and_results_go_back_there():
    from mgrpo.components.actor_client import ActorClient, in_sample_order
    from mgrpo.config import MGRPOConfig
    from mgrpo.experience import ForwardResults

    exp = _experience([7, 3, 9, 1, 4, 4, 8, 2], [True] * 8)
    sub = [5, 0, 6, 2, 7]  # a mini-batch's samples
    shards = ActorClient(None, MGRPOConfig(), dp=2)._shards(exp, sub, for_training=False)
    assert sorted(i for s in shards for i in s.seq_index) == list(range(len(sub)))
    # each rank answers in its shard's order: one value per sample, here its response length
    answers = [[len(ids) - p for ids, p in zip(s.input_ids, s.prompt_lens)] for s in shards]
    assert in_sample_order(shards, answers) == [len(exp.response_ids[i]) for i in sub]
    # results come back as values; the experience takes them only when asked, and keeps what was not computed
    got = exp.with_results(ForwardResults(old_logprobs=[[0.0] * len(r) for r in exp.response_ids]))
    assert exp.old_logprobs is None and got.old_logprobs is not None and got.entropy is None


def test_the_pipeline_returns_what_producing_a_batch_measured_and_drops_stale_samples():
    from mgrpo.components.rollout_pipeline import Produced, RolloutPipeline

    pipe = RolloutPipeline(lambda index: None, max_staleness=1)
    stale, fresh = _experience([1, 2], [True] * 2), _experience([3, 4], [True] * 2)
    stale.weight_versions, fresh.weight_versions = [0, 0], [0, 2]
    pipe.ready = [Produced(0, stale, {"rollout/retries": 1, "timing_s/gen": 0.5}),
                  Produced(1, fresh, {"rollout/retries": 2, "timing_s/gen": 0.25})]
    exp, measured = pipe.next(current_version=2)  # the first batch is dropped whole, then one sample of the next
    assert exp.weight_versions == [2] and pipe.steps_done == 1
    assert measured == {"rollout/retries": 3, "timing_s/gen": 0.75, "rollout/stale_dropped": 3,
                        "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/staleness_min": 0.0}
    assert pipe.may_start(2) and not pipe.may_start(3)  # batch b starts once b <= steps done + max_staleness


def test_run_summary_reads_the_steps_and_merges_the_last_steps_validation(tmp_path):
    import json

    from mgrpo.observe.metrics import run_summary

    assert run_summary(str(tmp_path)) == ({}, "")
    lines = [{"step": 0, "time": 100.0, "val/mgrpo/sum/score": 0.1}]
    lines += [{"step": s, "time": 100.0 + 2 * s, "critic/score/mean": s / 20} for s in range(1, 21)]
    lines += [{"step": 20, "time": 141.0, "val/mgrpo/sum/score": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "checkpoints").mkdir()
    final, line = run_summary(str(tmp_path))
    assert final == {"critic/score/mean": 1.0, "val/mgrpo/sum/score": 0.9}
    assert line == (f"done | 20 steps | reward first-10 0.275, last-10 0.775 | 41s | {tmp_path}: metrics.jsonl, "
                    "checkpoints/")


def test_tensorboard_gets_the_config_and_a_page_of_the_key_curves(tmp_path):
    import dataclasses

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mgrpo.components.assemble import config_yaml
    from mgrpo.config import MGRPOConfig
    from mgrpo.observe.tracker import Tracker

    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, api_key="s3cret"))
    text = config_yaml(cfg)
    assert "s3cret" not in text and "api_key: <a key of your own, not shown>" in text and "name: qwen3-tiny" in text
    tracker = Tracker(str(tmp_path), ["tensorboard"], config_text=text)
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker._tb.flush()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    tags = events.Tags()["tensors"]
    assert "config/text_summary" in tags and "custom_scalars__config__" in tags
    stored = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "name: qwen3-tiny" in stored and "s3cret" not in stored


def test_tensorboard_records_are_those_torchs_summary_writer_writes(tmp_path):
    """The driver writes TensorBoard without torch (observe/tb_events.py); torch's SummaryWriter, which the
    Tracker used before, is the reference: the same records, field for field (wall times aside), purge_step
    included."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from mgrpo.observe.tb_events import EventWriter
    from mgrpo.observe.tracker import TB_LAYOUT

    def records(d):
        (path,) = glob.glob(str(d / "events.*"))
        out = list(EventFileLoader(path).Load())
        for e in out:
            e.wall_time = 0.0
        return out

    for writer, d in ((SummaryWriter, tmp_path / "torch"), (EventWriter, tmp_path / "ours")):
        w = writer(str(d), purge_step=4)
        w.add_custom_scalars(TB_LAYOUT)
        w.add_text("config", "```\nmodel: tiny\n```", 3)
        w.add_scalar("critic/score/mean", 0.25, 4)
        w.add_scalar("actor/grad_norm", 1e30, 5)
        w.close()
    want, got = records(tmp_path / "torch"), records(tmp_path / "ours")
    assert len(want) == 7 and got == want


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_a_batchs_weights_are_a_function_of_its_index_not_of_thread_timing(max_staleness):
    """Batch b is generated with weight version max(0, b - max_staleness) however the producer's and the trainer's
    times fall: a weight sync waits for every batch the look-ahead allows before taking the engines."""
    import random
    import threading
    import time

    from mgrpo.components.rollout_pipeline import RolloutPipeline

    for trial in range(6):
        rng, lock = random.Random(trial), threading.Lock()
        version, started = [0], {}

        def produce(index):
            with lock:
                started[index] = version[0]
                pause = rng.random() * 0.004
            time.sleep(pause)
            exp = _experience([index + 1], [True])
            exp.weight_versions = [started[index]]
            return exp, {}

        pipe = RolloutPipeline(produce, max_staleness=max_staleness)
        pipe.start()
        try:
            for step in range(8):
                exp, _ = pipe.next(version[0])
                time.sleep(rng.random() * 0.004)  # training
                with pipe.paused():  # the weight sync
                    version[0] += 1
                pipe.step_done()
        finally:
            pipe.close()
        assert {b: started[b] for b in range(8)} == {b: max(0, b - max_staleness) for b in range(8)}, trial
