"""p3o.py: the ESS and the loss against hand-computed values and brute force, the update across
micro-batches and ranks, then the script end to end (fresh and stale rollouts, a shifted temperature, the
clip baseline). What every script gets (--help, bad flags, two steps, a NaN step, two ranks on a fixed
batch) is in test_scripts.py.

Also a script: `python tests/test_p3o.py OUT` (or under torchrun) runs one p3o.update_policy on a fixed
off-policy batch and writes its reduced statistics and the updated weights to OUT (see
test_two_ranks_compute_one_ess)."""

import json
import math
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for the script mode

import pytest
import torch
from helpers import CLIP_LOGGED, help_text, only_run_dir, precision, read_jsonl, run_script, torchrun

from algorithms import p3o
from common import flags, fsdp
from common.engines import Completion
from common.tracking import StepMetrics

# --- the effective sample size --------------------------------------------------------------------


def _ess_of(logprobs, sampler_logprobs, mask):
    return p3o.effective_sample_size(p3o.ratio_sums(logprobs, sampler_logprobs, mask))


def _random_batch(rows=6, width=7, seed=0, scale=0.5):
    generator = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    logprobs = sampler + scale * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    sampler = sampler * mask  # make_batch pads μ with 0.0
    logprobs = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, -50.0))  # padding must not count
    return logprobs, sampler, mask


def test_ess_is_one_for_equal_ratios():
    logprobs, sampler, mask = _random_batch()
    ess, fell_back = _ess_of(sampler + 0.3, sampler, mask)  # ρ = e^0.3 on every valid token
    assert ess == pytest.approx(1.0, abs=1e-12) and not fell_back
    assert _ess_of(sampler, sampler, mask) == (1.0, False)  # ρ ≡ 1: exactly 1
    # six equal ratios whose float64 quotient rounds to 1 + 2^-52: e_B is at most 1 all the same
    sums = {"ratio_sum": 11.885332809297116, "ratio_sq_sum": 23.543522664625748, "tokens": 6.0}
    assert sums["ratio_sum"] ** 2 / (6 * sums["ratio_sq_sum"]) > 1 and p3o.effective_sample_size(sums) == (1.0, False)


def test_ess_is_one_over_n_for_a_single_nonzero_ratio():
    assert p3o.effective_sample_size({"ratio_sum": 3.0, "ratio_sq_sum": 9.0, "tokens": 4}) == (0.25, False)
    # through the ratios: one token at ρ = 1, the other N − 1 as small as the log-ratio clamp allows (e^−10)
    logprobs, sampler, mask = _random_batch()
    tokens = int(mask.sum())
    logprobs = sampler - 50.0
    first = mask.nonzero()[0]
    logprobs[first[0], first[1]] = sampler[first[0], first[1]]
    ess, _ = _ess_of(logprobs, sampler, mask)
    floor = math.exp(-10)  # not 0: the clamp keeps every ratio positive
    assert ess == pytest.approx((1 + (tokens - 1) * floor) ** 2 / (tokens * (1 + (tokens - 1) * floor**2)), rel=1e-9)
    assert ess == pytest.approx(1 / tokens, rel=1e-2)


def test_ess_matches_the_formula_on_random_ratios():
    logprobs, sampler, mask = _random_batch(scale=1.0)
    ratios = torch.exp(logprobs - sampler)[mask.bool()].tolist()
    expected = sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios))
    ess, fell_back = _ess_of(logprobs, sampler, mask)
    assert ess == pytest.approx(expected, rel=1e-12) and not fell_back
    assert 1 / len(ratios) < ess < 0.9  # a genuinely spread batch


def test_ess_is_the_same_whether_the_batch_is_split_or_not():
    logprobs, sampler, mask = _random_batch(rows=9, scale=1.0)
    whole, _ = _ess_of(logprobs, sampler, mask)
    for parts in ([slice(0, 9)], [slice(0, 4), slice(4, 9)], [slice(i, i + 1) for i in range(9)]):
        sums = {"ratio_sum": 0.0, "ratio_sq_sum": 0.0, "tokens": 0.0}
        for part in parts:
            width = int(mask[part].any(0).nonzero()[-1]) + 1  # trimmed like common.batches.micro_batches
            for key, value in p3o.ratio_sums(logprobs[part, :width], sampler[part, :width], mask[part, :width]).items():
                sums[key] += value
        assert p3o.effective_sample_size(sums)[0] == pytest.approx(whole, rel=1e-12)
    # while the per-micro-batch values (the authors' scope) differ from the batch's
    per_row = [_ess_of(logprobs[i : i + 1], sampler[i : i + 1], mask[i : i + 1])[0] for i in range(9)]
    assert max(abs(e - whole) for e in per_row) > 1e-3


