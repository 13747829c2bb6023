"""Benchmark every method on the built-in task, and put each paper's claim to the test: run, plot, tabulate.

    ./run.sh bench                 # every method, 3 seeds, 60 steps (about 30 minutes of CPU)
    ./run.sh bench --quick         # every method, 1 seed, 8 steps: a few minutes
    ./run.sh bench ema_kpo p3o     # paper-claim experiments (ema_kpo, p3o, tis_icepop, gtpo, isopo)
    ./run.sh bench all             # the benchmark and every experiment
    ./run.sh bench isopo --plot-only   # redraw from the runs already there (--list: the runs, none run)
    ./run.sh bench stress_search   # GRPO alone on the reasoning task, in each setting searched for a failure
    ./run.sh bench stress          # each method in the stress setting of its claim, beside GRPO there
    ./run.sh bench fp16            # the train-inference mismatch of fp32 / bf16 / fp16 trainers and engines
    ./run.sh bench lora            # GRPO with LoRA adapters against full fine-tuning
    ./run.sh bench long            # the cost of a step of every method at long responses (4 x 512 tokens)
    ./run.sh bench lag lag_sums    # every method on rollouts 0, 1 and 2 steps old (--rollout-lag)
(`./run.sh bench ARGS` is `python -m common.bench ARGS`; `python -m common.bench.engines` times the
rollout engines.)

A run is `python algorithms/<method>.py <flags> --seed s`. Its folder under --output-dir is named after
the method and a hash of its flags, so one run serves every suite that asks for the same flags (the
GTPO experiment is the benchmark's GRPO and GTPO runs), and a killed bench goes on where it stopped:
finished runs are kept, unfinished ones continue from their last checkpoint (--resume auto). Runs go
in parallel, one thread each: on two cores, two one-thread runs take about as long as one run on two.
A finished run is also kept beside the results, in <results-dir>/records/ (its metrics, gzipped: about
10 KB a run): the published records come with a clone, so it redraws the tables and plots and goes on
with a suite where an earlier machine stopped, without redoing a run. A run is named after its algorithm file's
digest too, and records the digest of the weights it started from and the machine: after an edit of the file, or on
a machine whose built-in model differs, its runs are run again, never reused; each table says the machines its rows
ran on. A redraw (--plot-only; another --output-dir) where a run has no finished run made by today's code leaves the
published results as they are and draws what it has under --output-dir.

For each suite, --results-dir gets <suite>.png (mean over seeds, shaded from the lowest to the highest
seed), <suite>.md (a table of final accuracy ± std over seeds and seconds per step, with the date,
machine and command) and <suite>.json (the same numbers). The full runs write to common/bench/results,
where <suite>.md is the suite's page (the claim, the setting, the plot and what came out, written around
the table's `<!-- bench:<suite> -->` markers, between which the table is replaced), and replace the
README's table between the same markers when it has them; --quick, --only, --seeds or --steps write under
--output-dir instead.

Every setting of an experiment is fixed in SUITES (suites.py) before it runs (paper defaults scaled to the
built-in task); each suite's page reports what came out. This file is the machinery that runs the suites:
suites.py defines them from the dataclasses of spec.py (its docstring says why three files), and every
public name of suites.py is importable from here too (`runner.SUITES`, `runner.QUICK`, ...).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import fcntl
import functools
import glob
import gzip
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from dataclasses import dataclass

import tyro

from common.bench.spec import REPO, X_AXES, Config, Panel, Suite

# SUITES and QUICK (main() runs them) and the other definitions, which were here before they moved to suites.py
from common.bench.suites import (  # noqa: F401
    ACCURACY,
    AVG_AT_4,
    BF16_ENGINE,
    DRIFT_STRESS,
    ENTROPY,
    ENTROPY_STRESS,
    GRPO_OFF_POLICY,
    LAG_COLUMNS,
    LAG_METHODS,
    LONG_MODEL,
    LONG_MODEL_SHAPE,
    LONG_RESPONSES,
    MISMATCH_COLUMNS,
    MISMATCH_PANELS,
    MISMATCH_STRESS,
    MOE_ARMS,
    MOE_OFF_POLICY,
    NO_ANSWER,
    OFF_POLICY_STRESS,
    PRODUCTS,
    QUICK,
    ROUTING_COLUMNS,
    SHORT_RUN,
    STRESS_COLUMNS,
    SUITES,
    SUMS,
    SUMS_TASK,
    TOOL_COLUMNS,
    TORCH_NAMES,
    TRUNCATED_SAMPLING,
    VLLM_FLOAT32,
    build_long_model,
)
from common.processes import start_program, stop_programs


# running ---------------------------------------------------------------------------------------------
def task_of(flags: tuple[str, ...]) -> str:
    """The --task these flags give a script (its default: arith)."""
    return flags[flags.index("--task") + 1] if "--task" in flags else "arith"


def model_of(flags: tuple[str, ...]) -> str:
    """The --model these flags give a script (its default: the built-in model of the task)."""
    return flags[flags.index("--model") + 1] if "--model" in flags else "tiny"


# a stopped bench's runs each finish their step and its checkpoint within this many seconds, or are killed
RUN_STOP_SECONDS = 300.0
# in a finished run's folder and its record: how many runs shared the cores and its threads, and what made it (the
# algorithm file's and the model's digests, the machine; Run.made_by)
RAN_WITH = "bench_ran_with.json"
ALGORITHMS = os.path.join(REPO, "algorithms")


def file_digest(*paths: str) -> str:
    """The SHA-256 of the files' contents, in order (16 hex digits)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def model_digest(name: str, task: str) -> str | None:
    """The digest of the weights a run starts from: the built-in model's (`tiny`, `tiny-moe`: built on each machine,
    and its weights differ by processor) or a local model folder's; a hub model's name; None where a built-in or
    local model is not here (not built yet)."""
    from common.tiny import WARM_STARTS, cache_dir

    path = name
    if name in ("tiny", "tiny-moe"):
        path = cache_dir(task if task in WARM_STARTS else "arith", moe=name == "tiny-moe")
    elif not os.path.exists(name):
        return name  # a hub model: its name is all a run can record
    weights = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    # read once per version of the files (a table asks for each run, again and again)
    return _weights_digest(tuple((w, os.stat(w).st_mtime_ns, os.stat(w).st_size) for w in weights)) if weights else None


