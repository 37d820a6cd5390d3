"""Advantages, KL estimators, policy losses and aggregation against small hand-computed examples."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mgrpo.algorithms.advantages import compute_advantages, scores_to_token_rewards
from mgrpo.algorithms.aggregation import effective_loss_agg_mode, global_counts, metric_weights, token_weights
from mgrpo.algorithms.kl import apply_kl_in_reward, kl_estimate
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn, policy_loss
from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES
from mgrpo.config import AlgorithmConfig, ConfigError, MGRPOConfig
from mgrpo.preflight import preflight

L = math.log


@pytest.mark.parametrize("registry, field", [
    (ADVANTAGE_ESTIMATORS, "adv_estimator"), (POLICY_LOSSES, "policy_loss"), (KL_ESTIMATORS, "kl_loss_type"),
    (KL_ESTIMATORS, "kl_penalty"), (AGGREGATION_MODES, "loss_agg_mode"),
])
def test_registries_are_what_config_validation_accepts(registry, field):
    """One list per choice: every registered name has its function and validates; any other name is
    refused with exactly the registry's names."""
    assert len(registry) >= 2
    for name in registry:
        assert callable(registry[name].load()), name
        if field == "adv_estimator" and name == "none":  # pure distillation: valid, and it asks for its teacher
            with pytest.raises(ConfigError, match="teacher.hf_path"):
                preflight(MGRPOConfig(algorithm=AlgorithmConfig(**{field: name})), check_memory=False)
            continue
        preflight(MGRPOConfig(algorithm=AlgorithmConfig(**{field: name})), check_memory=False)
    with pytest.raises(ConfigError) as info:
        preflight(MGRPOConfig(algorithm=AlgorithmConfig(**{field: "nope"})), check_memory=False)
    assert f"algorithm.{field}='nope' is not one of {list(registry)}" in str(info.value)


# --- KL ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("array", [torch.tensor, lambda x: np.array(x, dtype=np.float32)], ids=["torch", "numpy"])
def test_kl_estimators_by_hand(array):
    # One definition serves the rank's loss (torch tensors) and the driver's KL-in-reward (numpy arrays).
    # pi = 0.5, pi_ref = 0.25 on the sampled token: r = log(pi_ref/pi) = -log 2
    lp, ref = array([L(0.5)]), array([L(0.25)])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(L(2))               # -r
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * L(2) ** 2)    # r^2/2 = 0.240227
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 + L(2) - 1)     # e^r - r - 1 = 0.193147
    assert kl_estimate(lp, ref, "low_var_kl").item() == pytest.approx(0.5 + L(2) - 1)
    # Far off-policy: r = -30. The raw k3 would be e^-30 + 30 - 1 = 29; like veRL, r is clamped to -20
    # (-> 19) and the estimate to 10, for k3 and its alias low_var_kl alike.
    lp, ref = array([0.0]), array([-30.0])
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(10.0)
    assert kl_estimate(lp, ref, "low_var_kl").item() == pytest.approx(10.0)
    # r = -12: 11 > 10 is clamped too; r = -5: 4 + e^-5 is not
    assert kl_estimate(array([0.0]), array([-12.0]), "k3").item() == pytest.approx(10.0)
    assert kl_estimate(array([0.0]), array([-5.0]), "k3").item() == pytest.approx(4 + math.exp(-5))
    # r = +25: exp(25) would dominate everything; low_var_kl caps at 10
    assert kl_estimate(array([-25.0]), array([0.0]), "low_var_kl").item() == pytest.approx(10.0)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_estimate(lp, ref, "k9")


def test_kl_in_reward():
    # k1 per token = logprob - ref = [1, 0, 5]; the third token is padding and must stay untouched
    r = apply_kl_in_reward(np.array([[0.0, 1.0, 7.0]]), np.array([[-1.0, -1.0, 0.0]]),
                           np.array([[-2.0, -1.0, -5.0]]), np.array([[1, 1, 0]]), 0.1, "k1")
    assert r.dtype == np.float32 and np.allclose(r, [[-0.1, 1.0, 7.0]])


# --- advantages ----------------------------------------------------------------------------------

