"""EMA-KPO: KPO's causal log-ratio filter as a scheduled EMA, with the Kalman filter it simplifies.

Papers: EMA-KPO, "Simplifying Kalman Policy Optimization with Fixed-Gain Exponential Smoothing"
(FARS, 2026; no arXiv id, code gitlab.com/fars-a/kpo-simple-smoothing); KPO, "Online Causal
Kalman Filtering for Stable and Effective Policy Optimization" (He et al., 2026,
arXiv:2602.10609); GRPO (arXiv:2402.03300).

Objective. GRPO's, with each token's ratio replaced by a causal low-pass filter of the
token log-ratios along its response (equation numbers are the EMA-KPO paper's; A_i:
GRPO's group-normalized advantages):

    z_t   = log π_θ(o_t | q, o_<t) − log π_old(o_t | q, o_<t)              (Eq. 1; detached)
    ρ̂_t   = (1 − α_t) ρ̂_t−1 + α_t z_t,  ρ̂_0 = 0,  α_t = K_t (Eqs. 4, 5, 7)   (Eqs. 6, 9)
    r̃_t   = exp(log π_θ(o_t) − sg(log π_θ(o_t)) + sg(ρ̂_t))
            its value exp(ρ̂_t), its gradient exp(ρ̂_t)·∇log π_θ
    J(θ)  = 1/N Σ_i 1/|o_i| Σ_t min(r̃_it A_i, clip(r̃_it, 1 − ε_low, 1 + ε_high) A_i)
            (ε_low, ε_high: the paper's ε−, ε+)

The model behind it: a random walk ρ_t = ρ_t−1 + η (variance Q = 1e-6) observed as
z_t = ρ_t + ε (variance V = 1) (Eqs. 2-3). The covariance recursion never sees z, so
the gains K_t depend only on the position t: the Kalman filter IS an EMA with a schedule
fixed before training (Eq. 9), which EMA-KPO runs.

How to read this file. main() is one training step after another: sample G completions per prompt,
score them, compute advantages, update the policy on minibatches, push new weights to the engine,
log, evaluate, checkpoint. The method is between `# ALGO LOGIC` and `# END ALGO LOGIC`; the rest is
plumbing a fork keeps (`# TRY NOT TO MODIFY` marks its helpers). Metrics are defined where recorded.
μ is the engine that sampled a batch, π_old the trainer at the weights this step starts from (never
μ). Three k3 KLs: mismatch/kl_k3 = KL(μ ‖ π_old), the engine against the trainer (at --rollout-lag
k ≥ 1 with the batch's staleness in it); losses/approx_kl = KL(π_old ‖ π_θ), how far the updates
moved; losses/kl_ref = KL(π_θ ‖ π_ref), the --kl-coef penalty.

What this file changes relative to grpo.py: the filtered ratio (the filter, its gains and their
flags) and the defaults ε_low = 3e-4, ε_high = 4e-4, --num-minibatches 4 and
--loss-aggregation sequence-mean (KPO's seq-mean-token-mean).

Tools. With a task that has tools (common/tools.py) a response is an episode, and a tool's output
inside it is context: no loss, no ratio, no place in any statistic; |o_i| counts the policy's own
tokens. The filter of Eq. 9 runs along the policy's own tokens, skipping an output as if it were
absent (α_t indexed by the policy's tokens).

Run it
  python algorithms/ema_kpo.py                                # the built-in task on a CPU, minutes
  python algorithms/ema_kpo.py --help                         # every flag, with its default
  python algorithms/ema_kpo.py --smoother kalman              # KPO's Kalman filter (slower)
  python algorithms/ema_kpo.py --smoother fixed --alpha 1e-2  # the fixed-gain ablation (and 1e-4)
  ./run.sh bench ema_kpo                                      # the paper's claims, built-in task
"""

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

