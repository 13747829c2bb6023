"""GTPO: GRPO with conflict-token protection, an entropy filter and an entropy advantage shift.

Paper: GTPO (Simoni et al., 2025, arXiv:2508.03772); authors' code: github.com/winstonsmith1897/GTPO

Objective. For each prompt q, sample a group of G completions o_1..o_G from the old policy, score
them (reward r_i in {0, 1}), and maximize

    J(θ) = 1/G · Σ_i δ_i/|o_i| · Σ_t λ_it · min(ρ_it Ã_i, clip(ρ_it, 1−ε_low, 1+ε_high) Ã_i) (Eq. 7)
    ρ_it = π_θ(o_it | q, o_i,<t) / π_old(o_it | q, o_i,<t)
    A_i  = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)     (--no-scale-advantages: no division)
    Ã_i  = A_i − γ · sg(⟨H⟩_i),  ⟨H⟩_i = 1/|o_i| Σ_t H(π_old(· | q, o_i,<t)): mean entropy (§4.2)
    λ_it = 1 outside M_i; inside, 0 if A_i < 0 and 2 if A_i > 0                         (Eq. 5)
    M_i  = M_i^fw ∨ M_i^bw: the first span of conflict tokens from the start / the end  (§5.1)
    δ_i  = 0 if ⟨H⟩_ini < ln 2 and ⟨H⟩_i > ln 2, else 1 (⟨H⟩_ini: the initial policy's, §6)  (Eq. 6)

A conflict token is a (position, token) pair in completions of the group with A > 0 and with
A < 0; λ gives the positives there what it takes from the negatives
(Σ_{A>0} A_i = Σ_{A<0} |A_i|).
The shift −γ⟨H⟩_i is detached, as in the authors' code: its literal gradient would lower the
entropy, but a larger γ raises it (§6.2).

What this file changes relative to grpo.py: λ, δ_i and the shift in the loss (ρ ≡ 1 with one
update per batch, as in the paper), ⟨H⟩_ini, sequence-mean by default (Eq. 7's 1/G Σ 1/|o_i|),
no KL term (§5.2).

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
tokens. The conflict spans of §5.1 run along the policy's own tokens, skipping an output; ⟨H⟩_i
and the entropy filter average the policy's tokens.

Run it
  python algorithms/gtpo.py                      # the built-in task on a CPU, 2-4 minutes
  python algorithms/gtpo.py --help               # every flag, with its default
  ./run.sh bench                                 # every method × 3 seeds on the built-in task
  python algorithms/gtpo.py --no-scale-advantages --mask-combine product \\
      --divide-by-conflict-count --entropy-filter on --entropy-threshold 0.7
                                                 # the authors' configuration (end of this file)
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
    clip_low: float = 0.2
    """ε_low: lower clip range of the ratio"""
    clip_high: float = 0.28
    """ε_high: upper clip range (DAPO's clip-higher; = clip_low for PPO's symmetric clip)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "sequence-mean"
    """token-mean over the minibatch (DAPO), or mean per completion then over completions (GRPO)"""
    conflict_masks: bool = True
    """reweight conflict tokens with λ (Eq. 5); --no-conflict-masks: λ ≡ 1, masks still
    logged"""
    mask_combine: Literal["or", "product"] = "or"
    """or: λ from M = M^fw ∨ M^bw (the paper, λ ≤ 2); product: λ^fw·λ^bw
    (the authors' code, 4 where spans overlap)"""
    divide_by_conflict_count: bool = False
    """also divide each completion's loss by n_i = max(|M^fw_i|, |M^bw_i|, 1) (the authors' code)"""
    entropy_coef: float = 0.1
    """γ: advantages become A_i − γ⟨H⟩_i, ⟨H⟩_i detached (Eq. 7's entropy term
    as the authors' code applies it)"""
    entropy_filter: Literal["auto", "on", "off"] = "auto"
    """δ_i (Eq. 6): auto drops completions with ⟨H⟩_i > threshold iff ⟨H⟩_ini < threshold;
    on: always (the code); off: never"""
    entropy_threshold: float = math.log(2)
    """δ_i's entropy threshold: ln 2 ≈ 0.693 (the paper, Eq. 6); the authors' code filters at
    0.7"""
    entropy_ini_prompts: int = 100
    """⟨H⟩_ini is measured on this many of the first training prompts, one
    completion each, before training"""

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


