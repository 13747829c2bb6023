"""Checkpoints and seeding: a killed run resumes from its last checkpoint with nothing lost.

    seed_everything(seed)                                   # python, numpy and torch generators
    save_checkpoint(run_dir, step, model, tokenizer, optimizer, scheduler, scaler, trainer_state, dist, checkpoints)
    path = find_checkpoint("auto", output_dir, run_prefix, settings)  # --resume: the newest complete checkpoint
    trainer_state = load_checkpoint(path, model, optimizer, scheduler, scaler, dist)

A checkpoint is a folder `checkpoints/step_00000050/` holding the policy in Hugging Face format
(`save_pretrained`: loadable by transformers and vLLM, float32 master weights; with --lora-rank the adapter in
peft's format, common/adapters.py), the optimizer state
through `torch.distributed.checkpoint` (sharded: each rank writes its part; reloadable on another
number of ranks), each rank's RNG states and rollouts sampled ahead (--rollout-lag: the trainer state's
"this_rank", common/rollouts.py), and `trainer_state.pt` (step, scheduler, float16's loss scale; the data position
is the step, see tasks.sample_batch). It is written to `step_XXXXXXXX.tmp` and renamed once complete, so
a kill at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import random
import shutil
import sys
import time
import warnings

import numpy as np
import torch

from common import adapters
from common.checks import check_resume, damaged, read_checkpoint_file, resume_differences
from common.errors import BadInput
from common.fsdp import Dist, barrier


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This rank's generators (its own GPU's only: a resume may see fewer or more GPUs)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if isinstance(state.get("cuda"), torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # a list (all devices) is from an older checkpoint: skipped


def save_checkpoint(
    run_dir, step, model, tokenizer, optimizer, scheduler, scaler, trainer_state, dist: Dist, checkpoints
) -> str:
    """Write checkpoints/step_{step:08d} atomically (every rank calls this) and keep the newest
    `checkpoints.keep_checkpoints` (the Checkpoints group of common.flags; 0: all).
    `trainer_state`: what the script needs to continue (skipped steps, its settings, ...); the step, the
    scheduler's state and the loss scale (`scaler`, fsdp.Precision's: float16's, lowered after each overflow; a
    resumed run restarting at 2^16 would skip its steps again) are added to it. Its "this_rank" entry is each rank's
    own (rollouts_rank{rank}.pt)."""
    trainer_state = {"step": step, **trainer_state, "scheduler": scheduler.state_dict()}
    trainer_state["loss_scale"] = scaler.state_dict()  # {} unless float16
    if adapters.is_adapted(model):  # what the adapter was trained over: common.evaluate merges it onto the same
        trainer_state["base_dtype"] = adapters.base_dtype(model)
    with _writing_a_checkpoint():  # a second Ctrl-C waits for the write
        return _write_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist, checkpoints)


def _sync_to_disk(folder: str, files: bool = True) -> None:
    """fsync every file under `folder` (every rank's: written by then), and the folders: the page cache survives a
    killed process, not an OS crash or a power loss, after which a renamed checkpoint could hold empty files while
    the older ones it replaced were gone."""
    for root, _, names in os.walk(folder) if files else [(folder, [], [])]:
        for path in [os.path.join(root, name) for name in names] + [root]:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            except OSError:  # a file system that cannot (some network ones): as before
                pass
            finally:
                os.close(descriptor)


def _write_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist: Dist, checkpoints) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    this_rank = trainer_state.pop("this_rank", None)  # the rest is every rank's, written by rank 0
    folder = os.path.join(run_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step:08d}")
    temporary = final + ".tmp"
    if dist.is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        os.makedirs(temporary)
    barrier(dist)
    # full weights, gathered on rank 0 only; with LoRA the adapter's alone, saved in peft's format
    # (adapter_config.json, adapter_model.safetensors), the frozen base being --model's
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters.is_adapted(model))
    weights = get_model_state_dict(model, options=options)
    if dist.is_main:
        # (peft: no look-up of the base model on the hub for resized embeddings, which adapters here never touch)
        extra = {"save_embedding_layers": False} if adapters.is_adapted(model) else {}
        model.save_pretrained(temporary, state_dict=weights, **extra)
        tokenizer.save_pretrained(temporary)
        torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    del weights
    with _single_process_is_intended():
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=os.path.join(temporary, "optimizer"),
        )
    torch.save(rng_state(), os.path.join(temporary, f"rng_rank{dist.rank}.pt"))
    if this_rank is not None:
        torch.save(this_rank, os.path.join(temporary, f"rollouts_rank{dist.rank}.pt"))
    barrier(dist)
    if dist.is_main:
        # the checkpoint exists only once it is complete; one of the same step (a resumed run rewrites the steps
        # after the checkpoint it resumed) is moved aside first, not deleted in place: half deleted, it would still
        # count as complete
        if os.path.isdir(final):
            _set_aside(final)
        _sync_to_disk(temporary)  # a power loss after the rename must not leave it named but empty
        os.replace(temporary, final)
        _sync_to_disk(folder, files=False)  # the rename itself
        # a run resumed from an earlier checkpoint rewrites the steps after it (_rewind dropped their checkpoints as it
        # started: any still there go now), and the newest kept are its own; compared by name (glob writes the folder
        # part its own way: a // as /)
        written = {os.path.basename(c): c for c in checkpoint_folders(os.path.dirname(folder))}
        later = [c for name, c in written.items() if name > os.path.basename(final)]
        earlier = [c for name, c in written.items() if name <= os.path.basename(final)]
        for old in later + earlier[: -checkpoints.keep_checkpoints]:
            remove_checkpoint(old)
        for aside in glob.glob(os.path.join(glob.escape(folder), "step_*" + _SET_ASIDE)):  # (a killed process's too)
            shutil.rmtree(aside, ignore_errors=True)
    barrier(dist)
    return final


_SET_ASIDE = ".removed"  # a checkpoint being removed: never one to resume from


def _set_aside(checkpoint: str) -> str:
    aside = checkpoint + _SET_ASIDE
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(checkpoint, aside)  # one rename: the checkpoint is there whole, or not at all
    return aside


def remove_checkpoint(checkpoint: str) -> None:
    """Remove a checkpoint folder so that a kill at any moment leaves it whole or gone, never half deleted (rmtree's
    order is the file system's: trainer_state.pt may outlive the optimizer's shards or a rank's RNG state)."""
    shutil.rmtree(_set_aside(checkpoint), ignore_errors=True)


def checkpoint_folders(run: str) -> list[str]:
    """A run folder's checkpoints/step_N folders (complete or not), oldest first."""
    return sorted(glob.glob(os.path.join(glob.escape(os.path.join(run, "checkpoints")), "step_*[0-9]")))


@contextlib.contextmanager
def _single_process_is_intended():
    """torch.distributed.checkpoint warns when there is no process group; on one rank that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_checkpoint(path: str, model, optimizer, scheduler, scaler, dist: Dist) -> dict:
    """Restore the optimizer, the scheduler, the loss scale and this rank's RNG (the weights were loaded with
    from_pretrained); returns the trainer state (step, and what the script saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    except (Exception, CheckpointException) as error:  # a shard cut short: name it and the other checkpoints
        raise damaged(path, "the optimizer state (optimizer/)", error) from None
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if os.path.exists(os.path.join(path, f"rng_rank{dist.rank}.pt")):  # absent when resuming on more ranks
        set_rng_state(read_checkpoint_file(path, f"rng_rank{dist.rank}.pt"))
    trainer_state = read_checkpoint_file(path, "trainer_state.pt")
    scheduler.load_state_dict(trainer_state["scheduler"])
    if trainer_state.get("loss_scale"):  # float16's (a checkpoint older than it restarts at the initial scale)
        scaler.load_state_dict(trainer_state["loss_scale"])
    if os.path.exists(os.path.join(path, f"rollouts_rank{dist.rank}.pt")):  # absent on more ranks, or in older ones
        trainer_state["this_rank"] = read_checkpoint_file(path, f"rollouts_rank{dist.rank}.pt")
    return trainer_state


def locked_run_folder(output_dir: str, resume: str | None, name: str, settings: dict, dist) -> tuple[str, str | None]:
    """(the run folder, the checkpoint to resume or None), the folder locked by this run. A new run:
    output_dir/<name>__<unix time>, created exclusively (a second run started in the same second, a sweep launched
    in a shell loop, gets <name>__<time>-2), one name for all ranks. --resume: the checkpoint it names
    (find_checkpoint) and its run's folder, after check_resume has compared `settings` (the command's flags,
    flags.flat(args)) with the run's. Either way a lock held by rank 0 until the process ends keeps a second writer
    out of the folder (two resumes of one run would interleave their metrics)."""
    from common import fsdp

    resume = os.path.normpath(resume) if resume and resume != "auto" else resume  # (a shell completes folders with /)
    checkpoint = find_checkpoint(resume, output_dir, name + "__", settings) if resume else None
    if checkpoint:  # <run folder>/checkpoints/step_N
        folder = os.path.dirname(os.path.dirname(checkpoint))
        if dist.is_main:  # before its checkpoints are read: a live run may be replacing them
            _lock(folder)
        if not os.path.isfile(os.path.join(resume, "trainer_state.pt")):  # the newest, now that none is written
            checkpoint = find_checkpoint(folder, output_dir, name + "__")
        check_resume(settings, checkpoint, verbose=dist.is_main)
        if dist.is_main:
            _rewind(folder, checkpoint)
        return folder, checkpoint
    if resume and dist.is_main:  # auto, and nothing to resume: a sweep's point that never reached a checkpoint
        why = _auto_mismatch(output_dir, name + "__", settings)
        print(f"--resume auto: no run {name}__* in {output_dir} with these settings has a checkpoint{why}: a new "
              "run starts", file=sys.stderr)  # fmt: skip
    stamp = f"{name}__{int(time.time())}"
    folder = fsdp.broadcast(_create_exclusively(os.path.join(output_dir, stamp)) if dist.is_main else None, dist)
    if dist.is_main:
        _lock(folder)
        atexit.register(_remove_if_unused, folder)
    return folder, checkpoint


def _rewind(run: str, checkpoint: str) -> None:
    """A run resumed from an earlier checkpoint than its newest rewrites the steps after it, metrics and checkpoints
    both: the later checkpoints go now, before the metrics after `checkpoint` are cut (tracking.Tracker). Left until
    the first new save, a run stopped before it would resume from the abandoned run's newest checkpoint, over metrics
    cut back to the earlier step: the steps between lost from both runs."""
    later = [c for c in checkpoint_folders(run) if os.path.basename(c) > os.path.basename(checkpoint)]
    if later:
        names = ", ".join(os.path.basename(c) for c in later)
        print(f"resuming from {checkpoint}: the run's later checkpoints ({names}) and metrics are dropped",
              file=sys.stderr)  # fmt: skip
    for abandoned in later:
        remove_checkpoint(abandoned)


def _remove_if_unused(folder: str) -> None:
    """At exit: a new run's folder that holds nothing but its lock (a start refused after it was made: a model, a
    data file, an adapter rank) is removed."""
    if os.path.isdir(folder) and set(os.listdir(folder)) <= {"run.lock"}:
        shutil.rmtree(folder, ignore_errors=True)


def _create_exclusively(path: str) -> str:
    """`path`, or `path`-2, -3, ...: the first that this process creates (mkdir fails where another process did)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for number in range(1, 10_000):
        candidate = path if number == 1 else f"{path}-{number}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise BadInput(f"{path}: 10,000 run folders of this name already exist")


_LOCKS = []  # the open lock files of this process's run folders (the lock lasts as long as the file is open)


def _lock(folder: str) -> None:
    """An exclusive lock on folder/run.lock, released by the system when the process ends, however it ends."""
    import fcntl

    try:
        handle = open(os.path.join(folder, "run.lock"), "a+")
    except OSError as error:  # a run folder of another user, a read-only mount
        raise BadInput(f"run folder {folder} cannot be written ({error.strerror}): a run writes its folder") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held by another process
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise BadInput(
            f"run folder {folder} is in use by {owner}: one run writes a folder at a time (wait for it to end, or "
            "start a new run without --resume)"
        ) from None
    except OSError as error:  # a file system without locks (some NFS / Lustre mounts): ENOLCK, EOPNOTSUPP
        print(f"warning: run folder {folder}: its file system cannot lock run.lock ({error.strerror}); nothing "
              "keeps a second process from writing this run: start one at a time", file=sys.stderr)  # fmt: skip
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()}\n")
    handle.flush()
    _LOCKS.append(handle)


# torchrun's agent forwards each signal it receives to its workers, and a scheduler (SLURM) or a terminal's Ctrl-C
# signals every process, the agent included: each worker gets the same signal twice at once. A repeat within
# REPEAT_SECONDS is that copy, not a second request.
_UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
REPEAT_SECONDS = 2.0

# A checkpoint being written, and the signal that asked meanwhile to stop at once (StopSignals defers it)
_WRITING = {"active": False, "exit": None}


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

    def __init__(self):
        import signal
        import threading

        self.received = None
        self.when = 0.0  # time.monotonic() of the first signal
        self.previous = {}
        self.owner = sys._getframe(1).f_code  # the function that catches signals (main), while it runs
        self.agent_timeout = _agent_shutdown_timeout() if _UNDER_TORCHRUN else None
        self.last_step_end = None  # time.monotonic() at the last `requested`: once a step
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if number == signal.SIGHUP and signal.getsignal(number) == signal.SIG_IGN:
                    continue  # nohup: the run was asked to outlive its terminal
                self.previous[number] = signal.signal(number, self._handle)
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = (_SurvivingStream(s) if _has_fd(s) else s for s in self.streams)

    def _handle(self, number, frame):
        import signal

        if not self._owner_running():  # main() raised: the handlers that were there before take it
            return self._pass_on(number, frame)
        name = signal.Signals(number).name
        if number == signal.SIGHUP:
            _detach_from_terminal()
        if self.received is not None and number == self.received and _UNDER_TORCHRUN:
            if time.monotonic() - self.when < REPEAT_SECONDS:  # the agent's copy of what every process was sent
                return
        if self.received is not None:  # the second one: now, unless a checkpoint is being written
            if _WRITING["active"]:
                _WRITING["exit"] = number
                _say(f"\n{name} again: the checkpoint being written is finished first, then the run stops")
                return
            _say(f"\n{name} again: stopped now; --resume continues from the newest checkpoint")
            raise SystemExit(128 + number)
        self.received, self.when = number, time.monotonic()
        _say(f"\n{name}: the step under way finishes and is checkpointed, then the run stops ({name} again: now)")

    def _owner_running(self) -> bool:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.owner:
            frame = frame.f_back
        return frame is not None

    def _restore(self) -> None:
        import signal

        for number, handler in self.previous.items():
            if handler is not None:  # None: a handler set outside Python, which Python cannot set back
                signal.signal(number, handler)
        self.previous = {}
        if isinstance(sys.stdout, _SurvivingStream) or isinstance(sys.stderr, _SurvivingStream):
            sys.stdout, sys.stderr = self.streams

    def _pass_on(self, number, frame) -> None:
        """Restore the handlers, then handle the signal as the one this object replaced would have."""
        import signal

        handler = self.previous.get(number, signal.SIG_DFL)
        self._restore()
        if callable(handler):
            return handler(number, frame)  # Python's default for SIGINT raises KeyboardInterrupt
        if handler == signal.SIG_DFL:
            os.kill(os.getpid(), number)  # the default action (ends the process), now that it is set again

    def requested(self, dist) -> bool:
        """Whether any rank received a signal: a collective, so every rank stops after the same step."""
        import signal

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
        numbers = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
        counts = fsdp.all_reduce_dict({str(int(n)): float(self.received == n) for n in numbers}, dist)
        if any(counts.values()) and self.received is None:  # another rank's: this one exits with its code too
            self.received = int(max(numbers, key=lambda n: (counts[str(int(n))], -numbers.index(n))))
        return any(counts.values())

    def finish(self, run_dir: str, dist, steps: int | None = None) -> None:
        """Restore the handlers; after a signal, say how to resume and exit with 128 + its number. A signal during
        the last of the run's `steps` stopped nothing: its checkpoint is the end of the run, said as such (exit 0)."""
        import signal

        self._restore()
        if self.received is None:
            return
        name = signal.Signals(self.received).name
        newest = checkpoint_folders(run_dir)
        if steps is not None and newest and int(os.path.basename(newest[-1]).split("_")[-1]) >= steps:
            if dist.is_main:
                _say(f"{name} during the last step: the run is complete ({newest[-1]}), nothing to resume")
            return
        if dist.is_main:
            _say(f"stopped by {name}: continue with --resume {run_dir}")
        raise SystemExit(128 + self.received)


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


@contextlib.contextmanager
def _writing_a_checkpoint():
    """A checkpoint's write: a second signal waits for its end (StopSignals), then stops the run."""
    _WRITING["active"] = True
    try:
        yield
    finally:
        _WRITING["active"] = False
    if _WRITING["exit"] is not None:
        number, _WRITING["exit"] = _WRITING["exit"], None
        raise SystemExit(128 + number)


def find_checkpoint(resume: str, output_dir: str, run_prefix: str, settings: dict | None = None) -> str | None:
    """Resolve --resume: a checkpoint folder, a run folder (its newest complete checkpoint), or "auto": the newest
    complete checkpoint of the newest run in `output_dir` whose name starts with `run_prefix` and whose settings
    match `settings` (this command's; flags a resume may change apart), or None when no run has one. So one command
    starts a run and continues it, and each point of a restarted sweep (`--lr 1e-4`, `--lr 3e-4`) finds its own."""
    if resume == "auto":
        for newest in _checkpointed_runs(output_dir, run_prefix):
            if settings is None or not _auto_differences(settings, _settings_of(newest)):
                return newest
        return None
    resume = os.path.normpath(resume)  # (a shell completes a folder's name with /)
    if os.path.isfile(os.path.join(resume, "trainer_state.pt")):
        return resume
    if not os.path.isdir(resume):
        raise BadInput(f"--resume {resume}: no such checkpoint or run folder")
    complete = _complete_checkpoints(resume)
    if not complete:
        raise BadInput(f"--resume {resume}: no complete checkpoint found")
    return complete[-1]


def _checkpointed_runs(output_dir: str, run_prefix: str):
    """The newest complete checkpoint of each run in `output_dir` named `run_prefix`*, the newest run first."""
    runs = [
        f for f in glob.glob(os.path.join(glob.escape(output_dir), glob.escape(run_prefix) + "*")) if os.path.isdir(f)
    ]
    for run in sorted(runs, key=lambda f: _started(f, run_prefix), reverse=True):
        complete = _complete_checkpoints(run)
        if complete:
            yield complete[-1]


def _auto_differences(settings: dict, saved: dict) -> list[str]:
    """How a --resume auto candidate's settings differ from this command's: resume_differences, and --model where it
    was trained on another model (a resume may name its model at another place, but a point of a sweep over models
    is another run)."""
    from common.checks import same_model_check

    differences = resume_differences(settings, saved)
    if "model" in settings and "model" in saved:
        try:
            same_model_check(settings, saved["model"], adapter=bool(saved.get("lora_rank")))
        except BadInput:
            differences.append(f"--model {saved['model']} in the run, {settings['model']} now")
    return differences


def _auto_mismatch(output_dir: str, run_prefix: str, settings: dict) -> str:
    """Why --resume auto found nothing: how the newest checkpointed run of the name differs from this command (a
    default the code has since changed, a flag set otherwise), or "" where no such run exists."""
    for newest in _checkpointed_runs(output_dir, run_prefix):
        differences = _auto_differences(settings, _settings_of(newest))
        return f"; the newest, {os.path.dirname(os.path.dirname(newest))}, differs: {', '.join(differences)}"
    return ""


def _complete_checkpoints(run: str) -> list[str]:
    """A run folder's checkpoints that were written to the end, oldest first."""
    return [c for c in checkpoint_folders(run) if os.path.isfile(os.path.join(c, "trainer_state.pt"))]


def _started(run: str, run_prefix: str) -> tuple:
    """When a run started: its folder's name ends in the start's unix time, and -2, -3, ... for a later start in the
    same second (_create_exclusively). A folder named otherwise counts by its modification time."""
    stamp, _, later = os.path.basename(run)[len(run_prefix) :].partition("-")
    if stamp.isdigit() and (later.isdigit() or not later):
        return (int(stamp), int(later or 1))
    return (os.path.getmtime(run), 0)


def _settings_of(checkpoint: str) -> dict:
    """The settings a checkpoint was written with; {} for one removed meanwhile (a live run replaced it: the
    run's lock then says it is in use)."""
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.pt")):
        return {}
    return read_checkpoint_file(checkpoint, "trainer_state.pt")["args"]