from common import checks, fsdp
from common.adapters import load_policy
from common.batches import make_batch, micro_batches
from common.checkpoint import load_checkpoint, locked_run_folder, save_checkpoint, seed_everything
from common.checks import require
from common.engines import load_tokenizer, make_training_engine
from common.evaluate import Evaluator
from common.flags import Checkpoints, Evaluation, Group, Sampling, Systems, TaskFormat, Tools, Tracking, flat
from common.logprobs import output_layer_scores
from common.rollouts import Groups, PromptSampler, RolloutQueue, record_rollouts, record_staleness
from common.scoring import overlong_penalty, score_completions
from common.stopping import StopSignals
from common.tasks import load_prompts
from common.tiny import resolve_model
from common.tools import policy_first, record_tool_use, record_turn_mismatch, restore_order, with_tools
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
    smoother: Literal["ema", "kalman", "fixed"] = "ema"
    """ema: EMA with precomputed α_t = K_t (EMA-KPO, Eq. 9); kalman: Kalman filter, token by
    token (KPO, Eqs. 4-7); fixed: α_t = --alpha"""
    kalman_q: float = 1e-6
    """Q: variance of the random walk of the latent log-ratio (Eq. 2)"""
    kalman_v: float = 1.0
    """V: variance of the observation noise on each token's log-ratio (Eq. 3)"""
    p0: float = 1.0
    """P_0|0, prior variance of the latent log-ratio: 1 = EMA-KPO paper
    (first gain ≈ 0.5), 0 = KPO code (≈ Q)"""
    alpha: float | None = None
    """the constant gain of --smoother fixed (the paper's ablation: 1e-4
    collapses, 1e-2 trails the schedule)"""
    clip_low: float = 3e-4
    """ε_low: lower clip range of the ratio"""
    clip_high: float = 4e-4
    """ε_high: upper clip range (DAPO's clip-higher; = clip_low for PPO's symmetric clip)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "sequence-mean"
    """token-mean over the minibatch (DAPO), or mean per completion then over completions (GRPO)"""
    kl_coef: float = 0.0
    """β of the k3 KL penalty to the initial policy (0: no reference model is loaded)"""

    # optimization
    lr: float = 1e-4
    """AdamW learning rate"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up (0: none)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global norm (0: no clipping)"""
    num_minibatches: int = 4
    """optimizer steps per rollout batch and epoch (EMA-KPO needs > 1:
    with one update r̃ ≡ 1; 4: the KPO script's)"""
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


# ALGO LOGIC: the log-ratio filter and its ratio, the clipped surrogate, advantages, loss averaging
def kalman_gains(length: int, q: float = 1e-6, v: float = 1.0, p0: float = 1.0) -> torch.Tensor:
    """Gains K_1..K_length (float64) of the Kalman filter of Eqs. 2-3 from P_0|0 = p0: a
    schedule of the position. p0 = 1 (the EMA-KPO paper): K_1 = (P0 + Q)/(P0 + Q + V) ≈ 0.5,
    then K_t ≈ 1/(t + 1) for t ≪ 1/√Q = 1000, so ρ̂_t ≈ the causal prefix mean of z (a
    constant z is followed to 50% at t = 1, 99% at t = 100). p0 = 0 (the KPO code): K grows
    from Q/(Q + V) ≈ 1e-6 by about Q per token: r̃ ≈ 1, never clipped, for hundreds of tokens
    (0.5% of a constant z at t = 100, 11% at 500, 35% at 1000). Both reach K_∞ ≈ 9.995e-4
    (Eq. 8), within 1% at t ≈ 2650."""
    gains, posterior = [], p0
    for _ in range(length):
        prior = posterior + q  # P_t|t−1 = P_t−1|t−1 + Q             (Eq. 4)
        gain = prior / (prior + v)  # K_t = P_t|t−1 / (P_t|t−1 + V)  (Eq. 5)
        posterior = (1 - gain) * prior  # P_t|t = (1 − K_t) P_t|t−1   (Eq. 7)
        gains.append(gain)
    return torch.tensor(gains, dtype=torch.float64)


def gain_schedule(args, length: int) -> torch.Tensor:
    """α_1..α_length of the EMA (Eq. 9): the Kalman gains, or --alpha. They depend on the
    position alone, so the filter needs no covariance state (update_policy computes them per
    rollout batch: 1 ms at 8k tokens)."""
    if args.smoother == "fixed":
        return torch.full((length,), args.alpha, dtype=torch.float64)
    return kalman_gains(length, args.kalman_q, args.kalman_v, args.p0)


