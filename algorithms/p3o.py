"""P3O: the batch's effective sample size replaces the clip and sets a KL to the behavior policy.

Paper: "Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training"
(Smola, Aubry, Stranges, Fakoor, 2026, arXiv:2605.12380), whose objective is recovered here from the
authors' code (github.com/FeynRL-project/FeynRL, algs/P3O/p3o.py) and blog
(feynrl-project.github.io/blogs/episode_two.html). Its ancestor, P3O (Fakoor, Chaudhari, Smola,
2019, arXiv:1905.01756): IS cap c = ESS, KL coefficient 1 − ESS.

Objective. The behavior policy μ (the rollout engine, recording its log-probs of the sampled
tokens) samples the completions; B: the N valid response tokens of one optimizer step (all
micro-batches, all ranks). Minimize

    L(θ) = 1/N · Σ_t [−sg(min(ρ_t, e_B)) · A_t · log π_θ(y_t) + (1 − e_B) · (log ρ_t + 1/ρ_t − 1)]
    ρ_t  = π_θ(y_t | x, y_<t) / μ(y_t | x, y_<t)          the ratio to the behavior policy
    e_B  = (Σ_B ρ_t)² / (N · Σ_B ρ_t²)  ∈ [1/N, 1]        normalized ESS of the batch, a constant
    A_t  = A_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)   of the completion i owning t

The first term is REINFORCE with a detached weight capped at the batch ESS (Eq. 11: the
"ESS-driven cap"); the second, the k3 estimate of KL(π_θ ‖ μ), switches on as the ratios spread;
no clip. On-policy (the default) ρ_t ≈ e_B ≈ 1: token-mean REINFORCE, grpo.py's gradient. P3O
acts on off-policy data: --sampling-temperature 1.2, --rollout-lag k (stale rollouts),
--engine-dtype bfloat16, --num-minibatches > 1 (π_θ drifts from μ: e_B drops).

What this file changes relative to grpo.py: the loss above replaces the clipped surrogate
(--clip-low/high); ratios to μ, not π_old; e_B from a no-grad pass per optimizer step
(--ess-scope micro-batch: per micro-batch, as the authors); off-policy flags; --loss clip
(--clip-eps), the paper's GRPO baseline, for `./run.sh bench p3o`.

How to read this file. main() is one training step after another: sample G completions per prompt,
score them, compute advantages, update the policy on minibatches, push new weights to the engine,
log, evaluate, checkpoint. The method is between `# ALGO LOGIC` and `# END ALGO LOGIC`; the rest is
plumbing a fork keeps (`# TRY NOT TO MODIFY` marks its helpers). Metrics are defined where recorded.
μ is the engine that sampled a batch, π_old the trainer at the weights this step starts from (never
μ). Three k3 KLs: mismatch/kl_k3 = KL(μ ‖ π_old), the engine against the trainer (at --rollout-lag
k ≥ 1 with the batch's staleness in it); losses/approx_kl = KL(π_old ‖ π_θ), how far the updates
moved; losses/kl_ref = KL(π_θ ‖ π_ref), the --kl-coef penalty.

Tools. With a task that has tools (common/tools.py) a response is an episode, and a tool's output
inside it is context: no loss, no ratio, no place in any statistic; |o_i| counts the policy's own
tokens. The batch ESS e_B and its N are over the policy's tokens only.

Metrics in this fork. losses/approx_kl compares π_θ with π_old, which P3O does not use: 0 at one
update per batch, stale rollouts or not; mismatch/kl_k3 compares μ with π_old, so it includes
--rollout-lag's staleness and --sampling-temperature's gap; losses/policy_loss is a surrogate whose
value means nothing beyond its gradient; losses/ess is e_B, the loss's own; tis_icepop.py's
correction/ess is the ESS of its weights, only logged. Left out from grpo.py: --ratio-level
sequence and token-sum-norm aggregation (P3O's loss is a token mean over B, with no clipped ratio).

Run it
  python algorithms/p3o.py                       # the built-in task on a CPU, on-policy
  python algorithms/p3o.py --help                # every flag, with its default
  ./run.sh bench p3o                             # P3O vs GRPO ε = 0.2/0.4/0.6, three settings
  python algorithms/p3o.py --sampling-temperature 1.2    # off-policy: rollouts at T = 1.2, π_θ at 1
  python algorithms/p3o.py --rollout-lag 1               # stale rollouts: a one-step pipeline
"""

