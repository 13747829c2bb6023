"""The machinery around a training step's rollouts: which prompts, DAPO's dynamic sampling, and from which weights.

Each script makes its rollouts itself (its `rollout`: the engine's generate call, then every completion
scored against its row's gold answer); this module says which prompts a step uses, refills a batch, and queues
batches sampled ahead of the step that trains on them:

    queue = RolloutQueue(systems, dist, pad_id, trainer_state, engine)   # --rollout-lag k (and a checkpoint's queue)
    queue.sample(step, sample_batch, metrics)   # step's batch, or step + k's at lag k: sample_batch(ahead, metrics)
    groups = queue.take(step, metrics)          # sampled k steps ago
    record_rollouts(metrics, groups)            # charts/reward, accuracy, lengths
    ...                                         # the update
    queue.finish_sampling(metrics)              # --overlap-rollouts: the batch sampled beside the update
    engine.load_weights(...)

A script's `sample_batch` takes this rank's share of a step's prompts (`sampler.step_prompts`), samples and scores
them (its `rollout`), and with DAPO's dynamic sampling replaces all-equal groups (`sampler.dynamic_sampling`).
Each batch is sampled inside `engine.seeded(step)`: its completions are a function of the run's seed, the rank,
the step and the weights alone.

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

Rollouts from older weights (--rollout-lag k). An asynchronous pipeline samples while its trainer updates, so the
trainer's step t learns from rollouts that the weights of step t − k sampled (verl's one-step-off-policy trainer
is k = 1). The same data come from a synchronous loop with no copy of the weights: step t samples the batch of step
t + k with its own weights θ_t and trains on the batch it sampled k steps ago, from a queue of k batches. Step 0
samples the batches of steps 0..k with θ_0, so step t < k trains on θ_0's (a lag of t). The last k steps sample too,
batches no step of the run trains on, so that a run resumed with more --steps continues exactly as one started with
them. A step's prompts are the same at any lag, and what a batch's sampling records (sampling/*, tools/*) is
logged with the step that trains on it, beside its charts/*. The weights still reach the engine after every step, so an
evaluation scores the trained policy. The queue is this rank's share, and part of the checkpoint (exact resume).
Each method treats the engine's policy μ as its paper does; what changes is how far μ is from π_θ. The mismatch
log π_old/μ then has two parts, as Zheng et al. (2025, arXiv:2512.01374) split it:
log π_s/μ, the engine against the trainer at the sampling weights θ_s (precision, kernels; and a sampling
distribution of its own, such as P3O's --sampling-temperature), and log π_old/π_s, the weights' change since
(staleness). For the split the trainer scores each queued batch once more, under θ_s, while
it still holds θ_s (`score_under_sampling_weights`): one forward pass per step, at lag > 0 only.

Overlapped (--overlap-rollouts, at lag k ≥ 1): step t's batch of step t + k is sampled on a thread of its own while
step t's update runs, as an asynchronous pipeline's engine samples beside its trainer. The engine keeps its own copy
of the weights (θ_t, until the push after the update); the transformers engine's copy also scores the batch under
θ_t on the sampler's thread (it computes as the trainer did at θ_t). The step waits for the batch before the push
(`finish_sampling`). The batches, and so every metric, are those of the synchronous run at lag k: the sampling
draws from its own seeded streams, never from the generators the trainer's minibatches draw from. vLLM's copy
computes μ, not the trainer's π: overlapped on vLLM, the split of the mismatch is not logged (the mismatch as a
whole is). At most one batch is in flight, and none at a checkpoint. Each side runs the thread count the process has
(bit-equal numbers: CPU kernels may round otherwise at another count); a second rank's dynamic-sampling all-reduce
goes through a process group of its own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from common import fsdp, moe
from common.batches import make_batch
from common.tasks import Row, sample_batch
from common.tracking import StepMetrics


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

    def __init__(self, data, dist, prompts_per_step: int, seed: int, max_rounds: int = 8):
        """`data`: the run's prompts (common.tasks.RunPrompts: its training rows and their prompt ids)."""
        self.prompts, self.rows, self.dist = data.prompts, data.train_rows, dist
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
                # all-equal rewards: advantage 0, no signal (compared, not by their std: float32's std of eight
                # 0.8s is 6e-8)
                informative = bool(group.rewards.max() > group.rewards.min())
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
    all_equal = rewards.amax(dim=1) == rewards.amin(dim=1)
    metrics.mean("charts/zero_std_group_fraction", all_equal.sum(), len(rewards))


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


