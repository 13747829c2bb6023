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
import json
import os
import random
import shutil
import sys
import time
import warnings
from functools import partial

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
    with writing_a_checkpoint():  # a second Ctrl-C waits for the write
        return _write_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist, checkpoints)


# a checkpoint being written, and the signal that asked meanwhile to stop at once (stopping.StopSignals defers it)
WRITING = {"active": False, "exit": None}


@contextlib.contextmanager
def writing_a_checkpoint():
    """A checkpoint's write: a second signal waits for its end (StopSignals), then stops the run."""
    WRITING["active"] = True
    try:
        yield
    finally:
        WRITING["active"] = False
    if WRITING["exit"] is not None:
        number, WRITING["exit"] = WRITING["exit"], None
        raise SystemExit(128 + number)


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
    # the files every rank writes, so that a resume notices one that is missing (checks.check_checkpoint_files)
    trainer_state["rank_files"] = {"world_size": dist.world_size, "rollouts": this_rank is not None}
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
    if dist.is_main:  # every check of the resume has passed (rows, model, engine, this checkpoint): now, not before
        _rewind(os.path.dirname(os.path.dirname(path)), path)
    return trainer_state


def locked_run_folder(name: str, args, dist) -> tuple[str, str | None]:
    """(the run folder, the checkpoint to resume or None) of a script's run named `name`, the folder locked by this
    run (open_run_folder). A resumed run keeps its own settings: where this command leaves a flag that a resume may
    change at its default (checks.RESUME_MAY_CHANGE: --steps, --save-every, --eval-every, ...), `args` takes the
    run's value, so a resume continues the run it names and never switches it to the defaults."""
    from common.checks import kept_from_the_run
    from common.flags import assign, flat

    settings = flat(args)
    keep = partial(kept_from_the_run, defaults=flat(type(args)()), argv=sys.argv[1:])
    folder, checkpoint = open_run_folder(
        settings["output_dir"], settings["resume"], name, settings, dist, script=script_of(args), keep=keep
    )
    kept = keep(flat(args), _settings_of(checkpoint)) if checkpoint else {}  # (what open_run_folder applied)
    if kept:
        assign(args, **kept)
        if dist.is_main:
            print("resuming with the run's own " + ", ".join(f"--{n.replace('_', '-')} {v}" for n, v in kept.items())
                  + " (give a flag to change it)", file=sys.stderr)  # fmt: skip
    changed = changed_on_resume(flat(args), _settings_of(checkpoint)) if checkpoint else []
    if changed and dist.is_main:  # allowed, never silent: P3O's --ess-scope micro-batch reads --micro-batch-size
        print(f"resuming with {', '.join(changed)}: from here on the run continues with the new value", file=sys.stderr)
    return folder, checkpoint


def changed_on_resume(settings: dict, saved: dict) -> list[str]:
    """The flags a resume may change (checks.RESUME_MAY_CHANGE) that this command changes, each as "--flag <now's>
    (the run: <its>)"."""
    from common.checks import RESUME_MAY_CHANGE

    names = sorted(RESUME_MAY_CHANGE - {"resume", "output_dir", "model"})
    differ = [n for n in names if n in settings and n in saved and settings[n] != saved[n]]
    return [f"--{n.replace('_', '-')} {settings[n]} (the run: {saved[n]})" for n in differ]


def script_of(args) -> str:
    """The file name of the script whose `Args` these are (grpo.py): a run belongs to the script that made it."""
    import inspect

    return os.path.basename(inspect.getfile(type(args)))


RUN_RECORD = "run.json"  # in a run's folder: the script that made it


def open_run_folder(
    output_dir: str, resume: str | None, name: str, settings: dict, dist, script: str | None = None, keep=None
) -> tuple[str, str | None]:
    """(the run folder, the checkpoint to resume or None), the folder locked by this run. A new run:
    output_dir/<name>__<unix time>, created exclusively (a second run started in the same second, a sweep launched
    in a shell loop, gets <name>__<time>-2), one name for all ranks, recording `script`. --resume: the checkpoint it
    names (find_checkpoint, which skips another script's runs) and its run's folder, after check_resume has compared
    `settings` (the command's flags, flags.flat(args)) with the run's and the script with the run's; `keep(settings,
    the run's settings)` names the flags that take the run's values, which `settings` then holds. Nothing is
    deleted here: a resume from an earlier checkpoint drops the later ones only once the run's set-up has passed
    (load_checkpoint). Either way a lock held by rank 0 until the run ends (stopping.StopSignals.finish) or the process
    does keeps a second writer out of the folder (two resumes of one run would interleave their metrics)."""
    from common import fsdp

    resume = os.path.normpath(resume) if resume and resume != "auto" else resume  # (a shell completes folders with /)
    checkpoint = find_checkpoint(resume, output_dir, name + "__", settings, script) if resume else None
    if checkpoint:  # <run folder>/checkpoints/step_N
        folder = os.path.dirname(os.path.dirname(checkpoint))
        same_script_check(folder, script, resume)
        if dist.is_main:  # before its checkpoints are read: a live run may be replacing them
            _lock(folder)
        if not os.path.isfile(os.path.join(resume, "trainer_state.pt")):  # the newest, now that none is written
            checkpoint = find_checkpoint(folder, output_dir, name + "__")
        settings.update(keep(settings, _settings_of(checkpoint)) if keep else {})
        check_resume(settings, checkpoint, verbose=dist.is_main)
        return folder, checkpoint
    if resume and dist.is_main:  # auto, and nothing to resume: a sweep's point that never reached a checkpoint
        why = _auto_mismatch(output_dir, name + "__", settings, script)
        print(f"--resume auto: no run {name}__* in {output_dir} with these settings has a checkpoint{why}: a new "
              "run starts", file=sys.stderr)  # fmt: skip
    stamp = f"{name}__{int(time.time())}"
    folder = fsdp.broadcast(_create_exclusively(os.path.join(output_dir, stamp)) if dist.is_main else None, dist)
    if dist.is_main:
        _lock(folder)
        if script:
            with open(os.path.join(folder, RUN_RECORD), "w") as f:
                json.dump({"script": script}, f)
        atexit.register(_remove_if_unused, folder)
    return folder, checkpoint


