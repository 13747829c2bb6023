"""Tasks and prompt formatting (common/tasks.py), answer checking (common/scoring.py)."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import REPO

from common import scoring, tasks
from common.errors import BadInput
from common.scoring import Score, extract_answer, extract_boxed, score
from common.tasks import (
    HUB_TASKS,
    MIN_NEW_TOKENS,
    Row,
    arith_rows,
    format_prompt,
    load_task,
    sample_batch,
    sums_rows,
    sums_scratchpad,
)


def check_answer(completion, gold):
    """How a math task (anything but the built-in ones) scores a completion."""
    return score(completion, gold, "gsm8k")


# --- answer extraction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{81}.", "81"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{3} then \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{\\{1, 2\\} \\cup \\{3\\}}", "\\{1, 2\\} \\cup \\{3\\}"),  # nested braces
        ("\\boxed{\\frac{1}{2", None),  # unbalanced: malformed
        ("our answer is $\\boxed 2$.", "2"),  # TeX's one-token argument (as in some MATH solutions)
        ("\\boxed \\pi", "\\pi"),
        ("\\boxed {7}", "7"),
        ("\\boxed2", None),  # no such command
        ("We get 70.\n#### 72", "72"),
        ("Answer: 5\nsome more text\nanswer: 7", "7"),
        ("#### Step 1: add\n2+3=5\n#### Step 2: check\nok\nAnswer: 5", "5"),  # markdown headings, then the answer
        ("Answer: 4\n#### 5", "5"),  # whichever marker comes last
        ("#### Final answer\n\\boxed{6}", "6"),  # a box first
        ("no marker at all 42", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_bare_only_when_asked():
    assert extract_answer(" 81", bare=True) == "81"
    assert extract_answer(" 81") is None
    assert extract_answer("   ", bare=True) is None
    assert extract_boxed("\\boxed{}") == ""
    assert extract_answer("\\boxed{}") is None  # an empty box is no answer


@pytest.mark.parametrize(
    "completion, gold, correct",
    [
        ("\\boxed{81}", "81", True),
        ("#### 81", "81", True),
        ("\\boxed{80}", "81", False),
        ("\\boxed{1/2}", "0.5", True),  # fraction vs decimal
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{\\dfrac13}", "\\frac{1}{3}", True),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
        ("\\boxed{1,000}", "1000", True),
        ("Answer: 72.0", "72", True),
        ("\\boxed{x^2+}", "4", False),  # malformed LaTeX: wrong, no exception
        ("\\boxed{-3}", "3", False),
    ],
)
def test_check_answer(completion, gold, correct):
    result = check_answer(completion, gold)
    assert result.found and result.correct is correct
    assert result.reward == (1.0 if correct else 0.0)


@pytest.mark.parametrize(
    "predicted, gold, correct",
    [
        ("1,000", "1000", True),
        ("-12,345.5", "-12345.5", True),
        ("1,2", "12", False),  # a pair (or a slip), not twelve
        ("12", "1,2", False),
        ("1,23", "123", False),
        ("1234,567", "1234567", False),
    ],
)
def test_only_thousands_separators_are_dropped(predicted, gold, correct):
    assert scoring.answers_match(predicted, gold, numbers_only=True) is correct


def test_a_number_past_pythons_digit_limit_is_wrong_not_a_crash():
    """int(str) refuses more than 4,300 digits (Python 3.11+): a degenerate completion of repeated digits stopped the
    run with a raw ValueError."""
    long = "1" * 5000
    assert not scoring.answers_match(long, "5", numbers_only=True)
    assert (score(f"\\boxed{{{long}}}", "5", "gsm8k").reward, score(long, "5", "arith").reward) == (0.0, 0.0)
    assert score("#### " + "7" * 4400, "7", "sums").reward == 0.0


@pytest.mark.parametrize("completion", ["", "I do not know", "\\boxed{\\frac{1}{2", "\\boxed{}"])
def test_no_answer_is_reported_separately(completion):
    result = check_answer(completion, "1")
    assert (result.found, result.correct, result.reward) == (False, False, 0.0)


def test_bare_answers_of_the_built_in_task():
    assert score("81", "81", "arith").reward == 1.0
    assert score("18", "81", "arith").reward == 0.0
    assert score("81", "81", "gsm8k").reward == 0.0  # other tasks need a marked answer


@pytest.mark.parametrize(
    "completion, correct, found",
    [
        ("37+48=85,85+91=176 #### 176", True, True),
        ("37+48=85,85+91=175 #### 175", False, True),  # a slip in the reasoning: the final answer decides
        ("37+48=84,84+91=176 #### 176", True, True),  # a wrong step with the right total still counts (as in GSM8K)
        ("37+48=85,85+91=176", False, False),  # the total written, but no answer after ####
        ("176", False, False),  # a bare number is no answer on this task
        ("37+48=85 #### 1+76", False, True),  # not a plain number: wrong, and math-verify is not asked
        ("#### 176 #### 17", False, True),  # the last marked answer is the one
    ],
)
def test_sums_answers_are_read_after_the_marker(completion, correct, found, monkeypatch):
    monkeypatch.setattr(scoring, "_math_verify_with_deadline", lambda *a: pytest.fail("math-verify was called"))
    assert score(completion, "176", "sums") == Score(correct=correct, found=found)


def test_the_math_verify_deadline_counts_from_a_started_worker(tmp_path):
    """The worker is spawned: it imports the main script first (a trainer's torch, seconds on a busy machine). That
    start is not the first answer's deadline, which would count it wrong (and the next one, in a new worker)."""
    script = tmp_path / "slow_to_import.py"
    script.write_text(
        textwrap.dedent("""
        import time
        if __name__ == "__mp_main__":  # the spawned worker's import of this script, as a trainer's of torch
            time.sleep(3)
        from common import scoring

        if __name__ == "__main__":
            scoring.VERIFY_DEADLINE_SECONDS = 2.0
            print([scoring.answers_match(a, "0.5") for a in ("\\\\frac{1}{2}", "1/2", "\\\\frac{1}{3}")])
        """)
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[True, True, False]"


def test_math_verify_survives_the_terminals_signals():
    """A Ctrl-C or a closed terminal reaches every process of the terminal's group; the trainer scores the step under
    way before it stops, so math-verify's process must not end then."""
    import signal
    import time

    assert scoring.answers_match("\\frac{1}{2}", "0.5")
    verifier = scoring._VERIFIER
    assert os.getsid(verifier.process.pid) != os.getsid(0)  # a session of its own: the group's signals miss it
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(verifier.process.pid, number)
    time.sleep(1)
    assert verifier.alive() and scoring.answers_match("\\frac{1}{3}", "1/3")
    assert scoring._VERIFIER is verifier


def test_math_verify_off_the_main_thread():
    """math-verify's signal timeouts fail off the main thread; we must still get an answer there."""
    results = []
    thread = threading.Thread(target=lambda: results.append(check_answer("\\boxed{\\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join()
    assert results == [Score(correct=True, found=True)]


# --- tasks ------------------------------------------------------------------------------------


def test_arith_is_deterministic_disjoint_and_correct():
    train, test = arith_rows("train"), arith_rows("test")
    assert (len(train), len(test)) == (9500, 500)
    assert train == arith_rows("train") and load_task("arith", "test") == test
    assert not {r.question for r in train} & {r.question for r in test}
    for row in train[:50] + test[:50]:
        a, b = row.question.removeprefix("Q: ").removesuffix("=").split("+")
        assert int(row.answer) == int(a) + int(b)


def test_sums_is_deterministic_disjoint_and_its_scratchpads_add_up():
    train, test = sums_rows("train"), sums_rows("test")
    assert (len(train), len(test)) == (20_000, 500)
    assert train == sums_rows("train") and load_task("sums", "test") == test
    assert len({r.question for r in train + test}) == 20_500  # distinct, so train and test are disjoint
    assert sums_scratchpad([37, 48, 91]) == "37+48=85,85+91=176 #### 176"  # the docstring example
    lengths = {3: 0, 4: 0}
    for row in train + test:
        numbers = [int(n) for n in row.question.removeprefix("Q: ").removesuffix("=").split("+")]
        assert len(numbers) in (3, 4) and all(10 <= n <= 99 for n in numbers) and int(row.answer) == sum(numbers)
        lengths[len(numbers)] += 1
        pad = sums_scratchpad(numbers)
        steps, answer = pad.split(" #### ")
        running = numbers[0]
        for step, number in zip(steps.split(","), numbers[1:]):  # each step adds the next number to the running sum
            assert step == f"{running}+{number}={running + number}"
            running += number
        assert int(answer) == running == sum(numbers)
        assert score(pad, row.answer, "sums").correct
        assert len(pad) + 1 <= MIN_NEW_TOKENS["sums"]  # one token per character, plus EOS
    assert min(lengths.values()) > 0.45 * len(train + test)  # about as many of each
    longest = max(len(sums_scratchpad([int(n) for n in r.question[3:-1].split("+")])) for r in train)
    assert longest + 1 == MIN_NEW_TOKENS["sums"]  # the limit is what the task needs, not more


def test_sample_batch_walks_seeded_epochs():
    seen = [i for step in range(5) for i in sample_batch(10, step, 4, seed=3)]  # 20 draws = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # each epoch has its own order
    assert sample_batch(10, 2, 4, seed=3) == seen[8:12]  # a pure function of the step: resumable
    assert sample_batch(10, 0, 4, seed=4) != seen[:4]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_local_files(tmp_path):
    import pandas

    records = [{"q": "1+1?", "a": 2}, {"q": "2+2?", "a": "4"}]
    expected = [Row("1+1?", "2"), Row("2+2?", "4")]
    jsonl = _write(tmp_path / "t.jsonl", records)
    (tmp_path / "t.json").write_text(json.dumps(records))
    pandas.DataFrame(records).astype(str).to_parquet(tmp_path / "t.parquet")
    for path in (jsonl, str(tmp_path / "t.json"), str(tmp_path / "t.parquet")):
        assert load_task(path, "train", question_column="q", answer_column="a") == expected


def test_bad_task_inputs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        load_task("gsm9k", "train")
    with pytest.raises(ValueError, match="split must be"):
        load_task("arith", "validation")
    with pytest.raises(ValueError, match="missing.jsonl"):
        load_task(str(tmp_path / "missing.jsonl"), "train")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_task(str(empty), "train")
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"question": "1+1", "answer": "2"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2:2: not a JSON record"):
        load_task(str(malformed), "train")
    wrong_columns = _write(tmp_path / "cols.jsonl", [{"problem": "1+1", "solution": "2"}])
    with pytest.raises(ValueError, match=r"no column\(s\) \['question', 'answer'\].*'problem', 'solution'"):
        load_task(wrong_columns, "train")
    blank_answer = _write(
        tmp_path / "blank.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "x", "answer": " "}]
    )
    with pytest.raises(ValueError, match=r"row 1 has an empty question or answer \(its answer; rows count from 0\)"):
        load_task(blank_answer, "train")


def test_bad_text_in_a_data_file_is_named_by_line_or_row(tmp_path, capsys):
    """Each was a raw traceback from pyarrow or the tokenizer, or a gold answer no completion could match (a rounded
    integer is warned of: a float's value cannot tell whether the file held it exactly)."""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(BadInput, match=rf"{latin1}:2: not UTF-8 text \(byte 18 of the line is 0xe9\)"):
        load_task(str(latin1), "train")
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"question": "1+1", "answer": "2"}\n{"question": "x\\udc80", "answer": "1"}\n')
    with pytest.raises(BadInput, match=rf"{surrogate}:2: a lone surrogate escape"):
        load_task(str(surrogate), "train")
    # a parquet binary column: the gold answer was "b'42'", and every reward 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    binary = str(tmp_path / "binary.parquet")
    pq.write_table(pa.table({"question": ["6*7?"], "answer": pa.array([b"42"], pa.binary())}), binary)
    with pytest.raises(BadInput, match="row 0's answer is a bytes, not text"):
        load_task(binary, "train")
    # a column of integers and decimals is read as floats: 12345678901234567 became the gold 12345678901234568
    half = {"question": "b", "answer": 0.5}
    mixed = _write(tmp_path / "mixed.jsonl", [{"question": "a", "answer": 12345678901234567}, half])
    assert load_task(mixed, "train")[0].answer == "12345678901234568"  # said (a float 1e16 is exact: not refused)
    assert f"warning: task file {mixed}: 1 answers (row 0 first: 12345678901234568) were read as floats past" in (
        capsys.readouterr().err
    )
    exact = _write(tmp_path / "exact.jsonl", [{"question": "a", "answer": 4503599627370495}, half])
    exact_gold = load_task(exact, "train")[0].answer  # below 2^53: exact as a float
    assert scoring.answers_match("4503599627370495", exact_gold, numbers_only=True)


HUB_RECORDS = {  # one row shaped like each public dataset
    "gsm8k": ({"question": "How many?", "answer": "2 + 2 = 4\n#### 1,204"}, "How many?", "1204"),
    "math": ({"problem": "Half?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}, "Half?", "\\frac{1}{2}"),
    "math500": ({"problem": "P", "answer": "\\sqrt{2}"}, "P", "\\sqrt{2}"),
    "dapo_math": (
        {
            "prompt": [{"role": "user", "content": tasks._DAPO_HEADER + "Find x." + tasks._DAPO_FOOTER}],
            "reward_model": {"ground_truth": "34", "style": "rule"},
        },
        "Find x.",
        "34",
    ),
    "aime24": ({"problem": "A", "answer": 204}, "A", "204"),
    "aime25": ({"problem": "B", "answer": "70"}, "B", "70"),
}


@pytest.mark.parametrize("name", sorted(HUB_TASKS))
def test_hub_tasks_read_the_right_dataset_split_and_columns(name, monkeypatch):
    import datasets

    record, question, answer = HUB_RECORDS[name]
    spec = HUB_TASKS[name]
    split = "test" if "test" in spec.splits else "train"
    calls = []

    def fake_load_dataset(dataset_id, config, split):
        calls.append((dataset_id, config, split))
        return datasets.Dataset.from_list([record])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_task(name, split) == [Row(question, answer)]
    assert calls == [(spec.dataset_id, spec.config, spec.splits[split])]


def test_hub_task_errors(monkeypatch):
    import datasets

    with pytest.raises(ValueError, match="'dapo_math' has no 'test' split"):
        load_task("dapo_math", "test")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list([{"q": "x"}]))
    with pytest.raises(ValueError, match=r"dataset openai/gsm8k has no column\(s\) \['question', 'answer'\]"):
        load_task("gsm8k", "train")

    solutions = [{"problem": "P", "solution": "so $\\boxed 2$."}, {"problem": "Q", "solution": "no box"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(solutions[:1]))
    assert load_task("math", "train") == [Row("P", "2")]  # TeX's one-token argument, as in some MATH solutions
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(solutions))
    with pytest.raises(BadInput, match="no .boxed.. answer in a MATH solution: 'no box'"):  # not a traceback
        load_task("math", "train")

    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="could not load task 'gsm8k' .*hub unreachable"):
        load_task("gsm8k", "train")


# --- prompts ----------------------------------------------------------------------------------


def test_prompt_formatting(tiny):
    _, tokenizer = tiny
    assert format_prompt("Q: 1+2=", tokenizer, "arith") == "Q: 1+2="
    assert format_prompt("What is 2+2?", tokenizer, "gsm8k").startswith("Question: What is 2+2?\n")

    class ChatTokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + messages[0]["content"] + "<assistant>"

    chat = format_prompt("What is 2+2?", ChatTokenizer(), "gsm8k")
    assert chat.startswith("<user>What is 2+2?") and "\\boxed{}" in chat and chat.endswith("<assistant>")
    assert format_prompt("What is 2+2?", ChatTokenizer(), "gsm8k", use_chat_template=False).startswith("Question:")


def test_a_pathological_answer_cannot_hang_training(monkeypatch):
    """`1E55910418` (sampled by the tiny model once) sends sympy into minutes of C code that
    math-verify's signal timeout cannot interrupt; the worker is killed at the deadline instead."""
    import time

    monkeypatch.setattr(scoring, "VERIFY_DEADLINE_SECONDS", 3.0)
    # start the math-verify worker outside the timed part (plain numbers are compared without it)
    assert check_answer("\\boxed{\\frac{1}{2}}", "0.5").correct
    start = time.time()
    assert check_answer("\\boxed{1E55910418}", "134") == Score(correct=False, found=True)
    assert time.time() - start < 8
    monkeypatch.setattr(scoring, "VERIFY_DEADLINE_SECONDS", 10.0)  # a cold worker start is not what is tested
    assert check_answer("\\boxed{\\frac{1}{4}}", "0.25").correct  # a fresh worker took over
    assert score("1E55910418", "134", "arith").reward == 0.0  # the built-in task never calls math-verify
