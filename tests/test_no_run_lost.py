"""No run lost: a run stopped at a drawn moment, by a signal or an error, resumes as if it had never stopped
(tests/fault_injection.py: a few of its trials here; `python tests/fault_injection.py soak` runs hundreds), and what
a start or a resume refuses deletes nothing."""

import os
import pickle
import signal

import pytest
import torch
from fault_injection import draw, run_trial
from helpers import one_process, run_script

from common import checks
from common.errors import BadInput

# trials of the soak's seed 0, chosen for their spread: an error in a task file's score() (its answers compared by
# math-verify in a helper of the task file's helper) at step 2, seen to fail ("lost") with the error's save removed;
# SIGTERM to the group during an update at lag 2, --save-every 2, seen to fail with the stop's save removed; SIGTERM
# inside a checkpoint's write with LoRA and a task file at lag 2; --overlap-rollouts: an error in a rollout on the
# sampler's thread (GTPO, LoRA, lag 2: sampled again, the run goes on, equal to the run without it), SIGTERM during a
# scoring on the sampler's thread (lag 1) (SIGKILL and the other moments: the soak)
CI_TRIALS = [44, 31, 41, 64, 156]


@pytest.mark.slow
@pytest.mark.parametrize("number", CI_TRIALS)
def test_a_run_stopped_at_a_drawn_moment_resumes_as_if_never_stopped(number, tmp_path):
    record = run_trial(draw(0, number), str(tmp_path))
    assert record["fired"], record  # each of these moments comes
    assert record["outcome"] == "ok", record


def test_a_resume_keeps_the_runs_length_and_cadences_unless_given():
    """A resume with the flags a refusal lists (and no others) once switched a 12-step run to the defaults: 60 steps,
    --save-every 50, and on a finished run the keep-2 rotation deleted its final checkpoint."""
    saved = {"steps": 12, "save_every": 1, "eval_every": 2, "keep_checkpoints": 0, "lr": 1e-4, "output_dir": "a"}
    defaults = {"steps": 60, "save_every": 50, "eval_every": 10, "keep_checkpoints": 2, "lr": 1e-4, "output_dir": "r"}
    settings = dict(defaults, output_dir="b")
    kept = checks.kept_from_the_run(settings, saved, defaults, ["--resume", "x", "--eval-every=4"])
    assert kept == {"steps": 12, "save_every": 1, "keep_checkpoints": 0}  # --eval-every given (as its default or not)
    settings["steps"] = 20  # set otherwise than its default: given
    assert "steps" not in checks.kept_from_the_run(settings, saved, defaults, [])


def test_a_resume_that_changes_a_flag_it_may_change_says_so():
    """--micro-batch-size may change on a resume (memory alone, except in P3O's --ess-scope micro-batch, whose loss
    reads it): never silently."""
    from common.checkpoint import changed_on_resume

    saved = {"micro_batch_size": 8, "steps": 12, "lr": 1e-4, "resume": None, "model": "tiny"}
    settings = dict(saved, micro_batch_size=4, resume="x", model="/models/tiny")
    assert changed_on_resume(settings, saved) == ["--micro-batch-size 4 (the run: 8)"]
    assert changed_on_resume(saved, saved) == []


def test_a_checkpoint_that_lacks_a_file_its_run_wrote_is_damaged(tmp_path):
    """A deleted rng_rank0.pt or rollouts_rank0.pt went unnoticed: the resume exited 0 and differed from the run."""
    from test_flags import _saved_run

    _saved_run(str(tmp_path), [1])
    checkpoint = tmp_path / "checkpoints" / "step_00000001"
    checks.check_checkpoint_files(str(checkpoint))
    (checkpoint / "rng_rank0.pt").unlink()
    with pytest.raises(BadInput, match="rng_rank0.pt is damaged or incomplete .missing: the run wrote it"):
        checks.check_checkpoint_files(str(checkpoint))


def test_a_run_belongs_to_its_script(tmp_path, capsys):
    """A sweep over scripts that shares --exp-name resumed one script's run with another; a resume by path of another
    script's run was accepted."""
    from common.checkpoint import open_run_folder, release_run_folder

    settings = {"lr": 1e-4, "steps": 10, "resume": None}
    folder, _ = open_run_folder(str(tmp_path), None, "arith__sweep__1", settings, one_process(), script="grpo.py")
    step = os.path.join(folder, "checkpoints", "step_00000002")
    os.makedirs(step)
    torch.save({"args": settings}, os.path.join(step, "trainer_state.pt"))
    release_run_folder(folder)
    with pytest.raises(BadInput, match=f"{folder} is a run of grpo.py, not of p3o.py: resume it with grpo.py"):
        open_run_folder(str(tmp_path), folder, "arith__sweep__1", settings, one_process(), script="p3o.py")
    auto = dict(settings, resume="auto")
    other, checkpoint = open_run_folder(str(tmp_path), "auto", "arith__sweep__1", auto, one_process(), script="p3o.py")
    release_run_folder(other)
    assert checkpoint is None and other != folder
    assert f"{folder}, differs: made by grpo.py, not p3o.py: a new run starts" in capsys.readouterr().err


