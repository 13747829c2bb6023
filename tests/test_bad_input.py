"""Bad input, as a new user gives it, to every script: each is refused with one message that names the flag, file
or model and what to do (none is accepted and silently misused), before a run folder is made; a resumed run keeps
its own settings; a damaged checkpoint is named. Also the warnings a running job gives, and `common.evaluate`."""

import dataclasses
import importlib
import json
import math
import os
import shutil

import pytest
import torch
from helpers import ALGORITHMS, only_run_dir, run_script

from common import checks, flags, tasks
from common.errors import BadInput
from common.tiny import resolve_model

NAN = math.nan
SMALL = {"prompts_per_step": 4, "group_size": 4, "eval_every": 0}
# (flag overrides, a part of the message); every script refuses each of these in check_args
SHARED_CASES = [
    ({"max_grad_norm": -1.0}, "--max-grad-norm must be > 0 and finite (1e9: no clipping)"),  # reversed the update
    ({"max_grad_norm": NAN}, "--max-grad-norm must be > 0"),
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
    ({"keep_sampling_mask": False}, "--keep-sampling-mask applies with --top-p < 1 or --top-k > 0 only"),
    # vLLM returns at most 20 kept tokens per position: a kept mask needs a top-k there, refused before loading
    (
        {"rollout_engine": "vllm", "top_p": 0.9},
        "to keep the sampling mask of --top-p / --top-k, set --top-k in [1, 20]",
    ),
    ({"rollout_engine": "vllm", "top_k": 50}, "to keep the sampling mask of --top-p / --top-k, set --top-k in [1, 20]"),
    ({"weight_decay": -0.1}, "--weight-decay must be >= 0 and finite"),
    ({"weight_decay": NAN}, "--weight-decay must be >= 0 and finite"),
    ({"group_size": 1}, "--group-size must be >= 2"),
    ({"prompts_per_step": 0}, "--prompts-per-step must be >= 1"),
    ({"max_prompt_tokens": 0}, "--max-prompt-tokens must be >= 1"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
    ({"task": "sums", "max_new_tokens": 16}, "--max-new-tokens must be >= 41 for sums"),
    ({"overlong_buffer": 16}, "--overlong-buffer must be in [0, --max-new-tokens)"),
    ({"max_sampling_rounds": 0}, "--max-sampling-rounds must be >= 1"),
    ({"num_minibatches": 0}, "--num-minibatches must be in [1, 16] (the rollouts)"),
    ({"num_minibatches": 257}, "--num-minibatches must be in [1, 16] (the rollouts)"),
    ({"update_epochs": 0}, "--update-epochs must be >= 1"),
    ({"micro_batch_size": 0}, "--micro-batch-size must be >= 1"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1)"),
    ({"exp_name": "a/b"}, "--exp-name must be a name without '/'"),
    ({"lora_rank": -4}, "--lora-rank must be >= 0 (0: full fine-tuning)"),
    ({"lora_rank": 8, "lora_alpha": 0.0}, "--lora-alpha must be > 0 and finite"),
    ({"lora_rank": 8, "lora_alpha": NAN}, "--lora-alpha must be > 0 and finite"),
    ({"lora_rank": 8, "lora_target_modules": ()}, "--lora-target-modules must be one or more module names"),
    ({"lora_alpha": 64.0}, "--lora-alpha applies with --lora-rank > 0 only"),
]
# each method's own flags: out of range, NaN, or set where the chosen variant ignores them
METHOD_CASES = {
    "grpo": [
        ({"clip_high": NAN}, "--clip-high must be >= 0 and finite"),  # skipped every update without a word
        ({"kl_coef": NAN}, "--kl-coef must be >= 0 and finite"),
        ({"clip_low": 1.0}, "--clip-low must be in [0, 1)"),
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
        ({"sync_every": 0}, "--sync-every must be >= 1"),
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
        ({"block_size": 0}, "--block-size must be >= 1"),  # was a ZeroDivisionError in the checks
        ({"n_overlap": 0}, "--n-overlap must be >= 1"),
        ({"variant": "interacting", "ntk_reg_coef": 0.0}, "--ntk-reg-coef must be > 0"),
        ({"ema_decay": 1.0}, "--ema-decay must be in [0, 1)"),
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
CASES = [
    pytest.param(name, flags, message, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in flags.items())}")
    for name in ALGORITHMS
    for flags, message in SHARED_CASES + METHOD_CASES[name]
]


def _args(name, **overrides):
    module = importlib.import_module(f"algorithms.{name}")
    return module, flags.make(module.Args, **{**SMALL, **overrides})


@pytest.mark.parametrize("name, flags, message", CASES)
def test_a_bad_flag_is_refused_by_name(name, flags, message, tmp_path):
    module, args = _args(name, output_dir=str(tmp_path / "runs"), **flags)
    with pytest.raises(BadInput) as error:
        module.main(args)  # check_args runs first: nothing is loaded, no folder is made
    assert message in str(error.value), str(error.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_defaults_pass_and_every_problem_is_listed_at_once(name):
    module, args = _args(name)
    module.check_args(args)
    with pytest.raises(BadInput) as error:
        module.check_args(dataclasses.replace(args, steps=-1, lr=NAN, keep_checkpoints=-1))
    assert str(error.value).count("\n") == 3  # the header and the three problems


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_command_prints_one_line_per_problem_and_no_traceback(name, tmp_path):
    result = run_script(
        f"algorithms/{name}.py", "--steps", -3, "--max-grad-norm", -1, "--output-dir", tmp_path, check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error: invalid arguments:\n  --steps must be >= 1\n" in result.stderr
    assert "--max-grad-norm must be > 0" in result.stderr and not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"task": "gsm9k"}, "unknown task 'gsm9k': use one of"),
        ({"task": "missing.jsonl"}, "task file not found: missing.jsonl"),
        ({"task": "{tmp}/columns.jsonl"}, "has no column(s) ['question', 'answer']; its columns are ['problem', 'x']"),
        (
            {"eval_task": "aime25", "task": "{tmp}/columns.jsonl", "question_column": "problem", "answer_column": "x"},
            "could not load task 'aime25'",
        ),
        ({"resume": "no/such/run"}, "--resume no/such/run: no such checkpoint or run folder"),
        ({"resume": "auto"}, "--resume auto: no complete checkpoint found (looked for arith__grpo__1__*"),
    ],
)
def test_a_bad_task_or_resume_is_named_before_any_model_loads(flags, message, tmp_path):
    (tmp_path / "columns.jsonl").write_text('{"problem": "1+1", "x": "2"}\n')
    flags = {key: value.replace("{tmp}", str(tmp_path)) for key, value in flags.items()}
    module, args = _args("grpo", output_dir=str(tmp_path / "runs"), **flags)
    with pytest.raises(BadInput) as error:
        module.main(args)
    assert message in str(error.value), str(error.value)


