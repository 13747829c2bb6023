"""Tasks: rows of (question, gold answer), and the prompts the policy sees.

    rows = load_task("arith", "train")            # built-in, offline, deterministic
    rows = load_task("sums", "train")             # built-in: sums with a written scratchpad
    rows = load_task("gsm8k", "test")             # Hugging Face datasets (needs the hub once)
    rows = load_task("data/my.jsonl", "train", question_column="q", answer_column="a")
    rows = load_task("my_task.py", "train")       # a task file: its rows(split) and score(completion, row)
    rows, prompt_ids = encode_prompts(rows, tokenizer, task="gsm8k", max_tokens=512)
    train_rows, eval_rows = load_train_and_eval("data/my.jsonl", None)   # a local file: a seeded 10% held out

How a completion is scored against a row's gold answer: common/scoring.py; what a task file defines:
common/task_files.py.
"""

from __future__ import annotations

import decimal
import hashlib
import json
import math
import os
import random
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import Callable

from common.errors import BadInput
from common.scoring import extract_boxed
from common.task_files import BUILT_IN as BUILT_IN_TASK_FILES
from common.task_files import is_task_file, load_task_file

# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    question: str
    answer: str  # the gold answer ("" for a task file's row without one)
    data: dict | None = field(default=None, compare=False)  # a task file's row, as its rows(split) returned it


@dataclass(frozen=True)
class HubTask:
    """Where a public task lives on the Hugging Face hub and how to read one row of it."""

    dataset_id: str
    config: str | None
    splits: dict[str, str]  # our split name -> the dataset's split name
    question: Callable[[dict], str]
    answer: Callable[[dict], str]
    columns: tuple[str, ...]  # the columns `question` / `answer` read, checked before use


def _last_boxed_or_raise(solution: str) -> str:
    boxed = extract_boxed(solution)
    if boxed is None:
        raise BadInput(f"no \\boxed{{}} answer in a MATH solution: {solution[-200:]!r}")
    return boxed


_DAPO_HEADER = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
_DAPO_FOOTER = '\n\nRemember to put your answer on its own line after "Answer:".'

HUB_TASKS: dict[str, HubTask] = {
    "gsm8k": HubTask(
        "openai/gsm8k",
        "main",
        {"train": "train", "test": "test"},
        question=lambda r: r["question"],
        answer=lambda r: r["answer"].split("####")[-1].strip().replace(",", ""),
        columns=("question", "answer"),
    ),
    "math": HubTask(  # Hendrycks MATH (the original hendrycks/competition_math was taken down)
        "DigitalLearningGmbH/MATH-lighteval",
        "default",
        {"train": "train", "test": "test"},
        question=lambda r: r["problem"],
        answer=lambda r: _last_boxed_or_raise(r["solution"]),
        columns=("problem", "solution"),
    ),
    "math500": HubTask(
        "HuggingFaceH4/MATH-500",
        None,
        {"test": "test"},
        question=lambda r: r["problem"],
        answer=lambda r: r["answer"],
        columns=("problem", "answer"),
    ),
    "dapo_math": HubTask(  # the prompt is a chat list whose text carries DAPO's own instruction
        "BytedTsinghua-SIA/DAPO-Math-17k",
        None,
        {"train": "train"},
        question=lambda r: r["prompt"][0]["content"].removeprefix(_DAPO_HEADER).removesuffix(_DAPO_FOOTER),
        answer=lambda r: r["reward_model"]["ground_truth"],
        columns=("prompt", "reward_model"),
    ),
    "aime24": HubTask(
        "HuggingFaceH4/aime_2024",
        None,
        {"test": "train"},
        question=lambda r: r["problem"],
        answer=lambda r: str(r["answer"]),
        columns=("problem", "answer"),
    ),
    "aime25": HubTask(
        "math-ai/aime25",
        None,
        {"test": "test"},
        question=lambda r: r["problem"],
        answer=lambda r: str(r["answer"]),
        columns=("problem", "answer"),
    ),
}
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ARITH_TEST_SIZE = 500
SUMS_TEST_SIZE, SUMS_TRAIN_SIZE = 500, 20_000


