"""Checkpoints and seeding: a killed run resumes from its last checkpoint with nothing lost.

    seed_everything(seed)                                   # python, numpy and torch generators
    save_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist, keep=2)
    path = find_checkpoint("auto", output_dir, run_prefix)  # --resume: the newest complete checkpoint
    trainer_state = load_checkpoint(path, model, optimizer, dist)

A checkpoint is a folder `checkpoints/step_00000050/` holding the policy in Hugging Face format
(`save_pretrained`: loadable by transformers and vLLM, float32 master weights; with --lora-rank the adapter in
peft's format, common/adapters.py), the optimizer state
through `torch.distributed.checkpoint` (sharded: each rank writes its part; reloadable on another
number of ranks), each rank's RNG states, and `trainer_state.pt` (step, scheduler; the data position is
the step, see tasks.sample_batch). It is written to `step_XXXXXXXX.tmp` and renamed once complete, so
a kill at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import warnings

import numpy as np
import torch

from common import adapters
from common.checks import damaged, read_checkpoint_file
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


def save_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist: Dist, keep: int) -> str:
    """Write checkpoints/step_{step:08d} atomically (every rank calls this) and keep the newest `keep`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    checkpoints = os.path.join(run_dir, "checkpoints")
    final = os.path.join(checkpoints, f"step_{step:08d}")
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
    barrier(dist)
    if dist.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temporary, final)  # the checkpoint exists only once it is complete
        for old in sorted(glob.glob(os.path.join(checkpoints, "step_*[0-9]")))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(dist)
    return final


@contextlib.contextmanager
def _single_process_is_intended():
    """torch.distributed.checkpoint warns when there is no process group; on one rank that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_checkpoint(path: str, model, optimizer, dist: Dist) -> dict:
    """Restore the optimizer and this rank's RNG (the weights were loaded with from_pretrained);
    returns the trainer state (step, scheduler, ...)."""
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
    return read_checkpoint_file(path, "trainer_state.pt")


def find_checkpoint(resume: str, output_dir: str, run_prefix: str) -> str:
    """Resolve --resume: a checkpoint folder, a run folder (its newest checkpoint), or "auto" (the
    newest checkpoint among runs in `output_dir` whose name starts with `run_prefix`)."""
    if resume == "auto":
        candidates = glob.glob(os.path.join(output_dir, f"{run_prefix}*", "checkpoints", "step_*[0-9]"))
    elif os.path.isfile(os.path.join(resume, "trainer_state.pt")):
        return resume
    elif os.path.isdir(resume):
        candidates = glob.glob(os.path.join(resume, "checkpoints", "step_*[0-9]"))
    else:
        raise BadInput(f"--resume {resume}: no such checkpoint or run folder")
    candidates = [c for c in candidates if os.path.isfile(os.path.join(c, "trainer_state.pt"))]
    if not candidates:
        raise BadInput(
            f"--resume {resume}: no complete checkpoint found (looked for {run_prefix}* in {output_dir})"
            if resume == "auto"
            else f"--resume {resume}: no complete checkpoint found"
        )
    return max(candidates, key=lambda c: (os.path.basename(c), os.path.getmtime(c)))
