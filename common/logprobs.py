"""Log-probs of given tokens (and the entropy) through a model's output layer, a chunk of positions at a
time, so that memory does not grow with vocabulary x response length.

    score = partial(log_softmax_gather, temperature=0.7)   # or a script's own: (logits, targets) -> (log π, logp)
    with output_layer_scores(model, response_ids, score, with_entropy=True):   # response_ids [B, T]
        scores = model(input_ids=..., logits_to_keep=T + 1).logits[:, :-1]   # [B, T, 2], not [B, T, V]
    logprobs, entropy = scores.unbind(-1)

`score` is the per-chunk math, log_softmax(z / temperature)[o]: the scripts pass their own function, so that
the log-prob a method trains on is written in the method's file; a number instead is the temperature of this
module's `log_softmax_gather`.

A plain forward keeps float32 logits [B, T, V], their log-softmax and, for the entropy, two more tensors of
that size (with Qwen's 151,936-token vocabulary: 1.2 GB per 1,000 response tokens each). Here the output
layer's forward is replaced, inside the context only, by one that takes each chunk of hidden states to
logits -> log-softmax -> the target's log-prob and the entropy, and drops the logits before the next chunk;
under autograd each chunk is recomputed in the backward (activation checkpointing), so the stage holds
O(chunk x V) however long the responses are. When everything fits in one chunk (the built-in model's
vocabulary of 52), it is computed directly, exactly as a plain forward would.

`sampling_mask` [B, T, K]: the token ids a top-p / top-k engine kept at each sampled position (−1: padding). The
log-prob and the entropy are then those of π renormalised over the kept set (DeepSeek-V3.2's "keep sampling mask"):
log π_kept(o_t) = z_o / τ − logsumexp_{v kept}(z_v / τ), gathered inside each chunk (no [B, T, V] tensor). A
position whose mask is all −1 is scored over the full vocabulary.

`float32_output_layer(model)` makes the output layer compute in float32 whatever the autocast (MiniMax-M1,
arXiv:2506.13585: the bf16 rounding of logits over a large vocabulary is a large share of the train-inference
mismatch): the hidden states and the weight are upcast and the product is taken with autocast off.

A model whose forward transforms the logits after the output layer (Gemma's final soft-capping, Granite's
logits_scaling, Cohere's logit_scale) has that transform moved into the chunks: its own setting is made the
identity inside the context, and each chunk's logits are transformed before the log-softmax. Any other change
of what the output layer returned is refused with the model's name (it would transform [log-prob, entropy]).

The replacement runs inside the model's own forward, so under FSDP2 the root unit's hooks gather the
output layer's weight (tied to the embedding or not) and reduce its gradient as usual; outside the context
the output layer returns logits (generation, evaluation).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.errors import BadInput

CHUNK_BYTES = 128 * 2**20  # float32 logits of one chunk (a few such tensors live at once in its backward)


@contextlib.contextmanager
def output_layer_scores(
    model,
    targets: torch.Tensor,
    score: Callable | float,
    with_entropy: bool = False,
    chunk_bytes: int | None = None,
    sampling_mask: torch.Tensor | None = None,
):
    """Within the context, the model's output layer returns [B, T + 1, 2] for the hidden states [B, T + 1, H] that
    reach it (call the model with logits_to_keep = T + 1): at position t < T the log-prob of targets[b, t] by
    `score` (a number: the temperature of `log_softmax_gather`) and the entropy (no gradient; 0 unless
    `with_entropy`), both over the vocabulary or, with `sampling_mask`, over its kept ids; the last position,
    which predicts past the end, is scored against token 0 (drop it)."""
    head = model.get_output_embeddings()
    targets = F.pad(targets, (0, 1))
    float32 = getattr(head, "in_float32", False)
    kept = None if sampling_mask is None else F.pad(sampling_mask, (0, 0, 0, 1), value=-1)
    returned = []  # what the output layer returned last: the model must hand it back unchanged

    def unchanged(module, args, output):
        """The model must hand back what its output layer returned: a transform after it would be applied to
        [log-prob, entropy] pairs, not to logits (a model this module does not know to move into the chunks)."""
        logits = getattr(output, "logits", None)
        if returned and logits is not None and not (logits is returned[0] or _same(logits, returned[0])):
            raise BadInput(
                f"{type(model).__name__} changes its logits after the output layer (in its forward), which the "
                "trainer's chunked log-probs cannot follow; common/logprobs.py knows Gemma's soft-capping, "
                "Granite's logits_scaling and Cohere's logit_scale"
            )

    with _post_head_transform(model) as transformed:
        chunk_score = transformed(_scorer(score))  # the model's own logit transform, then `score`

        def scores(hidden):
            bias, chunk = getattr(head, "bias", None), chunk_bytes or CHUNK_BYTES
            result = chunked_scores(hidden, head.weight, bias, targets, chunk_score, with_entropy, chunk, float32, kept)
            returned[:] = [result]
            return result

        # an instance attribute: nn.Module.__call__ finds it before the class's forward. One may be there already
        # (an engine sharing these modules computes its product in float32, --fp32-lm-head): it is put back after
        engines_forward = head.__dict__.get("forward")
        head.forward = scores
        check = model.register_forward_hook(unchanged)
        try:
            yield
        finally:
            check.remove()
            if engines_forward is None:
                del head.forward
            else:
                head.forward = engines_forward


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values, a NaN where the other has one (an overflow in float16 is a step
    to skip, not a changed output layer)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _scorer(score):
    """`score` as a function (logits, targets) -> (log π of the targets, log π); a number is the temperature of
    `log_softmax_gather`."""
    return score if callable(score) else partial(log_softmax_gather, temperature=score)


@contextlib.contextmanager
def _post_head_transform(model):
    """Some models transform their logits after the output layer, in their forward (transformers 5.x): Gemma 2-4's
    final soft-capping c·tanh(z / c) (config.final_logit_softcapping), Granite's z / config.logits_scaling, Cohere's
    z · model.logit_scale. Within the context the model's own transform is made the identity, and the yielded
    function wraps a chunk scorer so that it applies the transform to each chunk's logits first: the log-probs are
    those of the model's real distribution, the one its engine samples from."""
    config = model.config
    cap = getattr(config, "final_logit_softcapping", None)
    scaling = getattr(config, "logits_scaling", 1.0)
    # a PeftModel hands reads of an attribute on to the model it wraps, but not writes: Cohere's
    # setting is switched off where its forward reads it
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    scale = getattr(inner, "logit_scale", 1.0)
    scale = scale if isinstance(scale, (int, float)) else 1.0  # Cohere's number (not, say, a learned parameter)
    if cap is None and scaling == 1 and scale == 1:
        yield lambda score: score
        return

    def transformed(score):
        return lambda logits, targets: score(post_head_logits(logits, cap, scaling, scale), targets)

    settings = [(config, "final_logit_softcapping", cap, None), (config, "logits_scaling", scaling, 1.0)]
    settings += [(inner, "logit_scale", scale, 1.0)]
    changed = [(owner, name, value) for owner, name, value, identity in settings if value != identity]
    for owner, name, _ in changed:
        setattr(owner, name, 1.0 if name != "final_logit_softcapping" else None)
    try:
        yield transformed
    finally:
        for owner, name, value in changed:
            setattr(owner, name, value)


