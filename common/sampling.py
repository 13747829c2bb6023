"""A training step's rollouts: which prompts, G completions for each, and their rewards.

    sampler = GroupSampler(engine, tokenizer, prompts, rows, dist, prompts_per_step=32, group_size=8,
                           max_new_tokens=16, temperature=1.0, seed=1, task="arith", dynamic=True)
    groups = sampler.draw(step, metrics)   # groups.completions, groups.rewards [prompts, G], ...

Round 0 of step s takes the prompts `reward.sample_batch` gives step s (epochs of seeded permutations).
With `dynamic=True` (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476 §3.2), a group whose
rewards are all equal has advantage 0 for every completion and teaches nothing, yet under a token mean
its tokens still dilute the gradient; such groups are set aside and more prompts are drawn, round after
round, until each rank holds `prompts_per_step / world_size` groups whose rewards differ, or
`max_rounds` rounds have been drawn. A batch still short then is completed with set-aside groups, the
earliest drawn first, which do not train (`trains` False: no gradient, no token in the mean), so the
update is made of what there is while every rank keeps the same number of rows; the shortfall is counted.
An extra round may draw a prompt this step has already drawn (likely only on a task of a few hundred rows).

Determinism: round r ≥ 1 of step s draws from a permutation of the task seeded by (seed, s, r) alone,
rank k reading its own slice of it, so a resumed run draws exactly the prompts it would have drawn.
The number of rounds is agreed on by all ranks (one all-reduce per round), so every rank generates the
same number of times and holds the same number of groups, as FSDP's collectives need.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from common import fsdp
from common.evaluate import score_completions
from common.reward import overlong_penalty, sample_batch


@dataclass
class Groups:
    """This rank's groups: prompt i owns completions[i*G : (i+1)*G] and row i of `rewards`."""

    prompt_ids: list[list[int]]
    rows: list  # the task rows (question, gold answer)
    completions: list  # rollout.Completion
    scores: list  # reward.Score: correct, answer found
    rewards: torch.Tensor  # [prompts, G]: 1 for a correct answer, 0 otherwise, plus the overlong penalty (<= 0)
    trains: list[bool]  # per completion: whether its tokens train (make_batch's response mask)


def extra_round_indices(num_rows: int, seed: int, step: int, round_: int, start: int, count: int) -> list[int]:
    """Positions [start, start + count) of round `round_` ≥ 1 of step `step`: a seeded permutation of the
    task's rows, repeated if it is shorter than what is asked. A pure function of its arguments."""
    order = random.Random(f"dynamic-sampling/{seed}/{step}/{round_}").sample(range(num_rows), num_rows)
    return [order[position % num_rows] for position in range(start, start + count)]


class GroupSampler:
    """Draws each training step's groups for this rank (see the module docstring); `task`: how answers are
    checked (`common.reward.score`); `overlong_buffer`: DAPO's L_cache (0: no length penalty);
    `mask_truncated`: completions cut off by the length limit do not train (DAPO's overlong filtering)."""

    def __init__(
        self,
        engine,
        tokenizer,
        prompts,
        rows,
        dist,
        prompts_per_step: int,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        *,
        task: str,
        overlong_buffer: int = 0,
        mask_truncated: bool = False,
        dynamic: bool = False,
        max_rounds: int = 8,
    ):
        self.engine, self.tokenizer, self.prompts, self.rows, self.dist = engine, tokenizer, prompts, rows, dist
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.task, self.overlong_buffer, self.mask_truncated = task, overlong_buffer, mask_truncated
        self.dynamic, self.max_rounds = dynamic, max_rounds
        self.local_prompts = prompts_per_step // dist.world_size

    def rollout(self, indices: list[int]) -> Groups:
        """G completions for each prompt in `indices`, scored (rewards on the CPU)."""
        prompt_ids, rows = [self.prompts[i] for i in indices], [self.rows[i] for i in indices]
        completions = []
        if indices:  # a rank that is already full asks for nothing in a round
            completions = self.engine.generate(prompt_ids, self.group_size, self.max_new_tokens, self.temperature)
        scores = score_completions(completions, rows, self.group_size, self.tokenizer, self.task)
        rewards = [
            s.reward + overlong_penalty(len(c.token_ids), self.max_new_tokens, self.overlong_buffer)
            for s, c in zip(scores, completions)
        ]
        rewards = torch.tensor(rewards, dtype=torch.float32).view(-1, self.group_size)
        trains = [not (self.mask_truncated and c.finish_reason == "length") for c in completions]
        return Groups(prompt_ids, rows, completions, scores, rewards, trains)

    def draw(self, step: int, metrics) -> Groups:
        """This rank's groups for training step `step`; records how they were drawn in `metrics`."""
        rank, local = self.dist.rank, self.local_prompts
        indices = sample_batch(len(self.rows), step, self.prompts_per_step, self.seed)
        drawn = self.rollout(indices[rank * local : (rank + 1) * local])
        if not self.dynamic:
            metrics.sum("sampling/rollouts", drawn.rewards.numel())  # completions generated, all ranks
            return _join([drawn], self.dist.device)
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
            share = len(kept) / (generated / self.group_size)
            count = 0 if missing == 0 else local if share == 0 else min(local, math.ceil(missing / share))
            drawn = self.rollout(extra_round_indices(len(self.rows), self.seed, step, rounds, rank * local, count))
        fillers = [dataclasses.replace(g, trains=[False] * len(g.trains)) for g in set_aside[: local - len(kept)]]
        groups = _join(kept + fillers, self.dist.device)
        metrics.set("sampling/rounds", rounds)  # the same on every rank
        metrics.sum("sampling/rollouts", generated)  # completions generated, all ranks
        metrics.sum("sampling/groups_discarded", len(set_aside) - (local - len(kept)))  # generated, not trained on
        metrics.sum("sampling/groups_short", local - len(kept))  # at the round cap: all-equal fillers, not trained
        return groups


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


def _join(parts: list[Groups], device) -> Groups:
    """The groups of `parts` in order, as one Groups whose rewards are on `device`."""
    return Groups(
        [p for g in parts for p in g.prompt_ids],
        [r for g in parts for r in g.rows],
        [c for g in parts for c in g.completions],
        [s for g in parts for s in g.scores],
        torch.cat([g.rewards for g in parts]).to(device),
        [t for g in parts for t in g.trains],
    )
