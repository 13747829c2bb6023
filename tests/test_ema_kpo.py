"""ema_kpo.py: the gain schedule against the paper's numbers, the filters against float64 loops and each
other, the filtered ratio and its clip against autograd and hand-made values, then the script."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch
from helpers import (
    assert_two_ranks_update_like_one,
    only_run_dir,
    precision,
    read_jsonl,
    run_script,
    two_group_rollouts,
)

from algorithms import ema_kpo
from common import flags
from common.tracking import StepMetrics

Q, V = 1e-6, 1.0


def reference_filter(z, gains):
    """The EMA of Eq. 9 written as a loop, in float64 numpy: ρ̂_t = (1 − α_t) ρ̂_t−1 + α_t z_t, ρ̂_0 = 0."""
    z = np.asarray(z, dtype=np.float64)
    out, estimate = np.empty_like(z), np.zeros(z.shape[0])
    for t, gain in enumerate(np.asarray(gains, dtype=np.float64)[: z.shape[1]]):
        estimate = (1 - gain) * estimate + gain * z[:, t]
        out[:, t] = estimate
    return out


def reference_gains(length, q=Q, v=V, p0=1.0):
    """Eqs. 4, 5, 7 in plain Python floats."""
    gains, p = [], p0
    for _ in range(length):
        k = (p + q) / (p + q + v)
        gains.append(k)
        p = (1 - k) * (p + q)
    return gains


# --- the gain schedule: the paper's numbers ------------------------------------------------------


def steady_state_gain(q, v):
    """Eq. 8."""
    p_inf = (-q + math.sqrt(q * q + 4 * v * q)) / 2
    return (p_inf + q) / (p_inf + q + v)


def test_gains_match_the_papers_numbers():
    gains = ema_kpo.kalman_gains(20_000, Q, V, p0=1.0)
    k_inf = steady_state_gain(Q, V)
    assert gains[0].item() == pytest.approx(0.5, abs=1e-6)  # "K_0 ≈ 0.5" (P0 = 1)
    assert gains[0].item() == (1 + Q) / (1 + Q + V)  # P_1|0 = P0 + Q, exactly
    assert k_inf == pytest.approx(9.995e-4, rel=1e-4)  # "K_∞ ≈ 0.001"
    assert gains[-1].item() == pytest.approx(k_inf, rel=1e-12)  # the recursion converges to Eq. 8
    assert (gains[1:] <= gains[:-1]).all()  # from above, monotonically
    within = ((gains - k_inf).abs() <= 0.01 * k_inf).tolist()
    tokens = within.index(True) + 1  # 1-based token from which K_t stays within 1% of K_∞
    assert all(within[tokens - 1 :])
    assert tokens == 2651  # "approximately 2650 tokens"
    assert abs(tokens - math.atanh(1 / 1.01) / math.sqrt(Q)) < 1  # the closed form of the Riccati recursion


def test_official_p0_approaches_the_same_gain_from_below():
    gains = ema_kpo.kalman_gains(20_000, Q, V, p0=0.0)
    assert gains[0].item() == Q / (Q + V)  # ≈ 1e-6: the first tokens are barely filtered in
    assert (gains[1:] >= gains[:-1]).all()
    assert gains[-1].item() == pytest.approx(steady_state_gain(Q, V), rel=1e-12)
    # the step response (kalman_gains' docstring): a constant z is followed to 0.5% at t = 100, 11% at t = 500 (P0 = 0)
    step = ema_kpo.ema_filter(torch.ones(1, 1000, dtype=torch.float64), gains)[0]
    assert step[99].item() == pytest.approx(0.005, abs=5e-4) and step[499].item() == pytest.approx(0.113, abs=1e-3)
    step = ema_kpo.ema_filter(torch.ones(1, 100, dtype=torch.float64), ema_kpo.kalman_gains(100))[0]
    assert step[0].item() == pytest.approx(0.5) and step[99].item() == pytest.approx(0.990, abs=1e-3)  # P0 = 1


def test_gains_match_an_independent_recursion():
    for p0 in (0.0, 1.0, 3.5):
        np.testing.assert_allclose(
            ema_kpo.kalman_gains(3000, 2e-5, 0.7, p0).numpy(), reference_gains(3000, 2e-5, 0.7, p0), rtol=1e-14
        )


def test_the_schedule_of_the_flags():
    """gain_schedule: the Kalman gains of --kalman-q, --kalman-v and --p0 (each away from its default), or --alpha
    at every position; float64 either way (the filter's own precision)."""
    args = flags.make(ema_kpo.Args, smoother="kalman", kalman_q=2e-5, kalman_v=0.7, p0=3.5)
    gains = ema_kpo.gain_schedule(args, 300)
    np.testing.assert_allclose(gains.numpy(), reference_gains(300, 2e-5, 0.7, 3.5), rtol=1e-14)
    fixed = ema_kpo.gain_schedule(flags.make(ema_kpo.Args, smoother="fixed", alpha=0.3), 5)
    assert fixed.tolist() == [0.3] * 5 and gains.dtype == fixed.dtype == torch.float64


def test_without_process_noise_the_filter_is_a_prefix_mean():
    """Q = 0, P0 = V = 1: P_t|t = 1/(t+1), K_t = 1/(t+1), so ρ̂_t = (z_1 + ... + z_t)/(t+1) (by hand)."""
    gains = ema_kpo.kalman_gains(6, q=0.0, v=1.0, p0=1.0)
    torch.testing.assert_close(
        gains, torch.tensor([1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7], dtype=torch.float64), rtol=1e-15, atol=0
    )
    z = torch.tensor([[1.0, -2.0, 4.0, 0.5, 0.0, 3.0]], dtype=torch.float64)
    expected = z.cumsum(1) / torch.arange(2, 8, dtype=torch.float64)
    torch.testing.assert_close(ema_kpo.ema_filter(z, gains), expected, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ema_kpo.kalman_filter(z, 0.0, 1.0, 1.0), expected, rtol=1e-14, atol=1e-15)


# --- the filters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p0", [1.0, 0.0])
def test_kalman_filter_equals_the_scheduled_ema(p0):
    """The paper's claim (Sec. 3.3): Kalman filter (Eqs. 4-7) = EMA with α_t = K_t (Eq. 9), MSE < 1e-14."""
    generator = torch.Generator().manual_seed(0)
    z = (0.02 * torch.randn(6, 3000, generator=generator, dtype=torch.float64)).clamp(-5, 5)
    z[:, ::97] += 2.0  # a few large outliers
    kalman = ema_kpo.kalman_filter(z, Q, V, p0)
    ema = ema_kpo.ema_filter(z, ema_kpo.kalman_gains(3000, Q, V, p0))
    assert ((kalman - ema) ** 2).mean().item() < 1e-14
    np.testing.assert_allclose(kalman.numpy(), reference_filter(z, reference_gains(3000, p0=p0)), rtol=1e-9, atol=1e-15)
    assert kalman.abs().max() > 1e-3  # not trivially zero
    assert ema_kpo.kalman_filter(z[:, :50].float(), Q, V, p0).dtype == torch.float32  # float64 inside, z's out


@pytest.mark.parametrize("schedule", ["kalman_p0=1", "kalman_p0=0", "fixed_0.1", "fixed_0.01", "fixed_1e-4"])
def test_vectorized_filter_matches_a_float64_loop_at_8192_tokens(schedule):
    length = 8192
    if schedule.startswith("kalman"):
        gains = ema_kpo.kalman_gains(length, Q, V, p0=float(schedule[-1]))
    else:
        gains = torch.full((length,), float(schedule.split("_")[1]), dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    z = 0.3 * torch.randn(4, length, generator=generator)  # float32, as in training
    reference = reference_filter(z.double().numpy(), gains.numpy())
    filtered = ema_kpo.ema_filter(z, gains)
    assert filtered.dtype == torch.float32 and torch.isfinite(filtered).all()
    error = np.abs(filtered.double().numpy() - reference).max() / np.abs(reference).max()
    assert error < 1e-6, error
    # float64 in, float64 out: only rounding is left
    error = np.abs(ema_kpo.ema_filter(z.double(), gains).numpy() - reference).max() / np.abs(reference).max()
    assert error < 1e-12, error


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_vectorized_filter_any_length_and_block(length, block):
    generator = torch.Generator().manual_seed(length)
    z = torch.randn(3, length, generator=generator, dtype=torch.float64)
    gains = torch.rand(length + 3, generator=generator, dtype=torch.float64) * 0.9  # varying gains in [0, 0.9)
    np.testing.assert_allclose(
        ema_kpo.ema_filter(z, gains, block=block).numpy(), reference_filter(z, gains.numpy()), rtol=1e-10, atol=1e-13
    )


def test_filter_is_causal_and_trailing_pads_change_nothing():
    gains = ema_kpo.kalman_gains(300)
    generator = torch.Generator().manual_seed(2)
    z = torch.randn(2, 300, generator=generator)
    for smooth in (lambda x: ema_kpo.ema_filter(x, gains), lambda x: ema_kpo.kalman_filter(x, Q, V, 1.0)):
        changed = z.clone()
        changed[:, 150] += 5.0
        before, after = smooth(z), smooth(changed)
        assert torch.equal(before[:, :150], after[:, :150]) and not torch.equal(before[:, 150:], after[:, 150:])
        short = z[:1, :77]
        padded = torch.cat([short, torch.zeros(1, 223)], 1)  # a response of 77 tokens in a batch of width 300
        torch.testing.assert_close(smooth(padded)[:, :77], smooth(short), rtol=1e-6, atol=1e-7)


def test_too_few_gains_is_an_error():
    with pytest.raises(ValueError, match="10 gains for 11 tokens"):
        ema_kpo.ema_filter(torch.zeros(1, 11), torch.full((10,), 0.1, dtype=torch.float64))


# --- the filtered ratio and the clip ------------------------------------------------------------


def test_filtered_ratio_value_and_gradient_by_brute_force():
    """r̃ = exp(log π − sg(log π) + sg(ρ̂)): value exp(ρ̂), gradient exp(ρ̂)·∇log π, even when ρ̂ itself
    was computed from log π with its graph attached."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 4, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 5), generator=generator)
    coefficients = torch.randn(2, 5, generator=generator, dtype=torch.float64)

    def logprobs_of(w):
        return torch.log_softmax(hidden @ w, -1).gather(-1, tokens[..., None]).squeeze(-1)

    logprobs = logprobs_of(weight)
    old = logprobs.detach() + 0.1 * torch.randn(2, 5, generator=generator, dtype=torch.float64)
    rho_hat = ema_kpo.ema_filter(logprobs - old, ema_kpo.kalman_gains(5))  # not detached on purpose
    assert rho_hat.requires_grad
    ratio = ema_kpo.filtered_ratio(logprobs, rho_hat)
    assert torch.equal(ratio.detach(), torch.exp(rho_hat.detach()))  # the value: exp(ρ̂), bit for bit
    (gradient,) = torch.autograd.grad((coefficients * ratio).sum(), weight)

    expected = torch.zeros_like(weight)  # Σ_t c_t exp(ρ̂_t) ∇log π_t, one token at a time
    for b in range(2):
        for t in range(5):
            (token_gradient,) = torch.autograd.grad(logprobs_of(weight)[b, t], weight)
            expected += coefficients[b, t] * torch.exp(rho_hat[b, t].detach()) * token_gradient
    torch.testing.assert_close(gradient, expected, rtol=1e-12, atol=1e-14)
    # and not the plain policy gradient Σ_t c_t ∇log π_t (ρ̂ is far enough from 0 to tell them apart)
    assert not torch.allclose(gradient, torch.autograd.grad((coefficients * logprobs_of(weight)).sum(), weight)[0])


def test_filtered_ratio_is_clamped_like_the_official_code():
    logprobs = torch.tensor([-1.0, -1.0], requires_grad=True)
    ratio = ema_kpo.filtered_ratio(logprobs, torch.tensor([12.0, 9.0]))
    assert ratio[0].item() == pytest.approx(math.exp(10)) and ratio[1].item() == pytest.approx(math.exp(9))
    ratio.sum().backward()
    assert logprobs.grad[0].item() == 0 and logprobs.grad[1].item() == pytest.approx(math.exp(9))


EPS_LOW, EPS_HIGH = 3e-4, 4e-4
ABOVE = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)).item()
BELOW = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)).item()


@pytest.mark.parametrize(
    "ratio, advantage, active",
    [
        (1 + EPS_HIGH, 1.0, False),  # exactly at the upper bound: not clipped
        (ABOVE(1 + EPS_HIGH), 1.0, True),  # one float above it, A > 0: clipped
        (ABOVE(1 + EPS_HIGH), -1.0, False),  # above it with A < 0: the pessimistic min keeps r̃A
        (1 - EPS_LOW, -1.0, False),  # exactly at the lower bound: not clipped
        (BELOW(1 - EPS_LOW), -1.0, True),  # one float below it, A < 0: clipped
        (BELOW(1 - EPS_LOW), 1.0, False),  # below it with A > 0: unclipped
        (1 + 3.5e-4, 1.0, False),  # asymmetric: 3.5e-4 above 1 is inside (ε+ = 4e-4) ...
        (1 - 3.5e-4, -1.0, True),  # ... 3.5e-4 below 1 is outside (ε− = 3e-4)
        (1.0, 0.5, False),
        (BELOW(1 - EPS_LOW), 0.5, False),  # a small A > 0 below the range: unclipped
        (BELOW(1 - EPS_LOW), 0.0, False),  # A = 0 outside the range on either side: nothing clipped (clip_fraction)
        (ABOVE(1 + EPS_HIGH), 0.0, False),
    ],
)
def test_clip_acts_exactly_at_the_asymmetric_bounds(ratio, advantage, active):
    ratio_in = torch.tensor([[ratio]], dtype=torch.float64, requires_grad=True)
    loss, clip_active = ema_kpo.clipped_surrogate_loss(
        ratio_in, torch.tensor([advantage], dtype=torch.float64), EPS_LOW, EPS_HIGH
    )
    loss.sum().backward()
    bounded = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
    assert loss.item() == -min(ratio * advantage, bounded * advantage)
    assert clip_active.item() is active
    assert ratio_in.grad.item() == (0.0 if active else -advantage)  # d loss / d r̃


@pytest.mark.parametrize(
    "rho_hat, advantage, active",
    [
        (math.log1p(EPS_HIGH) - 1e-9, 1.0, False),
        (math.log1p(EPS_HIGH) + 1e-9, 1.0, True),
        (math.log1p(-EPS_LOW) + 1e-9, -1.0, False),
        (math.log1p(-EPS_LOW) - 1e-9, -1.0, True),
        (math.log1p(EPS_HIGH) + 1e-3, -2.0, False),
        (math.log1p(-EPS_LOW) - 1e-3, 3.0, False),
        (0.0, -1.0, False),
    ],
)
def test_surrogate_gradient_through_the_filtered_ratio(rho_hat, advantage, active):
    """d loss / d log π = −A exp(ρ̂) where the clip is inactive, 0 where it is active."""
    logprobs = torch.tensor([[-2.3]], dtype=torch.float64, requires_grad=True)
    ratio = ema_kpo.filtered_ratio(logprobs, torch.tensor([[rho_hat]], dtype=torch.float64))
    loss, clip_active = ema_kpo.clipped_surrogate_loss(
        ratio, torch.tensor([advantage], dtype=torch.float64), EPS_LOW, EPS_HIGH
    )
    loss.sum().backward()
    assert clip_active.item() is active
    expected = 0.0 if active else -advantage * math.exp(rho_hat)
    assert logprobs.grad.item() == pytest.approx(expected, rel=1e-12, abs=0)


# --- the whole loss through padding and micro-batches vs. brute force ------------------------


@pytest.mark.parametrize(
    "smoother, aggregation",
    [("ema", "sequence-mean"), ("ema", "token-mean"), ("kalman", "sequence-mean"), ("fixed", "sequence-mean")],
)
def test_loss_gradient_matches_brute_force(tiny, smoother, aggregation):
    """update_policy's per-micro-batch lines (left/right padding, trimmed micro-batches, the filter on
    each, accumulation) against the objective written out per sequence, without padding."""
    model, tokenizer = tiny
    model = type(model)(model.config)
    model.load_state_dict(tiny[0].state_dict())
    prompts, completions = two_group_rollouts(tokenizer, ("3$", "12", "4$", "3961", "96$", "9", "91$", "906$"))
    group = 4
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch = ema_kpo.make_batch(prompts, completions, group, tokenizer.pad_token_id, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        current = torch.cat(
            [ema_kpo.token_logprobs(model, m, 1.0)[0] for m in ema_kpo.micro_batches(batch, torch.arange(8), 8)]
        )
    # old log-probs: current ones shifted by about the clip range, so that some tokens are clipped
    batch["old_logprobs"] = current + 1e-3 * torch.randn(current.shape, generator=generator)
    batch["advantages"] = advantages
    tokens, sequences = batch["response_mask"].sum(), 8
    args = flags.make(ema_kpo.Args, smoother=smoother, alpha=0.3 if smoother == "fixed" else None)
    gains = ema_kpo.gain_schedule(args, 16)

    model.zero_grad()
    clipped_tokens = 0
    for micro in ema_kpo.micro_batches(batch, torch.tensor([5, 0, 3, 7, 1, 2, 6, 4]), 3):
        logprobs, _ = ema_kpo.token_logprobs(model, micro, temperature=1.0)
        mask = micro["response_mask"]
        z = (logprobs - micro["old_logprobs"]).detach() * mask
        if smoother == "kalman":  # update_policy's choice of filter
            rho_hat = ema_kpo.kalman_filter(z, args.kalman_q, args.kalman_v, args.p0)
        else:
            rho_hat = ema_kpo.ema_filter(z, gains)
        ratio = ema_kpo.filtered_ratio(logprobs, rho_hat)
        token_losses, clip_active = ema_kpo.clipped_surrogate_loss(ratio, micro["advantages"], EPS_LOW, EPS_HIGH)
        clipped_tokens += (clip_active.float() * mask).sum().item()
        ema_kpo.aggregate(token_losses, mask, aggregation, {"tokens": tokens, "sequences": sequences}).backward()
    script_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert 0 < clipped_tokens < tokens  # the example exercises both branches of the min

    model.zero_grad()
    objective = 0.0
    for i, completion in enumerate(completions):
        prompt, response = prompts[i // group], completion.token_ids
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        z = (logprobs.detach() - batch["old_logprobs"][i, : len(response)]).double()
        alphas = [0.3] * len(response) if smoother == "fixed" else reference_gains(len(response))
        rho_hat = torch.tensor(reference_filter(z[None], alphas)[0], dtype=torch.float32)
        ratio = torch.exp(logprobs - logprobs.detach() + rho_hat)
        surrogate = torch.minimum(ratio * advantages[i], ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantages[i])
        objective = objective + (
            surrogate.sum() / tokens if aggregation == "token-mean" else surrogate.mean() / sequences
        )
    (-objective).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(script_grads[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def _brute_force_objective(model, prompts, completions, group, advantages, old_logprobs, alphas, aggregation):
    """The EMA-KPO objective of one batch, sequence by sequence, without padding (float64 filter loop). A tool's
    output inside a response (Completion.tool_mask 1) is context: the filter runs along the policy's tokens alone."""
    policy_tokens = [torch.tensor([not t for t in (c.tool_mask or [0] * len(c.token_ids))]) for c in completions]
    tokens = sum(int(own.sum()) for own in policy_tokens)
    objective = 0.0
    for i, completion in enumerate(completions):
        prompt, response, own = prompts[i // group], completion.token_ids, policy_tokens[i]
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)[own]
        z = (logprobs.detach() - old_logprobs[i][own]).double()
        rho_hat = torch.tensor(reference_filter(z[None], alphas[: len(z)])[0], dtype=torch.float32)
        ratio = torch.exp(logprobs - logprobs.detach() + rho_hat)
        surrogate = torch.minimum(ratio * advantages[i], ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantages[i])
        objective = objective + (
            surrogate.sum() / tokens if aggregation == "token-mean" else surrogate.mean() / len(completions)
        )
    return objective


@pytest.mark.parametrize(
    "smoother, aggregation, tool",
    [("ema", "sequence-mean", False), ("kalman", "token-mean", False), ("fixed", "sequence-mean", False)]
    + [("ema", "token-mean", True)],
)
def test_update_policy_matches_two_epochs_of_sgd_by_hand(tiny, smoother, aggregation, tool):
    """update_policy as main calls it (old log-probs, minibatch loop, filter, loss, optimizer), with two
    epochs of SGD: the first on-policy (r̃ = 1), the second with π_θ ≠ π_old, so the filter and the clip
    act. The reference recomputes everything per sequence and steps SGD by hand. (The scheduled EMA and the
    Kalman filter are one function; the fixed gain is another, and update_policy must pick it.) `tool`: a
    tool's output after each response's first token, which the filter skips as if absent."""
    from common.engines import Completion

    model, tokenizer = tiny
    policy = type(model)(model.config)
    policy.load_state_dict(model.state_dict())
    prompts, completions = two_group_rollouts(tokenizer, ("3$", "12", "4$", "3961", "96$", "9", "91$", "906$"))
    if tool:
        output = tokenizer("<r>7</r>", add_special_tokens=False)["input_ids"]
        completions = [
            Completion(c.token_ids[:1] + output + c.token_ids[1:], [-1.0] * (len(c.token_ids) + len(output)),
                       c.finish_reason, tool_mask=[0] + [1] * len(output) + [0] * (len(c.token_ids) - 1))
            for c in completions
        ]  # fmt: skip
    group, lr = 4, 0.05
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch = ema_kpo.make_batch(prompts, completions, group, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = advantages
    args = flags.make(
        ema_kpo.Args,
        smoother=smoother,
        alpha=0.3 if smoother == "fixed" else None,
        loss_aggregation=aggregation,
        num_minibatches=1,
        update_epochs=2,
        micro_batch_size=3,
        max_grad_norm=1e9,
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    dist, metrics = ema_kpo.fsdp.setup(), StepMetrics()
    skipped = ema_kpo.update_policy(policy, None, optimizer, scheduler, batch, args, dist, precision(), metrics)
    logged = metrics.reduce()
    assert skipped == 0 and metrics.means["losses/policy_loss"][1] == 2  # two optimizer steps, none skipped
    assert (
        0 < logged["losses/clip_fraction"] < 1
        and 0 < logged["losses/rho_hat_abs_mean"] <= logged["losses/rho_hat_abs_max"]
    )

    reference = type(model)(model.config)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():  # π_old: the policy before the first update
        old = [
            torch.log_softmax(
                reference(input_ids=torch.tensor([prompts[i // group] + c.token_ids])).logits[
                    0, len(prompts[i // group]) - 1 : -1
                ],
                -1,
            )
            .gather(-1, torch.tensor(c.token_ids)[:, None])
            .squeeze(-1)
            for i, c in enumerate(completions)
        ]
    gains = [0.3] * 16 if smoother == "fixed" else reference_gains(16)
    for _ in range(2):
        reference.zero_grad()
        (
            -_brute_force_objective(reference, prompts, completions, group, advantages, old, gains, aggregation)
        ).backward()
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter -= lr * parameter.grad
    for (name, trained), expected in zip(policy.named_parameters(), reference.parameters()):
        assert not torch.equal(trained, model.state_dict()[name])
        torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-6, msg=name)


# --- flags ---------------------------------------------------------------------------------------


def test_good_flags_pass():
    for changes in ({}, {"smoother": "kalman", "p0": 0.0}, {"smoother": "fixed", "alpha": 1e-4}):
        ema_kpo.check_args(dataclasses.replace(ema_kpo.Args(), **changes))  # bad ones: tests/test_bad_input.py


def test_defaults_are_the_papers():
    args = ema_kpo.Args()
    assert (args.smoother, args.kalman_q, args.kalman_v, args.p0) == ("ema", 1e-6, 1.0, 1.0)
    assert (args.clip_low, args.clip_high, args.loss_aggregation) == (3e-4, 4e-4, "sequence-mean")
    assert args.num_minibatches * args.update_epochs == 4  # several updates: one would leave r̃ ≡ 1


# --- the script ---------------------------------------------------------------------------------

# 20 prompts: the first step's ratios leave 1 only if one of the 15 groups before its last minibatch (of 4) has a
# reward spread, missing on 0.48^15 < 1e-4 of machines (helpers.py, reward signal); with 4 prompts, one group per
# minibatch, it was 0.48^3 = 11%
SMALL = ["--prompts-per-step", 20, "--group-size", 4, "--eval-every", 0]
SMOOTHERS = {"ema": [], "kalman": ["--smoother", "kalman"], "fixed": ["--smoother", "fixed", "--alpha", 0.01]}


@pytest.mark.slow
def test_the_filter_acts_end_to_end_and_kalman_equals_the_scheduled_ema(tmp_path):
    """Two steps of each smoother, same seed: with four updates per batch the filtered ratio leaves 1 and
    the clip acts; the Kalman filter trains as the scheduled EMA does, the fixed gain differs."""
    first = {}
    for name, smoother_flags in SMOOTHERS.items():
        run_script("algorithms/ema_kpo.py", "--steps", 2, "--output-dir", tmp_path / name, *SMALL, *smoother_flags)
        records = read_jsonl(os.path.join(only_run_dir(tmp_path / name), "metrics.jsonl"))
        for key in ("losses/rho_hat_abs_mean", "losses/rho_hat_abs_max"):
            assert isinstance(records[-1][key], float), key
        first[name] = record = records[0]
        # four updates per batch: π_θ moved away from π_old, so the filtered ratio is no longer 1
        assert record["losses/rho_hat_abs_max"] > 0 and record["losses/approx_kl"] > 0
        assert record["losses/ratio_min"] < 1 or record["losses/ratio_max"] > 1
        assert record["losses/rho_hat_abs_mean"] <= record["losses/rho_hat_abs_max"]
        assert math.exp(-record["losses/rho_hat_abs_max"]) == pytest.approx(
            min(record["losses/ratio_min"], 1 / record["losses/ratio_max"]), rel=1e-5
        )  # r̃ = exp(ρ̂)
        assert record["losses/clip_fraction"] > 0
    ema, kalman, fixed = first["ema"], first["kalman"], first["fixed"]
    assert ema["charts/reward"] == kalman["charts/reward"] == fixed["charts/reward"]  # same rollouts at step 1
    for key in (
        "losses/policy_loss",
        "losses/rho_hat_abs_mean",
        "losses/rho_hat_abs_max",
        "losses/clip_fraction",
        "losses/grad_norm",
    ):
        assert kalman[key] == pytest.approx(ema[key], rel=1e-4, abs=1e-9), key
    assert fixed["losses/rho_hat_abs_mean"] != pytest.approx(ema["losses/rho_hat_abs_mean"], rel=1e-2)


@pytest.mark.slow
def test_eval_and_resume(tmp_path):
    flags = [
        "--prompts-per-step",
        4,
        "--group-size",
        4,
        "--eval-every",
        2,
        "--eval-prompts",
        16,
        "--eval-k",
        2,
        "--save-every",
        1,
        "--output-dir",
        tmp_path,
    ]
    run_script("algorithms/ema_kpo.py", "--steps", 2, *flags)
    run_script("algorithms/ema_kpo.py", "--steps", 3, "--resume", "auto", *flags)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("eval/greedy_accuracy", "eval/avg@2", "eval/pass@2", "time/eval"):
        assert isinstance(records[2][key], float) and isinstance(records[3][key], float), key


# --- several ranks: one update on a fixed batch, 1 process vs 2 FSDP2 ranks ---------------------


@pytest.mark.slow
def test_two_ranks_update_exactly_like_one(tmp_path):
    """The filter is per sequence and the sequence-mean is over the responses of all ranks: 1 process and
    2 FSDP2 ranks (gloo) compute the same update from the same global batch, with the paper's clip range
    and both the filter and the clip acting (the generic check of tests/test_scripts.py, for this script)."""
    settings = {"num_minibatches": 1, "lr": 0.05, "clip_low": 3e-4, "clip_high": 4e-4, "smoother": "ema"}
    one = assert_two_ranks_update_like_one(tmp_path, "ema_kpo", json.dumps(settings))
    # the second epoch ran off-policy: the filter moved and the clip acted on some tokens, not all
    assert one["losses/rho_hat_abs_mean"] > 0 and 0 < one["losses/clip_fraction"] < 1
    assert one["skipped"] == 0
