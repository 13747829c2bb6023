"""GTPO: GRPO with conflict-token protection, an entropy filter and an entropy advantage shift.

Paper: GTPO, Group-relative Trajectory-based Policy Optimization (Simoni, Fontana, Rossolini, Saracino,
2025, arXiv:2508.03772). Authors' code: github.com/winstonsmith1897/GTPO (gtpo/gtpo_training.py).

Objective. For each prompt q, sample a group of G completions o_1..o_G from the old policy, score them
(reward r_i), and maximize (Eq. 7, with the clipped ratio of grpo.py; the paper takes one update per batch,
where ρ ≡ 1 and the clip never acts)

    J(θ) = 1/G · Σ_i  δ_i/|o_i| · Σ_t λ_it · min( ρ_it Ã_i , clip(ρ_it, 1-ε_low, 1+ε_high) Ã_i )
    A_i   = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)        (--no-scale-advantages: no division)
    Ã_i   = A_i − γ · sg(⟨H⟩_i)                                    the entropy term of Eq. 7, as a detached shift
    ⟨H⟩_i = 1/|o_i| Σ_t H(π_θ(· | q, o_i,<t))                      mean full-vocabulary entropy (§4.2)
    λ_it  = 1 if M_it = 0;  0 if M_it = 1 and A_i < 0;  2 if M_it = 1 and A_i > 0           (Eq. 5)
    M_i   = M_i^fw ∨ M_i^bw: the first span of conflict tokens from the start / from the end   (§5.1)
    δ_i   = 0 if ⟨H⟩_ini < ln 2 and ⟨H⟩_i > ln 2, else 1                                     (Eq. 6)

A conflict token (§5.1) is a (position, token id) pair that occurs in at least one completion of the group
with A > 0 and in at least one with A < 0; positions count from the start of the completion (forward) or
back from its last token (backward). Masking negatives and doubling positives there keeps the group's
total signal: with centred advantages Σ_{A>0} A_i = Σ_{A<0} |A_i|, so what the positives gain is what the
negatives lose (§5.1). ⟨H⟩_ini is the initial policy's entropy on the first 100 training prompts (§6).

Why the entropy term is a detached advantage shift. Eq. 7 writes −γ⟨H⟩_i inside the objective; taken
literally its gradient minimises entropy, so a larger γ would give a lower entropy. The ablation (§6.2,
Fig. 4) shows the opposite, larger γ → higher stabilised entropy, and explains it: the term "amplifies
the negative gradient on the selected tokens, increasing the probability of the unselected ones". That is
what the authors' code does: Ã_i = A_i − γ⟨H⟩_i with ⟨H⟩_i detached, i.e. every sampled token gets an extra
push down of γ⟨H⟩_i ∇log π, strongest for uncertain completions, which flattens the distribution. So γ
here is that shift (inside δ_i and λ_it, as in the code), not a gradient through the entropy.

What this file changes relative to grpo.py: conflict masks and λ (once per batch, at the start of
update_policy, from the token ids and the signs of A_i), ⟨H⟩_i per completion, δ_i and the shift inside
the loss, ⟨H⟩_ini measured before training (and kept in checkpoints), the default loss normalisation
(sequence-mean: Eq. 7's 1/G Σ 1/|o_i|), no KL and no reference model, and the metrics below.

Implementation details
1. Conflicts are found per group among completions with A_i ≠ 0, on token ids; backward offsets count from
   the last valid token, EOS included (a truncated completion ends on whatever token it stopped at). A
   completion with A_i = 0 neither witnesses nor receives a conflict (λ ≡ 1), as in the authors' code.
2. "First contiguous span" is the run anchored at the first (for M^fw) or last (for M^bw) token, as the
   authors' code reads it: a completion whose first token is not a conflict token has no forward span, and
   conflict tokens in the middle are never masked (§5.1: only "the initial and final conflict regions").
3. Masks and λ use A_i before the entropy shift (the code does this); a completion removed by δ_i still
   witnesses conflicts for the others.
4. ⟨H⟩_i has no gradient and is measured under π_old. With one update per batch (the default, as in the
   paper) π_θ = π_old, so the entropy comes from the very forward pass that computes the loss; with more
   updates it comes from the no-grad pass that computes the old log-probs. No extra forward pass either way.
   Zero-advantage completions still get Ã_i = −γ⟨H⟩_i (the code does this).
5. ⟨H⟩_ini: one completion per prompt for the first --entropy-ini-prompts (100) training prompts, sampled
   by the engine from the initial policy at the training temperature, averaged over completions of the
   same ⟨H⟩_i. Several ranks share these prompts and reduce the sum. It is saved in every checkpoint, so
   --resume keeps the initial value. ⟨H⟩_ini = ln 2 exactly (undefined in Eq. 6) leaves the filter off.
   Both tests of Eq. 6 use --entropy-threshold (ln 2); ⟨H⟩_i equal to it is kept.
6. The loss is Eq. 7's 1/G Σ_i 1/|o_i| Σ_t (grpo.py's sequence-mean, the default here; G counts the
   completions of all prompts and ranks of a minibatch that have a response token). λ and δ reweight tokens, not denominators:
   filtered completions stay in G, masked tokens in |o_i|. --loss-aggregation token-mean is DAPO's.
7. Entropies and log-probs use logits divided by the sampling temperature (grpo.py's convention: the
   distribution that was sampled); identical to the paper's at temperature 1.
8. GTPO needs no KL term (§5.2): there is no --kl-coef and no reference model. Several ranks (torchrun):
   groups stay whole on one rank, so conflict masks are local; ⟨H⟩_ini is reduced across ranks.

Logged metrics (metrics.jsonl in the run folder; wandb with --track; curves.png at the end)
  charts/reward, charts/accuracy       mean reward and fraction of correct rollouts of the step
  charts/no_answer_rate                fraction of rollouts with no extractable answer
  charts/response_length_mean|max      completion length in tokens (EOS included)
  charts/truncation_rate               fraction stopped by --max-new-tokens
  charts/zero_std_group_fraction       groups whose rewards are all equal (only the entropy shift moves them)
  charts/entropy                       mean full-vocabulary entropy of π_θ at response tokens (token mean)
  charts/completion_entropy            mean over completions of ⟨H⟩_i under π_old, the quantity δ_i tests
  charts/entropy_ini                   ⟨H⟩_ini; with --entropy-filter auto the filter is on iff it is < --entropy-threshold
  charts/filtered_fraction             fraction of completions with δ_i = 0
  conflict/forward_fraction            fraction of response tokens in a forward span M^fw
  conflict/backward_fraction           fraction of response tokens in a backward span M^bw
  conflict/masked_fraction             fraction of response tokens in M = M^fw ∨ M^bw (where λ ≠ 1)
  charts/lr, charts/tokens_per_second, charts/skipped_steps
  losses/policy_loss                   the GTPO loss −J
  losses/approx_kl                     k3 estimate of KL(π_old ‖ π_θ) over response tokens
  losses/clip_fraction                 tokens whose clipped term is active (no gradient)
  losses/ratio_min|max, losses/grad_norm (before clipping)
  mismatch/kl_k3, mismatch/max_abs_logprob_diff   KL(μ ‖ π_old) and max |log μ − log π_old|, with μ the
                                       engine's log-probs: the train-inference mismatch
  time/rollout|train|weight_sync|eval|step   seconds per phase
  eval/greedy_accuracy, eval/avg@k, eval/pass@k    on held-out prompts, every --eval-every steps

Known differences from the authors' code (5d33811e), each a flag where it is cheap
- Advantages: the paper's std-scaled Â_i (Eq. 1) by default; the code only centres (--no-scale-advantages).
  The code's rewards go up to 20, so there γ⟨H⟩_i is small next to A_i; with scaled 0/1 rewards it weighs more.
- M: the paper's M^fw ∨ M^bw (λ ≤ 2); the code multiplies the two spans' weights, 4 where a positive
  completion's spans overlap (--mask-combine product).
- Normalisation: the paper's 1/G Σ_i 1/|o_i|; the code divides each completion by |o_i|·n_i with n_i =
  max(|M^fw_i|, |M^bw_i|, 1) and has no 1/G (--divide-by-conflict-count; the 1/G is a constant factor).
- δ_i: the paper's ⟨H⟩_ini test at ln 2 (--entropy-filter auto); the code never measures ⟨H⟩_ini and
  filters always at 0.7 for LLaMA (--entropy-filter on --entropy-threshold 0.7) and never for Qwen
  (--entropy-filter off).
- Entropy at the sampling temperature here; the code takes the raw logits (the same at temperature 1).
- The code trains LoRA (r = 128) on a 4-bit model with paged AdamW-8bit (β1 = β2 = 0.999999), one prompt
  per step, format + correctness rewards and a <reasoning>/<answer> system prompt; this file trains all
  weights with AdamW and the task's own prompt and 0/1 correctness reward.
  The official configuration: --no-scale-advantages --mask-combine product --divide-by-conflict-count
  --entropy-filter on --entropy-threshold 0.7.

Run it
  python algorithms/gtpo.py                                  # built-in tiny task, CPU, a few minutes
  ./run.sh bench gtpo                                        # GTPO vs GRPO on the built-in task (README)
  python algorithms/gtpo.py --model meta-llama/Llama-3.1-8B-Instruct --task gsm8k --eval-task gsm8k \\
      --steps 7473 --prompts-per-step 1 --group-size 12 --max-new-tokens 1500 --lr 1e-6 \\
      --max-grad-norm 0.1 --weight-decay 0.1 --entropy-coef 0.1 --micro-batch-size 4 --dtype bfloat16 \\
      --eval-every 500 --eval-k 8 --track              # the paper's LLaMA/GSM8K run (G = 12, γ = 0.1, 1 epoch)
  ... --model Qwen/Qwen2.5-3B-Instruct --task math --eval-task math500  # the paper's other model / task
  torchrun --nproc_per_node 8 algorithms/gtpo.py ...         # FSDP2 over 8 GPUs (--prompts-per-step 8 or more)
  python algorithms/gtpo.py --resume auto                    # continue the newest run of this task/name/seed
"""

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro
from tqdm import tqdm

