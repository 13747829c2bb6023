"""Chunked log-probs through the output layer: the same numbers and gradients as full logits, in float64,
through a model's own forward (tied and untied output layers), and the memory that no longer grows with T."""

import copy

import pytest
import torch

from algorithms import grpo
from common.logprobs import chunked_scores

F64 = torch.float64


def _reference(hidden, weight, bias, targets, temperature):
    """Full [N, T, V] logits: the log-prob of each target and the entropy, by the textbook formulas."""
    logits = (hidden @ weight.T + (0 if bias is None else bias)) / temperature
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(probs * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunks_equal_full_logits_in_float64(chunk_tokens, with_bias):
    torch.manual_seed(0)
    rows, width, hidden_size, vocab = 3, 5, 8, 11
    hidden = torch.randn(rows, width, hidden_size, dtype=F64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=F64, requires_grad=True)
    bias = torch.randn(vocab, dtype=F64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (rows, width))
    upstream = torch.randn(rows, width, dtype=F64)
    scores = chunked_scores(hidden, weight, bias, targets, 0.7, True, chunk_bytes=4 * vocab * chunk_tokens)
    expected_logp, expected_entropy = _reference(hidden, weight, bias, targets, 0.7)
    torch.testing.assert_close(scores[..., 0], expected_logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores[..., 1], expected_entropy, rtol=1e-10, atol=1e-12)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    grads = torch.autograd.grad((scores[..., 0] * upstream).sum(), inputs)
    expected = torch.autograd.grad((expected_logp * upstream).sum(), inputs)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grad", [True, False], ids=["backward", "no_grad"])
def test_the_logits_are_made_a_chunk_at_a_time_and_remade_in_the_backward(grad):
    """What keeps the memory down, counted: 10 positions under chunks of 3 positions' float32 logits are scored in 4
    pieces, and with a gradient each piece is computed again in the backward (its logits were not kept); positions
    that fit one chunk are scored once, and kept (nothing to save by computing them twice)."""
    from common.logprobs import log_softmax_gather

    sizes = []

    def score(logits, targets):
        sizes.append(len(logits))
        return log_softmax_gather(logits, targets)

    vocabulary, width = 7, 4
    for chunk_tokens, pieces in ((3, [3, 3, 3, 1]), (10, [10])):
        hidden = torch.randn(2, 5, width, dtype=F64, requires_grad=grad)
        weight, targets = torch.randn(vocabulary, width, dtype=F64), torch.randint(0, vocabulary, (2, 5))
        sizes.clear()
        with torch.set_grad_enabled(grad):
            scores = chunked_scores(
                hidden, weight, None, targets, score, False, chunk_bytes=4 * vocabulary * chunk_tokens
            )
        assert sizes == pieces
        if grad:
            scores[..., 0].sum().backward()
            assert sorted(sizes) == sorted(pieces * 2 if len(pieces) > 1 else pieces)  # the backward: in reverse


def test_log_softmax_gather_on_any_leading_shape():
    """log_softmax_gather takes logits [..., V] (here [2, 3, V]) at temperature 1 unless told: the target's log-prob
    over the last dimension, and the whole log-softmax."""
    from common.logprobs import log_softmax_gather

    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    targets = torch.tensor([[0, 6, 3], [2, 2, 5]])
    logp, whole = log_softmax_gather(logits, targets)
    expected = torch.log_softmax(logits, -1)
    assert torch.equal(whole, expected) and torch.equal(logp, expected.gather(-1, targets[..., None])[..., 0])


def test_bfloat16_logits_are_normalised_in_float32():
    """A bf16 output layer's logits are upcast before the log-softmax: its log-probs and entropy are float32, those of
    the same bf16 logits in float32 (a bf16 log-softmax rounds log-probs of about −4 to steps of 0.03)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8).bfloat16(), torch.randn(37, 8).bfloat16()
    targets = torch.randint(0, 37, (2, 5))
    scores = chunked_scores(hidden, weight, None, targets, 1.0, True)
    logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), -1)  # the same bf16 product
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores[..., 0], logp.gather(-1, targets[..., None]).squeeze(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(scores[..., 1], -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-5)


def test_entropy_carries_no_gradient():
    hidden = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=F64, requires_grad=True)
    scores = chunked_scores(hidden, weight, None, torch.zeros(2, 3, dtype=torch.long), 1.0, True, chunk_bytes=4 * 6 * 2)
    (gradient,) = torch.autograd.grad(scores[..., 1].sum() + 0 * scores[..., 0].sum(), [hidden])
    assert torch.equal(gradient, torch.zeros_like(hidden))


def _llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).to(F64)


@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_through_the_model_equal_full_logits(tied, monkeypatch):
    """grpo.token_logprobs (chunks of 2 positions, so several chunks per row) vs the model's own full
    logits: log-probs, entropy and every parameter's gradient, float64."""
    model = _llama(tied)
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 37, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of a shorter prompt
    micro = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_ids": ids[:, 7:],
    }
    monkeypatch.setattr("common.logprobs.CHUNK_BYTES", 4 * 37 * 2)
    logprobs, entropy = grpo.token_logprobs(model, micro, 0.8, with_entropy=True)
    logits = reference(input_ids=ids, attention_mask=mask, position_ids=micro["position_ids"]).logits[:, 6:-1] / 0.8
    logp_all = torch.log_softmax(logits, -1)
    expected = logp_all.gather(-1, ids[:, 7:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, -(logp_all.exp() * logp_all).sum(-1), rtol=1e-10, atol=1e-12)
    logprobs.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    # outside the context the output layer is a plain Linear again: generation gets logits
    assert model(input_ids=ids).logits.shape == (3, 12, 37)


def _micro(rows, width, prompt):
    """A micro-batch of random ids [rows, width] (no padding) whose last width − prompt tokens are the response."""
    ids = torch.randint(3, 37, (rows, width))
    positions = torch.arange(width).expand(rows, width)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": positions,
        "response_ids": ids[:, prompt:],
    }


