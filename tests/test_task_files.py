"""A task is a file the user writes (common/task_files.py): the README's example, clear errors for a broken file,
and a score that runs in a worker process under a deadline. Every script trains on the README's example in
test_scripts.py (test_dapo_rollout_flags_end_to_end)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO, run_script

from common import task_files
from common.engines import Completion, HFEngine
from common.errors import BadInput
from common.evaluate import evaluate
from common.processes import Helper
from common.scoring import score, score_completions
from common.tasks import arith_rows, encode_prompt, format_prompt, load_task, load_train_and_eval


def write(tmp_path, source, name="task.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


ADDITION = textwrap.dedent("""
    def rows(split):
        return [{"question": f"Q: {a}+{a}=", "sum": 2 * a} for a in range(10 if split == "train" else 3)]


    def score(completion, row):
        return float(completion.strip() == str(row["sum"]))
""")


def completions_of(tokenizer, texts):
    return [Completion(tokenizer(t, add_special_tokens=False)["input_ids"], [0.0] * len(t), "stop") for t in texts]


def test_the_readme_example_is_the_built_in_task_and_scores_like_it(readme_task_file, tiny):
    _, tokenizer = tiny
    train, held_out = load_train_and_eval(readme_task_file, None, verbose=False)
    assert [r.question for r in held_out] == [r.question for r in arith_rows("test")]
    assert len(train) == 9500 and not {r.question for r in train} & {r.question for r in held_out}
    row, gold = held_out[0], str(held_out[0].data["sum"])
    texts = [gold, str(int(gold) + 1), "", "x7", " " + gold]
    scores = score_completions(completions_of(tokenizer, texts), [row], len(texts), tokenizer, readme_task_file)
    assert [s.reward for s in scores] == [score(t, gold, "arith").reward for t in texts] == [1, 0, 0, 0, 1]
    assert [s.found for s in scores] == [True, True, False, False, True]  # None: no answer to read


def test_evaluate_scores_a_task_file_as_the_built_in_task(readme_task_file, tiny):
    """Greedy accuracy on the first 32 held-out prompts: the README's file and the built-in `arith` agree."""
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    results = {}
    for task in ("arith", readme_task_file):
        rows = load_task(task, "test")[:32]
        results[task] = evaluate(engine, tokenizer, rows, task=task, k=0, max_new_tokens=6)["eval/greedy_accuracy"]
    assert results[readme_task_file] == results["arith"] > 0


def test_rewards_may_be_numbers_bools_or_none_and_score_never_runs_in_this_process(tmp_path, tiny):
    _, tokenizer = tiny
    path = write(
        tmp_path,
        """
        import os
        from fractions import Fraction

        def rows(split):
            return [{"question": "Q: 1+1=", "parent": 0}]

        def score(completion, row):
            if os.getpid() == row["parent"]:
                raise RuntimeError("scored in the trainer's process")
            return {"a": 0.25, "b": True, "c": None, "d": 2, "e": Fraction(3, 2)}[completion]
        """,
    )
    row = load_task(path, "train")[0]
    row.data["parent"] = os.getpid()
    scores = score_completions(completions_of(tokenizer, "abcde"), [row], 5, tokenizer, path)
    assert [s.reward for s in scores] == [0.25, 1.0, 0.0, 2.0, 1.5]
    assert [s.correct for s in scores] == [False, True, False, True, True]  # correct: a reward of at least 1
    assert [s.found for s in scores] == [True, True, False, True, True]


