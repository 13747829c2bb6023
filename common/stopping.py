"""How a run stops: the stop signals, handled here and nowhere else.

    stop = StopSignals(run_dir, save)    # in main(), once the run is set up: Ctrl-C, SIGTERM, SIGHUP end the step
    ...                                  # under way, which is checkpointed, then the run
    if stop.requested(dist): ...         # after each step, on every rank (a collective)
    stop.step_ends(step, trainer_state)  # an error in the next step, before its update, saves this one
    stop.finish(dist, steps)             # after the loop: how to resume, exit code 128 + the signal's number

A second signal stops at once, but never inside a checkpoint's write (checkpoint.writing_a_checkpoint finishes the
write first). A run's helper processes (common/processes.py) never take a stop signal: the trainer decides when the
run stops, and they finish the step under way with it. A signal before StopSignals exists (the model loading, the engine
starting) has its default action: nothing has been trained, and nothing of a resumed run has been deleted yet
(common/checkpoint.py deletes a resumed run's later steps only once its set-up has passed).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from common import errors
from common.processes import STOP_SIGNALS

# torchrun's agent forwards each signal it receives to its workers, and a scheduler (SLURM) or a terminal's Ctrl-C
# signals every process, the agent included: each worker gets the same signal twice at once. A repeat within
# REPEAT_SECONDS is that copy, not a second request.
_UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
REPEAT_SECONDS = 2.0


def _say(text: str) -> None:
    """A line on stderr from a signal handler: one write(2) call (print may be mid-write: "reentrant call"), and
    nothing if the terminal is gone."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class StopSignals:
    """Ctrl-C (SIGINT), a scheduler's SIGTERM (preemption) and a closed terminal or dropped ssh connection (SIGHUP)
    during training lose nothing: the step under way finishes, the loop checkpoints it on every rank and ends, and
    `finish` exits with 128 + the signal's number after saying how to resume. A second signal stops at once, with the
    same exit code and no traceback, but never inside a checkpoint's write: that finishes first. After SIGHUP the
    run's output to the terminal goes to /dev/null (writing to a hung-up terminal fails). SIGHUP is left alone where
    it is ignored (nohup). Signals are caught only while training (in the main thread), that is while the function
    that made this object runs: if it raised before `finish`, the next signal finds it gone, restores the handlers
    that were there before and is handled by them (a notebook's or a test runner's Ctrl-C still works). Under
    torchrun a signal on one rank stops every rank after the same step, each exiting with its code; the agent kills
    its workers --shutdown-timeout seconds (30 by default) after forwarding a signal, so a step and its checkpoint
    must fit: rank 0 warns once when a step takes more than half of it, while there is time to restart with more."""

    def __init__(self, run_dir: str, save=None):
        """`save(step, trainer_state=...)`: checkpoint.save_checkpoint with every other argument given (a
        functools.partial), for an error that ends the run (save_finished_steps)."""
        self.run_dir, self.save = run_dir, save
        self.ended = None  # the last step that ended, and what its checkpoint holds (step_ends)
        _RUN["stop"] = self
        self.received = None
        self.when = 0.0  # time.monotonic() of the first signal
        self.previous = {}
        self.owner = sys._getframe(1).f_code  # the function that catches signals (main), while it runs
        self.agent_timeout = _agent_shutdown_timeout() if _UNDER_TORCHRUN else None
        self.last_step_end = None  # time.monotonic() at the last `requested`: once a step
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                if number == signal.SIGHUP and signal.getsignal(number) == signal.SIG_IGN:
                    continue  # nohup: the run was asked to outlive its terminal
                self.previous[number] = signal.signal(number, self._handle)
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = (_SurvivingStream(s) if _has_fd(s) else s for s in self.streams)

    def step_ends(self, step: int, trainer_state: dict) -> None:
        """Step `step` (counted from 1) has ended, and `trainer_state` is what its checkpoint holds besides the
        weights, the optimizer and the RNG. An error that ends the run during the next step, before its first
        optimizer step (a task file's score() that raises, in a rollout), saves it (save_finished_steps), with the
        RNG as it is now: the steps so far are kept, and a resume repeats the failed one exactly."""
        from common.checkpoint import rng_state

        scheduler = self.save.keywords["scheduler"]  # it steps with the optimizer: once it has, the weights changed
        self.ended = {"step": step, "trainer_state": trainer_state, "rng": rng_state(), "updates": scheduler.last_epoch}

    def _handle(self, number, frame):
        if not self._owner_running():  # main() raised: the handlers that were there before take it
            return self._pass_on(number, frame)
        name = signal.Signals(number).name
        if number == signal.SIGHUP:
            _detach_from_terminal()
        if self.received is not None and number == self.received and _UNDER_TORCHRUN:
            if time.monotonic() - self.when < REPEAT_SECONDS:  # the agent's copy of what every process was sent
                return
        if self.received is not None:  # the second one: now, unless a checkpoint is being written
            from common.checkpoint import WRITING

            if WRITING["active"]:
                WRITING["exit"] = number
                _say(f"\n{name} again: the checkpoint being written is finished first, then the run stops")
                return
            _say(f"\n{name} again: stopped now; {_what_a_resume_finds(self.run_dir)}")
            raise SystemExit(128 + number)
        self.received, self.when = number, time.monotonic()
        _say(f"\n{name}: the step under way finishes and is checkpointed, then the run stops ({name} again: now)")

    def _owner_running(self) -> bool:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.owner:
            frame = frame.f_back
        return frame is not None

    def _restore(self) -> None:
        for number, handler in self.previous.items():
            if handler is not None:  # None: a handler set outside Python, which Python cannot set back
                signal.signal(number, handler)
        self.previous = {}
        if isinstance(sys.stdout, _SurvivingStream) or isinstance(sys.stderr, _SurvivingStream):
            sys.stdout, sys.stderr = self.streams

    def _pass_on(self, number, frame) -> None:
        """Restore the handlers, then handle the signal as the one this object replaced would have."""
        handler = self.previous.get(number, signal.SIG_DFL)
        self._restore()
        if callable(handler):
            return handler(number, frame)  # Python's default for SIGINT raises KeyboardInterrupt
        if handler == signal.SIG_DFL:
            os.kill(os.getpid(), number)  # the default action (ends the process), now that it is set again

    def requested(self, dist) -> bool:
        """Whether any rank received a signal: a collective, so every rank stops after the same step."""
        from common import fsdp

        now, timeout = time.monotonic(), self.agent_timeout
        if self.last_step_end is not None and timeout is not None and now - self.last_step_end > timeout / 2:
            if dist.is_main:
                _say(f"warning: a step takes {now - self.last_step_end:.0f} s, and torchrun kills its workers "
                     f"{timeout:.0f} s after it forwards a signal (its --shutdown-timeout): a stop would lose the "
                     f"steps since the last checkpoint. Restart with torchrun --shutdown-timeout "
                     f"{max(900, 4 * round(now - self.last_step_end))} to stop safely")  # fmt: skip
            self.agent_timeout = None  # once
        self.last_step_end = now
        # how many ranks received each signal: ranks that received different ones (a scheduler's SIGTERM to some, a
        # terminal's SIGHUP to others) agree on one, the most common (at a tie, the first of these)
        numbers = list(STOP_SIGNALS)
        counts = fsdp.all_reduce_dict({str(int(n)): float(self.received == n) for n in numbers}, dist)
        if any(counts.values()) and self.received is None:  # another rank's: this one exits with its code too
            self.received = int(max(numbers, key=lambda n: (counts[str(int(n))], -numbers.index(n))))
        return any(counts.values())

    def finish(self, dist, steps: int | None = None) -> None:
        """Restore the handlers and release the run's folder; after a signal, say how to resume and exit with 128 +
        its number. A signal during
        the last of the run's `steps` stopped nothing: its checkpoint is the end of the run, said as such (exit 0)."""
        from common.checkpoint import checkpoint_folders, release_run_folder

        self._restore()
        release_run_folder(self.run_dir)  # the run has ended: main() may run again in this process
        _RUN.pop("stop", None)
        if self.received is None:
            return
        name = signal.Signals(self.received).name
        newest = checkpoint_folders(self.run_dir)
        if steps is not None and newest and int(os.path.basename(newest[-1]).split("_")[-1]) >= steps:
            if dist.is_main:
                _say(f"{name} during the last step: the run is complete ({newest[-1]}), nothing to resume")
            return
        if dist.is_main:
            _say(f"stopped by {name}: continue with --resume {self.run_dir}")
        raise SystemExit(128 + self.received)


