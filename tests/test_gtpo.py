"""gtpo.py: conflict masks against the paper's definitions, λ, the entropy filter and shift, the balance
property, the loss against brute force, ⟨H⟩_ini, then the script end to end (what every script gets is in
test_scripts.py)."""

import dataclasses
import json
import math
import os
import random
from functools import partial

import pytest
import torch
from helpers import (
    BASE_LOGGED,
    CLIP_LOGGED,
    only_run_dir,
    precision,
    read_jsonl,
    run_script,
    torchrun,
    two_group_rollouts,
)

from algorithms import grpo, gtpo
from common import flags, fsdp
from common.engines import Completion, HFEngine
from common.tracking import StepMetrics

CPU = fsdp.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
EOS = "$"  # in the hand-built groups below, each character is one token and "$" plays the EOS


# --- conflict masks: the definitions of §5.1 written out with sets, then hand-built groups ----------


def masks_from_definition(sequences, advantages):
    """Forward / backward conflict keys as sets of (position, token) over G+ and G-, then the first span
    of conflict tokens scanning each completion from its start and from its end (§5.1)."""
    positive = [s for s, a in zip(sequences, advantages) if a > 0]
    negative = [s for s, a in zip(sequences, advantages) if a < 0]
    forward_keys = {(p, v) for s in positive for p, v in enumerate(s)} & {
        (p, v) for s in negative for p, v in enumerate(s)
    }
    backward_keys = {(r, v) for s in positive for r, v in enumerate(reversed(s))} & {
        (r, v) for s in negative for r, v in enumerate(reversed(s))
    }
    result = []
    for s, a in zip(sequences, advantages):
        forward, backward = [0] * len(s), [0] * len(s)
        p = 0
        while a != 0 and p < len(s) and (p, s[p]) in forward_keys:
            forward[p], p = 1, p + 1
        r = 0
        while a != 0 and r < len(s) and (r, s[len(s) - 1 - r]) in backward_keys:
            backward[len(s) - 1 - r], r = 1, r + 1
        result.append((forward, backward))
    return result


def script_masks(sequences, advantages, group_size, pad="0"):
    """gtpo.conflict_masks on right-padded tensors, cut back to each completion's length, as lists."""
    tokens = [[ord(c) for c in s] for s in sequences]
    width = max(map(len, tokens))
    ids = torch.tensor([t + [ord(pad)] * (width - len(t)) for t in tokens])
    mask = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in tokens])
    forward, backward = gtpo.conflict_masks(ids, mask, torch.tensor(advantages), group_size)
    assert not (forward | backward)[mask == 0].any()  # padding is never masked
    return [(forward[i, : len(t)].int().tolist(), backward[i, : len(t)].int().tolist()) for i, t in enumerate(tokens)]


def bits(text):
    return [int(c) for c in text]


# each case: completions of one group, their advantages, and the expected (forward, backward) spans
GROUPS = {
    "shared prefix": (["ab1x", "ab2y", "ab3z", "ab4w"], [0.5, 0.5, -0.5, -0.5], [("1100", "0000")] * 4),
    # position 2 ("9") is a forward conflict too, but not in the span anchored at the first token
    "shared suffix": (
        ["pq9" + EOS, "rs9" + EOS, "tu9" + EOS, "vw9" + EOS],
        [1.0, -1.0, 1.0, -1.0],
        [("0000", "0011")] * 4,
    ),
    "both": (
        ["<a1/" + EOS, "<b2/" + EOS, "<c3/" + EOS, "<d4/" + EOS],
        [0.75, -0.25, -0.25, -0.25],
        [("10000", "00011")] * 4,
    ),
    # P1 and N1 share "ab", P2 shares only "a" with them, N2 shares nothing at the start; "c" at
    # position 2 of P2 and N2 is a conflict token in the middle, not in any span
    "partial overlaps": (
        ["abqx", "accy", "absz", "ztcw"],
        [1.0, 1.0, -1.0, -1.0],
        [("1100", "0000"), ("1000", "0000"), ("1100", "0000"), ("0000", "0000")],
    ),
    # "x" and "y" are shared by the two positives only, "u" by the two negatives only: no conflict
    "same sign only": (["xa", "xb", "uc", "ud"], [1.0, 1.0, -1.0, -1.0], [("00", "00")] * 4),
    "no conflict": (["abc", "def", "ghi", "jkl"], [1.0, -1.0, 1.0, -1.0], [("000", "000")] * 4),
    "all advantages zero": (["ab" + EOS] * 4, [0.0] * 4, [("000", "000")] * 4),
    # zero-advantage completions neither witness a conflict nor get a mask
    "zero advantages in a mixed group": (
        ["ab" + EOS, "ab" + EOS, "ac" + EOS, "ad" + EOS],
        [1.0, 0.0, -1.0, 0.0],
        [("100", "001"), ("000", "000"), ("100", "001"), ("000", "000")],
    ),
    # forward positions align at the start, backward offsets at each completion's own last token; the
    # truncated "12" (no EOS) ends on "2", so it shares no backward conflict
    "different lengths": (
        ["12345" + EOS, "7" + EOS, "129" + EOS, "12"],
        [1.0, 1.0, -1.0, -1.0],
        [("110000", "000001"), ("00", "01"), ("1100", "0001"), ("11", "00")],
    ),
    # the backward span runs through the EOS and the tokens before it; the truncated "jok" has no EOS
    "EOS in the backward span": (
        ["aok" + EOS, "jok", "bok" + EOS, "cxk" + EOS],
        [1.0, 1.0, -1.0, -1.0],
        [("0000", "0111"), ("000", "000"), ("0000", "0111"), ("0000", "0011")],
    ),
}


