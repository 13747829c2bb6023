"""grpo.py: the math against hand-computed values and brute force, then the script end to end."""

import copy
import dataclasses
import importlib
import os

import pytest
import torch
from helpers import (
    ALGORITHMS,
    assert_same_run,
    gradient_recorder,
    one_process,
    only_run_dir,
    per_sequence_logprobs,
    precision,
    read_jsonl,
    run_script,
    two_group_rollouts,
)

from algorithms import grpo
from common import flags
from common.errors import BadInput
from common.tracking import StepMetrics

ONE_PROCESS, NO_AUTOCAST = one_process(), torch.autocast("cpu", enabled=False)

# --- advantages -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS)
def test_group_normalized_advantages_by_hand(name):
    """grpo.py's advantages, and every fork's copy of them (in the rewards' dtype)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: mean 0.75, std 0.5
    std1, std2 = (1 / 3) ** 0.5, 0.5
    expected = torch.tensor(
        [
            [0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), 0.5 / (std1 + 1e-4)],
            [0.25 / (std2 + 1e-4)] * 3 + [-0.75 / (std2 + 1e-4)],
        ]
    )
    torch.testing.assert_close(algorithm.compute_advantages(rewards), expected)
    torch.testing.assert_close(
        algorithm.compute_advantages(rewards, scale=False),
        torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]),
    )


@pytest.mark.parametrize("name", ALGORITHMS)
def test_equal_rewards_give_zero_advantage(name):
    """Also fractional ones (DAPO's overlong penalty, a task file's scores): float32's mean of eight 0.8s is not
    0.8, and its std 6e-8 would turn the rounding into advantages of 6e-4."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    for value in (0.0, 1.0, 0.8, -0.6, 1 / 3):
        rewards = torch.full((3, 8), value)
        assert torch.equal(algorithm.compute_advantages(rewards), torch.zeros(3, 8)), value
        assert torch.equal(algorithm.compute_advantages(rewards, scale=False), torch.zeros(3, 8)), value