def test_ess_fallback_without_tokens_or_with_non_finite_sums():
    logprobs, sampler, mask = _random_batch()
    assert _ess_of(logprobs, sampler, torch.zeros_like(mask)) == (1.0, True)
    logprobs[tuple(mask.nonzero()[0])] = float("nan")
    assert _ess_of(logprobs, sampler, mask) == (1.0, True)
    # an infinite log-ratio is clamped, not a fallback
    logprobs, sampler, mask = _random_batch()
    sampler[tuple(mask.nonzero()[0])] = float("-inf")
    ess, fell_back = _ess_of(logprobs, sampler, mask)
    assert not fell_back and 0 < ess < 0.5


# --- the loss ------------------------------------------------------------------------------------


def _token_gradient(logprobs, sampler, advantages, mask, ess):
    logprobs = logprobs.clone().requires_grad_()
    token_losses, ratio, capped, kl = p3o.p3o_loss(logprobs, sampler, advantages, mask, ess)
    p3o.aggregate(token_losses, mask, "token-mean", {"tokens": mask.sum(), "sequences": len(mask)}).backward()
    return logprobs.grad * mask.sum(), ratio, capped, kl  # per-token gradient of the token sum


def test_per_token_weights_are_min_of_ratio_and_ess_and_the_kl_gradient_is_exact():
    logprobs, sampler, mask = _random_batch(scale=0.6)
    ess, _ = _ess_of(logprobs, sampler, mask)
    assert ess < 0.95
    advantages = torch.linspace(-1.5, 2.0, len(mask), dtype=torch.float64)
    with_advantage, ratio, capped, kl = _token_gradient(logprobs, sampler, advantages, mask, ess)
    kl_only, *_ = _token_gradient(logprobs, sampler, torch.zeros_like(advantages), mask, ess)
    valid = mask.bool()
    rho = torch.exp(logprobs - sampler)
    # the KL term: (1 − e_B)(1 − 1/ρ) ∇log π per token
    torch.testing.assert_close(kl_only[valid], ((1 - ess) * (1 - 1 / rho))[valid], rtol=1e-12, atol=1e-14)
    # the score-function weight: exactly min(ρ, e_B), detached (no ∇ρ term)
    weights = (with_advantage - kl_only) / -advantages[:, None]
    torch.testing.assert_close(weights[valid], torch.clamp(rho, max=ess)[valid], rtol=1e-10, atol=1e-14)
    assert 0 < int(capped[valid].sum()) < int(valid.sum())  # both sides of the cap are exercised
    assert torch.equal(capped[valid], (rho > ess)[valid])
    torch.testing.assert_close(kl[valid], (torch.log(rho) + 1 / rho - 1)[valid])
    assert (with_advantage[~valid] == 0).all()


def test_on_policy_is_reinforce():
    """ρ ≡ 1: e_B = 1, every weight 1, no KL: the gradient of token-mean −A·log π."""
    logprobs, sampler, mask = _random_batch()
    ess, _ = _ess_of(sampler, sampler, mask)
    advantages = torch.linspace(-1.0, 1.0, len(mask), dtype=torch.float64)
    gradient, *_ = _token_gradient(sampler, sampler, advantages, mask, ess)
    assert torch.equal(gradient, -advantages[:, None] * mask)
    # the cap is active where ρ > e_B only: ρ = e_B = 1 caps nothing; padding's log ρ is 0 (ρ = 1, not e)
    _, ratio, capped, _ = p3o.p3o_loss(sampler, sampler, advantages, mask, ess)
    assert not capped.any() and torch.equal(p3o.behavior_log_ratio(sampler + 1.0, sampler, mask), mask.double())