@pytest.mark.parametrize("name", GROUPS)
def test_conflict_masks_on_hand_built_groups(name):
    sequences, advantages, expected = GROUPS[name]
    expected = [(bits(f), bits(b)) for f, b in expected]
    assert masks_from_definition(sequences, advantages) == expected  # the hand-written spans are the definition's
    # the padding token equals a real token ("3" occurs in "12345$"): it must still never match
    assert script_masks(sequences, advantages, len(sequences), pad="3") == expected


def test_conflict_masks_match_the_definition_on_random_groups():
    """Many groups per batch (they must not see each other), small vocabulary, all lengths, EOS or not."""
    rng = random.Random(0)
    for trial in range(300):
        group_size, groups = rng.choice([2, 3, 4, 6]), rng.randint(1, 4)
        sequences = ["".join(rng.choice("ab$") for _ in range(rng.randint(1, 7))) for _ in range(group_size * groups)]
        advantages = [rng.choice([-1.0, -0.25, 0.0, 0.5, 1.0]) for _ in sequences]
        expected = []
        for g in range(groups):
            chunk = slice(g * group_size, (g + 1) * group_size)
            expected += masks_from_definition(sequences[chunk], advantages[chunk])
        assert script_masks(sequences, advantages, group_size, pad="a") == expected, trial
    # the random groups do exercise both spans
    assert any(any(f) for f, _ in expected) and any(any(b) for _, b in expected)


def test_groups_do_not_see_each_other():
    # the same two completions, but in two groups of one sign each: no conflict at all
    assert script_masks(["ab", "ab", "ab", "ab"], [1.0, 1.0, -1.0, -1.0], group_size=2) == [([0, 0], [0, 0])] * 4
    assert script_masks(["ab", "ab", "ab", "ab"], [1.0, -1.0, 1.0, -1.0], group_size=2) == [([1, 1], [1, 1])] * 4


def test_conflict_spans_skip_a_tool_output():
    """With tools (a response is an episode), a tool's output inside a completion is context: the spans run along
    the policy's own tokens as if the output were absent (§5.1 on the completion without it), and an output's
    tokens are never masked, even where they equal a conflict token. Random groups as above, each completion
    with outputs of 1-3 tokens (from the same small vocabulary) after some of its tokens, against the
    definition on the completions without their outputs."""
    rng, spans = random.Random(1), {"forward": 0, "backward": 0}
    for trial in range(200):
        group_size, groups = rng.choice([2, 3, 4]), rng.randint(1, 3)
        sequences = ["".join(rng.choice("ab$") for _ in range(rng.randint(1, 6))) for _ in range(group_size * groups)]
        advantages = [rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0]) for _ in sequences]
        episodes, policy = [], []  # tokens with the outputs, and 1 at the policy's own tokens
        for s in sequences:
            tokens, own = [ord(s[0])], [1]
            for c in s[1:] + "E":  # "E": the end, after which an output may still come (a truncated episode)
                if rng.random() < 0.4:
                    output = [ord(rng.choice("ab$")) for _ in range(rng.randint(1, 3))]
                    tokens, own = tokens + output, own + [0] * len(output)
                if c != "E":
                    tokens, own = tokens + [ord(c)], own + [1]
            episodes.append(tokens)
            policy.append(own)
        width = max(map(len, episodes))
        ids = torch.tensor([t + [ord("a")] * (width - len(t)) for t in episodes])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in policy], dtype=torch.float32)
        forward, backward = gtpo.conflict_masks(ids, mask, torch.tensor(advantages), group_size)
        assert not (forward | backward)[mask == 0].any(), trial  # outputs and padding are never masked
        expected = []
        for g in range(groups):
            chunk = slice(g * group_size, (g + 1) * group_size)
            expected += masks_from_definition(sequences[chunk], advantages[chunk])
        # the spans at the policy's own tokens, in their order
        at_own = [
            (forward[i][mask[i] == 1].int().tolist(), backward[i][mask[i] == 1].int().tolist()) for i in range(len(ids))
        ]
        assert at_own == expected, trial
        spans["forward"] += any(any(f) for f, _ in expected)
        spans["backward"] += any(any(b) for _, b in expected)
    assert min(spans.values()) > 20, spans  # the random groups do exercise both spans


# --- λ (Eq. 5) ---------------------------------------------------------------------------------


def test_lambda_values():
    forward = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).bool()
    backward = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()
    advantages = torch.tensor([0.5, -0.5, 0.0, 2.0])
    # the paper: M = M^fw ∨ M^bw; 2 inside for A > 0, 0 inside for A < 0, 1 outside
    weights_or = gtpo.conflict_weights(forward, backward, advantages, "or")
    assert weights_or.tolist() == [
        [2, 2, 2, 2],
        [0, 1, 1, 0],
        [1, 1, 1, 1],
        [2, 1, 1, 1],
    ]
    assert torch.equal(gtpo.conflict_weights(forward, backward, advantages), weights_or)  # the default: "or"
    # the authors' code: λ^fw · λ^bw, 4 where a positive completion's two spans overlap
    assert gtpo.conflict_weights(forward, backward, advantages, "product").tolist() == [
        [2, 4, 2, 2],
        [0, 1, 1, 0],
        [1, 1, 1, 1],
        [2, 1, 1, 1],
    ]


def test_lambda_is_built_in_the_advantages_dtype():
    """λ and the code's 1/n_i in float64 when the advantages are float64 (a float32 λ divided by n_i = 3
    carries a 3e-8 relative error into a float64 computation)."""
    forward = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    backward = torch.zeros_like(forward)
    for dtype in (torch.float64, torch.float32):
        weights = gtpo.conflict_weights(forward, backward, torch.tensor([1.0, -1.0], dtype=dtype))
        assert weights.dtype == dtype
    weights = gtpo.conflict_weights(forward, backward, torch.tensor([1.0, -1.0], dtype=torch.float64))
    assert (weights[0] / 3).tolist() == [2 / 3, 2 / 3, 2 / 3, 1 / 3]  # exact in float64


