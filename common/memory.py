"""Will it fit? The peak memory per GPU of a training script's settings, estimated before anything is loaded.

    python -m common.memory --model Qwen/Qwen3-4B-Base --gpus 8 --max-prompt-tokens 1024 --max-new-tokens 4096 \
        --micro-batch-size 4 --gradient-checkpointing --rollout-engine vllm --vllm-sleep-mode
    python -m common.memory --model Qwen/Qwen2.5-Math-1.5B --max-new-tokens 1024 --device cpu   # a CPU run

The same flags as the scripts (the ones that change memory), plus --gpus (torchrun's ranks) and --gpu-gib. Prints
each part of the peak, the phase that sets it (the update, the optimizer step or generation), whether it fits, and
which flags would make it fit when it does not. The parts, per GPU:
- training state: float32 weights, gradients and AdamW's two moments, 16 bytes per parameter, split over the
  ranks by FSDP2 (in CPU memory with --cpu-offload); with --lora-rank 16 bytes per adapter parameter, and the
  frozen weights at 2 (bf16 compute) or 4 bytes each;
- weights in the compute dtype: one process under bf16 autocast keeps a bf16 cast of every weight for the backward
  (one layer's with --gradient-checkpointing); FSDP2 ranks gather bf16 weights one layer at a time (two in
  flight) beside the root module (embedding, output layer), which stays gathered between forward and backward;
- activations: what autograd saves per response token per decoder layer, measured here on the CPU by running one
  and two decoder layers of the model's own width (the difference of their saved bytes over a range of lengths),
  for the micro-batch's longest case, micro-batch size × (max prompt + max new tokens); with
  --gradient-checkpointing only each layer's input is saved, and one layer is recomputed at a time;
- the output layer: chunks of CHUNK_BYTES of float32 logits (common/logprobs.py), a few alive in the backward;
  isopo.py's full [B, T, vocabulary] logits instead (--full-logits);
- the engine: vLLM's --gpu-memory-utilization share while it is awake (asleep, about 1 GiB stays); the hf engine's
  KV cache while it generates (a rank's rollouts at once, up to 1024 sequences), and its own copy of the weights on
  several ranks (one rank shares the trainer's); with --overlap-rollouts the hf engine's copy always, and its
  generation and the scoring of its batch (an output-layer chunk) during the update and the optimizer step (vLLM is
  awake throughout: its share holds it); with --engine-process vLLM's share is of a GPU of its own, reported apart
  (its weights in the engine's dtype, then its KV cache), and the trainer's GPU holds no engine;
- the CUDA context and allocator slack (1.5 GiB), or on a CPU the Python process itself (0.45 GB);
- in host memory, not the GPU's: with --rollout-lag k the k batches sampled ahead, a rank's rollouts each, at
  QUEUED_TOKEN_BYTES per response token (Python lists of token ids, the engine's and the trainer's log-probs);
  not counted: the kept ids of top-p / top-k sampling (K per token) and an MoE engine's routing (layers × k).
It is an estimate for dense decoder models (Llama, Qwen2, Qwen3): fragmentation and kernels' workspaces are not
modelled. On the CPU it agrees with the measured peak RSS of whole training steps within 20% (tests/test_memory.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch

from common import fsdp
from common.errors import BadInput
from common.logprobs import CHUNK_BYTES

GiB = 2**30
CUDA_CONTEXT = 1.5 * GiB  # the CUDA context, cuBLAS / NCCL workspaces and allocator slack
CPU_PROCESS = 0.45e9  # python, torch, transformers and the tokenizer, measured before the model loads
VLLM_ASLEEP = 1.0 * GiB  # what a sleeping vLLM engine keeps on the GPU (CUDA graphs, its context)
HF_MAX_BATCH = 1024  # HFEngine's max_batch_size: sequences per generate call
QUEUED_TOKEN_BYTES = 105  # a queued response token: its id, μ and π_s as Python objects in lists (tracemalloc)


@dataclass
class Plan:
    """The settings that decide memory: a script's flags, the ranks, and the hardware."""

    model: str = "tiny"
    """a Hugging Face model id or local folder (its config.json is read), or `tiny`"""
    gpus: int = 1
    """ranks (torchrun --nproc_per_node × nodes); FSDP2 shards the training state over them"""
    gpu_gib: float = 80.0
    """memory of one GPU, GiB (an H100: 80)"""
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda: per GPU; cpu: the process's peak RSS on a CPU (how the estimate is checked against a measurement)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the scripts' --dtype (auto: bfloat16 on a GPU, float32 on a CPU)"""
    gradient_checkpointing: bool = False
    """the scripts' --gradient-checkpointing"""
    cpu_offload: bool = False
    """the scripts' --cpu-offload (several ranks)"""
    micro_batch_size: int = 64
    """the scripts' --micro-batch-size"""
    max_prompt_tokens: int = 512
    """the scripts' --max-prompt-tokens"""
    max_new_tokens: int = 16
    """the scripts' --max-new-tokens"""
    prompts_per_step: int = 32
    """the scripts' --prompts-per-step (all ranks)"""
    group_size: int = 8
    """the scripts' --group-size"""
    rollout_engine: Literal["hf", "vllm"] = "vllm"
    """the engine (on a GPU the scripts' auto is vllm when it is installed)"""
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the hf engine's copy on several ranks (auto: the trainer's float32)"""
    gpu_memory_utilization: float = 0.3
    """vllm's share of the GPU while it is awake"""
    vllm_sleep_mode: bool = False
    """the scripts' --vllm-sleep-mode"""
    kl_coef: float = 0.0
    """> 0 loads a reference model (float32, or a LoRA run's frozen-base dtype; sharded like the policy)"""
    lora_rank: int = 0
    """the scripts' --lora-rank (adapters on every Linear of the decoder layers; 0: full fine-tuning)"""
    full_logits: bool = False
    """full [B, T, vocabulary] logits in the update (isopo.py) instead of chunks"""
    rollout_lag: int = 0
    """the scripts' --rollout-lag: k batches of rollouts queued, in host memory"""
    overlap_rollouts: bool = False
    """the scripts' --overlap-rollouts: the engine generates during the update and the optimizer step (the hf engine
    on its own copy of the weights)"""
    engine_process: bool = False
    """the scripts' --engine-process: vLLM on a GPU of its own beside each rank's (its --gpu-memory-utilization
    share of that GPU), counted apart; the trainer's GPU holds no engine"""
    fp32_lm_head: bool = False
    """the scripts' --fp32-lm-head: under FSDP2 the root unit (embedding, output layer) is gathered in float32, and a
    bf16 output-layer weight (LoRA's frozen one) is upcast for each chunk of positions"""


