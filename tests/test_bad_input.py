"""Bad input, as a new user gives it, to every script: each is refused with one message that names the flag, file
or model and what to do (none is accepted and silently misused), before a run folder is made; a resumed run keeps
its own settings; a damaged checkpoint is named. Also the warnings a running job gives, and `common.evaluate`."""

import importlib
import json
import math
import os
import random
import re
import shutil
import unicodedata

import pytest
import torch
from helpers import ALGORITHMS, only_run_dir, run_script

from common import checks, flags, tasks
from common.errors import BadInput
from common.scoring import score
from common.tiny import resolve_model

NAN = math.nan
SMALL = {"prompts_per_step": 4, "group_size": 4, "eval_every": 0}
# (flag overrides, a part of the message); every script refuses each of these in check_args
SHARED_CASES = [
    ({"max_grad_norm": -1.0}, "--max-grad-norm must be >= 0 and finite (0: no clipping)"),  # reversed the update
    ({"max_grad_norm": NAN}, "--max-grad-norm must be >= 0"),
    ({"keep_checkpoints": -1}, "--keep-checkpoints must be >= 0 (0: keep them all)"),  # deleted the final one
    ({"steps": -3}, "--steps must be >= 1"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"warmup_steps": -5}, "--warmup-steps must be >= 0 (0: no warm-up)"),
    ({"eval_every": -1}, "--eval-every must be >= 0 (0: never)"),
    ({"save_every": -1}, "--save-every must be >= 0 (0: only at the end)"),
    ({"eval_prompts": 0}, "--eval-prompts must be >= 1"),
    ({"eval_k": -1}, "--eval-k must be >= 0"),
    ({"lr": 1e39}, "--lr must be in (0, 1]"),  # overflowed inside torch
    ({"lr": NAN}, "--lr must be in (0, 1]"),
    ({"lr": 0.0}, "--lr must be in (0, 1]"),
    ({"temperature": NAN}, "--temperature must be > 0 and finite"),
    ({"temperature": math.inf}, "--temperature must be > 0 and finite"),
    ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
    ({"top_p": NAN}, "--top-p must be in (0, 1]"),
    ({"top_k": -1}, "--top-k must be >= 0"),
    ({"rollout_lag": -1}, "--rollout-lag must be in [0, 64]"),
    ({"overlap_rollouts": True}, "--overlap-rollouts applies with --rollout-lag >= 1 only"),
    # a batch sampled beside the update is scored on the engine's copy, as the trainer would score it
    ({"rollout_lag": 1, "overlap_rollouts": True, "engine_dtype": "bfloat16"}, "--overlap-rollouts must be off with"),
    (  # the engine samples during the update: it cannot free its memory then
        {"rollout_lag": 1, "overlap_rollouts": True, "rollout_engine": "vllm", "vllm_sleep_mode": True},
        "--overlap-rollouts must be off with --vllm-sleep-mode",
    ),
    # a process of its own is vLLM's; its GPU holds no trainer to make room for
    ({"rollout_engine": "hf", "engine_process": True}, "--engine-process must be used with vLLM"),
    (
        {"rollout_engine": "vllm", "engine_process": True, "vllm_sleep_mode": True},
        "--engine-process must be off with --vllm-sleep-mode",
    ),
    ({"keep_sampling_mask": False}, "--keep-sampling-mask applies with --top-p < 1 or --top-k > 0 only"),
    # vLLM returns at most 20 kept tokens per position: a kept mask needs a top-k there, refused before loading
    (
        {"rollout_engine": "vllm", "top_p": 0.9},
        "to keep the sampling mask of --top-p / --top-k, set --top-k in [1, 20]",
    ),
    ({"rollout_engine": "vllm", "top_k": 50}, "to keep the sampling mask of --top-p / --top-k, set --top-k in [1, 20]"),
    # vLLM raises a temperature below 0.01 to 0.01 and says so in its log only: μ would not be the run's policy
    ({"rollout_engine": "vllm", "temperature": 0.005}, "--temperature must be >= 0.01 with the vLLM engine"),
    ({"weight_decay": -0.1}, "--weight-decay must be >= 0 and finite"),
    ({"weight_decay": NAN}, "--weight-decay must be >= 0 and finite"),
    ({"group_size": 1}, "--group-size must be >= 2"),
    ({"prompts_per_step": 0}, "--prompts-per-step must be >= 1"),
    ({"max_prompt_tokens": 0}, "--max-prompt-tokens must be >= 1"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
    ({"task": "sums", "max_new_tokens": 16}, "--max-new-tokens must be >= 41 for sums"),
    ({"eval_task": "sums", "max_new_tokens": 16}, "--max-new-tokens must be >= 41 for sums"),  # held out: cut short
    ({"eval_task": "products", "max_new_tokens": 30}, "--eval-task must be a task with the tools of --task"),
    ({"task": "products", "eval_task": "arith"}, "--eval-task must be a task with the tools of --task"),
    ({"overlong_buffer": 16}, "--overlong-buffer must be in [0, --max-new-tokens)"),
    ({"max_sampling_rounds": 0}, "--max-sampling-rounds must be >= 1"),
    ({"num_minibatches": 0}, "--num-minibatches must be in [1, 16] (the rollouts of a rank)"),
    ({"num_minibatches": 257}, "--num-minibatches must be in [1, 16] (the rollouts of a rank)"),
    ({"update_epochs": 0}, "--update-epochs must be >= 1"),
    ({"micro_batch_size": 0}, "--micro-batch-size must be >= 1"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1)"),
    ({"exp_name": "a/b"}, "--exp-name must be a name without '/'"),
    ({"exp_name": ""}, "--exp-name must be a name (part of the run folder's name), not empty"),  # was: without '/'
    ({"lora_rank": -4}, "--lora-rank must be >= 0 (0: full fine-tuning)"),
    ({"lora_rank": 8, "lora_alpha": 0.0}, "--lora-alpha must be > 0 and finite"),
    ({"lora_rank": 8, "lora_alpha": NAN}, "--lora-alpha must be > 0 and finite"),
    ({"lora_rank": 8, "lora_target_modules": ()}, "--lora-target-modules must be one or more module names"),
    ({"seed": -1}, "--seed must be in [0, 2^31)"),
    ({"lora_alpha": 64.0}, "--lora-alpha applies with --lora-rank > 0 only"),
    # flags the run would silently ignore (issue 44): each is refused with when it applies
    ({"max_sampling_rounds": 4}, "--max-sampling-rounds applies with --dynamic-sampling only"),
    # --resume auto may start a new run: refused there too (a run it would find is matched without such a flag)
    ({"resume": "auto", "lora_alpha": 64.0}, "--lora-alpha applies with --lora-rank > 0 only"),
    # was a ValueError from common.engines once the model had loaded
    ({"rollout_engine": "vllm", "engine_dtype": "fp8"}, "--engine-dtype must be auto, float32, bfloat16 or float16"),
    ({"eval_every": 0, "eval_k": 8}, "--eval-k applies with --eval-every > 0 only"),
    ({"eval_every": 0, "eval_prompts": 64}, "--eval-prompts applies with --eval-every > 0 only"),
    ({"eval_every": 0, "eval_task": "gsm8k"}, "--eval-task applies with --eval-every > 0 (or a local data file"),
    (
        {"rollout_engine": "hf", "vllm_sleep_mode": True},
        "--vllm-sleep-mode applies to vLLM on a GPU only (--rollout-engine hf)",
    ),
    (
        {"rollout_engine": "hf", "gpu_memory_utilization": 0.5},
        "--gpu-memory-utilization applies to vLLM on a GPU only (--rollout-engine hf)",
    ),
    ({"cpu_offload": True}, "--cpu-offload applies with several ranks (torchrun) only"),  # one rank here
    # a flag a resume may change is this command's alone: refused where it does nothing, resumed or not
    ({"resume": "no/such/run", "cpu_offload": True}, "--cpu-offload applies with several ranks (torchrun) only"),
    (
        {"resume": "no/such/run", "rollout_engine": "hf", "vllm_sleep_mode": True},
        "--vllm-sleep-mode applies to vLLM on a GPU only (--rollout-engine hf)",
    ),
    ({"wandb_entity": "me"}, "--wandb-entity applies with --track only"),
    ({"wandb_project_name": "mine"}, "--wandb-project-name applies with --track only"),
    ({"question_column": "q"}, "--question-column applies to a local data file (.jsonl, .json, .parquet) as --task"),
    ({"task": "gsm8k", "answer_column": "a"}, "--answer-column applies to a local data file"),  # a hub task's own
    ({"dtype": "float32", "fp32_lm_head": True}, "--fp32-lm-head applies with bfloat16 / float16 compute (--dtype)"),
    # the output layer: the trainer's chunked log-probs would bypass its adapter
    ({"lora_rank": 8, "lora_target_modules": ("q_proj", "lm_head")}, "--lora-target-modules lm_head: the output"),
    # the built-in MoE model has no warm start of the tool task: was a KeyError deep in common/tiny.py
    ({"model": "tiny-moe", "task": "products"}, "--model tiny-moe has no built-in warm start for --task products"),
]
# each method's own flags: out of range, NaN, or set where the chosen variant ignores them
ONE_UPDATE = "--clip-high applies with --num-minibatches × --update-epochs > 1 only (one update: every ratio is 1)"
METHOD_CASES = {
    "grpo": [
        ({"clip_high": NAN}, "--clip-high must be >= 0 and finite"),  # skipped every update without a word
        ({"kl_coef": NAN}, "--kl-coef must be >= 0 and finite"),
        # one update per batch: every ratio is 1, so GSPO's sequence ratio (or a clip range) would change nothing
        ({"ratio_level": "sequence"}, "--ratio-level applies with --num-minibatches × --update-epochs > 1 only"),
    ],
    "ema_kpo": [
        ({"clip_high": NAN}, "--clip-high must be >= 0 and finite"),
        ({"kl_coef": NAN}, "--kl-coef must be >= 0 and finite"),
        ({"num_minibatches": 1}, "--num-minibatches × --update-epochs must be > 1"),  # its documented requirement
        ({"alpha": 0.01}, "--alpha must be left out: it applies to --smoother fixed only"),
        ({"smoother": "fixed", "alpha": 0.01, "kalman_q": 1e-4}, "--kalman-q applies to --smoother ema / kalman"),
        ({"kalman_q": NAN}, "--kalman-q must be > 0 and finite"),
        ({"kalman_v": -1.0}, "--kalman-v must be > 0"),
        ({"p0": math.inf}, "--p0 must be >= 0 and finite"),
        ({"smoother": "fixed"}, "--alpha must be in (0, 1) with --smoother fixed"),
        ({"smoother": "fixed", "alpha": 1.5}, "--alpha must be in (0, 1)"),
    ],
    "p3o": [
        ({"kl_coef": NAN}, "--kl-coef must be >= 0 and finite"),
        ({"clip_eps": 0.4}, "--clip-eps applies to --loss clip only"),
        ({"loss": "clip", "ess_scope": "micro-batch"}, "--ess-scope applies to --loss p3o only"),
        ({"sampling_temperature": NAN}, "--sampling-temperature must be > 0, finite"),
        ({"sampling_temperature": 0.0}, "--sampling-temperature must be > 0, finite"),
        ({"loss": "clip", "clip_eps": 1.0}, "--clip-eps must be in [0, 1)"),
    ],
    "gtpo": [
        ({"clip_high": NAN}, "--clip-high must be >= 0 and finite"),
        ({"entropy_coef": NAN}, "--entropy-coef must be >= 0 and finite"),
        ({"conflict_masks": False, "mask_combine": "product"}, "--mask-combine applies with conflict masks"),
        ({"entropy_filter": "off", "entropy_threshold": 0.7}, "--entropy-threshold applies to --entropy-filter"),
        ({"entropy_threshold": 0.0}, "--entropy-threshold must be > 0 and finite"),
        ({"entropy_ini_prompts": 0}, "--entropy-ini-prompts must be >= 1"),
    ],
    "isopo": [
        ({"p": NAN}, "--p must be a finite number"),
        ({"reg_coef": NAN}, "--reg-coef must be >= 0 and finite"),
        ({"variant": "interacting", "p": -2.0}, "--p applies to --variant non-interacting only"),
        ({"ntk_reg_coef": 2.0}, "--ntk-reg-coef applies to --variant interacting only"),
        ({"micro_batch_size": 12}, "--micro-batch-size must be a multiple of --block-size"),
        ({"num_minibatches": 3}, "--num-minibatches must be a divisor of the 4 prompts of a rank"),  # whole groups
        ({"block_size": 0}, "--block-size must be >= 1"),  # was a ZeroDivisionError in the checks
        ({"n_overlap": 0}, "--n-overlap must be >= 1"),
        ({"variant": "interacting", "ntk_reg_coef": 0.0}, "--ntk-reg-coef must be > 0"),
        ({"ema_decay": 1.0}, "--ema-decay must be in [0, 1)"),
        # λ = 0: reg2(x) = sqrt(x² + 1e-8), no trailing mean and no form
        ({"reg_form": "authors"}, "--reg-form applies with --reg-coef > 0 only"),
        ({"ema_decay": 0.5}, "--ema-decay applies with --reg-coef > 0 only"),
        ({"dtype": "float16"}, "--dtype must be auto, float32 or bfloat16: Eq. 6 normalizes"),
    ],
    "tis_icepop": [
        ({"clip_high": NAN}, "--clip-high must be >= 0 and finite"),
        ({"kl_coef": NAN}, "--kl-coef must be >= 0 and finite"),
        ({"tis_cap": NAN}, "--tis-cap must be > 0 and finite"),
        ({"icepop_beta": 3.0}, "--icepop-beta applies to --correction icepop only"),
        ({"correction": "icepop", "tis_cap": 3.0}, "--tis-cap applies to --correction tis / tis-seq / mis-seq only"),
        ({"tis_cap": math.inf}, "--tis-cap must be > 0 and finite"),
        ({"correction": "mis", "mis_low": 3.0}, "--mis-low must be in [0, --mis-high]"),
        ({"correction": "mis", "mis_high": -1.0}, "--mis-high must be > 0"),
        ({"correction": "icepop", "icepop_alpha": 6.0}, "--icepop-alpha must be in [0, --icepop-beta]"),
        ({"correction": "icepop", "icepop_beta": NAN}, "--icepop-beta must be > 0"),
        ({"correction": "kpop", "kpop_phi": -1.0}, "--kpop-phi must be >= 0"),
        ({"correction": "seq-mask", "seq_mask_delta": math.inf}, "--seq-mask-delta must be >= 0 and finite"),
        ({"correction": "seq-mask", "seq_mask_delta": -1.0}, "--seq-mask-delta must be >= 0"),  # dropped every A < 0
    ],
}
# every script with a clip range (a lower end of 1 would let a ratio fall to 0 unclipped)
CLIPPED = [name for name in ALGORITHMS if "clip_low" in flags.names(importlib.import_module(f"algorithms.{name}").Args)]
CLIP_CASES = [({"clip_low": 1.0}, "--clip-low must be in [0, 1)")]
CASES = [
    pytest.param(name, flags, message, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in flags.items())}")
    for name in ALGORITHMS
    # a new fork: the shared cases, and the clip's if it has one
    for flags, message in SHARED_CASES + CLIP_CASES * (name in CLIPPED) + METHOD_CASES.get(name, [])
]


