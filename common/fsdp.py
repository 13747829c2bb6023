"""Distributed set-up, seeding, metric reduction and checkpoints.

    dist = setup()                      # reads torchrun's environment; world size 1 is a plain process
    seed_everything(args.seed)
    metrics = reduce_metrics(metrics, dist)
    save_checkpoint(run_dir, step, model, tokenizer, trainer_state, keep=2)
    path = find_checkpoint(args.resume, output_dir, run_prefix)   # "auto", a run dir, or a checkpoint

World size 1 runs the same code as N ranks: every collective here is skipped when there is nothing to
reduce. Sharding the model across ranks (FSDP2) plugs in at `shard`.

A checkpoint is a folder `checkpoints/step_00000050/` with the policy in Hugging Face format
(`save_pretrained`: loadable by transformers and vLLM) and `trainer_state.pt` (optimizer, scheduler,
step, RNG states; the data position is the step, see reward.sample_batch). It is written to a temporary
folder and renamed, so a kill at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup() -> Dist:
    """Process group from torchrun's environment variables (nccl on GPUs, gloo on CPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world_size, local_rank, device)


def shard(model, dist: Dist):
    """Where FSDP2 sharding goes. One process: the model is used as it is."""
    if dist.world_size > 1:
        raise NotImplementedError(
            "training on several ranks (FSDP2) is not implemented yet; run one process"
        )
    return model


def cleanup() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reduce_metrics(metrics: dict[str, float], dist: Dist) -> dict[str, float]:
    """Mean over ranks, except *_max / *_min (max / min over ranks)."""
    if dist.world_size == 1:
        return metrics
    reduced = {}
    for name, value in metrics.items():
        tensor = torch.tensor(float(value), dtype=torch.float64, device=dist.device)
        if name.endswith("_max"):
            torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
        elif name.endswith("_min"):
            torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MIN)
        else:
            torch_dist.all_reduce(tensor)
            tensor /= dist.world_size
        reduced[name] = tensor.item()
    return reduced


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str, step: int, model, tokenizer, trainer_state: dict, keep: int) -> str:
    """Write checkpoints/step_{step:08d} atomically and keep only the newest `keep` checkpoints."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    final = os.path.join(checkpoints, f"step_{step:08d}")
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    for old in sorted(glob.glob(os.path.join(checkpoints, "step_*[0-9]")))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(checkpoint: str) -> dict:
    return torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)


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
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint or run folder")
    candidates = [c for c in candidates if os.path.isfile(os.path.join(c, "trainer_state.pt"))]
    if not candidates:
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint found")
    return max(candidates, key=lambda c: (os.path.basename(c), os.path.getmtime(c)))
