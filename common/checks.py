"""Checks of a script's flags, run before anything is loaded, and the warnings a running job gives.

    problems = shared_flags(args)                                  # the flags every script has
    problems += require(0 <= args.clip_low < 1, "--clip-low", "in [0, 1)")
    problems += unused(args, ["tis_cap"], "applies to --correction tis / tis-seq only")
    refuse(problems)                                               # one error listing every problem

Each check states what must hold (`0 < args.lr <= 1`), so NaN, which fails every comparison, is refused too.
What 0 means where it has a meaning (--eval-every 0: never; --save-every 0: only at the end; --keep-checkpoints
0: keep all; --warmup-steps 0: none; --overlong-buffer 0: off; --eval-k 0: greedy only) is said in each
flag's --help.
"""

from __future__ import annotations

import math
import os
import pickle
import sys

from common.errors import BadInput, clear_errors  # noqa: F401 (the scripts use checks.clear_errors)
from common.flags import flat
from common.tasks import MIN_NEW_TOKENS
from common.tools import toolbox_of

INFINITY = math.inf
MAX_ROLLOUT_LAG = 64


def require(ok: bool, flag: str, rule: str) -> list[str]:
    """[] when `ok`, else the problem "FLAG must be RULE"."""
    return [] if ok else [f"{flag} must be {rule}"]