@functools.lru_cache(maxsize=None)
def _weights_digest(files: tuple[tuple[str, int, int], ...]) -> str:
    return file_digest(*(path for path, _, _ in files))


@dataclass
class Run:
    config: Config
    seed: int
    steps: int
    flags: tuple[str, ...]  # the config's and the suite's: what makes the run what it is
    output_dir: str
    checkpoints: int = 3  # at most, the last at the end (the suite's)
    records_dir: str | None = None  # where finished runs are kept beside the results (keep_record); None: nowhere
    algorithm: str = ""  # the digest of the algorithm file, as the bench found it when it planned the run

    def __post_init__(self):
        self.algorithm = self.algorithm or file_digest(os.path.join(ALGORITHMS, self.config.script + ".py"))

    @property
    def exp_name(self) -> str:
        # what the run computes: its script's code (an edited algorithm file makes new runs, and its earlier runs and
        # records are not reused), its length and flags; the model it started from is in its RAN_WITH file (stale)
        identity = json.dumps([self.config.script, self.algorithm, self.steps, list(self.flags)])
        return f"{self.config.script}-{hashlib.sha1(identity.encode()).hexdigest()[:10]}"

    @property
    def prefix(self) -> str:  # the scripts name their run folders <task>__<exp_name>__<seed>__<time>
        return f"{os.path.basename(task_of(self.flags))}__{self.exp_name}__{self.seed}__"

    def folders(self, root: str | None = None) -> list[str]:
        """This run's folders under `root` (default: --output-dir), oldest first."""
        root = root or self.output_dir
        if not os.path.isdir(root):
            return []
        return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith(self.prefix))

    def made_by(self) -> dict:
        """What makes this run's numbers besides its flags: the digest of its algorithm file and of the weights it
        starts from (None: the model is not built here yet)."""
        return {"algorithm": self.algorithm, "model": model_digest(model_of(self.flags), task_of(self.flags))}

    def stale(self, folder: str) -> str | None:
        """Why a finished attempt does not stand for this run (it started from other weights than this machine's,
        or it did not record what made it), or None. Where the model is not built here, the weights are not
        compared."""
        made, today = made_by(folder), self.made_by()
        if "algorithm" not in made:
            return "it does not record the code that made it"
        if made["algorithm"] != today["algorithm"]:  # (its name holds the digest: a record copied by hand)
            return f"algorithms/{self.config.script}.py has changed since"
        if today["model"] is not None and made.get("model") != today["model"]:
            return f"it started from other weights ({made.get('model')}, here {today['model']})"
        return None

    def finished_attempts(self, kept: bool = True) -> list[str]:
        """This run's attempts that finished, whatever made them, newest first: its folders under --output-dir,
        then (`kept`) its kept records."""
        records = self.folders(self.records_dir) if kept and self.records_dir else []
        folders = [*reversed(self.folders()), *reversed(records)]
        return [f for f in folders if final_record(read_metrics(os.path.join(f, "metrics.jsonl")), self.steps)]

    def finished_folder(self) -> str | None:
        """The newest finished attempt of this run made by today's algorithm file and model: its folder under
        --output-dir, else its kept record."""
        return next((folder for folder in self.finished_attempts() if self.stale(folder) is None), None)

    def newest_finished(self) -> str | None:
        """The newest attempt under --output-dir that finished, whatever made it (the run that just ended)."""
        return next(iter(self.finished_attempts(kept=False)), None)

    def stale_attempts(self) -> list[str]:
        """The finished attempts of this run that no longer count, each with why (for the bench to say so)."""
        return [f"{folder}: {why}" for folder in self.finished_attempts() if (why := self.stale(folder))]

    def keep_record(self, folder: str) -> None:
        """Keep a finished run beside the results: its metrics (gzipped) and its KL-drift cache, all that the
        tables and plots read. The results can then be redrawn, and the run is not redone, where its folder
        is gone (a fresh clone; runs/ cleaned). A record stands for its run only as long as it was made by today's
        algorithm file and model (stale)."""
        if not self.records_dir or os.path.dirname(os.path.abspath(folder)) == os.path.abspath(self.records_dir):
            return
        kept = os.path.join(self.records_dir, os.path.basename(folder))
        os.makedirs(kept, exist_ok=True)
        source = os.path.join(folder, "metrics.jsonl")
        # the header keeps the time the run finished (the table's date); the same run gives the same bytes
        finished = int(os.path.getmtime(source))
        # each file written whole or not at all (a kill meanwhile leaves a .tmp, never a truncated record)
        target = os.path.join(kept, "metrics.jsonl.gz")
        with open(source, "rb") as f, gzip.GzipFile(target + ".tmp", "wb", mtime=finished) as gz:
            shutil.copyfileobj(f, gz)
        os.replace(target + ".tmp", target)
        for name in ("kl_drift.json", RAN_WITH):
            if os.path.exists(os.path.join(folder, name)):
                shutil.copy(os.path.join(folder, name), os.path.join(kept, name + ".tmp"))
                os.replace(os.path.join(kept, name + ".tmp"), os.path.join(kept, name))

    def command(self, dry: bool = False) -> list[str]:
        """The script's command line; continues the newest complete checkpoint of this run if there is one (and
        removes the run's unfinished folders when none has one, unless `dry`: the command alone)."""
        # what --resume auto would find: step_N folders (a step_N.tmp is a write the kill interrupted)
        checkpoints = [
            c for folder in self.folders() for c in glob.glob(os.path.join(folder, "checkpoints", "step_*[0-9]"))
        ]
        resume = any(os.path.isfile(os.path.join(c, "trainer_state.pt")) for c in checkpoints)
        if self.newest_finished() is not None:  # finished, yet to be run again (stale): a new folder, the old kept
            resume = False
        elif not resume and not dry:  # nothing to continue from: start clean
            for folder in self.folders():
                shutil.rmtree(folder)
        save_every = math.ceil(self.steps / self.checkpoints)  # the last at the end: the KL-drift points
        return [
            sys.executable,
            os.path.join(REPO, "algorithms", self.config.script + ".py"),
            *self.flags,
            "--steps",
            str(self.steps),
            "--seed",
            str(self.seed),
            "--exp-name",
            self.exp_name,
            "--output-dir",
            self.output_dir,
            "--save-every",
            str(save_every),
            "--keep-checkpoints",
            str(self.checkpoints),
            *(["--resume", "auto"] if resume else []),
        ]