def test_a_score_may_start_processes_of_its_own(tmp_path, tiny):
    """The worker is not a daemon (a daemon may have no children), and what the file's code starts does not inherit
    its deafness to the stop signals: a child ends when its parent terminates it (forked or spawned), and
    common.scoring's answers_match works (its math-verify runs in a process of its own)."""
    _, tokenizer = tiny
    path = write(
        tmp_path,
        """
        import multiprocessing
        import signal
        import time
        from common.scoring import answers_match
        SCORE_SECONDS = 600  # the first score starts math-verify's process: minutes on a machine busy with tests

        def rows(split):
            return [{"question": "Q: half=", "gold": "0.5"}]

        def score(completion, row):
            ended = []
            for method in ("fork", "spawn"):
                child = multiprocessing.get_context(method).Process(target=time.sleep, args=(600,))
                child.start()
                child.terminate()
                child.join(30)
                ended.append(child.exitcode == -signal.SIGTERM)
                child.kill()  # (a child that ignored it)
            return float(all(ended) and answers_match(completion, row["gold"]))
        """,
    )
    rows = load_task(path, "train")
    texts = ["\\frac{1}{2}", "\\frac{1}{3}", "1/2"]
    scores = score_completions(completions_of(tokenizer, texts), rows, 3, tokenizer, path)
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0]


def _hanging_task(tmp_path, pids, seconds):
    """A task file whose score starts a program (`sleep 600`), writes "<worker pid> <program pid>" to `pids`, and
    hangs; SCORE_SECONDS = `seconds`."""
    return write(
        tmp_path,
        f"""
        import os, subprocess, time
        SCORE_SECONDS = {seconds}

        def rows(split):
            return [{{"question": "Q: 1+1="}}]

        def score(completion, row):
            program = subprocess.Popen(["sleep", "600"])
            open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{program.pid}}")
            time.sleep(600)
        """,
    )


def _left_running(pids, seconds=30):
    """The processes of `pids` still running after up to `seconds` (killed, so that none outlives the test)."""
    deadline = time.time() + seconds
    while any(map(_running, pids)) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_a_score_past_its_deadline_is_killed_with_the_processes_it_started(tmp_path, tiny):
    """A worker is killed with its session's group: a program its score (or a tool) started is not left running."""
    _, tokenizer = tiny
    pids = tmp_path / "pids.txt"
    path = _hanging_task(tmp_path, pids, 2)
    rows = load_task(path, "train")
    assert [s.reward for s in score_completions(completions_of(tokenizer, ["2"]), rows, 1, tokenizer, path)] == [0.0]
    assert not _left_running([int(pids.read_text().split()[1])])


def test_a_row_may_hold_an_instance_of_a_class_the_file_defines(tmp_path, tiny):
    """Rows go to the worker pickled, and pickle finds a class by its module's name: the file is registered under
    it (here a dataclass too, which looks its module up while it is defined)."""
    _, tokenizer = tiny
    path = write(
        tmp_path,
        """
        from dataclasses import dataclass

        @dataclass
        class Case:
            answer: int

        def rows(split):
            return [{"question": "Q: 1+1=", "case": Case(2)}]

        def score(completion, row):
            return float(completion == str(row["case"].answer))
        """,
    )
    (tmp_path / "other").mkdir()
    other = write(tmp_path, open(path).read().replace("Case(2)", "Case(3)"), "other/task.py")  # a second task.py
    rows = {task: load_task(task, "train") for task in (path, other)}  # both imported before either scores
    for task, rewards in ((path, [1.0, 0.0]), (other, [0.0, 1.0])):
        scores = score_completions(completions_of(tokenizer, ["2", "3"]), rows[task], 2, tokenizer, task)
        assert [s.reward for s in scores] == rewards


def test_a_worker_whose_trainer_was_killed_outright_ends_with_what_it_started(tmp_path):
    """SIGKILL (the OOM killer, a crash) runs no exit handler of the trainer: the worker, whose score hangs, sees its
    trainer gone and kills its session, the program its score started with it; it ran on at full CPU before."""
    pids = tmp_path / "pids.txt"
    path = _hanging_task(tmp_path, pids, 600)
    scoring = f"from common import task_files as t; task = t.load_task_file({path!r}); t.score_all(task, ['2'], "
    trainer = subprocess.Popen([sys.executable, "-c", scoring + "task.rows('train'))"], cwd=REPO)
    deadline = time.time() + 120
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.time() < deadline:
        time.sleep(0.1)
    worker, program = map(int, pids.read_text().split())
    trainer.kill()
    trainer.wait()
    assert not _left_running([worker, program])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended (its reaper may be slow)
    except FileNotFoundError:
        return False