def world_size() -> int:
    """The number of ranks torchrun launched (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def shared_flags(args) -> list[str]:
    """The problems with the flags common/ knows: those of the shared groups (common/flags.py), and the usual ones of
    an RL script (the experiment, rollouts and rewards, optimization, checkpoints), each checked only where the script
    has it: a fork that deletes a flag loses its check and nothing else."""
    v, defaults = flat(args), flat(type(args)())
    has = lambda *names: all(name in v for name in names)  # noqa: E731
    problems = []
    if has("exp_name"):
        problems += require(
            v["exp_name"].strip() != "", "--exp-name", "a name (part of the run folder's name), not empty"
        )
        problems += require(os.sep not in v["exp_name"], "--exp-name", "a name without '/'")
    if has("output_dir"):
        problems += output_dir_problems(v["output_dir"])
    if has("output_dir", "resume") and v["resume"] not in (None, "auto") and v["output_dir"] != defaults["output_dir"]:
        problems += resumed_output_dir_problems(v["resume"], v["output_dir"])
    if has("seed"):  # numpy's generators take [0, 2^32); each rank seeds with seed + rank
        problems += require(0 <= v["seed"] < 2**31, "--seed", "in [0, 2^31)")
    for name in ("steps", "prompts_per_step", "max_prompt_tokens", "max_sampling_rounds", "update_epochs"):
        problems += require(v.get(name, 1) >= 1, f"--{name.replace('_', '-')}", ">= 1")
    if has("prompts_per_step"):
        ranks = world_size()
        problems += require(v["prompts_per_step"] % ranks == 0, "--prompts-per-step", f"divisible by {ranks} ranks")
    if has("group_size"):
        problems += require(v["group_size"] >= 2, "--group-size", ">= 2 (advantages compare completions of one prompt)")
    if has("max_new_tokens", "task"):
        for task in dict.fromkeys([v["task"], v.get("eval_task") or v["task"]]):  # a held-out task's answers too
            least = MIN_NEW_TOKENS.get(task, 1)
            problems += require(v["max_new_tokens"] >= least, "--max-new-tokens", f">= {least} for {task}")
    if has("temperature"):
        problems += require(0 < v["temperature"] < INFINITY, "--temperature", "> 0 and finite")
        from common.engines import VLLM_MIN_TEMPERATURE, engine_kind

        engine = v.get("rollout_engine", v.get("engine"))  # (common.evaluate's --engine)
        if engine in ("auto", "hf", "vllm") and engine_kind(engine) == "vllm":  # vLLM raises a lower one to its floor
            floor = f">= {VLLM_MIN_TEMPERATURE} with the vLLM engine (it samples at that at least)"
            problems += require(v["temperature"] >= VLLM_MIN_TEMPERATURE, "--temperature", floor)
    if has("top_p"):
        problems += require(0 < v["top_p"] <= 1, "--top-p", "in (0, 1] (1: off)")
    if has("top_k"):
        problems += require(v["top_k"] >= 0, "--top-k", ">= 0 (0: off)")
    if has("rollout_lag"):
        # each step of lag is a batch sampled ahead, held in memory and in every checkpoint, and step 0 samples all
        # of them before it trains: 1e6 would never reach its first step
        problems += require(
            0 <= v["rollout_lag"] <= MAX_ROLLOUT_LAG, "--rollout-lag",
            f"in [0, {MAX_ROLLOUT_LAG}] (0: on-policy; each step of lag holds one more batch sampled ahead, and "
            "asynchronous pipelines run at 1 to 8)",
        )  # fmt: skip
    if has("rollout_lag", "steps") and v["rollout_lag"] >= v["steps"] >= 1 and os.environ.get("RANK", "0") == "0":
        # allowed (a run resumed with more --steps continues as one started with them), but worth a word
        print(f"note: --rollout-lag {v['rollout_lag']} >= --steps {v['steps']}: every step of this run trains on "
              f"rollouts that the first weights sampled, before any update", file=sys.stderr)  # fmt: skip
    if has("rollout_engine"):
        problems += vllm_install_problems(v["rollout_engine"], "--rollout-engine")
    if has("model", "task"):
        problems += tiny_model_problems(v["model"], v["task"])
    if has("rollout_engine", "top_p", "top_k", "keep_sampling_mask"):
        problems += vllm_mask_problems(v["rollout_engine"], v["top_p"], v["top_k"], v["keep_sampling_mask"])
    if has("rollout_engine", "engine_dtype") and v["engine_dtype"] in ("fp8", "int8"):
        from common.engines import engine_kind

        kind = engine_kind(v["rollout_engine"])  # auto: vLLM where it is installed and a GPU is present
        rule = "auto, float32, bfloat16 or float16 with vLLM (rounded weights are the hf engine's: --rollout-engine hf)"
        problems += require(kind == "hf", "--engine-dtype", rule)
    if has("overlap_rollouts", "rollout_engine", "engine_dtype") and v["overlap_rollouts"]:
        from common.engines import engine_kind

        # the transformers engine's copy scores a batch under its sampling weights (the trainer has moved on): that
        # copy must compute what the trainer computes
        rule = "off with another --engine-dtype on the hf engine (its copy scores the batch as the trainer would: auto)"
        hf = engine_kind(v["rollout_engine"]) == "hf"
        problems += require(not hf or v["engine_dtype"] == "auto", "--overlap-rollouts", rule)
        if "vllm_sleep_mode" in v:  # the engine samples while the trainer updates: it cannot free its memory then
            rule = "off with --vllm-sleep-mode (the engine samples during the update, so it cannot sleep through it)"
            problems += require(not v["vllm_sleep_mode"], "--overlap-rollouts", rule)
    if has("engine_process", "rollout_engine") and v["engine_process"]:
        from common.engines import engine_kind

        rule = (
            "used with vLLM (--rollout-engine vllm, or auto where vLLM and a GPU are): a process of its own is vLLM's"
        )
        problems += require(engine_kind(v["rollout_engine"]) == "vllm", "--engine-process", rule)
        if "vllm_sleep_mode" in v:
            rule = "off with --vllm-sleep-mode (the engine's GPU is its own: there is nothing to free for the trainer)"
            problems += require(not v["vllm_sleep_mode"], "--engine-process", rule)
    if has("max_turns"):
        problems += require(v["max_turns"] >= 1, "--max-turns", ">= 1")
    if has("max_episode_tokens", "max_new_tokens"):
        episode, new_tokens = v["max_episode_tokens"], v["max_new_tokens"]
        rule = "0 (twice --max-new-tokens) or >= --max-new-tokens"
        problems += require(episode == 0 or episode >= new_tokens, "--max-episode-tokens", rule)
    if has("overlong_buffer", "max_new_tokens"):
        problems += require(
            0 <= v["overlong_buffer"] < v["max_new_tokens"], "--overlong-buffer", "in [0, --max-new-tokens)"
        )
    if has("lr"):
        problems += require(0 < v["lr"] <= 1, "--lr", "in (0, 1] (an AdamW learning rate; 1e-6 to 1e-4 is usual)")
    if has("warmup_steps"):
        problems += require(v["warmup_steps"] >= 0, "--warmup-steps", ">= 0 (0: no warm-up)")
    if has("weight_decay"):
        problems += require(0 <= v["weight_decay"] < INFINITY, "--weight-decay", ">= 0 and finite")
    if has("max_grad_norm"):
        problems += require(0 <= v["max_grad_norm"] < INFINITY, "--max-grad-norm", ">= 0 and finite (0: no clipping)")
    if has("num_minibatches", "prompts_per_step", "group_size"):  # each rank splits its own rollouts
        rollouts = max(1, v["prompts_per_step"] // world_size()) * v["group_size"]
        rule = f"in [1, {rollouts}] (the rollouts of a rank)"
        problems += require(1 <= v["num_minibatches"] <= rollouts, "--num-minibatches", rule)
    if has("micro_batch_size"):
        problems += require(v["micro_batch_size"] >= 1, "--micro-batch-size", ">= 1")
    if has("eval_every"):
        problems += require(v["eval_every"] >= 0, "--eval-every", ">= 0 (0: never)")
    if has("task", "eval_task") and v["eval_task"]:  # the run's engine runs --task's tools, and only those
        tools = [getattr(toolbox_of(v[name]), "path", None) for name in ("task", "eval_task")]
        rule = "a task with the tools of --task (the run's engine runs those): another is scored by python -m "
        problems += require(tools[0] == tools[1], "--eval-task", rule + "common.evaluate on a checkpoint")
    if has("eval_prompts"):
        problems += require(v["eval_prompts"] >= 1, "--eval-prompts", ">= 1")
    if has("eval_k"):
        problems += require(v["eval_k"] >= 0, "--eval-k", ">= 0 (0: greedy accuracy only)")
    if has("save_every"):
        problems += require(v["save_every"] >= 0, "--save-every", ">= 0 (0: only at the end)")
    if has("keep_checkpoints"):
        problems += require(v["keep_checkpoints"] >= 0, "--keep-checkpoints", ">= 0 (0: keep them all)")
    if has("gpu_memory_utilization"):
        problems += require(0 < v["gpu_memory_utilization"] < 1, "--gpu-memory-utilization", "in (0, 1)")
    if has("lora_rank", "lora_alpha", "lora_target_modules"):
        problems += require(v["lora_rank"] >= 0, "--lora-rank", ">= 0 (0: full fine-tuning)")
        problems += require(0 < v["lora_alpha"] < INFINITY, "--lora-alpha", "> 0 and finite")
        targets = v["lora_target_modules"]
        rule = "one or more module names (all-linear: every Linear but the output layer)"
        problems += require(len(targets) > 0 and all(targets), "--lora-target-modules", rule)
        if "lm_head" in targets:  # the usual name; common.adapters checks the model's own
            from common.adapters import OUTPUT_LAYER_ADAPTER

            problems += [f"--lora-target-modules lm_head: {OUTPUT_LAYER_ADAPTER}"]
    # a run resumed by path compares these values with its own instead (check_resume), but for those a resume may
    # change, which are this command's alone; --resume auto may start a new run, and finds a run made with such a
    # flag without it too (resume_differences passes over inert flags)
    new_run = v.get("resume") in (None, "", "auto")
    problems += [
        f"--{n.replace('_', '-')} {why}"
        for n, why in inert_flags(v).items()
        if v[n] != defaults[n] and (new_run or n in RESUME_MAY_CHANGE)
    ]
    return problems


def inert_flags(v: dict) -> dict[str, str]:
    """The flags of the shared groups that the other values of a run make do nothing, each with when it
    applies (`v`: flat(args)). A new run refuses them where they are set away from their defaults (no
    flag silently ignored); a resumed run may differ from its own settings in them (check_resume),
    so that a run keeps resuming after a flag of it became refusable."""
    from common.engines import engine_kind

    inert = {}

    def ignored(names, why):
        inert.update({name: why for name in names if name in v})

    if "top_p" in v and "top_k" in v and v["top_p"] == 1 and v["top_k"] == 0:
        ignored(["keep_sampling_mask"], "applies with --top-p < 1 or --top-k > 0 only")
    if "task" in v and toolbox_of(v["task"]) is None:
        ignored(["max_turns", "max_episode_tokens"], "applies to a task with tools only (a task file's TOOLS)")
    if "lora_rank" in v and not v["lora_rank"]:
        ignored(["lora_alpha", "lora_target_modules"], "applies with --lora-rank > 0 only")
    if "rollout_lag" in v and v["rollout_lag"] == 0:
        ignored(["overlap_rollouts"], "applies with --rollout-lag >= 1 only (a batch sampled ahead)")
    if "dynamic_sampling" in v and not v["dynamic_sampling"]:
        ignored(["max_sampling_rounds"], "applies with --dynamic-sampling only")
    if "eval_every" in v and v["eval_every"] == 0:
        ignored(["eval_prompts", "eval_k"], "applies with --eval-every > 0 only")
        if not is_data_file(v.get("task")):  # a local --task file trains on all its rows with another --eval-task
            ignored(["eval_task"], "applies with --eval-every > 0 (or a local data file as --task) only")
    if "rollout_engine" in v:
        # Auto is resolved as common.engines.engine_kind will resolve it for the run this command
        # starts, here: the flags are refused where this run would ignore them, whatever another
        # machine would do. vLLM on a CPU takes neither (it has no GPU memory to share or free).
        engine, kind = v["rollout_engine"], engine_kind(v["rollout_engine"])
        if kind == "hf" or not _has_gpu():
            auto = "auto is hf here: vLLM needs a GPU and the vllm package"
            here = {"hf": "hf", "auto": auto}.get(engine, "vllm runs on the CPU here")
            why = f"applies to vLLM on a GPU only (--rollout-engine {here})"
            ignored(["vllm_sleep_mode", "gpu_memory_utilization"], why)
    if world_size() == 1:  # fsdp.shard keeps one rank's model whole on its device
        ignored(["cpu_offload"], "applies with several ranks (torchrun) only")
    if "track" in v and not v["track"]:
        ignored(["wandb_project_name", "wandb_entity"], "applies with --track only")
    if "question_column" in v and not any(is_data_file(v.get(n)) for n in ("task", "eval_task")):
        why = "applies to a local data file (.jsonl, .json, .parquet) as --task or --eval-task only"
        ignored(["question_column", "answer_column"], why)
    float32_engine = v.get("engine_dtype", "auto") in ("auto", "float32", "fp8", "int8")
    if "fp32_lm_head" in v and "dtype" in v and float32_engine:
        # Float32 compute (--dtype float32, or auto on a CPU, resolved as common.fsdp resolves it
        # for this run) and an engine in float32 too (auto follows the trainer; fp8 / int8 keep
        # its dtype): the output layer computes in float32 everywhere already. A bfloat16 or
        # float16 --engine-dtype beside float32 compute does use the flag.
        if _compute_dtype(v["dtype"]) == "float32":
            why = "applies with bfloat16 / float16 compute (--dtype) or engine (--engine-dtype) only"
            ignored(["fp32_lm_head"], why)
    return inert


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _compute_dtype(dtype: str) -> str:
    """The trainer's compute dtype for --dtype, as common.fsdp.compute_dtype gives it here."""
    return ("bfloat16" if _has_gpu() else "float32") if dtype == "auto" else dtype


