"""Mixture-of-experts routing: record which experts each token is routed to, and replay a recorded routing.

    routing = Routing(model)              # hooks on every router of a transformers MoE model
    with routing.recording():             # the forwards' routing, kept until `take`
        model(input_ids)
    used, own = routing.take(len(input_ids))   # [B, S, L, k] each: the experts used, and those the router chose
    routing.replay(used)                  # every later forward (and the backward's recomputation) routes as given
    loss = model(input_ids).loss; loss.backward()
    routing.replay(None)                  # back to the router's own choice

A routing tensor holds, per sequence, position and decoder layer, the ids of the k experts the token went to
(uint8; layers without experts stay 0), aligned with the input ids of the forward. vLLM returns the same
layout (`routed_experts`), which is how a trainer replays what an inference engine chose (R3, arXiv:2510.11370).

Replay keeps the router differentiable, as Megatron, verl and slime do: the router still computes its logits
z, the given experts E replace its top-k, and their weights are softmax(z)[E], renormalised over E when the
model renormalises its top-k (Mixtral always; Qwen3-MoE and OLMoE with `norm_topk_prob`). Replaying a
forward's own routing therefore reproduces that forward exactly, and the router's weight still gets the
gradient of the replayed experts' weights. The replay is a setting of the model, not of one call, so that
gradient checkpointing's recomputation (in the backward, after the forward returned) routes as the forward did.

A script's side: `engine_records_routing` (whether the engine should record its routing) and
`routed_logprobs` (a batch's log-probs with its routing recorded and replayed), for --router-replay.

Routers are found by class: transformers 5.x's `...TopKRouter` modules, which return (logits, top-k weights,
top-k ids) from a softmax then top-k. A router that scores differently (GPT-OSS: top-k of the logits, then a
softmax over the k) is refused by name rather than replayed wrongly.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from functools import partial

import torch

from common.errors import BadInput

# router class -> whether it renormalises its top-k weights (None: read the module's `norm_topk_prob`)
ROUTERS = {
    "MixtralTopKRouter": True,
    "MiniMaxTopKRouter": True,
    "Qwen2MoeTopKRouter": None,
    "Qwen3MoeTopKRouter": None,
    "OlmoeTopKRouter": None,
}


def routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every mixture-of-experts layer, in layer order (the order of the model's
    ModuleList); [] for a dense model. A model may keep some layers dense (Qwen3-MoE's mlp_only_layers): the index
    is the decoder layer's, read from the module's name."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not kind.endswith("Router"):
            continue
        if kind not in ROUTERS:
            raise BadInput(f"routing replay does not know the router {kind} ({name}); it knows {', '.join(ROUTERS)}")
        layer = re.search(r"layers\.(\d+)\.", name)
        if layer is None:
            raise BadInput(f"routing replay cannot tell the decoder layer of the router {name} (no layers.<i>.)")
        found.append((int(layer.group(1)), module))
    return found


def is_moe(model) -> bool:
    return any(type(module).__name__.endswith("Router") for module in model.modules())


class Routing:
    """Forward hooks on a model's routers that record the experts chosen and, when set, replay given ones."""

    def __init__(self, model):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router: nothing to record or replay")
        self.layers = model.config.get_text_config().num_hidden_layers
        self.top_k, experts = self.routers[0][1].top_k, self.routers[0][1].num_experts
        self.dtype = torch.uint8 if experts <= 256 else torch.int16  # expert ids 0..255 fit in a byte
        self.replayed: torch.Tensor | None = None  # [B, S, L, k] of the next forwards, or None
        self.is_recording = False
        self.used: dict[int, list[torch.Tensor]] = {}  # layer -> one [B·s, k] per forward
        self.own: dict[int, list[torch.Tensor]] = {}
        self.handles = [router.register_forward_hook(partial(self._hook, layer)) for layer, router in self.routers]

    def replay(self, routing: torch.Tensor | None) -> None:
        """Route every following forward of the model by `routing` [B, S, L, k] (its batch and sequence must be the
        forward's), until replay(None)."""
        self.replayed = routing

    @contextlib.contextmanager
    def recording(self):
        """Within the context, every forward's routing is kept until `take`."""
        self.is_recording, self.used, self.own = True, {}, {}
        try:
            yield self
        finally:
            self.is_recording = False

    def take(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of the forwards recorded since the last take, [B, S, L, k] with S the positions of all of
        them (a generation's prefill, then one per decoding step): (the experts used, the router's own choice)."""
        used, own = (self._stack(records, batch_size) for records in (self.used, self.own))
        self.used, self.own = {}, {}
        return used, own

    def _stack(self, records, batch_size):
        positions = sum(part.shape[0] for part in next(iter(records.values()))) // batch_size if records else 0
        device = next(iter(records.values()))[0].device if records else None
        stacked = torch.zeros(batch_size, positions, self.layers, self.top_k, dtype=self.dtype, device=device)
        for layer, parts in records.items():
            calls = [part.view(batch_size, -1, self.top_k) for part in parts]
            stacked[:, :, layer] = torch.cat(calls, dim=1)  # stored as self.dtype
        return stacked

    def _hook(self, layer, router, inputs, output):
        logits, weights, own = output
        used = own
        if self.replayed is not None:
            used = self.replayed[:, :, layer].reshape(-1, self.top_k).to(device=own.device, dtype=torch.long)
            if used.shape != own.shape:
                raise ValueError(f"replayed routing of {used.shape[0]} tokens for a forward of {own.shape[0]}")
            # the router's softmax at the given experts, renormalised as the model does: z stays differentiable
            # (in float32 as the routers compute it, or in float64 for a float64 model)
            chosen = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(-1, used)
            renormalise = ROUTERS[type(router).__name__]
            if renormalise if renormalise is not None else router.norm_topk_prob:
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            output = (
                logits,
                chosen.to(torch.promote_types(weights.dtype, logits.dtype)),
                used,
            )  # as the router returns
        if self.is_recording:
            self.used.setdefault(layer, []).append(used.detach())
            self.own.setdefault(layer, []).append(own.detach())
        return output


def agreement(first: torch.Tensor, second: torch.Tensor, positions: torch.Tensor, layers) -> dict[str, torch.Tensor]:
    """How far two routings [B, S, L, k] of the same tokens agree, over `positions` [B, S] (bool), per MoE layer of
    `layers` (their indices: a dense layer's slot holds no experts, or what an engine filled it with): `same_set`
    [len(layers)] the share of tokens routed to the same set of experts, `overlap` [len(layers)] the mean
    |A ∩ B| / k, and per token `differs` [N] whether any of those layers' sets differs."""
    a, b = first[positions][:, layers].long(), second[positions][:, layers].long()  # [N, len(layers), k]
    same_set = (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)  # [N, L]
    overlap = (a[..., :, None] == b[..., None, :]).any(dim=-1).float().mean(dim=-1)  # [N, L]
    return {"same_set": same_set.float().mean(0), "overlap": overlap.mean(0), "differs": ~same_set.all(dim=-1)}


_ROUTINGS = weakref.WeakKeyDictionary()


def routing_of(model) -> Routing:
    """The model's one Routing (made on first use), so that an engine that samples with the trainer's own module and
    the trainer share the same hooks."""
    if model not in _ROUTINGS:
        _ROUTINGS[model] = Routing(model)
    return _ROUTINGS[model]


def engine_records_routing(policy, router_replay: str, engine_kind: str, model_name: str) -> bool:
    """Whether the rollout engine should record its routing: for an MoE policy, with --router-replay r3 (the
    replayed experts) and, where the engine can (hf; vLLM on a GPU), for the routing/* metrics. vLLM on a CPU
    cannot: without r3 the metrics are left out (False); with r3 this is True and the vLLM engine refuses it,
    with the reason. A replay asked of a dense model is refused here. `engine_kind`: "hf" or "vllm"."""
    if router_replay != "none" and not is_moe(policy):
        raise BadInput(f"--router-replay {router_replay}: {model_name} is not a mixture-of-experts model")
    can_record = engine_kind == "hf" or torch.cuda.is_available()
    return is_moe(policy) and (can_record or router_replay == "r3")


def routed_logprobs(model, batch, micros, logprobs_of, replayed: str | None = None):
    """Log-probs [B, T] of every response token of `batch` under an MoE `model`, one micro-batch of `micros` at a
    time (`logprobs_of(model, micro)` -> (log-probs [rows, T'], ...), under the caller's no_grad and autocast), with the
    routing recorded and, when `replayed` names a key of the batch, replayed from it. Returns (log π, the experts
    used [B, S, L, k], the routers' own choice [B, S, L, k]), S the batch's columns: a micro-batch trimmed of
    padding lands in its place."""
    routing, logprobs = routing_of(model), torch.zeros_like(batch["sampler_logprobs"])
    shape = (*batch["input_ids"].shape, routing.layers, routing.top_k)
    used, own = (torch.zeros(shape, dtype=routing.dtype, device=logprobs.device) for _ in range(2))
    for micro in micros:
        routing.replay(micro[replayed] if replayed else None)
        with routing.recording():
            micro_logprobs = logprobs_of(model, micro)[0]
        logprobs[micro["rows"], : micro_logprobs.shape[1]] = micro_logprobs
        micro_used, micro_own = routing.take(len(micro["rows"]))
        # a micro-batch is trimmed of padding: its prompt part ends where the batch's does
        first = batch["input_ids"].shape[1] - batch["response_ids"].shape[1] - micro["attention_mask"].shape[1]
        first += micro["response_ids"].shape[1]
        used[micro["rows"], first : first + micro_used.shape[1]] = micro_used
        own[micro["rows"], first : first + micro_own.shape[1]] = micro_own
    routing.replay(None)
    return logprobs, used, own


def batch_routing(prompt_ids, completions, group_size, batch) -> torch.Tensor | None:
    """The experts the engine routed each token of a batch to, [B, prompt + response, L, k] aligned with
    batch["input_ids"] ([left-padded prompt | right-padded response]; completion i answers prompt i // group_size).
    Padding and each completion's last token, which the engine never fed, get experts 0..k−1. None when the engine
    recorded no routing (a dense model, or vLLM on a CPU)."""
    if completions[0].routing is None:
        return None
    prompt_width = batch["input_ids"].shape[1] - batch["response_ids"].shape[1]
    layers, top_k = completions[0].routing.shape[1:]
    filler = torch.arange(top_k, dtype=completions[0].routing.dtype)
    routing = filler.expand(*batch["input_ids"].shape, layers, top_k).clone()
    for index, completion in enumerate(completions):
        start = prompt_width - len(prompt_ids[index // group_size])
        routing[index, start : start + len(completion.routing)] = completion.routing
    return routing.to(batch["input_ids"].device)


def scored_positions(batch) -> torch.Tensor:
    """[B, S] of a batch or micro-batch: the positions whose output is a response token's log-prob (the last prompt
    token and every response token but the last), where a routing changes the loss."""
    mask = batch["response_mask"].bool()
    positions = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    start = positions.shape[1] - mask.shape[1] - 1
    positions[:, start : start + mask.shape[1]] = mask
    return positions


def record_agreement(metrics, engine, used, own, positions, layers) -> None:
    """Engine vs trainer over the scored `positions`, averaged over the MoE `layers`: routing/agreement, the share of
    tokens the trainer sent to the experts the engine chose (`used`: 1 under r3), also per layer
    (routing/agreement_layer{l}); routing/overlap, the mean |A ∩ B| / k; routing/tokens_differing, the share of
    tokens with another set of experts in any layer; routing/own_agreement, the same share for the experts the
    trainer's routers chose themselves (`own`, whatever was replayed). At --rollout-lag k the engine routed with the
    weights of k steps before, so the shares below 1 hold the routers' change over those steps as well as the
    engine's precision (for the token log-probs common/rollouts.py splits the two; for the routing nothing does)."""
    if not positions.any():
        return
    tokens = positions.sum()
    compared, own_compared = agreement(engine, used, positions, layers), agreement(engine, own, positions, layers)
    same_set = compared["same_set"]
    metrics.mean("routing/agreement", same_set.mean() * tokens, tokens)
    for layer, share in zip(layers, same_set):
        metrics.mean(f"routing/agreement_layer{layer}", share * tokens, tokens)
    metrics.mean("routing/overlap", compared["overlap"].mean() * tokens, tokens)
    metrics.mean("routing/tokens_differing", compared["differs"].sum(), tokens)
    metrics.mean("routing/own_agreement", own_compared["same_set"].mean() * tokens, tokens)


def record_drift(metrics, old_own, own, positions, layers) -> None:
    """routing/drift: the share of scored tokens (per MoE layer, averaged) whose router chooses other experts under
    π_θ than under π_old, in the updates of a batch."""
    if positions.any():
        tokens = positions.sum()
        metrics.mean(
            "routing/drift", (1 - agreement(old_own, own, positions, layers)["same_set"].mean()) * tokens, tokens
        )
