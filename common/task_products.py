"""The built-in tool task `products` (`--task products`), written as a task file (common/task_files.py) with a tool.

`Q: 37*48=`: two numbers in 10..99, whose product the built-in model cannot compute in its head; with the calculator
it writes `<calc>37*48</calc>`, the episode continues after the output ` = 1776`, and it answers
` #### 1776`. The reward is 1 for the right number after the last `####`. Its warm start (common/tiny.py) imitates
the call on half of the prompts and a bare answer (` #### 1776`) on the others, so the policy starts by calling the
tool now and then: RL has to learn to call it (and without the tool, `--max-turns 1`, to multiply).

The calculator parses the arithmetic itself (integers, + − * / and parentheses; exact fractions), never `eval`.
Being the project's own code with a bounded input, it runs in the trainer's process; a user's tool runs in a worker.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

TEST_SIZE = 500
TOOL_SHARE = 1 / 2  # of the warm start's targets that call the calculator


def rows(split: str) -> list[dict]:
    """Every pair of 10..99, shuffled once with a fixed seed: 500 test rows, 7,600 training rows (disjoint)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(2468).shuffle(pairs)
    chosen = pairs[:TEST_SIZE] if split == "test" else pairs[TEST_SIZE:]
    return [{"question": f"Q: {a}*{b}=", "answer": str(a * b), "numbers": (a, b)} for a, b in chosen]


def score(completion: str, row: dict) -> float | None:
    """1 for the right number after the last `####` (a tool's output does not count: it has no `####`), else 0;
    None when there is no `####`."""
    if "####" not in completion:
        return None
    return float(completion.rsplit("####", 1)[1].strip() == row["answer"])


def warm_start_target(row: dict) -> str:
    """What the warm start imitates for `row`: the call, its output and the answer, or the bare answer."""
    a, b = row["numbers"]
    calls = random.Random(f"{a}*{b}").random() < TOOL_SHARE
    return f"<calc>{a}*{b}</calc>{TOOL_RESULT.format(a * b)} #### {a * b}" if calls else f" #### {a * b}"


MAX_EXPRESSION = 64  # characters: the calculator's input is bounded, and so is its work
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression of integers, + - * / and parentheses, exactly (a fraction when it is
    not whole). A malformed expression or a division by zero raises ValueError, which the policy sees as
    `error: ...`."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"an expression of at most {MAX_EXPRESSION} characters")
    tokens = [number or symbol for number, symbol in _TOKEN.findall(expression.strip())]
    value, position = _sum(tokens, 0)
    if position != len(tokens):
        raise ValueError(f"unexpected {tokens[position]!r}")
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _sum(tokens, position):
    value, position = _product(tokens, position)
    while position < len(tokens) and tokens[position] in "+-":
        operator, (right, position) = tokens[position], _product(tokens, position + 1)
        value = value + right if operator == "+" else value - right
    return value, position


def _product(tokens, position):
    value, position = _factor(tokens, position)
    while position < len(tokens) and tokens[position] in "*/":
        operator, (right, position) = tokens[position], _factor(tokens, position + 1)
        if operator == "/" and right == 0:
            raise ValueError("division by zero")
        value = value * right if operator == "*" else value / right
    return value, position


def _factor(tokens, position):
    if position >= len(tokens):
        raise ValueError("the expression ends too early")
    token = tokens[position]
    if token == "-":
        value, position = _factor(tokens, position + 1)
        return -value, position
    if token == "(":
        value, position = _sum(tokens, position + 1)
        if position >= len(tokens) or tokens[position] != ")":
            raise ValueError("a ( is not closed")
        return value, position + 1
    if token.isdigit():
        return Fraction(int(token)), position + 1
    raise ValueError(f"unexpected {token!r}")


TOOLS = {"calc": calculator}
TOOL_RESULT = " = {}"  # the output as the policy sees it: `<calc>37*48</calc> = 1776 #### 1776`
