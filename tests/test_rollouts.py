"""A step's rollouts (grpo.py's `rollout`, common/rollouts.py's sampler), with and without DAPO's dynamic sampling,
on a scripted engine
(which groups are informative is chosen per call), then on two ranks and through a resumed run."""

import contextlib
import dataclasses
import io
import json
import math
import os
import threading

import pytest
import torch
from distributed_rollouts import ScriptedEngine, scripted_step
from helpers import assert_same_run, one_process, only_run_dir, read_jsonl, run_script, torchrun

from common.flags import Systems
from common.rollouts import extra_round_indices, record_rollouts
from common.scoring import overlong_penalty
from common.tasks import sample_batch
from common.tracking import StepMetrics

ONE_PROCESS = one_process()
NO_AUTOCAST = contextlib.nullcontext()
LOCAL, G, STEP = 8, 4, 5  # prompts per step, completions per prompt, the step drawn


def draw(engine, **options):
    metrics = StepMetrics()
    groups = scripted_step(engine, ONE_PROCESS, STEP, metrics, prompts_per_step=LOCAL, group_size=G, **options)
    return groups, metrics.reduce()


def test_without_dynamic_sampling_a_step_is_its_sample_batch_prompts():
    engine = ScriptedEngine(lambda call, prompt: prompt % 2 == 0)
    groups, logged = draw(engine)
    assert engine.calls == [sample_batch(100, STEP, LOCAL, seed=3)]
    assert [p[0] for p in groups.prompt_ids] == engine.calls[0] and len(groups.completions) == LOCAL * G
    assert groups.rewards.shape == (LOCAL, G)
    assert logged == {"sampling/rollouts": LOCAL * G}


def test_dynamic_sampling_replaces_all_equal_groups_until_the_batch_is_full():
    # round 0: every group all wrong; later rounds: the even prompts are informative
    engine = ScriptedEngine(lambda call, prompt: call > 0 and prompt % 2 == 0)
    groups, logged = draw(engine, dynamic_sampling=True)
    assert engine.calls[0] == sample_batch(100, STEP, LOCAL, seed=3)
    assert engine.calls[1] == extra_round_indices(100, 3, STEP, 1, 0, LOCAL)  # nothing informative yet: a full round
    assert len(groups.rows) == LOCAL and bool((groups.rewards.std(dim=1) > 0).all())
    kept = [p[0] for p in groups.prompt_ids]
    drawn_later = [p for call in engine.calls[1:] for p in call]
    assert kept == [p for p in drawn_later if p % 2 == 0][:LOCAL]  # in the order they were drawn
    generated_groups = sum(len(call) for call in engine.calls)
    assert logged["sampling/rounds"] == len(engine.calls) > 1
    assert logged["sampling/rollouts"] == G * generated_groups
    assert logged["sampling/groups_discarded"] == generated_groups - LOCAL
    assert logged["sampling/groups_short"] == 0


def test_a_group_of_equal_fractional_rewards_is_set_aside_and_counted_as_all_equal():
    """--overlong-buffer 5: eight wrong completions of 6 tokens each score −0.6 each, a std of 6e-8 in float32, not
    0. Dynamic sampling sets such groups aside as it does groups of 0s, and charts/zero_std_group_fraction counts
    them."""
    engine = ScriptedEngine(lambda call, prompt: call > 0 and prompt % 2 == 0, length=lambda call, prompt, j: 6)
    options = dict(prompts_per_step=LOCAL, group_size=8, overlong_buffer=5)
    metrics = StepMetrics()
    groups = scripted_step(engine, ONE_PROCESS, STEP, metrics, dynamic_sampling=True, **options)
    assert len(engine.calls) > 1 and bool((groups.rewards.amax(dim=1) > groups.rewards.amin(dim=1)).all())
    metrics, all_wrong = StepMetrics(), ScriptedEngine(lambda call, prompt: False, engine.length)
    round_0 = scripted_step(all_wrong, ONE_PROCESS, STEP, metrics, **{**options, "prompts_per_step": 1})
    assert bool((round_0.rewards == -0.6).all())
    record_rollouts(metrics, round_0)
    assert metrics.reduce()["charts/zero_std_group_fraction"] == 1