def arith_rows(split: str, seed: int = 1234) -> list[Row]:
    """The built-in task: `Q: a+b=` with a, b in 0..99; the answer is a+b.

    All 10,000 pairs are shuffled once with a fixed seed; the first 500 are the test split and the
    rest the training split, so the two are disjoint and identical on every machine."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:ARITH_TEST_SIZE] if split == "test" else pairs[ARITH_TEST_SIZE:]
    return [Row(f"Q: {a}+{b}=", str(a + b)) for a, b in chosen]


def sums_scratchpad(numbers) -> str:
    """The written reasoning of the `sums` task: one running sum per step, then the answer after ####.
    (37, 48, 91) -> `37+48=85,85+91=176 #### 176`."""
    steps, total = [], numbers[0]
    for number in numbers[1:]:
        steps.append(f"{total}+{number}={total + number}")
        total += number
    return f"{','.join(steps)} #### {total}"


def sums_rows(split: str, seed: int = 4321) -> list[Row]:
    """The built-in reasoning task: `Q: 37+48+91=`, three or four numbers in 10..99, whose completion is
    written out step by step (`sums_scratchpad`); the gold answer is the sum. Responses are 26-41
    tokens of the character-level tiny model (EOS included), and their format tokens (`+`, `=`, `,`, ` #### `) are the
    same in right and wrong answers.

    Distinct number lists are drawn with a fixed seed, 500 for the test split, then 20,000 for the
    training split: disjoint, and identical on every machine."""
    generator, seen, chosen = random.Random(seed), set(), []
    while len(chosen) < SUMS_TEST_SIZE + SUMS_TRAIN_SIZE:
        numbers = tuple(generator.randint(10, 99) for _ in range(generator.choice((3, 4))))
        if numbers not in seen:
            seen.add(numbers)
            chosen.append(numbers)
    chosen = chosen[:SUMS_TEST_SIZE] if split == "test" else chosen[SUMS_TEST_SIZE:]
    return [Row(f"Q: {'+'.join(map(str, numbers))}=", str(sum(numbers))) for numbers in chosen]


BUILT_IN_TASKS = {"arith": arith_rows, "sums": sums_rows}  # offline, answers are plain numbers
# --max-new-tokens a task needs: room for its longest completion and EOS (99+99=198,198+99=297,297+99=396 #### 396)
MIN_NEW_TOKENS = {
    "sums": 41,
    "products": 28,
}  # products: <calc>99*99</calc> #### 9801 and EOS (the tool's output apart)


def load_task(
    name_or_path: str, split: str, question_column: str = "question", answer_column: str = "answer"
) -> list[Row]:
    """Rows (question, gold answer) of a named task or a local .jsonl / .json / .parquet file."""
    if split not in ("train", "test"):
        raise BadInput(f"split must be 'train' or 'test', got {split!r}")
    if name_or_path in BUILT_IN_TASKS:
        return BUILT_IN_TASKS[name_or_path](split)
    if name_or_path in HUB_TASKS:
        return _load_hub_task(name_or_path, split)
    if is_task_file(name_or_path):
        return [Row(r["question"], str(r.get("answer", "")), r) for r in load_task_file(name_or_path).rows(split)]
    extension = os.path.splitext(name_or_path)[1].lower()
    if extension in LOCAL_FORMATS:
        return _load_local_file(name_or_path, question_column, answer_column)
    raise BadInput(
        f"unknown task {name_or_path!r}: use one of {[*BUILT_IN_TASKS, *BUILT_IN_TASK_FILES, *HUB_TASKS]}, a path to a "
        f"{'/'.join(LOCAL_FORMATS)} file, or a task file (.py: its rows(split) and score(completion, row))"
    )


def _load_hub_task(name: str, split: str) -> list[Row]:
    import datasets

    spec = HUB_TASKS[name]
    if split not in spec.splits:
        raise BadInput(
            f"task {name!r} has no {split!r} split (it has {sorted(spec.splits)}); "
            f"choose another task for {'evaluation' if split == 'test' else 'training'}"
        )
    try:
        data = datasets.load_dataset(spec.dataset_id, spec.config, split=spec.splits[split])
    except Exception as error:  # the hub is unreachable, the id moved, ...
        raise BadInput(
            f"could not load task {name!r} ({spec.dataset_id}, split {spec.splits[split]!r}): {error}. "
            "Without hub access, download it elsewhere and pass the file path as the task."
        ) from error
    _require_columns(data.column_names, spec.columns, f"dataset {spec.dataset_id}")
    return _rows_from_records(data, spec.question, spec.answer, f"dataset {spec.dataset_id}")


def _load_local_file(path: str, question_column: str, answer_column: str) -> list[Row]:
    import datasets

    if os.path.isdir(path):  # e.g. a Spark or datasets export: a folder of part files under the file's name
        parts = sorted(os.listdir(path))
        raise BadInput(
            f"task file {path} is a folder ({len(parts)} entries: {', '.join(parts[:3])}{', ...' if parts[3:] else ''})"
            f": pass one file, e.g. its parts joined: cat {path}/*.json > {path.rstrip('/')}.all.jsonl"
        )
    if not os.path.isfile(path):
        raise BadInput(f"task file not found: {path}")
    if os.path.getsize(path) == 0:
        raise BadInput(f"task file is empty: {path}")
    builder = LOCAL_FORMATS[os.path.splitext(path)[1].lower()]
    if path.lower().endswith(".jsonl"):
        _check_json_lines(path)  # datasets would bury the line of a torn record under its own tracebacks
    try:
        data = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise BadInput(f"could not read task file {path} as {builder}: {reason}") from error
    _require_columns(data.column_names, (question_column, answer_column), f"task file {path}")
    return _rows_from_records(data, lambda r: r[question_column], lambda r: r[answer_column], f"task file {path}")


def _check_json_lines(path: str) -> None:
    """Every non-blank line of a .jsonl file is one JSON object; else the error names the file, line and column."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:  # a byte-order mark is no part of line 1
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise BadInput(
                    f"{path}:{number}: not UTF-8 text (byte {error.start + 1} of the line is "
                    f"0x{raw[error.start]:02x}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise BadInput(
                    f"{path}:{number}:{error.colno}: not a JSON record ({error.msg}); fix or remove the line"
                ) from None
            if not isinstance(record, dict):
                raise BadInput(f"{path}:{number}: a JSON {type(record).__name__}, not an object with named columns")
            try:  # an escaped lone surrogate (\udc80) parses, but is no text a tokenizer takes
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                surrogate = "a lone surrogate escape (\\udXXX), not a character; fix the line"
                raise BadInput(f"{path}:{number}: {surrogate}") from None