def _args(name, **overrides):
    module = importlib.import_module(f"algorithms.{name}")
    return module, flags.make(module.Args, **{**SMALL, **overrides})


@pytest.mark.parametrize("name, flags, message", CASES)
def test_a_bad_flag_is_refused_by_name(name, flags, message, tmp_path):
    """Each refusal by name, beside a second problem that the shared checks find first: one error lists both (a
    check that replaced the problems found before it would lose that one)."""
    second = ("--warmup-steps must be >= 0", {"warmup_steps": -5})
    if "warmup_steps" in flags:  # the case's own flag: another second problem
        second = ("--keep-checkpoints must be >= 0", {"keep_checkpoints": -1})
    module, args = _args(name, output_dir=str(tmp_path / "runs"), **flags, **second[1])
    with pytest.raises(BadInput) as error:
        module.main(args)  # check_args runs first: nothing is loaded, no folder is made
    assert message in str(error.value) and second[0] in str(error.value), str(error.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_defaults_pass_and_every_problem_is_listed_at_once(name):
    module, args = _args(name)
    module.check_args(args)
    with pytest.raises(BadInput) as error:
        module.check_args(flags.replace(args, steps=-1, lr=NAN, keep_checkpoints=-1))
    assert str(error.value).count("\n") == 3  # the header and the three problems


def test_a_rollout_lag_of_the_whole_run_is_allowed_with_a_note(capsys):
    """--rollout-lag k >= --steps trains every step on rollouts of the first weights: a run resumed with more
    --steps continues as one started with them, so it is allowed, and said."""
    module, args = _args("grpo", steps=2, rollout_lag=2)
    module.check_args(args)
    assert "note: --rollout-lag 2 >= --steps 2: every step of this run trains on rollouts that the first" in (
        capsys.readouterr().err
    )
    module.check_args(flags.replace(args, steps=3))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ALGORITHMS)
