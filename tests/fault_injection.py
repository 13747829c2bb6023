"""Fault injection: a run stopped by a signal at a drawn moment, then resumed, ends as the run that was never stopped.

    python tests/fault_injection.py soak --trials 200 --output-dir runs/soak    # the soak; rerun it to continue
    python tests/fault_injection.py trial 17 --output-dir /tmp/t17              # one trial again, by its number

Each trial is drawn from (seed, trial number) alone: a script (every algorithms/*.py), flags (--rollout-lag 0-2, and
with a lag --overlap-rollouts or not; the built-in task, a task file whose score goes through math-verify, or a
.jsonl data file; LoRA or not; dynamic sampling or not; --save-every 1 or 2), a signal (SIGINT, SIGTERM, SIGHUP
once or twice, to the process or to its group; SIGKILL; or an exception, as a task file's score() raises one) and a
moment: the nth call of the model's load, a rollout, a scoring, an update, a weight push, an evaluation or a
checkpoint's write (the signal is sent from inside that call, by the process to itself). The run then gets
`--resume auto`. A trial passes when:
  - the stopped run ended within STOP_SECONDS (no hang) with the exit code its ending promises (an error on the
    sampler's thread of --overlap-rollouts ends nothing: the batch is sampled again), and no process it started is
    left once it has ended;
  - its newest checkpoint is whole, and it holds the last step logged (no finished step lost) after one stop signal
    (not two, not SIGKILL) or an exception before the step's update (a rollout, a scoring);
  - the resume ends well, and every number of every step it logged (times aside) equals that of the same run never
    stopped (bit-equal: the transformers engine on one thread).
A trial whose moment never came (the 3rd evaluation of a run that has two) runs to its end and is still checked.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPTS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "algorithms", "*.py")))
SCRIPTS = [s for s in SCRIPTS if not s.endswith("__init__.py")]
PHASES = ["load", "rollout", "scoring", "update", "push", "evaluation", "checkpoint"]
SIGNALS = ["INT", "TERM", "HUP", "KILL", "ERROR"]  # ERROR: an exception raised there (a score() that raises)
STEPS = 4
BASE = ["--steps", STEPS, "--prompts-per-step", 4, "--group-size", 2, "--eval-every", 2, "--eval-prompts", 8]
STOP_SECONDS = 300  # a stopped run ends within this (a step and its checkpoint take seconds here)
RUN_SECONDS = 600

# a task file whose score compares answers with math-verify (its gold answers are fractions), in a helper process
# started by the task file's own helper process
TASK_FILE = """
from common.scoring import answers_match


def rows(split):
    pairs = [(a, b) for a in range(10) for b in range(10)]
    pairs = pairs[:60] if split == "train" else pairs[60:72]
    return [{"question": f"Q: {a}+{b}=", "answer": f"\\\\frac{{{2 * (a + b)}}}{{2}}"} for a, b in pairs]


def score(completion, row):
    answer = completion.strip()
    return float(answers_match(answer, row["answer"])) if answer else None
