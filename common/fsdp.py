"""Distributed set-up (torchrun), FSDP2 sharding, full weights for the engine, gradient norms, collectives.

    dist = setup()                          # reads torchrun's environment; world size 1 is a plain process
    model = shard(model, dist)              # FSDP2: each decoder layer, then the root (no-op on one rank)
    for name, tensor in named_full_tensors(model): ...   # full weights, one tensor at a time, all ranks
    norm = clip_grad_norm(model, max_norm, device)      # over every rank's shards

One process and N processes run the same functions; collectives are skipped when there is no one to
talk to. Launch several with `torchrun --nproc_per_node N algorithms/grpo.py ...` (nccl on GPUs, gloo
on CPUs).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as torch_dist

from common import adapters, logprobs


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The trainer's compute dtype for --dtype `name`: auto is bfloat16 on a GPU, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Precision(NamedTuple):
    dtype: torch.dtype  # --dtype: autocast's, LoRA's frozen weights', the reference's (the engine: --engine-dtype)
    autocast: torch.autocast  # re-entered by every forward that trains or scores
    scaler: torch.amp.GradScaler  # float16's dynamic loss scale; a pass-through otherwise


def mixed_precision(name: str, device: torch.device) -> Precision:
    """(compute dtype, autocast context, gradient scaler) of --dtype `name`. bf16 / fp16 compute over float32
    weights; the scaler is float16's dynamic loss scale and does nothing otherwise. The autocast keeps no cast
    cache: with one, the cast of every float32 weight would live until the forward ends, checkpointing or not
    (a bf16 copy of the model); without it a cast lives as long as autograd needs it (one layer's, checkpointed)."""
    dtype = compute_dtype(name, device)
    autocast = torch.autocast(device.type, dtype, enabled=dtype != torch.float32, cache_enabled=False)
    return Precision(dtype, autocast, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16))


def setup() -> Dist:
    """Process group from torchrun's environment variables (nccl on GPUs, gloo on CPUs). Also turns off
    transformers' progress bars ("Loading weights"): the run's own bar is the one to watch."""
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        check_no_gpu_is_left_unused()
        device = torch.device("cpu")
    if world_size > 1 and not torch_dist.is_initialized():
        # on GPUs, CUDA tensors go through nccl and CPU tensors (--cpu-offload's shards and gradients)
        # through gloo: an nccl-only group cannot reduce a CPU tensor
        torch_dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    return Dist(rank, world_size, local_rank, device)


def check_no_gpu_is_left_unused() -> None:
    """Stop when the machine has an NVIDIA GPU that torch cannot use, rather than train on the CPU for days:
    PyPI's torch 2.14 is a CUDA 13 build, which a driver older than CUDA 13's cannot run. Setting
    CUDA_VISIBLE_DEVICES to an empty value says the CPU is meant."""
    import shutil
    import subprocess

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or not shutil.which("nvidia-smi"):
        return
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    gpus = [line for line in listed.splitlines() if line.startswith("GPU ")]
    if gpus:
        raise RuntimeError(
            f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0].split(' (')[0]}), but torch {torch.__version__} cannot use "
            "them (torch.cuda.is_available() is False; this torch is built for CUDA "
            f"{torch.version.cuda or 'none: a CPU build'}). "
            "Install a torch build that this driver supports (nvidia-smi shows the driver's CUDA version; "
            "https://pytorch.org/get-started/locally), or set CUDA_VISIBLE_DEVICES= to train on the CPU on purpose."
        )


