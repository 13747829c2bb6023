"""LoRA adapters through peft: `--lora-rank r` trains low-rank matrices beside frozen weights, in every script.

    policy = load_policy(model, checkpoint, systems, compute_dtype)  # float32 model, or frozen base + adapters
    for name, weight in merged_weights(policy, gather): ...  # the engine push: W + (α/r)·B·A, base names
    model = load_merged(path)                                # evaluate: a checkpoint's base + adapter, merged

LoRA (Hu et al., 2021, arXiv:2106.09685, Eq. 3): an adapted Linear layer computes y = x Wᵀ + (α/r)·x Aᵀ Bᵀ with
A [r, in] random and B [out, r] zero at the start, so the adapted model starts as the base model. Only A and B
train: gradients and AdamW's state exist for them alone (77,824 of 3.25 M parameters in the tiny model at r = 4;
about 0.5% of an 8B model's at r = 16 on every projection). The frozen weights are held in the trainer's compute
dtype when it is bfloat16 (no float32 master copy: nothing updates them), in float32 otherwise.

The engine never runs the adapters: at each push it receives W + (α/r)·B·A under the base model's names,
computed in float32 from the gathered tensors, so vLLM serves a plain model (no in-place merge and unmerge of
sharded weights, and every weight tensor goes through on each push, as without adapters). vLLM's own LoRA
loading (`enable_lora`, adapter-only sync) is not used: it computes x Aᵀ Bᵀ in its own kernels beside the base
weights, a second code path whose numbers differ from the trainer's, and it would save only the push of the
frozen tensors, a fraction of a second of a step's time on one GPU.
A checkpoint holds the adapter in peft's format (adapter_config.json, adapter_model.safetensors; its
base_model_name_or_path names the base) beside the trainer state: `PeftModel.from_pretrained(base, folder)`
loads it anywhere, `python -m common.evaluate --model folder` scores it.

An 8B model on one 80 GB GPU (rank 16 on every Linear of the decoder layers: 43.6 M of 8.19 B parameters; the
frozen weights in bf16; LoRA's learning rate about 10× full fine-tuning's), with any script:

    python algorithms/grpo.py --model Qwen/Qwen3-8B-Base --task gsm8k --eval-task gsm8k --lora-rank 16 --lr 1e-5 \
        --steps 500 --prompts-per-step 32 --group-size 8 --max-new-tokens 1024 --num-minibatches 4 \
        --micro-batch-size 8 --gradient-checkpointing --dtype bfloat16 --gpu-memory-utilization 0.35 --track

Memory per GPU (`python -m common.memory` with these flags): frozen weights 15.3 GiB, the adapters' training state
0.65, checkpointed activations 7.1 (210 KiB per token per layer; bf16 residual stream), output-layer chunks 0.5, vLLM
28.0 (0.35 × 80: its bf16 weights and KV cache), CUDA 1.5: peak 53 of 80 GiB. Full fine-tuning of it: 182 GiB.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from common.errors import BadInput

ADAPTER = "default"  # peft's name for a model's only adapter
CONFIG_FILE = "adapter_config.json"
# Why the output layer takes no adapter (common.checks refuses its usual name, lm_head, early).
OUTPUT_LAYER_ADAPTER = (
    "the output layer takes no adapter: the trainer's log-probs multiply by its weight a chunk "
    "of positions at a time (common/logprobs.py), which would bypass one, and many models tie "
    "it to the embedding. Name Linear layers of the decoder layers instead (or all-linear)"
)


def is_adapted(model) -> bool:
    """Whether `model` carries peft adapters (a PeftModel)."""
    return hasattr(model, "peft_config")


def frozen_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of frozen base weights: bfloat16 when that is the compute dtype (nothing updates them, so no float32
    master copy), else float32."""
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32