def run_all(runs: list[Run], jobs: int, output_dir: str) -> list[str]:
    """Run every unfinished run, `jobs` at a time; returns the failures' descriptions. One bench at a time
    per output folder (a lock): two would start the same runs and delete each other's folders."""
    os.makedirs(output_dir, exist_ok=True)
    lock = open(os.path.join(output_dir, ".bench.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another bench is running in {output_dir}; wait for it or pick another --output-dir"
        ) from None
    with lock:
        return _run_all(runs, jobs)


def _run_all(runs: list[Run], jobs: int) -> list[str]:
    pending = [r for r in runs if r.finished_folder() is None]
    print(
        f"{len(runs) - len(pending)} of {len(runs)} runs already finished; {len(pending)} to run, {jobs} at a time",
        flush=True,
    )
    threads = max(1, (os.cpu_count() or 1) // jobs)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    log_dir = os.path.join(pending[0].output_dir, "logs") if pending else None
    running, failures, done = [], [], 0
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                os.makedirs(log_dir, exist_ok=True)
                log_path = os.path.join(log_dir, f"{run.exp_name}__{run.seed}.log")
                with open(log_path, "a") as log:  # a resumed run's log follows its first attempt's
                    process = start_program(run.command(), REPO, env, log)  # its own session (common/processes.py)
                running.append((run, process, log_path, time.time()))
            time.sleep(0.5)
            for entry in list(running):
                run, process, log_path, start = entry
                if process.poll() is None:
                    continue
                running.remove(entry)
                done += 1
                folder = run.newest_finished() if process.returncode == 0 else None
                if folder:  # kept at once: a bench cut off later keeps this run
                    made_by = {**run.made_by(), "machine": machine()}
                    with open(os.path.join(folder, RAN_WITH), "w") as f:  # what its seconds per step ran beside
                        json.dump({"runs_at_a_time": jobs, "threads": threads, **made_by}, f)
                    run.keep_record(folder)
                status = "done" if folder else f"FAILED (log: {log_path})"
                if status != "done":
                    failures.append(f"{run.config.label} seed {run.seed}: {log_path}")
                print(
                    f"[{done}/{done + len(pending) + len(running)}] {status}: {run.config.label}, seed {run.seed} "
                    f"({time.time() - start:.0f} s)",
                    flush=True,
                )
    finally:  # interrupted (Ctrl-C): each run saves its step and stops; they resume from their checkpoints next time
        stop_programs([entry[1] for entry in running], RUN_STOP_SECONDS)
    return failures


# measuring KL(π_θ ‖ π_0) ---------------------------------------------------------------------------------
def kl_from_initial(
    model, initial, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, seed: int = 0
) -> float:
    """Mean per-token KL(π_θ ‖ π_0) on completions sampled from π_θ (T = 1): at each response position the
    exact full-vocabulary KL Σ_v π_θ(v) (log π_θ(v) − log π_0(v)), averaged over all response tokens."""
    import torch

    from common.engines import HFEngine

    torch.manual_seed(seed)
    completions = HFEngine(model, tokenizer).generate(prompt_ids, 1, max_new_tokens, 1.0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completions):
            ids = torch.tensor([prompt + completion.token_ids])
            start = len(prompt) - 1  # the logits at position t predict token t + 1
            stop = ids.shape[1] - 1
            log_p = torch.log_softmax(model(ids).logits[0, start:stop].double(), -1)
            log_q = torch.log_softmax(initial(ids).logits[0, start:stop].double(), -1)
            total += (log_p.exp() * (log_p - log_q)).sum().item()
            tokens += stop - start
    return total / max(tokens, 1)


def measure_kl_drift(folder: str, prompts: int = 128) -> dict[int, float]:
    """KL(π_θ ‖ π_0) at step 0 and at every checkpoint of a run folder; cached in kl_drift.json."""
    cache = os.path.join(folder, "kl_drift.json")
    drift = {int(k): v for k, v in json.load(open(cache)).items()} if os.path.exists(cache) else {0: 0.0}
    checkpoint_dir = os.path.join(folder, "checkpoints")
    if not os.path.isdir(checkpoint_dir):  # a kept record: what was measured is all there is
        return drift
    steps = {
        int(name.split("_")[1]): os.path.join(checkpoint_dir, name)
        for name in os.listdir(checkpoint_dir)
        if name.startswith("step_") and name.split("_")[1].isdigit()
    }
    missing = {step: path for step, path in steps.items() if step not in drift}
    if missing:
        from transformers import AutoModelForCausalLM
        from transformers.utils.logging import disable_progress_bar

        from common.engines import load_tokenizer
        from common.tasks import encode_prompt, load_task
        from common.tiny import resolve_model

        disable_progress_bar()
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)  # the run's own arguments: its initial model, held-out task, prompt format
        initial_path = resolve_model(config["model"])
        initial = AutoModelForCausalLM.from_pretrained(initial_path).eval()
        tokenizer = load_tokenizer(initial_path)
        task = config.get("eval_task") or config["task"]
        rows = load_task(task, "test", config["question_column"], config["answer_column"])[:prompts]
        prompt_ids = [encode_prompt(row.question, tokenizer, task, config["chat_template"]) for row in rows]
        for step, path in sorted(missing.items()):
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            drift[step] = kl_from_initial(model, initial, tokenizer, prompt_ids, config["max_new_tokens"], seed=step)
        with open(cache, "w") as f:
            json.dump({str(k): v for k, v in sorted(drift.items())}, f)
    return drift


# summarising ------------------------------------------------------------------------------------------
def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (or of its kept record, metrics.jsonl.gz); a line that is not JSON (a
    run killed while writing it) is skipped with a warning that names the file."""
    records = []
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    if os.path.exists(path):
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            try:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        print(f"warning: {path}:{number} is not JSON; skipped", file=sys.stderr)
            except (EOFError, gzip.BadGzipFile, zlib.error) as error:  # a record cut short (copied by hand, ...)
                print(f"warning: {path} is damaged ({error}): {len(records)} records read", file=sys.stderr)
    return records


def made_by(folder: str) -> dict:
    """A finished run's RAN_WITH file: how it shared the machine, and the code, model and machine that made it ({}
    where it has none)."""
    try:
        with open(os.path.join(folder, RAN_WITH)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def ran_with(folders: list[str]) -> str:
    """How the runs in these folders shared the machine, as the table's header says it; "not recorded" for runs
    that finished before the bench kept it."""
    said = set()
    for ran in map(made_by, folders):
        if "runs_at_a_time" in ran and "threads" in ran:
            said.add(f"{ran['runs_at_a_time']} runs at a time, {ran['threads']} thread(s) each")
        else:
            said.add("runs at a time not recorded")
    return " and ".join(sorted(said))  # seeds of one row that ran differently


def finished_at(folder: str) -> float:
    """When a run's metrics were last written, to the second (a kept record holds it in its gzip header)."""
    path = os.path.join(folder, "metrics.jsonl")
    if os.path.exists(path):
        return float(int(os.path.getmtime(path)))
    with gzip.GzipFile(path + ".gz") as f:
        f.peek(1)  # reads the header
        return float(f.mtime)