def _require_columns(present, needed, where):
    missing = [c for c in needed if c not in present]
    if missing:
        raise BadInput(
            f"{where} has no column(s) {missing}; its columns are {list(present)} "
            "(choose them with --question-column / --answer-column)"
        )


def _rows_from_records(records, question, answer, where) -> list[Row]:
    rows, rounded = [], []
    for index, record in enumerate(records):
        q, a = question(record), answer(record)
        blank = [name for name, v in (("question", q), ("answer", a)) if v is None or str(v).strip() == ""]
        if blank:
            empty = " and ".join(blank)
            raise BadInput(f"{where}: row {index} has an empty question or answer (its {empty}; rows count from 0)")
        if not isinstance(q, str) or isinstance(a, (list, dict, bytes)):  # its repr: the prompt or the gold answer
            what = f"question is a {type(q).__name__}" if not isinstance(q, str) else f"answer is a {type(a).__name__}"
            columns = " (a .json file of columns? one object per row: .jsonl)" if isinstance(q, list) else ""
            raise BadInput(f"{where}: row {index}'s {what}, not text{columns}: {_short(q if what[0] == 'q' else a)}")
        if isinstance(a, float) and not math.isfinite(a):
            raise BadInput(f"{where}: row {index}'s answer is {a}, not a number any completion can equal")
        if isinstance(a, float) and abs(a) >= 2**53 and a.is_integer():  # 12345678901234567 read as ...568
            rounded.append(index)  # (1e16 written as a float is exact: said, not refused)
        # a float as written, never in exponent notation (5e-05), which no answer is compared with
        rows.append(Row(str(q), format(decimal.Decimal(repr(a)), "f") if isinstance(a, float) else str(a).strip()))
    if not rows:
        raise BadInput(f"{where} has no rows")
    if rounded:
        first = f"row {rounded[0]} first: {rows[rounded[0]].answer}"
        print(f"warning: {where}: {len(rounded)} answers ({first}) were read as floats past 2^53, where not every "
              "integer is one: if the file holds integers there (a column that mixes integers and decimals is read as "
              "floats), they may have been rounded; store answers as text", file=sys.stderr)  # fmt: skip
    return rows


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