def _transforming_model(kind):
    """A tiny random float64 model whose forward transforms the logits after its output layer (transformers 5.x),
    made strong enough to matter: Gemma 2's soft-capping at 0.5, Granite's division by 4, Cohere's × 0.25."""
    import transformers

    sizes = dict(
        vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**sizes, head_dim=8, final_logit_softcapping=0.5)
        return transformers.Gemma2ForCausalLM(config).to(F64), ("final_logit_softcapping", 0.5)
    if kind == "granite":
        config = transformers.GraniteConfig(**sizes, logits_scaling=4.0)
        return transformers.GraniteForCausalLM(config).to(F64), ("logits_scaling", 4.0)
    config = transformers.CohereConfig(**sizes, logit_scale=0.25)
    return transformers.CohereForCausalLM(config).to(F64), ("logit_scale", 0.25)


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["gemma2", "granite", "cohere"])
def test_a_transform_after_the_output_layer_is_applied_to_each_chunk(kind, adapted, monkeypatch):
    """Gemma's soft-capping, Granite's logits_scaling, Cohere's logit_scale: the model's forward applies them to
    what its output layer returns. grpo.token_logprobs (chunks of 2 positions) scores the model's real
    distribution, that of its own full logits, and leaves the model's setting as it was; also under a LoRA
    adapter (a PeftModel, which passes attribute reads to the model inside but keeps writes for itself)."""
    model, (name, value) = _transforming_model(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)  # logits of a few units, where the transform bends them
    if adapted:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    micro = _micro(2, 10, 6)
    ids = micro["input_ids"]
    monkeypatch.setattr("common.logprobs.CHUNK_BYTES", 4 * 37 * 2)
    with torch.no_grad():
        logprobs, entropy = grpo.token_logprobs(model, micro, 0.8, with_entropy=True)
        full = model(input_ids=ids).logits[:, 5:-1]
    owner = model.get_base_model() if adapted else model
    owner = owner if name == "logit_scale" else model.config
    assert getattr(owner, name) == value  # restored
    assert not adapted or name not in vars(model)  # and set on the model that reads it, not on peft's wrapper
    logp_all = torch.log_softmax(full / 0.8, -1)
    expected = logp_all.gather(-1, ids[:, 6:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, -(logp_all.exp() * logp_all).sum(-1), rtol=1e-10, atol=1e-12)
    inner = model.get_base_model() if adapted else model
    plain = torch.log_softmax(inner.lm_head(inner.model(input_ids=ids).last_hidden_state)[:, 5:-1] / 0.8, -1)
    assert (plain.gather(-1, ids[:, 6:, None]).squeeze(-1) - expected).abs().max() > 0.1  # the transform matters


def test_a_learned_logit_scale_is_not_taken_for_cohere_s(monkeypatch):
    """Only Cohere's `logit_scale`, a number its forward multiplies the logits by, is a transform: a model that
    holds a learned `logit_scale` parameter (of its own, unused by the forward) is scored as it is and keeps it."""
    model = _llama(tied=False)
    model.logit_scale = torch.nn.Parameter(torch.tensor(3.0, dtype=F64))
    micro = _micro(1, 8, 4)
    ids = micro["input_ids"]
    monkeypatch.setattr("common.logprobs.CHUNK_BYTES", 4 * 37 * 2)
    with torch.no_grad():
        logprobs, _ = grpo.token_logprobs(model, micro, 1.0)
        expected = torch.log_softmax(model(input_ids=ids).logits[:, 3:-1], -1).gather(-1, ids[:, 4:, None])
    torch.testing.assert_close(logprobs, expected.squeeze(-1), rtol=1e-10, atol=1e-12)
    assert isinstance(model.logit_scale, torch.nn.Parameter) and model.logit_scale.item() == 3.0


def test_a_non_finite_logit_is_not_taken_for_a_transform(monkeypatch):
    """Cohere's forward multiplies what the output layer returned (by 1 inside the context): an overflow there
    (NaN) gives NaN log-probs, for the step to be skipped, not a refusal of the model."""
    model, _ = _transforming_model("cohere")
    with torch.no_grad():
        model.get_output_embeddings().weight[:, 0] = float("nan")
    micro = _micro(1, 8, 4)
    monkeypatch.setattr("common.logprobs.CHUNK_BYTES", 4 * 37 * 2)
    with torch.no_grad():
        assert grpo.token_logprobs(model, micro, 1.0)[0].isnan().all()


@pytest.mark.parametrize("transform", ["doubled", "one NaN"])
def test_an_unknown_transform_after_the_output_layer_is_refused(monkeypatch, transform):
    """A model whose forward changes the logits in a way this module does not know: one clear error, not
    log-probs of [log-prob, entropy] pairs put through the model's transform. A NaN where the output layer returned
    a number is a change too (a NaN in both is not: an overflow, a step to skip)."""
    from common.errors import BadInput

    model = _llama(tied=False)
    forward = type(model).forward

    def transformed(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if transform == "doubled":
            output.logits = output.logits * 2
        else:
            output.logits = output.logits.clone()
            output.logits[0, 0, 0] = float("nan")
        return output

    monkeypatch.setattr(type(model), "forward", transformed)
    micro = _micro(1, 8, 4)
    with pytest.raises(BadInput, match="LlamaForCausalLM changes its logits after the output layer"):
        grpo.token_logprobs(model, micro, 1.0)


def test_targets_must_match_the_positions():
    with pytest.raises(ValueError, match="do not match"):
        chunked_scores(torch.randn(2, 3, 4), torch.randn(5, 4), None, torch.zeros(2, 4, dtype=torch.long), 1.0, False)


@pytest.mark.slow
def test_memory_does_not_grow_with_the_response_length():
    """Peak memory of the log-prob stage (forward + backward) with a 151,936-token vocabulary: chunking
    keeps it at a few chunks whatever the length (full logits: 4 tensors of 2.5 GB at 4,096 tokens)."""
    import subprocess
    import sys

    code = """
import resource, torch
from common.logprobs import chunked_scores
torch.manual_seed(0)
V, H = 151936, 64
weight = (torch.randn(V, H) * 0.02).requires_grad_()
for T in (1024, 4096):
    hidden = torch.randn(1, T, H, requires_grad=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    chunked_scores(hidden, weight, None, torch.randint(0, V, (1, T)), 1.0, True)[..., 0].sum().backward()
    print(T, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1e6)
"""
    from helpers import REPO

    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    growth = {int(t): float(gb) for t, gb in (line.split() for line in out.strip().splitlines())}
    # 1,024 tokens already span several chunks and set the peak (about 0.4 GB); 4x longer adds nothing
    assert growth[4096] < 0.1 and growth[1024] < 1.0, growth


@pytest.mark.parametrize("chunk_tokens", [3, 1000])
def test_a_float32_output_layer_under_bfloat16_autocast(tiny, chunk_tokens):
    """--fp32-lm-head: under bf16 autocast the output layer's product runs in float32, so the log-probs are the
    float64 head's over the same hidden states to float32 rounding; the bf16 head's are 1e-3 and more away."""
    from common.logprobs import float32_output_layer, output_layer_scores

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    ids = torch.tensor([tokenizer("Q: 37+48+91=37+48=85,85+91=176 #### 176")["input_ids"]])
    targets = ids[:, 1:]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        errors = {}
        for float32 in (False, True):
            float32_output_layer(model, float32)
            with output_layer_scores(model, targets, 1.0, chunk_bytes=4 * 100 * chunk_tokens):
                logprobs = model(input_ids=ids, logits_to_keep=targets.shape[1] + 1).logits[:, :-1, 0]
            reference = torch.log_softmax(hidden.double() @ model.lm_head.weight.double().T, -1)
            errors[float32] = (logprobs - reference.gather(-1, targets[..., None]).squeeze(-1)).abs().max()
    assert errors[True] < 1e-5 and errors[False] > 1e-3, errors


@pytest.mark.parametrize("float32", [True, False], ids=["float32-layer", "cast-once"])
def test_an_output_layers_bias_under_bfloat16_autocast(float32):
    """An output layer with a bias (some models have one) under bf16 autocast, chunked: the float32 product
    (--fp32-lm-head) and the weight cast once both add it: the float64 reference's log-probs with the bias, to bf16's
    rounding, where the bias moves each of them by more than that."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=generator)
    weight, targets = torch.randn(40, 16, generator=generator), torch.randint(0, 40, (2, 6), generator=generator)
    bias = torch.zeros(40).index_fill(0, targets.flatten(), 3.0)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        scores = {
            b is None: chunked_scores(hidden, weight, b, targets, 1.0, False, chunk_bytes=4 * 40 * 5, float32=float32)
            for b in (None, bias)
        }
    for without_bias, found in scores.items():
        expected = _reference(hidden.double(), weight.double(), None if without_bias else bias.double(), targets, 1.0)
        assert (found[..., 0] - expected[0]).abs().max() < (1e-5 if float32 else 0.1)
    assert (scores[False][..., 0] - scores[True][..., 0]).abs().min() > 0.2  # more than the tolerance: it counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_output_layer_is_cast_once_under_autocast(dtype, monkeypatch):
    """--dtype bfloat16 / float16 on one GPU: autocast casts the float32 [V, H] weight for each chunk that the
    backward recomputes (its cast cache empties when each recomputation's autocast exits); here it is cast once
    per forward and backward, 4 chunks or 1, with every gradient what autocast gives one chunk, to rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _llama(tied=False).float()
    weight = model.get_output_embeddings().weight
    micro = _micro(2, 12, 4)

    class CountCasts(TorchDispatchMode):  # the casts of the output layer's weight to `dtype`
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.shape == weight.shape and out.dtype == dtype:
                CountCasts.casts += 1
            return out

    gradients = {}
    for chunk_tokens in (16, 4):  # one chunk, four
        monkeypatch.setattr("common.logprobs.CHUNK_BYTES", 4 * 37 * chunk_tokens)
        model.zero_grad()
        CountCasts.casts = 0
        with CountCasts():
            with torch.autocast("cpu", dtype):
                logprobs, _ = grpo.token_logprobs(model, micro, 1.0)
            logprobs.float().mean().backward()
        assert CountCasts.casts == 1, (chunk_tokens, CountCasts.casts)
        gradients[chunk_tokens] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for name, gradient in gradients[16].items():  # bf16's rounding of a sum of 4 chunks' products, not of 1
        assert (gradients[4][name] - gradient).norm() <= 0.02 * gradient.norm(), name


def test_a_sampling_mask_renormalises_over_the_kept_tokens_in_float64():
    """log π_kept(o) = z_o/τ − logsumexp over the kept ids, and the entropy of the renormalised π, against the formula
    over full logits in float64 (gradients too), in chunks; a position whose mask is all −1 uses the full vocabulary."""
    torch.manual_seed(0)
    rows, width, hidden_size, vocab = 2, 4, 6, 13
    hidden = torch.randn(rows, width, hidden_size, dtype=F64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=F64, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, width))
    kept = torch.full((rows, width, 5), -1)
    for b in range(rows):
        for t in range(width):
            others = [v for v in torch.randperm(vocab).tolist() if v != targets[b, t]][: 1 + (b + t) % 4]
            kept[b, t, : len(others) + 1] = torch.tensor(sorted(others + [targets[b, t].item()]))
    kept[1, 3] = -1  # no mask at this position
    scores = chunked_scores(hidden, weight, None, targets, 0.8, True, chunk_bytes=4 * vocab * 3, kept=kept)
    logits = hidden @ weight.T / 0.8
    member = torch.zeros(rows, width, vocab, dtype=torch.bool)
    for b, t, k in (kept >= 0).nonzero().tolist():
        member[b, t, kept[b, t, k]] = True
    member[1, 3] = True
    masked = logits.masked_fill(~member, -torch.inf)
    expected = torch.log_softmax(masked, -1).gather(-1, targets[..., None]).squeeze(-1)
    probs = torch.softmax(masked, -1)
    entropy = -(probs * torch.log_softmax(masked, -1).nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(scores[..., 0], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores[..., 1], entropy, rtol=1e-10, atol=1e-12)
    upstream = torch.randn(rows, width, dtype=F64)
    grads = torch.autograd.grad((scores[..., 0] * upstream).sum(), [hidden, weight])
    for got, want in zip(grads, torch.autograd.grad((expected * upstream).sum(), [hidden, weight])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
