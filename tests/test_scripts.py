"""Checks every algorithm script gets, parametrized over the six files: its flags, a run end to end, a
non-finite step, two ranks against one, and empty completions. A method's own math is tested in its
test_<method>.py."""

import copy
import dataclasses
import importlib
import inspect
import math
import os
import re
import threading

import pytest
import torch
from distributed_update import update_policy
from helpers import (
    ALGORITHMS,
    BASE_LOGGED,
    CLIP_LOGGED,
    REPO,
    assert_same_run,
    assert_two_ranks_update_like_one,
    assert_weights_changed,
    assert_weights_unchanged,
    gradient_recorder,
    help_text,
    one_process,
    only_run_dir,
    per_sequence_logprobs,
    read_jsonl,
    run_script,
    two_group_rollouts,
)

from algorithms import grpo
from common import flags, fsdp
from common.engines import Completion

ONE_PROCESS = one_process()
# 8 prompts, so that what the end-to-end runs assert of their 2 steps does not wait for a rare batch (helpers.py,
# reward signal): the weights (LoRA's B) train unless all 16 groups had equal rewards (0.48^16 < 1e-5 of machines;
# products 0.43^16, sums 0.36^16); dynamic sampling draws a second round unless every group of the first rounds has a
# reward spread (0.52^16 < 1e-4). With 4 prompts these were 0.3% and 0.5% of machines per script.
SMALL = ["--prompts-per-step", 8, "--group-size", 4, "--eval-prompts", 16, "--eval-k", 2]