def test_output_dir_that_is_a_file_or_cannot_be_made(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert checks.output_dir_problems(str(afile)) == [f"--output-dir {afile} is a file, not a folder"]
    assert "cannot be created" in checks.output_dir_problems(str(afile / "runs"))[0]
    assert checks.output_dir_problems(str(tmp_path / "new" / "runs")) == []  # made when the run starts


# --- files and models -------------------------------------------------------------------------------


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
    assert "5 of the 50 rows" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n")
    train, held_out = tasks.load_train_and_eval(str(path), str(other))
    assert len(train) == 50 and len(held_out) == 1  # a separate held-out file: all of it, and all of the task trains
    assert tasks.load_train_and_eval("arith", None)[1] == tasks.load_task("arith", "test")  # named tasks: test split


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


def _fake_checkpoint(tmp_path, args):
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    torch.save({"args": flags.flat(args), "step": 3}, folder / "trainer_state.pt")
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


def test_a_resume_with_fewer_steps_than_the_run_has_is_refused(tmp_path):
    """--resume RUN --steps 1 on a run at step 3 would do nothing and rewrite the run's config.json to steps: 1."""
    grpo = importlib.import_module("algorithms.grpo")
    checkpoint = _fake_checkpoint(tmp_path, grpo.Args())
    with pytest.raises(BadInput, match="the run is at step 3 already, past --steps 1: pass --steps 4 or more"):
        checks.check_resume(flags.flat(flags.make(grpo.Args, steps=1, resume=checkpoint)), checkpoint)
