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
worker is replaced. The file's import is not timed: what score needs is best imported (or started) there. A file
that cannot be imported (or calls sys.exit as it is), lacks a function, or whose score raises, ends its process, or
returns something other than a number stops the run with an error that names the file and the function. What the
file's code prints goes to the trainer's stderr, its first PRINTED_CHARS per call. The worker is a helper process
(common/processes.py): it takes no signal from the terminal or a scheduler (Ctrl-C, a closed terminal, SIGTERM to
the process group), since the trainer decides when a run stops and scores the step under way first, and it never
outlives the trainer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import math
import os
import pickle
import sys
import traceback
from dataclasses import dataclass

from common.errors import BadInput
from common.processes import Helper, HelperEnded, how_it_ended

SCORE_SECONDS = 10.0  # per completion, unless the file sets SCORE_SECONDS
TOOL_SECONDS = 10.0  # per tool call, unless the file sets TOOL_SECONDS
TOOL_RESULT = "<result>{}</result>"  # how a tool's output is shown to the policy, unless the file sets TOOL_RESULT
WORKER_START_SECONDS = 120  # a spawned worker imports the main script (torch, ...) and the task file
REQUIRED = {"rows": "rows(split)", "score": "score(completion, row)"}
MAX_REWARD = 1e9  # |reward| at most: a group's std squares its rewards, and float32 overflows at 3e38


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
        if isinstance(rows, (dict, str, bytes)) or not hasattr(rows, "__iter__") or hasattr(rows, "columns"):
            # a pandas DataFrame iterates over its column names
            tip = ": DataFrame.to_dict('records') gives one" if hasattr(rows, "columns") else ""
            raise BadInput(f"{self.path}: rows({split!r}) returned a {type(rows).__name__}, not a list of dicts{tip}")
        rows = list(rows)
        if not rows:
            raise BadInput(f"{self.path}: rows({split!r}) returned no rows")
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise BadInput(f"{self.path}: rows({split!r})[{index}] is a {type(row).__name__}, not a dict")
            question = row.get("question")
            if not isinstance(question, str) or not question.strip():
                raise BadInput(f'{self.path}: rows({split!r})[{index}] has no "question" (a non-empty string)')
            if not question.isascii() and not _is_utf8(question):
                raise BadInput(f'{self.path}: rows({split!r})[{index}]["question"] holds a lone surrogate, not text')
            try:  # the row goes to the worker with each completion to score
                pickle.dumps(row)
            except Exception as error:
                key = next((k for k, value in row.items() if not _picklable(value)), None)
                where = f"[{key!r}]" if key is not None else ""
                raise BadInput(
                    f"{self.path}: rows({split!r})[{index}]{where} cannot be sent to the scoring process "
                    f"({type(error).__name__}: {error}): keep a row to plain data (text, numbers, lists, dicts)"
                ) from None
        return rows


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


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
    stem = os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    name = f"task_file_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"  # two folders' task.py are two modules
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # registered under its name, as an import does: pickle finds the file's classes by it (a row holding an instance
    # of one is sent to the worker, which imports the file under the same name), and so do dataclasses
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a syntax error, a missing import, ... in the user's file
        del sys.modules[name]
        raise BadInput(f"task file {path} could not be imported: {_describe(error)}") from None
    except SystemExit as error:  # it would end the trainer without a word
        del sys.modules[name]
        raise BadInput(
            f"task file {path} called sys.exit({error.code!r}) while it was imported"
            f"{_where(error)}: a task file defines rows, score (and TOOLS); put code meant for "
            'running it as a script under `if __name__ == "__main__":`'
        ) from None
    return module


def _describe(error: BaseException) -> str:
    """`Type: message (file:line)` of the innermost frame of the user's code, for a one-line error."""
    where = _where(error)
    if isinstance(error, SyntaxError):
        where = f" ({os.path.basename(error.filename or '?')}:{error.lineno})"
    return f"{type(error).__name__}: {error}{where}"