# --- clipped surrogate ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, advantage, loss, active, gradient",
    [
        # gradient = d loss / d log π = −ρA where the unclipped term is chosen, 0 where the clip is active
        (1.0, 1.0, -1.0, False, -1.0),
        (1.5, 1.0, -1.28, True, 0.0),  # above 1+ε_high with A > 0: clipped
        (1.28, 1.0, -1.28, False, -1.28),  # exactly at the boundary: not clipped
        (0.5, 1.0, -0.5, False, -0.5),  # below 1−ε_low with A > 0: the min keeps the unclipped term
        (0.5, -1.0, 0.8, True, 0.0),  # below 1−ε_low with A < 0: clipped
        (0.8, -1.0, 0.8, False, 0.8),  # exactly at the lower boundary
        (1.5, -1.0, 1.5, False, 1.5),  # above 1+ε_high with A < 0: pessimistic, unclipped
        (2.0, 0.0, 0.0, False, 0.0),  # zero advantage: no loss, no gradient, nothing clipped (clip_fraction)
        (0.5, 0.0, 0.0, False, 0.0),  # zero advantage below the range: nothing clipped either
    ],
)
@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n in ("grpo", "gtpo", "p3o", "tis_icepop")])
def test_clipped_surrogate_by_hand(name, ratio, advantage, loss, active, gradient):
    """grpo.py's clipped surrogate, and the forks' copies of it (ema_kpo.py's takes its filtered ratio)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logprobs = (old + torch.log(torch.tensor(ratio, dtype=torch.float64))).requires_grad_()
    token_loss, ratio_out, clip_active = algorithm.clipped_surrogate_loss(
        logprobs, old, torch.tensor([advantage], dtype=torch.float64), clip_low=0.2, clip_high=0.28
    )
    token_loss.sum().backward()
    assert token_loss.item() == pytest.approx(loss)
    assert ratio_out.item() == pytest.approx(ratio)
    assert clip_active.item() is active
    assert logprobs.grad.item() == pytest.approx(gradient)


def test_aggregation_token_mean_sequence_mean_and_token_sum():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # Dr. GRPO's constant: 2 completions × --max-new-tokens 16, whatever their lengths
    totals = {"tokens": 4, "sequences": 2, "token_budget": 2 * 16}
    assert grpo.aggregate(losses, mask, "token-mean", totals).item() == pytest.approx(10 / 4)
    assert grpo.aggregate(losses, mask, "sequence-mean", totals).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(losses, mask, "token-sum-norm", totals).item() == pytest.approx(10 / 32)
    # micro-batches each contribute their share; the shares add up to the minibatch's loss
    for mode in ("token-mean", "sequence-mean", "token-sum-norm"):
        parts = sum(grpo.aggregate(losses[i : i + 1], mask[i : i + 1], mode, totals) for i in range(2))
        assert parts.item() == pytest.approx(grpo.aggregate(losses, mask, mode, totals).item())


def test_gspo_sequence_ratio_by_hand():
    """GSPO's s_i = (π_θ(o_i|q) / π_old(o_i|q))^(1/|o_i|): one ratio per completion, on each of its tokens;
    its gradient with respect to each token's log-prob is s_i / |o_i| (the mean spreads it evenly)."""
    old = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.4, 0.3, 0.2]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.5, 0.5, 0.8], [0.2, 0.9, 0.7]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)  # the third token of o_1 is padding
    s = torch.tensor(
        [(0.5 * 0.5) / (0.5 * 0.25), (0.2 * 0.9 * 0.7) / (0.4 * 0.3 * 0.2)], dtype=torch.float64
    ) ** torch.tensor([1 / 2, 1 / 3], dtype=torch.float64)
    _, ratio, _ = grpo.clipped_surrogate_loss(
        grpo.completion_mean_logprob(new, mask),
        grpo.completion_mean_logprob(old, mask),
        torch.zeros(2, dtype=torch.float64),
        0.2,
        0.28,
    )
    torch.testing.assert_close(ratio, s[:, None].expand(2, 3))
    ratio[:, 0].sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([[s[0] / 2, s[0] / 2, 0.0], [s[1] / 3] * 3], dtype=torch.float64))


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean", "token-sum-norm"])
def test_update_policy_normalizes_as_each_aggregation_says(tiny, aggregation):
    """One on-policy update (ratio 1): each token's loss is −A_i, so the logged loss is −Σ_i A_i |o_i| over
    the tokens (token-mean), −Σ_i A_i over the completions (sequence-mean; 0 for centred advantages), or
    −Σ_i A_i |o_i| over completions × --max-new-tokens (token-sum-norm: Dr. GRPO's constant)."""
    from distributed_update import update_policy

    from common import fsdp

    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    batch = grpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch["advantages"] = advantages
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    args = flags.make(grpo.Args, group_size=4, loss_aggregation=aggregation, max_new_tokens=16, lr=1e-3)
    logged = update_policy(grpo, type(model)(model.config), batch, args, fsdp.Dist(0, 1, 0, torch.device("cpu")))
    expected = {
        "token-mean": -(advantages * lengths).sum() / lengths.sum(),
        "sequence-mean": -advantages.sum() / 8,
        "token-sum-norm": -(advantages * lengths).sum() / (8 * 16),
    }[aggregation]
    # float32 sums in the order the update takes the rows: the centred advantages cancel to about 1% of Σ|A_i|, so
    # the tolerance is absolute (a few float32 ulps of Σ|A_i| = 5.3), far below the gaps between the aggregations
    assert logged["losses/policy_loss"] == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize("ratio_to", ["pi-old", "behavior"])