def load_config(model: str):
    """The model's transformers config (`tiny`: the built-in model's). A model that is not there is
    refused as the scripts refuse it (common.tiny.resolve_model: a mistyped path, a run folder, a
    LoRA checkpoint; a hub id that cannot be reached)."""
    from transformers import AutoConfig

    from common.engines import unreachable_model
    from common.tiny import resolve_model

    path = resolve_model(model)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:  # not on the hub, no network, or an unreadable config
        raise unreachable_model(model, error) from None
    except (ArithmeticError, TypeError, KeyError) as error:  # values no model has (0 heads: a division by zero)
        what = f"{type(error).__name__}: {error}"
        raise BadInput(f"--model {model}: its config.json does not make a model's config ({what})") from None


def config_problems(config) -> list[str]:
    """What makes a model's config impossible to plan for: no layer, no attention head, no width (a config written by
    hand, a typo)."""
    values = {n: getattr(config, n, None) for n in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    return [
        f"the model's config.json has {name} = {value!r}: a positive integer is needed"
        for name, value in values.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]


def plan_problems(plan: Plan) -> list[str]:
    """The problems of a plan's flags, as the scripts check theirs (common.checks)."""
    from common.checks import require

    problems = require(plan.gpus >= 1, "--gpus", ">= 1")
    problems += require(0 < plan.gpu_gib < math.inf, "--gpu-gib", "> 0 and finite")
    for name in ("micro_batch_size", "max_prompt_tokens", "max_new_tokens", "prompts_per_step"):
        problems += require(getattr(plan, name) >= 1, f"--{name.replace('_', '-')}", ">= 1")
    if plan.gpus >= 1 and plan.prompts_per_step >= 1:
        rule = f"divisible by --gpus {plan.gpus} (each rank takes whole prompts)"
        problems += require(plan.prompts_per_step % plan.gpus == 0, "--prompts-per-step", rule)
    rule = ">= 2 (advantages compare completions of one prompt)"
    problems += require(plan.group_size >= 2, "--group-size", rule)
    utilization = plan.gpu_memory_utilization
    problems += require(0 < utilization < 1, "--gpu-memory-utilization", "in (0, 1)")
    problems += require(0 <= plan.kl_coef < math.inf, "--kl-coef", ">= 0 and finite")
    problems += require(plan.lora_rank >= 0, "--lora-rank", ">= 0 (0: full fine-tuning)")
    problems += require(plan.rollout_lag >= 0, "--rollout-lag", ">= 0 (0: on-policy)")
    # What the scripts would ignore, and the estimate with them.
    if plan.cpu_offload and plan.gpus == 1:
        problems += ["--cpu-offload applies with --gpus > 1 only"]
    if plan.vllm_sleep_mode and (plan.rollout_engine != "vllm" or plan.device != "cuda"):
        problems += ["--vllm-sleep-mode applies to --rollout-engine vllm on --device cuda only"]
    if plan.overlap_rollouts and plan.rollout_lag < 1:
        problems += ["--overlap-rollouts applies with --rollout-lag >= 1 only"]
    if plan.overlap_rollouts and plan.vllm_sleep_mode:
        problems += ["--overlap-rollouts must be off with --vllm-sleep-mode (the engine samples during the update)"]
    if plan.engine_process and (plan.rollout_engine != "vllm" or plan.device != "cuda"):
        problems += ["--engine-process applies to --rollout-engine vllm on --device cuda only (a GPU of its own)"]
    if plan.engine_process and plan.vllm_sleep_mode:
        problems += ["--engine-process must be off with --vllm-sleep-mode (the engine's GPU is its own)"]
    return problems


def is_moe(config) -> bool:
    """Whether a model's config is a mixture of experts (Qwen3-MoE, OLMoE: num_experts; Mixtral:
    num_local_experts)."""
    experts = [getattr(config, name, None) or 0 for name in ("num_experts", "num_local_experts")]
    return max(experts) > 1


MOE_CAVEAT = (
    "note: {model} is a mixture-of-experts model; this estimate is for dense models (its "
    "parameters are counted and its activations measured, but the routing, the experts' dispatch "
    "and the routers' state are not modelled): read it as a rough guide"
)


def parameter_counts(config) -> dict[str, int]:
    """Parameters in all, in one decoder layer, and outside the layers (embedding, output layer, final norm),
    counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied output layer counts once
    layers = decoder_layers(model)
    per_layer = sum(p.numel() for p in layers[0].parameters())
    return {"total": total, "layer": per_layer, "root": total - per_layer * len(layers), "layers": len(layers)}


def decoder_layers(model):
    """The decoder layers of a causal LM as the scripts train it (model.model.layers: Llama, Qwen2/3, Mistral,
    Mixtral, OLMoE, ...); another architecture is named, not an AttributeError."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise BadInput(
            f"{type(model).__name__} ({kind}) keeps no decoder layers at model.model.layers: the estimate is for the "
            "decoder-only models the scripts train (Llama, Qwen2, Qwen3, Mistral, Mixtral, OLMoE, ...)"
        )
    return layers