# ALGO LOGIC: conflict masks, λ, ⟨H⟩_i, δ_i, the shift, ⟨H⟩_ini (§5-6);
# the surrogate, advantages, averaging
def conflict_masks(response_ids, response_mask, advantages, group_size):
    """Conflict spans M^fw, M^bw [B, T] (bool, §5.1) of right-padded completions;
    i*G..(i+1)*G-1 form group i. With tools, the spans run along each completion's own tokens:
    a tool's output is skipped, as if absent. A completion that does not train (cut off under
    --mask-truncated) shares no token: with no gradient, it has no side to balance."""
    order = policy_first(response_mask)  # the identity without tools
    response_ids, response_mask = response_ids.gather(1, order), response_mask.gather(1, order)
    valid = response_mask.bool()
    columns = torch.arange(response_mask.shape[1], device=response_mask.device)
    lengths = valid.sum(dim=1, keepdim=True)
    # backward alignment: column r holds the token r places before the last valid one
    # (EOS, if any, included)
    from_end = (lengths - 1 - columns).clamp(min=0)
    forward = _leading_conflict_span(response_ids, valid, advantages, group_size)
    from_the_end = response_ids.gather(1, from_end)
    backward = _leading_conflict_span(from_the_end, columns < lengths, advantages, group_size)
    backward = backward.gather(1, from_end) & valid  # back to positions counted from the start
    return restore_order(forward, order), restore_order(backward, order)


def _leading_conflict_span(ids, valid, advantages, group_size):
    """Conflict tokens in aligned columns, then each completion's run of them from column 0."""
    # ids, valid: [groups, G, T]; sign: [groups, G]
    ids, valid, sign = (x.unflatten(0, (-1, group_size)) for x in (ids, valid, advantages.sign()))
    # same[g, i, j, t]: completions i and j of group g hold the same token in column t
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    # one has A > 0, the other A < 0 (A = 0: none)
    opposite = (sign[:, :, None] * sign[:, None, :] < 0)[..., None]
    # (column, token) occurs in G+ and in G-: a conflict token
    conflict = (same & opposite).any(dim=2)
    # the span anchored at the first token (M^fw; M^bw: the last), as the authors' code reads
    # §5.1's "initial and final conflict regions": conflict tokens in the middle are never masked
    return conflict.long().cumprod(dim=-1).bool().flatten(0, 1)


def conflict_weights(forward, backward, advantages, combine="or"):
    """λ_it of Eq. 5: 1 outside the mask, inside 0 for A_i < 0 and 2 for A_i > 0;
    "product": λ^fw·λ^bw (the code)."""
    # A_i = 0 never has a span
    inside = torch.where(advantages > 0, 2.0, 0.0).to(advantages.dtype)[:, None]
    if combine == "or":  # λ in the advantages' dtype (float64 stays exact)
        return torch.where(forward | backward, inside, 1.0)
    return torch.where(forward, inside, 1.0) * torch.where(backward, inside, 1.0)