def test_an_extra_round_asks_for_the_missing_groups_over_the_informative_share():
    informative_in_round_0 = set(sample_batch(100, STEP, LOCAL, seed=3)[:6])  # 6 of 8: share 3/4, 2 missing
    engine = ScriptedEngine(lambda call, prompt: call > 0 or prompt in informative_in_round_0)
    groups, logged = draw(engine, dynamic_sampling=True)
    assert [len(call) for call in engine.calls] == [LOCAL, math.ceil(2 / 0.75)]
    assert logged["sampling/groups_discarded"] == 2 + 1  # round 0's all-equal groups, round 1's spare one
    assert [p[0] for p in groups.prompt_ids] == sample_batch(100, STEP, LOCAL, seed=3)[:6] + engine.calls[1][:2]


def test_at_the_round_cap_the_batch_is_completed_with_the_earliest_all_equal_groups():
    engine = ScriptedEngine(lambda call, prompt: call == 1 and prompt == engine.calls[1][0])  # one informative group
    groups, logged = draw(engine, dynamic_sampling=True, max_sampling_rounds=3)
    assert len(engine.calls) == 3
    assert [p[0] for p in groups.prompt_ids] == [engine.calls[1][0]] + engine.calls[0][: LOCAL - 1]
    assert logged["sampling/rounds"] == 3 and logged["sampling/groups_short"] == LOCAL - 1
    assert groups.trains == [True] * G + [False] * (LOCAL - 1) * G  # the fillers do not train
    assert logged["sampling/groups_discarded"] == 3 * LOCAL - LOCAL


def test_extra_rounds_depend_only_on_seed_step_and_round():
    first = extra_round_indices(50, seed=1, step=7, round_=2, start=0, count=30)
    assert first == extra_round_indices(50, seed=1, step=7, round_=2, start=0, count=30)
    assert len(set(first)) == 30  # a permutation: no prompt twice in a round
    assert extra_round_indices(50, 1, 7, 2, start=10, count=5) == first[10:15]  # rank 1's slice of the same round
    for other in ((2, 7, 2), (1, 8, 2), (1, 7, 3)):
        assert extra_round_indices(50, *other, start=0, count=30) != first
    assert extra_round_indices(3, 1, 7, 2, start=0, count=7)[3:6] == extra_round_indices(3, 1, 7, 2, start=0, count=3)
    # two samplers (a run and its resumption) draw the same prompts for the same step
    calls = []
    for _ in range(2):
        engine = ScriptedEngine(lambda call, prompt: call > 0 and prompt % 3 == 0)
        draw(engine, dynamic_sampling=True)
        calls.append(engine.calls)
    assert calls[0] == calls[1]


def test_rewards_carry_the_overlong_penalty_and_truncated_completions_can_be_left_out():
    lengths = {0: 3, 1: 5, 2: 8, 3: 4}  # max_new_tokens 8, buffer 4: penalty from the 5th token, -1 at the 8th
    engine = ScriptedEngine(lambda call, prompt: True, length=lambda call, prompt, j: lengths[j])
    groups, _ = draw(engine, overlong_buffer=4)
    torch.testing.assert_close(groups.rewards[0], torch.tensor([1.0, -0.25, -1.0, 0.0]))
    assert [c.finish_reason for c in groups.completions[:4]] == ["stop", "stop", "length", "stop"]
    assert all(groups.trains)
    masked, _ = draw(engine, overlong_buffer=4, mask_truncated=True)  # still in the rewards, not trained
    torch.testing.assert_close(masked.rewards, groups.rewards)
    assert masked.trains == [True, True, False, True] * LOCAL