HELD_OUT_SHARE, HELD_OUT_MAX = 0.1, 500  # of a local task file evaluated on itself


def load_train_and_eval(
    task: str, eval_task: str | None, question_column="question", answer_column="answer", verbose=True, evaluated=True
):
    """(training rows, held-out rows). Named tasks: `task`'s train split and `eval_task`'s test split (`eval_task`
    defaults to `task`). A local file has no test split: as the held-out task too (no `eval_task`, or the same
    file, however its path is written), a seeded 10% of its distinct questions (at most 500, at least 1) is held
    out with all their rows and never trains; a separate `eval_task` file is held out whole. `verbose`: say which.
    Not `evaluated` (--eval-every 0): no held-out rows are loaded (a task without a test split trains), but a
    local file still holds its 10% out."""
    columns = (question_column, answer_column)
    eval_task = eval_task or task
    train = load_task(task, "train", *columns)
    local = os.path.splitext(task)[1].lower() in LOCAL_FORMATS
    answers = {}
    for row in train:
        answers.setdefault(_same_question(row.question), set()).add(row.answer)
    disagreeing = sum(len(golds) > 1 for golds in answers.values())
    if verbose and disagreeing:
        print(f"warning: {disagreeing} of the {len(answers)} questions of {task} have rows with different answers (a "
              "completion can match one of them only): check the data", file=sys.stderr)  # fmt: skip
    if not evaluated and not local:
        return train, []
    if not same_task(eval_task, task) or not local:
        held_out = load_task(eval_task, "test", *columns)
        if verbose and os.path.splitext(eval_task)[1].lower() in LOCAL_FORMATS:
            print(f"held-out prompts: all {len(held_out)} rows of {eval_task}", file=sys.stderr)
        evaluated_questions = {_same_question(r.question) for r in held_out}
        trained = len(evaluated_questions & answers.keys())
        if verbose and trained:
            print(f"warning: {trained} of the {len(evaluated_questions)} held-out questions of {eval_task} are also in "
                  f"{task}, which trains on them: their accuracy measures memory", file=sys.stderr)  # fmt: skip
        return train, held_out
    # The split is drawn over distinct questions, so that a question a file repeats is held out with every copy
    # (a copy left to train would make its held-out accuracy a memory test); without repeats, one row each. Copies
    # that differ in spacing or Unicode form (NFC) count as one question (_same_question).
    questions = list(answers)
    if len(questions) < 2:
        raise BadInput(
            f"task file {task} has {len(questions)} distinct question: too few to hold some out; "
            "give --eval-task a file"
        )
    count = min(HELD_OUT_MAX, max(1, round(HELD_OUT_SHARE * len(questions))))
    chosen = {questions[i] for i in random.Random(f"held-out/{len(questions)}").sample(range(len(questions)), count)}
    held_out = [r for r in train if _same_question(r.question) in chosen]
    if verbose:
        repeats = f" ({len(held_out)} rows: the file repeats some)" if len(held_out) > count else ""
        print(
            f"held-out prompts: {count} of the {len(questions)} questions of {task}{repeats} (seeded; they never "
            "train); --eval-task FILE evaluates on another file",
            file=sys.stderr,
        )
    return [r for r in train if _same_question(r.question) not in chosen], held_out


