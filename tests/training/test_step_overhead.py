"""What the per-step overhead cuts must not change.

The old-policy forward is skipped when exactly one optimizer step follows a rollout: the update then
takes pi_old from its own detached log-probs. These tests run the same updates both ways (the skip and
the forced recompute, `actor.recompute_old_logprob`) and require the same losses, metrics and gradient
norms, and the training forward's per-sample log-probs to equal what the separate forward computes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mgrpo.config import MGRPOConfig
from tests.helpers.distributed import run_ranks
from tests.helpers.convert import V, tiny_cfg

PROMPTS = [5, 3, 8, 2, 6, 4, 7, 3]
RESPONSES = [3, 17, 6, 1, 25, 9, 2, 12]
TEMPERATURE = 0.8
COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac",
            "actor/ppo_kl")


def _config(policy_loss: str = "vanilla", tis_cap=None) -> MGRPOConfig:
    """A 4-layer GQA model, fp32 on CPU, KL loss and an entropy bonus (every loss term has a gradient),
    a 64-token budget (several micro-batches of different shapes, samples reordered into them)."""
    cfg = MGRPOConfig()
    return dataclasses.replace(
        cfg, model=tiny_cfg(max_position_embeddings=128),
        algorithm=dataclasses.replace(cfg.algorithm, use_kl_loss=True, kl_coef=0.05, entropy_coeff=0.01,
                                      policy_loss=policy_loss, tis_cap=tis_cap),
        actor=dataclasses.replace(cfg.actor, max_tokens_per_gpu=64, lr=1e-2, grad_clip=1e9),
        rollout=dataclasses.replace(cfg.rollout, temperature=TEMPERATURE),
        trainer=dataclasses.replace(cfg.trainer, device="cpu"))


def _batch(vocab: int, seed: int):
    from mgrpo.training.batch import RankBatch

    g = torch.Generator().manual_seed(seed)
    total = sum(RESPONSES)
    return RankBatch(
        input_ids=[torch.randint(0, vocab, (p + r,), generator=g).tolist() for p, r in zip(PROMPTS, RESPONSES)],
        prompt_lens=list(PROMPTS), seq_index=list(range(len(PROMPTS))),
        advantages=[torch.randn(r, generator=g).tolist() for r in RESPONSES],
        # the rollout engine's log-probs, around the trainer's (~log 1/100): TIS weights capped and not
        rollout_logprobs=[(-3.5 - 2.5 * torch.rand(r, generator=g)).tolist() for r in RESPONSES],
        token_weight=[[1.0 / total] * r for r in RESPONSES], metric_weight=1.0 / total)


def _two_updates(rank, world, port, hf_dir, variants):
    """For each variant: a fresh actor from `hf_dir`, two updates on two batches, pi_old either from a
    separate forward or (old_logprobs=None) from the update's own forward."""
    from megatron.core import parallel_state as ps

    from mgrpo.training.actor import MegatronActor

    out = []
    for kw, skip in variants:
        cfg = _config(**kw)
        actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                              init_hf_dir=hf_dir, total_steps=2, need_ref=True)
        steps = []
        for step in range(2):
            batch = _batch(cfg.model.vocab_size, seed=step)
            batch.ref_logprobs = actor.compute_logprobs(batch, "ref")["logprobs"]
            before = actor.compute_logprobs(batch, "actor")
            if not skip:
                batch.old_logprobs = before["logprobs"]
            metrics = actor.train_mini_batch(batch)
            steps.append({"metrics": {k: v for k, v in metrics.items() if k != "per_sample"},
                          "per_sample": metrics.get("per_sample"), "separate_forward": before})
        out.append(steps)
        ps.destroy_model_parallel()
    return out


VARIANTS = [({"tis_cap": 1.5}, True), ({"tis_cap": 1.5}, False),        # chunked token-level loss, TIS from pi_old
            ({"policy_loss": "gspo"}, True), ({"policy_loss": "gspo"}, False)]  # sequence-level path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mgrpo.models import init_hf_checkpoint

    hf_dir = str(tmp_path_factory.mktemp("init"))
    init_hf_checkpoint(hf_dir, _config().model, seed=3)
    return run_ranks(_two_updates, 1, hf_dir, VARIANTS)[0]