def test_method_flags_are_accepted_where_they_apply(name):
    """The other side of the refusals above: two updates by epochs alone, and each method's flags in the variant
    that reads them."""
    module, args = _args(name, num_minibatches=1, update_epochs=2)
    module.check_args(args)
    applies = {
        "gtpo": {"entropy_filter": "auto", "entropy_ini_prompts": 20},
        "isopo": {"reg_coef": 0.5, "reg_form": "authors", "ema_decay": 0.5, "p": 0.0, "r": 1.0, "n_overlap": 10},
    }
    module.check_args(flags.replace(args, **applies.get(name, {})))
    if name == "isopo":  # the NTK's trailing mean in the interacting variant
        module.check_args(flags.replace(args, variant="interacting", ema_decay=0.5))
    # the ends of the ranges: a clip range of 0 is one (set, with two updates), an infinite one or β is not
    names = flags.names(module.Args)
    module.check_args(flags.replace(args, **{k: 0.0 for k in ("clip_low", "clip_high") if k in names}))
    for flag in [k for k in ("clip_high", "kl_coef") if k in names]:
        with pytest.raises(BadInput, match=f"--{flag.replace('_', '-')}"):
            module.check_args(flags.replace(args, **{flag: float("inf")}))


INF = float("inf")
# The ends of each method flag's range: (the flag, the variant that reads it, values accepted, values refused). A
# closed end and a value just inside an open one pass; an open end, or a value just past a closed one, is refused.
RANGE_ENDS = {
    "ema_kpo": [
        ("kalman_q", {}, [1e-12, 1e12], [0.0, INF]),
        ("kalman_v", {}, [1e-12, 1e12], [0.0, INF]),
        ("p0", {}, [0.0, 1e12], [-1e-12, INF]),
        ("alpha", {"smoother": "fixed"}, [1e-12, 0.999], [0.0, 1.0]),
    ],
    "gtpo": [
        ("entropy_coef", {}, [0.0, 1e12], [-1e-12, INF]),
        ("entropy_ini_prompts", {}, [1], [0]),
        ("entropy_threshold", {"entropy_filter": "on"}, [1e-12, 1e12], [0.0, INF]),
    ],
    "p3o": [
        ("sampling_temperature", {}, [1e-12, 1e12], [0.0, INF]),
        ("clip_eps", {"loss": "clip"}, [0.0, 0.999], [-1e-12, 1.0]),
    ],
    "tis_icepop": [
        ("tis_cap", {}, [1e-12, 1e12], [0.0, INF]),
        ("mis_high", {"correction": "mis", "mis_low": 0.0}, [1e-12, 1e12], [0.0, INF]),
        ("mis_low", {"correction": "mis", "mis_high": 2.0}, [0.0, 2.0], [-1e-12, 2.5]),
        ("icepop_beta", {"correction": "icepop", "icepop_alpha": 0.0}, [1e-12, 1e12], [0.0, INF]),
        ("icepop_alpha", {"correction": "icepop", "icepop_beta": 2.0}, [0.0, 2.0], [-1e-12, 2.5]),
        ("kpop_phi", {"correction": "kpop"}, [0.0, 1e12], [-1e-12, INF]),
        ("seq_mask_delta", {"correction": "seq-mask"}, [0.0, 1e12], [-1e-12, INF]),
    ],
    "isopo": [
        ("block_size", {"micro_batch_size": 4}, [1], [0]),
        ("n_overlap", {}, [1], [0]),
        ("reg_coef", {}, [0.0, 1e12], [-1e-12, INF]),
        ("ntk_reg_coef", {"variant": "interacting"}, [1e-12, 1e12], [0.0, INF]),
        ("ema_decay", {"reg_coef": 1.0}, [0.0, 0.999], [-1e-12, 1.0]),
    ],
}


CLIP_ENDS = [("clip_low", {}, [0.0, 0.999], [-1e-12, 1.0]), ("clip_high", {}, [0.0, 1e12], [-1e-12, INF])]


@pytest.mark.parametrize(
    "name, flag, variant, accepted, refused",
    [(name, *ends) for name in ALGORITHMS for ends in RANGE_ENDS.get(name, []) + CLIP_ENDS * (name in CLIPPED)],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_the_ends_of_each_method_flags_range(name, flag, variant, accepted, refused):
    module, args = _args(name, num_minibatches=1, update_epochs=2, **variant)
    for value in accepted:
        module.check_args(flags.replace(args, **{flag: value}))
    for value in refused:
        with pytest.raises(BadInput, match=f"--{flag.replace('_', '-')}"):
            module.check_args(flags.replace(args, **{flag: value}))


@pytest.mark.parametrize("name", CLIPPED)
def test_a_clip_range_with_one_update_is_refused_unless_resumed_by_path(name):
    """One update per batch: π_old is π_θ and every ratio 1, so a clip range would change nothing; refused where a
    run starts, --resume auto included (it may start one), not where a run is resumed by path (it keeps its flags).
    A method that needs two updates (EMA-KPO) refuses one update itself."""
    module, args = _args(name, num_minibatches=1, update_epochs=1)
    try:
        module.check_args(args)
    except BadInput as error:
        assert "--num-minibatches × --update-epochs must be > 1" in str(error)
        return
    for resume in (None, "auto"):
        with pytest.raises(BadInput, match=re.escape(ONE_UPDATE)):
            module.check_args(flags.replace(args, resume=resume, clip_high=0.3))
    module.check_args(flags.replace(args, resume="runs/a_run", clip_high=0.3))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_command_prints_one_line_per_problem_and_no_traceback(name, tmp_path):
    result = run_script(
        f"algorithms/{name}.py", "--steps", -3, "--max-grad-norm", -1, "--output-dir", tmp_path, check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error: invalid arguments:\n  --steps must be >= 1\n" in result.stderr
    assert "--max-grad-norm must be >= 0" in result.stderr and not os.listdir(tmp_path)


def test_a_retired_flag_names_what_replaced_it():
    """p3o.py's --sync-every became --rollout-lag: the command says so (the parser alone says "Unrecognized")."""
    result = run_script("algorithms/p3o.py", "--sync-every=2", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --sync-every is no longer a flag: p3o.py's --sync-every k" in result.stderr
    assert "became --rollout-lag" in result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"task": "gsm9k"}, "unknown task 'gsm9k': use one of"),
        ({"task": "missing.jsonl"}, "task file not found: missing.jsonl"),
        ({"task": "{tmp}/parts.jsonl"}, "parts.jsonl is a folder (2 entries: part-0.json, part-1.json): pass one"),
        ({"task": "{tmp}/by_columns.json"}, "row 0's question is a list, not text (a .json file of columns?"),
        ({"task": "{tmp}/numbers.jsonl"}, "row 0's question is a int, not text: 12"),
        ({"task": "{tmp}/columns.jsonl"}, "has no column(s) ['question', 'answer']; its columns are ['problem', 'x']"),
        (
            {"eval_task": "aime25", "task": "{tmp}/columns.jsonl", "question_column": "problem", "answer_column": "x"},
            "could not load task 'aime25'",
        ),
        ({"resume": "no/such/run"}, "--resume no/such/run: no such checkpoint or run folder"),
    ],
)
def test_a_bad_task_or_resume_is_named_before_any_model_loads(flags, message, tmp_path):
    (tmp_path / "columns.jsonl").write_text('{"problem": "1+1", "x": "2"}\n')
    (tmp_path / "parts.jsonl").mkdir()
    for part in ("part-0.json", "part-1.json"):
        (tmp_path / "parts.jsonl" / part).write_text('{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "by_columns.json").write_text('{"question": ["1+1", "2+2"], "answer": ["2", "4"]}')
    (tmp_path / "numbers.jsonl").write_text('{"question": 12, "answer": "3"}\n')
    flags = {key: value.replace("{tmp}", str(tmp_path)) for key, value in flags.items()}
    module, args = _args("grpo", output_dir=str(tmp_path / "runs"), **flags)
    with pytest.raises(BadInput) as error:
        module.main(args)
    assert message in str(error.value), str(error.value)


def test_a_resume_of_a_run_elsewhere_refuses_an_output_dir_it_would_ignore(tmp_path):
    """--resume PATH continues the run in its own folder: --output-dir elsewhere is named, not ignored (its
    default, and the run's own parent, are fine), and config.json records where the run is."""
    from common.tracking import Tracker

    run = tmp_path / "runs" / "arith__grpo__1__1800000000"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "trainer_state.pt").write_bytes(b"")
    for resume in (run, run / "checkpoints" / "step_00000002"):
        module, args = _args("grpo", output_dir=str(tmp_path / "elsewhere"), resume=str(resume))
        with pytest.raises(BadInput, match=f"--output-dir {tmp_path}/elsewhere: a resumed run continues in its own"):
            module.check_args(args)
        assert checks.resumed_output_dir_problems(str(resume), str(tmp_path / "runs")) == []  # the run's parent
        default = flags.replace(args, output_dir=module.Args().output_dir)
        assert not [problem for problem in checks.shared_flags(default) if "--output-dir" in problem]
    Tracker(str(run), {"output_dir": "elsewhere", "steps": 3})
    assert json.load(open(run / "config.json"))["output_dir"] == str(tmp_path / "runs")