def test_a_score_that_hangs_gets_reward_zero_and_the_others_are_still_scored(tmp_path, tiny, capsys):
    _, tokenizer = tiny
    path = write(
        tmp_path,
        """
        import time
        SCORE_SECONDS = 2

        def rows(split):
            return [{"question": "Q: 1+1="}]

        def score(completion, row):
            if completion == "9":
                time.sleep(600)  # C code or a loop that signals cannot stop: only killing the worker does
            return float(completion == "2")
        """,
    )
    rows = load_task(path, "train")
    score_completions(completions_of(tokenizer, ["2"]), rows, 1, tokenizer, path)  # start the worker first
    start = time.time()
    scores = score_completions(completions_of(tokenizer, ["2", "9", "2", "3"]), rows, 4, tokenizer, path)
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0, 0.0] and not scores[1].found
    assert time.time() - start < 30  # 2 s, and a new worker (spawned: a fresh interpreter)
    assert "score() ran past 2 s" in capsys.readouterr().err


def test_the_worker_takes_no_stop_signal_and_one_that_ended_while_idle_is_replaced(tmp_path, tiny, capsys):
    """Ctrl-C, a closed terminal and a scheduler's SIGTERM reach every process of the group: the worker ignores them,
    and the trainer decides when the run stops (after scoring the step under way). A worker that ended between two
    jobs (the out-of-memory killer) is replaced, with a warning."""
    _, tokenizer = tiny
    path = write(tmp_path, ADDITION)
    row = load_task(path, "train")[1]  # Q: 1+1=

    def rewards():
        return [s.reward for s in score_completions(completions_of(tokenizer, ["2", "3"]), [row], 2, tokenizer, path)]

    assert rewards() == [1.0, 0.0]
    worker = task_files._WORKERS[path]
    assert os.getsid(worker.process.pid) != os.getsid(0)  # a session of its own: neither the terminal's nor ours
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(worker.process.pid, number)
    time.sleep(1)
    assert worker.process.is_alive() and rewards() == [1.0, 0.0] and task_files._WORKERS[path] is worker
    worker.process.kill()
    worker.process.join(5)
    assert rewards() == [1.0, 0.0] and task_files._WORKERS[path] is not worker
    assert "ended while idle (its process was killed by SIGKILL): a new one takes over" in capsys.readouterr().err
    starting = Helper(task_files._serve, path)  # a Ctrl-C while it imports (torch, the file) is not fatal either
    os.kill(starting.process.pid, signal.SIGINT)
    assert task_files._ask(starting, ("load", None, None), 60) == ("value", None)
    starting.stop()