"""


def draw(seed: int, number: int) -> dict:
    """Trial `number` of a soak seeded `seed`: the moment and the signal go round in turn (every phase and signal as
    often as the other), the rest is drawn."""
    rng = random.Random(f"fault-injection/{seed}/{number}")
    phase, signal_name = PHASES[number % len(PHASES)], SIGNALS[number % len(SIGNALS)]
    flags = ["--rollout-lag", rng.choice([0, 1, 2]), "--save-every", rng.choice([1, 2])]
    task = rng.choice(["arith", "task-file", "data-file"])
    flags += ["--lora-rank", 4] if rng.random() < 0.3 else []
    flags += ["--dynamic-sampling", "--max-sampling-rounds", 2] if rng.random() < 0.3 else []
    trial = {
        "seed": seed, "number": number, "script": rng.choice(SCRIPTS), "task": task, "flags": [str(f) for f in flags],
        "phase": phase, "call": 1 if phase == "load" else rng.randint(1, 3), "signal": signal_name,
        "times": 1 if signal_name in ("KILL", "ERROR") else rng.choice([1, 2]),
        "target": rng.choice(["process", "group"]),
    }  # fmt: skip
    # drawn last, so that the draws above stay those of the trials before it existed
    trial["flags"] += ["--overlap-rollouts"] if flags[1] > 0 and rng.random() < 0.5 else []
    return trial


def _task_flags(task: str, folder: str) -> list[str]:
    """The --task flag of a trial, with the file it names written into `folder`."""
    if task == "task-file":
        path = os.path.join(folder, "fractions_task.py")
        with open(path, "w") as f:
            f.write(TASK_FILE)
        return ["--task", path]
    if task == "data-file":
        path = os.path.join(folder, "sums.jsonl")
        with open(path, "w") as f:
            for a in range(10):
                for b in range(8):
                    f.write(json.dumps({"question": f"Q: {a}+{b}=", "answer": str(a + b)}) + "\n")
        return ["--task", path]
    return []


def _environment(marker: str) -> dict:
    return {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "FAULT_TRIAL": marker,
    }  # fmt: skip


def _run(argv: list[str], log: str, marker: str, seconds: float) -> tuple[int | None, float]:
    """Run `argv` in a session of its own (a signal to its group reaches nothing else): (exit code, or None when it
    ran past `seconds` and was killed; seconds taken)."""
    start = time.monotonic()
    with open(log, "a") as out:
        process = subprocess.Popen(
            argv, cwd=REPO, env=_environment(marker), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(seconds), time.monotonic() - start
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None, time.monotonic() - start


def _left_behind(marker: str, seconds: float = 10.0) -> list[str]:
    """The live processes (not zombies) whose environment carries this trial's marker, after `seconds` of grace
    (a helper notices its parent is gone within a second)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"FAULT_TRIAL={marker}".encode() not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().split(") ")[1].startswith("Z"):
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                alive.append(f"{entry}: {command[:200]}")
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _records(output_dir: str) -> list[dict]:
    """The metrics of the one run in `output_dir` (of the newest, if a stop before its first checkpoint made a new
    run start on resume)."""
    runs = sorted(glob.glob(os.path.join(output_dir, "*", "metrics.jsonl")), key=os.path.getmtime)
    if not runs:
        return []
    with open(runs[-1]) as f:
        return [json.loads(line) for line in f if line.strip()]


def _differences(expected: list[dict], actual: list[dict]) -> list[str]:
    """Where two runs' logged numbers differ (times and speeds aside), at most five."""
    same = lambda r: {k for k in r if not k.startswith("time/") and k != "charts/tokens_per_second"}  # noqa: E731
    found = []
    if [r["step"] for r in expected] != [r["step"] for r in actual]:
        found.append(f"steps {[r['step'] for r in expected]} then, {[r['step'] for r in actual]} now")
    for a, b in zip(expected, actual):
        if same(a) != same(b):
            found.append(f"step {a['step']}: keys {sorted(same(a) ^ same(b))} in one run only")
        changed = [k for k in sorted(same(a) & same(b)) if a[k] != b[k]]
        found += [f"step {a['step']}: {k} {a[k]!r} then, {b[k]!r} now" for k in changed]
    return found[:5]


def _newest_checkpoint(output_dir: str) -> str | None:
    done = glob.glob(os.path.join(glob.escape(output_dir), "*", "checkpoints", "step_*[0-9]", "trainer_state.pt"))
    return os.path.dirname(max(done, key=lambda p: os.path.basename(os.path.dirname(p)))) if done else None


def reference(trial: dict, folder: str, cache: str | None = None) -> list[dict]:
    """The metrics of the trial's run never stopped (kept in `cache` by its script and flags, for the soak)."""
    flags = [*map(str, BASE), *trial["flags"], *_task_flags(trial["task"], folder)]
    key = hashlib.sha1(json.dumps([trial["script"], trial["task"], trial["flags"]]).encode()).hexdigest()[:16]
    where = os.path.join(cache or folder, f"reference_{key}")
    if not _records(where):
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        argv = [sys.executable, trial["script"], *flags, "--output-dir", where]
        code, _ = _run(argv, os.path.join(where, "log.txt"), uuid.uuid4().hex, RUN_SECONDS)
        if code != 0:
            raise RuntimeError(f"the reference run failed ({code}): {os.path.join(where, 'log.txt')}")
    return _records(where)