_RUN = {}  # the StopSignals of the run under way in this process (save_finished_steps)
errors.WHEN_A_RUN_FAILS.append(lambda error: save_finished_steps(error))  # errors.clear_errors calls it


def save_finished_steps(error: BaseException) -> None:
    """An error is ending the run (errors.clear_errors calls this): checkpoint the steps it finished, as a signal
    would, where the step under way has not yet changed the weights and no checkpoint holds them already; else say
    what a resume finds. One rank only: a checkpoint of several ranks is a collective, which the others, ended or
    elsewhere, cannot join."""
    from common.checkpoint import complete_checkpoints, set_rng_state

    stop = _RUN.pop("stop", None)
    if stop is None or stop.ended is None or stop.save is None:
        return
    stop._restore()
    ended, saved = stop.ended, complete_checkpoints(stop.run_dir)
    step, what = ended["step"], f"{type(error).__name__} during step {ended['step'] + 1}"
    if saved and int(os.path.basename(saved[-1]).split("_")[-1]) >= step:
        return
    if stop.save.keywords["scheduler"].last_epoch != ended["updates"] or stop.save.keywords["dist"].world_size > 1:
        _say(f"{what}, after its update (or on one of several ranks): {_what_a_resume_finds(stop.run_dir)}")
        return
    set_rng_state(ended["rng"])  # as the step found it, so that a resume repeats it exactly
    path = stop.save(step, trainer_state=ended["trainer_state"])
    finished = "step 1 is" if step == 1 else f"steps 1-{step} are"
    _say(f"{what}, before its update: {finished} saved ({path}); once the cause is fixed, --resume {stop.run_dir} "
         f"continues with step {step + 1}")  # fmt: skip