def test_clamped_log_ratio_never_flips_the_kl_gradient():
    """|log ρ| > 10 is clamped: such a token keeps its capped score-function weight, and gets no KL
    gradient (the authors' clamp of 1/ρ alone would push log π the wrong way there)."""
    sampler = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    logprobs = sampler + torch.tensor([[-15.0, 0.0, 12.0]], dtype=torch.float64)
    mask = torch.ones_like(sampler)
    gradient, ratio, _, _ = _token_gradient(logprobs, sampler, torch.tensor([1.0], dtype=torch.float64), mask, 0.5)
    torch.testing.assert_close(ratio, torch.exp(torch.tensor([[-10.0, 0.0, 10.0]], dtype=torch.float64)))
    assert gradient[0, 0].item() == pytest.approx(-math.exp(-10))  # weight e^−10, no KL gradient
    assert gradient[0, 1].item() == pytest.approx(-0.5)  # ρ = 1 > e_B: weight e_B, KL gradient 0 at ρ = 1
    assert gradient[0, 2].item() == pytest.approx(-0.5)  # capped weight, no KL gradient beyond the clamp


# --- the update on a real model: micro-batches, padding and ranks vs brute force ---------------------

CPU = torch.device("cpu")
ONE_CPU_RANK = fsdp.Dist(0, 1, 0, CPU)
QUESTIONS = ["Q: 1+2=", "Q: 45+51=", "Q: 9+9=", "Q: 70+30="]
RESPONSES = ["3", "12", "4", "396", "96", "9", "91", "906", "18", "1", "81", "188", "100", "10", "1000", "0"]


class GradRecorder:
    """Stands in for the optimizer: records the gradient of each step and leaves the weights alone."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self):
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _off_policy_batch(model, tokenizer, prompts_range=range(4), device=CPU):
    """4 prompts x 4 completions; μ = π_θ's log-probs shifted by fixed noise (ratios around 1, some capped)."""
    prompts = [tokenizer(q)["input_ids"] for q in QUESTIONS]
    completions = [
        Completion(
            tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], [0.0] * (len(r) + 1), "stop"
        )
        for r in RESPONSES
    ]
    full = p3o.make_batch(prompts, completions, 4, tokenizer.pad_token_id, device)
    with torch.no_grad():
        current = p3o.token_logprobs(model, full, 1.0)[0]
    noise = 0.5 * torch.randn(current.shape, generator=torch.Generator().manual_seed(0))
    sampler = (current + noise) * full["response_mask"]
    for index, completion in enumerate(completions):
        completion.logprobs = sampler[index, : len(completion.token_ids)].tolist()
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.3, -0.9, 0.4, 1.1, -1.0, 0.2, -0.3, 0.0, 0.8, -0.6, -0.2])
    mine = list(prompts_range)
    batch = p3o.make_batch(
        [prompts[i] for i in mine],
        [completions[i * 4 + j] for i in mine for j in range(4)],
        4,
        tokenizer.pad_token_id,
        device,
    )
    batch["advantages"] = advantages[mine[0] * 4 : (mine[-1] + 1) * 4]
    return prompts, completions, advantages, batch


def _update(model, batch, dist=ONE_CPU_RANK, **overrides):
    """(the statistics update_policy logs, reduced, with "skipped"; the gradient of each optimizer step)."""
    args = flags.make(p3o.Args, max_grad_norm=1e9, **overrides)
    recorder, metrics = GradRecorder(model), StepMetrics()
    skipped = p3o.update_policy(
        model, None, recorder, types.SimpleNamespace(step=lambda: None), batch, args, dist, precision(), metrics
    )
    return {"skipped": skipped, **metrics.reduce(dist)}, recorder.grads