import collections
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
    """temperature of π_θ (the trainer divides its logits by it) and of evaluation; also the
    engine's unless --sampling-temperature"""
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
    ess_scope: Literal["minibatch", "micro-batch"] = "minibatch"
    """e_B over one optimizer step's tokens (the paper's batch) or of each
    micro-batch (authors' code), all ranks; micro-batch keeps the minibatch's shuffled order (no
    sort by length, which would change each micro-batch's e_B), and makes --micro-batch-size part of
    the loss: keep it on --resume (which lets it change, as memory alone elsewhere)"""
    sampling_temperature: float | None = None
    """rollout temperature of the engine (μ) when it differs from --temperature (π_θ):
    off-policy data, e.g. 1.2"""
    loss: Literal["p3o", "clip"] = "p3o"
    """p3o: the P3O loss; clip: the paper's GRPO baseline, the clipped
    surrogate on the same ratio ρ = π_θ/μ"""
    clip_eps: float = 0.2
    """ε of --loss clip: ρ clipped to [1 − ε, 1 + ε] (the paper's GRPO baselines: 0.2, 0.4,
    0.6)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
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


# ALGO LOGIC: ratios to the behavior policy, the batch ESS, the P3O loss, the clip baseline;
# advantages, token averaging
def behavior_log_ratio(logprobs, sampler_logprobs, mask):
    """log ρ = log π_θ − log μ at valid tokens, clamped to ±10 (numerical safety; the authors
    clamp k3's exponent at ±10), 0 at prompt / pad positions (before any exp: never
    inf · 0 = NaN). μ: the engine's tempered log-probs of the sampled tokens (the authors'
    vLLM's are raw, T = 1: a temperature shift alone would not move ρ)."""
    return torch.where(mask.bool(), logprobs - sampler_logprobs, 0.0).clamp(-10.0, 10.0)


def ratio_sums(logprobs, sampler_logprobs, mask) -> dict[str, float]:
    """Σρ, Σρ² and N over the valid tokens in float64: sums, so they add up over
    micro-batches and ranks."""
    ratio = torch.exp(behavior_log_ratio(logprobs.detach(), sampler_logprobs, mask).double())
    return {
        "ratio_sum": (ratio * mask).sum().item(),
        "ratio_sq_sum": (ratio.square() * mask).sum().item(),
        "tokens": mask.sum().item(),
    }


def effective_sample_size(sums: dict[str, float]) -> tuple[float, bool]:
    """Normalized ESS e_B = (Σρ)² / (N·Σρ²) ∈ [1/N, 1], a float (no gradient), and whether
    it fell back to 1 (as the authors): no valid token, or a sum not finite (a NaN log-prob: its
    NaN loss then skips the step)."""
    total, squares, tokens = sums["ratio_sum"], sums["ratio_sq_sum"], sums["tokens"]
    if tokens == 0 or not (math.isfinite(total) and math.isfinite(squares)):
        return 1.0, True
    # ≤ 1 by Cauchy–Schwarz; min() for rounding
    return min(1.0, total * total / (tokens * squares)), False


def minibatch_ess(policy, batch, minibatch, args, dist, autocast) -> tuple[float, bool]:
    """e_B over every valid token of one optimizer step (the paper's "tokens in the batch"), on
    all ranks, from a no-grad pass (θ is fixed until the step; +30% train time on the CPU
    default). Unneeded when each forward gives its own: per micro-batch (--ess-scope micro-batch,
    as the authors: noisier; rows in random order), or steps of one micro-batch."""
    sums = dict.fromkeys(["ratio_sum", "ratio_sq_sum", "tokens"], 0.0)
    with torch.no_grad(), autocast:
        for micro in micro_batches(batch, minibatch, args.micro_batch_size):
            logprobs = token_logprobs(policy, micro, args.temperature)[0]
            for key, value in ratio_sums(logprobs, micro["sampler_logprobs"], micro["response_mask"]).items():
                sums[key] += value
    return effective_sample_size(fsdp.all_reduce_dict(sums, dist))


