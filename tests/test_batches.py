"""common/batches.py: rollouts as padded tensors, and micro-batches trimmed of the padding they do not need."""

import dataclasses

import torch
from helpers import two_group_rollouts

from common.batches import make_batch, micro_batches


def test_micro_batches_trim_padding(tiny):
    _, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    batch = make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    assert batch["input_ids"].shape == (8, len(prompts[1]) + 4)  # longest response: "906<eos>"
    (micro,) = micro_batches(batch, torch.tensor([0, 2]), 2)  # short prompt, responses of length 2
    assert micro["input_ids"].shape == (2, len(prompts[0]) + 2)
    assert micro["attention_mask"].all() and micro["response_mask"].all()
    assert micro["position_ids"][0].tolist() == list(range(len(prompts[0]) + 2))
    # a fork's own per-token tensor is trimmed like the response mask, with no list to extend
    batch["token_weights"] = torch.arange(8 * 4.0).view(8, 4)
    batch["advantages"] = torch.arange(8.0)
    (micro,) = micro_batches(batch, torch.tensor([0, 2]), 2)
    assert torch.equal(micro["token_weights"], batch["token_weights"][[0, 2], :2])
    assert torch.equal(micro["advantages"], torch.tensor([0.0, 2.0]))


def test_micro_batches_sorted_by_length_cover_every_row_and_pad_little():
    """A GSM8K-like mix of response lengths (log-normal around 300 tokens, a few near 4k): sorted within the
    minibatch, micro-batches hold every row once and pad far less than in random order."""
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.randn(256, generator=generator) * 0.6 + 5.6).exp().clamp(20, 4096).long()
    lengths[:3] = 4096  # truncated responses
    mask = (torch.arange(4096)[None, :] < lengths[:, None]).float()
    batch = {
        "input_ids": torch.ones(256, 4106, dtype=torch.long),
        "attention_mask": torch.ones(256, 4106),
        "response_ids": torch.ones(256, 4096, dtype=torch.long),
        "response_mask": mask,
    }
    order = torch.randperm(256, generator=generator)

    def padded_over_useful(by_length):
        micros = list(micro_batches(batch, order, 8, by_length=by_length))
        assert sorted(torch.cat([m["rows"] for m in micros]).tolist()) == list(range(256))
        return sum(m["response_mask"].numel() for m in micros) / mask.sum().item()

    shuffled, sorted_ = padded_over_useful(False), padded_over_useful(True)
    print(f"padded / useful response tokens: random order {shuffled:.2f}, sorted {sorted_:.3f}")
    assert sorted_ < 1.25 and shuffled > 2  # measured: 1.18 and 2.70


def test_the_trainer_log_probs_at_the_sampling_weights_are_padded_like_the_engines(tiny):
    """--rollout-lag: each completion's trainer_logprobs (common/rollouts.py) become [B, T] beside the engine's,
    0 past each response's end; a batch with one completion unscored has none (step 0's, or lag 0)."""
    _, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    assert "sampling_weights_logprobs" not in make_batch(prompts, completions, 4, 0, torch.device("cpu"))
    scored = [
        dataclasses.replace(c, trainer_logprobs=[-(i + 1.0)] * len(c.token_ids)) for i, c in enumerate(completions)
    ]
    batch = make_batch(prompts, scored, 4, 0, torch.device("cpu"))
    expected = torch.tensor(
        [[-(i + 1.0)] * len(c.token_ids) + [0.0] * (4 - len(c.token_ids)) for i, c in enumerate(scored)]
    )
    assert torch.equal(batch["sampling_weights_logprobs"], expected)
    assert 0 < (expected == 0).sum() < expected.numel()  # some responses are shorter than the longest
    scored[3] = completions[3]
    assert "sampling_weights_logprobs" not in make_batch(prompts, scored, 4, 0, torch.device("cpu"))