# Two prompts x 3 responses. Group A scores [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3],
# unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 0.57735. Group B [0.5, 0.5, 0.5]: no signal.
SCORES = np.array([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
GROUPS = np.array([0, 0, 0, 1, 1, 1])
LENGTHS = [2, 1, 1, 1, 1, 2]
MASK = np.array([[1 if t < n else 0 for t in range(3)] for n in LENGTHS])


def _per_seq(adv: np.ndarray) -> list[float]:
    """One value per response (all its tokens must agree), checking padding is zero."""
    assert adv.dtype == np.float32 and np.all(adv[MASK == 0] == 0)
    out = []
    for i, n in enumerate(LENGTHS):
        assert np.allclose(adv[i, :n], adv[i, 0])
        out.append(adv[i, 0].item())
    return out


def _adv(name, **kw):
    return compute_advantages(SCORES, GROUPS, MASK, AlgorithmConfig(adv_estimator=name, **kw))


def test_grpo_by_hand():
    std = math.sqrt(1 / 3)
    assert _per_seq(_adv("grpo")) == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0, 0, 0],
                                                   abs=1e-5)  # [1.1547, -0.5774, -0.5774, 0, 0, 0]
    assert _per_seq(_adv("grpo", norm_adv_by_std_in_grpo=False)) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_dr_grpo_by_hand():
    assert _per_seq(_adv("dr_grpo")) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_rloo_by_hand():
    # s_i minus the mean of the OTHER responses: 1 - 0 = 1, 0 - (1 + 0)/2 = -0.5
    assert _per_seq(_adv("rloo")) == pytest.approx([1.0, -0.5, -0.5, 0, 0, 0])


def test_reinforce_plus_plus_baseline_by_hand():
    # After the group baseline, tokens are [2/3, 2/3, -1/3, -1/3, 0, 0, 0, 0] (8 tokens, lengths 2,1,1,1,1,2).
    # Mean 1/12; deviations 7/12 (x2), -5/12 (x2), -1/12 (x4); unbiased var = (98+50+4)/144 / 7.
    std = math.sqrt(152 / 144 / 7)
    want = [(7 / 12) / std, (-5 / 12) / std, (-5 / 12) / std, (-1 / 12) / std, (-1 / 12) / std, (-1 / 12) / std]
    assert _per_seq(_adv("reinforce_plus_plus_baseline")) == pytest.approx(want, abs=1e-5)


def test_reinforce_plus_plus_by_hand():
    # Token rewards (score on the last token, KL penalties elsewhere):
    #   row 0 [0, -0.5, 1] -> returns-to-go [0.5, 0.5, 1.0];  row 1 [-0.25, 1, pad] -> [0.75, 1.0]
    # 5 tokens: mean 0.75, deviations [-.25, -.25, .25, 0, .25], unbiased var 0.25/4, std 0.25
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    rewards = np.array([[0.0, -0.5, 1.0], [-0.25, 1.0, 0.0]])
    adv = compute_advantages(np.zeros(2), np.array([0, 1]), mask,
                             AlgorithmConfig(adv_estimator="reinforce_plus_plus"), token_rewards=rewards)
    assert np.allclose(adv, np.array([[-1.0, -1.0, 1.0], [0.0, 1.0, 0.0]]), atol=1e-5)
    # Without KL terms it is the batch-whitened score on every token.
    a2 = compute_advantages(np.array([1.0, 0.0]), np.array([0, 1]), mask,
                            AlgorithmConfig(adv_estimator="reinforce_plus_plus"))
    # tokens [1, 1, 1, 0, 0]: mean 0.6, var = (3*.16 + 2*.36)/4 = 0.3
    assert np.allclose(a2[0], 0.4 / math.sqrt(0.3), atol=1e-5)
    assert np.allclose(a2[1, :2], -0.6 / math.sqrt(0.3), atol=1e-5)