def ema_filter(z: torch.Tensor, alphas: torch.Tensor, block: int = 64) -> torch.Tensor:
    """ρ̂_t = (1 − α_t) ρ̂_t−1 + α_t z_t with ρ̂_0 = 0 (Eq. 9) along each row of z [B, T], no
    loop over tokens. alphas: at least T gains in [0, 1), shared by the rows. Unrolled,
    ρ̂_t = Σ_i≤t α_i exp(L_t − L_i) z_i with L_t = Σ_j≤t log(1 − α_j), a matrix product
    within blocks of `block` tokens, then across them. Every exponent is ≤ 0: nothing
    overflows. Float64 inside: relative error < 1e-7 against a loop at 8192 tokens."""
    rows, length = z.shape
    if len(alphas) < length:
        raise ValueError(f"ema_filter: {len(alphas)} gains for {length} tokens")
    blocks = -(-length // block)
    # α = 0 and z = 0 past the end
    alpha = torch.zeros(blocks, block, dtype=torch.float64, device=z.device)
    alpha.view(-1)[:length] = alphas[:length]
    x = torch.nn.functional.pad(z.double(), (0, blocks * block - length)).view(rows, blocks, block)
    # L_t from the start of each block (the clamp only acts where α rounds to 1: log 0 = −inf)
    log_decay = torch.log1p(-alpha).clamp(min=-50).cumsum(1)
    causal = torch.ones(block, block, dtype=torch.bool, device=z.device).tril()
    exponent = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~causal, float("-inf"))
    # W[b, t, i] = α_i exp(L_t − L_i), 0 for i > t
    weights = alpha[:, None, :] * torch.exp(exponent)
    inner = torch.einsum("rbi,bti->rbt", x, weights)  # each block as if ρ̂ were 0 just before it
    # the value at each block's end: e_b = inner_b,end + exp(L_b,end) e_b−1,
    # unrolled the same way over blocks
    block_log_decay = log_decay[:, -1].cumsum(0)
    causal = torch.ones(blocks, blocks, dtype=torch.bool, device=z.device).tril()
    exponent = (block_log_decay[:, None] - block_log_decay[None, :]).masked_fill(~causal, float("-inf"))
    ends = inner[:, :, -1] @ torch.exp(exponent).T
    # ρ̂ just before each block (0 before the first)
    carry = torch.nn.functional.pad(ends[:, :-1], (1, 0))
    filtered = inner + torch.exp(log_decay) * carry[:, :, None]
    return filtered.reshape(rows, blocks * block)[:, :length].to(z.dtype)


def kalman_filter(z: torch.Tensor, q: float, v: float, p0: float) -> torch.Tensor:
    """KPO's filter as written (Eqs. 4-7): token by token, with each row's posterior
    variance as state. z [B, T] -> ρ̂ [B, T]. The same numbers as ema_filter with
    kalman_gains, in T sequential steps."""
    estimate = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)  # ρ̂_0 = 0
    variance = torch.full_like(estimate, p0)  # P_0|0
    filtered = torch.empty(z.shape, dtype=torch.float64, device=z.device)
    for t in range(z.shape[1]):
        prior = variance + q  # Eq. 4
        gain = prior / (prior + v)  # Eq. 5
        estimate = (1 - gain) * estimate + gain * z[:, t].double()  # Eq. 6
        variance = (1 - gain) * prior  # Eq. 7
        filtered[:, t] = estimate
    return filtered.to(z.dtype)


def filtered_ratio(logprobs, rho_hat, max_log_ratio=10.0):
    """r̃ = exp(log π − sg(log π) + sg(ρ̂)): value exp(ρ̂), gradient exp(ρ̂)·∇log π; no
    gradient through the filter (KPO's construction, as GSPO-token's). log r̃ is clamped at
    `max_log_ratio`, as in the KPO code."""
    return torch.exp(torch.clamp(logprobs - logprobs.detach() + rho_hat.detach(), max=max_log_ratio))


def clipped_surrogate_loss(ratio, advantages, clip_low, clip_high):
    """Per-token −min(r̃A, clip(r̃, 1−ε_low, 1+ε_high)A), and where the clip is active (no
    gradient). ratio: [B, T], the filtered r̃; advantages: [B] (one per completion). With the
    tiny default range, a token stops contributing once ρ̂ passes log(1 + ε_high) (A > 0) or
    log(1 − ε_low) (A < 0): a trust region on ρ̂."""
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    clipped_below = (ratio < 1 - clip_low) & (advantages < 0)
    clipped_above = (ratio > 1 + clip_high) & (advantages > 0)
    return -torch.minimum(unclipped, clipped), clipped_below | clipped_above


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


def record_mismatch(metrics, batch, old_logprobs):
    """The train-inference mismatch over the response tokens of `batch` (or of a micro-batch), μ
    being the engine's log-probs: mismatch/kl_k3 = k3 KL(μ ‖ π_old) = E_μ[ρ − 1 − log ρ]
    with ρ = π_old/μ, and mismatch/max_abs_logprob_diff."""
    log_ratio, mask = (old_logprobs - batch["sampler_logprobs"]).detach(), batch["response_mask"]
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    metrics.mean("mismatch/kl_k3", (k3 * mask).sum(), mask.sum())
    metrics.max("mismatch/max_abs_logprob_diff", log_ratio.abs() * mask)
    record_turn_mismatch(metrics, k3, mask, batch.get("later_turns"))  # tools: kl_k3_*_turn(s)
    record_staleness(metrics, batch, old_logprobs)  # --rollout-lag: kl_k3_discrepancy, _staleness