@dataclass
class Queued:
    """A batch sampled ahead: the step that trains on it, the step whose weights sampled it, and its rollouts."""

    step: int
    sampled_at: int
    groups: Groups
    metrics: StepMetrics | None = None  # what its sampling recorded (sampling/*, tools/*), logged at `step`


class RolloutQueue:
    """--rollout-lag k: this rank's batches sampled ahead of the steps that train on them (the module docstring)."""

    def __init__(self, systems, dist, pad_id: int, trainer_state: dict | None = None, engine=None):
        """`systems`: common.flags.Systems (--rollout-lag, --overlap-rollouts). `trainer_state`: a checkpoint's
        (load_checkpoint's), whose "this_rank" entry holds this rank's queue. `engine`: the one `sample` samples
        with (its seeded streams; overlapped, its copy of the weights scores the batches)."""
        self.lag, self.dist, self.pad_id, self.step, self.engine = systems.rollout_lag, dist, pad_id, 0, engine
        self.queued: list[Queued] = []
        self.sampling: dict[int, StepMetrics] = {}  # the metrics of the batches being sampled, by step
        overlap = systems.overlap_rollouts and self.lag > 0
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="sampler") if overlap else None
        self.in_flight = None  # overlapped: the future of the batches sampling beside the update
        # overlapped: score_under_sampling_weights' (batch_logprobs, options), with which the sampler's thread scores
        # the batches it sampled, on the engine's copy (scorer_ready: given this step, or none will be)
        self.scorer, self.scorer_ready = None, threading.Event()
        # overlapped, the module that scores a batch beside the update: the transformers engine's copy (vLLM has none)
        self.scoring_copy = getattr(engine, "model", None)
        # the sampler thread's collectives (dynamic sampling's all-reduce) on a group of their own: the trainer's
        # run at the same time on the default one
        self.group = fsdp.new_cpu_group(dist) if overlap and dist.world_size > 1 else None
        saved = (trainer_state or {}).get("this_rank")
        if saved and saved["world_size"] == dist.world_size:
            self.queued = list(saved["queued"])
        elif saved and saved["queued"] and dist.is_main:  # another rank's share: sampled again, lag 0 onwards
            print(f"note: the {len(saved['queued'])} batches sampled ahead were {saved['world_size']} ranks' "
                  f"shares; they are sampled again, with the resumed weights")  # fmt: skip

    def steps_to_sample(self, step: int, metrics: StepMetrics) -> list[tuple[int, StepMetrics]]:
        """The steps whose batches step `step` samples, with the weights it starts from: its own at lag 0; at lag k,
        step + k (and at the first step, or after a resume on another number of ranks, the ones before it). Each
        comes with the metrics its sampling records into: `metrics`, the step's own, at lag 0; at lag k the batch's
        own, which the step that trains on it logs (`take`)."""
        self.step = step
        first = self.queued[-1].step + 1 if self.queued else step
        if not self.lag:
            return [(step, metrics)]
        self.sampling = {ahead: StepMetrics() for ahead in range(first, step + self.lag + 1)}
        return list(self.sampling.items())

    def sample(self, step: int, sample_batch: Callable[[int, StepMetrics], Groups], metrics: StepMetrics) -> None:
        """Samples and queues the batches step `step` samples (steps_to_sample), each `sample_batch(ahead, its
        metrics)` inside the engine's seeded stream of step `ahead`. Overlapped: the ones of later steps on the
        sampler's thread, beside this step's update, queued by `finish_sampling`."""
        later = []
        for ahead, batch_metrics in self.steps_to_sample(step, metrics):
            if self.worker and ahead > step:
                later.append((ahead, batch_metrics))
            else:
                self.put(ahead, self._sampled(sample_batch, ahead, batch_metrics))
        if later:
            pushed = None
            if self.dist.device.type == "cuda":  # the sampler's kernels: on a stream of their own, after the push
                pushed = torch.cuda.Event()
                pushed.record()
            self.scorer_ready.clear()
            job = self.worker.submit(self._sample_beside, sample_batch, later, pushed)
            self.in_flight = (job, sample_batch, later)

    def _sampled(self, sample_batch, ahead: int, batch_metrics: StepMetrics) -> Groups:
        with self.engine.seeded(ahead) if self.engine is not None else contextlib.nullcontext():
            return sample_batch(ahead, batch_metrics)

    def _sample_beside(self, sample_batch, steps: list[tuple[int, StepMetrics]], pushed=None):
        """On the sampler's thread: [(step, its batch)], each scored under its sampling weights on the engine's copy
        once the step has said how (score_under_sampling_weights), and how long they took. `pushed`: a CUDA event
        after the last weight push, which the sampler's own stream waits for (the update's go on on the default)."""
        start = time.perf_counter()
        stream = None
        if pushed is not None:
            stream = torch.cuda.Stream(self.dist.device)
            stream.wait_event(pushed)
        with fsdp.collectives_on(self.group), torch.cuda.stream(stream):  # (None: the current stream)
            sampled = [(ahead, self._sampled(sample_batch, ahead, batch_metrics)) for ahead, batch_metrics in steps]
            self.scorer_ready.wait()
            if self.scorer is not None:
                batch_logprobs, options = self.scorer
                # an autocast context of its own: one object entered on two threads keeps one thread's state
                options = [copy.copy(o) if isinstance(o, torch.autocast) else o for o in options]
                for _, groups in sampled:
                    self._score_groups(groups, batch_logprobs, self.scoring_copy, options)
        return sampled, time.perf_counter() - start

    def finish_sampling(self, metrics: StepMetrics) -> None:
        """Overlapped: waits for the batches sampled (and scored) beside this step's update (time/rollout_wait;
        time/rollout_overlapped, the sampling itself) and queues them. Synchronous: nothing to do.

        An error on the sampler's thread (a task file's score() that raises) comes after this step's update, when
        the weights the step started from are in the engine's copy alone: the batches are sampled (and scored) again
        on this thread, by every rank, from the same weights and seeded streams (the same batches, unless the error
        recurs). One that recurs ends the run as an error after an update does: its newest checkpoint holds it."""
        if self.in_flight is None:
            return
        start = time.perf_counter()
        self.scorer_ready.set()  # a step that gave no scorer: the sampler's thread waits for none
        (future, sample_batch, steps), self.in_flight = self.in_flight, None
        error = future.exception()
        if fsdp.all_reduce(float(error is not None), self.dist):  # any rank's: every rank samples again (collectives)
            if error is not None:
                failed = f"{type(error).__name__}: {error}"
                print(f"warning: sampling beside the update failed ({failed}); sampled again", file=sys.stderr)
            self.sampling |= {ahead: StepMetrics() for ahead, _ in steps}  # what the failed attempt recorded: dropped
            sampled, took = self._sample_beside(sample_batch, [(a, self.sampling[a]) for a, _ in steps])
        else:
            sampled, took = future.result()
        metrics.set("time/rollout_wait", time.perf_counter() - start)
        metrics.set("time/rollout_overlapped", took)
        for ahead, groups in sampled:
            self.put(ahead, groups)

    def put(self, step: int, groups: Groups) -> None:
        """The batch of step `step`, sampled now (with the weights step `self.step` started from)."""
        self.queued.append(Queued(step, self.step, groups, self.sampling.pop(step, None)))

    def take(self, step: int, metrics: StepMetrics) -> Groups:
        """The batch step `step` trains on; records its lag, charts/rollout_lag, and what its sampling recorded
        (lag > 0)."""
        queued = self.queued.pop(0)
        assert queued.step == step, f"the queue holds step {queued.step}'s batch, not step {step}'s"
        if self.lag:
            metrics.set("charts/rollout_lag", step - queued.sampled_at)  # the same on every rank
            metrics.merge(queued.metrics or StepMetrics())
        return queued.groups

    def score_under_sampling_weights(self, batch_logprobs, model, *options) -> None:
        """At lag > 0, while the trainer still holds the weights that sampled them: each queued batch's log-probs
        under the trainer (a script's `batch_logprobs(model, batch, *options)[0]`: [B, T], no gradient) kept with its
        completions (trainer_logprobs), for the split of the mismatch (`record_staleness`). A script calls it in the
        step that sampled them, before its update: a batch the updates have passed is refused, not scored wrongly.
        Overlapped, the batch in flight is scored on the sampler's thread, on the engine's copy, with these options;
        overlapped on vLLM, no batch is (the module docstring)."""
        if self.worker is not None and self.scoring_copy is None:
            return
        if self.worker is not None:
            self.scorer = (batch_logprobs, options)
            self.scorer_ready.set()
        self._score(batch_logprobs, model, options)

    def _score(self, batch_logprobs, model, options) -> None:
        for queued in self.queued if self.lag else []:
            completions = queued.groups.completions
            if not completions or completions[0].trainer_logprobs is not None:
                continue
            if queued.sampled_at != self.step:  # the weights that sampled it are gone: its split would be wrong
                raise RuntimeError(
                    f"step {queued.step}'s batch, sampled in step {queued.sampled_at}, is scored in step {self.step}: "
                    "call queue.score_under_sampling_weights in the step that samples, before update_policy"
                )
            self._score_groups(queued.groups, batch_logprobs, model, options)

    def _score_groups(self, groups: Groups, batch_logprobs, model, options) -> None:
        """Each completion's trainer_logprobs: batch_logprobs(model, the groups' batch, *options)."""
        if not groups.completions:
            return
        group_size, device = groups.rewards.shape[1], self.dist.device
        batch = make_batch(groups.prompt_ids, groups.completions, group_size, self.pad_id, device)
        # an MoE engine's routing, as the step's batch holds it, for a method that replays it
        routed = moe.batch_routing(groups.prompt_ids, groups.completions, group_size, batch)
        batch |= {"engine_routing": routed} if routed is not None else {}
        for completion, logprobs in zip(groups.completions, batch_logprobs(model, batch, *options)[0].cpu()):
            completion.trainer_logprobs = logprobs[: len(completion.token_ids)].tolist()

    def state(self) -> dict:
        """What a checkpoint keeps of this rank's queue: its batches, each row as its question and answer alone. A
        task file's row may hold objects of the file's own classes, which pickle names by the module the file was
        imported as, and that name depends on the file's path: a resume from another folder could not load them. A
        scored batch needs neither."""
        bare = lambda rows: [Row(row.question, row.answer) for row in rows]  # noqa: E731
        queued = [
            dataclasses.replace(q, groups=dataclasses.replace(q.groups, rows=bare(q.groups.rows))) for q in self.queued
        ]
        return {"world_size": self.dist.world_size, "queued": queued}


def record_staleness(metrics, batch, old_logprobs: torch.Tensor) -> None:
    """--rollout-lag: the train-inference mismatch k3 KL(μ ‖ π_old) split in two (the module docstring), over the
    response tokens of `batch` (or of a micro-batch): mismatch/kl_k3_discrepancy, k3 with ρ = π_s/μ (the engine
    against the trainer, both at the sampling weights θ_s), and mismatch/kl_k3_staleness, k3 with ρ = π_old/π_s. Not
    at lag 0, nor for the batch of step 0 (sampled and trained at once, its staleness is 0)."""
    at_sampling = batch.get("sampling_weights_logprobs")
    if at_sampling is None:
        return
    mask = batch["response_mask"]
    for part, log_ratio in (
        ("discrepancy", at_sampling - batch["sampler_logprobs"]),
        ("staleness", old_logprobs.detach() - at_sampling),
    ):
        k3 = torch.exp(log_ratio) - 1 - log_ratio
        metrics.mean(f"mismatch/kl_k3_{part}", (k3 * mask).sum(), mask.sum())