def final_record(records: list[dict], steps: int) -> dict | None:
    """The record of the last step, if it has its evaluation (the run finished)."""
    return next((r for r in records if r["step"] == steps and "eval/greedy_accuracy" in r), None)


def series(
    records: list[dict], key: str, x: str, drift: dict[int, float] | None = None
) -> dict[int, tuple[float, float]]:
    """step -> (x, y) for one run, at every step where the metric `key` (or the KL drift) is a finite
    number; x is the step, the training seconds so far (evaluations excluded), or the KL drift."""
    clock, elapsed = {0: 0.0}, 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        seconds = record.get("time/step")
        elapsed += seconds if isinstance(seconds, (int, float)) else 0.0
        clock[record["step"]] = elapsed
    if key == "kl_drift":
        values = dict(drift or {})
    else:
        values = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}
    axis = {"step": {step: float(step) for step in values}, "time": clock, "kl_drift": drift or {}}[x]
    return {step: (axis[step], value) for step, value in sorted(values.items()) if step in axis}


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _measured(value) -> bool:
    """A metric's value that was measured: a finite number (metrics.jsonl writes a mean of nothing as "nan")."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def summarise(suite: Suite, runs: list[Run]) -> list[dict]:
    """One row per config: final held-out accuracy (mean and std over seeds), seconds per step, per phase."""
    rows = []
    for config in suite.configs:
        folders = [folder for folder in (run.finished_folder() for run in runs if run.config == config) if folder]
        if not folders:
            continue
        records = [read_metrics(os.path.join(folder, "metrics.jsonl")) for folder in folders]
        final = [final_record(r, suite.steps) for r in records]
        row = {
            "label": config.label,
            "script": f"algorithms/{config.script}.py",
            "flags": " ".join(config.flags),
            "seeds": len(folders),
            "finished": max(finished_at(folder) for folder in folders),
            "ran_with": ran_with(folders),
            "machines": sorted({made_by(folder).get("machine", "a machine not recorded") for folder in folders}),
        }
        for key, name in [("eval/greedy_accuracy", "greedy"), ("eval/avg@4", "avg@4"), ("eval/pass@4", "pass@4")]:
            row[name], row[name + "_std"] = mean_std([f.get(key) for f in final])
        # entropy at response tokens, over each run's last 5 steps (one step's is noisy)
        row["entropy"], row["entropy_std"] = mean_std(
            [
                statistics.fmean(
                    [r["charts/entropy"] for r in rs if r["step"] > suite.steps - 5 and "charts/entropy" in r]
                    or [math.nan]
                )
                for rs in records
            ]
        )
        row["greedy_at_0"] = mean_std(
            [next((r["eval/greedy_accuracy"] for r in rs if r["step"] == 0), None) for rs in records]
        )[0]
        for key, name in [
            ("time/step", "s_per_step"),
            ("time/rollout", "rollout_s"),
            ("time/train", "train_s"),
            ("sampling/rollouts", "rollouts_per_step"),
        ]:  # completions generated (dynamic sampling: more)
            row[name] = mean_std([r.get(key) for rs in records for r in rs if r["step"] > 0])[0]
        for key, _ in suite.columns:  # each run's mean over the training steps that measured it, then over seeds
            row[key], row[key + "_std"] = mean_std(
                [
                    statistics.fmean([r[key] for r in rs if r["step"] > 0 and _measured(r.get(key))] or [math.nan])
                    for rs in records
                ]
            )
        if suite.kl_drift:
            row["kl_drift"], row["kl_drift_std"] = mean_std(
                [measure_kl_drift(folder).get(suite.steps) for folder in folders]
            )
        rows.append(row)
    judge_against_baseline(suite, rows)
    return rows


def judge_against_baseline(suite: Suite, rows: list[dict]) -> None:
    """row["fails"]: which of greedy accuracy and entropy end below the baseline's by more than twice the
    larger seed standard deviation of the two settings (a suite with a baseline only). With a reference
    method, row["verdict"] for every other method: "prevents" when the reference fails in the same setting
    and this method does not, "does not prevent" when both fail, "failure not produced" when neither does
    (and says so when only this method fails)."""
    base = next((row for row in rows if row["label"] == suite.baseline), None)
    for row in rows if base else []:
        row["fails"] = [
            name
            for name in ("greedy", "entropy")
            if base[name] - row[name] > 2 * max(base[name + "_std"], row[name + "_std"])
        ]
    if not (base and suite.reference):
        return

    def setting_and_method(row):
        setting, _, method = row["label"].partition(" · ")
        return setting, method

    reference = {setting_and_method(row)[0]: row for row in rows if setting_and_method(row)[1] == suite.reference}
    for row in rows:
        setting, method = setting_and_method(row)
        if row is base or method == suite.reference or setting not in reference:
            continue
        if not reference[setting]["fails"]:
            row["verdict"] = f"fails where {suite.reference} does not" if row["fails"] else "failure not produced"
        else:
            row["verdict"] = "does not prevent" if row["fails"] else "prevents"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def write_table(suite: Suite, rows: list[dict], seeds, command: str, path: str, date: str) -> str:
    """The markdown table, returned and written to `path`: between the page's `<!-- bench:<suite> -->` markers
    when it has them (a suite's page: its write-up around the table), else as the whole file. A config with
    fewer finished seeds than asked for shows its count."""
    # how the runs shared the cores, as they ran (a --plot-only call's --jobs says nothing about them)
    labels_by_setting = {}
    for row in rows:
        labels_by_setting.setdefault(row.get("ran_with", "runs at a time not recorded"), []).append(row["label"])
    shared = (
        list(labels_by_setting)
        if len(labels_by_setting) == 1
        else [f"{setting} ({', '.join(labels)})" for setting, labels in labels_by_setting.items()]
    )
    what = (
        f"mean ± std over seeds at the last step (held-out greedy accuracy at step 0: {rows[0]['greedy_at_0']:.3f})"
        if suite.accuracy
        else "means over seeds and steps, no accuracy (the model learns nothing here)"
    )
    lines = [
        f"**{suite.title}** — built-in task {task_of(suite.flags)}, {suite.steps} steps, "
        f"seeds {', '.join(map(str, seeds))}; {what}. Seconds per step exclude evaluations; "
        f"{'; '.join(shared)}.",
        "",
        "| method | flags |"
        + (" greedy acc. | avg@4 | pass@4 |" if suite.accuracy else "")
        + (" KL(π‖π₀) |" if suite.kl_drift else "")
        + (" entropy | fails vs. baseline |" if suite.baseline else "")
        + (" verdict |" if suite.reference else "")
        + "".join(f" {h} |" for _, h in suite.columns)
        + " s/step | rollout s | train s | rollouts/step |",
        "|---|---|"
        + ("---|---|---|" if suite.accuracy else "")
        + ("---|" if suite.kl_drift else "")
        + ("---|---|" if suite.baseline else "")
        + ("---|" if suite.reference else "")
        + "---|" * len(suite.columns)
        + "---|---|---|---|",
    ]
    for row in rows:
        extra = f" {row['kl_drift']:.4f} ± {row['kl_drift_std']:.4f} |" if suite.kl_drift else ""
        if suite.baseline:
            verdict = "baseline" if row["label"] == suite.baseline else ", ".join(row.get("fails", [])) or "no"
            extra += f" {row['entropy']:.3f} ± {row['entropy_std']:.3f} | {verdict} |"
        if suite.reference:
            extra += f" {row.get('verdict', '')} |"
        extra += "".join(f" {_cell(row[key], row[key + '_std'])} |" for key, _ in suite.columns)
        label = row["label"] + (f" (n = {row['seeds']})" if row["seeds"] < len(seeds) else "")
        scores = (
            f" {row['greedy']:.3f} ± {row['greedy_std']:.3f} | {row['avg@4']:.3f} ± {row['avg@4_std']:.3f} "
            f"| {row['pass@4']:.3f} ± {row['pass@4_std']:.3f} |"
            if suite.accuracy
            else ""
        )
        lines.append(
            f"| {label} | `{row['flags'] or 'defaults'}` |{scores}"
            f"{extra} {row['s_per_step']:.2f} | {row['rollout_s']:.2f} | {row['train_s']:.2f} "
            f"| {row['rollouts_per_step']:.0f} |"
        )
    machines = sorted({m for row in rows for m in row.get("machines", ["a machine not recorded"])})
    lines += ["", f"Run {date} on {'; '.join(machines)}; command: `{command}`."]
    table = "\n".join(lines) + "\n"
    if _marked(path, suite.name):
        replace_between_markers(path, suite.name, table)  # a page with broken markers is kept as it is (a warning)
    else:
        with open(path, "w") as f:
            f.write(table)
    return table


def _marked(page: str, name: str) -> bool:
    """Whether `page` exists and holds either of the suite's markers: then it is a written page, never overwritten."""
    if not os.path.exists(page):
        return False
    with open(page) as f:
        return f"bench:{name} -->" in f.read()


def _cell(mean: float, std: float) -> str:
    """mean ± std with 3 significant digits (std with 1); — when no run logged the metric (e.g. routing, dense)."""
    return "—" if math.isnan(mean) else f"{mean:.3g} ± {std:.1g}"


def replace_between_markers(page: str, name: str, table: str) -> bool:
    """Replace the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in a markdown page (the README,
    a suite's page) with the suite's table, so the page's numbers are those of the committed run. False if
    there are no markers."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    with open(page) as f:
        text = f.read()
    if start not in text and end not in text:
        return False
    head, _, rest = text.partition(start)
    if end not in rest:
        print(f"warning: {page}: no {end} after a {start}; the table is not updated", file=sys.stderr)
        return False
    with open(page + ".tmp", "w") as f:
        f.write(head + start + "\n" + table.strip() + "\n" + end + rest.split(end, 1)[1])
    os.replace(page + ".tmp", page)
    return True


def plot(suite: Suite, runs: list[Run], panels: list[Panel], path: str, smooth: int = 5) -> None:
    """One panel per metric: per config, the mean over seeds (a moving average of `smooth` steps for
    per-step metrics), shaded between the lowest and highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one color per method: "setting · method" labels keep the method's color across settings
    methods = list(dict.fromkeys(c.label.split(" · ")[-1] for c in suite.configs))
    colors = {c.label: plt.get_cmap("tab10")(methods.index(c.label.split(" · ")[-1]) % 10) for c in suite.configs}
    if suite.baseline:  # the baseline in gray, dashed: it shares its method's color with that method's other settings
        colors[suite.baseline] = "gray"
    styles = ["-", "--", ":", "-."]  # one method's settings in one panel: one color, told apart by the line style
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        # a panel of one setting names its methods alone, unless two of them are one method (the baseline's)
        short_names = [label.split(" · ")[-1] for label in panel.labels or ()]
        short = panel.labels is not None and len(set(short_names)) == len(short_names)
        drawn = collections.Counter()  # the panel's lines so far, per color
        for config in suite.configs:
            if panel.labels is not None and config.label not in panel.labels:
                continue
            per_seed = []  # one {step: (x, y)} per seed
            for run in runs:
                folder = run.finished_folder() if run.config == config else None
                if folder:
                    drift = measure_kl_drift(folder) if "kl_drift" in (panel.x, panel.key) else None
                    points = series(read_metrics(os.path.join(folder, "metrics.jsonl")), panel.key, panel.x, drift)
                    if points:
                        per_seed.append(points)
            steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
            if not steps:
                continue
            xs = [statistics.fmean(p[step][0] for p in per_seed) for step in steps]  # the same step of every seed
            ys = [[p[step][1] for p in per_seed] for step in steps]
            length = len(steps)
            window = smooth if length > 3 * smooth and not panel.key.startswith("eval/") else 1
            mean = _moving_average([statistics.fmean(y) for y in ys], window)
            low = _moving_average([min(y) for y in ys], window)
            high = _moving_average([max(y) for y in ys], window)
            marker = "o" if length <= 12 else None
            color = colors[config.label]
            style = "--" if config.label == suite.baseline else styles[drawn[color] % len(styles)]
            drawn[color] += 1
            axis.plot(
                xs,
                mean,
                color=color,
                marker=marker,
                markersize=3,
                linestyle=style,
                label=config.label.split(" · ")[-1] if short else config.label,
            )
            if len(per_seed) > 1:
                axis.fill_between(xs, low, high, color=colors[config.label], alpha=0.15, linewidth=0)
        axis.set_title(panel.title, fontsize=10)
        axis.set_xlabel(X_AXES[panel.x])
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    figure.suptitle(suite.title, fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.3 / figure.get_figheight()))  # the suptitle keeps 0.3 inch of its own
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