# the curves of curves.png, and the progress bar's numbers
PLOTTED = ["charts/reward", "eval/greedy_accuracy", "charts/entropy", "charts/response_length_mean"]
PLOTTED += ["losses/approx_kl", "losses/clip_fraction", "losses/grad_norm", "losses/rho_hat_abs_mean", "mismatch/kl_k3"]
PROGRESS = ["charts/reward", "eval/greedy_accuracy", "memory/peak_allocated_gib"]
# END TRY NOT TO MODIFY


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
    if multiple_updates:
        batch["old_logprobs"] = batch_logprobs(policy, batch, args, autocast)[0]  # log π_old
        record_mismatch(metrics, batch, batch["old_logprobs"])
    if reference is not None:  # β > 0
        batch["ref_logprobs"] = batch_logprobs(reference, batch, args, autocast)[0]  # log π_ref

    # the EMA's α_t (Eq. 9), one per response column
    width = batch["response_ids"].shape[1]
    gains = gain_schedule(args, width).to(every_row.device)
    # END ALGO LOGIC

    # plumbing: minibatches (token totals over every rank) and micro-batches (memory only), around
    # the method's ALGO LOGIC regions
    skipped = 0
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
                with autocast:
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                # ALGO LOGIC: the EMA-KPO loss of this micro-batch
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1), never the engine's μ: where a staleness fix begins
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # z of the current π_θ (≡ 0 until the batch's first optimizer step); 0 at the right
                # padding, which a causal filter cannot carry into a valid token
                z = (logprobs - old_logprobs).detach() * mask  # token log-ratios (Eq. 1), float32
                # with tools, the filter runs along the policy's own tokens: a tool's
                # output is skipped, as if absent
                order = policy_first(mask)
                # ρ̂_t, causal along each response, per sequence (so rank-local)
                if args.smoother == "kalman":
                    # KPO (Eqs. 4-7)
                    rho_hat = kalman_filter(z.gather(1, order), args.kalman_q, args.kalman_v, args.p0)
                else:
                    rho_hat = ema_filter(z.gather(1, order), gains)  # EMA-KPO (Eq. 9)
                rho_hat = restore_order(rho_hat, order)
                # r̃_t (losses/clip_fraction, ratio_min|max are r̃'s)
                ratio = filtered_ratio(logprobs, rho_hat)
                token_losses, clip_active = clipped_surrogate_loss(
                    ratio, micro["advantages"], args.clip_low, args.clip_high
                )
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
                    # how far ρ̂ moves
                    metrics.mean("losses/rho_hat_abs_mean", (rho_hat.abs() * mask).sum(), tokens)
                    # the largest |ρ̂| (compare with ε_low, ε_high)
                    metrics.max("losses/rho_hat_abs_max", rho_hat[valid].abs())
                    if not multiple_updates:  # one pass sees every rollout, under π_old
                        record_mismatch(metrics, micro, old_logprobs)
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
    return skipped


def check_args(args: Args) -> None:
    """Every flag's range, before anything loads: one error lists every problem (NaN fails all)."""
    problems = checks.shared_flags(args)  # experiment, rollouts, optimization, evaluation, systems
    # ALGO LOGIC: this method's flags
    problems += require(0 <= args.clip_low < 1, "--clip-low", "in [0, 1)")
    problems += require(0 <= args.clip_high < math.inf, "--clip-high", ">= 0 and finite")
    problems += require(0 <= args.kl_coef < math.inf, "--kl-coef", ">= 0 and finite")
    problems += require(0 < args.kalman_q < math.inf, "--kalman-q", "> 0 and finite")
    problems += require(0 < args.kalman_v < math.inf, "--kalman-v", "> 0 and finite")
    problems += require(0 <= args.p0 < math.inf, "--p0", ">= 0 and finite")
    # the filter smooths z = log π_θ − log π_old, which is 0 throughout a batch's only update
    updates = args.num_minibatches * args.update_epochs
    problems += require(updates > 1, "--num-minibatches × --update-epochs", "> 1 (with one update, EMA-KPO is GRPO)")
    if args.smoother == "fixed":
        problems += require(args.alpha is not None and 0 < args.alpha < 1, "--alpha", "in (0, 1) with --smoother fixed")
        problems += checks.unused(args, ["kalman_q", "kalman_v", "p0"], "applies to --smoother ema / kalman only")
    else:
        problems += require(args.alpha is None, "--alpha", "left out: it applies to --smoother fixed only")
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
    engine = make_training_engine(systems, policy, tokenizer, dist, checkpoint or args.model, data.context, args.seed)
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
        record_rollouts(metrics, groups)

        # 3-4. old / reference log-probs, then the minibatch updates (the engine sleeps meanwhile)
        with metrics.timer("time/train"):
            engine.sleep()
            queue.score_under_sampling_weights(batch_logprobs, policy, args, precision.autocast)
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