def _same_question(question: str) -> str:
    """A question as the held-out split compares it: copies that differ in spacing or Unicode form are one."""
    return unicodedata.normalize("NFC", " ".join(question.split()))


def same_task(one: str, other: str) -> bool:
    """Whether two --task values name the same task: a local file by its real path (d.jsonl, ./d.jsonl, /x/d.jsonl)."""
    if one == other:
        return True
    local = [os.path.splitext(t)[1].lower() in LOCAL_FORMATS for t in (one, other)]
    return all(local) and os.path.realpath(one) == os.path.realpath(other)


def sample_batch(num_rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Row indices for training step `step`: epochs of seeded permutations, read in order.

    A pure function of (step, seed), so a resumed run sees exactly the prompts it would have seen."""
    indices, permutations = [], {}
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_rows)
        if epoch not in permutations:
            permutations[epoch] = random.Random(seed + epoch).sample(range(num_rows), num_rows)
        indices.append(permutations[epoch][offset])
    return indices


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(question: str, tokenizer, task: str, use_chat_template: bool = True) -> str:
    """The text the policy sees. The built-in tasks are used verbatim (the tiny models were trained on them).
    A task file's question goes inside the chat template after its SYSTEM_PROMPT, or verbatim without one.
    Math tasks get an instruction to box the answer, inside the chat template when the tokenizer has
    one (and `use_chat_template`), else as a plain `Question: ... Answer:` completion prompt."""
    if task in BUILT_IN_TASKS:
        return question
    if is_task_file(task):
        if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
            return question
        system = load_task_file(task).system_prompt
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question}\n{MATH_INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\n{MATH_INSTRUCTION}\nAnswer:"


def encode_prompt(question: str, tokenizer, task: str, use_chat_template: bool = True) -> list[int]:
    """Token ids of the formatted prompt. A chat template already writes its special tokens."""
    templated = task not in BUILT_IN_TASKS and use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    text = format_prompt(question, tokenizer, task, use_chat_template)
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


def encode_prompts(rows, tokenizer, task, use_chat_template=True, max_tokens=None, verbose=False):
    """(rows, token ids) of every row whose prompt (instruction and chat template included) fits in `max_tokens`;
    the others are dropped, and `verbose` says how many."""
    prompts = [encode_prompt(row.question, tokenizer, task, use_chat_template) for row in rows]
    keep = [i for i, p in enumerate(prompts) if max_tokens is None or len(p) <= max_tokens]
    if not keep:
        raise BadInput(
            f"every prompt of task {task!r} is longer than {max_tokens} tokens (the limit, --max-prompt-tokens or the "
            f"model's context less --max-new-tokens; instruction and chat template count): the shortest has "
            f"{min(map(len, prompts))}"
        )
    if verbose and len(keep) < len(rows):
        print(
            f"{task}: {len(rows) - len(keep)} of {len(rows)} prompts are longer than {max_tokens} tokens (instruction "
            "and chat template included) and are left out",
            file=sys.stderr,
        )
    return [rows[i] for i in keep], [prompts[i] for i in keep]


def prompt_token_limit(model: str, max_prompt_tokens: int, max_new_tokens: int, episode_tokens: int) -> int:
    """The longest prompt that leaves room for the new tokens (`episode_tokens`: --max-new-tokens, or a whole episode's
    with tools) in the model's context (max_position_embeddings of `model`'s config): --max-prompt-tokens, or less
    when the two do not fit together."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None) or math.inf
    if episode_tokens >= context:
        what = f"--max-new-tokens {max_new_tokens}"
        if episode_tokens != max_new_tokens:
            what = f"an episode of {episode_tokens} tokens (--max-episode-tokens)"
        raise BadInput(
            f"{what} does not fit in the context of {model} ({context} tokens, prompt included): lower it below "
            f"{context}"
        )
    return min(max_prompt_tokens, context - episode_tokens)  # prompts left out are counted where encoded