def test_a_start_refused_after_its_run_folder_was_made_leaves_no_folder(tmp_path):
    """A bad --model folder is found once the run's folder exists (the model is read after the folder is locked):
    the folder, which holds nothing but its lock, is removed as the process ends."""
    (tmp_path / "model").mkdir()
    result = run_script(
        "algorithms/grpo.py", "--model", tmp_path / "model", "--output-dir", tmp_path / "runs", check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert os.path.isdir(tmp_path / "runs") and not os.listdir(tmp_path / "runs")


def test_output_dir_that_is_a_file_or_cannot_be_made(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert checks.output_dir_problems(str(afile)) == [f"--output-dir {afile} is a file, not a folder"]
    assert "cannot be created" in checks.output_dir_problems(str(afile / "runs"))[0]
    assert checks.output_dir_problems(str(tmp_path / "new" / "runs")) == []  # made when the run starts


# --- files and models -------------------------------------------------------------------------------


def test_held_out_questions_that_train_and_rows_that_disagree_are_warned_of(tmp_path, capsys):
    """A separate --eval-task file is held out whole, but a copy of the training file (or a file sharing questions
    with it) evaluates on questions that train; and a question whose rows give two answers rewards one of them."""
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(20)]
    train, shared = tmp_path / "train.jsonl", tmp_path / "shared.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    shared.write_text("".join(json.dumps(row) + "\n" for row in rows[15:] + [{"question": "new?", "answer": "1"}]))
    tasks.load_train_and_eval(str(train), str(shared))
    assert f"warning: 5 of the 6 held-out questions of {shared} are also in {train}, which trains" in (
        capsys.readouterr().err
    )
    tasks.load_train_and_eval(str(train), None)  # its own held-out split: disjoint, nothing to warn of
    assert "warning" not in capsys.readouterr().err
    train.write_text(train.read_text() + json.dumps({"question": "What is  3+1? ", "answer": "5"}) + "\n")
    tasks.load_train_and_eval(str(train), None)
    assert f"warning: 1 of the 20 questions of {train} have rows with different answers" in capsys.readouterr().err


def test_a_torn_jsonl_names_its_line_and_column(tmp_path):
    path = tmp_path / "torn.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answ\n')
    with pytest.raises(BadInput, match=rf"{path}:2:\d+: not a JSON record"):
        tasks.load_task(str(path), "train")
    path.write_text('{"question": "1+1", "answer": "2"}\n[1, 2]\n')
    with pytest.raises(BadInput, match=rf"{path}:2: a JSON list, not an object"):
        tasks.load_task(str(path), "train")


def test_a_local_task_file_holds_out_a_seeded_tenth_that_never_trains(tmp_path, capsys):
    path = tmp_path / "my.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(50)))
    train, held_out = tasks.load_train_and_eval(str(path), None)
    assert len(held_out) == 5 and len(train) == 45 and not set(train) & set(held_out)
    assert tasks.load_train_and_eval(str(path), str(path)) == (train, held_out)  # the same file named twice
    for spelling in (str(tmp_path / "." / "my.jsonl"), os.path.relpath(path)):  # however its path is written
        assert tasks.load_train_and_eval(str(path), spelling) == (train, held_out)
    assert tasks.load_train_and_eval(str(path), None, evaluated=False)[0] == train  # --eval-every 0: the same 90%
    assert "5 of the 50 questions" in capsys.readouterr().err
    # a file without repeats is split as it always was: one row per question, the same seeded sample
    assert {int(r.answer) for r in held_out} == set(random.Random("held-out/50").sample(range(50), 5))
    # A question the file repeats (scraped data often does) is held out with every copy or trains with every copy:
    # the rows of a question on both sides would make its held-out accuracy a memory test.
    repeats = tmp_path / "repeats.jsonl"
    repeats.write_text("".join(json.dumps({"question": f"q{i % 20}", "answer": str(i % 20)}) + "\n" for i in range(60)))
    repeated_train, repeated_held_out = tasks.load_train_and_eval(str(repeats), None)
    assert len(repeated_held_out) == 6 and len(repeated_train) == 54  # 2 of the 20 questions, 3 copies each
    assert not {r.question for r in repeated_train} & {r.question for r in repeated_held_out}
    assert "2 of the 20 questions of" in capsys.readouterr().err
    # copies that differ in spacing or Unicode form (é composed or as e + accent) are the same question
    spellings = ("café {}?", " café  {}? ", "cafe\u0301 {}?")
    variants = tmp_path / "variants.jsonl"
    rows = [{"question": spelling.format(i), "answer": "1"} for i in range(20) for spelling in spellings]
    variants.write_text("".join(json.dumps(row) + "\n" for row in rows))
    variant_train, variant_held_out = tasks.load_train_and_eval(str(variants), None)
    same = lambda question: unicodedata.normalize("NFC", " ".join(question.split()))  # noqa: E731
    assert len(variant_held_out) == 6 and len({same(r.question) for r in variant_held_out}) == 2
    assert not {same(r.question) for r in variant_train} & {same(r.question) for r in variant_held_out}
    repeats.write_text(2 * (json.dumps({"question": "q", "answer": "1"}) + "\n"))
    with pytest.raises(BadInput, match="1 distinct question: too few to hold some out"):
        tasks.load_train_and_eval(str(repeats), None)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n")
    train, held_out = tasks.load_train_and_eval(str(path), str(other))
    assert len(train) == 50 and len(held_out) == 1  # a separate held-out file: all of it, and all of the task trains
    assert tasks.load_train_and_eval("arith", None)[1] == tasks.load_task("arith", "test")  # named tasks: test split


def test_a_task_without_a_test_split_trains_when_nothing_is_evaluated(monkeypatch):
    """--eval-every 0 loads no held-out rows: dapo_math (a train split only) could not run at all, as --eval-task is
    refused there (it does nothing)."""
    loaded = []
    monkeypatch.setattr(tasks, "load_task", lambda task, split, *columns: loaded.append(split) or [tasks.Row("q", "1")])
    assert tasks.load_train_and_eval("dapo_math", None, evaluated=False) == ([tasks.Row("q", "1")], [])
    assert loaded == ["train"]


def test_a_data_file_with_a_byte_order_mark_and_float_answers(tmp_path):
    """A .jsonl saved with a BOM (Windows editors) reads as any other; a float answer is written as a number is,
    never in exponent notation (5e-05, which no answer is compared with); a NaN answer is refused."""
    path = tmp_path / "bom.jsonl"
    records = [{"question": "a", "answer": 5e-05}, {"question": "b", "answer": 1e16}, {"question": "c", "answer": 2.5}]
    path.write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    rows = tasks.load_task(str(path), "train")
    assert [r.answer for r in rows] == ["0.00005", "10000000000000000", "2.5"]
    assert score("\\boxed{0.00005}", rows[0].answer, str(path)).correct
    path.write_text('{"question": "a", "answer": NaN}\n')
    with pytest.raises(BadInput, match="row 0's answer is nan, not a number any completion can equal"):
        tasks.load_task(str(path), "train")


def test_prompts_left_out_by_the_length_limit_are_counted(tiny, capsys):
    _, tokenizer = tiny
    rows = [tasks.Row("Q: 1+1=", "2"), tasks.Row("Q: " + "1+" * 40 + "1=", "41")]
    kept, _ = tasks.encode_prompts(rows, tokenizer, "arith", max_tokens=20, verbose=True)
    assert kept == rows[:1] and "1 of 2 prompts are longer than 20 tokens" in capsys.readouterr().err
    with pytest.raises(BadInput, match="every prompt of task 'arith' is longer than 2 tokens"):
        tasks.encode_prompts(rows, tokenizer, "arith", max_tokens=2)


def test_a_generation_longer_than_the_context_is_refused(tiny_dir):
    with pytest.raises(BadInput, match="--max-new-tokens 100000 does not fit in the context"):
        tasks.prompt_token_limit(tiny_dir, 512, 100_000, 100_000)
    assert tasks.prompt_token_limit(tiny_dir, 512, 56, 56) == 200
    with pytest.raises(BadInput, match="an episode of 300 tokens .--max-episode-tokens. does not fit"):
        tasks.prompt_token_limit(tiny_dir, 512, 56, 300)


def test_models_that_are_not_there_are_named(tmp_path, monkeypatch):
    with pytest.raises(BadInput, match="--model models/qwen/typo: no such model folder"):
        resolve_model("models/qwen/typo")  # a hub id is owner/name: this is a local path
    run = tmp_path / "grpo_run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    with pytest.raises(BadInput, match=r"is a run folder, not a model: .*step_00000002.*or continue the run"):
        resolve_model(str(run))
    from common.engines import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput, match="--model no-such-owner/no-such-model: not a local model folder"):
        load_tokenizer("no-such-owner/no-such-model")