def is_data_file(task: str | None) -> bool:
    """Whether --task / --eval-task names a local data file (its columns: --question-column,
    --answer-column)."""
    from common.tasks import LOCAL_FORMATS

    return bool(task) and os.path.splitext(task)[1].lower() in LOCAL_FORMATS


def vllm_mask_problems(rollout_engine: str, top_p: float, top_k: int, keep_sampling_mask: bool) -> list[str]:
    """vLLM returns a kept set of at most VLLM_MAX_MASK tokens per position, so a kept sampling mask needs a top-k in
    that range there: refused here, before the model and vLLM load, rather than at the first rollout."""
    from common.engines import VLLM_MAX_MASK, engine_kind, vllm_mask_problem

    masked = keep_sampling_mask and (top_p < 1 or top_k > 0)
    if masked and engine_kind(rollout_engine) == "vllm" and not 0 < top_k <= VLLM_MAX_MASK:
        return [vllm_mask_problem()]
    return []


def vllm_install_problems(engine: str, flag: str) -> list[str]:
    """`flag` vllm (the scripts' --rollout-engine, common.evaluate's --engine) where vllm is not
    installed."""
    from common.engines import vllm_available, vllm_missing

    return [vllm_missing(flag)] if engine == "vllm" and not vllm_available() else []


