"""A step's rollouts as padded tensors, and the micro-batches a forward pass takes.

    batch = make_batch(prompt_ids, completions, group_size, pad_id, device, trains)
    for micro in micro_batches(batch, minibatch_rows, micro_batch_size):
        logprobs, _ = token_logprobs(policy, micro, temperature)       # [rows, response columns]

Each row is one completion, [left-padded prompt | right-padded response], so every response starts in the
same column and the per-token tensors ([B, T]: the response mask, the engine's log-probs, the old and
reference log-probs a script adds) line up with `response_ids`; per-row tensors ([B]: the advantages) are
sliced by row only. The
response mask is 1 on the tokens that train: the policy's own tokens (a tool's output is context), of the
completions the sampler lets train (`trains`). A micro-batch is trimmed of the columns that are padding in
all of its rows, so its cost follows its own longest sequence, not the batch's.
"""

from __future__ import annotations

import torch

from common.engines import sampling_masks
from common.tools import later_turns


def make_batch(prompt_ids, completions, group_size, pad_id, device, trains=None):
    """Rollouts as tensors: [left-padded prompt | right-padded response]; position ids
    skip padding. The response mask marks the tokens that train: the policy's own (not a
    tool's output), of every completion or of those whose `trains` entry is True (the
    sampler's: not a completion cut off with --mask-truncated, nor a filler group of a
    batch left short by dynamic sampling)."""
    prompt_width = max(len(p) for p in prompt_ids)
    response_width = max(len(c.token_ids) for c in completions)
    rows, masks, response_masks, sampler_logprobs, turns = [], [], [], [], []
    for index, completion in enumerate(completions):
        prompt, response = prompt_ids[index // group_size], completion.token_ids
        left, right = prompt_width - len(prompt), response_width - len(response)
        rows.append([pad_id] * left + prompt + response + [pad_id] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        # a tool's output is context: no loss, no ratio, no statistic (common/tools.py)
        tool = completion.tool_mask or [0] * len(response)
        response_masks.append([int((trains is None or trains[index]) and not t) for t in tool] + [0] * right)
        turns.append(later_turns(completion) + [0] * right)
        sampler_logprobs.append(completion.logprobs + [0.0] * right)
    attention_mask = torch.tensor(masks, device=device)
    input_ids = torch.tensor(rows, device=device)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_ids": input_ids[:, prompt_width:],
        "response_mask": torch.tensor(response_masks, device=device).float(),
        "sampler_logprobs": torch.tensor(sampler_logprobs, device=device),
    }
    if all(c.trainer_logprobs is not None for c in completions):  # --rollout-lag (common/rollouts.py)
        at_sampling = [c.trainer_logprobs + [0.0] * (response_width - len(c.token_ids)) for c in completions]
        batch["sampling_weights_logprobs"] = torch.tensor(at_sampling, device=device)
    if any(c.tool_mask is not None for c in completions):  # tools: 1 after the first tool output
        batch["later_turns"] = torch.tensor(turns, device=device).float()
    # top-p / top-k: the ids kept per position [B, T, K]
    kept = sampling_masks(completions, response_width, device)
    return batch | ({"sampling_mask": kept} if kept is not None else {})


def micro_batches(batch, indices, size, by_length=True):
    """Slices of the batch, each trimmed of columns that are padding in all of its rows: the
    sequence tensors [B, prompt + response] and every per-response-token tensor [B, response]
    alike. by_length: rows sorted by response length first, so a long response does not pad many
    short ones (token sums do not depend on the order)."""
    full_width, response_width = batch["input_ids"].shape[1], batch["response_ids"].shape[1]
    if by_length:
        indices = indices[batch["response_mask"][indices].sum(1).argsort(descending=True, stable=True)]
    for start in range(0, len(indices), size):
        rows = indices[start : start + size]
        micro = {"rows": rows, **{k: v[rows] for k, v in batch.items()}}
        first = int(micro["attention_mask"].any(0).nonzero()[0])  # leftmost non-pad prompt column
        columns = micro["response_mask"].any(0).nonzero()
        width = int(columns[-1]) + 1 if len(columns) else 0  # rightmost response column
        for key, value in micro.items():
            if value.dim() >= 2 and value.shape[1] == full_width:  # [B, prompt + response, ...]
                micro[key] = value[:, first : full_width - response_width + width]
            elif value.dim() >= 2 and value.shape[1] == response_width:
                micro[key] = value[:, :width]
        yield micro