# --- resume and damaged checkpoints -----------------------------------------------------------------


def _fake_checkpoint(tmp_path, args, **lost_flags):
    """A run's checkpoint at step 3 holding its settings only: `args`', and `lost_flags`, flags its script no longer
    has."""
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    torch.save({"args": flags.flat(args) | lost_flags, "step": 3}, folder / "trainer_state.pt")
    return str(folder)


def test_a_resume_that_would_change_the_math_is_refused_with_the_differences(tmp_path):
    grpo = importlib.import_module("algorithms.grpo")
    saved = flags.make(grpo.Args, lr=1e-4, seed=1)
    checkpoint = _fake_checkpoint(tmp_path, saved)
    changed = flags.replace(saved, lr=3e-4, clip_high=0.2, steps=100, eval_every=5, resume=checkpoint)
    with pytest.raises(BadInput) as error:
        checks.check_resume(flags.flat(changed), checkpoint)
    message = str(error.value)
    assert "--lr 0.0001 in the run, 0.0003 now" in message and "--clip-high 0.28 in the run, 0.2 now" in message
    assert "--steps" not in message.split("A resume may change")[0]  # longer runs and other evaluations are fine
    assert "A resume may change: " in message and "--steps" in message.split("A resume may change")[1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A grpo.py run of 2 steps with a checkpoint at each step (the command a user runs)."""
    out = tmp_path_factory.mktemp("runs")
    flags = ["--steps", 2, "--save-every", 1, "--keep-checkpoints", 0, "--prompts-per-step", 4, "--group-size", 4]
    run_script("algorithms/grpo.py", "--output-dir", out, "--eval-every", 0, *flags)
    return only_run_dir(out), flags


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    ["model.safetensors", "trainer_state.pt", "rng_rank0.pt", "optimizer/.metadata", "optimizer/__0_0.distcp"],
)
def test_a_damaged_checkpoint_file_is_named_with_the_other_checkpoints(finished_run, damage, tmp_path):
    run_dir, flags = finished_run
    copy = tmp_path / os.path.basename(run_dir)
    shutil.copytree(run_dir, copy)
    checkpoint = copy / "checkpoints" / "step_00000002"
    target = checkpoint / damage
    target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 3)])  # cut short, as by a full disk
    result = run_script(
        "algorithms/grpo.py",
        "--output-dir",
        tmp_path,
        "--eval-every",
        0,
        *flags,
        "--steps",
        3,
        "--resume",
        checkpoint,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"checkpoint {checkpoint}: " in result.stderr and "damaged or incomplete" in result.stderr
    assert "other checkpoints of this run: step_00000001" in result.stderr


@pytest.mark.slow
def test_a_resume_says_what_it_resumes_and_may_run_longer(finished_run, tmp_path):
    run_dir, flags = finished_run
    copy = tmp_path / os.path.basename(run_dir)
    shutil.copytree(run_dir, copy)
    result = run_script(
        "algorithms/grpo.py", "--output-dir", tmp_path, "--eval-every", 0, *flags, "--steps", 3, "--resume", copy
    )
    assert f"resuming {copy} at step 2" in result.stderr
    assert json.load(open(copy / "config.json"))["steps"] == 3  # the record says what the run now does
    # the training rows are recorded when the run starts and checked when it resumes: other rows are refused
    record = json.load(open(copy / tasks.PROMPTS_RECORD))
    assert record["task"] == "arith" and record["training_rows"] > 0
    json.dump({**record, "sha256": "0" * 64}, open(copy / tasks.PROMPTS_RECORD, "w"))
    result = run_script(
        "algorithms/grpo.py", "--eval-every", 0, *flags, "--steps", 4, "--resume", copy, check=False
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "--task arith: the run started on other training rows" in result.stderr


def test_a_resume_on_an_edited_task_file_is_refused(tmp_path):
    """A row appended to a task file between a run's start and its resume: other prompts at each step, and another
    held-out split in which a held-out question may train (as here), unless the user says so by deleting the record."""
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(20)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    started = tasks.load_train_and_eval(str(path), None)[0]
    tasks.same_prompts_as_the_run(str(tmp_path), str(path), started)  # the first start: recorded
    tasks.same_prompts_as_the_run(str(tmp_path), str(path), started)  # the same rows: resumes
    path.write_text(path.read_text() + json.dumps({"question": "What is 20+1?", "answer": "21"}) + "\n")
    edited, held_out = tasks.load_train_and_eval(str(path), None)
    assert {r.question for r in held_out} & {r.question for r in started}  # a held-out question that trained
    with pytest.raises(BadInput, match=r"the run started on other training rows \(18 then, 19 now, .* delete "):
        tasks.same_prompts_as_the_run(str(tmp_path), str(path), edited)
    os.remove(tmp_path / tasks.PROMPTS_RECORD)  # the user's choice, as the message says
    tasks.same_prompts_as_the_run(str(tmp_path), str(path), edited)
    tasks.same_prompts_as_the_run(str(tmp_path), str(path), edited)


@pytest.mark.slow
def test_evaluate_names_damaged_weights_and_its_help_is_plain(finished_run, tmp_path):
    run_dir, _ = finished_run
    checkpoint = tmp_path / "step"
    shutil.copytree(os.path.join(run_dir, "checkpoints", "step_00000002"), checkpoint)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run_script("-m", "common.evaluate", "--model", checkpoint, "--k", 1, check=False)
    assert result.returncode == 2 and "model.safetensors is damaged or incomplete" in result.stderr, result.stderr
    help_text = run_script("-m", "common.evaluate", "--help").stdout
    assert "usage: python -m common.evaluate" in help_text and "(default: None)" not in help_text
    assert run_script("-m", "common.evaluate", "--k", 0, check=False).stderr.startswith("error: invalid arguments")


# --- a running job's warnings -----------------------------------------------------------------------


def test_watch_warns_once_after_three_steps_of_a_stuck_uniform_or_answerless_run(capsys):
    watch = checks.Watch(vocab_size=52, updates_per_step=2)
    healthy = {"charts/skipped_steps": 0, "charts/entropy": 0.5, "charts/no_answer_rate": 0.1}
    for step in range(1, 4):
        watch.step(healthy, step)
    assert capsys.readouterr().err == ""
    for step in range(4, 10):
        skipped = 2 * (step - 3)  # both optimizer steps of every training step skipped
        watch.step({"charts/skipped_steps": skipped, "charts/entropy": 3.9, "charts/no_answer_rate": 1.0}, step)
    err = capsys.readouterr().err
    assert err.count("warning (step 6)") == 3  # each of the three after 3 steps in a row, once
    assert "every optimizer step was skipped" in err and "near its maximum, log(vocabulary) = 3.95" in err
    assert "no completion had an answer to score" in err


def test_a_run_resumes_after_one_of_its_flags_became_refusable(tmp_path, capsys, monkeypatch):
    """A run saved with a flag that its other values make do nothing (--no-keep-sampling-mask without top-p or
    top-k; --fp32-lm-head --dtype auto made on a GPU, resumed on a CPU where auto is float32) resumes with the
    flag passed as it was or left out: neither is refused, as ignored nor as a changed setting. A flag that does
    change the run is still refused."""
    grpo = importlib.import_module("algorithms.grpo")
    monkeypatch.setattr(checks, "check_checkpoint_files", lambda checkpoint: None)  # settings only: no weights here
    for saved_flags in ({"keep_sampling_mask": False}, {"fp32_lm_head": True, "dtype": "auto"}):
        checkpoint = _fake_checkpoint(tmp_path / next(iter(saved_flags)), flags.make(grpo.Args, **saved_flags))
        for given in (saved_flags, {}):  # passed as the run had it, or left out
            resumed = flags.make(grpo.Args, resume=checkpoint, **given)
            assert checks.shared_flags(resumed) == []
            checks.check_resume(flags.flat(resumed), checkpoint, verbose=False)
        with pytest.raises(BadInput, match="--lr 0.0001 in the run, 0.0003 now"):
            checks.check_resume(flags.flat(flags.make(grpo.Args, resume=checkpoint, lr=3e-4)), checkpoint)
    checks.check_resume(flags.flat(flags.make(grpo.Args, resume=checkpoint)), checkpoint)
    note = "note: --fp32-lm-head False (the run: True) does nothing here: applies with bfloat16"
    assert note in capsys.readouterr().err
    # a flag the script has since lost (p3o.py's --sync-every): said, not refused
    older = _fake_checkpoint(tmp_path / "older", flags.make(grpo.Args), sync_every=4)
    checks.check_resume(flags.flat(flags.make(grpo.Args, resume=older)), older)
    assert "note: the run was made with --sync-every 4, which this script no longer has" in capsys.readouterr().err


def test_a_resume_with_fewer_steps_than_the_run_has_is_refused(tmp_path):
    """--resume RUN --steps 1 on a run at step 3 would do nothing and rewrite the run's config.json to steps: 1."""
    grpo = importlib.import_module("algorithms.grpo")
    checkpoint = _fake_checkpoint(tmp_path, grpo.Args())
    with pytest.raises(BadInput, match="the run is at step 3 already, past --steps 1: pass --steps 4 or more"):
        checks.check_resume(flags.flat(flags.make(grpo.Args, steps=1, resume=checkpoint)), checkpoint)


# --- issue 44: what common/ refuses, before anything heavy loads ------------------------------------


def test_the_vllm_flags_with_auto_are_refused_where_auto_means_hf(monkeypatch):
    """--rollout-engine auto is resolved as common.engines resolves it: hf without a GPU or without vLLM (the run
    would ignore --vllm-sleep-mode there), vLLM with both (the flag is used)."""
    from common import engines

    grpo = importlib.import_module("algorithms.grpo")
    args = flags.make(grpo.Args, vllm_sleep_mode=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--vllm-sleep-mode applies to vLLM on a GPU only (--rollout-engine auto is hf here" in "".join(
        checks.shared_flags(args)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engines, "vllm_available", lambda: True)
    assert not [p for p in checks.shared_flags(args) if "vllm-sleep-mode" in p]
    # float32 compute on a GPU is asked for by name; auto there is bfloat16, which the head flag changes
    assert not [p for p in checks.shared_flags(flags.replace(args, fp32_lm_head=True)) if "fp32" in p]


def test_vllm_that_is_not_installed_is_one_line_naming_the_flag(monkeypatch, tmp_path):
    """Was a RuntimeError chained to vLLM's ImportError: 17 lines of traceback."""
    from common import engines

    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    module, args = _args("grpo", output_dir=str(tmp_path / "runs"), rollout_engine="vllm", top_k=20)
    with pytest.raises(BadInput, match=r"--rollout-engine vllm needs vLLM, which is not installed: `pip install"):
        module.main(args)
    assert not (tmp_path / "runs").exists()
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # `import vllm` raises ImportError
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # what VLLMEngine sets is put back after
    with pytest.raises(BadInput, match="the vLLM engine cannot start: vllm does not import") as error:
        engines.VLLMEngine("tiny", "float32", 64, 0)
    assert error.value.__cause__ is None and error.value.__suppress_context__  # raised `from None`: one line


def _evaluate(monkeypatch, capsys, *argv):
    """`python -m common.evaluate ARGV`, in this process: the BadInput it raises, or (its JSON, its stderr)."""
    from common import evaluate

    monkeypatch.setattr("sys.argv", ["evaluate", *map(str, argv)])
    try:
        evaluate.main()
    except BadInput as error:
        return error
    out, err = capsys.readouterr()
    return json.loads(out[out.index("{") :]), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-turns", 2], "--max-turns applies to a task with tools only (a task file's TOOLS)"),
        (
            ["--task", "products", "--max-new-tokens", 28, "--max-episode-tokens", 5],
            "--max-episode-tokens must be 0 (twice --max-new-tokens) or >= --max-new-tokens",  # the scripts' rule
        ),
        (["--engine", "vllm"], "--engine vllm needs vLLM, which is not installed"),  # its own flag's name
        (["--task", "products", "--model", "tiny-moe", "--max-new-tokens", 28], "--model tiny-moe has no built-in"),
        (["--question-column", "q"], "--question-column applies to a local data file"),
    ],
)
def test_evaluate_refuses_what_the_scripts_refuse(argv, message, monkeypatch, capsys):
    from common import engines

    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    error = _evaluate(monkeypatch, capsys, *argv)
    assert isinstance(error, BadInput) and message in str(error), error


def test_evaluate_scores_a_data_files_held_out_rows_and_says_so(tmp_path, monkeypatch, capsys, tiny_dir):
    """A local file has no test split: the held-out rows of a training run on it, not every row (which trained)."""
    from common import evaluate

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": f"Q: {i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    scored = []
    monkeypatch.setattr(evaluate, "evaluate", lambda engine, tokenizer, rows, *_: scored.extend(rows) or {})
    result, err = _evaluate(monkeypatch, capsys, "--task", path, "--engine", "hf", "--k", 1)
    held_out = tasks.load_train_and_eval(str(path), None, verbose=False)[1]
    assert scored == held_out and len(scored) == 4 and result["split"] == "held-out" and result["prompts"] == 4
    assert f"scoring 4 prompts of the held-out split of {path}" in err
    # a file a training run was given as --eval-task, which it held out whole: every row
    scored.clear()
    result, err = _evaluate(monkeypatch, capsys, "--task", path, "--whole-file", "--engine", "hf", "--k", 1)
    assert scored == tasks.load_task(str(path), "train") and result["split"] == "all rows" and result["prompts"] == 40
    assert f"scoring 40 prompts of all rows of {path}" in err
    error = _evaluate(monkeypatch, capsys, "--task", "arith", "--whole-file")
    assert isinstance(error, BadInput) and "--whole-file must be used with a local data file as --task" in str(error)
    # the checkpoint of a run that had an --eval-task file of its own, which trained on every row of this one
    checkpoint = tmp_path / "step_00000002"
    shutil.copytree(tiny_dir, checkpoint)
    other = str(tmp_path / "other.jsonl")
    torch.save({"args": {"task": str(path), "eval_task": other}}, checkpoint / "trainer_state.pt")
    result, err = _evaluate(monkeypatch, capsys, "--task", path, "--model", checkpoint, "--engine", "hf", "--k", 1)
    assert f"warning: the run of {checkpoint} trained on every row of {path} (its --eval-task was" in err
    torch.save({"args": {"task": str(path), "eval_task": None}}, checkpoint / "trainer_state.pt")  # held out: fine
    assert "warning" not in _evaluate(monkeypatch, capsys, "--task", path, "--model", checkpoint, "--engine", "hf")[1]


def test_evaluate_names_the_base_a_lora_checkpoint_needs(tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "step_00000002"
    checkpoint.mkdir()
    moved = str(tmp_path / "models" / "base-that-moved")
    (checkpoint / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": moved}))
    error = _evaluate(monkeypatch, capsys, "--model", checkpoint)
    assert isinstance(error, BadInput), error
    assert f"the adapter's base model {moved} is not there" in str(error)
    assert f"put the base model back at {moved}, or point base_model_name_or_path in {checkpoint}" in str(error)


def test_lora_shapes_are_checked_against_the_config_before_any_weight_loads(tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from common import adapters
    from common.flags import Systems

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    # the tiny model's widest Linear layers (q_proj, o_proj, the MLP's) have rank 256 at most
    with pytest.raises(BadInput, match=r"--lora-rank 257 is larger than every targeted layer of .*rank 256\)"):
        adapters.load_policy(tiny_dir, None, Systems(lora_rank=257))
    # k_proj / v_proj alone are [128, 256]
    with pytest.raises(BadInput, match=r"--lora-rank 129 is larger .*self_attn.[kv]_proj \[128, 256\], has rank 128"):
        adapters.load_policy(tiny_dir, None, Systems(lora_rank=129, lora_target_modules=("k_proj", "v_proj")))
    # the output layer, by the model's own module (whatever a fork or common.checks calls it)
    with pytest.raises(BadInput, match="lm_head is .* output layer: the output layer takes no adapter"):
        adapters.load_policy(tiny_dir, None, Systems(lora_rank=4, lora_target_modules=("model.lm_head", "lm_head")))
    # a rank above k_proj's width (128) but not above the others' trains k_proj at full rank: accepted
    adapters.check_targets(tiny_dir, 256, ["all-linear"])


def test_a_rank_above_one_layers_width_is_accepted_on_an_moe_model(tmp_path):
    """A Qwen2-MoE model's shared_expert_gate is a Linear [1, hidden]: --lora-rank 8 on all-linear trains it at
    its full rank (1) and the other layers at rank 8, as peft allows; only a rank above every layer's width is
    refused."""
    import transformers

    from common import adapters
    from common.flags import Systems

    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    policy = adapters.load_policy(str(tmp_path), None, Systems(lora_rank=8))
    adapted = {n.rsplit(".", 2)[0] for n, p in policy.named_parameters() if p.requires_grad}
    assert any(name.endswith("shared_expert_gate.lora_A") for name in adapted), sorted(adapted)
    with pytest.raises(BadInput, match=r"--lora-rank 33 is larger than every targeted layer .*has rank 32"):
        adapters.check_targets(str(tmp_path), 33, ["all-linear"])


def _model_folder(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


@pytest.mark.parametrize("rank, why", [(4, "holds the adapter alone"), (0, "reference policy and tokenizer")])
def test_a_run_resumes_on_its_own_model_only(tmp_path, rank, why):
    """A LoRA checkpoint holds the adapter alone: resumed on another --model it would train beside other weights. A
    full one holds the weights, but --kl-coef's reference and the tokenizer would come from the other model."""
    grpo = importlib.import_module("algorithms.grpo")
    base = _model_folder(tmp_path / "base", b"weights of the base" * 100)
    other = _model_folder(tmp_path / "instruct", b"weights of another" * 100)
    moved = _model_folder(tmp_path / "elsewhere" / "base", b"weights of the base" * 100)
    checkpoint = _fake_checkpoint(tmp_path, flags.make(grpo.Args, lora_rank=rank, model=base))
    resume = lambda model: flags.flat(flags.make(grpo.Args, lora_rank=rank, model=model, resume=checkpoint))  # noqa: E731
    with pytest.raises(BadInput) as error:
        checks.check_resume(resume(other), checkpoint, verbose=False)
    assert f"run was trained on --model {base}, and --model {other} is another model" in str(error.value)
    assert f"Resume with --model {base}" in str(error.value) and why in str(error.value)
    for same in (base, moved):  # the same folder, or a copy of it elsewhere: the resume goes on to the files
        with pytest.raises(BadInput, match="the model weights is damaged or incomplete"):
            checks.check_resume(resume(same), checkpoint, verbose=False)


def test_the_built_in_moe_model_names_the_tasks_it_has():
    with pytest.raises(BadInput, match="--model tiny-moe has no built-in warm start for --task products: it has one"):
        resolve_model("tiny-moe", "products")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "models/qwen/typo"], "--model models/qwen/typo: no such model folder"),
        (["--model", "{run}"], "is a run folder, not a model"),
        (["--model", "{adapter}"], "is a LoRA adapter, not a model: pass its base as --model"),
        (["--model", "no-such-owner/no-such-model"], "--model no-such-owner/no-such-model: not a local model folder"),
        (["--micro-batch-size", 0], "--micro-batch-size must be >= 1"),
        (["--max-new-tokens", -5], "--max-new-tokens must be >= 1"),
        (["--lora-rank", -1], "--lora-rank must be >= 0 (0: full fine-tuning)"),
        (["--rollout-lag", -4], "--rollout-lag must be >= 0 (0: on-policy)"),
        (["--gpu-memory-utilization", 2], "--gpu-memory-utilization must be in (0, 1)"),
        (["--prompts-per-step", 0], "--prompts-per-step must be >= 1"),
        (["--gpus", 3], "--prompts-per-step must be divisible by --gpus 3"),
        (["--cpu-offload"], "--cpu-offload applies with --gpus > 1 only"),
        (["--lora-rank", 100000], "--lora-rank 100000 is larger than every targeted layer"),
        (["--model", "{headless}"], "config.json does not make a model's config (ZeroDivisionError"),
        (["--model", "{layerless}"], "num_hidden_layers = 0: a positive integer is needed"),
    ],
)
def test_the_memory_estimate_checks_its_flags_and_model_as_the_scripts_do(argv, message, tmp_path, monkeypatch):
    from common import memory

    run, adapter, headless = tmp_path / "run", tmp_path / "adapter", tmp_path / "headless"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    for name, zero in (("headless", "num_attention_heads"), ("layerless", "num_hidden_layers")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, zero: 0}))
    argv = [str(a).format(run=run, adapter=adapter, headless=headless, layerless=tmp_path / "layerless") for a in argv]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("sys.argv", ["memory", *argv])
    with pytest.raises(BadInput) as error:
        memory.main()
    assert message in str(error.value), str(error.value)


