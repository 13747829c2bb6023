"""The flag groups every script shares: settings a method never changes, held by each script's `Args`.

    @dataclass
    class Args:
        lr: float = 1e-4                                     # the script's own flags
        ...
        evaluation: Group[Evaluation] = field(default_factory=Evaluation)
        systems: Group[Systems] = field(default_factory=Systems)

    python algorithms/grpo.py --lora-rank 16 --eval-every 5  # a group's flags keep their plain names

`Group[...]` flattens a group into the command line (tyro's OmitArgPrefixes): every flag keeps its name and the
group is shown under its own heading in `--help`. common/ receives a group, or plain values, never a script's
`Args`, so a fork can delete any flag of its own (or a whole group's use) without touching common/.
`flat(args)` gives the run's settings under their flag names, as config.json and the checkpoints keep them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import tyro
import tyro._strings

T = TypeVar("T")
Group = Annotated[T, tyro.conf.OmitArgPrefixes]  # a group whose flags keep their plain names


def _reflowed(remove_single_line_breaks):
    """tyro (1.0.17, requirements.txt) joins a flag's docstring lines into one paragraph only where the next line starts
    with a letter, and it dedents after joining: every indented continuation line of a docstring wrapped in the
    source broke the `--help` text mid-sentence. Dedented first (inspect.cleandoc), the lines join; a line that
    starts a list (`-`, a digit, a parenthesis) still starts a line of its own."""
    return lambda helptext: remove_single_line_breaks(inspect.cleandoc(helptext))


tyro._strings.remove_single_line_breaks = _reflowed(tyro._strings.remove_single_line_breaks)


@dataclass
class TaskFormat:
    """How a task's rows become prompts."""

    question_column: str = "question"
    """question column of a local task file"""
    answer_column: str = "answer"
    """answer column of a local task file"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one"""


@dataclass
class Sampling:
    """Top-p / top-k sampling, and the kept sets the trainer scores with (common/logprobs.py)."""

    top_p: float = 1.0
    """nucleus sampling: each token from the most likely ones whose probability reaches top_p (1: off)"""
    top_k: int = 0
    """each token from the k most likely (0: off); vLLM returns at most 20 kept tokens, so --top-p needs it there"""
    keep_sampling_mask: bool = True
    """with --top-p / --top-k: π_θ, π_old, π_ref and charts/entropy renormalised over the tokens the engine kept
    (DeepSeek-V3.2); --no-keep-sampling-mask scores the full vocabulary: the naive mismatch"""


@dataclass
class Tools:
    """Episodes with tools (a task file's TOOLS; common/tools.py)."""

    max_turns: int = 4
    """the policy's turns per episode at most (a call on the last one is not run)"""
    max_episode_tokens: int = 0
    """an episode's tokens at most, the tools' outputs included (0: twice --max-new-tokens); --max-new-tokens bounds
    the policy's own"""


@dataclass
class Evaluation:
    """Held-out evaluation (common/evaluate.py): greedy accuracy, avg@k and pass@k."""

    eval_task: str | None = None
    """held-out task (its test split); defaults to --task (a local file: a seeded 10% of it, held out)"""
    eval_every: int = 10
    """evaluate every this many steps (0: never)"""
    eval_prompts: int = 256
    """held-out prompts per evaluation"""
    eval_k: int = 4
    """samples per held-out prompt for avg@k and pass@k (0: greedy accuracy only)"""