def tiny_model_problems(model: str, task: str) -> list[str]:
    """A built-in model asked for with a task it has no warm start of (tiny.tiny_model_problem)."""
    from common.tiny import tiny_model_problem

    problem = tiny_model_problem(model, task)
    return [problem] if problem else []


def unused(args, names: list[str], why: str) -> list[str]:
    """Problems for the method flags in `names` set away from their defaults where the chosen variant ignores
    them (`why` says when they apply), so that no flag is silently ignored."""
    defaults = type(args)()
    return [f"--{name.replace('_', '-')} {why}" for name in names if getattr(args, name) != getattr(defaults, name)]


def resumed_output_dir_problems(resume: str, output_dir: str) -> list[str]:
    """--resume PATH continues the run in its own folder: an --output-dir elsewhere would be ignored."""
    run = os.path.normpath(resume)
    if os.path.isfile(os.path.join(run, "trainer_state.pt")):  # a checkpoint: <run>/checkpoints/step_N
        run = os.path.dirname(os.path.dirname(run))
    if not os.path.isdir(run) or os.path.realpath(os.path.dirname(run)) == os.path.realpath(output_dir):
        return []  # (a --resume that names nothing is refused by name when the run starts)
    return [f"--output-dir {output_dir}: a resumed run continues in its own folder ({run}); leave it out with --resume "
            "PATH (to continue a copy elsewhere, copy the run's folder there and resume the copy)"]  # fmt: skip