def _where(error: BaseException) -> str:
    """` (file:line)` of the innermost frame of `error`'s traceback, or ""."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


# ---------------------------------------------------------------------------------------------
# Scoring in a worker process, each completion within a deadline
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    reward: float  # 0 for no answer or a time-out
    found: bool  # the score was a number (False: None, or a time-out)
    timed_out: bool = False


_WORKERS: dict[str, Helper] = {}  # one per task file, started on first use
OUTPUT_CHARS = 100_000  # of a tool's output at most, before it is sent: the rest is cut (marked)
PRINTED_CHARS = 4_000  # of what the file's code prints in one job at most, shown on stderr


def _serve(connection, path: str) -> None:
    """In the worker (a common.processes.Helper): answer jobs until the trainer closes the connection. The file's
    code writes to a bounded buffer, not to the inherited stdout and stderr."""
    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):
            return
        sys.stdout = sys.stderr = printed = _Bounded(PRINTED_CHARS)
        outcome = _run_one((path, *job))
        connection.send((outcome, (printed.text(), printed.size) if printed.size else None))


def _ask(worker: Helper, job: tuple, seconds: float) -> tuple[str, object] | None:
    """What `_run_one` returns for `job` in `worker`; ("exited", how) when its process ended during it, or None when
    it ran past `seconds`. What the code printed goes to stderr (`_show_printed`)."""
    try:
        answer = worker.ask(job, seconds)
    except HelperEnded as ended:
        return ("exited", ended.how)
    if answer is None:
        return None
    outcome, printed = answer
    _show_printed(printed)
    return outcome


def _show_printed(printed: tuple[str, int] | None) -> None:
    """What a job printed in the worker, (its first PRINTED_CHARS, how many in all), on stderr:
    neither the trainer's stdout (common.evaluate's JSON) nor its console is flooded by a file
    that prints megabytes."""
    if not printed:
        return
    text, size = printed
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    if size > len(text):
        more = f"{size - len(text):,} more characters"
        sys.stderr.write(f"[... {more} printed by the task file's code, not shown]\n")


class _Bounded(io.TextIOBase):
    """A text stream that keeps its first `limit` characters and counts the rest."""

    def __init__(self, limit: int):
        self.parts, self.kept, self.size, self.limit = [], 0, 0, limit

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.size += len(text)
        return len(text)

    def text(self) -> str:
        return "".join(self.parts)


def run_each(task: TaskFile, jobs: list[tuple], seconds: float, on_exit=None) -> list:
    """Each job, ("score", text, row) or ("tool", name, argument), run by the task file's code in a
    worker process, one at a time, each within `seconds`: what `_run_one` returns, or None for a
    job that ran past its time (the worker is then killed and a new one takes the jobs that
    follow). A job during which the worker ended (os._exit, a crash, the out-of-memory killer)
    gives ("exited", how), and a new worker takes the next job; with `on_exit`, the first such job
    raises on_exit(index of the job, how) instead, once, and no later job runs."""
    if task.in_process:  # the project's own code, bounded: no worker, no deadline
        outcomes = [_run_one((task.path, *job)) for job in jobs]
    else:
        outcomes = []
        for job in jobs:
            outcome = _ask(_worker(task), job, seconds)
            outcomes.append(outcome)
            if outcome is None or outcome[0] == "exited":  # hung or gone: a new worker for the next
                _WORKERS.pop(task.path).stop()
            if on_exit is not None and outcome is not None and outcome[0] == "exited":
                raise on_exit(len(outcomes) - 1, outcome[1])
    exited = [i for i, o in enumerate(outcomes) if o is not None and o[0] == "exited"]
    if on_exit is not None and exited:  # in-process: sys.exit in the project's own code
        raise on_exit(exited[0], outcomes[exited[0]][1])
    return outcomes


def _worker(task: TaskFile) -> Helper:
    """The task file's worker, started if there is none (its file imported before any deadline
    counts)."""
    if task.path in _WORKERS and _WORKERS[task.path].alive():
        return _WORKERS[task.path]
    if task.path in _WORKERS:  # ended between jobs (the out-of-memory killer, a kill): a new one takes over
        gone = _WORKERS.pop(task.path)
        gone.stop()
        how = how_it_ended(gone.process.exitcode)
        print(f"warning: {task.name}: the worker process that runs its code ended while idle ({how}): "
              "a new one takes over", file=sys.stderr)  # fmt: skip
    worker = Helper(_serve, task.path)
    outcome = _ask(worker, ("load", None, None), WORKER_START_SECONDS)
    if outcome is None:
        worker.stop()
        raise BadInput(
            f"{task.path}: the worker process that runs its code did not start in "
            f"{WORKER_START_SECONDS} s (a script that starts it needs the "
            '`if __name__ == "__main__":` guard)'
        )
    if outcome[0] != "value":
        worker.stop()
        what = "the worker process that runs its code failed to import it"
        raise BadInput(f"{task.path}: {what} ({outcome[1]})")
    _WORKERS[task.path] = worker
    return worker


def score_all(task: TaskFile, texts: list[str], rows: list[dict]) -> list[Scored]:
    """`score(text, row)` of the task file for every pair, in a worker process, each within the
    task's deadline. A score that ends its process stops the run, at the first completion it does
    it on."""

    def exited(index: int, how: str) -> BadInput:
        return BadInput(
            f"{task.path}: score(completion, row) exited ({how}) on row {_short(rows[index])}: a "
            "score must return a number, a bool or None, not end its process (sys.exit, os._exit, "
            "a crash, or the out-of-memory killer)"
        )

    jobs = [("score", text, row) for text, row in zip(texts, rows)]
    outcomes = run_each(task, jobs, task.score_seconds, on_exit=exited)
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
    if kind == "not a number" or not abs(float(value or 0)) <= MAX_REWARD:
        raise BadInput(
            f"{where} returned {_cut(str(value), 60)} on row {_short(row)}: the reward must be a finite number "
            f"(at most {MAX_REWARD:g} in size), a bool, or None (no answer)"
        )
    return Scored(0.0, False) if value is None else Scored(float(value), True)


def _cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a marker that says how long it was."""
    if len(text) <= limit:
        return text
    marker = f"[... cut: the output had {len(text):,} characters, the first {limit:,} are shown]"
    return text[:limit] + "\n" + marker


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
    except SystemExit as error:  # sys.exit: it would end the worker (or, in-process, the trainer)
        return ("exited", f"it called sys.exit({error.code!r})")
    except (Exception, KeyboardInterrupt) as error:  # a KeyboardInterrupt the code raised: named, not an exit
        return ("raised", _describe(error))
    if kind == "tool":
        if isinstance(value, (bytes, bytearray)):  # its repr would reach the policy: b'...'
            return ("not a string", type(value).__name__)
        try:
            text = value if isinstance(value, str) else str(value)
        except Exception as error:  # a __str__ that raises is the tool's error, as one raised in its call
            return ("raised", _describe(error))
        # a lone surrogate (os.fsdecode, an echoed "\udc80" of a JSON call) has no UTF-8: the tokenizer would raise
        return ("value", _cut(text.encode("utf-8", "replace").decode("utf-8"), OUTPUT_CHARS))
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_REWARD:
        return ("not a number", f"an integer of {value.bit_length()} bits")  # float() of 10**400 overflows
    if value is None or isinstance(value, (bool, int, float)):
        return ("value", value)
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return ("value", float(value))  # a numpy or torch scalar
    except (TypeError, ValueError):
        return ("not a number", f"{repr(value)[:100]} ({type(value).__name__})")