def _per_token(model, prompts, completions):
    """Every response token of every completion, one unpadded sequence at a time: (log π_θ with its graph, log μ,
    the index of the completion that owns the token)."""
    logprobs, sampler, owner = [], [], []
    for i, completion in enumerate(completions):
        prompt, response = prompts[i // 4], completion.token_ids
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
        sampler.append(torch.tensor(completion.logprobs))
        owner += [i] * len(response)
    return torch.cat(logprobs), torch.cat(sampler), owner


def _copy(tiny):
    model = type(tiny[0])(tiny[0].config)
    model.load_state_dict(tiny[0].state_dict())
    return model.eval()


def test_update_gradient_matches_brute_force_of_the_written_objective(tiny):
    """update_policy (padding, trimmed micro-batches of 3, the no-grad ESS pass, accumulation) against
    L = 1/N Σ_t [−sg(min(ρ, e_B))·A·log π + (1 − e_B)(log ρ + 1/ρ − 1)] written per unpadded sequence."""
    model, tokenizer = _copy(tiny), tiny[1]
    prompts, completions, advantages, batch = _off_policy_batch(model, tokenizer)
    logged, grads = _update(model, batch, micro_batch_size=3)
    assert len(grads) == 1 and logged["losses/ess_fallbacks"] == 0 and logged["skipped"] == 0

    model.zero_grad()
    logprobs, sampler, owner = _per_token(model, prompts, completions)
    rho = torch.exp(logprobs - sampler)
    n = len(rho)
    ess = (rho.detach().double().sum() ** 2 / (n * rho.detach().double().square().sum())).item()
    objective = (
        -torch.clamp(rho.detach(), max=ess) * advantages[owner] * logprobs + (1 - ess) * (torch.log(rho) + 1 / rho - 1)
    ).sum() / n
    objective.backward()

    assert logged["losses/ess_min"] == pytest.approx(ess, abs=1e-6) and ess < 0.97
    assert logged["losses/ess"] == pytest.approx(ess, abs=1e-6)  # one e_B for the whole step
    capped = (rho.detach() > ess).float().mean().item()  # the tokens whose weight min(ρ, e_B) is e_B
    assert logged["losses/clip_fraction"] == pytest.approx(capped, abs=1e-6) and 0 < capped < 1
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(grads[0][name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_clip_baseline_update_is_the_clipped_surrogate_on_the_behavior_ratio(tiny, monkeypatch):
    """--loss clip through update_policy: the gradient of 1/N Σ_t −min(ρA, clip(ρ, 1 − ε, 1 + ε)A), ρ = π_θ/μ, written
    per unpadded sequence (no ESS cap, no KL term), and its clip fraction. Its e_B is only logged: the step's, from
    the update's own forward passes, without P3O's no-grad pass over the step (which cost +30% of train time)."""
    model, tokenizer = _copy(tiny), tiny[1]
    prompts, completions, advantages, batch = _off_policy_batch(model, tokenizer)
    monkeypatch.setattr(p3o, "minibatch_ess", lambda *args: pytest.fail("a pass over the step for a logged e_B"))
    logged, grads = _update(model, batch, micro_batch_size=3, loss="clip", clip_eps=0.2)
    model.zero_grad()
    logprobs, sampler, owner = _per_token(model, prompts, completions)
    rho, advantage = torch.exp(logprobs - sampler), advantages[owner]
    surrogate = torch.minimum(rho * advantage, torch.clamp(rho, 0.8, 1.2) * advantage)
    (-surrogate.sum() / len(rho)).backward()
    clipped = ((rho > 1.2) & (advantage > 0)) | ((rho < 0.8) & (advantage < 0))
    assert logged["losses/clip_fraction"] == pytest.approx(clipped.float().mean().item(), abs=1e-6) and clipped.any()
    assert logged["losses/ratio_mean"] == pytest.approx(rho.mean().item(), rel=1e-5)  # the mean ρ of the tokens
    kl_behavior = (torch.log(rho) + 1 / rho - 1).mean().item()  # logged only, as e_B is
    assert logged["losses/kl_behavior"] == pytest.approx(kl_behavior, rel=1e-4) and kl_behavior > 0
    ess = (rho.detach().double().sum() ** 2 / (len(rho) * rho.detach().double().square().sum())).item()
    assert logged["losses/ess"] == pytest.approx(ess, abs=1e-6) == logged["losses/ess_min"] and ess < 0.97
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(grads[0][name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_authors_micro_batch_scope_takes_rows_in_minibatch_order(tiny):
    """--ess-scope micro-batch: one e_B per micro-batch of the minibatch's rows in their own (shuffled) order, as
    FeynRL's per-micro-batch ESS; not sorted by length first, which would be another partition and other e_B. A
    micro-batch whose sums are not finite falls back to e_B = 1 and is counted."""
    model, tokenizer = _copy(tiny), tiny[1]
    *_, batch = _off_policy_batch(model, tokenizer)
    torch.manual_seed(0)
    logged, _ = _update(model, dict(batch), micro_batch_size=3, ess_scope="micro-batch")
    torch.manual_seed(0)
    order = torch.randperm(16)  # update_policy's one minibatch, drawn from the same generator state
    with torch.no_grad():
        rho = torch.exp(p3o.token_logprobs(model, batch, 1.0)[0] - batch["sampler_logprobs"]).double()
    mask = batch["response_mask"].bool()
    by_length = order[batch["response_mask"][order].sum(1).argsort(descending=True, stable=True)]
    expected = {}
    for partition, rows in (("own order", order), ("by length", by_length)):
        parts = [rho[chunk][mask[chunk]] for chunk in rows.split(3)]
        each = [(r.sum() ** 2 / (len(r) * r.square().sum())).item() for r in parts]
        expected[partition] = (sum(e * len(r) for e, r in zip(each, parts)) / mask.sum().item(), min(each))
    assert (logged["losses/ess"], logged["losses/ess_min"]) == pytest.approx(expected["own order"], rel=1e-5)
    assert expected["by length"] != pytest.approx(expected["own order"], rel=1e-3)  # the test can tell them apart


@pytest.mark.parametrize(
    "overrides, fallbacks",
    [
        ({"micro_batch_size": 16}, 2),  # e_B from the forward pass itself: one micro-batch holds each step
        ({"micro_batch_size": 3}, 2),  # from the no-grad pass over each step (minibatch_ess)
        ({"micro_batch_size": 3, "loss": "clip"}, 2),  # --loss clip: the step's e_B, logged after its passes
        ({"micro_batch_size": 6, "ess_scope": "micro-batch"}, 6),  # one per micro-batch: 16 rows in 3, twice
    ],
    ids=["one-micro-batch", "no-grad-pass", "clip-logged-after", "per-micro-batch"],
)
def test_every_non_finite_ess_falls_back_and_is_counted(tiny, monkeypatch, overrides, fallbacks):
    """Each way of taking e_B falls back to 1 on sums that are not finite, and each fallback is counted, over two
    epochs (as the whole run's are: test_non_finite_sums_fall_back_and_are_counted)."""
    model, tokenizer = _copy(tiny), tiny[1]
    *_, batch = _off_policy_batch(model, tokenizer)
    monkeypatch.setattr(p3o, "ratio_sums", lambda *a: {"ratio_sum": math.nan, "ratio_sq_sum": 1.0, "tokens": 1.0})
    logged, grads = _update(model, batch, update_epochs=2, **overrides)
    assert logged["losses/ess_fallbacks"] == fallbacks and logged["losses/ess"] == 1.0 and len(grads) == 2


def test_update_ess_does_not_depend_on_the_micro_batch_size(tiny):
    model, tokenizer = _copy(tiny), tiny[1]
    *_, batch = _off_policy_batch(model, tokenizer)
    torch.manual_seed(0)
    split, split_grads = _update(model, dict(batch), micro_batch_size=3)  # 6 micro-batches + the ESS pass
    torch.manual_seed(0)
    whole, whole_grads = _update(model, dict(batch), micro_batch_size=16)  # one pass gives e_B
    assert split["losses/ess_min"] == pytest.approx(whole["losses/ess_min"], rel=1e-6)
    assert split["losses/ess"] == pytest.approx(whole["losses/ess"], rel=1e-6)  # one e_B for every token
    for name in whole_grads[0]:
        torch.testing.assert_close(split_grads[0][name], whole_grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    # the authors' scope: one e_B per micro-batch, hence another update
    torch.manual_seed(0)
    per_micro, per_micro_grads = _update(model, dict(batch), micro_batch_size=3, ess_scope="micro-batch")
    assert per_micro["losses/ess"] != pytest.approx(whole["losses/ess"], rel=1e-4)
    name = next(iter(whole_grads[0]))
    assert not torch.allclose(per_micro_grads[0][name], whole_grads[0][name], rtol=1e-3)


def test_several_updates_tighten_as_pi_drifts_from_mu(tiny):
    """Ratios stay relative to μ: on-policy data, two minibatches x two epochs with real steps."""
    model, tokenizer = _copy(tiny), tiny[1]
    *_, batch = _off_policy_batch(model, tokenizer)
    with torch.no_grad():
        batch["sampler_logprobs"] = p3o.token_logprobs(model, batch, 1.0)[0] * batch["response_mask"]
    args = flags.make(p3o.Args, num_minibatches=2, update_epochs=2, micro_batch_size=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.manual_seed(0)
    metrics = StepMetrics()
    skipped = p3o.update_policy(
        model, None, optimizer, scheduler, batch, args, fsdp.Dist(0, 1, 0, torch.device("cpu")), precision(), metrics
    )
    logged = metrics.reduce()
    assert scheduler.last_epoch == 4 and skipped == 0  # four optimizer steps, none skipped
    assert logged["losses/ess_min"] < 0.999  # the later updates see π_θ ≠ μ
    assert logged["losses/ratio_max"] > 1.01 or logged["losses/ratio_min"] < 0.99


def _distributed_update(out_path):
    """One update_policy on the global batch of 4 prompts, this rank's share of them (as p3o.main)."""
    dist = fsdp.setup()
    from common.tiny import load, tiny_model_dir

    model, tokenizer = load(tiny_model_dir())
    model.eval()
    per_rank = 4 // dist.world_size
    *_, batch = _off_policy_batch(
        model, tokenizer, range(dist.rank * per_rank, (dist.rank + 1) * per_rank), dist.device
    )
    policy = fsdp.shard(model, dist)
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)  # linear in the gradient: weights compare gradients
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = flags.make(p3o.Args, micro_batch_size=3, max_grad_norm=1e9)
    metrics = StepMetrics()
    skipped = p3o.update_policy(policy, None, optimizer, scheduler, batch, args, dist, precision(), metrics)
    logged = {
        "skipped": skipped,
        "tokens": fsdp.all_reduce(batch["response_mask"].sum().item(), dist),
        **metrics.reduce(dist),
    }  # means over the tokens of all ranks
    weights = dict(fsdp.named_full_tensors(policy, dist.device))
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump(logged, f)
        torch.save(weights, out_path + ".weights.pt")
    fsdp.cleanup(dist)


@pytest.mark.slow
def test_two_ranks_compute_one_ess(tmp_path):
    """Same global batch on 1 process and on 2 FSDP2 ranks (different token counts per rank): e_B is
    summed over ranks, so the ESS, the loss and the updated weights agree."""
    run_script("tests/test_p3o.py", tmp_path / "one.json")
    torchrun(2, "tests/test_p3o.py", tmp_path / "two.json")
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["tokens"] == two["tokens"] == 49 and one["skipped"] == two["skipped"] == 0
    assert one["losses/ess_min"] < 0.97
    for key in ("losses/ess_min", "losses/ess", "losses/policy_loss", "losses/clip_fraction", "losses/kl_behavior"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    weights_one = torch.load(tmp_path / "one.json.weights.pt")
    weights_two = torch.load(tmp_path / "two.json.weights.pt")
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-4, atol=1e-6, msg=name)


# --- the script ----------------------------------------------------------------------------------

SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-prompts", 16, "--eval-k", 2]
LOGGED = CLIP_LOGGED + [
    "losses/ratio_mean",
    "losses/kl_behavior",
    "losses/ess",
    "losses/ess_min",
    "losses/ess_fallbacks",
]


@pytest.mark.slow
def test_fresh_rollouts_keep_the_ess_at_one_and_stale_ones_lower_it(tmp_path):
    """--rollout-lag 1: step 1 trains on the rollouts of its own weights, step 2 on those of step 1's weights (the
    initial ones again), as a one-step pipeline (P3O's Fig. 5) feeds its trainer."""
    # step 2's rollouts are stale only if step 1 moved the weights: 16 groups, all with equal rewards on 0.48^16 < 1e-5
    # of machines (helpers.py, reward signal; with 4 groups on 5% of them)
    flags = ["--eval-every", 0, "--rollout-lag", 1, "--output-dir", tmp_path, "--prompts-per-step", 16, *SMALL[2:4]]
    run_script("algorithms/p3o.py", "--steps", 2, *flags)
    fresh, stale = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for key in LOGGED:
        assert isinstance(fresh[key], float), key
    # the float32 engine has the trainer's weights: μ = π_θ up to rounding
    assert 1 - 1e-9 < fresh["losses/ess"] <= 1 and fresh["losses/ess_fallbacks"] == 0
    assert abs(fresh["losses/ratio_max"] - 1) < 1e-4 and abs(fresh["losses/ratio_min"] - 1) < 1e-4
    assert fresh["losses/kl_behavior"] < 1e-9 and fresh["mismatch/max_abs_logprob_diff"] < 1e-4
    assert [fresh["charts/rollout_lag"], stale["charts/rollout_lag"]] == [0, 1]
    assert stale["losses/ess"] < 0.99 and stale["losses/ess"] == pytest.approx(
        stale["losses/ess_min"], rel=1e-12
    )  # one e_B per step
    assert stale["mismatch/max_abs_logprob_diff"] > 1e-2 and stale["losses/kl_behavior"] > 1e-3
    assert stale["losses/ratio_max"] > 1 > stale["losses/ratio_min"]
    assert stale["charts/skipped_steps"] == 0


@pytest.mark.slow
def test_sampling_temperature_makes_the_batch_off_policy(tmp_path):
    run_script(
        "algorithms/p3o.py",
        "--steps",
        1,
        "--eval-every",
        0,
        "--sampling-temperature",
        1.2,
        "--ess-scope",
        "micro-batch",
        "--micro-batch-size",
        5,
        "--output-dir",
        tmp_path,
        *SMALL[:4],
    )
    (record,) = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    # temperature 1.2 makes every token off-policy, no reward needed; over run seeds 1-3: e_B min 0.964-0.970 below
    # their mean 0.980-0.983, KL to μ 0.014-0.041, capped tokens 0.79-0.82 of them
    assert record["losses/ess_min"] < record["losses/ess"] < 0.999  # four micro-batches, four e_B
    assert record["losses/kl_behavior"] > 1e-3 and 0 < record["losses/clip_fraction"] < 1


def test_non_finite_sums_fall_back_and_are_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(p3o, "ratio_sums", lambda *a: {"ratio_sum": float("nan"), "ratio_sq_sum": 1.0, "tokens": 1.0})
    p3o.main(
        flags.make(
            p3o.Args,
            steps=2,
            eval_every=0,
            output_dir=str(tmp_path),
            prompts_per_step=4,
            group_size=4,
            micro_batch_size=5,
        )
    )
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for record in records:
        assert record["losses/ess_fallbacks"] == 1  # one optimizer step per rollout batch
        assert record["losses/ess"] == 1.0 and record["charts/skipped_steps"] == 0


def test_help_has_no_clip_range():
    text = help_text("algorithms/p3o.py", p3o.Args, count_defaults=False)
    assert "--clip-low" not in text and "--clip-high" not in text  # P3O has no clip hyper-parameter


def test_bad_ess_scope_is_refused_by_the_parser(tmp_path):
    result = run_script("algorithms/p3o.py", "--ess-scope", "batch", "--output-dir", tmp_path, check=False)
    assert result.returncode != 0 and "--ess-scope" in result.stderr


def test_clip_baseline_is_grpos_surrogate_on_the_behavior_ratio():
    """--loss clip: grpo.py's clipped surrogate with π_old replaced by μ (an independent implementation),
    same values and same gradients; P3O's ratio clamp does not bind for these log-ratios."""
    from algorithms import grpo

    torch.manual_seed(0)
    logprobs = (-torch.rand(6, 5) * 3).requires_grad_()
    sampler = logprobs.detach() + torch.randn(6, 5) * 0.5
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0])
    mask = torch.ones(6, 5)
    mask[2, 3:] = 0
    ours, ratio, active, kl = p3o.clipped_behavior_loss(logprobs, sampler, advantages, mask, 0.2)
    reference, ref_ratio, ref_active = grpo.clipped_surrogate_loss(logprobs, sampler, advantages, 0.2, 0.2)
    valid = mask.bool()
    assert torch.allclose(ours[valid], reference[valid]) and torch.equal(active[valid], ref_active[valid])
    # its KL(π_θ ‖ μ) statistic is P3O's k3, log ρ + 1/ρ − 1 (≥ 0), written out here
    log_ratio = (logprobs - sampler).detach()
    assert torch.allclose(kl[valid], (log_ratio + torch.exp(-log_ratio) - 1)[valid]) and (kl[valid] > 0).all()
    assert 0 < active[valid].float().mean() < 1  # the clip binds on some tokens and not on others
    (grad_ours,) = torch.autograd.grad((ours * mask).sum(), logprobs)
    (grad_ref,) = torch.autograd.grad((reference * mask).sum(), logprobs)
    assert torch.allclose(grad_ours, grad_ref)


@pytest.mark.slow
def test_clip_baseline_end_to_end_off_policy(tmp_path):
    run_script(
        "algorithms/p3o.py",
        "--steps",
        1,
        "--eval-every",
        0,
        "--sampling-temperature",
        1.2,
        "--loss",
        "clip",
        "--clip-eps",
        0.05,
        "--output-dir",
        tmp_path,
        *SMALL[:4],
    )
    (record,) = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    assert record["losses/ess"] < 0.999 and 0 < record["losses/clip_fraction"] < 1  # seeds 1-3: 0.980-0.983, 0.08-0.15


if __name__ == "__main__":
    _distributed_update(sys.argv[1])