def output_dir_problems(path: str) -> list[str]:
    """--output-dir must be a folder this process can write to, or one it can create. A folder is
    made and removed again to find out: permission bits say nothing of /proc, a read-only mount or
    a full disk (and root passes every os.access check)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return [f"--output-dir {path} is a file, not a folder"]
        reason = _cannot_make_a_folder_in(path)
        return [f"--output-dir {path} is not writable ({reason})"] if reason else []
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"--output-dir {path} cannot be created ({parent} is not a writable folder)"]
    reason = _cannot_make_a_folder_in(parent)
    if reason:
        why = f"making a folder in {parent}: {reason}"
        return [f"--output-dir {path} cannot be created ({why}); choose another"]
    return []


def _cannot_make_a_folder_in(folder: str) -> str | None:
    """The operating system's reason why no folder can be made in `folder`, or None (a probe is
    made and removed)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=folder))
    except OSError as error:
        return error.strerror or str(error)
    return None


def refuse(problems: list[str]) -> None:
    """Raise one error that lists every problem, or nothing."""
    if problems:
        raise BadInput("invalid arguments:\n  " + "\n  ".join(problems))


class Watch:
    """Warnings from a running job's metrics: steps that changed nothing, a policy that became uniform, a task
    whose answers are never found. Each warns once, after `patience` training steps in a row."""

    def __init__(self, vocab_size: int, updates_per_step: int, patience: int = 3, enabled: bool = True):
        self.max_entropy, self.updates_per_step = math.log(vocab_size), updates_per_step
        self.patience, self.enabled = patience, enabled
        self.skipped_before, self.streaks, self.warned = None, {}, set()

    def step(self, logged: dict, step: int) -> None:
        """Look at one training step's reduced metrics (`step`: its number, for the message)."""
        skipped = logged.get("charts/skipped_steps", 0)  # optimizer steps skipped so far
        skipped_now = skipped - (skipped if self.skipped_before is None else self.skipped_before)
        self.skipped_before = skipped
        entropy = logged.get("charts/entropy", 0.0)
        checks = {
            "skipped": (
                skipped_now >= self.updates_per_step,
                "every optimizer step was skipped (a non-finite loss or gradient norm, or no response token): "
                "the policy does not change; see losses/grad_norm, and lower --lr",
            ),
            "uniform": (
                entropy > 0.9 * self.max_entropy,
                f"the policy's entropy ({entropy:.2f} nats) is near its maximum, log(vocabulary) = "
                f"{self.max_entropy:.2f}: it samples almost uniformly; a learning rate too large does this",
            ),
            "no_answer": (
                logged.get("charts/no_answer_rate") == 1.0,
                "no completion had an answer to score (charts/no_answer_rate = 1), so every reward is 0: the "
                "model does not answer in the task's format (a math task's answer is read from \\boxed{}, "
                "`#### x` or `Answer: x`; the built-in `tiny` model answers the built-in tasks only)",
            ),
        }
        for name, (bad, message) in checks.items():
            self._check(name, bad, step, message)

    def _check(self, name: str, bad: bool, step: int, message: str) -> None:
        self.streaks[name] = self.streaks.get(name, 0) + 1 if bad else 0
        if self.enabled and self.streaks[name] >= self.patience and name not in self.warned:
            self.warned.add(name)
            print(f"warning (step {step}): {message}", file=sys.stderr)