@pytest.mark.parametrize(
    "length, penalty",
    [
        (0, 0.0),
        (12, 0.0),  # up to L_max − L_cache = 12: nothing
        (13, -0.25),
        (14, -0.5),
        (15, -0.75),  # ((L_max − L_cache) − |y|) / L_cache
        (16, -1.0),  # |y| = L_max: the whole punishment
        (17, -1.0),
        (40, -1.0),  # beyond L_max: −1 (Eq. 13's third case)
    ],
)
def test_overlong_penalty_is_dapo_eq_13_at_the_buffer_edges(length, penalty):
    assert overlong_penalty(length, max_new_tokens=16, buffer=4) == pytest.approx(penalty)
    assert overlong_penalty(length, max_new_tokens=16, buffer=0) == 0.0  # off


def test_two_ranks_draw_the_same_number_of_rounds(tmp_path):
    """Rank 0 is full after round 0, rank 1 after round 2: both count 3 rounds (rank 0 generating nothing
    more), each holds its 4 groups, and the metrics reduced over ranks are the same on both."""
    torchrun(2, "tests/distributed_rollouts.py", tmp_path / "out")
    ranks = [json.load(open(tmp_path / f"out.rank{r}.json")) for r in range(2)]
    assert [r["rounds"] for r in ranks] == [3, 3]
    assert [len(r["calls"]) for r in ranks] == [1, 3]
    assert [(r["groups"], r["informative"]) for r in ranks] == [(4, 4), (4, 4)]
    assert ranks[0]["logged"] == ranks[1]["logged"]
    assert ranks[0]["logged"]["sampling/groups_short"] == 0
    assert ranks[0]["logged"]["sampling/rollouts"] == 4 * sum(len(c) for r in ranks for c in r["calls"])


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_at_lag_k_step_t_trains_on_the_batch_sampled_at_step_t_minus_k(lag, capsys):
    """The queue's schedule over 5 steps: step 0 samples steps 0..k, each later step samples step + k (the last k
    steps too, batches a longer resumed run trains on), and step t takes the batch sampled at max(0, t − k), with
    what that batch's sampling recorded (sampling/*), not what this step's sampling did. A checkpoint's queue
    continues where it stopped on as many ranks (the batches' metrics kept); on another number it is sampled again."""
    from common.rollouts import Groups, RolloutQueue
    from common.tasks import Row

    def batch(step):  # a batch that says which step it was sampled for
        return Groups([[step]], [Row(f"Q: {step}", "0")], [], [], torch.zeros(1, 1), [])

    def sample(queue, step):
        metrics = StepMetrics()
        for ahead, batch_metrics in queue.steps_to_sample(step, metrics):
            assert (batch_metrics is metrics) == (lag == 0)  # on-policy: the step's own
            batch_metrics.sum("sampling/rollouts", 100 + ahead)
            batch_metrics.max("sampling/longest", ahead)
            sampled.append((step, ahead))
            queue.put(ahead, batch(ahead))
        assert queue.take(step, metrics).prompt_ids == [[step]]
        return metrics.reduce()

    queue, sampled, logged = RolloutQueue(Systems(rollout_lag=lag), ONE_PROCESS, 0), [], []
    for step in range(5):
        logged.append(sample(queue, step))
    assert sampled == [(0, s) for s in range(lag + 1)] + [(t, t + lag) for t in range(1, 5)]
    assert [r.get("charts/rollout_lag", 0) for r in logged] == [min(t, lag) for t in range(5)]
    assert ("charts/rollout_lag" in logged[-1]) == (lag > 0)  # not logged on-policy
    assert [(r["sampling/rollouts"], r["sampling/longest"]) for r in logged] == [(100 + t, t) for t in range(5)]
    checkpoint = io.BytesIO()  # as a checkpoint keeps the queue
    torch.save(queue.state(), checkpoint)
    checkpoint.seek(0)
    resumed, sampled = (
        RolloutQueue(
            Systems(rollout_lag=lag), ONE_PROCESS, 0, {"this_rank": torch.load(checkpoint, weights_only=False)}
        ),
        [],
    )
    assert sample(resumed, 5)["sampling/rollouts"] == 105 and sampled == [(5, 5 + lag)]
    two_ranks = queue.state() | {"world_size": 2}  # another rank's share: dropped, said, sampled again
    other = RolloutQueue(Systems(rollout_lag=lag), ONE_PROCESS, 0, {"this_rank": two_ranks})
    assert [ahead for ahead, _ in other.steps_to_sample(5, StepMetrics())] == list(range(5, 5 + lag + 1))
    assert ("sampled again" in capsys.readouterr().out) == (lag > 0)