def test_lambda_from_masks_of_a_group():
    sequences, advantages, _ = GROUPS["different lengths"]
    tokens = [[ord(c) for c in s] for s in sequences]
    width = max(map(len, tokens))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    mask = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in tokens])
    weights = gtpo.conflict_weights(
        *gtpo.conflict_masks(ids, mask, torch.tensor(advantages), 4), torch.tensor(advantages)
    )
    assert weights[:, :6].tolist() == [[2, 2, 1, 1, 1, 2], [1, 2, 1, 1, 1, 1], [0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1]]


# --- ⟨H⟩_i, δ_i (Eq. 6) and the entropy shift ---------------------------------------------------


def test_completion_entropy_is_a_masked_mean():
    token_entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert gtpo.completion_entropy(token_entropy, mask).tolist() == [2.0, 4.0]


def test_entropy_filter_three_cases():
    ln2 = math.log(2)
    entropy = torch.tensor([0.1, ln2, 0.7, 2.0])  # 0.7 > ln 2 = 0.693
    # case 1: ⟨H⟩_ini > ln 2: every completion is kept
    assert gtpo.entropy_filter(entropy, 0.9).tolist() == [1, 1, 1, 1]
    # cases 2 and 3: ⟨H⟩_ini < ln 2: drop ⟨H⟩_i > ln 2, keep ⟨H⟩_i <= ln 2
    assert gtpo.entropy_filter(entropy, 0.5).tolist() == [1, 1, 0, 0]
    # ⟨H⟩_ini = ln 2 exactly is undefined in Eq. 6: no filter
    assert gtpo.entropy_filter(entropy, ln2).tolist() == [1, 1, 1, 1]
    # the authors' code: always on (whatever ⟨H⟩_ini); and off
    assert gtpo.entropy_filter(entropy, 0.9, mode="on").tolist() == [1, 1, 0, 0]
    assert gtpo.entropy_filter(entropy, 0.5, mode="off").tolist() == [1, 1, 1, 1]
    # the authors' code's threshold 0.7 (--entropy-threshold 0.7): 0.7 itself is kept, ln 2 < 0.7 kept
    assert gtpo.entropy_filter(entropy, 0.9, mode="on", threshold=0.7).tolist() == [1, 1, 1, 0]
    # auto compares ⟨H⟩_ini with the same threshold: 0.695 is above ln 2 (off) and below 0.7 (on)
    assert gtpo.entropy_filter(entropy, 0.695).tolist() == [1, 1, 1, 1]
    assert gtpo.entropy_filter(entropy, 0.695, threshold=0.7).tolist() == [1, 1, 1, 0]
    assert gtpo.entropy_filter(entropy.double(), 0.5).dtype == torch.float64  # δ_i in ⟨H⟩_i's dtype


def test_entropy_threshold_flag_is_checked_and_there_is_no_kl():
    """--entropy-filter on --entropy-threshold 0.7 (the authors' configuration) parses and is checked; GTPO
    has no KL term and no reference model, so no --kl-coef."""
    args = flags.make(gtpo.Args, entropy_filter="on", entropy_threshold=0.7)
    gtpo.check_args(args)
    with pytest.raises(ValueError, match="entropy-threshold"):
        gtpo.check_args(flags.make(gtpo.Args, entropy_threshold=0.0))
    assert "kl_coef" not in {field.name for field in dataclasses.fields(gtpo.Args)}


def test_advantage_shift_by_hand_and_detached():
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5])
    entropy = torch.tensor([0.5, 0.2, 0.3, 0.9], requires_grad=True)
    delta = torch.tensor([1.0, 1.0, 1.0, 0.0])
    shaped = gtpo.shaped_advantages(advantages, entropy, delta, entropy_coef=0.1)
    # δ_i (A_i − γ⟨H⟩_i): zero-advantage completions get −γ⟨H⟩_i, filtered ones nothing
    torch.testing.assert_close(shaped, torch.tensor([0.95, -1.02, -0.03, 0.0]))
    assert not shaped.requires_grad  # no gradient flows through the entropy


# --- balance (§5.1): what the positives gain inside the mask is what the negatives lose ------------


@pytest.mark.parametrize("rewards, scale", [([1.0, 1.0, 1.0, 0.0], False), ([1.0, 0.0, 0.0, 0.0, 0.0, 1.0], True)])
def test_balance_on_a_shared_prefix_and_suffix(rewards, scale):
    """Completions of equal length that share their first and last tokens (so ∇log π is the same there).
    The push −∂loss/∂log π on the shared tokens: GRPO's sums to zero over the group (the conflict);
    GTPO's drops the negatives and doubles the positives, and the two amounts are equal."""
    advantages = gtpo.compute_advantages(torch.tensor([rewards]), scale).flatten()
    sequences = ["<" + chr(ord("a") + i) * 3 + EOS for i in range(len(rewards))]
    ids = torch.tensor([[ord(c) for c in s] for s in sequences])
    mask = torch.ones(ids.shape)
    forward, backward = gtpo.conflict_masks(ids, mask, advantages, len(rewards))
    masked = forward | backward
    assert masked[:, 0].all() and masked[:, -1].all() and not masked[:, 1:-1].any()

    def push(weights):
        logprobs = torch.zeros(ids.shape, requires_grad=True)
        token_losses, _, _ = gtpo.clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, 0.2, 0.28)
        totals = {"tokens": mask.sum(), "sequences": len(rewards)}
        gtpo.aggregate(token_losses * weights, mask, "sequence-mean", totals).backward()
        return -logprobs.grad

    gtpo_push = push(gtpo.conflict_weights(forward, backward, advantages))
    grpo_push = push(torch.ones(ids.shape))
    positive, negative = advantages > 0, advantages < 0
    for column in (0, ids.shape[1] - 1):
        assert grpo_push[:, column].sum().item() == pytest.approx(0, abs=1e-7)  # GRPO: the conflict cancels out
        gained = (gtpo_push - grpo_push)[positive, column].sum()  # extra push up from the positives
        lost = (grpo_push.abs() - gtpo_push.abs())[negative, column].sum()  # push down the negatives no longer give
        assert gained.item() == pytest.approx(lost.item()) and gained > 0
        # the group's total signal magnitude is preserved: Σ_i λ_it |A_i| = Σ_i |A_i|
        assert gtpo_push[:, column].abs().sum().item() == pytest.approx(grpo_push[:, column].abs().sum().item())
        assert (gtpo_push[negative, column] == 0).all()
    torch.testing.assert_close(gtpo_push[:, 1:-1], grpo_push[:, 1:-1])  # unmasked tokens are untouched