# --resume may change what does not change the run's math: its length, its bookkeeping and where it runs
RESUME_MAY_CHANGE = {
    *("steps", "resume", "output_dir", "model", "track", "wandb_project_name", "wandb_entity"),
    *("eval_every", "eval_prompts", "eval_k", "save_every", "keep_checkpoints"),
    *("rollout_engine", "gpu_memory_utilization", "vllm_sleep_mode", "cpu_offload", "gradient_checkpointing"),
    "micro_batch_size",  # gradient accumulation: memory, not the math
    "overlap_rollouts",  # when a batch is sampled, not what
    "engine_process",  # where the engine runs
}


def kept_from_the_run(settings: dict, saved: dict, defaults: dict, argv: list[str]) -> dict:
    """The flags a resume may change (RESUME_MAY_CHANGE) that this command leaves at their default, neither given on
    its command line (`argv`) nor set otherwise, where the run has its own value: {name: the run's value}. A resume
    continues the run as it was started (its length, its cadences, its engine) unless a flag says otherwise."""
    given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    kept = RESUME_MAY_CHANGE - {"resume", "output_dir", "model"}  # a model's place: same_model_check compares them
    at_default = {n for n in kept & settings.keys() if settings[n] == defaults.get(n) and n not in given}
    return {n: saved[n] for n in sorted(at_default) if n in saved and saved[n] != settings[n]}


def resume_differences(settings: dict, saved: dict, verbose: bool = False) -> list[str]:
    """The flags of `settings` (this command's) that differ from `saved` (a run's) where they would change the run's
    math, each as "--flag <the run's> in the run, <now's> now". A flag that does nothing in this run (the run may be
    older than its refusal) is no difference: a note says so (`verbose`), as it does of a flag of the run's that the
    script no longer has (p3o.py's --sync-every, replaced by --rollout-lag)."""
    changed = [n for n, value in settings.items() if n not in RESUME_MAY_CHANGE and n in saved and value != saved[n]]
    inert = inert_flags(settings)
    flag = lambda name: f"--{name.replace('_', '-')}"  # noqa: E731
    for n in (n for n in changed if n in inert and verbose):
        print(f"note: {flag(n)} {settings[n]} (the run: {saved[n]}) does nothing here: {inert[n]}", file=sys.stderr)
    for n in (n for n in saved if n not in settings and verbose):  # a flag the script has since lost
        print(f"note: the run was made with {flag(n)} {saved[n]}, which this script no longer has", file=sys.stderr)
    return [f"{flag(n)} {saved[n]} in the run, {settings[n]} now" for n in changed if n not in inert]