def test_the_memory_command_prints_one_line_and_no_traceback():
    result = run_script("-m", "common.memory", "--model", "models/qwen/typo", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("error: --model models/qwen/typo: no such model folder")


def test_the_memory_estimate_of_an_moe_model_says_it_is_for_dense_ones(tmp_path, monkeypatch, capsys):
    from transformers import MixtralConfig

    from common import memory

    MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_local_experts=4).save_pretrained(
        tmp_path
    )
    monkeypatch.setattr(memory, "estimate", lambda plan, config: config)  # the caveat, not the measurement
    monkeypatch.setattr(memory, "report", lambda plan, result: f"report of {type(result).__name__}")
    monkeypatch.setattr("sys.argv", ["memory", "--model", str(tmp_path)])
    memory.main()
    out, err = capsys.readouterr()
    assert (
        out.strip() == "report of MixtralConfig" and "is a mixture-of-experts model; this estimate is for dense" in err
    )
    monkeypatch.setattr("sys.argv", ["memory", "--model", "tiny"])
    memory.main()
    assert "mixture-of-experts" not in capsys.readouterr().err


def test_a_torn_last_metrics_line_is_dropped_and_garbage_before_it_is_named(tmp_path, capsys):
    """A run killed while writing a record resumes (the record's step is recomputed); a damaged line in the middle
    is not a kill's doing, and is named before anything loads."""
    from common.tracking import Tracker

    grpo = importlib.import_module("algorithms.grpo")
    checkpoint = _fake_checkpoint(tmp_path, grpo.Args())  # step 3 of tmp_path/run
    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = "".join(json.dumps({"step": step, "charts/reward": 0.5}) + "\n" for step in (1, 2, 3, 4))
    metrics.write_text(whole + '{"step": 5, "charts/rew')  # killed mid-write
    Tracker(str(tmp_path / "run"), {}, resume_step=3)
    assert metrics.read_text() == "".join(whole.splitlines(keepends=True)[:3])
    assert f"warning: {metrics}:5: the last line is not a whole record" in capsys.readouterr().err
    metrics.write_text(whole.replace('{"step": 2', 'x{"step": 2'))
    settings = flags.flat(flags.make(grpo.Args, resume=checkpoint))
    with pytest.raises(BadInput, match=rf"{metrics}:2: not a metrics record \(Expecting value.*Fix or remove the line"):
        checks.check_resume(settings, checkpoint, verbose=False)
    metrics.write_text(whole.replace('{"step": 3', '{"stop": 3'))
    with pytest.raises(BadInput, match=rf"{metrics}:3: not a metrics record \(no 'step'"):
        checks.check_resume(settings, checkpoint, verbose=False)


