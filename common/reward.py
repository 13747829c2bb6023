"""Tasks (prompt + gold answer) and answer checking.

    rows = load_task("arith", "train")            # built-in, offline, deterministic
    rows = load_task("sums", "train")             # built-in: sums with a written scratchpad
    rows = load_task("gsm8k", "test")             # Hugging Face datasets (needs the hub once)
    rows = load_task("data/my.jsonl", "train", question_column="q", answer_column="a")
    prompt = format_prompt(rows[0].question, tokenizer, task="gsm8k")
    score = check_answer(completion_text, rows[0].answer)   # Score(correct, found)

Answer checking extracts the final answer (the last \\boxed{...}, else the last `#### x`, else the
last `Answer: x`; for the built-in `arith` task the whole completion) and compares it with the gold
answer: plain numbers exactly, anything else with math-verify (the built-in tasks accept plain numbers
only). math-verify's timeouts are signals, which cannot interrupt sympy inside C code (`1E55910418`
hangs it), so it runs in a worker process that is killed when it overruns a deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    question: str
    answer: str


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
        raise ValueError(f"no \\boxed{{}} answer in a MATH solution: {solution[-200:]!r}")
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
MIN_NEW_TOKENS = {"sums": 41}


def load_task(
    name_or_path: str, split: str, question_column: str = "question", answer_column: str = "answer"
) -> list[Row]:
    """Rows (question, gold answer) of a named task or a local .jsonl / .json / .parquet file."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name_or_path in BUILT_IN_TASKS:
        return BUILT_IN_TASKS[name_or_path](split)
    if name_or_path in HUB_TASKS:
        return _load_hub_task(name_or_path, split)
    extension = os.path.splitext(name_or_path)[1].lower()
    if extension in LOCAL_FORMATS:
        return _load_local_file(name_or_path, question_column, answer_column)
    raise ValueError(
        f"unknown task {name_or_path!r}: use one of {[*BUILT_IN_TASKS, *HUB_TASKS]} or a path to a "
        f"{'/'.join(LOCAL_FORMATS)} file"
    )


def _load_hub_task(name: str, split: str) -> list[Row]:
    import datasets

    spec = HUB_TASKS[name]
    if split not in spec.splits:
        raise ValueError(
            f"task {name!r} has no {split!r} split (it has {sorted(spec.splits)}); "
            f"choose another task for {'evaluation' if split == 'test' else 'training'}"
        )
    try:
        data = datasets.load_dataset(spec.dataset_id, spec.config, split=spec.splits[split])
    except Exception as error:  # the hub is unreachable, the id moved, ...
        raise RuntimeError(
            f"could not load task {name!r} ({spec.dataset_id}, split {spec.splits[split]!r}): {error}. "
            "Without hub access, download it elsewhere and pass the file path as the task."
        ) from error
    _require_columns(data.column_names, spec.columns, f"dataset {spec.dataset_id}")
    return _rows_from_records(data, spec.question, spec.answer, f"dataset {spec.dataset_id}")


def _load_local_file(path: str, question_column: str, answer_column: str) -> list[Row]:
    import datasets

    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file not found: {path}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"task file is empty: {path}")
    builder = LOCAL_FORMATS[os.path.splitext(path)[1].lower()]
    try:
        data = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as error:
        raise ValueError(f"could not read task file {path} as {builder}: {error}") from error
    _require_columns(data.column_names, (question_column, answer_column), f"task file {path}")
    return _rows_from_records(data, lambda r: r[question_column], lambda r: r[answer_column], f"task file {path}")


def _require_columns(present, needed, where):
    missing = [c for c in needed if c not in present]
    if missing:
        raise ValueError(
            f"{where} has no column(s) {missing}; its columns are {list(present)} "
            "(choose them with --question-column / --answer-column)"
        )


