"""The tiny Qwen3-MoE through the whole loop (Ray, megatron-core over gloo, the in-process transformers
engine holding a Qwen3MoeForCausalLM): EP=2 and TP=2 x EP=2 reproduce the one-rank run, two steps of
the default job shortened as tests/e2e/test_e2e.py shortens it.

The engine generates the second step with the experts both EP ranks trained and the weight source
gathered (its log-probs agree with the trainer's), and the HF export written from the EP ranks equals
the one-rank run's. The load-balancing loss is off here: with EP=2 the two data-parallel replicas each
average it over their own half of the batch (tests/training/test_moe_parallel.py checks it where that is exact)."""

from __future__ import annotations

import os

import pytest

from mgrpo.loop import Trainer
from tests.helpers.runs import LOSS_KEYS, read_metrics, small_config
from tests.helpers.moe import HF_ENGINE, tiny_moe

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("moe1"))
    Trainer(small_config(run_dir, model=tiny_moe(), rollout=HF_ENGINE, trainer={"save_hf": True})).fit()
    return run_dir, read_metrics(run_dir)


@pytest.mark.parametrize("actor", [{"ep": 2}, {"tp": 2, "ep": 2}], ids=["ep2", "tp2ep2"])
def test_moe_layouts_match_one_rank(one_rank, tmp_path, actor):
    from transformers import AutoModelForCausalLM

    ref_dir, ref = one_rank
    Trainer(small_config(str(tmp_path), model=tiny_moe(), actor=actor, rollout=HF_ENGINE, trainer={"save_hf": True})).fit()
    got = read_metrics(str(tmp_path))
    assert ref[0]["actor/grad_norm"] > 1e-3
    assert got[0]["critic/score/mean"] == ref[0]["critic/score/mean"]  # same rollouts
    for step in range(2):
        for key in LOSS_KEYS:
            assert got[step][key] == pytest.approx(ref[step][key], abs=1e-5), (step, key)
        assert got[step]["rollout/logprob_abs_diff"] < 1e-4  # step 2: the engine holds the synced experts
    assert got[0]["perf/update_weights_bytes"] == ref[0]["perf/update_weights_bytes"]  # every expert, once
    a = AutoModelForCausalLM.from_pretrained(os.path.join(ref_dir, "hf")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(os.path.join(str(tmp_path), "hf")).state_dict()
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-4, name
