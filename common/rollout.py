"""Rollout engines: sample completions and the sampler's own log-probs of the sampled tokens.

    engine = make_engine("hf", policy, tokenizer)
    completions = engine.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0)
    # len(completions) == len(prompt_ids) * n; prompt i owns completions[i*n : (i+1)*n]
    engine.load_weights(policy.state_dict().items())   # after each optimizer step

Every engine returns, per completion, the sampled token ids (EOS included when sampled), the
log-probability of each sampled token under the distribution it was sampled from (logits divided by
the temperature, full vocabulary: top_p = 1 and no top-k, as RL needs), and why it stopped.

`HFEngine` is transformers' `generate`. It shares the trainer's module when the dtypes agree (then a
weight push costs nothing), or keeps its own copy in another dtype (`dtype="bfloat16"`), which is how
to produce a real train-inference mismatch on a CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Literal

import torch
from transformers import LogitsProcessor, LogitsProcessorList


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # sampler's log-prob of each token in token_ids (after temperature)
    finish_reason: Literal["stop", "length"]  # stop: an EOS was sampled; length: max_new_tokens reached


class _RecordSampledLogprobs(LogitsProcessor):
    """Divides the logits by the temperature and remembers the log-softmax of each step, so that on
    the next step (when the sampled token is visible in input_ids) the sampled token's log-prob is
    read off. Holds one step's [batch, vocab] at a time, not the whole [batch, steps, vocab]."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.sampled_logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.read_sampled(input_ids[:, -1])
        scores = scores / self.temperature
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def read_sampled(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.sampled_logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))
            self.previous = None


class HFEngine:
    """Sampling with transformers' `generate` (the fallback when vLLM is absent; the CPU default)."""

    def __init__(self, model, tokenizer, dtype: torch.dtype | None = None, max_batch_size: int = 1024,
                 share_weights: bool = True):
        same_dtype = dtype is None or dtype == next(model.parameters()).dtype
        if share_weights and same_dtype:
            self.model, self.shares_trainer_weights = model, True
        else:  # its own copy: another dtype, or a trainer whose weights will be sharded across ranks
            self.model, self.shares_trainer_weights = copy.deepcopy(model).to(dtype), False
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        self.max_batch_size = max_batch_size

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0
    ) -> list[Completion]:
        if top_p != 1.0:
            raise ValueError("HFEngine samples from the full distribution: top_p must be 1.0")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        prompts_per_chunk = max(1, self.max_batch_size // n)
        completions = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompt_ids), prompts_per_chunk):
                chunk = prompt_ids[start : start + prompts_per_chunk]
                completions += self._generate_chunk(chunk, n, max_new_tokens, temperature)
        finally:
            self.model.train(was_training)
        return completions

    def _generate_chunk(self, prompt_ids, n, max_new_tokens, temperature) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompt_ids], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        greedy = temperature == 0
        recorder = _RecordSampledLogprobs(1.0 if greedy else temperature)
        # temperature is applied by the recorder, so it sees exactly the distribution sampled from
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **sampling,
            num_return_sequences=1 if greedy else n,
            max_new_tokens=max_new_tokens,
            logits_processor=LogitsProcessorList([recorder]),
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
        )
        new_tokens = sequences[:, width:]
        recorder.read_sampled(new_tokens[:, -1])
        logprobs = torch.stack(recorder.sampled_logprobs, dim=1)
        if greedy and n > 1:  # greedy decoding is deterministic: n copies of one completion
            new_tokens, logprobs = new_tokens.repeat_interleave(n, dim=0), logprobs.repeat_interleave(n, dim=0)
        return [self._trim(tokens.tolist(), lps.tolist()) for tokens, lps in zip(new_tokens, logprobs)]

    def _trim(self, tokens: list[int], logprobs: list[float]) -> Completion:
        for position, token in enumerate(tokens):
            if token in self.eos_ids:
                return Completion(tokens[: position + 1], logprobs[: position + 1], "stop")
        return Completion(tokens, logprobs, "length")

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights (Hugging Face names) into the engine. Free when shared."""
        if self.shares_trainer_weights:
            return
        own = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name in own:
                own[name].copy_(tensor)

    def sleep(self) -> None:  # nothing to free: the engine owns no cache between calls
        pass

    def wake_up(self) -> None:
        pass


def _eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def make_engine(kind: str, model, tokenizer, dtype: str = "auto", max_batch_size: int = 1024,
                share_weights: bool = True):
    """`kind`: "auto" (vLLM when it is installed and a GPU is present; for now always "hf") or "hf".
    `dtype`: "auto" (the trainer's) or "float32" / "bfloat16" / "float16" for a separate engine copy.
    `share_weights`: the engine may generate with the trainer's own module (one process)."""
    if kind not in ("auto", "hf"):
        raise ValueError(f"unknown rollout engine {kind!r}: use 'auto' or 'hf'")
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype, None)
    if dtype != "auto" and not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown engine dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return HFEngine(model, tokenizer, dtype=torch_dtype, max_batch_size=max_batch_size, share_weights=share_weights)