def test_token_rewards_feed_outcome_estimators_and_last_token_placement():
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    r = scores_to_token_rewards(np.array([2.0, 3.0, 4.0]), mask)
    assert r.tolist() == [[0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]]
    # grpo on token rewards uses their per-response sum: [1.9, 3.0] -> dr_grpo [-0.55, 0.55]
    tr = np.array([[0.0, -0.1, 2.0, 9.0], [3.0, 0, 0, 0], [0, 0, 0, 0]])
    adv = compute_advantages(np.zeros(3), np.array([0, 0, 1]), mask,
                             AlgorithmConfig(adv_estimator="dr_grpo"), token_rewards=tr)
    assert adv[0, 1].item() == pytest.approx(-0.55) and adv[1, 0].item() == pytest.approx(0.55)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="adv_estimator='ppo'"):
        compute_advantages(SCORES, GROUPS, MASK, AlgorithmConfig(adv_estimator="ppo"))


# --- aggregation ---------------------------------------------------------------------------------

def test_aggregation_modes_by_hand():
    # Per-token losses of 3 responses (L_max = 4); the third is fully masked and must not count.
    loss = np.array([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0] * 4])
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    tok, seq = global_counts(mask)
    assert (tok, seq) == (4, 2)
    want = {
        "token-mean": (1 + 2 + 3 + 4) / 4,                  # 2.5
        "seq-mean-token-sum": (6 + 4) / 2,                  # 5
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,         # 3
        "seq-mean-token-sum-norm": (6 + 4) / (2 * 4),       # 1.25: Dr. GRPO's constant L_max
    }
    for mode, value in want.items():
        w = token_weights(mask, mode, global_tokens=tok, global_seqs=seq, max_response_length=4)
        assert (w * loss).sum().item() == pytest.approx(value), mode
    assert metric_weights(mask, global_tokens=tok).sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="loss_agg_mode='sum'"):
        token_weights(mask, "sum", global_tokens=tok, global_seqs=seq, max_response_length=4)
    # veRL 0.9.1's GSPO aggregates with the actor's loss_agg_mode (default token-mean) like every loss.
    assert effective_loss_agg_mode(AlgorithmConfig(policy_loss="gspo")) == "token-mean"
    assert effective_loss_agg_mode(AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-sum-norm")) \
        == "seq-mean-token-sum-norm"


# --- policy losses -------------------------------------------------------------------------------

# Six tokens. pi_old = [.5 .5 .5 .5 .5 .2], pi = [.6 .25 .7 .2 .75 .8] -> ratios [1.2 .5 1.4 .4 1.5 4],
# advantages [1 1 -1 -1 1 -1], clip-higher eps_low 0.2, eps_high 0.28, dual-clip c = 3:
#   t0 r=1.2 A=+1: max(-1.2, -1.2)              = -1.2
#   t1 r=0.5 A=+1: max(-0.5, -0.8)              = -0.5   (below the range but unclipped is pessimistic)
#   t2 r=1.4 A=-1: max( 1.4,  1.28)             =  1.4
#   t3 r=0.4 A=-1: max( 0.4,  0.8)              =  0.8   clipped
#   t4 r=1.5 A=+1: max(-1.5, -1.28)             = -1.28  clipped
#   t5 r=4.0 A=-1: max( 4.0,  1.28) = 4, dual-clip min(4, 3) = 3   (lower-clipped)
# sum = 2.22 -> token-mean pg_loss 0.37, clipfrac 2/6, clipfrac_lower 1/6.
OLD = torch.tensor([L(.5), L(.5), L(.5), L(.5), L(.5), L(.2)])
NEW = torch.tensor([L(.6), L(.25), L(.7), L(.2), L(.75), L(.8)])
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
CFG = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=False,
                      entropy_coeff=0.0)  # the by-hand references have no entropy term


def _inputs(**kw) -> TokenLossInputs:
    w = torch.full((6,), 1 / 6)
    return TokenLossInputs(old_logprob=OLD, advantages=ADV, token_weight=w, metric_weight=w, **kw)