def recorded_metrics(name):
    """Patterns of the metric names a script records in its code: `metrics.mean("losses/...", ...)` and the
    like, or an f-string for a family (ISOPO's per-layer `isopo/{group}/{key}`: one piece per placeholder)."""
    source = open(os.path.join(REPO, "algorithms", f"{name}.py")).read()
    source += open(os.path.join(REPO, "common", "rollouts.py")).read()  # what dynamic sampling records
    source += open(os.path.join(REPO, "common", "tools.py")).read()  # what episodes with tools record
    calls = re.findall(r'(?:metrics\.(?:mean|sum|max|min|set|timer)|getattr\(metrics, \w+\))\(\s*(f?)"([^"]+)"', source)
    return [r"[^/]+".join(map(re.escape, re.split(r"\{[^}]*\}", text))) if f else re.escape(text) for f, text in calls]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_help_documents_every_flag(name):
    help_text(f"algorithms/{name}.py", importlib.import_module(f"algorithms.{name}").Args)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_token_logprobs_are_the_scripts_policy_logprobs(name, tiny, monkeypatch):
    """token_logprobs at temperature 0.7, the output layer scored 5 positions at a time (ISOPO: full logits): the
    log-probs and entropies of a float64 log_softmax(logits / 0.7) of a plain forward, per completion without
    padding. And they are the script's own `policy_logprobs`: a fork that changes it changes what trains."""
    import common.logprobs

    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    batch = algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    monkeypatch.setattr(common.logprobs, "CHUNK_BYTES", 4 * model.config.vocab_size * 5)  # several chunks
    with torch.no_grad():
        logprobs, entropy = algorithm.token_logprobs(model, batch, 0.7, with_entropy=True)
        for i, completion in enumerate(completions):
            prompt, response = prompts[i // 4], completion.token_ids
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
            logp = torch.log_softmax(logits / 0.7, -1)
            expected = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            torch.testing.assert_close(logprobs[i, : len(response)].double(), expected, rtol=0, atol=1e-5)
            expected_entropy = -(logp.exp() * logp).sum(-1)
            torch.testing.assert_close(entropy[i, : len(response)].double(), expected_entropy, rtol=0, atol=1e-5)
        # top-p / top-k: π renormalised over the engine's kept ids (the sampled one and 3 others at each
        # position; a position with no kept set, all −1, is scored over the whole vocabulary)
        generator = torch.Generator().manual_seed(0)
        kept_sets = []
        for completion in completions:
            others = torch.randint(0, model.config.vocab_size, (len(completion.token_ids), 3), generator=generator)
            kept = torch.cat([torch.tensor(completion.token_ids)[:, None], others], dim=1)
            kept[0] = -1
            kept_sets.append(kept)
        masked = [dataclasses.replace(c, sampling_mask=k) for c, k in zip(completions, kept_sets)]
        batch_kept = algorithm.make_batch(prompts, masked, 4, tokenizer.pad_token_id, torch.device("cpu"))
        kept_logprobs, kept_entropy = algorithm.token_logprobs(model, batch_kept, 0.7, with_entropy=True)
        for i, (completion, kept) in enumerate(zip(completions, kept_sets)):
            prompt, response = prompts[i // 4], completion.token_ids
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
            member = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, kept.clamp(min=0), True)
            member[0] = True
            logp = torch.log_softmax((logits / 0.7).masked_fill(~member, -math.inf), -1)
            expected = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            torch.testing.assert_close(kept_logprobs[i, : len(response)].double(), expected, rtol=0, atol=1e-5)
            expected_entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            torch.testing.assert_close(kept_entropy[i, : len(response)].double(), expected_entropy, rtol=0, atol=1e-5)
        original = algorithm.policy_logprobs
        monkeypatch.setattr(
            algorithm, "policy_logprobs", lambda *a, **k: (original(*a, **k)[0] + 1.0, original(*a, **k)[1])
        )
        shifted = algorithm.token_logprobs(model, batch, 0.7)[0]
        kept_shifted = algorithm.token_logprobs(model, batch_kept, 0.7)[0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(shifted[mask], logprobs[mask] + 1.0)
    torch.testing.assert_close(kept_shifted[mask], kept_logprobs[mask] + 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_two_steps_end_to_end(name, tmp_path, tiny_products_dir):
    """Two steps with evaluations on the built-in tool task (episodes with calculator calls), with the float16
    trainer (autocast under a loss scale; ISOPO, which refuses float16, in float32): every metric every script
    logs, each logged metric recorded in the script's own code or the common module it calls (where its comment
    defines it), the curves, and a checkpoint that loads and trained."""
    flags = ["--task", "products", "--max-new-tokens", 32, "--steps", 2, "--eval-every", 1, "--output-dir", tmp_path]
    run_script(f"algorithms/{name}.py", *flags, *SMALL, "--dtype", "float32" if name == "isopo" else "float16")
    run_dir = only_run_dir(tmp_path)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["charts/skipped_steps"] <= 1  # float16: at most the first step overflows the initial scale
    patterns = recorded_metrics(name)
    clip = CLIP_LOGGED if re.escape("losses/ratio_max") in patterns else []  # the scripts with a ratio
    tools = ["tools/calls_per_episode", "tools/turns", "tools/errors", "mismatch/kl_k3_first_turn"]
    for key in BASE_LOGGED + clip + tools + ["eval/greedy_accuracy", "eval/avg@2", "eval/pass@2", "time/eval"]:
        assert isinstance(records[-1][key], float), key
    assert sum(r["tools/calls_per_episode"] for r in records[1:]) > 0  # the warm start calls its calculator
    assert not [key for key in records[-1] if key.startswith("memory/")]  # a GPU's figure: absent on a CPU, not 0
    logged = {key for key in records[-1] if not key.startswith("eval/")} - {"step"}  # eval/*: common/evaluate.py
    unrecorded = sorted(key for key in logged if not any(re.fullmatch(p, key) for p in patterns))
    assert not unrecorded, f"{name}.py logs metrics no line of it records by name: {unrecorded}"
    assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 10_000
    assert_weights_changed(os.path.join(run_dir, "checkpoints", "step_00000002"), tiny_products_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_dapo_rollout_flags_end_to_end(name, tmp_path, readme_task_file):
    """Every script draws its rollouts with DAPO's flags (its `rollout` and common/rollouts.py, the same lines as
    grpo.py's): with dynamic sampling, a batch not short at the round cap holds no all-equal group. The task is the
    README's example task file (the user's own `rows` and `score`). At --rollout-lag 1, so step 2 trains on the
    rollouts of step 1's weights, and its mismatch is measured in two parts (common/rollouts.py)."""
    run_script(
        f"algorithms/{name}.py",
        "--task",
        readme_task_file,
        "--steps",
        2,
        "--eval-every",
        0,
        "--output-dir",
        tmp_path,
        *SMALL[:4],
        "--dynamic-sampling",
        "--max-sampling-rounds",
        4,
        "--overlong-buffer",
        4,
        "--mask-truncated",
        "--rollout-lag",
        1,
    )
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for record in records:
        assert 1 <= record["sampling/rounds"] <= 4 and record["sampling/rollouts"] >= 4 * 4
        if record["sampling/groups_short"] == 0:
            assert record["charts/zero_std_group_fraction"] == 0
    assert any(r["sampling/rounds"] > 1 for r in records)
    assert [r["charts/rollout_lag"] for r in records] == [0, 1]
    assert records[1]["mismatch/kl_k3_discrepancy"] < 1e-6 < records[1]["mismatch/kl_k3_staleness"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_lora_with_top_k_top_p_end_to_end(name, tmp_path):
    """--lora-rank in every script, two updates per batch, sampling with --top-k 5 --top-p 0.9 and the mask kept:
    no step is skipped; the engine generates with the adapted model and the trainer scores what it sampled
    (μ = π_old to float rounding, 1e-4 on some builds of the model: an engine on the base weights, or a mask left
    out, is off by more than 1e-2 on the second step's rollouts); the checkpoint is the adapter alone, in peft's
    format, its B moved off zero."""
    from safetensors.torch import load_file

    flags = ["--lora-rank", 4, "--lr", 1e-2, "--num-minibatches", 2, "--steps", 2, "--output-dir", tmp_path]
    run_script(f"algorithms/{name}.py", *flags, *SMALL, "--top-k", 5, "--top-p", 0.9, "--keep-sampling-mask")
    run_dir = only_run_dir(tmp_path)
    record = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[-1]
    assert record["charts/skipped_steps"] == 0 and record["mismatch/max_abs_logprob_diff"] < 1e-3, record
    checkpoint = os.path.join(run_dir, "checkpoints", "step_00000002")
    adapter = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    assert adapter and all(".lora_" in key for key in adapter), sorted(adapter)[:3]
    assert any(value.abs().max() > 0 for key, value in adapter.items() if ".lora_B." in key)  # B moved off zero
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in os.listdir(checkpoint))


@pytest.mark.slow
def test_top_k_top_p_without_the_sampling_mask(tmp_path):
    """The other side of the test above (common/ plumbing, the same lines in every script): without the mask
    every token's ratio carries the mass the truncation dropped (DeepSeek-V3.2's argument for keeping it)."""
    flags = ["--steps", 1, "--eval-every", 0, "--output-dir", tmp_path, *SMALL[:4], "--top-k", 5, "--top-p", 0.9]
    run_script("algorithms/grpo.py", *flags, "--no-keep-sampling-mask")
    record = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))[-1]
    # no reward needed: every truncated position drops mass; over run seeds 1-3 0.14-0.30 and k3 0.0021-0.0064
    assert record["mismatch/max_abs_logprob_diff"] > 1e-2 and record["mismatch/kl_k3"] > 1e-4


@pytest.mark.slow
def test_the_reasoning_task_in_float16_end_to_end(tmp_path, tiny_sums_dir):
    """`--task sums` (the scratchpad task and its own warm start, `--model tiny`) with the float16 trainer
    (autocast under a loss scale): responses are the written reasoning, scored after their ####, and some are
    right. (Every script runs in float16 in test_two_steps_end_to_end; the task is common/'s, as is its model.)"""
    run_script(
        "algorithms/grpo.py",
        "--task",
        "sums",
        "--max-new-tokens",
        48,
        "--dtype",
        "float16",
        "--steps",
        2,
        "--eval-every",
        2,
        "--output-dir",
        tmp_path,
        *SMALL,
    )
    run_dir = only_run_dir(tmp_path)
    assert os.path.basename(run_dir).startswith("sums__")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    # grpo at run seeds 1-2: responses of 31 tokens on average, every one with an answer, 31-34% right, no skipped step
    assert all(r["charts/response_length_mean"] > 20 and r["charts/no_answer_rate"] < 0.5 for r in records[1:])
    assert max(r["charts/accuracy"] for r in records[1:]) > 0 and "eval/greedy_accuracy" in records[-1]
    assert records[-1]["charts/skipped_steps"] <= 1  # float16: at most the first step overflows the initial scale
    assert_weights_changed(os.path.join(run_dir, "checkpoints", "step_00000002"), tiny_sums_dir)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_non_finite_step_leaves_the_weights_untouched(name, tmp_path, monkeypatch, tiny_dir):
    """NaN log-probs make the loss and the gradient NaN: every optimizer step is skipped and counted, and
    the weights stay the initial ones."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    real_token_logprobs = algorithm.token_logprobs

    def nan_logprobs(*args, **kwargs):
        logprobs, entropy = real_token_logprobs(*args, **kwargs)
        return logprobs * float("nan"), entropy

    monkeypatch.setattr(algorithm, "token_logprobs", nan_logprobs)
    fields = flags.names(algorithm.Args)
    overrides = {
        "steps": 2,
        "eval_every": 0,
        "output_dir": str(tmp_path),
        "prompts_per_step": 4,
        "group_size": 4,
        "num_minibatches": 2,  # two skipped steps per batch: each is counted
    }
    algorithm.main(flags.make(algorithm.Args, **{k: v for k, v in overrides.items() if k in fields}))
    run_dir = only_run_dir(tmp_path)
    updates = overrides["num_minibatches"]
    skipped = [r["charts/skipped_steps"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert skipped == [updates, 2 * updates]
    assert_weights_unchanged(os.path.join(run_dir, "checkpoints", "step_00000002"), tiny_dir)


# ISOPO's statistics are those of a block: blocks of one group each are the same on 1 and 2 ranks
ISOPO_BLOCKS = {
    "isopo": '{"block_size": 4, "micro_batch_size": 8, "reg_coef": 1.0}',
    "isopo interacting": '{"block_size": 4, "micro_batch_size": 8, "variant": "interacting"}',
}
# LoRA: the updated adapters, merged into the pushed weights, agree (ISOPO's layers are then the adapters' A and B)
LORA = {
    "grpo lora": '{"lora_rank": 4, "lora_alpha": 8.0}',
    "isopo lora": '{"block_size": 4, "micro_batch_size": 8, "lora_rank": 4, "lora_alpha": 8.0}',
}


# EMA-KPO's own test runs this check with its filter and clip acting (tests/test_ema_kpo.py)
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n not in ("isopo", "ema_kpo")] + [*ISOPO_BLOCKS, *LORA])
def test_two_ranks_update_exactly_like_one(name, tmp_path):
    """Same global batch, 1 process vs 2 FSDP2 ranks (gloo) holding different numbers of response tokens:
    every statistic the update logs and every updated weight agree (the cross-rank means and counts)."""
    one = assert_two_ranks_update_like_one(tmp_path, name.split()[0], {**ISOPO_BLOCKS, **LORA}.get(name, "{}"))
    if name == "grpo":
        assert one["losses/approx_kl"] > 0  # the second epoch ran with π_θ ≠ π_old


def _args(algorithm, micro_batch_size=16, **overrides):
    """The script's Args with sequence-mean aggregation where the script has the choice (ISOPO's loss is
    always a mean over sequences), one update and no gradient clipping."""
    fields = flags.names(algorithm.Args)
    values = {
        "group_size": 4,
        "lr": 0.5,
        "micro_batch_size": micro_batch_size,
        "loss_aggregation": "sequence-mean",
        "num_minibatches": 1,
        "update_epochs": 1,
        "max_grad_norm": 1e9,
        **overrides,
    }  # no clipping: it hides scale
    return flags.make(algorithm.Args, **{k: v for k, v in values.items() if k in fields})


def _updated(algorithm, model, tokenizer, prompts, completions, rewards, args, mask_truncated=False):
    """(weights after one update_policy on this batch, its logged statistics)."""
    policy = copy.deepcopy(model).train()
    trains = [c.finish_reason != "length" for c in completions] if mask_truncated else None  # as the sampler sets it
    batch = algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"), trains)
    batch["advantages"] = algorithm.compute_advantages(torch.tensor(rewards).view(-1, 4)).flatten()
    logged = update_policy(algorithm, policy, batch, args, ONE_PROCESS)
    return {name: p.detach().clone() for name, p in policy.named_parameters()}, logged


# micro-batches of 3: the last one holds only empty rows. Not for ISOPO, whose statistics are those of a
# block (another partition of the real rows is another update)
@pytest.mark.parametrize(
    "name, micro_batch_size", [(n, 16) for n in ALGORITHMS] + [(n, 3) for n in ALGORITHMS if n != "isopo"]
)
def test_empty_completions_add_nothing(name, micro_batch_size, tiny):
    """A group of empty completions (no response token) neither contributes nor dilutes the mean: the
    sequence-mean counts only the completions that have a token, so the update equals the one without it."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    empty = [Completion([], [], "length") for _ in range(4)]
    args = _args(algorithm, micro_batch_size)
    initial = dict(model.named_parameters())
    alone, _ = _updated(algorithm, model, tokenizer, prompts[:1], completions[:4], [1.0, 0.0, 0.0, 1.0], args)
    padded, _ = _updated(
        algorithm, model, tokenizer, prompts, completions[:4] + empty, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], args
    )
    for key, weight in alone.items():
        step, step_with_empty = weight - initial[key], padded[key] - initial[key]
        # float32 noise of another padding layout is ~1e-6 of a step; counting the empty rows halves it
        assert (step_with_empty - step).norm() <= 1e-4 * step.norm() + 1e-9, key
    assert alone["model.embed_tokens.weight"].ne(initial["model.embed_tokens.weight"]).any()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_masked_truncated_completions_get_no_gradient(name, tiny):
    """--mask-truncated: a completion cut off by the length limit keeps its reward in its group's advantages,
    but its tokens get exactly no gradient and leave the token mean: the update equals the one with empty
    completions in their place. Unmasked, the same completions do change the update."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)  # "12", "396", "9" do not end with EOS: cut off
    cut = [
        Completion(c.token_ids, c.logprobs, "stop" if c.token_ids[-1] == tokenizer.eos_token_id else "length")
        for c in completions
    ]
    emptied = [c if c.finish_reason == "stop" else Completion([], [], "length") for c in cut]
    rewards, args = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], _args(algorithm, loss_aggregation="token-mean")
    initial = dict(model.named_parameters())
    masked, _ = _updated(algorithm, model, tokenizer, prompts, cut, rewards, args, mask_truncated=True)
    reference, _ = _updated(algorithm, model, tokenizer, prompts, emptied, rewards, args)
    unmasked, _ = _updated(algorithm, model, tokenizer, prompts, cut, rewards, args)
    assert sum(c.finish_reason == "length" for c in cut) == 3
    for key, weight in reference.items():
        step = weight - initial[key]
        assert (masked[key] - weight).norm() <= 1e-4 * step.norm() + 1e-9, key
    embedding = "model.embed_tokens.weight"
    assert (unmasked[embedding] - reference[embedding]).norm() > 1e-2 * (
        reference[embedding] - initial[embedding]
    ).norm()


def _with_a_tool_output(tokenizer, completions, tool_logprob=0.0, masked=True):
    """The completions with a tool's output (`<r>7</r>`) after their first token: context the policy did not
    sample, masked (`tool_logprob`: what the engine reports at its tokens, which nothing may read)."""
    tool = tokenizer("<r>7</r>", add_special_tokens=False)["input_ids"]
    episodes = []
    for c in completions:
        ids, logprobs = c.token_ids[:1] + tool + c.token_ids[1:], c.logprobs[:1] + [tool_logprob] * len(tool)
        mask = [0] + [1] * len(tool) + [0] * (len(c.token_ids) - 1)
        episode = Completion(ids, logprobs + c.logprobs[1:], c.finish_reason, tool_mask=mask if masked else None)
        episodes.append(episode)
    return episodes


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_tool_output_is_context_not_action(name, tiny):
    """Tool-output tokens inside every response, two updates per batch (ratios, corrections and filters at work):
    the update and every logged statistic are the same whatever the engine's log-probs at those tokens (no loss,
    ratio, correction, filter or statistic reads them), and differ from the update that treats the same tokens as
    the policy's own (the mask is what keeps them out)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    rewards, args = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], _args(algorithm, num_minibatches=2)
    runs = {}
    for label, episodes in (
        ("engine log-prob 0", _with_a_tool_output(tokenizer, completions, 0.0)),
        ("engine log-prob -30", _with_a_tool_output(tokenizer, completions, -30.0)),
        ("unmasked", _with_a_tool_output(tokenizer, completions, masked=False)),
    ):
        torch.manual_seed(0)  # the minibatches' order
        runs[label] = _updated(algorithm, model, tokenizer, prompts, episodes, rewards, args)
    (weights, logged), (other_weights, other_logged) = runs["engine log-prob 0"], runs["engine log-prob -30"]
    for key, weight in weights.items():
        assert torch.equal(weight, other_weights[key]), key
    assert logged.keys() == other_logged.keys() and "mismatch/kl_k3_later_turns" in logged
    for key, value in logged.items():
        assert value == other_logged[key] or (value != value and other_logged[key] != other_logged[key]), key
    embedding = "model.embed_tokens.weight"
    assert (runs["unmasked"][0][embedding] - weights[embedding]).norm() > 1e-3 * weights[embedding].norm()