@dataclass
class Tracking:
    """Weights & Biases (the run folder's metrics.jsonl and curves.png are always written)."""

    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to work without a network)"""
    wandb_project_name: str = "clean-llm-rl"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""


@dataclass
class Checkpoints:
    """Checkpoints (common/checkpoint.py): the policy, the optimizer and the step, to resume from."""

    save_every: int = 50
    """checkpoint every this many steps (and at the end; 0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep (0: all)"""

    def due(self, step: int, steps: int) -> bool:
        """Whether the run saves after step `step` (counted from 1) of `steps`: every --save-every, and the last."""
        return (self.save_every > 0 and step % self.save_every == 0) or step == steps


@dataclass
class Systems:
    """The engine and the systems: where and how the run executes (engine, precision, memory, adapters)."""

    rollout_engine: Literal["auto", "hf", "vllm"] = "auto"
    """vllm (in-process vLLM), hf (transformers generate), or auto: vllm on a GPU when installed, else hf"""
    rollout_lag: int = 0
    """step t trains on rollouts sampled with the weights of step t − k, as a k-step asynchronous pipeline feeds its
    trainer (the first k steps: with the initial weights; common/rollouts.py); 0: the step's own weights"""
    overlap_rollouts: bool = False
    """with --rollout-lag k: sample step t + k's batch on a thread of its own while step t trains (on the engine's own
    copy of the weights), as an asynchronous pipeline does; the same batches and metrics as without"""
    engine_process: bool = False
    """vllm: the engine in a process of its own, on a GPU of its own (rank r of n on a node: GPU n + r; on a CPU,
    the CPU), sent the new weights by a broadcast after each step (NCCL; gloo on a CPU); with --overlap-rollouts, an
    asynchronous pipeline's engine (common/engines.py EngineProcess)"""
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "int8"] = "auto"
    """engine weights' dtype; auto: hf the trainer's weights, vllm the trainer's compute dtype on GPU (another is a
    train-inference mismatch); fp8 / int8 (hf): Linear weights rounded through float8 e4m3 / int8 per output channel"""
    gpu_memory_utilization: float = 0.3
    """vllm: fraction of GPU memory for the engine (weights and KV cache); the trainer gets the rest (with
    --engine-process: of the engine's own GPU, where 0.9 leaves the trainer nothing to lose)"""
    vllm_sleep_mode: bool = False
    """vllm on GPU: free the engine's GPU memory while training (sleep level 1)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """trainer compute dtype (weights stay float32); auto: bfloat16 on GPU, float32 on CPU; float16 scales the loss"""
    fp32_lm_head: bool = False
    """the output layer in float32 in the trainer (under bf16 / fp16 autocast) and in a bf16 / fp16 engine, as
    MiniMax-M1 does (arXiv:2506.13585): the rounding of logits over a large vocabulary is mismatch. vLLM's head_dtype
    multiplies its bf16 hidden states and weight into float32 logits; the trainer upcasts both first"""
    cpu_offload: bool = False
    """with several ranks (torchrun), keep sharded parameters and optimizer state in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward: less memory for long responses, more compute"""
    lora_rank: int = 0
    """r of the LoRA adapters (peft) trained beside the frozen weights (0: full fine-tuning; ~0.5% of an 8B model at
    16). vLLM generates from merged weights; the hf engine on one rank runs peft's unmerged adapters at every token,
    about 3x slower (merging in place would round the frozen weights at every push)"""
    lora_alpha: float = 32.0
    """LoRA's α: an adapted layer computes with W + (α/r)·B·A"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """the Linear layers given adapters, by name (e.g. q_proj v_proj); all-linear: every one but the output layer"""


def flat(args) -> dict:
    """{flag name: value} of a script's `Args`, its groups' flags included under their plain names."""
    values = {}
    for spec in dataclasses.fields(args):
        value = getattr(args, spec.name)
        values |= flat(value) if dataclasses.is_dataclass(value) else {spec.name: value}
    return values


def names(cls) -> set[str]:
    """The flag names of a script's `Args` class, its groups' included."""
    return set(flat(make(cls)))


def make(cls, **values):
    """`cls` (a script's `Args`) from flag names, each put in the group that holds it: make(Args, lr=1e-3,
    lora_rank=8). An unknown name is a TypeError, as for the dataclass itself."""
    own, groups = {}, {}
    for spec in dataclasses.fields(cls):
        group = spec.default_factory if dataclasses.is_dataclass(spec.default_factory) else None
        if group is None:
            own[spec.name] = spec
            continue
        names = {f.name for f in dataclasses.fields(group)}
        groups[spec.name] = group(**{k: values[k] for k in names if k in values})
    unknown = set(values) - set(own) - {k for g in groups.values() for k in flat(g)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no flag(s) {sorted(unknown)}")
    return cls(**{k: v for k, v in values.items() if k in own}, **groups)


def assign(args, **values) -> None:
    """Set flags of `args` in place, by their plain names, in whichever group holds each."""
    for name, value in values.items():
        holder = args if name in {f.name for f in dataclasses.fields(args)} else None
        for spec in dataclasses.fields(args) if holder is None else ():
            group = getattr(args, spec.name)
            if dataclasses.is_dataclass(group) and name in {f.name for f in dataclasses.fields(group)}:
                holder = group
        if holder is None:
            raise TypeError(f"{type(args).__name__} has no flag {name}")
        setattr(holder, name, value)


def replace(args, **values):
    """A copy of `args` with flags (plain names, in any group) changed."""
    return make(type(args), **(flat(args) | values))