def check_resume(settings: dict, checkpoint: str, verbose: bool = True) -> None:
    """A resumed run continues with its own settings (`settings`: this command's, flags.flat(args)): refuse flags that
    differ from the run's where they would change its math (the list names each difference), check that the
    checkpoint's files are whole, and say what is resumed."""
    saved = read_checkpoint_file(checkpoint, "trainer_state.pt")["args"]
    differences = resume_differences(settings, saved, verbose)
    if differences:
        raise BadInput(
            f"--resume {settings['resume']}: the run was made with other settings, and a resumed run keeps its own "
            f"({os.path.dirname(os.path.dirname(checkpoint))}/config.json): " + "; ".join(differences) + ". Resume "
            "with the run's values, or start a new run. A resume may change: "
            + ", ".join(f"--{n.replace('_', '-')}" for n in sorted(RESUME_MAY_CHANGE - {"resume"}))
        )
    if "model" in settings and "model" in saved:
        same_model_check(settings, saved["model"], adapter=bool(saved.get("lora_rank")))
    step = int(os.path.basename(checkpoint).split("_")[-1])
    if settings.get("steps", step) < step:  # it would do nothing, and rewrite the run's config.json
        raise BadInput(
            f"--resume {settings['resume']}: the run is at step {step} already, past --steps {settings['steps']}: "
            f"pass --steps {step + 1} or more to continue it"
        )
    metrics = os.path.join(os.path.dirname(os.path.dirname(checkpoint)), "metrics.jsonl")
    if os.path.isfile(metrics):  # a damaged line is named now, not once the model is loaded
        from common.tracking import records_to_resume

        records_to_resume(metrics, step, verbose=False)  # the Tracker warns of a torn last line
    check_checkpoint_files(checkpoint)
    if verbose:
        print(f"resuming {os.path.dirname(os.path.dirname(checkpoint))} at step {step} ({checkpoint})", file=sys.stderr)


def same_model_check(settings: dict, trained_on: str, adapter: bool) -> None:
    """A resume continues the run's model (`trained_on`, from the run's settings): its --model may name the same
    model at another place (a moved folder, the same files), not another model. A LoRA checkpoint holds the adapter
    alone, its frozen weights are the run's model; a full checkpoint holds the weights, and the reference policy
    of --kl-coef and the tokenizer still come from --model."""
    from common.tiny import resolve_model

    given = resolve_model(settings["model"], settings.get("task", "arith"))
    if trained_on in ("tiny", "tiny-moe"):  # as a run records it before resolving (or an older run)
        trained_on = resolve_model(trained_on, settings.get("task", "arith"))
    if _same_model(trained_on, given):
        return
    shown = settings["model"] + (f" ({given})" if given != settings["model"] else "")
    why = (
        "the checkpoint holds the adapter alone, its frozen weights are the run's model"
        if adapter
        else "the checkpoint continues the run's weights, whose reference policy and tokenizer are the run's model's"
    )
    raise BadInput(
        f"--resume {settings['resume']}: this {'LoRA ' if adapter else ''}run was trained on --model {trained_on}, "
        f"and --model {shown} is another model: {why}. Resume with --model {trained_on} (or a copy of it "
        "elsewhere), or start a new run"
    )


def _same_model(a: str, b: str) -> bool:
    """Whether two --model values are one model: the same name or folder, two folders with the
    same config.json and weight files (a moved copy), or a folder that is gone (moved: it cannot be
    compared; adapters.load_policy warns). A hub id and a local folder, or two hub ids, differ
    unless they are equal."""
    if a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)):
        return True
    looks_local = a.startswith((".", "/", "~")) or a.count("/") > 1
    if looks_local and not os.path.isdir(a):
        return True
    if not (os.path.isdir(a) and os.path.isdir(b)):
        return False
    fingerprint = _fingerprint(a)
    return fingerprint is not None and fingerprint == _fingerprint(b)