class _SeededEngine:
    """An engine that records which step's sampling stream each batch was sampled in, and on which thread."""

    def __init__(self, model=None):
        self.model, self.streams = model, []

    @contextlib.contextmanager
    def seeded(self, step):
        self.streams.append((step, threading.current_thread().name))
        yield


def _marked_batch(step):
    from common.rollouts import Groups
    from common.tasks import Row

    return Groups([[step]], [Row(f"Q: {step}", "0")], [], [], torch.zeros(1, 1), [])


@pytest.mark.parametrize("lag", [1, 2])
def test_an_overlapped_queue_samples_later_steps_beside_the_update_and_queues_what_the_synchronous_one_does(lag):
    """queue.sample: the batch a step trains on at once, on the trainer's thread; with --overlap-rollouts the later
    steps' on the sampler's thread, queued by finish_sampling (time/rollout_wait, time/rollout_overlapped), each in
    the engine's stream of its own step. Step by step, the queue holds and hands out what the synchronous one does,
    each batch with what its own sampling recorded."""
    from common.rollouts import RolloutQueue

    def sample_batch(ahead, metrics):
        metrics.sum("sampling/rollouts", 100 + ahead)
        return _marked_batch(ahead)

    runs = {}
    for overlap in (False, True):
        engine = _SeededEngine()
        queue, taken = (
            RolloutQueue(Systems(rollout_lag=lag, overlap_rollouts=overlap), ONE_PROCESS, 0, None, engine),
            [],
        )
        for step in range(4):
            metrics = StepMetrics()
            queue.sample(step, sample_batch, metrics)
            taken.append(queue.take(step, metrics).prompt_ids)
            queue.finish_sampling(metrics)
            logged = metrics.reduce()
            assert ("time/rollout_overlapped" in logged) == overlap and ("time/rollout_wait" in logged) == overlap
            assert 0 <= logged.get("time/rollout_wait", 0) < 60 and 0 <= logged.get("time/rollout_overlapped", 0) < 60
            taken.append(logged["sampling/rollouts"])
            taken.append([(q.step, q.sampled_at, q.groups.prompt_ids) for q in queue.state()["queued"]])
        runs[overlap] = taken, engine.streams
    assert runs[True][0] == runs[False][0]
    engineless = RolloutQueue(Systems(rollout_lag=lag), ONE_PROCESS, 0)  # a queue without an engine samples as it is
    engineless.sample(0, sample_batch, StepMetrics())
    assert [q.step for q in engineless.queued] == list(range(lag + 1))
    assert [step for step, _ in runs[True][1]] == [step for step, _ in runs[False][1]] == list(range(4 + lag))
    assert {thread for _, thread in runs[False][1]} == {"MainThread"}
    assert runs[True][1][0][1] == "MainThread" and {t for _, t in runs[True][1][1:]} == {"sampler_0"}