def p3o_loss(logprobs, sampler_logprobs, advantages, mask, ess):
    """Per-token P3O loss −sg(min(ρ, e_B))·A·log π_θ + (1 − e_B)·(log ρ + 1/ρ − 1), with
    ρ = π_θ/μ; its gradient per token is [−min(ρ, e_B)·A + (1 − e_B)(1 − 1/ρ)]·∇log π_θ (its value
    contains −A·log π: only the gradient means something). Shapes: logprobs, sampler_logprobs
    and mask [B, T], advantages [B]; ess: a float. Returns the token losses, ρ, where the cap is
    active (ρ > e_B: noise on-policy, where ρ, e_B = 1 ± 1e-6), k3 values."""
    log_ratio = behavior_log_ratio(logprobs, sampler_logprobs, mask)
    ratio = torch.exp(log_ratio)
    # sg(min(ρ, e_B)) ≤ e_B ≤ 1, never 0: the ESS-driven cap (Eq. 11)
    weight = ratio.detach().clamp(max=ess)
    # the k3 form of KL(π_θ ‖ μ), ≥ 0, with its gradient, no IS weight; on μ's samples it estimates
    # that KL only on-policy (as the authors' code)
    kl_behavior = log_ratio + torch.exp(-log_ratio) - 1
    token_losses = -weight * advantages[:, None] * logprobs + (1 - ess) * kl_behavior
    return token_losses, ratio.detach(), ratio.detach() > ess, kl_behavior.detach()