def _fingerprint(folder: str):
    """What tells a model folder's copy from another model, cheaply: its config.json, and the size
    and last 64 KiB of each weight file (two fine-tunes of one base have the same headers, not the
    same data in their last tensors)."""
    import hashlib
    import json

    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        weights = []
        names = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin")))
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 2**16))
                weights.append((name, size, hashlib.sha256(f.read()).hexdigest()))
    except (OSError, ValueError):
        return None
    config.pop("_name_or_path", None)
    return json.dumps(config, sort_keys=True), weights


def earlier_checkpoints(checkpoint: str) -> str:
    """The other complete checkpoints of the run, for an error message."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    others = sorted(
        name
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if name.startswith("step_") and not name.endswith(".tmp") and name != os.path.basename(checkpoint)
    )
    return f"other checkpoints of this run: {', '.join(others)}" if others else "the run has no other checkpoint"


def damaged(checkpoint: str, name: str, error: Exception, to_use: str = "--resume PATH") -> BadInput:
    """`name` of `checkpoint` cannot be read: what, why, and the run's other checkpoints, to pass as `to_use`."""
    reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return BadInput(
        f"checkpoint {checkpoint}: {name} is damaged or incomplete ({reason}); {earlier_checkpoints(checkpoint)} "
        f"(pass one with {to_use})"
    )


def read_checkpoint_file(checkpoint: str, name: str):
    """torch.load of one of the checkpoint's small files, or a BadInput that names it."""
    import torch

    path = os.path.join(checkpoint, name)
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:
        raise damaged(checkpoint, name, error) from None


def base_dtype_of(checkpoint: str) -> str:
    """The dtype the run of an adapter checkpoint held its frozen base in (save_checkpoint records it); float32 for a
    bare adapter folder."""
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.pt")):
        return "float32"
    return read_checkpoint_file(checkpoint, "trainer_state.pt").get("base_dtype", "float32")


def check_checkpoint_files(checkpoint: str, weights_only: bool = False) -> None:
    """Open every file of a checkpoint (or of a model folder, `weights_only`) far enough to find one truncated or
    corrupted: the weights' safetensors headers and sizes, the trainer state, each rank's RNG state and queue, the
    optimizer's metadata and shards."""
    from safetensors import safe_open

    to_use = "--model PATH" if weights_only else "--resume PATH"  # common.evaluate's flag, or a script's
    weights = [n for n in sorted(os.listdir(checkpoint)) if n.endswith(".safetensors")]
    if not weights and not any(n.endswith(".bin") for n in os.listdir(checkpoint)):
        raise damaged(checkpoint, "the model weights", FileNotFoundError("no *.safetensors file"), to_use)
    for name in weights:
        try:
            with safe_open(os.path.join(checkpoint, name), "pt") as f:
                f.keys()
        except Exception as error:
            raise damaged(checkpoint, name, error, to_use) from None
    if weights_only:
        return
    for name in sorted(os.listdir(checkpoint)):
        if name.startswith(("rng_rank", "rollouts_rank")) or name == "trainer_state.pt":
            read_checkpoint_file(checkpoint, name)
    written = read_checkpoint_file(checkpoint, "trainer_state.pt").get("rank_files")  # (older checkpoints: not said)
    for rank in range(written["world_size"] if written else 0):
        for name in [f"rng_rank{rank}.pt"] + ([f"rollouts_rank{rank}.pt"] if written["rollouts"] else []):
            if not os.path.isfile(os.path.join(checkpoint, name)):
                raise damaged(checkpoint, name, FileNotFoundError("missing: the run wrote it"))
    optimizer = os.path.join(checkpoint, "optimizer")
    shards = sorted(os.listdir(optimizer)) if os.path.isdir(optimizer) else []
    if ".metadata" not in shards:
        raise damaged(checkpoint, "optimizer/.metadata", FileNotFoundError("missing"))
    try:
        with open(os.path.join(optimizer, ".metadata"), "rb") as f:
            pickle.load(f)
    except Exception as error:
        raise damaged(checkpoint, "optimizer/.metadata", error) from None
    for name in shards:
        if name.endswith(".distcp") and os.path.getsize(os.path.join(optimizer, name)) == 0:
            raise damaged(checkpoint, f"optimizer/{name}", ValueError("empty"))
