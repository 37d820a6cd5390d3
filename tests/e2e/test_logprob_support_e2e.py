"""algorithm.logprob_support=sampled end to end (Ray, megatron-core over gloo; the in-process engine, and the
SGLang-protocol CPU server; top_k=5, top_p=0.9) at TP=2 and CP=2 (packed): two steps in which the engine's
behaviour log-probs over each token's support and the trainer's agree token by token, the first update
starts on-policy and the reference (the same weights at step 1) agrees too.

Each check fails if one forward ignored the supports: a trainer normalising over the whole vocabulary
puts every token's log-prob lower by log(1 / support mass), ~0.1-1 nat here; a support laid out in the
wrong token order trips the kernel's check that each sampled token is in its own support.
"""

from __future__ import annotations

import math

import pytest

from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics, small_config

pytestmark = pytest.mark.system

HF = {"engine": "hf", "mode": "hybrid"}
SGLANG = {"engine": "sglang"}  # the default path: the CPU server answers SGLang's return_sampling_mask


@pytest.mark.parametrize("engine,actor", [
    (HF, {"tp": 2, "recompute_old_logprob": True}),  # old-policy and reference forwards, then the update
    (HF, {"cp": 2, "pack_sequences": True}),         # on-policy update; the reference forward kept on the ranks
    (SGLANG, {"tp": 2}),
], ids=["hf-tp2", "hf-cp2-packed", "sglang-tp2"])
def test_rollout_and_trainer_log_probs_agree_over_supports(tmp_path, engine, actor):
    run_dir = str(tmp_path)
    Trainer(small_config(run_dir, actor=actor, rollout={**engine, "top_k": 5, "top_p": 0.9},
                         algorithm={"logprob_support": "sampled", "entropy_coeff": 0.01})).fit()
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2]
    first = m[0]
    assert first["actor/grad_norm"] > 1e-3 and abs(first["actor/pg_loss"]) > 1e-6
    for step in m:  # engine vs trainer, same tokens and weights, both over each token's support
        assert step["rollout/logprob_abs_diff"] < 1e-5 and step["rollout/logprob_abs_diff_max"] < 1e-5, step["step"]
    assert abs(first["actor/ppo_kl"]) < 1e-6 and first["actor/pg_clipfrac"] == 0.0
    assert abs(first["actor/kl_loss"]) < 1e-6  # the reference forward renormalises over the same supports
    # the trainer's entropy is over supports of at most 5 tokens (the whole 16-token vocabulary: ~2.7)
    assert all(0.0 < x["actor/entropy"] < math.log(5) for x in m)