def prepare_for_training(model, gradient_checkpointing: bool = False):
    """The policy as the update needs it: in training mode, with dropout off, and (optionally) with each
    decoder layer's activations recomputed in the backward. Returns the model.
    - Training mode: `from_pretrained` returns a model in eval mode, and transformers' decoder layers
      checkpoint only in training mode, so without it --gradient-checkpointing silently does nothing.
    - Dropout off: the update scores the sampled tokens again and compares (ρ = π_θ / π_old), so π_θ must be a
      deterministic function of the weights (0 already in Llama / Qwen configs; not in every model's).
    - Router jitter off: in training mode Mixtral's and MiniMax's routers multiply their input by random noise when
      the config's router_jitter_noise > 0, which would make π_θ random too.
    - Checkpointing before sharding; non-reentrant, as FSDP2 requires."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention's functional dropout rate
            module.attention_dropout = 0.0
        if isinstance(getattr(module, "jitter_noise", None), float):  # an MoE router's multiplicative noise
            module.jitter_noise = 0.0
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard(
    model, dist: Dist, cpu_offload: bool = False, compute_dtype: torch.dtype = torch.float32, float32_head: bool = False
):
    """FSDP2: `fully_shard` each decoder layer, then the root, over all ranks, and onto the rank's device. On one
    rank the model is moved to the device, whole. The shards stay float32 (the optimizer's weights).
    Pass the model while it is still in CPU memory: `fully_shard` moves each unit's shard to the device as it
    shards it, so a rank's GPU never holds the whole float32 model (beside an awake vLLM engine at start-up, that
    would be the run's peak: 4 bytes per parameter on every GPU, 30 GiB for an 8B model).
    With a bfloat16 `compute_dtype`, each unit is gathered in bf16 and its gradients are reduced in float32
    (FSDP2's MixedPrecisionPolicy, as verl does). Why: under autocast alone every float32 weight gathered
    for the forward is cast again and autograd keeps the cast for the backward, a full-size bf16 copy of
    the model on every rank however many ranks share it. The price: every weight is bf16 in the forward
    (norms and the embedding too, so the residual stream is bf16), where one process computes with float32
    weights under autocast; N ranks agree with one process to bf16 rounding, not exactly (float32 exactly).
    float16 stays autocast over float32 weights: float16 gradients of a loss scaled by 2^16 would overflow.
    `cpu_offload`: keep sharded parameters and optimizer state in CPU memory. `float32_head`: the output layer
    computes in float32 (--fp32-lm-head; common/logprobs.py), and with bf16 the root unit (embedding, final norm,
    output layer) is gathered in float32, not bf16."""
    logprobs.float32_output_layer(model, float32_head)
    if dist.world_size == 1:
        return model.to(dist.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {"mesh": init_device_mesh(dist.device.type, (dist.world_size,))}
    if compute_dtype == torch.bfloat16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cpu_offload:  # pinned memory needs an accelerator
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **({k: v for k, v in options.items() if k != "mp_policy"} if float32_head else options))
    return model


def shard_for_training(policy, dist: Dist, systems, compute_dtype: torch.dtype):
    """prepare_for_training, then shard, as `systems` (common.flags.Systems) asks: --gradient-checkpointing,
    --cpu-offload, --fp32-lm-head. Pass the policy while it is still in CPU memory (see shard)."""
    policy = prepare_for_training(policy, systems.gradient_checkpointing)
    return shard(policy, dist, systems.cpu_offload, compute_dtype, systems.fp32_lm_head)


def load_reference(model: str, dist: Dist, systems, compute_dtype: torch.dtype):
    """The frozen reference policy π_ref of a KL penalty: `model`'s weights, in eval mode, sharded like the policy.
    In float32, as a full fine-tune's weights are; with --lora-rank in the dtype of the policy's frozen base
    (adapters.frozen_dtype), so that π_ref is the policy with B = 0 exactly: a float32 copy beside a bf16 base ran
    its norms and residual stream in float32, and the KL penalty was not 0 at step 0."""
    from transformers import AutoModelForCausalLM

    dtype = adapters.frozen_dtype(compute_dtype) if systems.lora_rank else torch.float32
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    return shard(reference, dist, systems.cpu_offload, compute_dtype, systems.fp32_lm_head)


def named_full_tensors(model, device: torch.device, dtype: torch.dtype | None = None):
    """(Hugging Face name, full tensor on `device`, in `dtype`) for every weight, gathered one tensor at a
    time. A shard is moved to the compute device and cast before its gather (a CPU-offloaded shard cannot
    go through nccl; the engine's dtype halves the traffic for bf16). Under FSDP2 every rank must iterate
    this to the end, in the same order: each gather is a collective. A model with LoRA adapters
    (common/adapters.py) gives the base model's names and merged weights W + (α/r)·B·A."""
    from torch.distributed.tensor import DTensor

    def gather(tensor, dtype):
        tensor = tensor.detach().to(device=device, dtype=dtype)
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    if adapters.is_adapted(model):
        yield from adapters.merged_weights(model, gather, dtype)
        return
    for name, tensor in model.state_dict().items():
        yield name, gather(tensor, dtype)


def clip_grad_norm(model, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip gradients to `max_norm` (0: no clipping, the norm measured all the same); returns the total norm before
    clipping as a plain tensor on `device`.
    The norm of sharded gradients is reduced over ranks and moved to the compute device before it scales
    them, wherever they live (CPU-offloaded gradients included, as verl's fsdp2_clip_grad_norm_ does)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).to(device)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


_THREAD = threading.local()  # .group: the process group this thread's all_reduce_dict uses (collectives_on)


def new_cpu_group(dist: Dist):
    """A gloo process group of every rank (each must call it, in the same order), for collectives of CPU numbers that
    run on another thread at the same time as the default group's."""
    return torch_dist.new_group(backend="gloo") if dist.world_size > 1 else None


@contextlib.contextmanager
def collectives_on(group):
    """all_reduce and all_reduce_dict in this thread go through `group` (None: the default group): the rollout
    sampler's thread reduces its counts while the trainer's thread runs FSDP's collectives."""
    previous, _THREAD.group = getattr(_THREAD, "group", None), group
    try:
        yield
    finally:
        _THREAD.group = previous


def all_reduce(value: float, dist: Dist) -> float:
    """Sum of a number over ranks."""
    return all_reduce_dict({"value": value}, dist)["value"]


def all_reduce_dict(values: dict[str, float], dist: Dist) -> dict[str, float]:
    """Sums of several numbers over ranks, in one collective (float64). A step's metrics go through
    tracking.StepMetrics instead; this is for the counts the update itself needs."""
    if dist.world_size == 1:
        return {k: float(v) for k, v in values.items()}
    group = getattr(_THREAD, "group", None)
    device = dist.device if group is None else torch.device("cpu")  # collectives_on's groups are gloo's
    tensor = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor, group=group)
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
