"""mgrpo/rollout/categorical.py: the engine's sampler draws from exactly the distribution it is given.

The reference is the distribution itself: counts over many seeded draws against the exact probabilities
(Pearson's chi-square), and the inversion checked entry by entry at the ends of [0, 1)."""

import math

import pytest
import torch

from mgrpo.rollout.categorical import BLOCK, invert, sample_categorical, within


def _chi2_bound(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile at the normal quantile z (4.75: p ~ 1e-6)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def _weights() -> torch.Tensor:
    """300 entries (not a multiple of BLOCK: the padded path), a whole block of zeros, single zeros, and a
    range of weights from 1e-3 to 60 (unnormalised, as a caller may pass)."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(300, generator=g).mul_(6).sub_(3).exp_()  # e^-3 .. e^3
    w[BLOCK:2 * BLOCK] = 0.0
    w[[0, 5, 299]] = 0.0
    w[7] = 60.0
    w[2 * BLOCK + 3] = 1e-3
    return w


def _one_block() -> torch.Tensor:
    """20 entries (one block: the path without padding that the tiny job's 16-token vocabulary takes), zeros
    among them and at both ends."""
    w = _weights()[:20].clone()
    w[19] = 0.0
    return w


@pytest.mark.parametrize("weights", [_weights, _one_block])
def test_draws_follow_the_exact_distribution_and_never_a_zero_weight(weights):
    w = weights()
    size = w.numel()
    rows, calls = 4000, 50
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(size, dtype=torch.float64)
    for _ in range(calls):
        got = sample_categorical(w.expand(rows, -1), generator=g)
        assert got.shape == (rows, 1) and got.dtype == torch.int64
        counts += torch.bincount(got.view(-1), minlength=size).double()
    assert counts.numel() == size  # nothing drawn past the vocabulary (padding)
    n = rows * calls
    assert counts[w == 0].sum() == 0  # no zero weight drawn, padding included (bincount would show 300+)
    assert counts.sum() == n
    expected = w.double() / w.double().sum() * n
    keep = expected > 5  # Pearson's statistic needs enough expected counts per cell
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    assert stat < _chi2_bound(df), (stat, df)
    # the statistic is not trivially small either: draws that copied the expectation would be a defect too
    assert stat > df / 4, (stat, df)


@pytest.mark.parametrize("weights", [_weights, _one_block])
def test_a_wrong_distribution_fails_the_same_check(weights):
    """The chi-square check above has power: draws from a slightly different distribution (one entry of
    probability ~0.06, or ~0.4 in one block, weighted 20% more) fail it."""
    w = weights()
    shifted = w.clone()
    shifted[7] *= 1.2
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(w.numel(), dtype=torch.float64)
    for _ in range(50):
        counts += torch.bincount(sample_categorical(shifted.expand(4000, -1), generator=g).view(-1),
                                 minlength=w.numel()).double()
    expected = w.double() / w.double().sum() * counts.sum()
    keep = expected > 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert stat > _chi2_bound(int(keep.sum()) - 1)


def test_the_ends_of_the_unit_interval_give_the_first_and_last_entry_with_weight():
    """u = 0 is the first entry with weight, u just below 1 the last one; u = 1 itself (past the contract,
    what float64 rounding of u * total or of the partial sums may reach) is clamped to the last entry with
    weight, never past it to a zero or to padding."""
    w = torch.zeros(2, 3 * BLOCK)
    w[:, [BLOCK + 2, BLOCK + 9]] = torch.tensor([0.25, 0.75])
    w[1, 2 * BLOCK + 5] = 0.5
    blocks = w.view(2, 3, BLOCK)
    sums = blocks.sum(-1, dtype=torch.float64)
    cum = sums.cumsum(-1)

    def at(u: float) -> list[int]:
        return invert(blocks, torch.full((2, 1), u, dtype=torch.float64), sums, cum).view(-1).tolist()

    assert at(0.0) == [BLOCK + 2, BLOCK + 2]
    assert at(math.nextafter(1.0, 0.0)) == [BLOCK + 9, 2 * BLOCK + 5]
    assert at(1.0) == [BLOCK + 9, 2 * BLOCK + 5]
    assert at(0.2) == [BLOCK + 2, BLOCK + 9]  # row 1: 0.2 * 1.5 = 0.3, past the first 0.25
    assert at(0.7) == [BLOCK + 9, 2 * BLOCK + 5]  # row 1: 1.05 > 1.0


def test_within_one_block_the_ends_give_the_first_and_last_entry_with_weight():
    w = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.5, 0.0, 0.0, 0.0, 1.0]])
    total = w.sum(-1, keepdim=True).double()

    def at(u: float) -> list[int]:
        return within(w, torch.full((2, 1), u, dtype=torch.float64) * total).view(-1).tolist()

    assert at(0.0) == [1, 0]
    assert at(math.nextafter(1.0, 0.0)) == [3, 4]
    assert at(1.0) == [3, 4]  # rounded up to the total: the last entry with weight, not the zero after it
    assert at(0.3) == [3, 0]  # row 0: 0.3 is past the first 0.25; row 1: 0.3 * 1.5 = 0.45 is inside the first 0.5

    """At Qwen3's vocabulary (1,187 blocks, no padding) a peaked row's top tokens come out at their
    probabilities, within 5 standard errors."""
    v = 151_936
    logits = torch.full((v,), -2.0)
    logits[[17, 100_000, v - 1]] = torch.tensor([9.0, 8.0, 7.5])
    p = torch.softmax(logits, -1)
    g = torch.Generator().manual_seed(2)
    draws = torch.cat([sample_categorical(p.expand(64, -1), generator=g).view(-1) for _ in range(100)])
    n = draws.numel()
    for tok in (17, 100_000, v - 1):
        got, want = float((draws == tok).double().mean()), float(p[tok])
        assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / n), (tok, got, want)


def test_same_generator_seed_same_draws():
    p = torch.softmax(torch.randn(8, 1000, generator=torch.Generator().manual_seed(3)), -1)
    a = sample_categorical(p, generator=torch.Generator().manual_seed(4))
    b = sample_categorical(p, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


@pytest.mark.parametrize("vocab", [500, 16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_a_row_that_is_no_distribution_raises(bad, vocab):
    p = torch.softmax(torch.randn(3, vocab), -1)
    p[1] = 0.0
    p[1, 4] = bad
    with pytest.raises(ValueError, match="not a distribution"):
        sample_categorical(p)