@pytest.mark.integration
@pytest.mark.parametrize("pair", [0, 1], ids=["vanilla_tis", "gspo"])
def test_skipped_old_forward_gives_the_same_updates(runs, pair):
    skip, recompute = runs[2 * pair], runs[2 * pair + 1]
    for step in range(2):
        a, b = skip[step]["metrics"], recompute[step]["metrics"]
        # something to compare: a gradient, and after the first update a KL term (actor != reference)
        assert a["actor/grad_norm"] > 1e-2 and (step == 0 or abs(a["actor/kl_loss"]) > 1e-6)
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], abs=1e-6), (step, key)
        # on-policy by construction: ratio exactly 1
        assert a["actor/ppo_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0
        # the update's own forward returns what the separate forward computes, sample by sample, at the
        # weights before this step (step 1: after step 0's update, the same in both runs)
        assert recompute[step]["per_sample"] is None
        own, separate = skip[step]["per_sample"], skip[step]["separate_forward"]
        for key in ("logprobs", "entropy"):
            assert [len(x) for x in own[key]] == RESPONSES
            diff = max(abs(u - v) for x, y in zip(own[key], separate[key]) for u, v in zip(x, y))
            assert diff < 1e-5, key
        if pair == 0:  # TIS weights min(pi_old / pi_rollout, 1.5): some capped, some well below 1
            w = [min(math.exp(o - r), 1.5) for x, y in zip(separate["logprobs"], _batch(V, step).rollout_logprobs)
                 for o, r in zip(x, y)]
            assert max(w) == 1.5 and min(w) < 0.5
    # the second update saw the first one's weights
    assert skip[1]["separate_forward"]["logprobs"] != skip[0]["separate_forward"]["logprobs"]


def test_timer_other_is_the_step_outside_its_named_phases():
    import time

    from mgrpo.observe.timing import PhaseTimer

    timer = PhaseTimer()
    with timer("step"):
        with timer("gen"):
            time.sleep(0.01)
        time.sleep(0.03)  # not in any named phase
        with timer("update"):
            with timer("fwd_bwd"):  # nested deeper: part of update, not counted twice
                time.sleep(0.01)
    m = timer.metrics()
    named = m["timing_s/gen"] + m["timing_s/update"]
    assert m["timing_s/other"] == pytest.approx(m["timing_s/step"] - named, abs=1e-12)
    assert m["timing_s/other"] >= 0.03 and m["timing_s/fwd_bwd"] <= m["timing_s/update"]
    single = PhaseTimer()
    with single("reward"):
        pass
    assert set(single.metrics()) == {"timing_s/reward"}  # nothing inside: no 'other'


@pytest.mark.system
def test_training_run_with_and_without_the_old_forward(tmp_path):
    """Two steps of the default job (shortened) through the whole stack: skipping the old-policy forward
    changes no loss, metric or gradient norm; the rollout-vs-trainer check still compares the engine's
    log-probs with the trainer's (now from the update's forward) and still holds at every step."""
    from mgrpo.loop import Trainer
    from tests.helpers.runs import LOSS_KEYS, read_metrics, small_config

    runs = {}
    for name, recompute in (("skip", False), ("recompute", True)):
        Trainer(small_config(str(tmp_path / name), actor={"recompute_old_logprob": recompute})).fit()
        runs[name] = read_metrics(str(tmp_path / name))
    skip, recompute = runs["skip"], runs["recompute"]
    for step in range(2):
        a, b = skip[step], recompute[step]
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same rollouts
        for key in LOSS_KEYS + ("actor/pg_clipfrac", "actor/ppo_kl", "rollout/entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (step, key)
        assert a["rollout/logprob_abs_diff"] == pytest.approx(b["rollout/logprob_abs_diff"], abs=1e-6)
        assert 0.0 < a["rollout/logprob_abs_diff"] < 1e-4  # a real comparison, not of a thing with itself
        assert "timing_s/old_logprob" not in a and b["timing_s/old_logprob"] > 0.0
    assert skip[0]["actor/grad_norm"] > 1e-3