def saved_activation_bytes(model, length: int, compute_dtype: torch.dtype, residual_dtype: torch.dtype) -> int:
    """Bytes of the tensors autograd saves in one training forward of `length` random tokens, weights excluded."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", compute_dtype, enabled=compute_dtype != residual_dtype):
            model(input_ids=torch.randint(0, 64, (1, length)), use_cache=False)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for p, n in storages.items() if p and p not in parameters)


def activation_bytes_per_token(
    config, compute_dtype: torch.dtype, residual_dtype: torch.dtype, lengths=(128, 256)
) -> float:
    """Bytes autograd keeps per token per decoder layer in a training forward, measured on the CPU at the model's
    width: the saved tensors of 2 layers minus those of 1 layer, at two lengths, over the extra tokens (weights and
    their casts, which do not grow with the length, cancel). `compute_dtype`: autocast's; `residual_dtype`: the
    dtype of the hidden states between layers (float32 when the weights are float32 under autocast)."""
    from transformers import AutoModelForCausalLM

    saved = {}
    for layers in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers, small.vocab_size, small.tie_word_embeddings = layers, 64, True
        if hasattr(small, "layer_types") and small.layer_types is not None:
            small.layer_types = small.layer_types[:layers]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small, dtype=residual_dtype).train()
        for length in lengths:
            saved[layers, length] = saved_activation_bytes(model, length, compute_dtype, residual_dtype)
        del model
    (short, long) = lengths
    return ((saved[2, long] - saved[1, long]) - (saved[2, short] - saved[1, short])) / (long - short)


def lora_parameters(config, rank: int) -> int:
    """The adapters' parameters at rank r on every Linear of the decoder layers: r × (in + out) each."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = [m for m in decoder_layers(model).modules() if isinstance(m, torch.nn.Linear)]
    return sum(rank * (m.in_features + m.out_features) for m in linear)