from common import fsdp
from common.evaluate import evaluate, score_completions
from common.logprobs import output_layer_scores
from common.reward import encode_prompts, load_task, sample_batch
from common.rollout import load_tokenizer, make_engine
from common.tiny import resolve_model
from common.tracking import Tracker


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the run: sampling, prompt order, minibatch order"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to work without a network)"""
    wandb_project_name: str = "clean-llm-rl"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    model: str = "tiny"
    """`tiny` (the built-in offline model), a Hugging Face model id or a local folder"""
    task: str = "arith"
    """training task: arith (built-in), gsm8k, math, math500, dapo_math, aime24, aime25, or a .jsonl/.json/.parquet file"""
    eval_task: str | None = None
    """held-out task (its test split); defaults to --task"""
    question_column: str = "question"
    """question column of a local task file"""
    answer_column: str = "answer"
    """answer column of a local task file"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one"""
    output_dir: str = "runs"
    """where run folders (metrics, checkpoints, plots) go"""
    resume: str | None = None
    """continue from a checkpoint folder, a run folder, or `auto` (the newest run of this exp/task/seed)"""
    rollout_engine: Literal["auto", "hf", "vllm"] = "auto"
    """vllm (in-process vLLM), hf (transformers generate), or auto: vllm on a GPU when installed, else hf"""
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """engine weights' dtype; auto = hf: the trainer's, vllm: bfloat16 on GPU (another dtype than the trainer's is a train-inference mismatch)"""
    gpu_memory_utilization: float = 0.3
    """vllm: fraction of GPU memory for the engine (weights and KV cache); the trainer gets the rest"""
    vllm_sleep_mode: bool = False
    """vllm on GPU: free the engine's GPU memory while training (sleep level 1)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """trainer compute dtype (weights stay float32); auto = bfloat16 on GPU, float32 on CPU"""
    cpu_offload: bool = False
    """with several ranks (torchrun), keep sharded parameters and optimizer state in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward: less memory for long responses, more compute"""
    steps: int = 60
    """training steps (one rollout batch each)"""
    prompts_per_step: int = 32
    """prompts per rollout batch"""
    group_size: int = 8
    """completions per prompt (G)"""
    max_prompt_tokens: int = 512
    """prompts longer than this are dropped from the task"""
    max_new_tokens: int = 16
    """maximum completion length"""
    temperature: float = 1.0
    """sampling temperature (the trainer divides its logits by it too)"""
    lr: float = 1e-4
    """AdamW learning rate"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    num_minibatches: int = 1
    """optimizer steps per rollout batch and epoch"""
    update_epochs: int = 1
    """passes over each rollout batch"""
    micro_batch_size: int = 64
    """sequences per forward/backward (gradient accumulation; memory only, not the math)"""
    eval_every: int = 10
    """evaluate every this many steps (0: never)"""
    eval_prompts: int = 256
    """held-out prompts per evaluation"""
    eval_k: int = 4
    """samples per held-out prompt for avg@k and pass@k"""
    save_every: int = 50
    """checkpoint every this many steps (and at the end; 0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""

    # Algorithm specific arguments
    clip_low: float = 0.2
    """ε_low: lower clip range of the ratio (acts only with several updates per batch)"""
    clip_high: float = 0.28
    """ε_high: upper clip range (DAPO's clip-higher; = clip_low for PPO's symmetric clip)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (the paper's Â); --no-scale-advantages: the authors' code"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "sequence-mean"
    """mean per completion then over completions (Eq. 7's 1/G Σ 1/|o_i|), or token-mean over the minibatch (DAPO)"""
    conflict_masks: bool = True
    """reweight conflict tokens with λ (Eq. 5); --no-conflict-masks: λ ≡ 1 (the masks are still logged)"""
    mask_combine: Literal["or", "product"] = "or"
    """or: λ from M = M^fw ∨ M^bw (the paper, λ ≤ 2); product: λ^fw·λ^bw (the authors' code, 4 where spans overlap)"""
    divide_by_conflict_count: bool = False
    """also divide each completion's loss by n_i = max(|M^fw_i|, |M^bw_i|, 1), as the authors' code does"""
    entropy_coef: float = 0.1
    """γ: advantages become A_i − γ⟨H⟩_i, ⟨H⟩_i detached (Eq. 7's entropy term as the authors' code applies it)"""
    entropy_filter: Literal["auto", "on", "off"] = "auto"
    """δ_i (Eq. 6): auto drops completions with ⟨H⟩_i > threshold iff ⟨H⟩_ini < threshold; on: always (the code); off: never"""
    entropy_threshold: float = math.log(2)
    """δ_i's entropy threshold: ln 2 ≈ 0.693 (the paper, Eq. 6); the authors' code filters at 0.7"""
    entropy_ini_prompts: int = 100
    """⟨H⟩_ini is measured on this many of the first training prompts, one completion each, before training"""


def check_args(args: Args) -> None:
    problems = [f"--{name} must be {rule}" for name, bad, rule in [
        ("group-size", args.group_size < 2, ">= 2 (advantages compare completions of one prompt)"),
        ("prompts-per-step", args.prompts_per_step < 1, ">= 1"),
        ("max-new-tokens", args.max_new_tokens < 1, ">= 1"),
        ("temperature", not args.temperature > 0, "> 0"),
        ("num-minibatches", not 1 <= args.num_minibatches <= args.prompts_per_step * args.group_size,
         "between 1 and the number of rollouts per step"),
        ("update-epochs", args.update_epochs < 1, ">= 1"),
        ("micro-batch-size", args.micro_batch_size < 1, ">= 1"),
        ("lr", not args.lr > 0, "> 0"),
        ("clip-low", not 0 <= args.clip_low < 1, "in [0, 1)"),
        ("clip-high", args.clip_high < 0, ">= 0"),
        ("entropy-coef", not args.entropy_coef >= 0, ">= 0 (γ)"),
        ("entropy-ini-prompts", args.entropy_ini_prompts < 1, ">= 1"),
        ("entropy-threshold", not args.entropy_threshold > 0, "> 0 (an entropy in nats)"),
    ] if bad]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 < args.gpu_memory_utilization < 1:
        problems.append("--gpu-memory-utilization must be in (0, 1)")
    if args.prompts_per_step % world_size:
        problems.append(f"--prompts-per-step must be divisible by the number of ranks ({world_size})")
    if problems:
        raise ValueError("invalid arguments: " + "; ".join(problems))


# ALGO LOGIC: advantages, conflict masks and λ (§5.1), ⟨H⟩_i, δ_i and the entropy shift (§5.2), the surrogate
def compute_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards [prompts, G] -> advantages [prompts, G]: centred per group, optionally std-scaled."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps) if scale else centred


def conflict_masks(response_ids, response_mask, advantages, group_size):
    """Forward and backward conflict spans M^fw, M^bw [B, T] (bool) of right-padded completions (§5.1).
    response_ids / response_mask: [B, T]; advantages: [B]; completions i*G..(i+1)*G-1 form group i."""
    valid = response_mask.bool()
    lengths = valid.sum(dim=1, keepdim=True)
    columns = torch.arange(valid.shape[1], device=valid.device)
    # backward alignment: column r holds the token r places before the last valid one (EOS included)
    from_end = (lengths - 1 - columns).clamp(min=0)
    forward = _leading_conflict_span(response_ids, valid, advantages, group_size)
    backward = _leading_conflict_span(response_ids.gather(1, from_end), columns < lengths, advantages, group_size)
    return forward, backward.gather(1, from_end) & valid  # back to positions counted from the start


def _leading_conflict_span(ids, valid, advantages, group_size):
    """Conflict tokens in aligned columns, then each completion's run of them that starts at column 0."""
    groups = len(ids) // group_size
    ids, valid = ids.view(groups, group_size, ids.shape[1]), valid.view(groups, group_size, valid.shape[1])
    sign = torch.sign(advantages).view(groups, group_size)
    # same[g, i, j, t]: completions i and j of group g hold the same token in column t
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    opposite = (sign[:, :, None] * sign[:, None, :] < 0)[..., None]  # one has A > 0, the other A < 0
    conflict = (same & opposite).any(dim=2)  # (column, token) occurs in G+ and in G-: a conflict token
    return conflict.long().cumprod(dim=-1).bool().flatten(0, 1)  # the first contiguous span


def conflict_weights(forward, backward, advantages, combine="or"):
    """λ_it of Eq. 5: 1 outside the mask; inside, 0 for A_i < 0 and 2 for A_i > 0. combine="or" masks
    M^fw ∨ M^bw (the paper); "product" multiplies the two spans' λ (the authors' code: 4 on overlaps)."""
    inside = torch.where(advantages > 0, 2.0, 0.0).to(advantages.dtype)[:, None]  # A_i = 0 never has a span

    def weights(mask):
        return torch.where(mask, inside, torch.ones_like(inside))  # in the advantages' dtype (float64 stays exact)

    return weights(forward | backward) if combine == "or" else weights(forward) * weights(backward)


def completion_entropy(token_entropy, mask):
    """⟨H⟩_i (§4.2): the mean over each completion's tokens of the full-vocabulary entropy. [B, T] -> [B]."""
    return (token_entropy * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def entropy_filter(entropy, initial_entropy, mode="auto", threshold=math.log(2)):
    """δ_i of Eq. 6 from ⟨H⟩_i [B] and ⟨H⟩_ini: 0 drops a completion. auto: the paper (filter iff
    ⟨H⟩_ini < threshold, ln 2 in Eq. 6); on: filter whatever ⟨H⟩_ini (the authors' code, at 0.7); off: keep everything."""
    if mode == "off" or (mode == "auto" and not initial_entropy < threshold):
        return torch.ones_like(entropy)
    return (entropy <= threshold).to(entropy.dtype)


def shaped_advantages(advantages, entropy, delta, entropy_coef):
    """δ_i · (A_i − γ⟨H⟩_i): Eq. 7's entropy term as a detached advantage shift, as the authors' code has it."""
    return delta * (advantages - entropy_coef * entropy.detach())


def clipped_surrogate_loss(logprobs, old_logprobs, advantages, clip_low, clip_high):
    """Per-token −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A), and where the clip is active (no gradient).
    logprobs / old_logprobs: [B, T]; advantages: [B] (one per completion)."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    clip_active = ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))
    return -torch.minimum(unclipped, clipped), ratio, clip_active


def aggregate(token_losses, mask, mode, minibatch_tokens, minibatch_sequences):
    """Sum of this micro-batch's share of the minibatch loss (micro-batch shares add up to the mean).
    minibatch_sequences counts the completions with at least one response token, on all ranks."""
    if mode == "token-mean":
        return (token_losses * mask).sum() / minibatch_tokens
    per_sequence = (token_losses * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sequence.sum() / minibatch_sequences
# END ALGO LOGIC


def token_logprobs(model, micro, temperature, with_entropy=False):
    """Log-probs [B, T] of the response tokens under `model` at `temperature` (and their entropy, no
    gradient). The output layer scores a chunk of positions at a time: no [B, T, vocabulary] logits."""
    targets = torch.nn.functional.pad(micro["response_ids"], (0, 1))  # the last position predicts past the end
    with output_layer_scores(model, targets, temperature, with_entropy):
        scores = model(
            input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], position_ids=micro["position_ids"],
            logits_to_keep=targets.shape[1], use_cache=False,  # the output layer only runs where a response token is predicted
        ).logits[:, :-1]
    return scores[..., 0], (scores[..., 1].detach() if with_entropy else None)


def make_batch(prompt_ids, completions, group_size, pad_id, device):
    """Rollouts as tensors: [left-padded prompt | right-padded response]; position ids skip padding."""
    prompt_width = max(len(p) for p in prompt_ids)
    response_width = max(len(c.token_ids) for c in completions)
    rows, masks, response_masks, sampler_logprobs = [], [], [], []
    for index, completion in enumerate(completions):
        prompt, response = prompt_ids[index // group_size], completion.token_ids
        left, right = prompt_width - len(prompt), response_width - len(response)
        rows.append([pad_id] * left + prompt + response + [pad_id] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        response_masks.append([1] * len(response) + [0] * right)
        sampler_logprobs.append(completion.logprobs + [0.0] * right)
    attention_mask = torch.tensor(masks, device=device)
    input_ids = torch.tensor(rows, device=device)
    return {
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_ids": input_ids[:, prompt_width:], "response_mask": torch.tensor(response_masks, device=device).float(),
        "sampler_logprobs": torch.tensor(sampler_logprobs, device=device),
    }


def micro_batches(batch, indices, size, by_length=True):
    """Slices of the batch, each trimmed of columns that are padding in all of its rows: the sequence
    tensors [B, prompt + response] and every per-response-token tensor [B, response] alike. by_length:
    rows sorted by response length first, so a long response does not pad many short ones (token sums
    do not depend on the order)."""
    full_width, response_width = batch["input_ids"].shape[1], batch["response_ids"].shape[1]
    if by_length:
        indices = indices[batch["response_mask"][indices].sum(1).argsort(descending=True, stable=True)]
    for start in range(0, len(indices), size):
        rows = indices[start : start + size]
        micro = {"rows": rows, **{k: v[rows] for k, v in batch.items()}}
        first = int(micro["attention_mask"].any(0).nonzero()[0])  # leftmost non-pad prompt column
        columns = micro["response_mask"].any(0).nonzero()
        width = int(columns[-1]) + 1 if len(columns) else 0  # rightmost response column
        for key, value in micro.items():
            if value.dim() == 2 and value.shape[1] == full_width:
                micro[key] = value[:, first : full_width - response_width + width]
            elif value.dim() == 2 and value.shape[1] == response_width:
                micro[key] = value[:, :width]
        yield micro


def train_inference_mismatch(old_logprobs, sampler_logprobs, mask, totals=None):
    """Running sums for k3 KL(μ ‖ π_old) = E_μ[ρ − 1 − log ρ], ρ = π_old/μ, and max |log μ − log π_old|."""
    totals = totals or {"kl_sum": 0.0, "tokens": 0.0, "max_abs_diff": 0.0}
    log_ratio = (old_logprobs - sampler_logprobs).detach()
    totals["kl_sum"] += ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum().item()
    totals["tokens"] += mask.sum().item()
    totals["max_abs_diff"] = max(totals["max_abs_diff"], (log_ratio.abs() * mask).max().item())
    return totals


# ALGO LOGIC: ⟨H⟩_ini, the initial policy's entropy on the first training prompts (§5.2, §6)
def rank_share(count, dist):
    """Indices of this rank's share of `count` items (every rank gets as many, so FSDP's collectives stay
    in step; the last shares wrap around) and whether each one counts (wrapped repeats do not)."""
    per_rank = -(-count // dist.world_size)
    positions = range(dist.rank * per_rank, (dist.rank + 1) * per_rank)
    return [p % count for p in positions], [p < count for p in positions]


def measure_initial_entropy(policy, engine, prompt_ids, args, dist, autocast, pad_id) -> float:
    """⟨H⟩_ini: the mean ⟨H⟩_i of one completion per prompt, sampled and scored by the current policy."""
    indices, counts = rank_share(len(prompt_ids), dist)
    prompts = [prompt_ids[i] for i in indices]
    completions = engine.generate(prompts, 1, args.max_new_tokens, args.temperature)
    batch = make_batch(prompts, completions, 1, pad_id, dist.device)
    counts = torch.tensor(counts, device=dist.device, dtype=torch.float32)
    total = 0.0
    with torch.no_grad(), autocast:
        for micro in micro_batches(batch, torch.arange(len(prompts), device=dist.device), args.micro_batch_size):
            entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)[1]
            total += (completion_entropy(entropy, micro["response_mask"]) * counts[micro["rows"]]).sum().item()
    return fsdp.all_reduce(total, dist) / len(prompt_ids)
# END ALGO LOGIC


def update_policy(policy, optimizer, scheduler, batch, args, dist, autocast, initial_entropy) -> dict:
    """Conflict weights λ, old log-probs and ⟨H⟩_i, then minibatch updates on one rollout batch (this rank's
    share, whole groups). Returns statistics summed over this rank's tokens (reduce them over ranks before dividing)."""
    # ALGO LOGIC: conflict masks and λ from the token ids and the signs of A_i (§5.1, Eq. 5)
    forward, backward = conflict_masks(batch["response_ids"], batch["response_mask"], batch["advantages"], args.group_size)
    batch["conflict_weights"] = (conflict_weights(forward, backward, batch["advantages"], args.mask_combine)
                                 if args.conflict_masks else torch.ones_like(batch["response_mask"]))
    if args.divide_by_conflict_count:  # the authors' code: 1/n_i with n_i = max(|M^fw_i|, |M^bw_i|, 1)
        batch["conflict_weights"] /= torch.maximum(forward.sum(1), backward.sum(1)).clamp(min=1)[:, None]
    # END ALGO LOGIC
    # old log-probs only when π_θ will move away from π_old within this batch (else ratio ≡ 1)
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    batch["completion_entropy"] = torch.zeros_like(batch["advantages"])  # ⟨H⟩_i under π_old, filled below
    if multiple_updates:
        batch["old_logprobs"] = torch.zeros_like(batch["sampler_logprobs"])
        with torch.no_grad(), autocast:
            for micro in micro_batches(batch, every_row, args.micro_batch_size):
                logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                batch["old_logprobs"][micro["rows"], : logprobs.shape[1]] = logprobs
                batch["completion_entropy"][micro["rows"]] = completion_entropy(entropy, micro["response_mask"])
    stats = dict.fromkeys(["loss", "approx_kl", "clipped", "entropy", "tokens", "grad_norm",
                           "updates", "skipped"], 0.0)
    stats.update(ratio_min=float("inf"), ratio_max=float("-inf"))
    if multiple_updates:
        stats["mismatch"] = train_inference_mismatch(batch["old_logprobs"], batch["sampler_logprobs"], batch["response_mask"])

    for epoch in range(args.update_epochs):
        order = torch.randperm(len(every_row), device=every_row.device)
        for minibatch in order.chunk(args.num_minibatches):
            # the loss is a mean over the minibatch of all ranks; FSDP averages gradients over ranks,
            # so each rank's share is scaled by the world size
            # sequence-mean counts the completions that have a response token (an empty one adds nothing)
            response_mask = batch["response_mask"][minibatch]
            counts = fsdp.all_reduce_dict({"tokens": response_mask.sum().item(),
                                           "sequences": response_mask.any(1).sum().item()}, dist)
            minibatch_tokens, minibatch_sequences = counts["tokens"], counts["sequences"]
            if minibatch_tokens == 0:  # no response token on any rank: nothing to learn, no step (counted)
                stats["skipped"] += 1
                continue
            minibatch_loss = 0.0
            for micro in micro_batches(batch, minibatch, args.micro_batch_size):
                mask = micro["response_mask"]
                with autocast:
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # ALGO LOGIC: the GTPO loss of this micro-batch (Eq. 7)
                if multiple_updates:  # ⟨H⟩_i under π_old, from the no-grad pass above
                    entropy_i = micro["completion_entropy"]
                else:  # π_θ = π_old: this forward's entropy is ⟨H⟩_i, no extra pass
                    entropy_i = batch["completion_entropy"][micro["rows"]] = completion_entropy(entropy, mask)
                delta = entropy_filter(entropy_i, initial_entropy, args.entropy_filter, args.entropy_threshold)  # Eq. 6
                advantages = shaped_advantages(micro["advantages"], entropy_i, delta, args.entropy_coef)
                token_losses, ratio, clip_active = clipped_surrogate_loss(
                    logprobs, old_logprobs, advantages, args.clip_low, args.clip_high)
                token_losses = token_losses * micro["conflict_weights"]  # λ_it (Eq. 5)
                loss = aggregate(token_losses, mask, args.loss_aggregation, minibatch_tokens, minibatch_sequences)
                # END ALGO LOGIC
                (loss * dist.world_size).backward()
                minibatch_loss += loss.item()
                with torch.no_grad():
                    log_ratio, valid = (logprobs - old_logprobs).detach(), mask.bool()
                    stats["approx_kl"] += ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum().item()
                    stats["clipped"] += (clip_active.float() * mask).sum().item()
                    stats["entropy"] += (entropy * mask).sum().item()
                    stats["tokens"] += mask.sum().item()
                    stats["ratio_min"] = min(stats["ratio_min"], ratio[valid].min().item())
                    stats["ratio_max"] = max(stats["ratio_max"], ratio[valid].max().item())
                    if not multiple_updates:  # this single pass sees every rollout once, under π_old
                        stats["mismatch"] = train_inference_mismatch(
                            old_logprobs, micro["sampler_logprobs"], mask, stats.get("mismatch"))
            grad_norm = fsdp.clip_grad_norm(policy, args.max_grad_norm, dist.device)
            minibatch_loss = fsdp.all_reduce(minibatch_loss, dist)
            if torch.isfinite(grad_norm) and torch.isfinite(torch.tensor(minibatch_loss)):
                optimizer.step()
                scheduler.step()
            else:
                stats["skipped"] += 1  # never write NaN weights
            optimizer.zero_grad(set_to_none=True)
            stats["loss"] += minibatch_loss
            stats["grad_norm"] += grad_norm.item()
            stats["updates"] += 1
    delta = entropy_filter(batch["completion_entropy"], initial_entropy, args.entropy_filter, args.entropy_threshold)
    stats.update(completion_entropy=batch["completion_entropy"].sum().item(), filtered=(delta == 0).sum().item(),
                 forward_conflict=forward.sum().item(), backward_conflict=backward.sum().item(),
                 masked=(forward | backward).sum().item())
    return stats


def main(args: Args) -> None:
    check_args(args)
    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # no "Loading weights" bars: the training bar is the one to watch

    # TRY NOT TO MODIFY: set-up
    dist = fsdp.setup()
    fsdp.seed_everything(args.seed + dist.rank)
    device = dist.device
    bfloat16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=bfloat16)  # weights stay float32
    run_prefix = f"{os.path.basename(args.task)}__{args.exp_name}__{args.seed}__"
    checkpoint = fsdp.find_checkpoint(args.resume, args.output_dir, run_prefix) if args.resume else None
    run_dir = os.path.dirname(os.path.dirname(checkpoint)) if checkpoint else os.path.join(
        args.output_dir, run_prefix + fsdp.broadcast(str(int(time.time())), dist))  # one name for all ranks
    train_rows = load_task(args.task, "train", args.question_column, args.answer_column)
    eval_task = args.eval_task or args.task
    eval_rows = load_task(eval_task, "test", args.question_column, args.answer_column)[: args.eval_prompts]
    args.model = resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    train_rows, prompts = encode_prompts(train_rows, tokenizer, args.task, args.chat_template, args.max_prompt_tokens)

    # the engine first: vLLM sizes its KV cache from the GPU memory that is free when it starts.
    # One rank: the hf engine can share the trainer's module; several: it keeps a full copy per rank.
    policy = AutoModelForCausalLM.from_pretrained(checkpoint or args.model, dtype=torch.float32)
    engine = make_engine(args.rollout_engine, policy, tokenizer, dtype=args.engine_dtype, share_weights=dist.world_size == 1,
                         model_path=checkpoint or args.model, max_model_len=min(args.max_prompt_tokens + args.max_new_tokens,
                                           policy.config.max_position_embeddings),
                         seed=args.seed + dist.rank, gpu_memory_utilization=args.gpu_memory_utilization,
                         sleep_mode=args.vllm_sleep_mode, device=device)
    policy = policy.to(device)
    if args.gradient_checkpointing:  # before sharding; non-reentrant, as FSDP2 requires
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = fsdp.shard(policy, dist, cpu_offload=args.cpu_offload)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    start_step, skipped_steps = 0, 0
    if checkpoint:
        state = fsdp.load_checkpoint(checkpoint, policy, optimizer, dist)
        scheduler.load_state_dict(state["scheduler"])
        start_step, skipped_steps = state["step"], state["skipped_steps"]
    tracker = Tracker(run_dir, os.path.basename(run_dir), asdict(args), args.track, args.wandb_project_name,
                      args.wandb_entity, enabled=dist.is_main, resume_step=start_step if checkpoint else None)
    # ALGO LOGIC: ⟨H⟩_ini of the initial policy (Eq. 6), measured once and kept in the checkpoints
    initial_entropy = state.get("entropy_ini") if checkpoint else None
    if initial_entropy is None:
        initial_entropy = measure_initial_entropy(policy, engine, prompts[: args.entropy_ini_prompts], args, dist,
                                                  autocast, tokenizer.pad_token_id)
    threshold = args.entropy_threshold
    filter_on = args.entropy_filter == "on" or (args.entropy_filter == "auto" and initial_entropy < threshold)
    if dist.is_main:
        print(f"<H>_ini = {initial_entropy:.4f} (threshold {threshold:.4f}): entropy filter {'on' if filter_on else 'off'}")
    # END ALGO LOGIC

    eval_kwargs = dict(task=eval_task, k=args.eval_k, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, use_chat_template=args.chat_template, dist=dist)
    if args.eval_every and start_step == 0:
        tracker.log(evaluate(engine, tokenizer, eval_rows, **eval_kwargs), step=0)
    local_prompts = args.prompts_per_step // dist.world_size

    progress = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not dist.is_main)
    for step in progress:
        step_start = time.time()
        # 1. rollout: G completions per prompt, with the sampler's log-probs μ of the sampled tokens
        #    (each rank takes whole groups, so group statistics are those of one process)
        indices = sample_batch(len(train_rows), step, args.prompts_per_step, args.seed)
        indices = indices[dist.rank * local_prompts : (dist.rank + 1) * local_prompts]
        step_prompts = [prompts[i] for i in indices]
        completions = engine.generate(step_prompts, args.group_size, args.max_new_tokens, args.temperature)
        rollout_seconds = time.time() - step_start

        # 2. rewards and advantages
        scores = score_completions(completions, [train_rows[i] for i in indices], args.group_size, tokenizer,
                                   bare=args.task == "arith")
        rewards = torch.tensor([s.reward for s in scores], device=device).view(-1, args.group_size)
        advantages = compute_advantages(rewards, args.scale_advantages).flatten()
        batch = make_batch(step_prompts, completions, args.group_size, tokenizer.pad_token_id, device)
        batch["advantages"] = advantages

        # 3-4. conflict weights λ, old log-probs and ⟨H⟩_i, then the minibatch updates (a sleeping engine frees the GPU)
        train_start = time.time()
        engine.sleep()
        stats = update_policy(policy, optimizer, scheduler, batch, args, dist, autocast, initial_entropy)
        skipped_steps += int(stats["skipped"])
        train_seconds = time.time() - train_start

        # 5. push the new weights to the engine (every rank gathers each full tensor in turn)
        sync_start = time.time()
        engine.wake_up(["weights"])
        engine.load_weights(fsdp.named_full_tensors(policy, device, engine.dtype))
        engine.wake_up(["kv_cache"])
        sync_seconds = time.time() - sync_start

        # 6. log, evaluate, checkpoint: sums over ranks first, then ratios
        lengths = batch["response_mask"].sum(1)
        mismatch = stats["mismatch"]
        sums = fsdp.all_reduce_dict({
            "reward": rewards.sum().item(), "correct": sum(s.correct for s in scores),
            "no_answer": sum(not s.found for s in scores), "rollouts": len(scores), "length": lengths.sum().item(),
            "truncated": sum(c.finish_reason == "length" for c in completions), "groups": len(rewards),
            "zero_std_groups": (rewards.std(dim=1) == 0).sum().item(), "entropy": stats["entropy"],
            "tokens": stats["tokens"], "approx_kl": stats["approx_kl"], "clipped": stats["clipped"],
            "mismatch_kl": mismatch["kl_sum"], "mismatch_tokens": mismatch["tokens"],
            **{k: stats[k] for k in ("completion_entropy", "filtered", "forward_conflict", "backward_conflict", "masked")},
        }, dist)
        extremes = fsdp.all_reduce_dict({"length_max": lengths.max().item(), "ratio_max": stats["ratio_max"],
                                         "mismatch_max": mismatch["max_abs_diff"], "neg_ratio_min": -stats["ratio_min"]},
                                        dist, op="max")
        step_seconds = time.time() - step_start
        metrics = {
            "charts/reward": sums["reward"] / sums["rollouts"],
            "charts/accuracy": sums["correct"] / sums["rollouts"],
            "charts/no_answer_rate": sums["no_answer"] / sums["rollouts"],
            "charts/response_length_mean": sums["length"] / sums["rollouts"],
            "charts/response_length_max": extremes["length_max"],
            "charts/truncation_rate": sums["truncated"] / sums["rollouts"],
            "charts/zero_std_group_fraction": sums["zero_std_groups"] / sums["groups"],
            "charts/entropy": sums["entropy"] / sums["tokens"],
            "charts/completion_entropy": sums["completion_entropy"] / sums["rollouts"],
            "charts/entropy_ini": initial_entropy,
            "charts/filtered_fraction": sums["filtered"] / sums["rollouts"],
            "conflict/forward_fraction": sums["forward_conflict"] / sums["length"],
            "conflict/backward_fraction": sums["backward_conflict"] / sums["length"],
            "conflict/masked_fraction": sums["masked"] / sums["length"],
            "charts/lr": scheduler.get_last_lr()[0],
            "charts/skipped_steps": skipped_steps,
            "charts/tokens_per_second": sums["length"] / step_seconds,
            "losses/policy_loss": stats["loss"] / max(stats["updates"], 1),  # already summed over ranks
            "losses/approx_kl": sums["approx_kl"] / sums["tokens"],
            "losses/clip_fraction": sums["clipped"] / sums["tokens"],
            "losses/ratio_min": -extremes["neg_ratio_min"],
            "losses/ratio_max": extremes["ratio_max"],
            "losses/grad_norm": stats["grad_norm"] / max(stats["updates"], 1),  # the global norm
            "mismatch/kl_k3": sums["mismatch_kl"] / sums["mismatch_tokens"],
            "mismatch/max_abs_logprob_diff": extremes["mismatch_max"],
            "time/rollout": rollout_seconds,
            "time/train": train_seconds,
            "time/weight_sync": sync_seconds,
            "time/step": step_seconds,
        }
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            eval_start = time.time()
            metrics.update(evaluate(engine, tokenizer, eval_rows, **eval_kwargs))
            metrics["time/eval"] = time.time() - eval_start
        tracker.log(metrics, step=step + 1)
        progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}", **(
            {"eval_greedy": f"{metrics['eval/greedy_accuracy']:.3f}"} if "eval/greedy_accuracy" in metrics else {}))
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
            trainer_state = {"step": step + 1, "skipped_steps": skipped_steps, "scheduler": scheduler.state_dict(),
                             "args": asdict(args), "entropy_ini": initial_entropy}
            fsdp.save_checkpoint(run_dir, step + 1, policy, tokenizer, optimizer, trainer_state, dist,
                                 args.keep_checkpoints)

    plot = tracker.close(plot_keys=[
        "charts/reward", "eval/greedy_accuracy", f"eval/avg@{args.eval_k}", "charts/entropy",
        "charts/response_length_mean", "losses/approx_kl", "losses/clip_fraction", "losses/grad_norm",
        "mismatch/kl_k3", "charts/completion_entropy", "charts/filtered_fraction", "conflict/masked_fraction"])
    if dist.is_main:
        print(f"run folder: {run_dir}" + (f" (plot: {plot})" if plot else ""))
    fsdp.barrier(dist)
    engine.close()
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(tyro.cli(Args))