def test_vanilla_ppo_clip_dual_clip_by_hand():
    lp = NEW.clone().requires_grad_()
    loss, m = policy_loss(lp, None, _inputs(), CFG)
    assert loss.item() == pytest.approx(2.22 / 6)
    assert m["actor/pg_loss"].item() == pytest.approx(2.22 / 6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    kl = [L(.5 / .6), L(2), L(.5 / .7), L(2.5), L(.5 / .75), L(.25)]   # old - new
    assert m["actor/ppo_kl"].item() == pytest.approx(sum(kl) / 6)
    loss.backward()
    # d/dlogprob of -A*r*w is -A*r/6 where unclipped; clipped and dual-clipped tokens are constant.
    assert lp.grad.tolist() == pytest.approx([-1.2 / 6, -0.5 / 6, 1.4 / 6, 0, 0, 0])
    # without dual-clip t5 contributes 4 instead of 3
    loss2, _ = policy_loss(NEW, None, _inputs(), replace(CFG, clip_ratio_c=None))
    assert loss2.item() == pytest.approx(3.22 / 6)


def test_truncated_importance_sampling_by_hand():
    # pi_rollout: t1 0.2 -> pi_old/pi_rollout = 2.5, capped at 2; t3 0.4 -> 1.25; the rest 1.
    roll = torch.tensor([L(.5), L(.2), L(.5), L(.4), L(.5), L(.2)])
    lp = NEW.clone().requires_grad_()
    loss, m = policy_loss(lp, None, _inputs(rollout_logprob=roll), replace(CFG, tis_cap=2.0))
    # t1: -0.5 * 2 = -1.0 ; t3: 0.8 * 1.25 = 1.0 -> sum = 2.22 - 0.5 + 0.2 = 1.92
    assert loss.item() == pytest.approx(1.92 / 6)
    # ratios before the cap 1, 2.5, 1, 1.25, 1, 1: token mean 7.75/6; one of six tokens capped
    assert m["actor/tis_ratio_mean"].item() == pytest.approx(7.75 / 6)
    assert m["actor/tis_capped_frac"].item() == pytest.approx(1 / 6)
    loss.backward()
    assert lp.grad[1].item() == pytest.approx(-0.5 * 2 / 6)  # the IS weight is a constant factor


def test_kl_loss_and_entropy_bonus_by_hand():
    # ref = logprob - 0.1 everywhere -> k1 = 0.1 per token; entropies 1..6 (token mean 3.5)
    cfg = replace(CFG, use_kl_loss=True, kl_loss_type="k1", kl_coef=0.5, entropy_coeff=0.01)
    ent = torch.arange(1.0, 7.0).requires_grad_()
    lp = NEW.clone().requires_grad_()
    loss, m = policy_loss(lp, ent, _inputs(ref_logprob=NEW - 0.1), cfg)
    assert m["actor/kl_loss"].item() == pytest.approx(0.1)
    assert m["actor/entropy"].item() == pytest.approx(3.5)
    assert loss.item() == pytest.approx(2.22 / 6 + 0.5 * 0.1 - 0.01 * 3.5)
    loss.backward()
    assert ent.grad.tolist() == pytest.approx([-0.01 / 6] * 6)
    assert lp.grad[3].item() == pytest.approx(0.5 / 6)   # clipped token: only d(k1)/dlogprob * coef * w


def test_gspo_by_hand():
    # Two responses of 2 tokens, seq-mean-token-mean weights 1/(2*2) = 1/4, eps 0.05 both sides.
    #   seq 0: token ratios [1.2, 1.0] -> s0 = sqrt(1.2) = 1.0954 > 1.05, A = +1 -> clipped: -1.05 per token
    #   seq 1: token ratios [1.0, 0.9604] -> s1 = sqrt(0.9604) = 0.98 in range, A = -1 -> 0.98 per token
    # loss = 2 * (1/4) * -1.05 + 2 * (1/4) * 0.98 = -0.035
    old = torch.full((4,), L(0.5))
    lp = torch.tensor([L(0.6), L(0.5), L(0.5), L(0.5 * 0.9604)]).requires_grad_()
    w = torch.full((4,), 0.25)
    inputs = TokenLossInputs(old_logprob=old, advantages=torch.tensor([1.0, 1.0, -1.0, -1.0]), token_weight=w,
                             metric_weight=w, seq_index=torch.tensor([7, 7, 3, 3]))
    cfg = AlgorithmConfig(entropy_coeff=0.0, policy_loss="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05,
                          use_kl_loss=False)
    loss, m = policy_loss(lp, None, inputs, cfg)
    assert loss.item() == pytest.approx(-0.035)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # seq 0 is clipped (no gradient); in seq 1 each token gets -A * s1 * w = 0.98 / 4
    assert lp.grad.tolist() == pytest.approx([0, 0, 0.245, 0.245])
    with pytest.raises(ValueError, match="needs whole sequences"):
        make_token_loss_fn(inputs, cfg)


# Three responses (lengths 2, 1, 3; L_max = 4), each with equal token ratios so that its sequence ratio
# s_i is that ratio; eps 0.2 both sides:
#   A: ratios [1.1, 1.1], A=+1 -> s=1.1 in range:  -1.1 per token  (token sum -2.2, token mean -1.1)
#   B: ratio 1.5,         A=+1 -> s=1.5 clipped:   -1.2            (sum -1.2, mean -1.2)
#   C: ratios [.9 .9 .9], A=-1 -> s=0.9 in range:   0.9 per token  (sum 2.7, mean 0.9)
# plus one padding slot after B (weight 0).
GSPO_BY_MODE = {
    "token-mean": (-2.2 - 1.2 + 2.7) / 6,                 # -0.11667
    "seq-mean-token-sum": (-2.2 - 1.2 + 2.7) / 3,         # -0.23333
    "seq-mean-token-mean": (-1.1 - 1.2 + 0.9) / 3,        # -0.46667
    "seq-mean-token-sum-norm": (-2.2 - 1.2 + 2.7) / (3 * 4),  # -0.05833
}


@pytest.mark.parametrize("mode", list(GSPO_BY_MODE))
def test_gspo_honours_loss_agg_mode_by_hand(mode):
    """veRL 0.9.1's compute_policy_loss_gspo aggregates with the actor's loss_agg_mode (agg_loss), not a
    fixed seq-mean-token-mean: the weights the trainer computes for GSPO follow algorithm.loss_agg_mode."""
    cfg = AlgorithmConfig(entropy_coeff=0.0, policy_loss="gspo", clip_ratio_low=0.2, clip_ratio_high=0.2,
                          use_kl_loss=False, loss_agg_mode=mode)
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    tok, seq = global_counts(mask)
    # the driver's weights (numpy) become the rank's tensors, as a RankBatch's lists do
    w = torch.from_numpy(token_weights(mask, effective_loss_agg_mode(cfg), global_tokens=tok, global_seqs=seq,
                                       max_response_length=4))
    ratios = torch.tensor([[1.1, 1.1, 1.0], [1.5, 1.0, 1.0], [0.9, 0.9, 0.9]])
    adv = torch.tensor([[1.0] * 3, [1.0] * 3, [-1.0] * 3])
    old = torch.full((3, 3), L(0.5))
    lp = (old + ratios.log()).flatten().requires_grad_()
    inputs = TokenLossInputs(old_logprob=old.flatten(), advantages=adv.flatten(), token_weight=w.flatten(),
                             metric_weight=torch.from_numpy(metric_weights(mask, global_tokens=tok)).flatten(),
                             seq_index=torch.arange(3).repeat_interleave(3))
    loss, m = policy_loss(lp, None, inputs, cfg)
    assert loss.item() == pytest.approx(GSPO_BY_MODE[mode], abs=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1 / 6)  # B's token, a token mean in every mode
    loss.backward()
    # unclipped tokens: d/dlogprob of -A * s_it * w_t = -A * s_i * w_t; B (clipped) and padding: 0
    want = [-1.1 * w[0, 0], -1.1 * w[0, 1], 0, 0, 0, 0, 0.9 * w[2, 0], 0.9 * w[2, 1], 0.9 * w[2, 2]]
    assert lp.grad.tolist() == pytest.approx([float(x) for x in want], abs=1e-7)


def test_ppo_kl_clamps_the_log_ratio_like_verl():
    """veRL 0.9.1 reports actor/ppo_kl from the log-ratio its loss uses: vanilla clamps it to [-20, 20]
    (compute_policy_loss_vanilla), gspo does not (compute_policy_loss_gspo)."""
    old = torch.tensor([L(0.5) - 30.0, L(0.5)])
    lp = torch.tensor([L(0.5), L(0.5) - 0.5])  # log-ratios +30 and -0.5
    w = torch.full((2,), 0.5)
    inputs = TokenLossInputs(old_logprob=old, advantages=torch.tensor([1.0, -1.0]), token_weight=w, metric_weight=w,
                             seq_index=torch.tensor([0, 1]))
    _, m = policy_loss(lp, None, inputs, AlgorithmConfig(entropy_coeff=0.0, use_kl_loss=False))
    assert m["actor/ppo_kl"].item() == pytest.approx((-20.0 + 0.5) / 2)
    _, m = policy_loss(lp, None, inputs, AlgorithmConfig(entropy_coeff=0.0, policy_loss="gspo", use_kl_loss=False))
    assert m["actor/ppo_kl"].item() == pytest.approx((-30.0 + 0.5) / 2)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(clip_ratio_c=3.0, clip_ratio_high=0.28),
    dict(tis_cap=1.5),
    dict(use_kl_loss=True, kl_loss_type="low_var_kl", kl_coef=0.1, entropy_coeff=0.01),
    dict(use_kl_loss=True, kl_loss_type="k2", kl_coef=0.3, clip_ratio_c=2.0, tis_cap=1.2),
])
def test_chunked_token_loss_equals_whole_batch(variant):
    g = torch.Generator().manual_seed(0)
    T = 23
    lp = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    ent = torch.rand(T, generator=g, dtype=torch.float64)
    w = torch.rand(T, generator=g, dtype=torch.float64) * (torch.rand(T, generator=g) > 0.2)
    inputs = TokenLossInputs(
        old_logprob=lp + 0.4 * torch.randn(T, generator=g, dtype=torch.float64),
        advantages=torch.randn(T, generator=g, dtype=torch.float64),
        token_weight=w, metric_weight=(w > 0).double() / int((w > 0).sum()),
        ref_logprob=lp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64),
        rollout_logprob=lp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64))
    cfg = replace(AlgorithmConfig(entropy_coeff=0.0, use_kl_loss=False), **variant)

    a, e = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    loss_all, m_all = policy_loss(a, e, inputs, cfg)
    loss_all.backward()

    fn = make_token_loss_fn(inputs, cfg)
    for chunk in (1, 5, T):
        b, f = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        total, metrics = 0.0, {}
        for s in range(0, T, chunk):
            sl = slice(s, min(s + chunk, T))
            lc, mc = fn(b[sl], f[sl], sl)
            lc.backward()
            total += lc.item()
            for k, v in mc.items():
                metrics[k] = metrics.get(k, 0.0) + v.item()
        assert total == pytest.approx(loss_all.item(), abs=1e-12)
        assert metrics.keys() == m_all.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(m_all[k].item(), abs=1e-12), k
        assert torch.allclose(b.grad, a.grad, atol=1e-12)
        # entropy only gets a gradient through the entropy bonus
        assert (f.grad is None) == (e.grad is None) == (cfg.entropy_coeff == 0)
        assert f.grad is None or torch.allclose(f.grad, e.grad, atol=1e-12)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="ref_logprob"):
        make_token_loss_fn(_inputs(), replace(CFG, use_kl_loss=True))
    with pytest.raises(ValueError, match="rollout_logprob"):
        make_token_loss_fn(_inputs(), replace(CFG, tis_cap=2.0))


def test_tokens_out_of_the_loss_are_out_of_the_metrics():
    # Same six tokens plus two with token_weight 0 (an overlong-filtered response) whose metric
    # weight the caller filled uniformly: the metrics must not change.
    w = torch.cat([torch.full((6,), 1 / 6), torch.zeros(2)])
    inputs = TokenLossInputs(old_logprob=torch.cat([OLD, torch.tensor([0.0, 0.0])]),
                             advantages=torch.cat([ADV, torch.tensor([5.0, 5.0])]), token_weight=w,
                             metric_weight=torch.full((8,), 1 / 6))
    loss, m = policy_loss(torch.cat([NEW, torch.tensor([-3.0, -3.0])]), None, inputs, CFG)
    assert loss.item() == pytest.approx(2.22 / 6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 6)