def post_head_logits(logits: torch.Tensor, cap: float | None, scaling: float, scale: float) -> torch.Tensor:
    """The logits a model hands out after its output layer's z: Gemma's soft-capping c·tanh(z / c) (`cap`, None: off),
    then Granite's z / `scaling` and Cohere's z · `scale`."""
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits / scaling * scale


def chunked_scores(
    hidden, weight, bias, targets, score, with_entropy, chunk_bytes=CHUNK_BYTES, float32: bool = False, kept=None
):
    """[B, T, 2] log-prob of `targets` and entropy from hidden states [B, T, H] and the output layer's
    weight [V, H] (and bias), over chunks of about `chunk_bytes` of float32 logits (`float32`: the layer's
    product in float32, autocast off; `kept` [B, T, K]: renormalised over those ids, −1 padding)."""
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match the hidden states {tuple(hidden.shape[:2])}")
    score = _scorer(score)
    rows, width = targets.shape
    flat_hidden, flat_targets = hidden.reshape(rows * width, -1), targets.reshape(-1)
    flat_kept = None if kept is None else kept.reshape(rows * width, -1)
    per_chunk = max(1, chunk_bytes // (4 * weight.shape[0]))
    if len(flat_targets) <= per_chunk:  # one chunk: nothing to save by recomputing
        scores = _scores(flat_hidden, weight, bias, flat_targets, score, with_entropy, float32, flat_kept)
        return scores.view(rows, width, 2)
    # Under bf16 / fp16 autocast a float32 weight is cast once here, not once per chunk in the backward
    # (each recomputation re-enters autocast, whose cast cache empties when it exits)
    device = hidden.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and not float32 else None
    if low is not None and weight.dtype == torch.float32 and low in (torch.bfloat16, torch.float16):
        weight = _CastOnce(weight, low)
    pieces = []
    for start in range(0, len(flat_targets), per_chunk):
        piece = (
            flat_hidden[start : start + per_chunk],
            weight,
            bias,
            flat_targets[start : start + per_chunk],
            score,
            with_entropy,
            float32,
            None if flat_kept is None else flat_kept[start : start + per_chunk],
        )
        if torch.is_grad_enabled():  # keep no logits for the backward: recompute this chunk there
            pieces.append(checkpoint(_scores, *piece, use_reentrant=False))
        else:
            pieces.append(_scores(*piece))
    return torch.cat(pieces).view(rows, width, 2)


def log_softmax_gather(logits, targets, temperature=1.0):
    """log π(o) = log_softmax(z / temperature)[o] of one chunk of positions, logits z [..., V] and targets o [...]:
    (the targets' log-probs [...], the whole log-softmax [..., V])."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), logp


def _scores(hidden, weight, bias, targets, score, with_entropy, float32=False, kept=None):
    """[N, 2]: log-prob of each target and entropy (no gradient) of `score`'s log-softmax, in float32 at
    least (bf16 logits are upcast; float64 stays float64); over the ids in `kept` [N, K] where given."""
    if float32:
        logits = float32_linear(hidden, weight, bias)
    elif isinstance(weight, _CastOnce):
        logits = _LowPrecisionLinear.apply(hidden, weight.weight, weight.low, bias)
    else:
        logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    target_logp, logp = score(logits, targets)
    if kept is not None:  # log π_kept(o) = log π(o) − log Σ_{v kept} π(v); all −1: the full vocabulary
        in_set = kept >= 0
        kept_logp = logp.gather(-1, kept.clamp(min=0).long()).masked_fill(~in_set, -math.inf)
        kept_mass = torch.logsumexp(kept_logp, dim=-1).masked_fill(~in_set.any(-1), 0.0)
        target_logp = target_logp - kept_mass
    with torch.no_grad():
        if not with_entropy:
            entropy = torch.zeros_like(target_logp)
        elif kept is None:
            entropy = -(logp.exp() * logp).sum(-1)
        else:  # of π renormalised over the kept set (the full distribution's where there is none)
            renormalised = (kept_logp - kept_mass[:, None]).masked_fill(~in_set, -math.inf)
            entropy = -(renormalised.exp() * renormalised.nan_to_num(neginf=0.0)).sum(-1)
            entropy = torch.where(in_set.any(-1), entropy, -(logp.exp() * logp).sum(-1))
    return torch.stack([target_logp, entropy], dim=-1)


class _CastOnce:
    """A float32 weight with its bf16 / fp16 copy, made once for every chunk of a forward and its backward."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight, self.low = weight, weight.detach().to(dtype)


class _LowPrecisionLinear(torch.autograd.Function):
    """F.linear(hidden, weight, bias) as autocast computes it (inputs cast to the low dtype, the weight's
    gradient back in its own dtype, accumulated in float32), with the weight's cast `low` given: the same
    values, without a new cast of the [V, H] weight for each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, low, bias):
        hidden = hidden.to(low.dtype)
        ctx.save_for_backward(hidden, low)
        ctx.dtypes = weight.dtype, None if bias is None else bias.dtype
        return F.linear(hidden, low, None if bias is None else bias.to(low.dtype))

    @staticmethod
    def backward(ctx, grad):
        hidden, low = ctx.saved_tensors
        grad, (weight_dtype, bias_dtype) = grad.to(low.dtype), ctx.dtypes
        grad_hidden = grad @ low if ctx.needs_input_grad[0] else None
        grad_weight = (grad.mT @ hidden).to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(bias_dtype) if ctx.needs_input_grad[3] else None
        return grad_hidden, grad_weight, None, grad_bias


def float32_linear(hidden, weight, bias=None):
    """hidden @ weight.T + bias in float32 (float64 stays float64), whatever the autocast around it."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def float32_output_layer(model, enabled: bool = True):
    """Mark the model's output layer to compute in float32 in `output_layer_scores` (the trainer's log-probs)."""
    model.get_output_embeddings().in_float32 = enabled
    return model
