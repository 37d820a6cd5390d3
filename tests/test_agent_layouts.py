"""Multi-turn samples through the trainer's other layouts: one step of the peek task on the tiny model, its first
call constrained (tool_choice=required: the grammar's tokens are context too), with an environment that always
replies (so every trajectory holds a context span and a turn after it), and the
engine's and the trainer's log-probs compared token by token on every sampled token, also those after a
context span. A layout that scored context tokens, or shifted the ids the engine continued from, would differ
there by far more than 1e-5 (tests/test_agent_e2e.py does TP=2 with packing).

- CP=2 with packing: each sequence is split over two ranks and gathered back in sample order;
- PP=2: two pipeline stages, the log-probs from the last one;
- logprob_support=sampled (top_k=5) at TP=2: behaviour log-probs over each sampled token's support, which
  the trajectories carry turn by turn (without them the trainer normalised over the whole vocabulary: the
  difference was 2.54 nat)."""

from __future__ import annotations

import dataclasses

import pytest

from mgrpo.config import MGRPOConfig
from mgrpo.data.printable import VOCAB
from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics, trajectories

pytestmark = pytest.mark.integration


def _config(run_dir: str, actor: dict, rollout: dict, algorithm: dict) -> MGRPOConfig:
    cfg = MGRPOConfig()
    r = cfg.rollout
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, tokenizer="printable", vocab_size=len(VOCAB), max_position_embeddings=512),
        data=dataclasses.replace(cfg.data, synthetic_task="peek", max_prompt_length=256, max_response_length=224,
                                 train_batch_size=8),
        algorithm=dataclasses.replace(cfg.algorithm, use_kl_loss=False, **algorithm),
        actor=dataclasses.replace(cfg.actor, **actor),
        rollout=dataclasses.replace(r, engine="hf", mode="hybrid", n=4, **rollout, multi_turn=dataclasses.replace(
            r.multi_turn, enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=3,
            max_tokens_per_turn=48, environment="tests.helpers.agent:AlwaysReply", tool_choice="required",
            stop_after_call=True)),
        trainer=dataclasses.replace(cfg.trainer, output_dir=run_dir, device="cpu", total_training_steps=1,
                                    logger=["tensorboard"], save_hf=False, log_token_logprobs=True),
    )


@pytest.mark.parametrize("actor,rollout,algorithm", [
    ({"cp": 2, "pack_sequences": True}, {}, {}),
    ({"pp": 2}, {}, {}),
    ({"tp": 2}, {"top_k": 5}, {"logprob_support": "sampled"}),
], ids=["cp2-packed", "pp2", "tp2-sampled-support"])
def test_multi_turn_step1_logprobs_match_in_other_layouts(tmp_path, actor, rollout, algorithm):
    Trainer(_config(str(tmp_path), actor, rollout, algorithm)).fit()
    (m,) = read_metrics(str(tmp_path))
    assert m["rollout/logprob_abs_diff_max"] <= 1e-5
    after_context = 0
    for row in trajectories(str(tmp_path)):
        mask = row["sampled_mask"]
        assert len(mask) == len(row["response_ids"]) == len(row["rollout_logprobs"]) == len(row["trainer_logprobs"])
        first_context = mask.index(0) if 0 in mask else len(mask)
        for k in range(first_context, len(mask)):
            if mask[k]:
                after_context += 1
                assert abs(row["rollout_logprobs"][k] - row["trainer_logprobs"][k]) <= 1e-5, (row["multi_turn"], k)
    assert after_context > 0 and m["multi_turn/context_tokens"] > 0