@dataclass
class RunPrompts:
    """A training run's prompts: its training rows with their prompts, and the held-out rows it evaluates on."""

    train_rows: list[Row]
    prompts: list[list[int]]  # token ids of each training row's prompt, instruction and chat template included
    eval_rows: list[Row]
    eval_task: str
    use_chat_template: bool
    context: int  # the tokens the engine's context must hold: the longest prompt and a whole episode


def load_prompts(
    model, tokenizer, task, max_prompt_tokens, max_new_tokens, task_format, tools, evaluation, verbose, run_dir=None
):
    """The prompts of a run on `task` (RunPrompts). `task_format`, `tools`, `evaluation`: the groups of
    common.flags. The training rows and the held-out ones of load_train_and_eval are encoded with the chat-template
    setting; a prompt is left out (and counted) when it is longer than --max-prompt-tokens or than what the model's
    context leaves beside the new tokens (with tools, a whole episode's); --eval-prompts held-out rows at most.
    `run_dir`: the run's folder, where the training rows are recorded (a digest) when it starts and checked when it
    resumes (same_prompts_as_the_run)."""
    from common.tools import episode_tokens

    new_tokens = episode_tokens(task, max_new_tokens, tools)
    prompt_limit = prompt_token_limit(model, max_prompt_tokens, max_new_tokens, new_tokens)
    columns, template = (task_format.question_column, task_format.answer_column), task_format.chat_template
    eval_task = evaluation.eval_task or task
    evaluated = bool(evaluation.eval_every)
    train_rows, eval_rows = load_train_and_eval(task, eval_task, *columns, verbose=verbose, evaluated=evaluated)
    train_rows, prompts = encode_prompts(train_rows, tokenizer, task, template, prompt_limit, verbose)
    if run_dir is not None:
        same_prompts_as_the_run(run_dir, task, train_rows)
    eval_rows = encode_prompts(eval_rows, tokenizer, eval_task, template, prompt_limit, verbose)[0] if eval_rows else []
    return RunPrompts(
        train_rows, prompts, eval_rows[: evaluation.eval_prompts], eval_task, template, prompt_limit + new_tokens
    )


PROMPTS_RECORD = "prompts.json"  # in a run's folder: its training rows' digest


def same_prompts_as_the_run(run_dir: str, task: str, train_rows: list[Row]) -> None:
    """A run resumes on the training rows it started with: a task file edited in between (a row appended, say)
    would give other prompts at each step and, for a file that holds its own questions out, another split, where a
    held-out question may train. The first start records the rows' digest in the run's folder; a resume compares.
    A run started before the record existed, or with a damaged one, is recorded afresh."""
    digest = hashlib.sha256(json.dumps([[r.question, r.answer] for r in train_rows]).encode()).hexdigest()
    record = {"task": task, "training_rows": len(train_rows), "sha256": digest}
    path = os.path.join(run_dir, PROMPTS_RECORD)
    try:
        with open(path) as f:
            saved = json.load(f)
        started = int(saved["training_rows"]), str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        temporary = f"{path}.{os.getpid()}.tmp"  # every rank writes the same record
        with open(temporary, "w") as f:
            json.dump(record, f)
        os.replace(temporary, path)
        return
    if started[1] != digest:
        raise BadInput(
            f"--task {task}: the run started on other training rows ({started[0]} then, {len(train_rows)} now, "
            "or the same number changed): a resumed run would train on other prompts, and a file's held-out "
            "questions may train. Restore the task as it was, or start a new run; to resume on these rows anyway, "
            f"delete {path}"
        )