def test_ratio_to_behavior_takes_the_ratio_to_the_engines_logprobs(tiny, ratio_to):
    """--ratio-to behavior: ρ = π_θ/μ, the engine's log-probs of a (stale) batch, clipped around 1 at one update too
    (TRL's asynchronous trainer, verl's bypass mode); pi-old: π_θ/π_old, 1 at one update. Here μ = π_θ shifted by a
    known δ per token: ρ = e^δ, its clip fraction and the loss −min(ρA, clip(ρ)A) by hand. The mismatch is π_old's
    against μ either way, and approx_kl π_old's against π_θ (0 at one update)."""
    from distributed_update import update_policy

    from common import fsdp

    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    own = [logprobs.detach() for logprobs, _ in per_sequence_logprobs(model, prompts, completions, 4)]
    delta = [0.4 * torch.randn(len(lp), generator=torch.Generator().manual_seed(i)) for i, lp in enumerate(own)]
    completions = [dataclasses.replace(c, logprobs=(lp - d).tolist()) for c, lp, d in zip(completions, own, delta)]
    batch = grpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch["advantages"] = advantages
    args = flags.make(grpo.Args, group_size=4, ratio_to=ratio_to, lr=1e-3)
    grpo.check_args(args)  # the clip range is not refused at one update (behavior)
    logged = update_policy(grpo, copy.deepcopy(model), batch, args, fsdp.Dist(0, 1, 0, torch.device("cpu")))
    ratio = torch.cat(delta).exp() if ratio_to == "behavior" else torch.ones(sum(map(len, delta)))
    a = torch.cat([advantages[i].expand(len(d)) for i, d in enumerate(delta)])
    clipped = (ratio < 0.8) & (a < 0) | (ratio > 1.28) & (a > 0)
    loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()  # token-mean
    k3 = lambda x: x.exp() - 1 - x  # noqa: E731
    expected = {"losses/ratio_min": ratio.min(), "losses/ratio_max": ratio.max(), "losses/policy_loss": loss}
    expected |= {"losses/clip_fraction": clipped.float().mean(), "mismatch/kl_k3": k3(torch.cat(delta)).mean()}
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value.item(), rel=1e-4, abs=1e-6), key
    assert logged["losses/approx_kl"] == 0 and (0 < expected["losses/clip_fraction"] < 1) == (ratio_to == "behavior")
    if ratio_to == "pi-old":
        with pytest.raises(BadInput, match="--clip-high applies with --num-minibatches"):
            grpo.check_args(flags.replace(args, clip_high=0.3))


# --- the whole loss through padding and micro-batches vs. brute force ------------------------