def test_a_batch_whose_sampling_beside_the_update_failed_is_sampled_again(capsys):
    """An error on the sampler's thread (a task file's score() that raises) surfaces after the update: the batch is
    sampled again on the trainer's thread, in the same stream, what the failed attempt recorded dropped; an error
    that recurs is raised there."""
    from common.rollouts import RolloutQueue

    failures = {1: 1, 2: 2}  # step 1's sampling fails once, step 2's twice

    def sample_batch(ahead, metrics):
        metrics.sum("sampling/rollouts", 1)
        if failures.get(ahead, 0) > 0:
            failures[ahead] -= 1
            raise ValueError(f"score() failed on step {ahead}")
        return _marked_batch(ahead)

    engine = _SeededEngine()
    queue = RolloutQueue(Systems(rollout_lag=1, overlap_rollouts=True), ONE_PROCESS, 0, None, engine)
    queue.sample(0, sample_batch, StepMetrics())
    queue.take(0, StepMetrics())
    queue.finish_sampling(StepMetrics())
    assert "ValueError: score() failed on step 1" in capsys.readouterr().err
    assert engine.streams == [(0, "MainThread"), (1, "sampler_0"), (1, "MainThread")]
    metrics = StepMetrics()
    queue.sample(1, sample_batch, metrics)
    assert queue.take(1, metrics).prompt_ids == [[1]]
    assert metrics.reduce()["sampling/rollouts"] == 1  # the second attempt's alone
    with pytest.raises(ValueError, match="failed on step 2"):
        queue.finish_sampling(metrics)


def test_an_overlapped_batch_is_scored_on_the_engines_copy_before_the_push(tiny):
    """Overlapped, the batch in flight arrives after the update: finish_sampling scores it under its sampling
    weights on the engine's copy, which holds them until the push, with the options score_under_sampling_weights was
    given; the trainer's module, which has moved on, scores nothing. So it is when the sampler's attempt failed and the
    trainer's thread sampled it again. An engine without a module of its own (vLLM) scores no batch: no split."""
    from helpers import two_group_rollouts

    from algorithms import grpo
    from common import flags
    from common.batches import make_batch
    from common.rollouts import Groups, RolloutQueue

    model, tokenizer = tiny
    moved = type(model)(model.config)  # the trainer after its update: other weights
    prompts, completions = two_group_rollouts(tokenizer)
    args = flags.make(grpo.Args, micro_batch_size=3)

    failures = []

    def sample_batch(ahead, metrics):
        if failures and threading.current_thread() is not threading.main_thread():
            failures.pop()  # the sampler's attempt fails: the trainer's thread samples again
            raise RuntimeError("a score() that raised")
        fresh = [dataclasses.replace(c) for c in completions]
        return Groups(prompts, [None, None], fresh, [None] * 8, torch.zeros(2, 4), [True] * 8)

    expected = grpo.batch_logprobs(
        model, make_batch(prompts, completions, 4, 0, torch.device("cpu")), args, NO_AUTOCAST
    )
    for fail_first in (False, True):
        failures[:] = [1] if fail_first else []
        queue = RolloutQueue(Systems(rollout_lag=1, overlap_rollouts=True), ONE_PROCESS, 0, None, _SeededEngine(model))
        queue.sample(0, sample_batch, StepMetrics())
        queue.take(0, StepMetrics())
        queue.score_under_sampling_weights(grpo.batch_logprobs, moved, args, NO_AUTOCAST)
        queue.finish_sampling(StepMetrics())
        assert not failures
        for row, completion in enumerate(queue.queued[0].groups.completions):
            assert completion.trainer_logprobs == expected[0][row, : len(completion.token_ids)].tolist()
    vllm_like = _SeededEngine()
    del vllm_like.model
    queue = RolloutQueue(Systems(rollout_lag=1, overlap_rollouts=True), ONE_PROCESS, 0, None, vllm_like)
    queue.sample(0, sample_batch, StepMetrics())
    queue.score_under_sampling_weights(grpo.batch_logprobs, moved, args, NO_AUTOCAST)
    queue.finish_sampling(StepMetrics())
    assert all(c.trainer_logprobs is None for q in queue.queued for c in q.groups.completions)