def run_trial(trial: dict, folder: str, cache: str | None = None) -> dict:
    """Stop the trial's run at its moment, check what it left, resume it and compare: the trial's record, whose
    "outcome" is "ok" or names the first check that failed."""
    os.makedirs(folder, exist_ok=True)
    runs, log = os.path.join(folder, "runs"), os.path.join(folder, "log.txt")
    flags = [*map(str, BASE), *trial["flags"], *_task_flags(trial["task"], folder), "--output-dir", runs]
    marker, fired = uuid.uuid4().hex, os.path.join(folder, "fired")
    moment = [trial["phase"], str(trial["call"]), trial["signal"], str(trial["times"]), trial["target"], fired]
    argv = [sys.executable, os.path.abspath(__file__), "inject", *moment, trial["script"], *flags]
    code, seconds = _run(argv, log, marker, STOP_SECONDS)
    record = {**trial, "fired": os.path.exists(fired), "exit": code, "seconds": round(seconds, 1)}
    # --overlap-rollouts: an error on the sampler's thread is sampled again on the trainer's (the run goes on)
    retried = record["fired"] and trial["signal"] == "ERROR" and _read(fired).startswith("sampler")
    left = _left_behind(marker)
    newest = _newest_checkpoint(runs)
    if code is None:
        return {**record, "outcome": "hang", "detail": f"still running after {STOP_SECONDS} s"}
    if left:
        return {**record, "outcome": "left behind", "detail": left}
    number = int(getattr(signal, f"SIG{trial['signal']}", 0))
    # a stop signal ends a run with 128 + its number, or as the signal's default action before the run is set up (a
    # negative exit code); a signal during the last step leaves a complete run (0); an exception is a traceback (1)
    expected = ({0} if retried else {1}) if trial["signal"] == "ERROR" else {0, 128 + number, -number}
    expected = {-number} if trial["signal"] == "KILL" else expected
    if code not in (expected if record["fired"] else {0}):
        return {**record, "outcome": "exit", "detail": f"exit code {code}, expected one of {sorted(expected)} ({log})"}
    if newest:
        from common.checks import check_checkpoint_files
        from common.errors import BadInput

        try:
            check_checkpoint_files(newest)
        except BadInput as error:
            return {**record, "outcome": "damaged", "detail": str(error)}
    logged = _records(runs)
    if trial["signal"] == "ERROR":
        one_stop = record["fired"] and trial["phase"] in ("rollout", "scoring") and not retried
    else:
        one_stop = record["fired"] and trial["signal"] != "KILL" and trial["times"] == 1 and trial["phase"] != "load"
    saved_step = int(os.path.basename(newest).split("_")[1]) if newest else 0
    if one_stop and logged and saved_step < logged[-1]["step"]:
        return {**record, "outcome": "lost", "detail": f"step {logged[-1]['step']} logged, {saved_step} saved"}
    record["saved_step"] = saved_step
    code, _ = _run([sys.executable, trial["script"], *flags, "--resume", "auto"], log, marker, RUN_SECONDS)
    if code != 0:
        return {**record, "outcome": "resume failed", "detail": f"exit code {code} ({log})"}
    differences = _differences(reference(trial, folder, cache), _records(runs))
    if differences:
        return {**record, "outcome": "differs", "detail": differences}
    return {**record, "outcome": "ok"}


