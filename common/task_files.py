"""A task is a Python file the user writes: `--task path/to/my_task.py` in every script and in common.evaluate.

The file defines two functions, and may set a system prompt:

    def rows(split):             # "train" or "test" -> a list of dicts, each with a "question" (the prompt's text)
    def score(completion, row):  # the completion's text and its row -> the reward: a number (or a bool; None: no
                                 # answer could be read, reward 0, counted in charts/no_answer_rate)
    SYSTEM_PROMPT = "..."        # optional: the system message, for a model whose tokenizer has a chat template
    TOOLS = {"calc": calculator} # optional: tools, each a function of a string that returns a string (common/tools.py)

A row may carry anything else the score needs (a gold answer, test cases). The prompt is the row's question,
inside the chat template when the tokenizer has one (after SYSTEM_PROMPT), verbatim otherwise. Accuracy
metrics count a reward of at least 1 as correct.

`rows` runs in the trainer's process, once per split. `score` is the user's code, and never runs there without
a deadline: completions are scored in a worker process, one at a time, each within `SCORE_SECONDS` (the file
may set its own); a completion that overruns it gets reward 0 (it counts as no answer, with a warning) and the
worker is replaced. A file that cannot be imported, lacks a function, or whose function raises or returns
something other than a number stops the run with an error that names the file and the function.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import sys
import traceback
from dataclasses import dataclass

from common.errors import BadInput

SCORE_SECONDS = 10.0  # per completion, unless the file sets SCORE_SECONDS
TOOL_SECONDS = 10.0  # per tool call, unless the file sets TOOL_SECONDS
TOOL_RESULT = "<result>{}</result>"  # how a tool's output is shown to the policy, unless the file sets TOOL_RESULT
WORKER_START_SECONDS = 120  # a spawned worker imports the main script (torch, ...) and the task file
REQUIRED = {"rows": "rows(split)", "score": "score(completion, row)"}


# built-in tasks written as task files: the project's own code, run in the trainer's process (no worker)
BUILT_IN = {"products": os.path.join(os.path.dirname(os.path.abspath(__file__)), "task_products.py")}


def is_task_file(task: str | None) -> bool:
    """A path to a .py task file, or the name of a built-in task written as one (`products`)."""
    return bool(task) and (task.lower().endswith(".py") or task in BUILT_IN)


@dataclass
class TaskFile:
    path: str  # absolute
    module: object
    system_prompt: str | None
    score_seconds: float
    tools: tuple[str, ...] = ()  # the names in TOOLS
    tool_seconds: float = TOOL_SECONDS
    tool_result: str = TOOL_RESULT
    in_process: bool = False  # a built-in task: its score and tools run here, not in a worker
    tool_call: str = "tag"  # tag: <name>argument</name>; json: <tool_call>{"name": ..., "arguments": ...}</tool_call>

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def rows(self, split: str) -> list[dict]:
        """The file's rows of `split`, checked: a non-empty list of dicts, each with a non-empty string "question"."""
        try:
            rows = self.module.rows(split)
        except Exception as error:
            raise BadInput(f"{self.path}: rows({split!r}) raised {_describe(error)}") from None
        if isinstance(rows, dict) or not hasattr(rows, "__iter__"):
            raise BadInput(f"{self.path}: rows({split!r}) returned a {type(rows).__name__}, not a list of dicts")
        rows = list(rows)
        if not rows:
            raise BadInput(f"{self.path}: rows({split!r}) returned no rows")
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise BadInput(f"{self.path}: rows({split!r})[{index}] is a {type(row).__name__}, not a dict")
            question = row.get("question")
            if not isinstance(question, str) or not question.strip():
                raise BadInput(f'{self.path}: rows({split!r})[{index}] has no "question" (a non-empty string)')
        return rows


_LOADED: dict[str, TaskFile] = {}


def load_task_file(path: str) -> TaskFile:
    """The task file at `path`, imported once per process; a missing file or function, or an import that fails,
    is an error naming the file."""
    path = os.path.abspath(BUILT_IN.get(path, path))
    if path in _LOADED:
        return _LOADED[path]
    if not os.path.isfile(path):
        raise BadInput(f"task file not found: {path}")
    module = _import(path)
    for name, signature in REQUIRED.items():
        if not callable(getattr(module, name, None)):
            raise BadInput(
                f"{path} defines no function {signature} (a task file needs {' and '.join(REQUIRED.values())})"
            )
    system_prompt = getattr(module, "SYSTEM_PROMPT", None)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise BadInput(f"{path}: SYSTEM_PROMPT is a {type(system_prompt).__name__}, not a string")
    seconds = {name: getattr(module, name, default) for name, default in SECONDS.items()}
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise BadInput(f"{path}: {name} must be a positive number of seconds, got {value!r}")
    tools = getattr(module, "TOOLS", {})
    if not isinstance(tools, dict) or not all(isinstance(n, str) and callable(f) for n, f in tools.items()):
        raise BadInput(f"{path}: TOOLS must be a dict of names and functions (each of a string), got {tools!r}")
    unnamed = [name for name in tools if not name.isidentifier()]
    if unnamed:
        raise BadInput(f"{path}: a tool's name is its marker (<name>...</name>): letters, digits, _; not {unnamed}")
    result = getattr(module, "TOOL_RESULT", TOOL_RESULT)
    if not isinstance(result, str) or result.count("{}") != 1:
        raise BadInput(f"{path}: TOOL_RESULT must be a string with one {{}} where the output goes, got {result!r}")
    call = getattr(module, "TOOL_CALL", "tag")
    if call not in ("tag", "json"):
        raise BadInput(f"{path}: TOOL_CALL must be 'tag' (<name>argument</name>) or 'json' (<tool_call>), got {call!r}")
    seconds = float(seconds["SCORE_SECONDS"]), float(seconds["TOOL_SECONDS"])
    built_in = path in BUILT_IN.values()
    _LOADED[path] = TaskFile(path, module, system_prompt, seconds[0], tuple(tools), seconds[1], result, built_in, call)
    return _LOADED[path]