@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n != "isopo"])  # ISOPO refuses float16
def test_float16_gradients_are_unscaled_before_clipping(name, tiny):
    """--dtype float16: the loss is multiplied by the scaler's scale (2^10 here) for the backward, and the
    gradients are divided by it before their norm is taken and clipped: the logged norm is float32's, to
    float16 rounding, not 1024 times it."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    # μ: the model's own log-probs, as an engine at these weights gives them (the placeholder μ of −1 made P3O's
    # ratio π/μ, and its gradient norm, 15,730 on one build of the model: float16 overflowed)
    batch = algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        own = algorithm.token_logprobs(model, batch, 1.0)[0]
    for row, completion in enumerate(completions):
        completion.logprobs = own[row, : len(completion.token_ids)].tolist()
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    norms = {}
    for dtype in ("float32", "float16"):
        args = _args(algorithm, loss_aggregation="token-mean", dtype=dtype, max_grad_norm=1.0)
        _, logged = _updated(algorithm, model, tokenizer, prompts, completions, rewards, args)
        norms[dtype] = logged["losses/grad_norm"]
    assert norms["float16"] == pytest.approx(norms["float32"], rel=0.05), norms


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_minibatch_without_response_tokens_is_skipped_and_counted(name, tiny):
    """No response token in a minibatch (0/0 in a token mean): no NaN, no optimizer step, counted as
    skipped, and the next minibatch is still tried (two skipped of two); no loss is logged for an update that did
    not happen (not a made-up 0)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, _ = two_group_rollouts(tokenizer)
    empty = [Completion([], [], "length") for _ in range(8)]
    args = _args(algorithm, loss_aggregation="token-mean", num_minibatches=2)
    weights, logged = _updated(algorithm, model, tokenizer, prompts, empty, [1.0, 0.0] * 4, args)
    for key, p in model.named_parameters():
        assert torch.equal(weights[key], p), key
    assert logged["skipped"] == 2 and "losses/policy_loss" not in logged


