"""The processes a run starts, each started one way, so that none dies of a stop signal meant for the trainer and
none outlives it.

    helper = Helper(serve, path)          # serve(connection, path) in a spawned Python process
    answer = helper.ask(job, seconds)     # what serve sent back for `job`; None past `seconds`; HelperEnded if it died
    helper.send(job); ...; helper.answer(seconds)   # the same, with more messages for the job between
    helper.stop()                         # killed with every process its code started, a bounded wait

    process = start_program(argv, cwd, env, log)   # a program (a bench's training run)
    stop_programs([process], seconds)              # one SIGTERM: it checkpoints and stops; SIGKILL past `seconds`

A helper (the math-verify worker of common/scoring.py, a task file's worker of common/task_files.py, the vLLM
engine of common/engines.py) has its own
session: the terminal's Ctrl-C and hang-up and a signal to the trainer's process group (torchrun's agent, `scancel`,
`kill -- -PGID`) do not reach it. It ignores the stop signals (STOP_SIGNALS, those common/stopping.py stops a run on)
from its first instruction, so the trainer, which decides when a run stops, can finish the step under way with it.
It is killed by its session's id, never through a lock it may hold (a multiprocessing pool's terminate() waits on
its queue's lock forever when a worker died holding it), on a deadline, at exit, and when its parent goes: a trainer
killed outright (SIGKILL, the out-of-memory killer) cannot stop it, so it watches its parent and kills its own
session once the parent is gone.

A program (a bench's run of a script) is a trainer itself: it has its own session too, so that the terminal's Ctrl-C
reaches only the program that started it, which then sends one SIGTERM to each run (each finishes its step, saves
it and stops) and waits a bounded time; and the system sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.util  # its exit handler registered before ours (_stop_all), so ours runs first
import os
import signal
import subprocess
import threading
import time

# the signals a run stops on: an interrupt (Ctrl-C), a scheduler's or torchrun's termination (preemption), a closed
# terminal or dropped ssh connection
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def deaf_to_stop_signals():
    """A process started inside ignores the stop signals from its first instruction: an ignored signal stays ignored
    across fork and exec (and Python then installs no KeyboardInterrupt handler), so a Ctrl-C while a helper imports
    torch is not fatal to it. This process only holds them back meanwhile: blocked, a signal stays pending even where
    it is ignored (Linux), and its handler receives it at the end."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's to change
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    handlers = {number: signal.signal(number, signal.SIG_IGN) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def take_no_stop_signal() -> None:
    """In a helper process (common/processes.py): a stop signal does nothing. A handler that does nothing, not
    SIG_IGN, which a process the helper's code starts would inherit: a forked child takes the default actions back
    (a pool's terminate() sends SIGTERM), and a stop signal sent before it could waits, held, until then."""
    for number in STOP_SIGNALS:
        signal.signal(number, _no_action)
    os.register_at_fork(before=_hold, after_in_parent=_release, after_in_child=_default_actions)
    _release()  # held by the parent while it started this process, and inherited


def _no_action(number, frame) -> None:
    pass


def _hold() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _release() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _default_actions() -> None:
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    _release()


STOP_SECONDS = 5.0  # how long a killed helper is waited for (SIGKILL cannot be refused; this bounds a zombie's reap)


class HelperEnded(Exception):
    """The helper's process ended during a job (os._exit, a crash, the out-of-memory killer, a kill)."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class Helper:
    """A spawned Python process that runs `serve(connection, *args)`: it receives jobs on `connection` and sends one
    answer for each (the module docstring says how it is started and ended)."""

    def __init__(self, serve, *args, environment: dict[str, str | None] | None = None):
        """`environment`: variables the helper's process starts with changed (None: removed), as it must for what
        a process reads once, when it starts (CUDA_VISIBLE_DEVICES)."""
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        # not a daemon: its code may start processes of its own (a pool, math-verify's helper), which a daemon may
        # not; _stop_all ends it at exit all the same
        self.process = context.Process(target=_helper_main, args=(child, os.getpid(), serve, args))
        with deaf_to_stop_signals(), _changed_environment(environment or {}):
            self.process.start()
        _STARTED[:] = [h for h in _STARTED if h.process.is_alive()] + [self]
        child.close()

    def ask(self, job, seconds: float | None):
        """What the helper answers to `job`, or None when it does not answer within `seconds` (the caller stops it;
        None: no limit); HelperEnded when its process ended meanwhile."""
        self.send(job)
        return self.answer(seconds)

    def send(self, message) -> None:
        """Send the helper a job, or a message its job reads (HelperEnded when its process has ended)."""
        try:
            self.connection.send(message)
        except OSError:  # ended before the message was sent (BrokenPipeError)
            raise HelperEnded(self._how_it_ended()) from None

    def answer(self, seconds: float | None):
        """The helper's answer to the job sent last (`ask`)."""
        from multiprocessing.connection import wait

        if not wait([self.connection, self.process.sentinel], seconds):
            return None
        try:
            return self.connection.recv()
        except (EOFError, OSError):  # ended without an answer
            raise HelperEnded(self._how_it_ended()) from None

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        """Kill the helper and every process its code started (its session), and reap it within STOP_SECONDS."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # no session yet: it is still starting
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.join(STOP_SECONDS)
        self.connection.close()

    def _how_it_ended(self) -> str:
        self.process.join(STOP_SECONDS)
        return how_it_ended(self.process.exitcode)


@contextlib.contextmanager
def _changed_environment(changes: dict[str, str | None]):
    """This process's environment with `changes` while a process is started (spawn copies it), then as it was."""
    before = {name: os.environ.get(name) for name in changes}

    def apply(values):
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    apply(changes)
    try:
        yield
    finally:
        apply(before)


def how_it_ended(exitcode: int | None) -> str:
    """A process's exit code in words: "its process was killed by SIGKILL", "... ended with exit code 1"."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"its process was killed by {signal.Signals(-exitcode).name}"
    return f"its process ended with exit code {exitcode}"


def _helper_main(connection, parent: int, serve, args) -> None:
    """In the helper, from its first instruction (the stop signals were ignored before it started)."""
    os.setsid()  # a session of its own: the terminal's and the trainer's group's signals do not reach it
    threading.Thread(target=_end_with_the_parent, args=(parent,), daemon=True).start()
    take_no_stop_signal()
    serve(connection, *args)


def _end_with_the_parent(parent: int) -> None:
    """In the helper: once its parent is gone (the helper has another parent), its session is killed."""
    while os.getppid() == parent:
        time.sleep(1)
    os.killpg(0, signal.SIGKILL)


_STARTED: list[Helper] = []  # every helper this process started


@atexit.register  # after multiprocessing.util's own exit handler (imported above), so it runs first
def _stop_all() -> None:
    """At exit, each helper is killed: it ignores SIGTERM, and multiprocessing's exit handler would wait for it."""
    for helper in _STARTED:
        if helper.process.is_alive():
            helper.stop()
    _STARTED.clear()


def start_program(argv: list[str], cwd: str, env: dict, log) -> subprocess.Popen:
    """Start a program (a training run) in a session of its own, writing to `log`; SIGTERM reaches it when this
    process dies, however it dies (the run then checkpoints its step and stops)."""
    parent = os.getpid()
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: _terminated_with(parent),
    )  # fmt: skip


def _terminated_with(parent: int) -> None:
    """In the started program, before it runs: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG); a parent
    already gone before this ran gets it at once."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the parent's stop_program is what stops it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def stop_programs(processes: list[subprocess.Popen], seconds: float) -> None:
    """Stop started programs as a stop signal stops a run: one SIGTERM each (each finishes its step, checkpoints it and
    exits), a wait of at most `seconds` for all of them, then SIGKILL to what is left. A Ctrl-C meanwhile sends each a
    second SIGTERM (a run then stops at once, but never inside a checkpoint's write)."""
    for process in processes:
        _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for process in processes:
        while True:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(STOP_SECONDS)
                break
            except KeyboardInterrupt:
                for other in processes:
                    _signal(other, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + 60)


def _signal(process: subprocess.Popen, number: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, number)
