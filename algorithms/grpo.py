"""GRPO with DAPO's clip-higher and token-mean loss, all of DAPO as flags; the other files fork it.

Papers: GRPO, DeepSeekMath (Shao et al., 2024, arXiv:2402.03300); DAPO (Yu et al., 2025,
arXiv:2503.14476) for the decoupled clip range, token-level aggregation, dynamic sampling and
overlong shaping; Dr. GRPO (Liu et al., 2025, arXiv:2503.20783) and GSPO (Zheng et al., 2025,
arXiv:2507.18071) for the loss variants the other papers compare against.

Objective. For each prompt q, sample a group of G completions o_1..o_G from the old policy,
score them (r_i = 1 for a correct answer, else 0, plus DAPO's overlong penalty with
--overlong-buffer), and maximize

    J(θ) = 1/Σ|o_i|·Σ_i Σ_t min(ρ_it A_i, clip(ρ_it, 1−ε_low, 1+ε_high) A_i) − β·KL_k3(π_θ ‖ π_ref)
    ρ_it = π_θ(o_it | q, o_i,<t) / π_old(o_it | q, o_i,<t)
    A_i  = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)     (--no-scale-advantages: no division)

Variants, each a flag (the first three concern rollouts and rewards, so every fork has them too):
  --dynamic-sampling (DAPO §3.2): a group whose rewards are all equal (A_i = 0) is replaced by
    another prompt's, for at most --max-sampling-rounds rounds (then it stays, without gradient)
  --overlong-buffer L (DAPO Eq. 13): r_i falls linearly to −1 over the last L tokens allowed
  --mask-truncated (DAPO's overlong filtering): completions cut at the length limit: no gradient
  --loss-aggregation token-sum-norm (Dr. GRPO): the token sum divided by a constant,
    completions × --max-new-tokens, not by Σ|o_i|
  --ratio-level sequence (GSPO): one ratio per completion, s_i = exp(mean_t log ρ_it), clipped
    as a whole
Presets: DAPO `--dynamic-sampling --overlong-buffer 4` (token-mean, clip-higher, β = 0: the
defaults; a clip acts with several updates per batch, e.g. --num-minibatches 4); Dr. GRPO
`--loss-aggregation token-sum-norm --no-scale-advantages`; GSPO `--ratio-level sequence
--loss-aggregation sequence-mean` with `--clip-low 3e-4 --clip-high 4e-4` and
`--num-minibatches 4` (with one update per batch every ratio is 1). A stale batch (--rollout-lag)
is used as if fresh, π_old the trainer now, unless --ratio-to behavior takes ρ to the engine's μ
(p3o.py and tis_icepop.py correct for staleness).

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
tokens. GSPO's s_i averages log ρ over the policy's tokens only.

Run it
  python algorithms/grpo.py                      # the built-in task on a CPU, 2-4 minutes
  python algorithms/grpo.py --help               # every flag, with its default
  python algorithms/grpo.py --resume auto        # continue the newest run of this task/name/seed
  python algorithms/grpo.py --dynamic-sampling --overlong-buffer 4   # DAPO
  ./run.sh bench                                 # every method × 3 seeds on the built-in task
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
    loss_aggregation: Literal["token-mean", "sequence-mean", "token-sum-norm"] = "token-mean"
    """token-mean over the minibatch (DAPO); sequence-mean: per completion, then over completions
    (GRPO); token-sum-norm: the token sum over a constant norm, completions × --max-new-tokens
    (Dr. GRPO; verl's seq-mean-token-sum-norm)"""
    ratio_level: Literal["token", "sequence"] = "token"
    """an importance ratio per token (PPO, GRPO), or per completion: the
    geometric mean of its tokens' (GSPO)"""
    ratio_to: Literal["pi-old", "behavior"] = "pi-old"
    """ρ's denominator, on which the clip is centred: π_old (PPO, verl) or behavior, the engine's μ,
    stale at --rollout-lag k (TRL's async trainer, verl's bypass mode): clipped at one update too"""
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


# ALGO LOGIC: the clipped surrogate, advantages, and how token losses are averaged
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


def completion_mean_logprob(values, mask):
    """GSPO's per-completion mean of [B, T] log-probs on each of its tokens (not sequence-mean's
    mean of losses): s_i = (π_θ(o_i|q)/π_old(o_i|q))^(1/|o_i|) = exp(mean_t log ρ_it), clipped per
    completion (arXiv:2507.18071, Eq. 5)."""
    per_completion = (values * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return per_completion.expand_as(values)


def aggregate(token_losses, mask, mode, totals):
    """This micro-batch's share of the minibatch loss (the shares of its micro-batches add up to
    the mean); `totals` holds the minibatch's counts over all ranks.
    token-mean (DAPO): every response token that trains weighs the same (totals["tokens"]).
    sequence-mean (GRPO): a mean over each completion, then over the completions with a token
    that trains (totals["sequences"]); a row that does not train (a filler) has none.
    token-sum-norm (Dr. GRPO, arXiv:2503.20783 §3.2): the sum over a constant, every row ×
    --max-new-tokens (totals["token_budget"]), rows that do not train included."""
    if mode == "token-mean":
        return (token_losses * mask).sum() / totals["tokens"]
    if mode == "token-sum-norm":
        return (token_losses * mask).sum() / totals["token_budget"]
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
PLOTTED += ["losses/approx_kl", "losses/clip_fraction", "losses/grad_norm", "mismatch/kl_k3"]
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
            counts["token_budget"] = len(minibatch) * args.max_new_tokens  # Dr. GRPO's constant
            totals = fsdp.all_reduce_dict(counts, dist)
            if totals["tokens"] == 0:  # no token on any rank: no step (counted)
                skipped += 1
                continue
            minibatch_loss = 0.0
            for micro in micro_batches(batch, minibatch, args.micro_batch_size):
                mask = micro["response_mask"]
                with autocast:
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                # ALGO LOGIC: the GRPO loss of this micro-batch
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1): ρ's denominator (--ratio-to behavior: engine's μ)
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                denominator = micro["sampler_logprobs"] if args.ratio_to == "behavior" else old_logprobs
                ratio_inputs = (logprobs, denominator)
                if args.ratio_level == "sequence":  # GSPO: one ratio per completion
                    ratio_inputs = (completion_mean_logprob(logprobs, mask), completion_mean_logprob(denominator, mask))
                token_losses, ratio, clip_active = clipped_surrogate_loss(
                    *ratio_inputs, micro["advantages"], args.clip_low, args.clip_high
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
    # one update per batch: π_old = π_θ, every ratio is 1 (a run resumed by path keeps its flags)
    if args.num_minibatches * args.update_epochs == 1 and args.resume in (None, "auto") and args.ratio_to == "pi-old":
        one_update = "applies with --num-minibatches × --update-epochs > 1 only (one update: every ratio is 1)"
        problems += checks.unused(args, ["clip_low", "clip_high", "ratio_level"], one_update)
    problems += require(0 <= args.kl_coef < math.inf, "--kl-coef", ">= 0 and finite")
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


# Paper scale: the papers' smaller runs on one 80 GB GPU (on 8: torchrun --nproc_per_node 8, FSDP2)
#   python algorithms/grpo.py --model Qwen/Qwen2.5-Math-1.5B --task gsm8k --eval-task gsm8k \
#       --steps 500 --prompts-per-step 64 --group-size 8 --max-new-tokens 1024 --lr 1e-6 \
#       --num-minibatches 4 --micro-batch-size 8 --gradient-checkpointing --dtype bfloat16 \
#       --eval-every 50 --eval-k 4 --track
# Memory per GPU (`python -m common.memory` with these flags; at worst 8 × 1,536 tokens a
# micro-batch), one GPU: training state 23.0 GiB (16 bytes × 1.54 B parameters), checkpointed
# activations 4.0 (116 KiB per token per layer), bf16 weight casts 0.5, output-layer chunks 0.5,
# vLLM 24.0 (0.3 × 80), CUDA 1.5: peak 54 of 80 GiB (91 without --gradient-checkpointing: it does
# not fit). 8 GPUs: 32 GiB (state 2.9 each). Overlapped, the engine on a GPU of its own (2 GPUs, or
# torchrun --nproc_per_node 4 on 8; add --rollout-lag 1 --overlap-rollouts --engine-process
# --gpu-memory-utilization 0.9): trainer 30 GiB (11 at 4 ranks), engine 72 (2.9 weights).
#
# Differences from the papers' settings, each a flag: the defaults are DAPO's token-mean and
# clip-higher (ε_high = 0.28), not DeepSeekMath's per-completion mean and symmetric clip
# (--loss-aggregation sequence-mean --clip-high 0.2); β = 0 where DeepSeekMath uses 0.04 (--kl-coef
# 0.04); AdamW betas (0.9, 0.99). DAPO's recipe (verl) draws 3× the batch per round, keeps groups
# whose *accuracies* differ and stops with an error after its last round; here a round is sized by
# the share of informative groups so far, groups whose rewards differ are kept, and a batch short at
# the cap is completed with all-equal groups that do not train. Eq. 13's penalty reaches −1: the
# whole gap between a right (1) and a wrong (0) answer, half with ±1. No clamp on the log-ratio (the
# papers' objectives, TRL): verl clamps log ρ at ±20 and GSPO's sequence log-ratio at 10, zeroing an
# extremely stale token's gradient; here such a token keeps the clipped surrogate's: none when A > 0
# and ρ > 1 + ε_high, ρ·A·∇log π (unbounded) when A < 0.