def _main(algorithm, output_dir, **overrides):
    """algorithm.main with the given fields (those the script has) on a small run: its metrics, step by step."""
    values = dict(dict(steps=3, eval_every=2, eval_prompts=8, prompts_per_step=4, group_size=4), **overrides)
    fields = flags.names(algorithm.Args)
    algorithm.main(
        flags.make(algorithm.Args, output_dir=str(output_dir), **{k: v for k, v in values.items() if k in fields})
    )
    return read_jsonl(os.path.join(only_run_dir(output_dir), "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 2])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_overlapped_rollouts_equal_the_synchronous_lag(name, lag, tmp_path):
    """--overlap-rollouts samples the batch of step t + k on a thread of its own while step t trains: every number
    of every step (times apart, an evaluation included) equals the synchronous --rollout-lag k run's, bit for bit
    (the transformers engine, each side at the process's one thread, as in CI)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    synchronous = _main(algorithm, tmp_path / "synchronous", rollout_lag=lag)
    overlapped = _main(algorithm, tmp_path / "overlapped", rollout_lag=lag, overlap_rollouts=True)
    assert_same_run(synchronous, overlapped)
    assert (
        all(r["time/rollout_overlapped"] > 0 for r in overlapped[1:])
        and "time/rollout_overlapped" not in synchronous[1]
    )


def test_overlapped_rollouts_sample_while_the_update_runs(tmp_path, monkeypatch):
    """The batch in flight is sampled while update_policy runs, not before or after it: the first update waits (a
    minute at most) for a generate call on another thread, which itself waits for the update to have begun. In a
    synchronous run no generate call comes while the update runs: the wait runs out."""
    from common.engines import HFEngine

    updating, sampled_beside = threading.Event(), threading.Event()
    generate, update = HFEngine.generate, grpo.update_policy

    def watched_generate(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and updating.wait(60):
            sampled_beside.set()
        return generate(self, *args, **kwargs)

    def watched_update(*args, **kwargs):
        updating.set()
        seen.append(sampled_beside.wait(60 if not seen else 0))
        return update(*args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", watched_generate)
    monkeypatch.setattr(grpo, "update_policy", watched_update)
    seen = []
    _main(grpo, tmp_path, steps=2, rollout_lag=1, overlap_rollouts=True)
    assert seen[0]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_micro_batches_change_no_number(name, tiny):
    """--micro-batch-size is memory only: micro-batches of 4 rows make the update and log the loss of one
    micro-batch of 8 (each micro-batch's share of the loss adds up to the minibatch's)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    runs = []
    for size in (8, 4):  # two epochs: the second's ratios are not 1, so every method's loss is away from 0
        torch.manual_seed(0)
        args = _args(algorithm, size, update_epochs=2, block_size=4, lr=0.01)
        runs.append(_updated(algorithm, model, tokenizer, prompts, completions, rewards, args))
    (weights, logged), (micro_weights, micro_logged) = runs
    assert abs(logged["losses/policy_loss"]) > 1e-3
    assert micro_logged["losses/policy_loss"] == pytest.approx(logged["losses/policy_loss"], rel=1e-4)
    initial = dict(model.named_parameters())
    for key, weight in weights.items():  # float32 sums in another order: about 1e-4 of a step at most
        assert (micro_weights[key] - weight).norm() <= 1e-3 * (weight - initial[key]).norm() + 1e-9, key


@pytest.mark.parametrize("name", ALGORITHMS)
def test_groups_of_equal_rewards_teach_nothing(name, tiny):
    """Groups whose completions earned the same reward have advantages of 0, and every method's loss is 0 on them:
    no gradient, and a logged loss of 0, over two epochs. The terms that do not depend on A are off: the KL penalty
    (β = 0), GTPO's entropy bonus (γ = 0), and P3O's KL to μ (the engine's log-probs are π_θ's own)."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    own = [logprobs.tolist() for logprobs, _ in per_sequence_logprobs(model, prompts, completions, 4)]
    completions = [dataclasses.replace(c, logprobs=lp) for c, lp in zip(completions, own)]
    args = _args(algorithm, 8, update_epochs=2, block_size=4, lr=0.01, kl_coef=0.0, entropy_coef=0.0)
    _, logged = _updated(algorithm, model, tokenizer, prompts, completions, [1.0] * 8, args)
    assert logged["losses/policy_loss"] == pytest.approx(0.0, abs=1e-9)
    assert logged["losses/grad_norm"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("updates", [1, 2], ids=["one-update", "two-epochs"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_shared_statistics_and_kl_penalty_by_brute_force(name, updates, tiny, monkeypatch):
    """What every script's update_policy shares, against brute force. The weights stay still (an optimizer that
    records gradients) and the π_old pass is shifted by a known ε per token, so log π_θ − log π_old = −ε: approx_kl is
    the mean k3 of −ε at two updates, and 0 at one, where π_old is π_θ itself and no pass is made; the mismatch is
    k3(log π_old − log μ), and its two parts beside π_s (a batch sampled a step ago); the entropy is π_θ's; kl_ref is
    k3 KL(π_θ ‖ π_ref). Where the method has --kl-coef, β·KL adds β times its aggregate to the logged loss and β times
    its gradient to every step's."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    model, tokenizer = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # π_ref away from π_θ, so that the KL term has a gradient
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    prompts, completions = two_group_rollouts(tokenizer)
    # sampled a step ago (--rollout-lag): the trainer's log-probs at the sampling weights, −1.2 at every token
    completions = [dataclasses.replace(c, trainer_logprobs=[-1.2] * len(c.token_ids)) for c in completions]
    new_batch = lambda: algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))  # noqa: E731
    noise = 0.4 * torch.randn(new_batch()["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    batch_logprobs = algorithm.batch_logprobs

    def shifted_old_logprobs(model_, *rest, **kwargs):  # the π_old pass off by ε per token; π_ref's exact
        logprobs, *others = batch_logprobs(model_, *rest, **kwargs)
        return (logprobs + noise if model_ is policy else logprobs, *others)

    monkeypatch.setattr(algorithm, "batch_logprobs", shifted_old_logprobs)
    has_penalty = "kl_coef" in flags.names(algorithm.Args)
    parameters = inspect.signature(algorithm.update_policy).parameters  # GTPO has no π_ref
    runs = []
    for kl_coef in [0.0, 0.5] if has_penalty else [0.0]:
        batch = new_batch()
        batch["advantages"] = algorithm.compute_advantages(torch.tensor([[1.0, 0, 0, 1], [1, 0, 1, 0]])).flatten()
        args = _args(algorithm, 3, update_epochs=updates, kl_coef=kl_coef, log_kl_ref=True)
        optimizer = gradient_recorder(policy.parameters())
        torch.manual_seed(0)
        logged = update_policy(algorithm, policy, batch, args, ONE_PROCESS, optimizer, reference)
        runs.append((logged, optimizer.steps, batch["advantages"]))

    found = per_sequence_logprobs(policy, prompts, completions, 4)
    found_ref = per_sequence_logprobs(reference, prompts, completions, 4)
    mask = new_batch()["response_mask"].bool()
    epsilon = noise[mask] if updates > 1 else torch.zeros(int(mask.sum()))
    logprobs = torch.cat([lp for lp, _ in found])
    log_ref_ratio = torch.cat([lp for lp, _ in found_ref]) - logprobs
    k3 = lambda x: x.exp() - 1 - x  # noqa: E731
    mismatch = logprobs.detach() + epsilon + 1.0  # log π_old − log μ (the placeholder μ: −1 at every token)
    expected = {
        "losses/approx_kl": k3(-epsilon).mean(),
        "charts/entropy": torch.cat([entropy for _, entropy in found]).mean(),
        **({"losses/kl_ref": k3(log_ref_ratio).mean()} if "reference" in parameters else {}),
        "mismatch/kl_k3": k3(mismatch).mean(),
        "mismatch/max_abs_logprob_diff": mismatch.abs().max(),
        "mismatch/kl_k3_discrepancy": k3(torch.full_like(epsilon, -0.2)).mean(),  # log π_s − log μ
        "mismatch/kl_k3_staleness": k3(logprobs.detach() + epsilon + 1.2).mean(),  # log π_old − log π_s
    }
    if name in ("grpo", "gtpo", "tis_icepop"):  # ρ = π_θ/π_old (EMA-KPO filters it, P3O's is π_θ/μ, ISOPO has none)
        ratio = torch.exp(-epsilon)
        expected |= {"losses/ratio_min": ratio.min(), "losses/ratio_max": ratio.max()}
    if name in ("grpo", "tis_icepop"):  # clipped on the group's advantages (GTPO's are shaped by entropy)
        advantage = new_batch()["response_mask"] * runs[-1][2][:, None]
        clipped = (ratio < 1 - args.clip_low) & (advantage[mask] < 0) | (ratio > 1 + args.clip_high) & (
            advantage[mask] > 0
        )
        expected["losses/clip_fraction"] = clipped.float().mean()
        assert 0 < clipped.float().mean() < 1 or updates == 1
    logged, steps, _ = runs[-1]
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key
    assert logged["losses/approx_kl"] == 0 or updates > 1  # one update: π_old is π_θ, exactly
    if re.escape("losses/ratio_max") in recorded_metrics(name):  # the scripts with a ratio
        assert set(CLIP_LOGGED) <= set(logged) and 0 <= logged["losses/clip_fraction"] <= 1
    assert len(steps) == updates
    if not has_penalty:
        return
    # β·KL (sequence-mean: each completion's mean over its tokens, then over the 8 completions)
    penalty = 0.5 * sum(k3(r).mean() for r in log_ref_ratio.split([len(c.token_ids) for c in completions])) / 8
    (plain, plain_steps, _), (penalized, penalized_steps, _) = runs
    assert penalized["losses/policy_loss"] - plain["losses/policy_loss"] == pytest.approx(penalty.item(), rel=1e-5)
    policy.zero_grad()
    penalty.backward()
    for with_kl, without, parameter in zip(penalized_steps[-1], plain_steps[-1], policy.parameters()):
        assert (with_kl - without - parameter.grad).norm() <= 1e-4 * parameter.grad.norm() + 1e-9


@pytest.mark.parametrize("name, lora_rank", [(n, 0) for n in ALGORITHMS] + [("grpo", 4)])
def test_gradient_checkpointing_recomputes_every_layer(name, lora_rank, tmp_path, monkeypatch):
    """Through the script's own set-up (main()): with --gradient-checkpointing every decoder layer runs
    twice per training forward (the forward, then its recomputation inside the backward), without it once.
    Counted by calls with autograd on, so generation and the no-grad scoring passes do not count. The
    recomputation changes no number: the step's loss and gradient norm are the same. With LoRA too (frozen
    weights: the layers' inputs need no gradient, the adapters inside them do)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

    algorithm = importlib.import_module(f"algorithms.{name}")
    fields = flags.names(algorithm.Args)
    counts = {}
    for cls, key in ((LlamaDecoderLayer, "layer"), (LlamaForCausalLM, "model")):

        def counting(self, *args, _forward=cls.forward, _key=key, **kwargs):
            counts[_key] += torch.is_grad_enabled()
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counting)
    for checkpointing in (False, True):
        counts.update(layer=0, model=0)
        overrides = {
            "steps": 1,
            "eval_every": 0,
            "output_dir": str(tmp_path / str(checkpointing)),
            "prompts_per_step": 4,
            "group_size": 4,
            "num_minibatches": 2,
            "micro_batch_size": 8,
            "gradient_checkpointing": checkpointing,
            "lora_rank": lora_rank,
        }
        algorithm.main(flags.make(algorithm.Args, **{k: v for k, v in overrides.items() if k in fields}))
        layers = 4  # the built-in model's
        assert counts["model"] >= 2, counts  # a training forward per micro-batch
        assert counts["layer"] == layers * counts["model"] * (2 if checkpointing else 1), (checkpointing, counts)
    plain, checkpointed = (
        read_jsonl(os.path.join(only_run_dir(tmp_path / str(c)), "metrics.jsonl"))[-1] for c in (False, True)
    )
    for key in ("losses/policy_loss", "losses/grad_norm"):
        assert checkpointed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-8), key


def test_a_gpu_that_torch_cannot_use_stops_the_run(tmp_path, monkeypatch):
    """nvidia-smi lists a GPU, torch (a CPU build here, a CUDA build too new for the driver elsewhere) cannot
    use it: the script stops and says why instead of training on the CPU; an empty CUDA_VISIBLE_DEVICES says
    the CPU is meant."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    path = f"{fake.parent}{os.pathsep}{os.environ['PATH']}"
    result = run_script("algorithms/grpo.py", "--output-dir", tmp_path / "runs", check=False, env={"PATH": path})
    assert result.returncode != 0 and "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H100 80GB HBM3)" in result.stderr
    assert "CUDA_VISIBLE_DEVICES=" in result.stderr and not (tmp_path / "runs").exists()
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert fsdp.setup().device == torch.device("cpu")


def _delete_field(source, name):
    """`source` without the Args field `name` and its docstring."""
    match = re.search(rf'\n    {name}: [^\n]*\n    """.*?"""\n', source, re.S)
    assert match, name
    return source.replace(match.group(0), "\n")


@pytest.mark.slow
def test_a_fork_without_the_optional_features_runs(tmp_path):
    """A fork of grpo.py that deletes three optional features (top-p / top-k and the kept sampling mask, DAPO's
    dynamic sampling, the tool-turn mismatch split): its flags, their lines, nothing in common/. Its checks pass and
    it trains, because common/ receives groups and plain values, never a script's fields by name."""
    source = open(os.path.join(REPO, "algorithms", "grpo.py")).read()
    for name in ("dynamic_sampling", "max_sampling_rounds"):
        source = _delete_field(source, name)
    for text, replacement in (
        ("    sampling: Group[Sampling] = field(default_factory=Sampling)\n", ""),  # --top-p, --top-k, the mask
        (
            "        top_p=args.sampling.top_p,\n        top_k=args.sampling.top_k,\n"
            "        sampling_mask=args.sampling.keep_sampling_mask,\n",
            "",
        ),
        (", args.max_sampling_rounds)\n", ")\n"),
        ('    record_turn_mismatch(metrics, k3, mask, batch.get("later_turns"))  # tools: kl_k3_*_turn(s)\n', ""),
    ):
        assert text in source, text  # a deletion that finds nothing would test nothing
        source = source.replace(text, replacement)
    source, deleted = re.subn(r"(?m)^( +)if args\.dynamic_sampling:.*\n(\1    .*\n)+", "", source)
    assert deleted == 1  # the block and its body, not the line after it
    fork = tmp_path / "algorithms" / "fork.py"
    fork.parent.mkdir()
    fork.write_text(source)
    options = ["--steps", 2, "--eval-every", 0, "--output-dir", tmp_path / "runs", *SMALL[:4]]
    result = run_script(str(fork), *options, env={"PYTHONPATH": REPO}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(os.path.join(only_run_dir(tmp_path / "runs"), "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2] and all(r["charts/skipped_steps"] == 0 for r in records)
    result = run_script(str(fork), "--top-p", 0.9, env={"PYTHONPATH": REPO}, check=False)
    assert result.returncode == 2 and "--top-p" in result.stderr  # the flag is gone from the fork
