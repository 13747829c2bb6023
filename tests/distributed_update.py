"""One call of an algorithm's update_policy on a fixed rollout batch, on however many ranks this is
launched with (`python` or `torchrun --nproc_per_node N`):

    python tests/distributed_update.py OUT.json [ALGORITHM [ARGS_JSON [CHUNK_BYTES]]]   # ALGORITHM defaults to grpo

ARGS_JSON may name "lora_rank" (the adapted model of helpers.adapted_tiny; the weights written are then the merged
ones the engine receives), or "model": "tiny-moe" (the mixture-of-experts model); with "router_replay": "r3" the
batch then carries an engine routing that depends on each token's position in its sequence only (the same on any
rank).
Writes every statistic the update records (reduced over ranks, as the scripts log them) and the number
of skipped optimizer steps as JSON to OUT.json, and the updated weights to OUT.json.weights.pt.
The global batch is 4 prompts x 4 completions (group_size 4) of very different lengths; rank r takes prompts
[r*4/N, (r+1)*4/N), as the scripts' main() does, so batch-level means must be normalized across ranks
to match. SGD (linear in the gradient) makes equal weights mean equal gradients."""

import importlib
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from helpers import adapted_tiny, compute_dtype, precision

from common import flags, fsdp, logprobs, moe
from common.engines import Completion
from common.tiny import load, tiny_model_dir
from common.tracking import StepMetrics

QUESTIONS = ["Q: 1+2=", "Q: 45+51=", "Q: 9+9=", "Q: 70+30="]
RESPONSES = ["3", "12", "4", "396", "96", "9", "91", "906", "18", "1", "81", "188", "100", "10", "1000", "0"]
DEFAULT_ARGS = {
    "group_size": 4,
    "num_minibatches": 1,
    "update_epochs": 2,
    "micro_batch_size": 3,
    "clip_low": 0.01,
    "clip_high": 0.01,
    "lr": 0.5,
}
# the extra inputs some methods' update_policy take, by parameter name
EXTRAS = {
    "initial_entropy": lambda algorithm, args, policy, dist: 1.0,  # gtpo: ⟨H⟩_ini (above ln 2: the filter stays off)
    "isopo": lambda algorithm, args, policy, dist: algorithm.IsopoGradients(policy, args, dist),  # isopo: its forwards
}


