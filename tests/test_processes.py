"""The processes a run starts (common/processes.py): none dies of a stop signal meant for the trainer, none outlives
it, none is stopped through a lock it may hold, and a started program stops as a run stops (one SIGTERM)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from helpers import REPO


def _gone(pid: int, seconds: float = 10.0) -> bool:
    """Whether process `pid` has ended (reaped or a zombie of a dead parent, reaped by init) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_a_sigterm_to_the_trainers_group_neither_hangs_scoring_nor_the_exit_and_the_helper_ends_with_it(tmp_path):
    """The preemption case: torchrun's agent or `scancel` sends SIGTERM to the trainer's whole process group while
    math-verify's helper is idle. The helper has a session of its own: it does not receive it, the next non-plain
    answer is scored, a helper that died while idle is replaced, and the trainer exits at once (a multiprocessing
    pool hung here in terminate(), on the queue lock its killed worker held). A trainer killed outright takes its
    helper with it."""
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        from common import scoring
        received = []
        signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))  # as StopSignals does
        if __name__ == "__main__":
            assert scoring.answers_match("\\\\frac{1}{2}", "0.5")
            helper = scoring._VERIFIER
            os.killpg(0, signal.SIGTERM)  # the group: this process, and the helper were it in it
            time.sleep(1)
            assert received == [signal.SIGTERM] and helper.alive()
            assert scoring.answers_match("\\\\frac{1}{3}", "1/3") and scoring._VERIFIER is helper
            os.kill(helper.process.pid, signal.SIGKILL)  # idle, as if it held a lock: it is replaced, not waited on
            time.sleep(1)
            assert scoring.answers_match("\\\\frac{2}{4}", "1/2") and scoring._VERIFIER is not helper
            print(scoring._VERIFIER.process.pid, flush=True)
            if sys.argv[1] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    for ending in ("exit", "kill"):
        start = time.monotonic()
        # a session of its own, so that its killpg(0) does not reach the test runner
        out = subprocess.run(
            [sys.executable, str(script), ending], env=env, capture_output=True, text=True, timeout=300,
            start_new_session=True,
        )  # fmt: skip
        assert out.returncode == (0 if ending == "exit" else -signal.SIGKILL), out.stderr[-3000:]
        assert time.monotonic() - start < 240
        helper = int(out.stdout.split()[-1])
        assert _gone(helper), f"the helper {helper} outlived a trainer that ended by {ending}"


def test_a_stopped_bench_sends_each_run_one_sigterm_and_waits_a_bounded_time(tmp_path):
    """A bench's runs are trainers: Ctrl-C reaches only the bench (each run has its own session), which sends each run
    one SIGTERM (a second would stop it before its checkpoint) and waits; a run that does not end in time is killed.
    A run whose bench died gets SIGTERM from the system."""
    from common.processes import start_program, stop_programs

    run = tmp_path / "run.py"
    run.write_text(
        textwrap.dedent("""
        import signal, sys, time
        received = []
        signal.signal(signal.SIGTERM, lambda n, f: received.append(n))
        signal.signal(signal.SIGINT, lambda n, f: received.append(n))
        print("started", flush=True)
        while not received:
            time.sleep(0.05)
        if sys.argv[1] == "stubborn":
            time.sleep(600)
        time.sleep(1)  # the step and its checkpoint
        print("signals", received, flush=True)
    """)
    )
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("good", "stubborn")]
    runs = [start_program([sys.executable, str(run), name], REPO, dict(os.environ), log) for name, log in
            zip(("good", "stubborn"), logs)]  # fmt: skip
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{n}.log").read_text() for n in ("good", "stubborn")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(os.getsid(r.pid) == r.pid != os.getsid(0) for r in runs)  # sessions of their own
    start = time.monotonic()
    stop_programs(runs, seconds=5)
    assert time.monotonic() - start < 15
    assert runs[0].returncode == 0 and f"signals [{int(signal.SIGTERM)}]" in (tmp_path / "good.log").read_text()
    assert runs[1].returncode == -signal.SIGKILL  # past the deadline

    # the bench itself killed outright: its run gets SIGTERM, saves its step and ends
    bench = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from common.processes import start_program
            run = start_program([sys.executable, {str(run)!r}, "good"], {REPO!r}, dict(os.environ), sys.stdout)
            print(run.pid, flush=True)
            time.sleep(600)
        """)],
        env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(bench.stdout.readline())
    time.sleep(2)
    bench.kill()
    assert _gone(child, 30), "a run outlived its killed bench"
    assert "signals [15]" in bench.stdout.read()


def _environment_of_the_helper(connection, names):
    connection.recv()
    connection.send({name: os.environ.get(name) for name in names})


def test_a_helper_starts_with_the_environment_it_is_given(monkeypatch):
    """Helper(..., environment=): the process starts with those variables set or removed (what CUDA reads once, when
    a process starts: --engine-process's CUDA_VISIBLE_DEVICES; torchrun's RANK, which the engine must not see), and
    the trainer's own environment is as it was."""
    from common.processes import Helper

    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names = ("RANK", "CUDA_VISIBLE_DEVICES")
    helper = Helper(_environment_of_the_helper, names, environment={"RANK": None, "CUDA_VISIBLE_DEVICES": "5"})
    try:
        assert helper.ask("which", 60) == {"RANK": None, "CUDA_VISIBLE_DEVICES": "5"}
    finally:
        helper.stop()
    assert os.environ["RANK"] == "3" and "CUDA_VISIBLE_DEVICES" not in os.environ