def test_an_output_dir_the_system_will_not_create_is_refused_with_its_reason(tmp_path):
    """/proc passes os.access for root, and makedirs failed later with a traceback."""
    (problem,) = checks.output_dir_problems("/proc/runs")
    assert problem.startswith("--output-dir /proc/runs cannot be created (making a folder in /proc: "), problem
    module, args = _args("grpo", output_dir="/proc/runs")
    with pytest.raises(BadInput, match="--output-dir /proc/runs cannot be created"):
        module.main(args)
    assert checks.output_dir_problems(str(tmp_path)) == [] and os.listdir(tmp_path) == []  # the probe is removed


# --- task files: the user's code that exits or floods ------------------------------------------------


def _task_file(tmp_path, body, name="task.py"):
    import textwrap

    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


TASK_ROWS = """
import os, sys

def rows(split):
    return [{"question": "Q: 1+1="}]
"""


def test_a_task_file_that_exits_as_it_is_imported_is_named(tmp_path):
    path = _task_file(tmp_path, TASK_ROWS + "sys.exit('not a script')\n", name="exits.py")
    with pytest.raises(BadInput, match=r"task file .*exits.py called sys.exit\('not a script'\) while it was imp"):
        tasks.load_task(path, "train")


def test_a_score_that_ends_its_worker_stops_the_run_once(tmp_path, tiny, capsys):
    """Was 8 warnings `score() ran past 10 s`, 80 s, and reward 0 for every completion."""
    from common.scoring import score_completions

    _, tokenizer = tiny
    path = _task_file(tmp_path, TASK_ROWS + "def score(completion, row):\n    os._exit(3)\n", name="dies.py")
    rows = tasks.load_task(path, "train")
    completions = _completions(tokenizer, ["2"] * 8)
    with pytest.raises(BadInput, match=r"dies.py: score\(completion, row\) exited \(its process ended with exit "):
        score_completions(completions, rows, 8, tokenizer, path)
    assert "ran past" not in capsys.readouterr().err