def load_policy(model: str, checkpoint: str | None, systems, compute_dtype: torch.dtype = torch.float32):
    """The model to train. Full fine-tuning: the weights of `checkpoint` (a resume) or of `model`, in float32.
    With --lora-rank r in `systems` (common.flags.Systems): `model`'s weights, frozen (bfloat16 when that is the
    compute dtype, else float32), with a LoRA adapter on --lora-target-modules: new (B = 0), or the checkpoint's for a
    resume."""
    from transformers import AutoModelForCausalLM

    if not systems.lora_rank:
        return AutoModelForCausalLM.from_pretrained(checkpoint or model, dtype=torch.float32)
    from peft import LoraConfig, PeftModel, get_peft_model

    if not checkpoint:  # a resume keeps the run's adapter, checked when the run started
        check_targets(model, systems.lora_rank, list(systems.lora_target_modules))
    base = AutoModelForCausalLM.from_pretrained(model, dtype=frozen_dtype(compute_dtype))
    if checkpoint:  # the run's adapter (its config was the run's flags: check_resume keeps them)
        trained_on = base_of(checkpoint)
        if os.path.realpath(trained_on) != os.path.realpath(model):  # --model may move, but should be the same
            print(
                f"warning: the adapter was trained on {trained_on}; resuming it on --model {model}",
                file=sys.stderr,
            )
        policy = PeftModel.from_pretrained(base, checkpoint, is_trainable=True)
        policy.peft_config[ADAPTER].base_model_name_or_path = _where(model)  # the base it now runs on (saved with)
        return policy
    targets = list(systems.lora_target_modules)
    config = LoraConfig(
        r=systems.lora_rank,
        lora_alpha=systems.lora_alpha,
        target_modules=decoder_linear_layers(base) if targets == ["all-linear"] else targets,
        lora_dropout=0.0,  # the ratio π_θ / π_old compares two passes: π_θ must be deterministic
        bias="none",
    )
    try:
        policy = get_peft_model(base, config)  # adapters in float32 over a bf16 base (autocast_adapter_dtype)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        raise BadInput(
            f"--lora-target-modules {' '.join(targets)}: {error}. The Linear layers of {model}'s decoder layers: "
            f"{' '.join(decoder_linear_layers(base))}"
        ) from None
    # the engine push merges nn.Linear weights stored [out, in] (merged_weights): not an embedding, a GPT-2 Conv1D
    # ([in, out], peft's fan_in_fan_out) or another layer type peft can adapt
    from peft.tuners.lora import LoraLayer

    for name, module in policy.named_modules():
        if isinstance(module, LoraLayer) and type(module.get_base_layer()) is not torch.nn.Linear:
            layer = type(module.get_base_layer()).__name__
            raise BadInput(
                f"--lora-target-modules: {base_name(name)} is a {layer}; adapters go on nn.Linear layers only"
            )
    policy.peft_config[ADAPTER].base_model_name_or_path = _where(model)  # saved in its checkpoints' adapter config
    return policy


def _where(model: str) -> str:
    """A local base model's absolute path (an adapter checkpoint is loaded from any folder), or a hub id as it is."""
    return os.path.abspath(model) if os.path.isdir(model) else model