def test_a_process_that_runs_main_twice_resumes_its_own_run(tmp_path):
    """A notebook or a sweep driver: the run folder's lock was never released in the process ("in use by process
    <its own pid>"), one descriptor leaked per call."""
    from common.checkpoint import _LOCKS, _lock, open_run_folder, release_run_folder

    folder, _ = open_run_folder(str(tmp_path), None, "arith__grpo__1", {}, one_process())
    _lock(folder)  # a main() that raised left its lock: this process takes it over
    assert len([f for f in _LOCKS if f == os.path.realpath(folder)]) == 1
    open(os.path.join(folder, "metrics.jsonl"), "w").close()  # a run that trained: kept at its release
    release_run_folder(folder)
    assert os.path.realpath(folder) not in _LOCKS and os.path.isdir(folder)
    _lock(folder)
    release_run_folder(folder)


def test_a_queued_batch_keeps_no_object_of_a_task_files_classes():
    """At --rollout-lag >= 1 the queue's rows were pickled whole: a row holding an object of the task file's own
    class could not be loaded from another path ("rollouts_rank0.pt is damaged")."""
    from common.flags import Systems
    from common.rollouts import Groups, Queued, RolloutQueue
    from common.tasks import Row

    queue = RolloutQueue(Systems(rollout_lag=1), one_process(), 0)
    row = Row("Q: 1+1=", "2", {"question": "Q: 1+1=", "check": lambda text: text})  # unpicklable, as a class may be
    queue.queued.append(Queued(1, 0, Groups([[1]], [row], [], [], torch.zeros(1, 1), [])))
    saved = pickle.loads(pickle.dumps(queue.state()))
    assert saved["queued"][0].groups.rows == [Row("Q: 1+1=", "2")] and queue.queued[0].groups.rows[0].data


def test_a_lag_beyond_what_a_run_can_hold_is_refused():
    """--rollout-lag 1000000 was accepted: step 0 samples every batch up to the lag before it trains (1 GB and
    growing), and its SIGTERM promised a checkpoint that never came."""
    from algorithms.grpo import Args
    from common.flags import make

    problems = checks.shared_flags(make(Args, rollout_lag=1_000_000))
    assert any(p.startswith("--rollout-lag must be in [0, 64]") for p in problems), problems
    assert not checks.shared_flags(make(Args, rollout_lag=64))


def test_a_second_signal_before_the_first_checkpoint_says_what_is_lost(tmp_path, capfd):
    from common.stopping import StopSignals

    stop = StopSignals(str(tmp_path))
    try:
        stop._handle(signal.SIGINT, None)
        with pytest.raises(SystemExit):
            stop._handle(signal.SIGINT, None)
        said = capfd.readouterr().err
        assert "the run had no checkpoint yet: its steps are lost" in said and "--save-every N" in said
    finally:
        stop.received = None
        stop.finish(one_process())


@pytest.mark.slow
def test_a_refused_resume_deletes_nothing_and_a_refused_start_leaves_no_folder(tmp_path):
    """--resume <run>/checkpoints/step_2 of a run with steps 3 and 4, after a row was appended to its task file, said
    "the run's later checkpoints (step_00000003, step_00000004) are dropped", then refused the rows: steps 3-4 were
    gone. And a start refused after its folder was made (an adapter rank larger than the model) left the folder."""
    task = tmp_path / "sums.jsonl"
    rows = [f'{{"question": "Q: {a}+{b}=", "answer": "{a + b}"}}\n' for a in range(10) for b in range(4)]
    task.write_text("".join(rows))
    flags = ["--task", task, "--steps", 4, "--prompts-per-step", 4, "--group-size", 2, "--eval-every", 0]
    flags += ["--save-every", 1, "--keep-checkpoints", 0, "--output-dir", tmp_path / "runs"]
    run_script("algorithms/grpo.py", *flags)
    (run,) = os.listdir(tmp_path / "runs")
    checkpoints = tmp_path / "runs" / run / "checkpoints"
    before = sorted(os.listdir(checkpoints))
    task.write_text("".join(rows) + '{"question": "Q: 9+9=", "answer": "18"}\n')
    refused = run_script(
        "algorithms/grpo.py", *flags, "--resume", checkpoints / "step_00000002", check=False
    )  # fmt: skip
    assert refused.returncode == 2 and "the run started on other training rows" in refused.stderr, refused.stderr
    assert sorted(os.listdir(checkpoints)) == before == [f"step_0000000{i}" for i in (1, 2, 3, 4)]
    start = run_script("algorithms/grpo.py", *flags[:-2], "--output-dir", tmp_path / "new", "--lora-rank", 100_000,
                       check=False)  # fmt: skip
    assert start.returncode != 0 and not os.listdir(tmp_path / "new"), start.stderr[-2000:]