# --- the whole update through padding and micro-batches vs. brute force --------------------------


def _copy(tiny):
    model = type(tiny[0])(tiny[0].config)
    model.load_state_dict(tiny[0].state_dict())
    return model


def _rollouts(tokenizer):
    """Two groups of four: shared first digits and EOS give forward and backward conflicts."""
    prompts, completions = two_group_rollouts(tokenizer, ("3$", "12", "4$", "31$", "96$", "9", "91$", "906$"))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    return prompts, completions, rewards


def _batch(tokenizer):
    prompts, completions, rewards = _rollouts(tokenizer)
    batch = gtpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = gtpo.compute_advantages(rewards).flatten()
    return prompts, completions, batch


def _brute_force_entropy(model, prompts, completions, group=4):
    """⟨H⟩_i and log π per completion, each sequence on its own (no padding)."""
    entropies, logprobs = [], []
    for i, completion in enumerate(completions):
        prompt, response = prompts[i // group], completion.token_ids
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logp_all = torch.log_softmax(logits, -1)
        logprobs.append(logp_all.gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
        entropies.append(-(logp_all.exp() * logp_all).sum(-1).mean().detach())
    return torch.stack(entropies), logprobs


def _update(model, batch, args, initial_entropy, module=gtpo):
    """One update_policy call with plain SGD at lr 1: returns the StepMetrics it recorded into and −Δweights
    (= the gradient with one update per batch)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = StepMetrics()
    common = (optimizer, scheduler, batch, args, CPU, precision())
    if module is gtpo:
        skipped = gtpo.update_policy(model, *common, metrics, initial_entropy)
    else:
        skipped = grpo.update_policy(model, None, *common, metrics)  # no reference model
    assert skipped == 0
    return metrics, {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "combine, filter_mode, aggregation",
    [("or", "auto", "sequence-mean"), ("product", "auto", "sequence-mean"), ("or", "off", "token-mean")],
)
def test_update_matches_eq7_by_brute_force(tiny, combine, filter_mode, aggregation):
    """update_policy (padding, trimmed micro-batches, ⟨H⟩_i from the loss's own forward, δ_i, the shift,
    λ, 1/G Σ 1/|o_i|) against Eq. 7 written out per sequence; with the filter off (δ_i = 1) and DAPO's token mean
    (1/Σ|o_i|) too."""
    _, tokenizer = tiny
    prompts, completions, batch = _batch(tokenizer)
    forward, backward = gtpo.conflict_masks(batch["response_ids"], batch["response_mask"], batch["advantages"], 4)
    weights = gtpo.conflict_weights(forward, backward, batch["advantages"], combine)
    assert (weights == 0).any() and (weights >= 2).any()  # the example has masked negatives and positives
    # the threshold halfway between the 4th and 5th of the eight completion entropies filters some completions and
    # keeps others whatever the built model: ln 2 (the default) did only by a margin of 0.07 nats (0.76 vs 0.37-0.51 on
    # one build), which another processor's build need not keep
    entropies = _brute_force_entropy(_copy(tiny), prompts, completions)[0].sort().values
    threshold = (entropies[3] + entropies[4]).item() / 2
    initial_entropy = threshold / 2  # below the threshold: the filter is on
    args = flags.make(
        gtpo.Args, group_size=4, micro_batch_size=3, max_grad_norm=1e9, entropy_coef=0.1, mask_combine=combine,
        entropy_filter=filter_mode, loss_aggregation=aggregation,
    )  # fmt: skip
    args.entropy_threshold = threshold
    torch.manual_seed(0)
    metrics, step = _update(_copy(tiny), batch, args, initial_entropy)
    logged = metrics.reduce()
    assert torch.equal(batch["conflict_weights"], weights)
    tokens = batch["response_mask"].sum().item()
    assert (
        logged["conflict/forward_fraction"],
        logged["conflict/backward_fraction"],
        logged["conflict/masked_fraction"],
    ) == (forward.sum().item() / tokens, backward.sum().item() / tokens, (forward | backward).sum().item() / tokens)
    assert logged["charts/entropy_ini"] == initial_entropy

    model = _copy(tiny)
    entropy, logprobs = _brute_force_entropy(model, prompts, completions)
    delta = (entropy <= threshold).float()
    assert 0 < delta.sum() < len(delta)  # the example has filtered and kept completions
    delta = delta if filter_mode == "auto" else torch.ones_like(delta)
    assert logged["charts/filtered_fraction"] == (len(delta) - delta.sum().item()) / len(delta)
    torch.testing.assert_close(batch["completion_entropy"], entropy, rtol=1e-5, atol=1e-6)
    assert logged["charts/completion_entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)
    objective, tokens = 0.0, sum(len(logprob) for logprob in logprobs)
    for i, logprob in enumerate(logprobs):
        shaped = delta[i] * (batch["advantages"][i] - 0.1 * entropy[i])
        normalizer = tokens if aggregation == "token-mean" else len(logprob) * len(logprobs)
        objective = objective + shaped * (weights[i, : len(logprob)] * logprob).sum() / normalizer
    (-objective).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(step[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_completions_that_do_not_train_are_not_in_the_entropy_statistics(tiny):
    """A row with no token to train (--mask-truncated, dynamic sampling's filler groups) has ⟨H⟩_i = 0 by the
    masked mean: it is left out of charts/completion_entropy and charts/filtered_fraction (it lowered the one and
    counted as kept in the other)."""
    _, tokenizer = tiny
    prompts, completions, rewards = _rollouts(tokenizer)
    batch = gtpo.make_batch(
        prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"), [True] * 4 + [False] * 4
    )
    batch["advantages"] = gtpo.compute_advantages(rewards).flatten()
    entropy = _brute_force_entropy(_copy(tiny), prompts, completions)[0][:4]
    threshold = entropy.sort().values[1:3].mean().item()  # two of the four that train filtered
    args = flags.make(gtpo.Args, group_size=4, micro_batch_size=3, max_grad_norm=1e9, entropy_filter="on")
    args.entropy_threshold = threshold
    logged = _update(_copy(tiny), batch, args, initial_entropy=2 * threshold)[0].reduce()
    assert logged["charts/completion_entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert logged["charts/filtered_fraction"] == 2 / 4


def test_authors_configuration_matches_their_loss_by_brute_force(tiny):
    """--no-scale-advantages --mask-combine product --divide-by-conflict-count --entropy-filter on (the authors'
    code) against their loss written out per sequence: λ^fw·λ^bw from the spans of §5.1's definition, divided by
    n_i = max(|M^fw_i|, |M^bw_i|, 1), and δ_i = [⟨H⟩_i <= threshold] although ⟨H⟩_ini is above it. These
    completions have spans of two tokens (n_i = 2), which the example above lacks (all its n_i are 1), and the
    threshold drops two of the eight completions, so charts/filtered_fraction (2/8) is not the kept fraction."""
    _, tokenizer = tiny
    responses = ("123$", "124$", "5$", "96$", "41$", "51$", "7$", "8")  # one character, one token
    prompts, completions = two_group_rollouts(tokenizer, responses)
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
    advantages = [r - sum(group) / len(group) for group in rewards for r in group]  # centred, not scaled
    batch = gtpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = torch.tensor(advantages)
    # λ_it / n_i by hand from the definition's spans
    weights, counts = torch.ones(batch["response_mask"].shape), []
    for g in range(2):
        spans = masks_from_definition(responses[4 * g : 4 * g + 4], advantages[4 * g : 4 * g + 4])
        for i, (forward, backward) in enumerate(spans, start=4 * g):
            inside = 2.0 if advantages[i] > 0 else 0.0
            counts.append(max(sum(forward), sum(backward), 1))
            for t, (f, b) in enumerate(zip(forward, backward)):
                weights[i, t] = (inside if f else 1.0) * (inside if b else 1.0) / counts[-1]
    assert counts == [2, 2, 1, 1, 2, 2, 1, 1]

    model = _copy(tiny)
    entropy, logprobs = _brute_force_entropy(model, prompts, completions)
    threshold = entropy.sort().values[5:7].mean().item()  # halfway between the 6th and 7th: two dropped
    delta = (entropy <= threshold).float()
    assert delta.sum() == 6
    # of the four completions with n_i = 2, three have a λ ≠ 0: at least one of them is kept
    assert any(delta[i] and counts[i] == 2 and weights[i].any() for i in range(8))
    args = flags.make(
        gtpo.Args,
        group_size=4,
        micro_batch_size=3,
        max_grad_norm=1e9,
        entropy_coef=0.1,
        scale_advantages=False,
        mask_combine="product",
        divide_by_conflict_count=True,
        entropy_filter="on",
    )
    args.entropy_threshold = threshold
    torch.manual_seed(0)
    metrics, step = _update(_copy(tiny), batch, args, initial_entropy=2 * threshold)
    logged = metrics.reduce()
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(batch["conflict_weights"][valid], weights[valid])
    assert logged["charts/filtered_fraction"] == 2 / 8
    objective = 0.0
    for i, logprob in enumerate(logprobs):
        shaped = delta[i] * (advantages[i] - 0.1 * entropy[i])
        objective = objective + shaped * (weights[i, : len(logprob)] * logprob).sum() / len(logprob) / len(logprobs)
    (-objective).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(step[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_several_updates_take_entropy_from_pi_old(tiny):
    """With several updates per batch, ⟨H⟩_i (and so δ_i and the shift) comes from the no-grad π_old pass,
    and is the same value the single-update path reads off its own forward."""
    _, tokenizer = tiny
    prompts, completions, batch = _batch(tokenizer)
    args = flags.make(gtpo.Args, group_size=4, micro_batch_size=3, num_minibatches=2, update_epochs=2, lr=1e-3)
    torch.manual_seed(0)
    metrics, _ = _update(_copy(tiny), batch, args, 0.5)
    expected, _ = _brute_force_entropy(_copy(tiny), prompts, completions)
    torch.testing.assert_close(batch["completion_entropy"], expected, rtol=1e-5, atol=1e-6)
    assert metrics.means["losses/grad_norm"][1] == 4  # four optimizer steps
    assert metrics.reduce()["losses/approx_kl"] > 0  # π_θ moved away from π_old within the batch


def test_without_its_components_gtpo_is_grpo(tiny):
    """λ ≡ 1, γ = 0, δ ≡ 1 and sequence-mean: the update is grpo.py's, bit for bit (several updates)."""
    _, tokenizer = tiny
    _, _, batch = _batch(tokenizer)
    common = dict(
        group_size=4, micro_batch_size=3, num_minibatches=2, update_epochs=2, lr=1e-3, loss_aggregation="sequence-mean"
    )
    torch.manual_seed(0)
    gtpo_metrics, gtpo_step = _update(
        _copy(tiny),
        dict(batch),
        flags.make(gtpo.Args, **common, conflict_masks=False, entropy_coef=0.0, entropy_filter="off"),
        0.5,
    )
    torch.manual_seed(0)
    grpo_metrics, grpo_step = _update(_copy(tiny), dict(batch), flags.make(grpo.Args, **common), None, module=grpo)
    gtpo_logged, grpo_logged = gtpo_metrics.reduce(), grpo_metrics.reduce()
    for key in ("losses/policy_loss", "losses/grad_norm"):
        assert gtpo_logged[key] == grpo_logged[key], key
    for name in gtpo_step:
        assert torch.equal(gtpo_step[name], grpo_step[name]), name


# --- ⟨H⟩_ini -----------------------------------------------------------------------------------


def test_initial_entropy_is_the_mean_of_completion_entropies(tiny):
    model, tokenizer = _copy(tiny), tiny[1]
    prompts = [tokenizer(f"Q: {a}+{a + 3}=")["input_ids"] for a in range(7)]
    engine = HFEngine(model, tokenizer)
    args = flags.make(gtpo.Args, micro_batch_size=3, max_new_tokens=6)
    torch.manual_seed(0)
    measured = gtpo.measure_initial_entropy(
        model, engine, prompts, args, CPU, torch.autocast("cpu", enabled=False), tokenizer.pad_token_id
    )
    torch.manual_seed(0)  # the same samples again
    completions = engine.generate(prompts, 1, 6, 1.0)
    with torch.no_grad():
        entropy, _ = _brute_force_entropy(model, prompts, completions, group=1)
    assert measured == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert 0 < measured < math.log(len(tokenizer))


@pytest.mark.parametrize("top_k, top_p, keep", [(2, 1.0, True), (0, 0.6, True), (2, 1.0, False)])
def test_initial_entropy_is_of_the_policy_the_run_samples_under_top_k(tiny, top_k, top_p, keep):
    """Under --top-k or --top-p with the sampling mask kept, ⟨H⟩_i is the entropy of π renormalised over the kept ids,
    and so is ⟨H⟩_ini: its completions are sampled as the run's rollouts are, and scored with their mask (each token's
    entropy at most ln 2 under top-k 2; the full vocabulary's, which it was, is no statistic ⟨H⟩_i is ever compared
    with). With --no-keep-sampling-mask the run's π is the whole vocabulary's, and so is ⟨H⟩_ini's."""
    from common.engines import truncate

    model, tokenizer = _copy(tiny), tiny[1]
    prompts = [tokenizer(f"Q: {a}+{a + 3}=")["input_ids"] for a in range(7)]
    engine = HFEngine(model, tokenizer)
    args = flags.make(
        gtpo.Args, micro_batch_size=3, max_new_tokens=6, top_k=top_k, top_p=top_p, keep_sampling_mask=keep
    )
    torch.manual_seed(0)
    measured = gtpo.measure_initial_entropy(
        model, engine, prompts, args, CPU, torch.autocast("cpu", enabled=False), tokenizer.pad_token_id
    )
    torch.manual_seed(0)  # the same samples again
    completions = engine.generate(prompts, 1, 6, 1.0, top_k=top_k, top_p=top_p, sampling_mask=keep)
    entropies = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            response = completion.token_ids
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            kept = truncate(logits, top_k, top_p) if keep else torch.ones_like(logits, dtype=torch.bool)
            logp = torch.log_softmax(logits.masked_fill(~kept, -math.inf), -1)  # π over the kept ids
            entropies.append(-(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1).mean())
    assert measured == pytest.approx(torch.stack(entropies).mean().item(), rel=1e-5)
    assert 0 < measured <= (math.log(2) if top_k == 2 and keep else math.log(len(tokenizer)))


def test_a_resumed_run_keeps_its_initial_entropy():
    """measure_initial_entropy given a checkpoint's value returns it and samples nothing."""

    class NoEngine:
        def generate(self, *args, **sampling):
            raise AssertionError("a resumed run must not measure ⟨H⟩_ini again")

    assert gtpo.measure_initial_entropy(None, NoEngine(), [[1]], gtpo.Args(), CPU, None, 0, entropy_ini=0.25) == 0.25


@pytest.mark.parametrize(
    "mode, initial, threshold, acts",
    [
        ("auto", 0.5, math.log(2), True),  # ⟨H⟩_ini < ln 2: Eq. 6's filter
        ("auto", 0.9, math.log(2), False),
        ("auto", math.log(2), math.log(2), False),  # equal: not below
        ("auto", 0.695, 0.7, True),  # the same threshold as δ_i's
        ("on", 0.9, math.log(2), True),  # the authors' code: whatever ⟨H⟩_ini
        ("off", 0.5, math.log(2), False),
    ],
)
def test_the_initial_entropy_line_says_whether_the_filter_acts(capsys, mode, initial, threshold, acts):
    """The line printed with ⟨H⟩_ini says whether δ_i will act, by Eq. 6's rule written out (on: always, off:
    never, auto: iff ⟨H⟩_ini < threshold), and says what entropy_filter then does; only the main rank prints. A
    resumed run's value (nothing sampled) is enough to check it."""
    args = flags.make(gtpo.Args, entropy_filter=mode, entropy_threshold=threshold)
    assert gtpo.measure_initial_entropy(None, None, [[1]], args, CPU, None, 0, entropy_ini=initial) == initial
    line = f"<H>_ini = {initial:.4f} (threshold {threshold:.4f}): entropy filter {'on' if acts else 'off'}\n"
    assert capsys.readouterr().out == line
    # the filter does what the line says: a completion above the threshold is dropped iff it acts
    assert gtpo.entropy_filter(torch.tensor([threshold + 1]), initial, mode, threshold).tolist() == [0 if acts else 1]
    other_rank = fsdp.Dist(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    assert gtpo.measure_initial_entropy(None, None, [[1]], args, other_rank, None, 0, entropy_ini=initial) == initial
    assert capsys.readouterr().out == ""


def entropy_one_for_prompt(model, micro, temperature, with_entropy=False, probe=0):
    """A stand-in for token_logprobs: entropy 1 on the response tokens of prompt `probe` (token 10 + probe), else 0."""
    return None, (micro["response_ids"] == 10 + probe).float()


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("count", [1, 5, 100])
def test_ranks_share_the_initial_entropy_prompts(monkeypatch, world_size, count):
    """⟨H⟩_ini over simulated ranks: every rank scores as many completions (so FSDP's collectives stay in
    step), the last share wrapping around, and over the ranks every prompt counts exactly once."""
    prompts = [[10 + i] for i in range(count)]  # prompt i is token 10 + i; its completion repeats it

    class Engine:
        def generate(self, prompts, n, max_new_tokens, temperature, **sampling):
            sizes.append(len(prompts))
            return [Completion(list(prompt), [0.0], "stop") for prompt in prompts]

    monkeypatch.setattr(gtpo.fsdp, "all_reduce", lambda total, dist: total)  # each rank's own sum
    args, no_autocast = flags.make(gtpo.Args, micro_batch_size=7), torch.autocast("cpu", enabled=False)
    for probe in range(count):  # ⟨H⟩_i is 1 for the completion of prompt `probe`, 0 for the others
        monkeypatch.setattr(gtpo, "token_logprobs", partial(entropy_one_for_prompt, probe=probe))
        sizes = []
        shares = [
            gtpo.measure_initial_entropy(
                None, Engine(), prompts, args, fsdp.Dist(rank, world_size, rank, torch.device("cpu")), no_autocast, 0
            )
            for rank in range(world_size)
        ]
        assert len(sizes) == world_size and len(set(sizes)) == 1  # as many completions on every rank
        assert sum(shares) == pytest.approx(1 / count, rel=1e-12), probe  # counted once over the ranks


@pytest.mark.parametrize(
    "world_size, sizes, widest",
    [
        (1, dict(prompts_per_step=1, group_size=4), 4),  # the long-response workload: 4 rows at a time, not 64
        (1, dict(), 64),  # the defaults (32 prompts × 8): --micro-batch-size
        (1, dict(prompts_per_step=4, group_size=4, num_minibatches=3), 6),  # minibatches of ⌈16 / 3⌉ rows
        (2, dict(prompts_per_step=2, group_size=4), 4),  # one prompt per rank
        (1, dict(prompts_per_step=8, group_size=4, micro_batch_size=5), 5),
    ],
)
def test_initial_entropy_takes_no_more_rows_at_once_than_the_update(monkeypatch, world_size, sizes, widest):
    """The ⟨H⟩_ini forward's micro-batches are no wider than the update's, whatever the 100 prompts: their
    [rows, heads, T, T] attention scores would otherwise set the run's peak memory at long responses."""
    seen = []

    def constant_entropy(model, micro, temperature, with_entropy=False):
        seen.append(len(micro["rows"]))
        return None, torch.full(micro["response_ids"].shape, 0.25)

    class Engine:
        def generate(self, prompts, n, max_new_tokens, temperature, **sampling):
            return [Completion(list(prompt), [0.0], "stop") for prompt in prompts]

    monkeypatch.setattr(gtpo, "token_logprobs", constant_entropy)
    monkeypatch.setattr(gtpo.fsdp, "all_reduce", lambda total, dist: total * world_size)  # every rank the same
    args, dist = flags.make(gtpo.Args, **sizes), fsdp.Dist(0, world_size, 0, torch.device("cpu"))
    value = gtpo.measure_initial_entropy(
        None, Engine(), [[10 + i] for i in range(100)], args, dist, torch.autocast("cpu", enabled=False), 0
    )
    assert max(seen) == widest and sum(seen) == 100 // world_size and value == 0.25


def test_initial_entropy_does_not_depend_on_how_the_rows_are_grouped(tiny):
    """The same samples scored 1, 2 and 7 rows at a time (prompts of different lengths: each micro-batch pads its
    own) give the same ⟨H⟩_ini, to float32 rounding."""
    model, tokenizer = _copy(tiny), tiny[1]
    prompts = [tokenizer(f"Q: {a * 37}+{a + 3}=")["input_ids"] for a in range(7)]
    engine, no_autocast = HFEngine(model, tokenizer), torch.autocast("cpu", enabled=False)
    measured = []
    for rows in (1, 2, 7):
        args = flags.make(gtpo.Args, prompts_per_step=1, group_size=rows, max_new_tokens=6)
        torch.manual_seed(0)  # the same samples each time
        measured.append(gtpo.measure_initial_entropy(model, engine, prompts, args, CPU, no_autocast, 0))
    assert measured[1] == pytest.approx(measured[0], rel=1e-6) and measured[2] == pytest.approx(measured[0], rel=1e-6)


# --- the script ---------------------------------------------------------------------------------

# 8 prompts: the authors' configuration moves π_θ in its second step unless all 16 groups of both steps had equal
# rewards, and a conflict needs a group whose rewards differ: all equal on 0.48^16 < 1e-5 of machines (helpers.py,
# reward signal; with 4 prompts on 0.3% of them)
SMALL = ["--prompts-per-step", 8, "--group-size", 4, "--eval-every", 0, "--entropy-ini-prompts", 20]
LOGGED = BASE_LOGGED + CLIP_LOGGED
GTPO_LOGGED = [
    "charts/completion_entropy",
    "charts/entropy_ini",
    "charts/filtered_fraction",
    "conflict/forward_fraction",
    "conflict/backward_fraction",
    "conflict/masked_fraction",
]


@pytest.mark.slow
def test_end_to_end_and_resume_keep_the_initial_entropy(tmp_path):
    """Three steps: GTPO's metrics, ⟨H⟩_ini measured once, printed and kept in the checkpoints. ⟨H⟩_ini belongs
    to the initial policy: a resumed run reads it from the checkpoint instead of measuring the trained one,
    and continues exactly."""
    flags = ["--save-every", 1, *SMALL, "--lr", 1e-3]
    result = run_script("algorithms/gtpo.py", "--steps", 3, "--output-dir", tmp_path / "straight", *flags)
    run_script("algorithms/gtpo.py", "--steps", 1, "--output-dir", tmp_path / "split", *flags)
    resumed = run_script(
        "algorithms/gtpo.py", "--steps", 3, "--output-dir", tmp_path / "split", "--resume", "auto", *flags
    )
    run_dir = only_run_dir(tmp_path / "straight")
    straight = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in straight] == [1, 2, 3]
    for record in straight:
        for key in LOGGED + GTPO_LOGGED:
            assert isinstance(record[key], float), key
        assert 0 <= record["charts/filtered_fraction"] <= 1
        assert (
            max(record["conflict/forward_fraction"], record["conflict/backward_fraction"])
            <= record["conflict/masked_fraction"]
            <= record["conflict/forward_fraction"] + record["conflict/backward_fraction"] + 1e-9
        )
        assert record["losses/ratio_max"] == 1.0  # one update per batch: π_θ = π_old exactly
    # arithmetic answers share digits and EOS: the largest step's fractions were 0.09-0.41 and 0.13-0.34 over run
    # seeds 1-2; none only if all 24 groups had equal rewards (SMALL)
    assert any(r["conflict/forward_fraction"] > 0 for r in straight)
    assert any(r["conflict/backward_fraction"] > 0 for r in straight)
    entropy_ini = straight[0]["charts/entropy_ini"]
    assert {r["charts/entropy_ini"] for r in straight} == {entropy_ini} and 0 < entropy_ini < math.log(100)
    assert f"<H>_ini = {entropy_ini:.4f}" in result.stdout
    checkpoint = os.path.join(run_dir, "checkpoints", "step_00000003")
    assert torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)["entropy_ini"] == entropy_ini

    split = read_jsonl(os.path.join(only_run_dir(tmp_path / "split"), "metrics.jsonl"))
    assert [r["step"] for r in split] == [1, 2, 3]
    for a, b in zip(straight, split):
        for key in (
            "charts/reward",
            "losses/policy_loss",
            "losses/grad_norm",
            "charts/entropy_ini",
            "charts/completion_entropy",
            "conflict/masked_fraction",
        ):
            assert a[key] == b[key], (a["step"], key)
    # the resumed run reports the checkpoint's value (measuring the trained policy would give another
    # value and consume the sampler's random numbers, so the run would not continue exactly)
    assert f"<H>_ini = {entropy_ini:.4f}" in resumed.stdout


@pytest.mark.slow
def test_authors_code_configuration_with_several_updates(tmp_path):
    run_script(
        "algorithms/gtpo.py",
        "--steps",
        2,
        "--output-dir",
        tmp_path,
        *SMALL,
        "--no-scale-advantages",
        "--mask-combine",
        "product",
        "--divide-by-conflict-count",
        "--entropy-filter",
        "on",
        "--num-minibatches",
        2,
        "--update-epochs",
        2,
        "--micro-batch-size",
        5,
        "--lr",
        1e-3,
    )
    last = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))[-1]
    assert last["losses/ratio_max"] > 1.0 or last["losses/ratio_min"] < 1.0  # π_θ moved away from π_old
    assert last["mismatch/max_abs_logprob_diff"] < 1e-3
    assert all(isinstance(last[key], float) for key in GTPO_LOGGED)