def check_targets(model: str, rank: int, targets: list[str]) -> None:
    """Refuse adapters on `model`'s output layer, whatever its name, and a rank above the width of
    every targeted Linear layer (B·A of a layer [out, in] has rank min(out, in) at most, so there
    such an r adds parameters and nothing else: a typo such as 100000), before any weight is
    allocated: the model is built on the meta device from its config. A rank above some layers'
    width only is accepted: peft trains those layers at full rank (a Qwen2-MoE model's
    shared_expert_gate is [1, hidden] beside [hidden, hidden] attention layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    names = decoder_linear_layers(skeleton) if targets == ["all-linear"] else targets

    def targeted(name: str) -> bool:  # peft's matching of a module name
        return any(name == target or name.endswith("." + target) for target in names)

    output = skeleton.get_output_embeddings()
    modules = list(skeleton.named_modules())
    head = next((name for name, module in modules if module is output and targeted(name)), None)
    if head is not None:
        what = f"--lora-target-modules {' '.join(targets)}: {head} is {model}'s output layer"
        raise BadInput(f"{what}: {OUTPUT_LAYER_ADAPTER}")
    unmatched = [t for t in names if not any(n == t or n.endswith("." + t) for n, _ in modules)]
    if unmatched:  # peft drops a name that matches nothing as long as another one matches: a typo trains less
        raise BadInput(
            f"--lora-target-modules {' '.join(unmatched)}: no module of {model} has this name. The Linear layers "
            f"of its decoder layers: {' '.join(decoder_linear_layers(skeleton))} (or all-linear)"
        )
    layers = [(n, m) for n, m in modules if isinstance(m, torch.nn.Linear) and targeted(n)]
    if not layers:
        return  # modules that are not Linear layers: load_policy gives peft's error
    name, layer = max(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
    width = min(layer.in_features, layer.out_features)
    if rank > width:
        raise BadInput(
            f"--lora-rank {rank} is larger than every targeted layer of {model} (the widest, "
            f"{base_name(name)} [{layer.out_features}, {layer.in_features}], has rank {width}): B·A "
            f"cannot exceed a layer's rank, so a larger r adds parameters and nothing else. Use "
            f"--lora-rank {width} or less"
        )


def decoder_linear_layers(model) -> list[str]:
    """The names of the nn.Linear modules inside the decoder layers (q_proj, ..., down_proj): --lora-target-modules
    all-linear. Not peft's own "all-linear", which on an MoE model also adapts the fused experts and the routers
    (nn.Parameters, through parametrizations): here an MoE model's experts and routers stay frozen, so routing
    replay (common/moe.py) sees the routers it knows and a push merges Linear layers only."""
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for layer in model.modules()
            if type(layer).__name__ in layer_classes
            for name, module in layer.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
    )


def _adapted_part(name: str, scales: dict[str, float]) -> tuple[str | None, str]:
    """(the adapted module, "W" / "A" / "B") for a state-dict entry of an adapted layer, else (None, "")."""
    for marker, part in (
        (".base_layer.weight", "W"),
        (f".lora_A.{ADAPTER}.weight", "A"),
        (f".lora_B.{ADAPTER}.weight", "B"),
    ):
        if name.endswith(marker) and name[: -len(marker)] in scales:
            return name[: -len(marker)], part
    return None, ""


def base_name(name: str) -> str:
    """The base model's name of a PeftModel's tensor: base_model.model.X.base_layer.weight -> X.weight."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_weights(model, gather, dtype: torch.dtype | None = None):
    """(base name, tensor in `dtype`) for every weight of the adapted `model`, in state-dict order: an adapted
    layer's W + (α/r)·B·A, merged in float32; every other weight as it is. `gather(tensor, dtype)` makes a full
    tensor of a state-dict entry (FSDP2: a collective, so every rank runs this to the end). A layer's W, (bias,) A
    and B are consecutive entries: one layer's parts are held at a time."""
    from peft.tuners.lora import LoraLayer

    scales = {n: m.scaling[ADAPTER] for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        module, part = _adapted_part(name, scales)
        if module is None:
            yield base_name(name), gather(tensor, dtype)
            continue
        parts.setdefault(module, {})[part] = gather(tensor, None).float()  # gathered in its own dtype
        if len(parts[module]) == 3:
            weight, a, b = (parts[module].pop(k) for k in "WAB")
            del parts[module]
            yield base_name(f"{module}.weight"), torch.addmm(weight, b, a, alpha=scales[module]).to(dtype)
    if parts:  # an adapted layer whose W, A or B never came: its weight would be missing from the push
        raise RuntimeError(f"LoRA push: {sorted(parts)[0]} has only {sorted(parts[sorted(parts)[0]])} of W, A and B")


def has_trained(model) -> bool:
    """Whether any B of the adapter is non-zero (a resumed adapter): a new one leaves the base model as it is."""
    return any(p.count_nonzero() > 0 for n, p in model.named_parameters() if f".lora_B.{ADAPTER}." in n)


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def base_of(path: str) -> str:
    """The base model an adapter folder was trained on (its adapter_config.json's base_model_name_or_path)."""
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            base = json.load(f)["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as error:
        raise BadInput(f"{path}/{CONFIG_FILE}: no base model named in it ({error})") from None
    if not base:
        raise BadInput(f"{path}/{CONFIG_FILE}: no base model named in it (base_model_name_or_path is empty)")
    return base


def existing_base(path: str) -> str:
    """base_of(path), checked: a local base folder that is no longer there (moved or deleted since
    the run) is a BadInput that says which folder the adapter needs, rather than transformers'
    error about a hub id."""
    base = base_of(path)
    looks_local = base.startswith((".", "/", "~")) or base.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(base)):
        raise BadInput(
            f"LoRA checkpoint {path}: the adapter's base model {base} is not there (moved or "
            f"deleted?). The adapter holds the trained matrices alone: put the base model back at "
            f"{base}, or point base_model_name_or_path in {os.path.join(path, CONFIG_FILE)} at "
            "where it is now"
        )
    return base


def base_dtype(model) -> str:
    """The dtype the adapted `model` holds its frozen base in ("bfloat16" under --dtype bfloat16): a checkpoint
    records it, since the adapter was trained over that rounding of the base, not over the weights on disk."""
    return str(next(p.dtype for p in model.parameters() if not p.requires_grad)).removeprefix("torch.")


def load_merged(path: str, base_dtype: str = "float32"):
    """A plain float32 model: the base named in the adapter folder `path`, rounded to `base_dtype` (the dtype its run
    held it in: checks.base_dtype_of), with the adapter merged into it in float32, as merged_weights does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(existing_base(path), dtype=getattr(torch, base_dtype)).float()
    return PeftModel.from_pretrained(base, path).merge_and_unload()