def _rows_from_records(records, question, answer, where) -> list[Row]:
    rows = []
    for index, record in enumerate(records):
        q, a = question(record), answer(record)
        if q is None or a is None or str(q).strip() == "" or str(a).strip() == "":
            raise ValueError(f"{where}: row {index} has an empty question or answer")
        rows.append(Row(str(q), str(a).strip()))
    if not rows:
        raise ValueError(f"{where} has no rows")
    return rows


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
    Math tasks get an instruction to box the answer, inside the chat template when the tokenizer has
    one (and `use_chat_template`), else as a plain `Question: ... Answer:` completion prompt."""
    if task in BUILT_IN_TASKS:
        return question
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question}\n{MATH_INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\n{MATH_INSTRUCTION}\nAnswer:"


def encode_prompt(question: str, tokenizer, task: str, use_chat_template: bool = True) -> list[int]:
    """Token ids of the formatted prompt. A chat template already writes its special tokens."""
    templated = task not in BUILT_IN_TASKS and use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    text = format_prompt(question, tokenizer, task, use_chat_template)
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


def encode_prompts(rows, tokenizer, task, use_chat_template=True, max_tokens=None):
    """(rows, token ids) of every row whose prompt fits in `max_tokens`; the others are dropped."""
    prompts = [encode_prompt(row.question, tokenizer, task, use_chat_template) for row in rows]
    keep = [i for i, p in enumerate(prompts) if max_tokens is None or len(p) <= max_tokens]
    if not keep:
        raise ValueError(f"every prompt of task {task!r} is longer than --max-prompt-tokens {max_tokens}")
    return [rows[i] for i in keep], [prompts[i] for i in keep]


# ---------------------------------------------------------------------------------------------
# Answer extraction and checking
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    correct: bool
    found: bool  # an answer could be extracted at all

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    position = text.index("{", start) + 1
    depth, content_start = 1, position
    while position < len(text):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[content_start:position].strip()
        position += 1
    return None  # unbalanced braces: malformed, no answer


_HASH_ANSWER = re.compile(r"####\s*([^\n]+)")
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")


def extract_answer(text: str, bare: bool = False) -> str | None:
    """The final answer in a completion, or None. `bare`: the completion is the answer itself
    (the built-in task), used when no marker is present."""
    for found in (extract_boxed(text), _last_match(_HASH_ANSWER, text), _last_match(_ANSWER_LINE, text)):
        if found:
            return found.strip().rstrip(".").strip("$ ")
    if bare and text.strip():
        return text.strip()
    return None


def _last_match(pattern: re.Pattern, text: str) -> str | None:
    matches = pattern.findall(text)
    if not matches:
        return None
    last = matches[-1]
    return last if isinstance(last, str) else last[0]


def _as_number(text: str) -> Fraction | None:
    text = text.replace(",", "").strip()
    return Fraction(text) if _PLAIN_NUMBER.match(text) else None


def answers_match(predicted: str, gold: str, numbers_only: bool = False) -> bool:
    """Plain numbers are compared exactly, in-process (fast: the common case); anything else
    (fractions, LaTeX, sets, expressions) goes to math-verify in a worker process. `numbers_only`: the
    answer must be a plain number (the built-in task), anything else is wrong."""
    predicted_number, gold_number = _as_number(predicted), _as_number(gold)
    if predicted_number is not None and gold_number is not None:
        return predicted_number == gold_number
    if numbers_only:
        return False
    return _math_verify_with_deadline(predicted, gold)


_VERIFIER = None  # a one-process pool, created on first use
VERIFY_DEADLINE_SECONDS = 10.0


def _math_verify_with_deadline(predicted: str, gold: str) -> bool:
    """math-verify's own timeouts are signals, which cannot interrupt sympy inside C code: an answer
    such as `1E55910418` hangs it for minutes. So it runs in a worker process that is killed (and
    replaced) when it overruns the deadline; the overrunning answer counts as wrong."""
    global _VERIFIER
    if _VERIFIER is None:
        _VERIFIER = multiprocessing.get_context("spawn").Pool(1)
    try:
        return _VERIFIER.apply_async(_math_verify, (predicted, gold)).get(VERIFY_DEADLINE_SECONDS)
    except multiprocessing.TimeoutError:
        _VERIFIER.terminate()
        _VERIFIER = None
        return False


def _math_verify(predicted: str, gold: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # signal-based timeouts only work in a process's main thread; elsewhere run without them
    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main_thread else None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=timeout)
        predicted_parsed = parse(f"${predicted}$", extraction_config=configs, parsing_timeout=timeout)
        if not gold_parsed or not predicted_parsed:
            return predicted.strip() == gold.strip()
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify raising on odd input (or a timeout) counts as not correct
        return False


def check_answer(completion: str, gold: str, bare: bool = False, numbers_only: bool = False) -> Score:
    """`bare`: the completion may be the answer itself; `numbers_only`: only a plain number can be right,
    so math-verify is never called."""
    predicted = extract_answer(completion, bare=bare)
    if predicted is None:
        return Score(correct=False, found=False)
    return Score(correct=answers_match(predicted, gold, numbers_only), found=True)


def score(completion: str, gold: str, task: str) -> Score:
    """A completion of `task` against its gold answer: the built-in `arith` answers bare, `sums` after
    its `####`, both plain numbers; any other task as a math answer (\\boxed{}, ####, Answer:)."""
    return check_answer(completion, gold, bare=task == "arith", numbers_only=task in BUILT_IN_TASKS)


def reward(completion: str, gold: str, task: str) -> float:
    """1.0 when the completion's final answer equals the gold answer, else 0.0."""
    return score(completion, gold, task).reward


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Eq. 13), added to the reward:
    0 up to L_max − L_cache tokens, then falling linearly to −1 at L_max, with L_max = `max_new_tokens`
    and L_cache = `buffer` (0: no penalty). `length` counts the completion's tokens, EOS included, as
    the authors' verl recipe does (valid response length). Longer than L_max is −1 (the engine never
    samples that far)."""
    if buffer <= 0:
        return 0.0
    expected = max_new_tokens - buffer
    return max(min((expected - length) / buffer, 0.0), -1.0)
