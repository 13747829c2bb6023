"""Scoring: a completion's final answer against the gold answer, and DAPO's overlong penalty.

    score(completion_text, row.answer, task="gsm8k")        # Score(correct, found); .reward is 1.0 or 0.0
    scores = score_completions(completions, rows, n=8, tokenizer=tokenizer, task="gsm8k")
    scores = score_completions(completions, rows, n=8, tokenizer=tokenizer, task="my_task.py")   # a task file's score

A task file (common/task_files.py) scores with its own `score(completion, row)`: the reward it returns, in a worker
process under a deadline per completion; correct means a reward of at least 1.

The final answer is the last \\boxed{...}, else the last `#### x`, else the last `Answer: x`; for the built-in
`arith` task the whole completion. It is compared with the gold answer: plain numbers exactly, anything else
with math-verify (the built-in tasks accept plain numbers only). math-verify's timeouts are signals, which
cannot interrupt sympy inside C code (`1E55910418` hangs it), so it runs in a helper process (common/processes.py)
that is killed when it overruns a deadline.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from fractions import Fraction

from common.processes import Helper, HelperEnded
from common.task_files import is_task_file, load_task_file, score_all

NUMBER_ANSWER_TASKS = ("arith", "sums")  # the built-in tasks: a plain number is the only right answer

# ---------------------------------------------------------------------------------------------
# Answer extraction and checking
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    correct: bool
    found: bool  # an answer could be extracted at all
    value: float | None = None  # a task file's reward (None: 1 when correct, else 0)

    @property
    def reward(self) -> float:
        return self.value if self.value is not None else 1.0 if self.correct else 0.0


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces matched; of `\\boxed 2` (TeX's argument
    of one token, as some MATH solutions write it), that token."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = text[start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox") :]
    argument = after.lstrip()
    if not argument.startswith("{"):
        token = _ONE_TOKEN.match(argument) if len(argument) < len(after) else None  # `\boxed2` is no box
        return token.group(0) if token else None
    depth, position = 1, 1
    while position < len(argument):
        depth += {"{": 1, "}": -1}.get(argument[position], 0)
        if depth == 0:
            return argument[1:position].strip()
        position += 1
    return None  # unbalanced braces: malformed, no answer


_ONE_TOKEN = re.compile(r"\\[A-Za-z]+|[^\s{}$\\]")  # a control sequence (\pi) or one character


_HASH_ANSWER = re.compile(r"####\s*([^\n]+)")
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS_GROUPED = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d*)?$")  # 1,000 or 12,345.6, not 1,2


def extract_answer(text: str, bare: bool = False) -> str | None:
    """The final answer in a completion, or None. `bare`: the completion is the answer itself
    (the built-in task), used when no marker is present."""
    # a \boxed{} first; else the last of the `#### x` and `Answer: x` lines (a "#### Step 2" heading before a final
    # "Answer: 5" is no answer)
    marked = max(
        (m for p in (_HASH_ANSWER, _ANSWER_LINE) for m in p.finditer(text)), key=lambda m: m.start(), default=None
    )
    for found in (extract_boxed(text), marked and marked.group(1)):
        if found:
            return found.strip().rstrip(".").strip("$ ")
    if bare and text.strip():
        return text.strip()
    return None


def _as_number(text: str) -> Fraction | None:
    text = text.strip()
    if _THOUSANDS_GROUPED.match(text):  # a comma is a number's own only between groups of three digits
        text = text.replace(",", "")
    if not _PLAIN_NUMBER.match(text):
        return None
    try:
        return Fraction(text)
    except ValueError:  # past Python's 4,300-digit limit on int(str) (a degenerate completion): not a plain number
        return None


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


_VERIFIER = None  # the helper process that runs math-verify, started on first use
VERIFY_DEADLINE_SECONDS = 10.0  # per answer, once the helper has started
VERIFIER_START_SECONDS = 120.0  # a spawned process imports the main script (torch, ...) and math-verify (sympy)


def _math_verify_with_deadline(predicted: str, gold: str) -> bool:
    """math-verify's own timeouts are signals, which cannot interrupt sympy inside C code: an answer
    such as `1E55910418` hangs it for minutes. So it runs in a helper process (common/processes.py) that is killed
    (and replaced) when it overruns the deadline; the overrunning answer counts as wrong, as does one during which
    the helper died (a new one takes the next answer)."""
    global _VERIFIER
    verifier = _started_verifier()
    try:
        answer = verifier.ask((predicted, gold), VERIFY_DEADLINE_SECONDS)
    except HelperEnded as ended:
        print(f"warning: the process that runs math-verify ended ({ended.how}); the answer counts as wrong, and a "
              "new process takes the next", file=sys.stderr)  # fmt: skip
        answer = None
    if answer is None:
        verifier.stop()
        _VERIFIER = None
        return False
    return answer


def _started_verifier() -> Helper:
    """The helper, started with math-verify imported and its parsers loaded before an answer's deadline counts: a
    spawned process imports the main script first, which took 8.5 s of a 10 s deadline on a busy 2-core machine."""
    global _VERIFIER
    if _VERIFIER is not None and not _VERIFIER.alive():  # died while idle (a kill, the out-of-memory killer)
        _VERIFIER.stop()
        _VERIFIER = None
    if _VERIFIER is None:
        helper = Helper(_serve_math_verify)
        try:
            started = helper.ask(("1", "1"), VERIFIER_START_SECONDS)
        except HelperEnded:
            started = None
        if started is None:
            helper.stop()
            raise RuntimeError(
                f"the process that runs math-verify did not start in {VERIFIER_START_SECONDS:g} s (a script that "
                'starts it needs the `if __name__ == "__main__":` guard)'
            )
        _VERIFIER = helper
    return _VERIFIER


def _serve_math_verify(connection) -> None:
    """In the helper: (predicted, gold) pairs in, math-verify's verdicts out, until the trainer closes the
    connection."""
    while True:
        try:
            predicted, gold = connection.recv()
        except (EOFError, OSError):
            return
        connection.send(_math_verify(predicted, gold))


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


def score(completion: str, gold: str, task: str) -> Score:
    """A completion of `task` against its gold answer. The built-in `arith` answers bare, `sums` after its `####`,
    both plain numbers only (math-verify is never called); any other task as a math answer (the last \\boxed{},
    `#### x` or `Answer: x`), compared as a number or by math-verify."""
    predicted = extract_answer(completion, bare=task == "arith")
    if predicted is None:
        return Score(correct=False, found=False)
    return Score(correct=answers_match(predicted, gold, numbers_only=task in NUMBER_ANSWER_TASKS), found=True)


def score_completions(completions, rows, n: int, tokenizer, task: str) -> list[Score]:
    """Each completion scored against its prompt's gold answer (prompt i owns completions[i*n : (i+1)*n])."""
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    if is_task_file(task):  # the user's score(completion, row), in a worker process, under a deadline
        scored = score_all(load_task_file(task), texts, [rows[i // n].data for i in range(len(texts))])
        return [Score(s.reward >= 1, s.found, s.reward) for s in scored]
    return [score(text, rows[i // n].answer, task) for i, text in enumerate(texts)]


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
