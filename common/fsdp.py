"""Distributed set-up (torchrun), FSDP2 sharding, seeding, metric reduction and checkpoints.

    dist = setup()                          # reads torchrun's environment; world size 1 is a plain process
    model = shard(model, dist)              # FSDP2: each decoder layer, then the root (no-op on one rank)
    for name, tensor in named_full_tensors(model): ...   # full weights, one tensor at a time, all ranks
    save_checkpoint(run_dir, step, model, tokenizer, optimizer, trainer_state, dist, keep=2)
    trainer_state = load_checkpoint(path, model, optimizer, dist)

One process and N processes run the same functions; collectives are skipped when there is no one to
talk to. Launch several with `torchrun --nproc_per_node N algorithms/grpo.py ...` (nccl on GPUs, gloo
on CPUs).

A checkpoint is a folder `checkpoints/step_00000050/` holding the policy in Hugging Face format
(`save_pretrained`: loadable by transformers and vLLM, float32 master weights), the optimizer state
through `torch.distributed.checkpoint` (sharded: each rank writes its part; reloadable on another
number of ranks), each rank's RNG states, and `trainer_state.pt` (step, scheduler; the data position is
the step, see reward.sample_batch). It is written to `step_XXXXXXXX.tmp` and renamed once complete, so
a kill at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import warnings
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
        # on GPUs, CUDA tensors go through nccl and CPU tensors (--cpu-offload's shards and gradients)
        # through gloo: an nccl-only group cannot reduce a CPU tensor
        torch_dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    return Dist(rank, world_size, local_rank, device)


def shard(model, dist: Dist, cpu_offload: bool = False):
    """FSDP2: `fully_shard` each decoder layer, then the root, over all ranks. On one rank the model is
    returned as it is. Parameters, gathers and gradient reductions stay float32: bf16 compute comes from
    the caller's torch.autocast, as on one rank, so N ranks compute what one process computes (FSDP2's
    MixedPrecisionPolicy would instead round every weight to bf16 before the forward, norms included).
    `cpu_offload`: keep sharded parameters and optimizer state in CPU memory."""
    if dist.world_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options = {"mesh": init_device_mesh(dist.device.type, (dist.world_size,))}
    if cpu_offload:  # pinned memory needs an accelerator
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def named_full_tensors(model, device: torch.device, dtype: torch.dtype | None = None):
    """(Hugging Face name, full tensor on `device`, in `dtype`) for every weight, gathered one tensor at a
    time. A shard is moved to the compute device and cast before its gather (a CPU-offloaded shard cannot
    go through nccl; the engine's dtype halves the traffic for bf16). Under FSDP2 every rank must iterate
    this to the end, in the same order: each gather is a collective."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(device=device, dtype=dtype)
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(model, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip gradients to `max_norm`; returns the total norm before clipping as a plain tensor on `device`.
    The norm of sharded gradients is reduced over ranks and moved to the compute device before it scales
    them, wherever they live (CPU-offloaded gradients included, as verl's fsdp2_clip_grad_norm_ does)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).to(device)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def all_reduce(value: float, dist: Dist, op: str = "sum") -> float:
    """Sum / max / min of a number over ranks."""
    return all_reduce_dict({"value": value}, dist, op)["value"]


def all_reduce_dict(values: dict[str, float], dist: Dist, op: str = "sum") -> dict[str, float]:
    """all_reduce of several numbers in one collective."""
    if dist.world_size == 1:
        return {k: float(v) for k, v in values.items()}
    tensor = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(tensor, op={"sum": torch_dist.ReduceOp.SUM, "max": torch_dist.ReduceOp.MAX,
                                      "min": torch_dist.ReduceOp.MIN}[op])
    return dict(zip(values, tensor.tolist()))


def broadcast(value, dist: Dist):
    """Rank 0's `value` on every rank (any picklable object)."""
    if dist.world_size == 1:
        return value
    box = [value]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(dist: Dist) -> None:
    if dist.world_size > 1:
        torch_dist.barrier()


def cleanup(dist: Dist) -> None:
    """Tear down the process group `setup` created (not one a library such as vLLM made for itself)."""
    if dist.world_size > 1 and torch_dist.is_initialized():
        torch_dist.barrier()  # no rank tears down its connections while a peer still uses them
        torch_dist.destroy_process_group()


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
    # full weights, gathered on rank 0 only
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        model.save_pretrained(temporary, state_dict=weights)
        tokenizer.save_pretrained(temporary)
        torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    del weights
    with _single_process_is_intended():
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(temporary, "optimizer"))
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
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    rng_file = os.path.join(path, f"rng_rank{dist.rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)


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