def inject(phase: str, call: int, signal_name: str, times: int, target: str, fired: str, script: str, flags) -> None:
    """In the stopped run's process: run `script` as its command line would, with the signal sent at the `call`th
    call of the function that makes `phase`."""
    import importlib.util

    sys.path.insert(0, REPO)
    import tyro

    from common import checkpoint, checks, fsdp
    from common.evaluate import Evaluator

    spec = importlib.util.spec_from_file_location("stopped_script", os.path.join(REPO, script))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (tyro reads the docstrings of its Args through it)
    spec.loader.exec_module(module)
    where = {
        "load": (module, "load_policy"), "rollout": (module, "rollout"), "scoring": (module, "score_completions"),
        "update": (module, "update_policy"), "push": (fsdp, "named_full_tensors"),
        "evaluation": (Evaluator, "__call__"),
        "checkpoint": (checkpoint, "rng_state"),  # called inside a checkpoint's write, after the weights
    }  # fmt: skip
    holder, name = where[phase]
    original, calls = getattr(holder, name), [0]

    def with_a_signal(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            with open(fired, "w") as f:  # which thread: an overlapped batch is sampled on the "sampler" one
                f.write(threading.current_thread().name)
            if signal_name == "ERROR":
                raise RuntimeError(f"an error injected at {phase} #{call}")
            number = getattr(signal, f"SIG{signal_name}")
            for _ in range(times):
                os.killpg(0, number) if target == "group" else os.kill(os.getpid(), number)
        return original(*args, **kwargs)

    setattr(holder, name, with_a_signal)
    sys.argv = [script, *flags]
    with checks.clear_errors():
        module.main(tyro.cli(module.Args, args=list(flags)))


def soak(trials: int, seed: int, output_dir: str, jobs: int) -> dict:
    """Run trials 0 .. trials − 1 (those already in output_dir/trials.jsonl are kept, not rerun), `jobs` at a time;
    print and return the counts by outcome, signal and moment."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(output_dir, exist_ok=True)
    results = os.path.join(output_dir, "trials.jsonl")
    done = {}
    if os.path.exists(results):
        with open(results) as f:
            done = {r["number"]: r for r in map(json.loads, f) if r.get("seed") == seed}
    cache = os.path.join(output_dir, "references")
    os.makedirs(cache, exist_ok=True)

    def one(number: int) -> dict:
        folder = os.path.join(output_dir, f"trial_{number:04d}")
        shutil.rmtree(folder, ignore_errors=True)
        try:
            record = run_trial(draw(seed, number), folder, cache)
        except Exception as error:  # the harness's own failure: kept, named
            record = {**draw(seed, number), "outcome": "harness error", "detail": repr(error)}
        if record["outcome"] == "ok":
            shutil.rmtree(folder, ignore_errors=True)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"trial {number}: {record['outcome']} ({record['script']}, {record['phase']} #{record['call']}, "
              f"SIG{record['signal']} x{record['times']} to the {record['target']})", flush=True)  # fmt: skip
        return record

    with ThreadPoolExecutor(jobs) as pool:
        for record in pool.map(one, [n for n in range(trials) if n not in done]):
            done[record["number"]] = record
    return summary(list(done.values()))


def summary(records: list[dict]) -> dict:
    counts = {
        "trials": len(records),
        "outcomes": dict(collections.Counter(r["outcome"] for r in records)),
        "by signal": dict(collections.Counter(f"SIG{r['signal']} x{r['times']} {r['target']}" for r in records)),
        "by moment": dict(collections.Counter(r["phase"] for r in records)),
        "signal sent": sum(bool(r.get("fired")) for r in records),
    }
    print(json.dumps(counts, indent=1))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=textwrap.dedent(__doc__).split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    soak_command = commands.add_parser("soak", help="run trials 0..N-1 (resumable)")
    soak_command.add_argument("--trials", type=int, default=200)
    soak_command.add_argument("--seed", type=int, default=0)
    soak_command.add_argument("--output-dir", default="runs/fault_injection")
    soak_command.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1) // 1))
    trial_command = commands.add_parser("trial", help="one trial, by its number")
    trial_command.add_argument("number", type=int)
    trial_command.add_argument("--seed", type=int, default=0)
    trial_command.add_argument("--output-dir", required=True)
    inject_command = commands.add_parser("inject", help="(internal) the stopped run itself")
    inject_command.add_argument("moment", nargs=6)
    inject_command.add_argument("script")
    inject_command.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.command == "inject":
        phase, call, signal_name, times, target, fired = args.moment
        inject(phase, int(call), signal_name, int(times), target, fired, args.script, args.flags)
    elif args.command == "trial":
        print(json.dumps(run_trial(draw(args.seed, args.number), args.output_dir), indent=1))
    else:
        counts = soak(args.trials, args.seed, args.output_dir, args.jobs)
        raise SystemExit(0 if set(counts["outcomes"]) <= {"ok"} else 1)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