# Paper scale: the KPO script's setting that EMA-KPO follows, on 8 80 GB GPUs with torchrun (FSDP2)
#   torchrun --nproc_per_node 8 algorithms/ema_kpo.py --model Qwen/Qwen3-4B-Base --task dapo_math \
#       --eval-task aime24 --steps 500 --prompts-per-step 32 --group-size 8 --max-new-tokens 4096 \
#       --max-prompt-tokens 1024 --lr 1e-6 --warmup-steps 100 --weight-decay 0.1 \
#       --num-minibatches 4 --micro-batch-size 4 --gradient-checkpointing --dtype bfloat16 \
#       --vllm-sleep-mode --gpu-memory-utilization 0.5 --eval-every 50 --eval-k 16 --track
# Memory per GPU (`python -m common.memory --gpus 8` with these flags): training state 7.5 GiB
# (16 bytes × 4.02 B parameters / 8), bf16 gathers 1.1, checkpointed activations 8.4
# (4 × 5,120 tokens, 166 KiB per token per layer), output-layer chunks 0.5, the sleeping
# engine 1.0, CUDA 1.5: 20 GiB in the update; 47 GiB while vLLM generates (its 0.5 × 80 beside
# the weights and AdamW state): fits. One GPU does not: 60 GiB of training state alone.
# Overlapped, each engine on a GPU of its own: torchrun --nproc_per_node 4 on the 8 GPUs,
# --rollout-lag 1 --overlap-rollouts --engine-process --gpu-memory-utilization 0.9 in place of the
# sleep mode and its 0.5: per trainer GPU 26.5 GiB (the training state 15.0 over 4 ranks), per
# engine GPU 72 (7.5 of it weights).
#
# Differences from the authors' code (KPO's: github.com/shuohe1995/verl-kpo,
# core_algos.py; EMA-KPO's is not public):
# - P0 = 1 here, as the EMA-KPO paper states; 0 in the KPO code (--p0 0).
# - Its gains come in closed form (kalman_gains_nonsteady_1d: a Möbius map through sinh), clamped to
#   [1e-6, 1 − 1e-6] and computed in float32, where 1 + Q/2 rounds to 1 + 4.77e-7 for Q = 1e-6: its
#   K_t run above Eq. 8's (P0 = 0: K_1000 = 7.69e-4 against 7.61e-4, K_8000 = 1.0234e-3
#   against 9.995e-4, up to 2.4% off), so with z ≡ 0.01 its filtered log-ratio is 0.2-0.6% high
#   over 1,000-3,000 tokens (t = 1,000: 3.538e-3 against 3.522e-3), enough to flip clip decisions
#   near ε = 3e-4 / 4e-4 on long responses. Here the gains come from the float64 recursion
#   (Eqs. 4, 5, 7), unclamped; the same closed form in float64 agrees with it to 1e-6 relative.
# - Its filter is exp(L_t)·Σ_i α_i exp(−L_i) z_i (see ema_filter) in float32: it overflows once
#   L_t < −88 (α = 0.1 after 840 tokens) and, with its clamp exp(L) ≥ 1e-30, stops decaying once
#   L_t < −69 (α = 0.01 after about 6,870 tokens). For Q = 1e-6 the two agree (its exponents
#   stay above −15 at 8k tokens).
# - Its seq-mean-token-mean averages per micro-batch and rescales; here the mean is over the
#   minibatch's responses on all ranks (the same when micro-batches are of equal size). Advantages
#   divide by std + 1e-4 here, 1e-6 there.
# - Its script also warms the lr up over 5% of the optimizer steps, uses weight decay 0.1 and
#   samples Qwen3-4B without thinking; the command above adds the warm-up and weight decay.