def _completions(tokenizer, texts):
    from common.engines import Completion

    return [Completion(tokenizer(t, add_special_tokens=False)["input_ids"], [0.0] * len(t), "stop") for t in texts]


TOOL = (
    TASK_ROWS
    + """
def score(completion, row):
    return 0.0

def calc(argument):
    if argument == "exit":
        os._exit(5)
    if argument == "sys.exit":
        sys.exit(6)
    if argument == "flood":
        print("y" * 60_000_000)  # 60 MB on the trainer's stdout, once
        return "x" * 60_000_000
    return "7"

TOOLS = {"calc": calc}
TOOL_SECONDS = 20
"""
)


def test_a_tool_that_exits_is_reported_as_exiting_and_a_flood_is_cut(tmp_path, tiny, capfd):
    from test_tools import ScriptedPolicy

    from common import task_files
    from common.tools import ToolEngine

    _, tokenizer = tiny
    toolbox = task_files.load_task_file(_task_file(tmp_path, TOOL, name="tool.py"))
    calls = iter(["<calc>exit</calc>", "<calc>sys.exit</calc>", "<calc>exit</calc>", "<calc>2</calc>", "done$"])
    engine = ToolEngine(ScriptedPolicy(tokenizer, lambda _: next(calls)), tokenizer, toolbox, 5, 400)
    (episode,) = engine.generate([tokenizer("Q: 1+1=")["input_ids"]], 1, 100, 1.0)
    text = tokenizer.decode([t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool])
    assert text == "<result>error: the tool exited</result>" * 3 + "<result>7</result>"  # a new worker answers
    assert (episode.tool_calls, episode.tool_errors, episode.tool_timeouts) == (4, 3, 0)  # not time-outs
    err = capfd.readouterr().err
    assert err.count("the tool calc exited") == 1 and "(its process ended with exit code 5)" in err
    outcome = task_files.run_each(toolbox, [("tool", "calc", "flood")], 20)[0]
    assert outcome[0] == "value" and len(outcome[1]) < task_files.OUTPUT_CHARS + 100
    assert outcome[1].endswith("[... cut: the output had 60,000,000 characters, the first 100,000 are shown]")
    out, err = capfd.readouterr()
    assert out == "" and len(err) < task_files.PRINTED_CHARS + 200  # the print: its first 4,000 characters
    assert "[... 59,996,001 more characters printed by the task file's code, not shown]" in err


@pytest.mark.parametrize("vllm", ["gpu", "CPU", "0.33.0"])
def test_run_sh_names_an_unknown_vllm_choice_before_it_installs_anything(tmp_path, vllm):
    import subprocess

    from helpers import REPO

    env = {**os.environ, "VLLM": vllm, "VENV": str(tmp_path / "venv")}
    out = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "test"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and f"VLLM={vllm}: not a choice" in out.stderr, out.stderr
    assert not (tmp_path / "venv").exists()  # nothing created, nothing installed


def test_a_score_that_raises_keyboardinterrupt_is_named_and_a_model_the_estimate_cannot_read_too(tmp_path):
    """A score() raising KeyboardInterrupt was reported as its process ending; `python -m common.memory` on a
    BERT-style config ended in an AttributeError; common.evaluate on a damaged checkpoint advised --resume."""
    from transformers import BertConfig

    from common import memory, task_files

    path = tmp_path / "interrupting.py"
    path.write_text(
        "def rows(split):\n    return [{'question': 'q'}]\n\ndef score(c, r):\n    raise KeyboardInterrupt\n"
    )
    kind, said = task_files._run_one((str(path), "score", "text", {"question": "q"}))
    assert kind == "raised" and "KeyboardInterrupt" in said
    with pytest.raises(BadInput, match=r"BertLMHeadModel \(bert\) keeps no decoder layers at model.model.layers"):
        memory.parameter_counts(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50))
    (tmp_path / "model").mkdir()
    with pytest.raises(BadInput, match=r"no \*.safetensors file.*pass one with --model PATH"):
        checks.check_checkpoint_files(str(tmp_path / "model"), weights_only=True)