# command line -----------------------------------------------------------------------------------------
@dataclass
class BenchArgs:
    suites: tyro.conf.Positional[tuple[str, ...]] = ("bench",)
    """what to run: bench (every method), ema_kpo, p3o, tis_icepop, gtpo, isopo (the claims on the built-in
    task), stress_search, stress, fp16, fp32_head, sampling_mask, mismatch_fixes_training, moe_mismatch, moe (on the
    reasoning task; the last two: mixture of experts), tools (the tool task), lora (adapters), long (the cost of a
    step at 4 x 512 new tokens), lag and lag_sums (rollouts from older weights), overlap (sampling beside the
    update against the synchronous step; run it with --jobs 1), or all"""
    quick: bool = False
    """a few minutes: 1 seed, 8 steps, smaller evaluations (results under --output-dir)"""
    seeds: int | None = None
    """seeds 1..n (default 3; 1 with --quick)"""
    steps: int | None = None
    """training steps of every run (default: each suite's own)"""
    only: tuple[str, ...] = ()
    """run only the configs with these labels (e.g. GRPO P3O)"""
    jobs: int = max(1, os.cpu_count() or 1)
    """runs at a time (each gets cores / jobs threads)"""
    output_dir: str = "runs/bench"
    """where the runs go"""
    results_dir: str | None = None
    """where plots and tables go (default: common/bench/results and the README's tables for a complete default
    run; <output-dir>/results with --quick, --only, --seeds or --steps)"""
    plot_only: bool = False
    """draw plots and tables from the runs already there, run nothing"""
    list: bool = False
    """list each suite's runs (its label, seed, command and whether a finished run of today's code stands for it),
    run nothing"""