def completion_entropy(token_entropy, mask):
    """⟨H⟩_i (§4.2): the mean over each completion's tokens of π's entropy
    (over the vocabulary; under --top-k/--top-p, over the kept ids). [B, T] -> [B]."""
    return (token_entropy * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def entropy_filter(entropy, initial_entropy, mode="auto", threshold=math.log(2)):
    """δ_i of Eq. 6 [B] (modes: --entropy-filter); ⟨H⟩_i or ⟨H⟩_ini equal to the
    threshold keeps the completion."""
    if mode == "off" or (mode == "auto" and not initial_entropy < threshold):
        return torch.ones_like(entropy)
    return (entropy <= threshold).to(entropy.dtype)


def shaped_advantages(advantages, entropy, delta, entropy_coef):
    """δ_i (A_i − γ sg(⟨H⟩_i)), as in the authors' code: "amplifies the negative
    gradient on the selected tokens"."""
    return delta * (advantages - entropy_coef * entropy.detach())


def measure_initial_entropy(policy, engine, prompt_ids, args, dist, autocast, pad_id, entropy_ini=None):
    """⟨H⟩_ini (§6): the mean ⟨H⟩_i of one sampled completion per prompt (ranks
    share them), or a resumed run's."""
    if entropy_ini is None:
        # as many on every rank: FSDP's collectives stay in step
        per_rank = -(-len(prompt_ids) // dist.world_size)
        # the last share wraps around
        positions = torch.arange(dist.rank * per_rank, (dist.rank + 1) * per_rank)
        prompts = [prompt_ids[p % len(prompt_ids)] for p in positions.tolist()]
        # sampled as the rollouts are: under --top-k/--top-p ⟨H⟩_i is of π over the kept ids
        sampling = args.sampling
        completions = engine.generate(
            prompts, 1, args.max_new_tokens, args.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, sampling_mask=sampling.keep_sampling_mask,
        )  # fmt: skip
        batch = make_batch(prompts, completions, 1, pad_id, dist.device)
        # wrapped repeats do not count
        counts, total = (positions < len(prompt_ids)).float().to(dist.device), 0.0
        # ⟨H⟩_i is per completion, so the grouping of rows does not change the sum. They go at
        # most as many at a time as an update's micro-batch holds (of one minibatch of this rank's
        # rollouts), not --micro-batch-size: 64 of the 100 completions at once hold
        # [rows, heads, T, T] attention scores and MLP activations that set the run's peak memory
        # once responses are long (2.8 GB at 512 tokens; 4 rows, the update's there: 1.0)
        rank_rows = args.prompts_per_step // dist.world_size * args.group_size
        update_rows = -(-rank_rows // args.num_minibatches)  # rows of one minibatch, rounded up
        rows_per_forward = max(1, min(args.micro_batch_size, update_rows))
        every_row = torch.arange(len(prompts), device=dist.device)
        with torch.no_grad(), autocast:
            for micro in micro_batches(batch, every_row, rows_per_forward):
                entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)[1]
                entropy_i = completion_entropy(entropy, micro["response_mask"])
                total += (entropy_i * counts[micro["rows"]]).sum().item()
        entropy_ini = fsdp.all_reduce(total, dist) / len(prompt_ids)
    if dist.is_main:
        auto_on = args.entropy_filter == "auto" and entropy_ini < args.entropy_threshold
        active = args.entropy_filter == "on" or auto_on
        threshold = f"threshold {args.entropy_threshold:.4f}"
        print(f"<H>_ini = {entropy_ini:.4f} ({threshold}): entropy filter {'on' if active else 'off'}")
    return entropy_ini


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
# GTPO's
PLOTTED += ["charts/completion_entropy", "charts/filtered_fraction", "conflict/masked_fraction"]
# END TRY NOT TO MODIFY


def update_policy(policy, optimizer, scheduler, batch, args, dist, precision, metrics, initial_entropy):
    """λ, old log-probs and ⟨H⟩_i, then the minibatch updates on one rollout batch (this rank's
    share). Records the statistics in `metrics`; returns how many optimizer steps were skipped."""
    autocast, scaler = precision.autocast, precision.scaler  # bf16 / fp16 (fsdp.mixed_precision)
    # ALGO LOGIC: what the loss needs before the updates (grpo.py: the log-probs of π_old and π_ref)
    # conflict masks and λ (Eq. 5), from A_i before the shift as in the authors' code
    # (groups are whole on a rank)
    forward, backward = conflict_masks(
        batch["response_ids"], batch["response_mask"], batch["advantages"], args.group_size
    )
    batch["conflict_weights"] = (
        conflict_weights(forward, backward, batch["advantages"], args.mask_combine)
        if args.conflict_masks
        else torch.ones_like(batch["response_mask"])
    )
    # the authors' code: 1/n_i with n_i = max(|M^fw_i|, |M^bw_i|, 1)
    if args.divide_by_conflict_count:
        conflict_count = torch.maximum(forward.sum(1), backward.sum(1)).clamp(min=1)  # n_i
        batch["conflict_weights"] /= conflict_count[:, None]
    # response tokens in M^fw
    metrics.mean("conflict/forward_fraction", forward.sum(), batch["response_mask"].sum())
    # ... in M^bw
    metrics.mean("conflict/backward_fraction", backward.sum(), batch["response_mask"].sum())
    # in M (λ ≠ 1)
    metrics.mean("conflict/masked_fraction", (forward | backward).sum(), batch["response_mask"].sum())
    # One update per batch: π_old is π_θ's own forward, detached, so ρ is exactly 1 and its gradient
    # the policy gradient (no pass). Several: π_old from the pass below, whose micro-batches differ
    # in rows and padding, so the first update's ρ is 1 to rounding (|ρ − 1| ≤ 4e-6 in float32 here)
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    # ⟨H⟩_i under π_old: this pass's or the loss's
    batch["completion_entropy"] = torch.zeros_like(batch["advantages"])
    if multiple_updates:  # no reference model: GTPO has no KL term (§5.2)
        batch["old_logprobs"], entropy = batch_logprobs(policy, batch, args, autocast, with_entropy=True)
        batch["completion_entropy"] = completion_entropy(entropy, batch["response_mask"])
        record_mismatch(metrics, batch, batch["old_logprobs"])
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
                # ALGO LOGIC: the GTPO loss of this micro-batch (Eq. 7)
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1), never the engine's μ: where a staleness fix begins
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                entropy_i = micro["completion_entropy"] if multiple_updates else completion_entropy(entropy, mask)
                # kept for the step's statistics (one update: π_θ = π_old, no extra pass)
                batch["completion_entropy"][micro["rows"]] = entropy_i
                # Eq. 6
                delta = entropy_filter(entropy_i, initial_entropy, args.entropy_filter, args.entropy_threshold)
                advantages = shaped_advantages(micro["advantages"], entropy_i, delta, args.entropy_coef)
                token_losses, ratio, clip_active = clipped_surrogate_loss(
                    logprobs, old_logprobs, advantages, args.clip_low, args.clip_high
                )
                # λ_it (Eq. 5); |o_i| and G still count all
                token_losses = token_losses * micro["conflict_weights"]
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
    entropy_i, trained = batch["completion_entropy"], batch["response_mask"].any(1)
    delta = entropy_filter(entropy_i, initial_entropy, args.entropy_filter, args.entropy_threshold)
    # ⟨H⟩_i, δ_i's test, of the completions that train (not a row that --mask-truncated or a
    # filler group leaves empty)
    metrics.mean("charts/completion_entropy", (entropy_i * trained).sum(), trained.sum())
    # completions with δ_i = 0
    metrics.mean("charts/filtered_fraction", ((delta == 0) & trained).sum(), trained.sum())
    # ⟨H⟩_ini (auto: δ_i acts iff it is < threshold)
    metrics.set("charts/entropy_ini", initial_entropy)
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
    problems += require(0 <= args.entropy_coef < math.inf, "--entropy-coef", ">= 0 and finite (γ)")
    problems += require(args.entropy_ini_prompts >= 1, "--entropy-ini-prompts", ">= 1")
    problems += require(0 < args.entropy_threshold < math.inf, "--entropy-threshold", "> 0 and finite (nats)")
    if not args.conflict_masks:
        conflict_flags = ["mask_combine", "divide_by_conflict_count"]
        problems += checks.unused(args, conflict_flags, "applies with conflict masks")
    if args.entropy_filter == "off":
        problems += checks.unused(args, ["entropy_threshold"], "applies to --entropy-filter auto / on")
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
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    state = load_checkpoint(checkpoint, policy, optimizer, scheduler, precision.scaler, dist) if checkpoint else {}
    start_step, skipped_steps = state.get("step", 0), state.get("skipped_steps", 0)
    tracker = Tracker(run_dir, flat(args), args.tracking, enabled=dist.is_main, resume_step=start_step)
    # ALGO LOGIC: ⟨H⟩_ini of the initial policy (Eq. 6), measured once, kept in the checkpoints
    first_prompts, pad_id = data.prompts[: args.entropy_ini_prompts], tokenizer.pad_token_id
    initial_entropy = measure_initial_entropy(policy, engine, first_prompts, args, dist, precision.autocast, pad_id,
                                              state.get("entropy_ini"))  # fmt: skip
    # END ALGO LOGIC
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

        # 3-4. λ, old log-probs and ⟨H⟩_i, then the minibatch updates (the engine sleeps)
        with metrics.timer("time/train"):
            engine.sleep()
            queue.score_under_sampling_weights(batch_logprobs, policy, args, precision.autocast)
            skipped_steps += update_policy(
                policy, optimizer, scheduler, batch, args, dist, precision, metrics, initial_entropy
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
        # ⟨H⟩_ini: a resumed run keeps δ_i's reference
        trainer_state["entropy_ini"] = initial_entropy
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


# Paper scale: the paper's LLaMA/GSM8K run (G = 12, γ = 0.1, one epoch) on 8 80 GB GPUs with
# torchrun (FSDP2); its other run: --model Qwen/Qwen2.5-3B-Instruct --task math --eval-task math500.
# The paper trains one prompt per step with LoRA on one GPU; here every weight trains, which needs
# the 8 GPUs, and each takes one prompt per step (8 in all)
#   torchrun --nproc_per_node 8 algorithms/gtpo.py --model meta-llama/Llama-3.1-8B-Instruct \
#       --task gsm8k --eval-task gsm8k --steps 934 --prompts-per-step 8 --group-size 12 \
#       --max-new-tokens 1500 --lr 1e-6 --max-grad-norm 0.1 --weight-decay 0.1 --entropy-coef 0.1 \
#       --micro-batch-size 4 --gradient-checkpointing --dtype bfloat16 --vllm-sleep-mode \
#       --gpu-memory-utilization 0.5 --eval-every 60 --eval-k 8 --track
# Memory per GPU (`python -m common.memory --gpus 8` with these flags): training state 15.0 GiB
# (16 bytes × 8.03 B parameters / 8), bf16 gathers 2.8, checkpointed activations 4.2
# (4 × 2,012 tokens, 196 KiB per token per layer), output-layer chunks 0.5, the sleeping
# engine 1.0, CUDA 1.5: 25 GiB in the update, 53 GiB while vLLM generates. On one GPU the
# training state alone is 120 GiB.
# Overlapped, each engine on a GPU of its own: torchrun --nproc_per_node 4 on the 8 GPUs (2 prompts
# per rank), --rollout-lag 1 --overlap-rollouts --engine-process --gpu-memory-utilization 0.9 in
# place of the sleep mode and its 0.5: per trainer GPU 38.9 GiB (the training state 30.0 over 4
# ranks), per engine GPU 72 (15.0 of it weights).
#
# Differences from the authors' code (5d33811e), each a flag: Â_i std-scaled (Eq. 1), the code
# only centres (--no-scale-advantages; its rewards reach 20, so γ⟨H⟩_i weighs less there);
# M^fw ∨ M^bw, the code multiplies the spans' λ, 4 on overlaps (--mask-combine product);
# 1/G Σ 1/|o_i|, the code 1/(|o_i|·n_i) with n_i = max(|M^fw_i|, |M^bw_i|, 1)
# (--divide-by-conflict-count); δ_i by the ⟨H⟩_ini test, the code always at 0.7 for LLaMA
# (--entropy-filter on --entropy-threshold 0.7) and never for Qwen (off); entropies at the
# sampling temperature, the code's from raw logits. The code trains LoRA (r = 128) on a 4-bit
# model, paged AdamW-8bit (β1 = β2 = 0.999999), one prompt per step, format + correctness
# rewards, a <reasoning>/<answer> system prompt; here all weights, AdamW, 0/1 rewards.
