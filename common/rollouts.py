"""The machinery around a training step's rollouts: which prompts, and DAPO's dynamic sampling.

Each script makes its rollouts itself (its `rollout`: the engine's generate call, then every completion
scored against its row's gold answer); this module says which prompts a step uses and refills a batch:

    sampler = PromptSampler(prompts, rows, dist, prompts_per_step=32, seed=1, max_rounds=8)
    prompt_ids, rows = sampler.step_prompts(step)                      # this rank's share of step `step`
    groups = rollout(prompt_ids, rows)                                   # Groups: completions, rewards [prompts, G]
    groups = sampler.dynamic_sampling(groups, step, rollout, metrics)    # --dynamic-sampling
    record_rollouts(metrics, groups)                                     # charts/reward, accuracy, lengths

Step s takes the prompts `tasks.sample_batch` gives it (epochs of seeded permutations). With DAPO's dynamic
sampling (Yu et al. 2025, arXiv:2503.14476 §3.2), a group whose rewards are all equal has advantage 0 for
every completion and teaches nothing, yet under a token mean its tokens still dilute the gradient; such
groups are set aside and more prompts are drawn, round after round, until each rank holds
`prompts_per_step / world_size` groups whose rewards differ, or `max_rounds` rounds have been drawn. A batch
still short then is completed with set-aside groups, the earliest drawn first, which do not train (`trains`
False: no gradient, no token in the mean), so the update is made of what there is while every rank keeps the
same number of rows; the shortfall is counted. An extra round may draw a prompt this step has already drawn
(likely only on a task of a few hundred rows).

Determinism: round r ≥ 1 of step s draws from a permutation of the task seeded by (seed, s, r) alone, rank k
reading its own slice of it, so a resumed run draws exactly the prompts it would have drawn. The number of
rounds is agreed on by all ranks (one all-reduce per round), so every rank generates the same number of
times and holds the same number of groups, as FSDP's collectives need.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Callable

import torch

from common import fsdp
from common.tasks import sample_batch


@dataclass
class Groups:
    """Rollouts grouped by prompt: prompt i owns completions[i*G : (i+1)*G] and row i of `rewards`."""

    prompt_ids: list[list[int]]
    rows: list  # the task rows (question, gold answer)
    completions: list  # engines.Completion: token ids, the engine's log-probs, finish reason
    scores: list  # scoring.Score: correct, answer found
    rewards: torch.Tensor  # [prompts, G]: 1 for a correct answer, 0 otherwise, plus the overlong penalty (<= 0)
    trains: list[bool]  # per completion: whether its tokens train (make_batch's response mask)


def extra_round_indices(num_rows: int, seed: int, step: int, round_: int, start: int, count: int) -> list[int]:
    """Positions [start, start + count) of round `round_` ≥ 1 of step `step`: a seeded permutation of the
    task's rows, repeated if it is shorter than what is asked. A pure function of its arguments."""
    order = random.Random(f"dynamic-sampling/{seed}/{step}/{round_}").sample(range(num_rows), num_rows)
    return [order[position % num_rows] for position in range(start, start + count)]