PUBLISHED = os.path.join(REPO, "common", "bench", "results")  # the results the README shows


def is_complete(args: BenchArgs) -> bool:
    """Only a complete run with the default settings replaces the published results and README tables."""
    return not (args.quick or args.only or args.seeds or args.steps)


def main(args: BenchArgs) -> int:
    names = list(SUITES) if "all" in args.suites else list(args.suites)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {', '.join(unknown)}: choose from {', '.join(SUITES)} or all")
    if args.jobs < 1 or (args.seeds is not None and args.seeds < 1) or (args.steps is not None and args.steps < 1):
        raise SystemExit("--jobs, --seeds and --steps must be >= 1")
    seeds = tuple(range(1, (args.seeds or (len(QUICK["seeds"]) if args.quick else 3)) + 1))
    output_dir = os.path.abspath(args.output_dir)
    complete = is_complete(args)
    results_dir = os.path.abspath(args.results_dir or (PUBLISHED if complete else os.path.join(output_dir, "results")))
    planned = {}
    for name in names:
        suite = SUITES[name]
        configs = [c for c in suite.configs if not args.only or c.label in args.only]
        if configs:
            steps = args.steps or (QUICK["steps"] if args.quick else suite.steps)
            flags = suite.flags + (QUICK["flags"] if args.quick else ())
            planned[name] = [
                Run(c, s, steps, c.flags + flags, output_dir, suite.checkpoints, os.path.join(results_dir, "records"))
                for s in seeds
                for c in configs
            ]
    if not planned:
        raise SystemExit(
            f"--only {' '.join(args.only)}: no such config in {', '.join(names)} (labels: "
            f"{', '.join(c.label for n in names for c in SUITES[n].configs)})"
        )
    if args.list:
        for name, runs in planned.items():
            print(f"{name}: {len(runs)} runs, {runs[0].steps} steps")
            for run in runs:
                state = "finished" if run.finished_folder() else "to run"
                script, *flags = run.command(dry=True)[1:]
                command = " ".join(["python", os.path.relpath(script, REPO), *flags])
                print(f"  {run.config.label}, seed {run.seed} ({state}): {command}")
        return 0
    failures = []
    if not args.plot_only:
        for name in planned:  # what a suite's runs need, before any starts (the long-response suite's model)
            if SUITES[name].prepare:
                SUITES[name].prepare()
        from common.tiny import resolve_model

        # the built-in models, built before any run is judged finished: a kept record counts where it started from
        # this machine's weights (Run.stale)
        for model, task in {(model_of(r.flags), task_of(r.flags)) for runs in planned.values() for r in runs}:
            if model in ("tiny", "tiny-moe"):
                resolve_model(model, task)
        unique = {}  # a run two suites share runs once (under the first suite's label)
        for run in (r for runs in planned.values() for r in runs):
            unique.setdefault((run.exp_name, run.seed), run)
        failures = run_all(list(unique.values()), args.jobs, output_dir)
    os.makedirs(results_dir, exist_ok=True)
    for name, runs in planned.items():
        suite = dataclasses.replace(
            SUITES[name],
            configs=[c for c in SUITES[name].configs if any(r.config == c for r in runs)],
            steps=runs[0].steps,
        )
        rows = summarise(suite, runs)
        for run in runs:  # what ran before records were kept, and the KL drift summarise measured
            if folder := run.finished_folder():
                run.keep_record(folder)
        for stale in (line for run in runs for line in run.stale_attempts()):
            print(f"{name}: not counted: {stale}", file=sys.stderr)
        if not rows:
            print(f"{name}: no finished run to summarise", file=sys.stderr)
            continue
        suite_dir = results_dir
        missing = [f"{run.config.label} seed {run.seed}" for run in runs if run.finished_folder() is None]
        if missing and results_dir == PUBLISHED:  # a redraw never publishes less than a complete run did
            suite_dir = os.path.join(output_dir, "results")
            os.makedirs(suite_dir, exist_ok=True)
            print(
                f"{name}: {len(missing)} of {len(runs)} runs have no finished run made by today's code and model "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): the published results are kept, "
                f"and these go to {suite_dir}",
                file=sys.stderr,
            )
        # the command that makes these runs, whatever this invocation was (--plot-only, several suites)
        command = " ".join(
            [
                "./run.sh bench",
                *([name] if name != "bench" else []),
                *(["--quick"] if args.quick else []),
                *([f"--seeds {args.seeds}"] if args.seeds else []),
                *([f"--steps {args.steps}"] if args.steps else []),
                *(["--only", *args.only] if args.only else []),
            ]
        )
        date = datetime.date.fromtimestamp(max(row["finished"] for row in rows)).isoformat()  # of the runs
        table_path = os.path.join(suite_dir, f"{name}.md")
        table = write_table(suite, rows, seeds, command, table_path, date)
        with open(os.path.join(suite_dir, f"{name}.json"), "w") as f:
            json.dump({"suite": name, "steps": suite.steps, "seeds": seeds, "rows": rows}, f, indent=1)
        for figure_name, panels in {name: suite.panels, **suite.extra_figures}.items():
            plot(suite, runs, panels, os.path.join(suite_dir, f"{figure_name}.png"))
        print(f"{name}: {table_path} and {name}.png\n{table}")
        if (
            suite_dir == PUBLISHED
            and complete
            and replace_between_markers(os.path.join(REPO, "README.md"), name, table)
        ):
            print(f"README.md: the {name} table is updated")
    if failures:
        print("failed runs:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0