def _what_a_resume_finds(run_dir: str) -> str:
    """What a second signal leaves to resume: the run's newest checkpoint, or, before its first, nothing."""
    from common.checkpoint import complete_checkpoints

    saved = complete_checkpoints(run_dir)
    if saved:
        return f"--resume {run_dir} continues from {os.path.basename(saved[-1])}, and the steps after it are lost"
    return (
        "the run had no checkpoint yet: its steps are lost (one signal, not two, lets the step under way "
        "finish and be checkpointed; --save-every N saves every N steps)"
    )


def _agent_shutdown_timeout() -> float | None:
    """The seconds torchrun's agent, this worker's parent, waits after forwarding a signal before it kills its
    workers: its --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 (None where /proc cannot tell)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            environ = dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)
    except OSError:
        return None
    given = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            given = value if equals else argv[i + 1] if i + 1 < len(argv) else given
    try:
        return float(given)
    except ValueError:
        return None


class _SurvivingStream:
    """sys.stdout or sys.stderr while training. A reader that went away (a closed terminal's `| tee`, which its
    SIGHUP ends too; `| head`) makes the next write fail with EPIPE, a hung-up terminal with EIO: the progress bar's
    next line would end the run there, before the checkpoint of the step. The stream's descriptor goes to /dev/null
    instead, and the run goes on to its checkpoint (and its stop, after a signal)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._lost(error)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._lost(error)

    def _lost(self, error: OSError) -> None:
        import errno

        if error.errno not in (errno.EPIPE, errno.EIO):
            raise error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what the stream still holds is flushed there
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _has_fd(stream) -> bool:
    """A stream on a file descriptor (not a test runner's capture, which has no reader to lose)."""
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _detach_from_terminal() -> None:
    """Point stdout and stderr, where they are a terminal, at /dev/null: the terminal has hung up."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)