@pytest.mark.parametrize(
    "source, message",
    [
        ("def rows(split):\n    return []\n", "defines no function score(completion, row)"),
        ("score = 1\ndef rows(split):\n    return []\n", "defines no function score(completion, row)"),
        ("def score(completion, row):\n    return 1\n", "defines no function rows(split)"),
        ("def rows(split:\n", "could not be imported: SyntaxError"),
        ("import no_such_module\n", "could not be imported: ModuleNotFoundError"),
        (ADDITION.replace("range(10", "range(1 // 0 +10"), "rows('train') raised ZeroDivisionError"),
        (ADDITION.replace("range(10 if", "range(0 if"), "rows('train') returned no rows"),
        (ADDITION.replace('"question"', '"prompt"'), "rows('train')[0] has no \"question\""),
        (ADDITION.replace('"question": f"Q: {a}+{a}="', '"question": " "'), 'has no "question"'),
        (ADDITION.replace("return [", "return 7 or ["), "rows('train') returned a int, not a list of dicts"),
        (ADDITION.replace("return [", "return [5] or ["), "rows('train')[0] is a int, not a dict"),
        (ADDITION + "SYSTEM_PROMPT = 3\n", "SYSTEM_PROMPT is a int, not a string"),
        (ADDITION + "SCORE_SECONDS = 0\n", "SCORE_SECONDS must be a positive number"),
        (ADDITION.replace("return [", "return __import__('pandas').DataFrame([").replace("3)]", "3)])"), "a DataFrame"),
        # rows go to the worker pickled: was an AttributeError at the first score, after the model had loaded
        (
            ADDITION.replace('"sum": 2 * a}', '"sum": 2 * a, "check": lambda text: text}'),
            "rows('train')[0]['check'] cannot be sent to the scoring process (",
        ),
        # was a TypeError from the tokenizer
        (ADDITION.replace('f"Q: {a}+{a}="', 'f"Q: {a}+{a}=\\udc80"'), '["question"] holds a lone surrogate'),
    ],
)
def test_a_broken_task_file_is_named_with_its_function(tmp_path, source, message):
    path = write(tmp_path, textwrap.dedent(source), name=f"broken_{abs(hash(source))}.py")
    with pytest.raises(BadInput) as error:
        load_task(path, "train")
    assert path in str(error.value) and message in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "body, message",
    [
        ("return 1 / 0", "score(completion, row) raised ZeroDivisionError: division by zero"),
        ("return row['missing']", "score(completion, row) raised KeyError: 'missing'"),
        ('return "1.0"', "score(completion, row) returned '1.0' (str)"),
        ("return [1.0]", "score(completion, row) returned [1.0] (list)"),
        ("return float('nan')", "score(completion, row) returned nan"),
        ("return 10**400", "returned an integer of 1329 bits on row"),  # float() would overflow
        ("return -1e308", "returned -1e+308 on row"),  # finite, but a group's std would not be
    ],
)
def test_a_score_that_raises_or_is_not_a_number_is_named(tmp_path, tiny, body, message):
    _, tokenizer = tiny
    path = write(tmp_path, ADDITION.replace('return float(completion.strip() == str(row["sum"]))', body))
    rows = load_task(path, "train")
    with pytest.raises(BadInput) as error:
        score_completions(completions_of(tokenizer, ["0"]), rows, 1, tokenizer, path)
    assert path in str(error.value) and message in str(error.value) and "on row {'question'" in str(error.value)


def test_a_script_names_a_broken_task_file_in_one_line(tmp_path):
    path = write(tmp_path, "def rows(split):\n    return []\n")
    result = run_script("algorithms/grpo.py", "--task", path, "--output-dir", tmp_path / "runs", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {path} defines no function score(completion, row) (a task file needs rows(split) and "
        "score(completion, row))"
    )


def test_the_prompt_is_the_question_inside_the_chat_template_after_the_system_prompt(tmp_path, tiny):
    _, tokenizer = tiny
    plain = write(tmp_path, ADDITION, "plain.py")
    system = write(tmp_path, ADDITION + "SYSTEM_PROMPT = 'Add.'\n", "system.py")

    class ChatTokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    assert format_prompt("Q: 1+1=", tokenizer, plain) == "Q: 1+1="  # no chat template: verbatim
    assert encode_prompt("Q: 1+1=", tokenizer, plain) == encode_prompt("Q: 1+1=", tokenizer, "arith")
    assert format_prompt("Q: 1+1=", ChatTokenizer(), plain) == "<user>Q: 1+1=<assistant>"
    assert format_prompt("Q: 1+1=", ChatTokenizer(), system) == "<system>Add.<user>Q: 1+1=<assistant>"
    assert format_prompt("Q: 1+1=", ChatTokenizer(), system, use_chat_template=False) == "Q: 1+1="


def test_a_task_file_is_imported_once_per_process(tmp_path):
    counter = tmp_path / "imports"
    path = write(tmp_path, ADDITION + f"open({str(counter)!r}, 'a').write('.')\n", "once.py")
    load_task(path, "train"), load_task(path, "test")
    assert counter.read_text() == "."