class PromptSampler:
    """This rank's prompts for each training step, and DAPO's extra rounds (see the module docstring)."""

    def __init__(self, prompts, rows, dist, prompts_per_step: int, seed: int, max_rounds: int = 8):
        self.prompts, self.rows, self.dist = prompts, rows, dist
        self.prompts_per_step, self.seed, self.max_rounds = prompts_per_step, seed, max_rounds
        self.local_prompts = prompts_per_step // dist.world_size

    def step_prompts(self, step: int) -> tuple[list[list[int]], list]:
        """(prompt token ids, task rows) of this rank's share of training step `step`."""
        local, rank = self.local_prompts, self.dist.rank
        indices = sample_batch(len(self.rows), step, self.prompts_per_step, self.seed)
        indices = indices[rank * local : (rank + 1) * local]
        return [self.prompts[i] for i in indices], [self.rows[i] for i in indices]

    def dynamic_sampling(self, drawn: Groups, step: int, rollout: Callable[[list, list], Groups], metrics) -> Groups:
        """`drawn` (round 0) with its all-equal groups replaced by informative ones of extra rounds, each made
        by `rollout(prompt_ids, rows)`; records how in `metrics` (sampling/*)."""
        local, group_size = self.local_prompts, drawn.rewards.shape[1]
        kept, set_aside, generated, rounds = [], [], 0, 0
        while True:
            for group in _split(drawn):
                informative = bool(group.rewards.std() > 0)  # all-equal rewards: advantage 0, no signal
                (kept if informative and len(kept) < local else set_aside).append(group)
            generated, rounds = generated + len(drawn.completions), rounds + 1
            missing = local - len(kept)
            if rounds == self.max_rounds or fsdp.all_reduce(missing, self.dist) == 0:
                break
            # the next round asks for the missing groups divided by the share of informative ones drawn
            # so far (at most a full batch), so that one more round is usually enough
            share = len(kept) / (generated / group_size)
            count = 0 if missing == 0 else local if share == 0 else min(local, math.ceil(missing / share))
            start = self.dist.rank * local
            indices = extra_round_indices(len(self.rows), self.seed, step, rounds, start, count)
            if indices:
                drawn = rollout([self.prompts[i] for i in indices], [self.rows[i] for i in indices])
            else:  # this rank is full: it generates nothing, and still counts the round with the others
                drawn = Groups([], [], [], [], torch.zeros(0, group_size), [])
        fillers = [dataclasses.replace(g, trains=[False] * len(g.trains)) for g in set_aside[:missing]]
        metrics.set("sampling/rounds", rounds)  # the same on every rank
        metrics.sum("sampling/groups_discarded", len(set_aside) - len(fillers))  # generated, not trained on
        metrics.sum("sampling/groups_short", len(fillers))  # at the round cap: all-equal fillers, not trained
        return _join(kept + fillers)


def record_rollouts(metrics, groups: Groups) -> None:
    """What the engine sampled this step (the batch's groups): the reward and how it came about (charts/*)."""
    completions, scores, rewards = groups.completions, groups.scores, groups.rewards
    lengths, rollouts = torch.tensor([c.policy_length for c in completions]), len(scores)  # EOS in, tool outputs out
    metrics.mean("charts/reward", rewards.sum(), rollouts)
    metrics.mean("charts/accuracy", sum(s.correct for s in scores), rollouts)
    metrics.mean("charts/no_answer_rate", sum(not s.found for s in scores), rollouts)  # no answer to extract
    metrics.mean("charts/response_length_mean", lengths.sum(), rollouts)
    metrics.max("charts/response_length_max", lengths)
    metrics.mean("charts/truncation_rate", sum(c.finish_reason == "length" for c in completions), rollouts)
    # groups whose rewards are all equal: their advantages are 0, they carry no signal
    metrics.mean("charts/zero_std_group_fraction", (rewards.std(dim=1) == 0).sum(), len(rewards))


def _split(groups: Groups) -> list[Groups]:
    """One Groups per prompt."""
    G = groups.rewards.shape[1]
    return [
        Groups(
            [groups.prompt_ids[i]],
            [groups.rows[i]],
            groups.completions[i * G : (i + 1) * G],
            groups.scores[i * G : (i + 1) * G],
            groups.rewards[i : i + 1],
            groups.trains[i * G : (i + 1) * G],
        )
        for i in range(len(groups.rows))
    ]


def _join(parts: list[Groups]) -> Groups:
    """The groups of `parts` in order, as one Groups."""
    return Groups(
        [p for g in parts for p in g.prompt_ids],
        [r for g in parts for r in g.rows],
        [c for g in parts for c in g.completions],
        [s for g in parts for s in g.scores],
        torch.cat([g.rewards for g in parts]),
        [t for g in parts for t in g.trains],
    )