@pytest.mark.parametrize(
    "aggregation, ratio_level",
    [
        ("token-mean", "token"),
        ("sequence-mean", "token"),
        ("token-sum-norm", "token"),  # DAPO, GRPO, Dr. GRPO
        ("sequence-mean", "sequence"),
        ("token-mean", "sequence"),  # GSPO as in its paper, and with DAPO's token mean
    ],
)
def test_loss_gradient_matches_brute_force(tiny, aggregation, ratio_level):
    """The script's path (left/right padding, position ids, trimmed micro-batches, accumulation)
    against the objective written out per sequence without any padding (GSPO's ratio from the sequence
    probabilities themselves)."""
    model, tokenizer = tiny
    model = type(model)(model.config)
    model.load_state_dict(tiny[0].state_dict())
    prompts, completions = two_group_rollouts(tokenizer)
    group = 4
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    batch = grpo.make_batch(prompts, completions, group, tokenizer.pad_token_id, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    # old log-probs = current ones shifted by random amounts, so that some tokens are clipped
    with torch.no_grad():
        current = torch.cat(
            [
                grpo.token_logprobs(model, m, 1.0)[0]
                for m in grpo.micro_batches(batch, torch.arange(8), 8, by_length=False)
            ]
        )
    noise = 0.4 if ratio_level == "token" else 0.8  # a sequence's mean log-ratio varies less than a token's
    batch["old_logprobs"] = current + noise * torch.randn(current.shape, generator=generator)
    batch["advantages"] = advantages
    tokens, sequences, constant = (
        batch["response_mask"].sum(),
        8,
        8 * 16,
    )  # token-sum-norm: 8 completions × 16 new tokens

    model.zero_grad()
    clipped_tokens = 0
    for micro in grpo.micro_batches(batch, torch.tensor([5, 0, 3, 7, 1, 2, 6, 4]), 3):
        logprobs, _ = grpo.token_logprobs(model, micro, temperature=1.0)
        ratio_inputs = (logprobs, micro["old_logprobs"])  # as update_policy does
        if ratio_level == "sequence":
            ratio_inputs = tuple(grpo.completion_mean_logprob(x, micro["response_mask"]) for x in ratio_inputs)
        token_losses, _, clip_active = grpo.clipped_surrogate_loss(*ratio_inputs, micro["advantages"], 0.2, 0.28)
        clipped_tokens += (clip_active.float() * micro["response_mask"]).sum().item()
        totals = {"tokens": tokens, "sequences": sequences, "token_budget": constant}
        grpo.aggregate(token_losses, micro["response_mask"], aggregation, totals).backward()
    script_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert 0 < clipped_tokens < tokens  # the example exercises both branches of the min

    model.zero_grad()
    objective = 0.0
    for i, (logprobs, _) in enumerate(per_sequence_logprobs(model, prompts, completions, group)):
        response = completions[i].token_ids
        old = batch["old_logprobs"][i, : len(response)]
        if ratio_level == "token":
            ratio = torch.exp(logprobs - old)
        else:  # (π_θ(o_i|q) / π_old(o_i|q))^(1/|o_i|), on every token of o_i
            ratio = (torch.exp(logprobs.sum() - old.sum()) ** (1 / len(response))).expand(len(response))
        surrogate = torch.minimum(ratio * advantages[i], ratio.clamp(0.8, 1.28) * advantages[i])
        normalizer = {"token-mean": tokens, "sequence-mean": sequences * len(response), "token-sum-norm": constant}
        objective = objective + surrogate.sum() / normalizer[aggregation]
    (-objective).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(script_grads[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "num_minibatches, update_epochs, ratio_level, kl_coef",
    [(1, 1, "token", 0.0), (1, 2, "token", 0.1), (2, 1, "sequence", 0.0), (5, 1, "token", 0.0)],
    ids=["one-update", "two-epochs-kl", "two-minibatches-gspo", "five-minibatches-of-8-rows"],
)
def test_update_policy_gradient_matches_brute_force(
    tiny, monkeypatch, num_minibatches, update_epochs, ratio_level, kl_coef
):
    """Each optimizer step of update_policy against the objective of its minibatch written out per sequence (the
    minibatches of the script's seeded permutations): π_old is the π_old pass's (made different from π_θ here, so
    that tokens clip) whenever the batch makes more than one update, and π_θ itself at one update (no pass);
    β·k3(π_θ ‖ π_ref) joins each token's loss; GSPO's ratio is the sequence's; no step carries another's gradient.
    The weights never move here, so each logged statistic (ratio range, clip fraction, approx_kl, entropy, kl_ref)
    is brute force's over every token."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # π_ref away from π_θ, so that the KL term has a gradient
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    prompts, completions = two_group_rollouts(tokenizer)
    batch = grpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4])
    noise = 0.4 * torch.randn(batch["sampler_logprobs"].shape, generator=torch.Generator().manual_seed(0))
    batch_logprobs = grpo.batch_logprobs

    def shifted_old_logprobs(model_, batch_, *rest):  # the π_old pass, off by a random amount per token
        logprobs, entropy = batch_logprobs(model_, batch_, *rest)
        return (logprobs + noise if model_ is not reference else logprobs), entropy

    monkeypatch.setattr(grpo, "batch_logprobs", shifted_old_logprobs)
    args = flags.make(
        grpo.Args, group_size=4, num_minibatches=num_minibatches, update_epochs=update_epochs,
        ratio_level=ratio_level, kl_coef=kl_coef, micro_batch_size=3, max_grad_norm=1e9,
    )  # fmt: skip
    optimizer = gradient_recorder(model.parameters())  # the weights never move: every update sees π_θ = π_start
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.manual_seed(0)
    metrics, reference_model = StepMetrics(), reference if kl_coef else None
    grpo.update_policy(model, reference_model, optimizer, scheduler, batch, args, ONE_PROCESS, precision(), metrics)
    logged = metrics.reduce()
    torch.manual_seed(0)  # the minibatches, as update_policy draws them
    minibatches = [m.tolist() for _ in range(update_epochs) for m in torch.randperm(8).tensor_split(num_minibatches)]
    assert len(minibatches) == num_minibatches * update_epochs  # 8 rows in 5: 2, 2, 2, 1, 1

    with torch.no_grad():
        current, _ = batch_logprobs(model, batch, args, NO_AUTOCAST)
        ref_logprobs, _ = batch_logprobs(reference, batch, args, NO_AUTOCAST)
    old_logprobs = current + noise if num_minibatches * update_epochs > 1 else current
    token_objectives, seen = [], {key: [] for key in ("ratio", "clipped", "k3", "kl", "entropy", "mismatch")}
    for i, (logprobs, entropy) in enumerate(per_sequence_logprobs(model, prompts, completions, 4)):
        response = completions[i].token_ids
        old, ref = old_logprobs[i, : len(response)], ref_logprobs[i, : len(response)]
        if ratio_level == "token":
            ratio = torch.exp(logprobs - old)
        else:  # (π_θ(o_i|q) / π_old(o_i|q))^(1/|o_i|), on every token of o_i
            ratio = torch.exp((logprobs.sum() - old.sum()) / len(response)).expand(len(response))
        surrogate = torch.minimum(ratio * advantages[i], ratio.clamp(0.8, 1.28) * advantages[i])
        kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
        token_objectives.append(surrogate - kl_coef * kl)
        log_ratio = (logprobs - old).detach()
        clipped = (ratio < 0.8) & (advantages[i] < 0) | (ratio > 1.28) & (advantages[i] > 0)
        engine = old - completions[i].logprobs[0]  # log π_old − log μ (the placeholder μ: -1 at every token)
        values = (ratio, clipped.float(), log_ratio.exp() - 1 - log_ratio, kl, entropy, engine)
        for key, value in zip(seen, values):
            seen[key].append(value.detach())
    assert len(optimizer.steps) == len(minibatches) == scheduler.last_epoch  # the schedule moves once per step
    for rows, gradients in zip(minibatches, optimizer.steps):
        objective = sum(token_objectives[i].sum() for i in rows) / batch["response_mask"][rows].sum()
        model.zero_grad()
        (-objective).backward(retain_graph=True)
        for (name, parameter), gradient in zip(model.named_parameters(), gradients):
            # float32 sums in other orders: about 1e-6 of the norm, up to 8e-5 in minibatches of one or two rows
            # (small gradients) and under GSPO's sequence ratio (one exp of a sum over the tokens) on some builds of
            # the model; a wrong π_old, ratio or KL: 1e-2 and more
            tolerance = 2e-4
            assert (gradient - parameter.grad).norm() <= tolerance * parameter.grad.norm(), name
    # the statistics, over every token of every update (each sees π_start here)
    seen = {key: torch.cat(values) for key, values in seen.items()}
    assert 0 < seen["clipped"].mean() < 1 or num_minibatches * update_epochs == 1  # both branches of the min
    expected = {
        "losses/ratio_min": seen["ratio"].min(),
        "losses/ratio_max": seen["ratio"].max(),
        "losses/clip_fraction": seen["clipped"].mean(),
        "losses/approx_kl": seen["k3"].mean(),
        "charts/entropy": seen["entropy"].mean(),
        **({"losses/kl_ref": seen["kl"].mean()} if kl_coef else {}),
        "mismatch/kl_k3": (seen["mismatch"].exp() - 1 - seen["mismatch"]).mean(),  # k3 KL(μ ‖ π_old)
        "mismatch/max_abs_logprob_diff": seen["mismatch"].abs().max(),
    }
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key
    assert ("losses/kl_ref" in logged) == bool(kl_coef)


def test_record_mismatch_k3():
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    sampler = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: ignored
    metrics = StepMetrics()
    grpo.record_mismatch(metrics, {"sampler_logprobs": sampler, "response_mask": mask}, old)
    logged = metrics.reduce()
    expected_k3 = (torch.exp(torch.tensor(0.5)) - 1 - 0.5).item() / 2  # ρ = π_old/μ = e^0.5 on the first token
    assert logged["mismatch/kl_k3"] == pytest.approx(expected_k3)
    assert logged["mismatch/max_abs_logprob_diff"] == pytest.approx(0.5)


# --- the script ---------------------------------------------------------------------------------

# 8 prompts: the second step's ratios leave 1 unless all 16 groups of both steps had equal rewards, on 0.48^16 < 1e-5
# of machines (helpers.py, reward signal; with 4 prompts on 0.3% of them)
SMALL = ["--prompts-per-step", 8, "--group-size", 4, "--eval-prompts", 16, "--eval-k", 2]


@pytest.mark.slow
def test_several_updates_per_batch_and_kl_penalty(tmp_path):
    run_script(
        "algorithms/grpo.py",
        "--steps",
        2,
        "--eval-every",
        0,
        "--output-dir",
        tmp_path,
        *SMALL[:4],
        "--num-minibatches",
        2,
        "--update-epochs",
        2,
        "--micro-batch-size",
        5,
        "--kl-coef",
        0.05,
        "--lr",
        1e-3,
        "--loss-aggregation",
        "sequence-mean",
    )
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    last = records[-1]
    assert last["losses/ratio_max"] > 1.0 or last["losses/ratio_min"] < 1.0  # π_θ moved away from π_old
    assert last["losses/approx_kl"] > 0 and last["losses/kl_ref"] > 0
    assert last["mismatch/max_abs_logprob_diff"] < 1e-3


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """A run of 2 steps extended to 4 equals a run of 4: the first evaluated at its last step, 2, where the second
    did not (evaluations at 0 and 4), and an evaluation draws from a random stream of its own."""
    common_flags = ["--eval-every", 4, "--eval-prompts", 8, "--save-every", 2, *SMALL[:4]]
    run_script("algorithms/grpo.py", "--steps", 4, "--output-dir", tmp_path / "straight", *common_flags)
    run_script("algorithms/grpo.py", "--steps", 2, "--output-dir", tmp_path / "split", *common_flags)
    run_script(
        "algorithms/grpo.py", "--steps", 4, "--output-dir", tmp_path / "split", "--resume", "auto", *common_flags
    )
    straight = read_jsonl(os.path.join(only_run_dir(tmp_path / "straight"), "metrics.jsonl"))
    split = read_jsonl(os.path.join(only_run_dir(tmp_path / "split"), "metrics.jsonl"))
    assert [r["step"] for r in split] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in split if "eval/greedy_accuracy" in r] == [0, 2, 4]
    assert [r["step"] for r in straight if "eval/greedy_accuracy" in r] == [0, 4]
    straight, split = [r for r in straight if r["step"]], [r for r in split if r["step"]]
    for record in straight:  # one update per batch: π_old = π_θ exactly, and the engine samples π_θ
        assert record["losses/ratio_min"] == record["losses/ratio_max"] == 1.0
        assert record["mismatch/max_abs_logprob_diff"] < 1e-3
    assert [r["step"] for r in straight] == [r["step"] for r in split] == [1, 2, 3, 4]
    assert_same_run(straight, split, first_end=2)  # every number logged, the evaluation at 4 included