def _script_of_run(folder: str) -> str | None:
    """The script that made a run (its run.json), or None for a run older than the record."""
    try:
        with open(os.path.join(folder, RUN_RECORD)) as f:
            return str(json.load(f)["script"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def same_script_check(folder: str, script: str | None, resume: str) -> None:
    """A run belongs to the script that made it: p3o.py does not continue a grpo.py run (its method, its flags)."""
    made_by = _script_of_run(folder)
    if script and made_by and made_by != script:
        raise BadInput(
            f"--resume {resume}: {folder} is a run of {made_by}, not of {script}: resume it with {made_by}, or start "
            f"a new run of {script} (a new --exp-name gives it a folder of its own)"
        )


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
    """At exit, or when main() ends: a new run's folder that holds nothing a run made (a start refused after it was
    made: a model, a data file, an adapter rank) is removed; its records of the start alone are nothing."""
    from common.tasks import PROMPTS_RECORD

    if os.path.isdir(folder) and set(os.listdir(folder)) <= {"run.lock", RUN_RECORD, PROMPTS_RECORD}:
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


_LOCKS = {}  # this process's run folders (real paths) and their open lock files (a lock lasts while its file is open)


def release_run_folder(folder: str) -> None:
    """Release this process's lock on a run folder (at the end of a run: a notebook or a sweep driver that calls
    main() again may resume it), and remove a new run's folder that holds nothing."""
    handle = _LOCKS.pop(os.path.realpath(folder), None)
    if handle is not None:
        handle.close()
    _remove_if_unused(folder)


def _lock(folder: str) -> None:
    """An exclusive lock on folder/run.lock, released by the system when the process ends, however it ends. A lock
    this process holds already (an earlier main() in it that raised) is taken over, not refused."""
    import fcntl

    held = _LOCKS.pop(os.path.realpath(folder), None)
    if held is not None:
        held.close()

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
    _LOCKS[os.path.realpath(folder)] = handle


def find_checkpoint(
    resume: str, output_dir: str, run_prefix: str, settings: dict | None = None, script: str | None = None
) -> str | None:
    """Resolve --resume: a checkpoint folder, a run folder (its newest complete checkpoint), or "auto": the newest
    complete checkpoint of the newest run in `output_dir` whose name starts with `run_prefix` and whose settings
    match `settings` (this command's; flags a resume may change apart), or None when no run has one. So one command
    starts a run and continues it, and each point of a restarted sweep (`--lr 1e-4`, `--lr 3e-4`) finds its own."""
    if resume == "auto":
        for newest in _checkpointed_runs(output_dir, run_prefix):
            if settings is None or not _auto_differences(settings, _settings_of(newest), script, newest):
                return newest
        return None
    resume = os.path.normpath(resume)  # (a shell completes a folder's name with /)
    if os.path.isfile(os.path.join(resume, "trainer_state.pt")):
        return resume
    if not os.path.isdir(resume):
        raise BadInput(f"--resume {resume}: no such checkpoint or run folder")
    complete = complete_checkpoints(resume)
    if not complete:
        raise BadInput(f"--resume {resume}: no complete checkpoint found")
    return complete[-1]


def _checkpointed_runs(output_dir: str, run_prefix: str):
    """The newest complete checkpoint of each run in `output_dir` named `run_prefix`*, the newest run first."""
    runs = [
        f for f in glob.glob(os.path.join(glob.escape(output_dir), glob.escape(run_prefix) + "*")) if os.path.isdir(f)
    ]
    for run in sorted(runs, key=lambda f: _started(f, run_prefix), reverse=True):
        complete = complete_checkpoints(run)
        if complete:
            yield complete[-1]


def _auto_differences(settings: dict, saved: dict, script: str | None = None, checkpoint: str = "") -> list[str]:
    """How a --resume auto candidate's settings differ from this command's: resume_differences, --model where it
    was trained on another model (a resume may name its model at another place, but a point of a sweep over models
    is another run), and the script where another script made it (a sweep over scripts that shares --exp-name)."""
    from common.checks import same_model_check

    differences = resume_differences(settings, saved)
    made_by = _script_of_run(os.path.dirname(os.path.dirname(checkpoint))) if checkpoint else None
    if script and made_by and made_by != script:
        differences.append(f"made by {made_by}, not {script}")
    if "model" in settings and "model" in saved:
        try:
            same_model_check(settings, saved["model"], adapter=bool(saved.get("lora_rank")))
        except BadInput:
            differences.append(f"--model {saved['model']} in the run, {settings['model']} now")
    return differences


def _auto_mismatch(output_dir: str, run_prefix: str, settings: dict, script: str | None = None) -> str:
    """Why --resume auto found nothing: how the newest checkpointed run of the name differs from this command (a
    default the code has since changed, a flag set otherwise), or "" where no such run exists."""
    for newest in _checkpointed_runs(output_dir, run_prefix):
        differences = _auto_differences(settings, _settings_of(newest), script, newest)
        return f"; the newest, {os.path.dirname(os.path.dirname(newest))}, differs: {', '.join(differences)}"
    return ""


def complete_checkpoints(run: str) -> list[str]:
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