def test_queued_batches_are_scored_once_under_the_weights_that_sampled_them(tiny):
    """At lag 1 each queued batch gets the trainer's log-probs of its tokens (batch_logprobs, as the scripts'
    π_old pass), once: a batch scored before keeps its scores; on-policy nothing is scored."""
    from helpers import two_group_rollouts

    from algorithms import grpo
    from common import flags
    from common.batches import make_batch
    from common.rollouts import Groups, RolloutQueue

    model, tokenizer = tiny
    args = flags.make(grpo.Args, micro_batch_size=3)
    prompts, completions = two_group_rollouts(tokenizer)
    expected = grpo.batch_logprobs(
        model, make_batch(prompts, completions, 4, 0, torch.device("cpu")), args, NO_AUTOCAST
    )
    for lag in (0, 1):
        queue = RolloutQueue(Systems(rollout_lag=lag), ONE_PROCESS, 0)
        fresh = [dataclasses.replace(c) for c in completions]
        queue.put(1, Groups(prompts, [None, None], fresh, [None] * 8, torch.zeros(2, 4), [True] * 8))
        queue.score_under_sampling_weights(grpo.batch_logprobs, model, args, NO_AUTOCAST)
        if lag == 0:
            assert all(c.trainer_logprobs is None for c in fresh)
            continue
        batch = make_batch(prompts, fresh, 4, 0, torch.device("cpu"))
        mask = batch["response_mask"].bool()
        assert torch.equal(batch["sampling_weights_logprobs"][mask], expected[0][mask])
        fresh[0].trainer_logprobs = [0.5] * len(fresh[0].token_ids)  # scored already: left alone
        queue.score_under_sampling_weights(grpo.batch_logprobs, model, args, NO_AUTOCAST)
        assert fresh[0].trainer_logprobs[0] == 0.5
    # a script that scores a step late (after an update) is stopped: the split needs the weights that sampled
    late = [dataclasses.replace(c, trainer_logprobs=None) for c in completions]
    queue.put(2, Groups(prompts, [None, None], late, [None] * 8, torch.zeros(2, 4), [True] * 8))
    queue.steps_to_sample(1, StepMetrics())  # the next step began: the update came between
    with pytest.raises(RuntimeError, match="sampled in step 0, is scored in step 1"):
        queue.score_under_sampling_weights(grpo.batch_logprobs, model, args, NO_AUTOCAST)