def update_policy(algorithm, policy, batch, args, dist, optimizer=None, reference=None):
    """algorithm.update_policy on `batch` with SGD at args.lr (or `optimizer`), `reference` as π_ref (none), bf16 /
    fp16 autocast (and fp16's loss scale) as --dtype says, and whatever extra inputs the method's update_policy
    takes. Returns the metrics it recorded, reduced over ranks (collectives), with "skipped" (the optimizer steps it
    skipped) and "tokens_seen" (the response tokens its updates saw, over ranks and epochs)."""
    optimizer = optimizer or torch.optim.SGD(policy.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = StepMetrics()
    available = {
        "policy": policy,
        "reference": reference,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "batch": batch,
        "args": args,
        "dist": dist,
        "precision": precision(args.systems.dtype),
        "metrics": metrics,
    }
    parameters = inspect.signature(algorithm.update_policy).parameters
    skipped = algorithm.update_policy(
        **{
            name: available[name] if name in available else EXTRAS[name](algorithm, args, policy, dist)
            for name in parameters
        }
    )
    # the entropy's count: every response token, once per epoch (none when every minibatch was skipped)
    tokens_seen = fsdp.all_reduce(metrics.means.get("charts/entropy", (0.0, 0.0))[1], dist)
    return {"skipped": skipped, "tokens_seen": tokens_seen, **metrics.reduce(dist)}


class _ToBfloat16(torch.nn.Module):
    def forward(self, weight):
        return weight.to(torch.bfloat16)


def _inputs_to_bfloat16(module, args, kwargs):
    """Every floating tensor in a layer's arguments, nested ones too (RoPE's (cos, sin)), as FSDP2 casts them."""
    from torch.utils._pytree import tree_map

    cast = lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return tree_map(cast, args), tree_map(cast, kwargs)


def in_bfloat16(model, undo=False, float32_root=False):
    """One process computing what fsdp.shard's bf16 MixedPrecisionPolicy computes on several ranks: every
    parameter enters the forward in bf16 and its gradient flows back to the float32 weight (a parametrization
    of each weight, removed again with `undo`); `float32_root`: the root unit's own (embedding, final norm, output
    layer) stay float32, as fsdp.shard gathers them with --fp32-lm-head, and each decoder layer's floating inputs
    are cast to bf16, as FSDP2 casts a unit's inputs to its parameters' dtype (the residual stream is bf16)."""
    from torch.nn.utils import parametrize

    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for layer in layers if float32_root else []:
        if undo:
            layer._forward_pre_hooks.pop(layer.bf16_inputs_hook.id)
        else:
            layer.bf16_inputs_hook = layer.register_forward_pre_hook(_inputs_to_bfloat16, with_kwargs=True)
    for module in [m for m in model.modules() if id(m) in in_layers or not float32_root]:
        names = (
            getattr(module, "parametrizations", {})
            if undo
            else [n for n, p in module._parameters.items() if p is not None]
        )
        for name in list(names):
            if undo:
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            else:
                parametrize.register_parametrization(module, name, _ToBfloat16(), unsafe=True)


def synthetic_routing(batch, routing):
    """[B, S, L, k]: token at position p of its sequence (prompt and response, padding skipped), layer l, goes to
    experts (3p + l + j) mod E, j < k."""
    experts = routing.routers[0][1].num_experts
    position = batch["position_ids"][:, :, None, None]
    layer = torch.arange(routing.layers)[None, None, :, None]
    slot = torch.arange(routing.top_k)[None, None, None, :]
    return ((3 * position + layer + slot) % experts).to(routing.dtype)


def main(out_path, algorithm_name="grpo", args_json="{}", chunk_bytes=None):
    """chunk_bytes: score the output layer in chunks of this many bytes of logits (5 tokens: 2000)."""
    algorithm = importlib.import_module(f"algorithms.{algorithm_name}")
    if chunk_bytes:
        logprobs.CHUNK_BYTES = int(chunk_bytes)
    dist = fsdp.setup()
    torch.manual_seed(0)
    settings = {**DEFAULT_ARGS, **json.loads(args_json)}
    model, tokenizer = load(tiny_model_dir(moe=settings.get("model") == "tiny-moe"))
    prompts = [tokenizer(q)["input_ids"] for q in QUESTIONS]
    completions = [
        Completion(
            tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
            [-1.0] * (len(r) + 1),
            "stop",
        )
        for r in RESPONSES
    ]
    rewards = torch.tensor([1.0 if i % 3 == 0 else 0.0 for i in range(16)]).view(4, 4)
    advantages = algorithm.compute_advantages(rewards).flatten()
    per_rank = 4 // dist.world_size
    mine = range(dist.rank * per_rank, (dist.rank + 1) * per_rank)
    batch = algorithm.make_batch(
        [prompts[i] for i in mine],
        [completions[i * 4 + j] for i in mine for j in range(4)],
        4,
        tokenizer.pad_token_id,
        dist.device,
    )
    batch["advantages"] = advantages[mine.start * 4 : mine.stop * 4]
    fields = flags.names(algorithm.Args)  # e.g. P3O has no clip range
    args = flags.make(algorithm.Args, **{k: v for k, v in settings.items() if k in fields})
    if args.systems.lora_rank:  # LoRA adapters as the scripts make them, B drawn at random (the same on every rank)
        model = adapted_tiny(tiny_model_dir(), args.systems.lora_rank, args.systems.lora_alpha)
    if getattr(args, "router_replay", "none") == "r3":
        batch["engine_routing"] = synthetic_routing(batch, moe.Routing(model))
    float32_head = getattr(args, "fp32_lm_head", False)
    policy = fsdp.shard(
        model, dist, compute_dtype=compute_dtype(args.systems.dtype), float32_head=float32_head
    )  # as scripts
    if dist.world_size == 1 and args.systems.dtype == "bfloat16":
        in_bfloat16(policy, float32_root=float32_head)  # what FSDP2 ranks compute in bf16
    logged = update_policy(algorithm, policy, batch, args, dist)
    if dist.world_size == 1 and args.systems.dtype == "bfloat16":
        in_bfloat16(policy, undo=True, float32_root=float32_head)
    weights = dict(fsdp.named_full_tensors(policy, dist.device))
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump(logged, f)
        torch.save(weights, out_path + ".weights.pt")
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(*sys.argv[1:])