def clipped_behavior_loss(logprobs, sampler_logprobs, advantages, mask, clip_eps):
    """--loss clip, the paper's GRPO baseline: grpo.py's clipped surrogate (ε_low = ε_high = ε)
    on P3O's ρ = π_θ/μ (FeynRL's GRPO takes its old log-probs from the engine too). Returns what
    p3o_loss returns (capped: clipped)."""
    log_ratio = behavior_log_ratio(logprobs, sampler_logprobs, mask)
    token_losses, ratio, clip_active = clipped_surrogate_loss(
        log_ratio, torch.zeros_like(log_ratio), advantages, clip_eps, clip_eps
    )
    return token_losses, ratio.detach(), clip_active, (log_ratio + torch.exp(-log_ratio) - 1).detach()


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
    # μ's; off-policy data if it differs
    sampling_temperature = args.sampling_temperature or args.temperature
    completions = engine.generate(
        prompt_ids,
        args.group_size,
        args.max_new_tokens,
        sampling_temperature,
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
PLOTTED += ["losses/ess", "losses/kl_behavior", "losses/clip_fraction", "losses/grad_norm", "mismatch/kl_k3"]
PROGRESS = ["charts/reward", "eval/greedy_accuracy", "memory/peak_allocated_gib"]
# END TRY NOT TO MODIFY


def update_policy(policy, reference, optimizer, scheduler, batch, args, dist, precision, metrics):
    """Old and reference log-probs, then the minibatch updates on one rollout batch (this rank's
    share). Records the statistics in `metrics`; returns how many optimizer steps were skipped."""
    autocast, scaler = precision.autocast, precision.scaler  # bf16 / fp16 (fsdp.mixed_precision)
    # ALGO LOGIC: what the loss needs before the updates (grpo.py: the log-probs of π_old and π_ref)
    # old log-probs only when π_θ will move away from π_old within this batch. P3O's ratio is to μ:
    # they serve the statistics (approx_kl, the mismatch) only
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    if multiple_updates:
        batch["old_logprobs"] = batch_logprobs(policy, batch, args, autocast)[0]  # log π_old
        record_mismatch(metrics, batch, batch["old_logprobs"])
    if reference is not None:  # β > 0
        batch["ref_logprobs"] = batch_logprobs(reference, batch, args, autocast)[0]  # log π_ref
    # END ALGO LOGIC

    # plumbing: minibatches (token totals over every rank) and micro-batches (memory only), around
    # the method's ALGO LOGIC regions
    skipped = 0
    ess_fallbacks = 0
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
            # ALGO LOGIC: e_B from a no-grad pass over the step, unless each forward pass
            # gives its own (minibatch_ess); --loss clip only logs it: the step's, summed from
            # its own forward passes, known after the last (no extra pass)
            ess_from_forward = args.ess_scope == "micro-batch" or len(minibatch) <= args.micro_batch_size
            ess_logged_after = not ess_from_forward and args.loss == "clip"
            if not ess_from_forward and not ess_logged_after:
                ess, fell_back = minibatch_ess(policy, batch, minibatch, args, dist, autocast)
                ess_fallbacks += fell_back
            # the same keys on every rank, for the all-reduce
            step_sums = collections.Counter(ratio_sum=0.0, ratio_sq_sum=0.0, tokens=0.0)
            # END ALGO LOGIC
            for micro in micro_batches(
                batch, minibatch, args.micro_batch_size, by_length=args.ess_scope != "micro-batch"
            ):
                mask = micro["response_mask"]
                with autocast:
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                # ALGO LOGIC: the P3O loss of this micro-batch, on ρ = π_θ/μ
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1), never the engine's μ: where a staleness fix begins
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # (π_old only feeds the statistics)
                if ess_from_forward:
                    ess, fell_back = effective_sample_size(
                        fsdp.all_reduce_dict(ratio_sums(logprobs, micro["sampler_logprobs"], mask), dist)
                    )
                    ess_fallbacks += fell_back
                if ess_logged_after:
                    step_sums.update(ratio_sums(logprobs, micro["sampler_logprobs"], mask))
                if args.loss == "p3o":
                    token_losses, ratio, clip_active, kl_behavior = p3o_loss(
                        logprobs, micro["sampler_logprobs"], micro["advantages"], mask, ess
                    )
                else:  # the GRPO baseline: e_B is only logged
                    token_losses, ratio, clip_active, kl_behavior = clipped_behavior_loss(
                        logprobs, micro["sampler_logprobs"], micro["advantages"], mask, args.clip_eps
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
                    metrics.mean(
                        "losses/clip_fraction", (clip_active.float() * mask).sum(), tokens
                    )  # P3O: ρ capped at e_B; on-policy about half the tokens (ρ ≈ e_B ≈ 1): noise
                    # entropy of π_θ (over the kept ids under --top-k/--top-p)
                    metrics.mean("charts/entropy", (entropy * mask).sum(), tokens)
                    metrics.min("losses/ratio_min", ratio[valid])
                    metrics.max("losses/ratio_max", ratio[valid])
                    # ρ = π_θ/μ, as ratio_min|max
                    metrics.mean("losses/ratio_mean", (ratio * mask).sum(), tokens)
                    # the penalty's k3 form of KL(π_θ ‖ μ), on μ's samples
                    metrics.mean("losses/kl_behavior", (kl_behavior * mask).sum(), tokens)
                    if not ess_logged_after:
                        # e_B, over the tokens it applied to
                        metrics.mean("losses/ess", ess * tokens.item(), tokens)
                        # e_B's minimum (e_B is the same on every rank)
                        metrics.min("losses/ess_min", ess)
                    if not multiple_updates:  # one pass sees every rollout, under π_old
                        record_mismatch(metrics, micro, old_logprobs)
            if ess_logged_after:  # ALGO LOGIC: --loss clip's e_B of the step, logged only
                ess, fell_back = effective_sample_size(fsdp.all_reduce_dict(dict(step_sums), dist))
                ess_fallbacks += fell_back
                metrics.mean("losses/ess", ess * rank_tokens, rank_tokens)
                metrics.min("losses/ess_min", ess)
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
    metrics.set(
        "losses/ess_fallbacks", ess_fallbacks
    )  # ESS computations that fell back to e_B = 1 (the same on every rank)
    return skipped


def check_args(args: Args) -> None:
    """Every flag's range, before anything loads: one error lists every problem (NaN fails all)."""
    problems = checks.shared_flags(args)  # experiment, rollouts, optimization, evaluation, systems
    # ALGO LOGIC: this method's flags
    temperature = args.sampling_temperature
    problems += require(temperature is None or 0 < temperature < math.inf, "--sampling-temperature", "> 0, finite")
    problems += require(0 <= args.kl_coef < math.inf, "--kl-coef", ">= 0 and finite")
    if args.loss == "clip":
        problems += require(0 <= args.clip_eps < 1, "--clip-eps", "in [0, 1)")
        problems += checks.unused(args, ["ess_scope"], "applies to --loss p3o only")
    else:
        problems += checks.unused(args, ["clip_eps"], "applies to --loss clip only")
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


# Paper scale: Qwen3-4B-Thinking-2507 or Qwen2.5-1.5B, 4,096-token rollouts, one optimizer step
# per batch, the authors' DeepScaleR config (dapo_math for DeepScaleR-Preview); add
# --sampling-temperature 1.2 or --rollout-lag 1 (asynchronous). On 8 80 GB GPUs with torchrun
# (FSDP2; one vLLM engine per GPU):
#   torchrun --nproc_per_node 8 algorithms/p3o.py --model Qwen/Qwen3-4B-Thinking-2507 \
#       --task dapo_math --eval-task aime24 --steps 500 --prompts-per-step 256 --group-size 4 \
#       --max-new-tokens 4096 --lr 1e-5 --weight-decay 0.01 --max-grad-norm 0.5 --warmup-steps 50 \
#       --num-minibatches 1 --micro-batch-size 4 --gradient-checkpointing --dtype bfloat16 \
#       --rollout-engine vllm --engine-dtype bfloat16 --vllm-sleep-mode \
#       --gpu-memory-utilization 0.5 --eval-every 25 --eval-k 16 --track
# Memory per GPU (`python -m common.memory --gpus 8` with these flags): training state 7.5 GiB
# (16 bytes × 4.02 B parameters / 8), bf16 gathers 1.1, checkpointed activations 7.6
# (4 × 4,608 tokens, 166 KiB per token per layer), output-layer chunks 0.5, the sleeping
# engine 1.0, CUDA 1.5: 19 GiB in the update, 47 GiB while vLLM generates. One GPU does not fit
# (60 GiB of training state alone), nor 8 with --rollout-engine hf: transformers' generate of a
# rank's 128 sequences keeps a KV cache of 147 KiB per token, about 81 GiB at 4,608 tokens.
# Overlapped, each engine on a GPU of its own: torchrun --nproc_per_node 4 on the 8 GPUs,
# --rollout-lag 1 --overlap-rollouts --engine-process --gpu-memory-utilization 0.9 in place of the
# sleep mode and its 0.5: per trainer GPU 25.6 GiB (the training state 15.0 over 4 ranks), per
# engine GPU 72 (7.5 of it weights).
#
# Differences from the authors' code (FeynRL, algs/P3O/p3o.py): e_B over the optimizer step, not
# per micro-batch (--ess-scope micro-batch is theirs); tempered behavior log-probs (their vLLM's
# are raw, T = 1); log ρ clamped to ±10 everywhere, where they clamp only the exponent of 1/ρ in
# k3 (which flips the KL gradient's sign for log ρ < −10) and fall back to e_B = 1 when a ratio
# overflows; no +1e-8 in the ESS denominator (ρ ≥ e^−10 > 0); advantages divide by std + 1e-4,
# not 1e-8; AdamW betas (0.9, 0.99) as grpo.py, theirs (0.9, 0.95). Tempered μ has a cost: the
# KL term's target is then the sampler's own (hotter) distribution. With rollouts 8 steps stale
# at T = 1.5 on the reasoning task (`./run.sh bench stress`, README), P3O's entropy ran away
# (0.13 to 3.5 in 40 steps, greedy accuracy to 0 in all 3 seeds) where GRPO's clipped loss held;
# raw (T = 1) μ is not offered here.
