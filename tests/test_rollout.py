"""The HF rollout engine: completions, finish reasons, and sampler log-probs that match the trainer."""

import pytest
import torch

from common.rollout import HFEngine, make_engine

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


def test_greedy_is_the_argmax(tiny):
    model, tokenizer = tiny
    prompts = _prompt_ids(tokenizer)
    completions = HFEngine(model, tokenizer).generate(prompts, n=2, max_new_tokens=5, temperature=0.0)
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
    with pytest.raises(ValueError, match="top_p must be 1.0"):
        HFEngine(model, tokenizer).generate(_prompt_ids(tokenizer), 1, 2, 1.0, top_p=0.9)


def _chat_tokenizer(tokenizer):
    """The built-in tokenizer with a Qwen-style chat template and its <|im_end|> special token."""
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return chat


def test_chat_models_stop_at_the_end_of_turn_token(tiny):
    from common.rollout import end_of_turn_ids

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