def test_the_mismatch_splits_into_the_engines_part_and_the_staleness():
    """record_staleness by hand: log π_old/μ = log π_s/μ + log π_old/π_s, each part's k3 averaged over the
    response tokens (mask 0 excluded); nothing without the trainer's log-probs at the sampling weights."""
    from common.rollouts import record_staleness

    mu = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=torch.float64)
    at_sampling = torch.tensor([[-1.1, -1.9, -0.5], [-0.3, -1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-0.6, -2.4, -0.7], [-0.8, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    batch = {"sampler_logprobs": mu, "sampling_weights_logprobs": at_sampling, "response_mask": mask}
    metrics = StepMetrics()
    record_staleness(metrics, batch, old)
    logged = metrics.reduce()
    k3 = lambda a, b: [math.exp(x - y) - 1 - (x - y) for x, y in zip(a, b)]  # noqa: E731
    valid = lambda t: t[0].tolist() + t[1, :2].tolist()  # noqa: E731
    expected_engine = sum(k3(valid(at_sampling), valid(mu))) / 5
    expected_staleness = sum(k3(valid(old), valid(at_sampling))) / 5
    assert logged["mismatch/kl_k3_discrepancy"] == pytest.approx(expected_engine, rel=1e-9)
    assert logged["mismatch/kl_k3_staleness"] == pytest.approx(expected_staleness, rel=1e-9)
    metrics = StepMetrics()
    record_staleness(metrics, {k: v for k, v in batch.items() if k != "sampling_weights_logprobs"}, old)
    assert metrics.reduce() == {}


@pytest.mark.slow
def test_a_resumed_run_at_lag_two_draws_and_trains_on_what_an_uninterrupted_one_does(
    tmp_path, tiny_dir, readme_task_file
):
    """--rollout-lag 2 with dynamic sampling: step t trains on the batch the weights of step t − 2 sampled (the
    queue a checkpoint holds, scored again under each checkpoint's weights), and a run stopped at step 2 and resumed
    (the queue restored from its checkpoint) logs every metric an uninterrupted one logs. The task is the README's
    task file (the built-in task's rows and rewards) with each row's sum an instance of a class the file defines:
    a checkpoint keeps the queued rows' questions and answers, not the file's objects, which pickle names by a module
    whose name depends on the file's path (a resume from another folder could not read them back)."""
    with open(readme_task_file) as f:
        source = "class Gold(int):\n    pass\n\n\n" + f.read().replace('"sum": a + b}', '"sum": Gold(a + b)}')
    assert "Gold(a + b)" in source  # the README's example still builds its rows so
    task = tmp_path / "gold_task.py"
    task.write_text(source)
    flags = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 0, "--save-every", 1, "--keep-checkpoints", 0]
    flags += ["--task", task]
    flags += ["--dynamic-sampling", "--max-sampling-rounds", 4, "--overlong-buffer", 2, "--rollout-lag", 2]
    run_script("algorithms/grpo.py", "--steps", 4, "--output-dir", tmp_path / "straight", *flags)
    run_script("algorithms/grpo.py", "--steps", 2, "--output-dir", tmp_path / "split", *flags)
    run_script("algorithms/grpo.py", "--steps", 4, "--output-dir", tmp_path / "split", "--resume", "auto", *flags)
    straight, split = (
        read_jsonl(os.path.join(only_run_dir(tmp_path / d), "metrics.jsonl")) for d in ("straight", "split")
    )
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    # dynamic sampling draws more unless all 16 first-round groups of the 4 steps had a reward spread: 52% of groups
    # do (helpers.py, reward signal), all 16 on 0.52^16 < 1e-4 of machines
    assert any(r["sampling/rounds"] > 1 for r in straight)
    assert [r["charts/rollout_lag"] for r in straight] == [0, 1, 2, 2]
    assert_same_run(straight, split)
    # the hf engine samples in float32 with the trainer's own weights: the mismatch is all staleness
    for record in straight[1:]:
        assert record["mismatch/kl_k3_discrepancy"] < 1e-6 < record["mismatch/kl_k3_staleness"]
        assert record["mismatch/kl_k3_staleness"] == pytest.approx(record["mismatch/kl_k3"], rel=1e-3)
    assert "mismatch/kl_k3_staleness" not in straight[0]  # the batch of step 1 was sampled by its own weights

    # after 2 steps the queue holds the batches of steps 3 and 4, sampled with the weights of steps 1 and 2 (the
    # model's, then checkpoint 1's): the engine's log-probs are theirs, not the newest weights'
    from algorithms import grpo
    from common import flags as common_flags
    from common.batches import make_batch
    from common.checks import read_checkpoint_file
    from common.tiny import load

    checkpoints = os.path.join(only_run_dir(tmp_path / "straight"), "checkpoints")
    queued = read_checkpoint_file(os.path.join(checkpoints, "step_00000002"), "rollouts_rank0.pt")["queued"]
    assert [(q.step, q.sampled_at) for q in queued] == [(2, 0), (3, 1)]
    assert all(row.data is None and row.question.startswith("Q: ") for q in queued for row in q.groups.rows)
    args = common_flags.make(grpo.Args, micro_batch_size=8)
    newest = load(os.path.join(checkpoints, "step_00000002"))[0]
    for q, weights in zip(queued, [tiny_dir, os.path.join(checkpoints, "step_00000001")]):
        sampler = load(weights)[0]
        batch = make_batch(q.groups.prompt_ids, q.groups.completions, 4, 0, torch.device("cpu"))
        mask = batch["response_mask"].bool()
        for model, close in ((sampler, True), (newest, False)):
            logprobs = grpo.batch_logprobs(model.eval(), batch, args, contextlib.nullcontext())[0]
            gap = (logprobs - batch["sampler_logprobs"])[mask].abs().max().item()
            assert (gap < 1e-4) if close else (gap > 1e-3), (q.step, close, gap)
        # and scored by the trainer under the weights that sampled it, for the split of the mismatch
        assert (batch["sampling_weights_logprobs"] - batch["sampler_logprobs"])[mask].abs().max() < 1e-4