def estimate(plan: Plan, config=None, per_token: float | None = None) -> dict:
    """Each part of the peak in bytes, the phase that sets it, and the total. `config`: the model's (default: read from
    plan.model); `per_token`: activation bytes per token per layer (default: measured, activation_bytes_per_token)."""
    config = config or load_config(plan.model)
    counts = parameter_counts(config)
    gpu = plan.device == "cuda"
    compute = fsdp.compute_dtype(plan.dtype, torch.device(plan.device))
    sharded = plan.gpus > 1
    mixed = sharded and compute == torch.bfloat16  # fsdp.shard's MixedPrecisionPolicy: bf16 weights in the forward
    lora_bf16 = plan.lora_rank > 0 and compute == torch.bfloat16  # the frozen weights, embedding included, in bf16
    residual = compute if mixed or lora_bf16 else torch.float32
    if per_token is None:
        per_token = activation_bytes_per_token(config, compute, residual)
    hidden, vocab, layers = config.hidden_size, config.vocab_size, counts["layers"]
    compute_bytes = compute.itemsize

    parts = {}
    # parameters whose float32 weight, gradient and AdamW moments (16 bytes) this GPU holds: its shard. With LoRA the
    # adapters' alone, beside the frozen weights (bf16 under bf16 compute, else float32; common/adapters.py)
    offloaded = plan.cpu_offload and sharded and gpu
    trained = lora_parameters(config, plan.lora_rank) if plan.lora_rank else counts["total"]
    on_device = 0.0 if offloaded else trained / plan.gpus
    parts["training state (fp32 weights, grads, AdamW)"] = 16 * on_device
    frozen_bytes = (2 if lora_bf16 else 4) if plan.lora_rank else 0
    frozen = 0.0 if offloaded else frozen_bytes * counts["total"] / plan.gpus
    if plan.lora_rank:
        parts["frozen weights (LoRA)"] = frozen
    reference = 0.0  # π_ref of --kl-coef, on the GPU all run (fsdp.load_reference: a LoRA base's dtype, else float32)
    if plan.kl_coef > 0:
        reference = 0.0 if offloaded else (frozen_bytes if plan.lora_rank else 4) * counts["total"] / plan.gpus
        parts["reference model"] = reference
    # weights in the compute dtype during the update
    kept_layers = 1 if plan.gradient_checkpointing else layers
    if sharded:  # gathered: the root stays (in float32 with --fp32-lm-head), two layers in flight
        root_bytes = 4 if plan.fp32_lm_head or not mixed else compute_bytes
        parts["gathered weights"] = counts["root"] * root_bytes + 2 * counts["layer"] * (compute_bytes if mixed else 4)
    if compute != torch.float32 and not mixed and not lora_bf16:
        # autocast's casts of float32 weights (one process, or FSDP2 in float16), which autograd saves for the
        # backward: every layer's, or with checkpointing the recomputed layer's. The scripts turn autocast's cast
        # cache off, which would otherwise keep every layer's cast to the end of the forward, checkpointing or not
        parts["weight casts for the backward"] = (counts["root"] + kept_layers * counts["layer"]) * compute_bytes
    # activations of the longest micro-batch
    rows = min(plan.micro_batch_size, plan.prompts_per_step // plan.gpus * plan.group_size)  # a micro-batch's
    tokens = rows * (plan.max_prompt_tokens + plan.max_new_tokens)
    # the backward's own working memory (gradients of one layer's activations): about half a layer's saved tensors
    if plan.gradient_checkpointing:  # each layer's input kept, one layer recomputed at a time
        parts["activations"] = tokens * (layers * hidden * residual.itemsize + 1.5 * per_token)
    else:  # every layer's saved tensors
        parts["activations"] = tokens * per_token * (layers + 0.5)
    response_positions = rows * (plan.max_new_tokens + 1)
    if plan.full_logits:
        parts["output layer (full logits)"] = full_logits_bytes(rows, plan.max_new_tokens, vocab)
    else:
        parts["output layer (chunks)"] = min(4 * CHUNK_BYTES, 4 * 4 * response_positions * vocab)
    if plan.fp32_lm_head and lora_bf16:  # a float32 copy of the frozen bf16 output layer, one chunk at a time
        parts["output layer (chunks)"] += 4 * vocab * hidden
    engine_training, generation, engine_gpu = 0.0, {}, {}
    if plan.rollout_engine == "vllm" and gpu and plan.engine_process:  # on its own GPU: that GPU's share
        share = plan.gpu_memory_utilization * plan.gpu_gib * GiB
        weights = {"auto": compute_bytes, "float32": 4, "bfloat16": 2, "float16": 2}[plan.engine_dtype] * counts[
            "total"
        ]
        engine_gpu = {"vllm weights": weights, "vllm KV cache, activations, context": share - weights}
    elif plan.rollout_engine == "vllm" and gpu:
        awake = plan.gpu_memory_utilization * plan.gpu_gib * GiB
        engine_training = VLLM_ASLEEP if plan.vllm_sleep_mode else awake
        generation["vllm engine (weights, KV cache)"] = awake
    else:
        engine_dtype = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[plan.engine_dtype]
        if sharded or plan.overlap_rollouts:  # its own full copy on every rank, or to sample beside the update
            engine_training = engine_dtype * counts["total"]
        sequences = min(HF_MAX_BATCH, plan.prompts_per_step // plan.gpus * plan.group_size)
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads  # Mixtral's: null
        kv_width = 2 * layers * config.num_key_value_heads * head_dim
        context = plan.max_prompt_tokens + plan.max_new_tokens
        generation["hf engine KV cache"] = sequences * context * kv_width * engine_dtype
        generation["hf engine logits"] = 3 * 4 * sequences * vocab
    parts["engine during the update"] = engine_training
    if plan.overlap_rollouts and not (plan.rollout_engine == "vllm" and gpu):  # (vLLM's share holds its KV cache)
        # its generation, then its batch scored under the sampling weights: a no-grad pass, one output-layer chunk
        scoring = min(CHUNK_BYTES, 4 * response_positions * vocab)
        parts["engine generating beside the update"] = sum(generation.values()) + scoring
    # --rollout-lag k: the queued batches, in host memory (at the longest responses); a CPU process holds them too
    queue = plan.rollout_lag * plan.prompts_per_step // plan.gpus * plan.group_size * plan.max_new_tokens
    host = {"rollout queue (--rollout-lag)": queue * QUEUED_TOKEN_BYTES} if plan.rollout_lag else {}
    if not gpu:
        parts |= host
    fixed = CUDA_CONTEXT if gpu else CPU_PROCESS
    parts["CUDA context, slack" if gpu else "python process"] = fixed

    update = sum(parts.values())
    # the optimizer step: the state, and AdamW's foreach temporaries (about one more float32 copy of the shard)
    step = 20 * on_device + frozen + reference + engine_training + fixed + (0 if gpu else sum(host.values()))
    step += parts.get("engine generating beside the update", 0.0)
    # generation: weights and AdamW's moments (gradients are freed), the engine, but no activations
    resident = 12 * on_device + frozen + reference + fixed
    resident += engine_training if plan.rollout_engine != "vllm" or not gpu else 0.0
    resident += 0 if gpu else sum(host.values())
    rollout = resident + sum(generation.values())
    # start-up: the float32 weights reach the GPU before the optimizer exists, beside an engine already awake (vLLM
    # is built first, to size its KV cache). The scripts shard a model still in CPU memory, so a rank receives its
    # shard one unit at a time (with one unit whole in flight), not the whole model
    weights = (4 * trained + frozen_bytes * counts["total"] if plan.lora_rank else 4 * counts["total"]) / plan.gpus
    in_flight = 4 * max(counts["root"], counts["layer"]) if sharded else 0.0
    engine = generation.get("vllm engine (weights, KV cache)", engine_training)  # vLLM sleeps only once it trains
    start = (0.0 if offloaded else weights) + reference + in_flight + engine + fixed
    phases = {"start-up": start, "update": update, "optimizer step": step, "generation": rollout}
    return {
        "parts": parts,
        "generation": generation,
        "host": host if gpu else {},  # beside the GPU's peak
        "engine_gpu": engine_gpu,  # --engine-process: each rank's engine's own GPU
        "phases": phases,
        "peak_bytes": max(phases.values()),
        "phase": max(phases, key=phases.get),
        "parameters": counts["total"],
        "trained_parameters": trained,
        "activation_bytes_per_token_per_layer": per_token,
    }


def full_logits_bytes(micro_batch_size: int, max_new_tokens: int, vocab: int) -> int:
    """isopo.py's output-layer stage: float32 logits [B, T + 1, V], divided by the temperature, their log-softmax
    and its gradient, alive together."""
    return 4 * 4 * micro_batch_size * (max_new_tokens + 1) * vocab


def device_bytes(device: torch.device) -> int:
    """All of a GPU's memory, or the machine's RAM."""
    import os

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def advice(plan: Plan, result: dict) -> list[str]:
    """Flags that would lower the peak, most effective first, for the phase that sets it."""
    tips, parts, phase = [], result["parts"], result["phase"]
    more_ranks = "more GPUs with torchrun (FSDP2 splits the 16 bytes per parameter)" + (
        ", or --cpu-offload" if plan.gpus > 1 and not plan.cpu_offload else ""
    )
    vllm_awake = plan.rollout_engine == "vllm" and not plan.vllm_sleep_mode and plan.device == "cuda"
    vllm_awake = vllm_awake and not plan.engine_process
    if phase == "update" and not plan.gradient_checkpointing and parts["activations"] > 0.1 * result["peak_bytes"]:
        tips.append("--gradient-checkpointing (activations: each layer's input only)")
    if phase in ("update", "optimizer step") and vllm_awake and not plan.overlap_rollouts:
        tips.append("--vllm-sleep-mode (frees vLLM's share during the update)")
    if phase in ("update", "optimizer step") and parts.get("engine generating beside the update", 0.0):
        tips.append("no --overlap-rollouts (the engine then generates before the update, not during it)")
    if phase == "update" and plan.micro_batch_size > 1:
        tips.append(f"--micro-batch-size {plan.micro_batch_size // 2} (activations scale with it)")
    if phase in ("update", "optimizer step"):
        tips.append(more_ranks)
    elif plan.rollout_engine == "hf":  # generation
        tips.append("--rollout-engine vllm (paged KV cache), or fewer --prompts-per-step per rank")
    else:
        tips.append("a lower --gpu-memory-utilization (vLLM's share), or " + more_ranks)
    return tips


def report(plan: Plan, result: dict) -> str:
    unit, scale = ("GiB", GiB) if plan.device == "cuda" else ("GB", 1e9)
    budget = plan.gpu_gib * GiB if plan.device == "cuda" else None
    size = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    count = size(result["parameters"])
    count += f" ({size(result['trained_parameters'])} in LoRA's adapters)" if plan.lora_rank else ""
    lines = [
        f"{plan.model}: {count} parameters, {plan.gpus} rank(s); activations "
        f"{result['activation_bytes_per_token_per_layer'] / 1024:.0f} KiB per token per layer"
    ]
    row = lambda name, value: f"  {name:<46} {value / scale:8.2f} {unit}"
    lines += [row(name, value) for name, value in result["parts"].items()]
    lines.append(row("= the update (forward and backward)", result["phases"]["update"]))
    lines.append(row("= the optimizer step (state + AdamW's temporaries)", result["phases"]["optimizer step"]))
    lines += [row(name, value) for name, value in result["generation"].items()]
    lines.append(row("= generation (with weights, AdamW, context)", result["phases"]["generation"]))
    lines.append(row("= start-up (weights onto the GPU, engine awake)", result["phases"]["start-up"]))
    peak = result["peak_bytes"]
    if plan.device == "cuda" and result["phase"] == "update" and result["parts"]["activations"] > 0.3 * peak:
        lines.append(
            "  (activations set much of this peak; their per-token cost is measured with the CPU's attention, which "
            "saves more than CUDA's fused kernels: an upper bound on a GPU, 31% high at a 0.5B width on an H100)"
        )
    where = f"peak {peak / scale:.1f} {unit} per {'GPU' if plan.device == 'cuda' else 'process'}, in {result['phase']}"
    lines += [f"  (host memory per rank besides: {n} {v / scale:.2f} {unit})" for n, v in result["host"].items()]
    lines += engine_gpu_report(plan, result["engine_gpu"])
    if budget is None:
        lines.append(where)
    elif peak <= 0.95 * budget:
        lines.append(f"{where}: fits in {plan.gpu_gib:.0f} GiB")
    else:
        lines.append(f"{where}: does NOT fit in {plan.gpu_gib:.0f} GiB. Try: " + "; ".join(advice(plan, result)))
    return "\n".join(lines)


def engine_gpu_report(plan: Plan, parts: dict) -> list[str]:
    """--engine-process: the engine's own GPU, apart from the trainer's (vLLM takes its share whatever it holds)."""
    if not parts:
        return []
    share = sum(parts.values())
    lines = [f"  engine GPU (--engine-process, one per rank): vLLM's {plan.gpu_memory_utilization:g} of it"]
    lines += [f"  {name:<46} {value / GiB:8.2f} GiB" for name, value in parts.items()]
    if parts["vllm KV cache, activations, context"] < 0.1 * share:
        lines.append(f"  engine GPU: the weights leave vLLM less than a tenth of its {share / GiB:.1f} GiB: raise "
                     "--gpu-memory-utilization (0.9: the GPU is the engine's alone)")  # fmt: skip
    return lines


def main() -> None:
    import sys

    import tyro

    from common.checks import refuse

    plan = tyro.cli(Plan, description="Estimate the peak memory per GPU of a training script's settings.")
    refuse(plan_problems(plan))  # one error that lists every problem, before the config is read
    config = load_config(plan.model)
    refuse(config_problems(config))
    if plan.lora_rank:  # a rank the scripts refuse (larger than every layer it adapts) is not planned either
        from common.adapters import check_targets
        from common.tiny import resolve_model

        check_targets(resolve_model(plan.model), plan.lora_rank, ["all-linear"])
    if is_moe(config):
        print(MOE_CAVEAT.format(model=plan.model), file=sys.stderr)
    print(report(plan, estimate(plan, config)))


if __name__ == "__main__":
    from common.errors import clear_errors

    with clear_errors():  # a bad flag or model: one line that names it, not a traceback
        main()