@pytest.mark.slow
def test_two_ranks_update_exactly_like_one_with_the_authors_options(tmp_path):
    """Groups stay whole on a rank, so λ and δ are local, and the sequence-mean is over the completions of
    all ranks: 1 process and 2 FSDP2 ranks (gloo) compute the same update from the same global batch, with
    δ_i on, the product of the spans' λ and 1/n_i (test_scripts.py runs the defaults)."""
    flags = [
        "gtpo",
        json.dumps(
            {"group_size": 4, "entropy_filter": "on", "mask_combine": "product", "divide_by_conflict_count": True}
        ),
    ]
    run_script("tests/distributed_update.py", tmp_path / "one.json", *flags)
    torchrun(2, "tests/distributed_update.py", tmp_path / "two.json", *flags)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one.keys() == two.keys() and one["losses/approx_kl"] > 0  # two epochs, the second off-policy
    assert set(GTPO_LOGGED) <= one.keys() and 0 < one["conflict/masked_fraction"] < 1
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-9), key
    weights_one, weights_two = (
        torch.load(tmp_path / "one.json.weights.pt"),
        torch.load(tmp_path / "two.json.weights.pt"),
    )
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_ranks_end_to_end(tmp_path):
    """FSDP2 over two gloo ranks: ⟨H⟩_ini on 5 prompts (3 + 2, one repeat excluded) and the updates stay in step."""
    torchrun(2, "algorithms/gtpo.py", "--steps", 2, "--output-dir", tmp_path, *SMALL[:-1], 5, "--num-minibatches", 2)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    assert all(isinstance(records[-1][key], float) for key in LOGGED + GTPO_LOGGED)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--entropy-coef", -0.1], "--entropy-coef must be >= 0"),
        (["--entropy-coef", "nan"], "--entropy-coef must be >= 0"),
        (["--entropy-ini-prompts", 0], "--entropy-ini-prompts must be >= 1"),
        (["--mask-combine", "xor"], "--mask-combine"),  # tyro's own message for a value outside the choices
        (["--entropy-filter", "maybe"], "--entropy-filter"),
    ],
)
def test_bad_gtpo_flags_get_a_clear_error(tmp_path, flags, message):
    result = run_script("algorithms/gtpo.py", "--output-dir", tmp_path, *flags, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
