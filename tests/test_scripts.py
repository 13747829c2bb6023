"""Checks every algorithm script gets, parametrized over the six files (a method's own math is tested in
its test_<method>.py)."""

import copy
import dataclasses
import importlib

import pytest
import torch

from common import fsdp
from common.rollout import Completion
from conftest import two_group_rollouts
from distributed_update import update_policy

ALGORITHMS = ["grpo", "ema_kpo", "p3o", "gtpo", "isopo", "tis_icepop"]
ONE_PROCESS = fsdp.Dist(0, 1, 0, torch.device("cpu"))


def _args(algorithm, **overrides):
    """The script's Args with sequence-mean aggregation where the script has the choice (ISOPO's loss is
    always a mean over sequences), one update and no gradient clipping."""
    fields = {f.name for f in dataclasses.fields(algorithm.Args)}
    values = {"group_size": 4, "lr": 0.5, "micro_batch_size": 16, "loss_aggregation": "sequence-mean",
              "num_minibatches": 1, "update_epochs": 1, "max_grad_norm": 1e9, **overrides}  # no clipping: it hides scale
    return algorithm.Args(**{k: v for k, v in values.items() if k in fields})


def _updated(algorithm, model, tokenizer, prompts, completions, rewards, args):
    """(weights after one update_policy on this batch, its statistics)."""
    policy = copy.deepcopy(model).train()
    batch = algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = algorithm.compute_advantages(torch.tensor(rewards).view(-1, 4)).flatten()
    stats = update_policy(algorithm, policy, batch, args, ONE_PROCESS)
    return {name: p.detach().clone() for name, p in policy.named_parameters()}, stats


@pytest.mark.parametrize("name", ALGORITHMS)
def test_empty_completions_add_nothing(name, tiny):
    """A group of empty completions (no response token) neither contributes nor dilutes the mean: the
    sequence-mean counts only the completions that have a token, so the update equals the one without it."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    empty = [Completion([], [], "length") for _ in range(4)]
    args = _args(algorithm)
    initial = dict(model.named_parameters())
    alone, _ = _updated(algorithm, model, tokenizer, prompts[:1], completions[:4], [1.0, 0.0, 0.0, 1.0], args)
    padded, _ = _updated(algorithm, model, tokenizer, prompts, completions[:4] + empty,
                         [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], args)
    for key, weight in alone.items():
        step, step_with_empty = weight - initial[key], padded[key] - initial[key]
        # float32 noise of another padding layout is ~1e-6 of a step; counting the empty rows halves it
        assert (step_with_empty - step).norm() <= 1e-4 * step.norm() + 1e-9, key
    assert alone["model.embed_tokens.weight"].ne(initial["model.embed_tokens.weight"]).any()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_minibatch_without_response_tokens_is_skipped_and_counted(name, tiny):
    """No response token in a minibatch (0/0 in a token mean): no NaN, no optimizer step, counted as skipped."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, _ = two_group_rollouts(tokenizer)
    empty = [Completion([], [], "length") for _ in range(8)]
    args = _args(algorithm, loss_aggregation="token-mean")
    weights, stats = _updated(algorithm, model, tokenizer, prompts, empty, [1.0, 0.0] * 4, args)
    for name_, p in model.named_parameters():
        assert torch.equal(weights[name_], p), name_
    assert stats["skipped"] == 1 and stats["updates"] == 0 and stats["loss"] == 0.0