SECONDS = {"SCORE_SECONDS": SCORE_SECONDS, "TOOL_SECONDS": TOOL_SECONDS}


def _import(path: str):
    name = "task_file_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a syntax error, a missing import, ... in the user's file
        raise BadInput(f"task file {path} could not be imported: {_describe(error)}") from None
    return module


def _describe(error: BaseException) -> str:
    """`Type: message (file:line)` of the innermost frame of the user's code, for a one-line error."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    if isinstance(error, SyntaxError):
        where = f" ({os.path.basename(error.filename or '?')}:{error.lineno})"
    return f"{type(error).__name__}: {error}{where}"


# ---------------------------------------------------------------------------------------------
# Scoring in a worker process, each completion within a deadline
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    reward: float  # 0 for no answer or a time-out
    found: bool  # the score was a number (False: None, or a time-out)
    timed_out: bool = False


_WORKERS: dict[str, multiprocessing.pool.Pool] = {}  # one per task file, started on first use


def run_each(task: TaskFile, jobs: list[tuple], seconds: float) -> list[tuple[str, object] | None]:
    """Each job, ("score", text, row) or ("tool", name, argument), run by the task file's code in a worker process,
    one at a time, each within `seconds`: what `_run_one` returns, or None for a job that ran past its time (the
    worker is then killed and a new one takes the jobs that follow)."""
    if task.in_process:  # the project's own code, bounded: no worker, no deadline
        return [_run_one((task.path, *job)) for job in jobs]
    outcomes = []
    while len(outcomes) < len(jobs):
        if task.path not in _WORKERS:  # a new worker imports the task file before any deadline counts
            _WORKERS[task.path] = multiprocessing.get_context("spawn").Pool(1)
            try:
                _WORKERS[task.path].apply_async(_run_one, ((task.path, "load", None, None),)).get(WORKER_START_SECONDS)
            except multiprocessing.TimeoutError:
                _WORKERS.pop(task.path).terminate()
                raise BadInput(
                    f"{task.path}: the worker process that runs its code did not start in {WORKER_START_SECONDS} s "
                    '(a script that starts it needs the `if __name__ == "__main__":` guard)'
                ) from None
        pending = _WORKERS[task.path].imap(_run_one, [(task.path, *job) for job in jobs[len(outcomes) :]])
        try:
            while len(outcomes) < len(jobs):
                outcomes.append(pending.next(seconds))
        except multiprocessing.TimeoutError:  # the user's code hangs on this job
            _WORKERS.pop(task.path).terminate()
            outcomes.append(None)
    return outcomes


def score_all(task: TaskFile, texts: list[str], rows: list[dict]) -> list[Scored]:
    """`score(text, row)` of the task file for every pair, in a worker process, each within the task's deadline."""
    outcomes = run_each(task, [("score", text, row) for text, row in zip(texts, rows)], task.score_seconds)
    for outcome, row in zip(outcomes, rows):
        if outcome is None:
            print(
                f"warning: {task.name}: score() ran past {task.score_seconds:g} s on a completion of row "
                f"{_short(row)}; it gets reward 0",
                file=sys.stderr,
            )
    return [Scored(0.0, False, True) if o is None else _checked(task, o, row) for o, row in zip(outcomes, rows)]


def _checked(task: TaskFile, outcome: tuple[str, object], row: dict) -> Scored:
    """What the worker returned, as a Scored; an exception or a non-number is an error naming the file."""
    kind, value = outcome
    where = f"{task.path}: score(completion, row)"
    if kind == "raised":
        raise BadInput(f"{where} raised {value} on row {_short(row)}")
    if kind == "not a number" or not math.isfinite(value if value is not None else 0.0):
        raise BadInput(
            f"{where} returned {value} on row {_short(row)}: the reward must be a finite number, a bool, or None "
            "(no answer)"
        )
    return Scored(0.0, False) if value is None else Scored(float(value), True)


def _short(row: dict) -> str:
    text = repr(row)
    return text if len(text) <= 160 else text[:157] + "..."


def _run_one(job: tuple) -> tuple[str, object]:
    """In the worker. A score: ("value", a float, bool or None), ("not a number", its repr) or ("raised", what was
    raised). A tool: ("value", its output as a string) or ("raised", what was raised)."""
    path, kind, first, second = job
    try:
        module = load_task_file(path).module
        if kind == "load":
            return ("value", None)
        value = module.score(first, second) if kind == "score" else module.TOOLS[first](second)
    except BadInput as error:
        return ("raised", str(error))
    except Exception as error:
        return ("raised", _describe(error))
    if kind == "tool":
        return ("value", value if isinstance(value, str) else str(value))
    if value is None or isinstance(value, (bool, int, float)):
        return ("value", value)
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return ("value", float(value))  # a numpy or torch scalar
    except (TypeError, ValueError):
        return ("not a number", f"{repr(value)[:100]} ({type(value).__name__})")
