"""P3O: the batch's effective sample size replaces the clip and sets a KL to the behavior policy.

Paper: P3O, "Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training"
(Smola, Aubry, Stranges, Fakoor, 2026, arXiv:2605.12380; code: github.com/FeynRL-project/FeynRL,
algs/P3O/p3o.py). The paper's method section was not available; the objective below is the one recovered
from the authors' code and blog (../shared/notes/p3o.md, "notes §n" below). Its ancestor is P3O (Fakoor,
Chaudhari, Smola, 2019, arXiv:1905.01756): IS cap c = ESS, KL coefficient λ = 1 − ESS.

Objective. Completions are sampled by the behavior policy μ (the rollout engine: its log-probs of the
sampled tokens are recorded); B is the set of the N valid response tokens of one optimizer step (all
micro-batches, all ranks). Minimize (global token mean, notes §3)

    L(θ) = 1/N · Σ_t [ −sg(min(ρ_t, e_B)) · A_t · log π_θ(y_t)  +  (1 − e_B) · (log ρ_t + 1/ρ_t − 1) ]
    ρ_t  = π_θ(y_t | x, y_<t) / μ(y_t | x, y_<t)                                   the ratio to the behavior policy
    e_B  = (Σ_B ρ_t)² / (N · Σ_B ρ_t²)  ∈ [1/N, 1]    normalized ESS of the batch (notes §1), a constant
    A_t  = A_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)        of the completion i owning token t

The first term is REINFORCE with a detached weight capped at the batch ESS (Eq. 11 of the paper: the
"ESS-driven cap"); the second is the k3 estimate of KL(π_θ ‖ μ) on the sampled tokens, switched on as the
batch's ratios spread out. Per token the gradient is [−min(ρ_t, e_B)·A_t + (1 − e_B)(1 − 1/ρ_t)]·∇log π_θ.
There is no clip hyper-parameter. On-policy (the default: the float32 engine shares the trainer's weights,
one update per rollout batch, one temperature) ρ_t = 1 up to float rounding, so e_B ≈ 1, every weight is
≈ 1, the KL term vanishes and P3O is token-mean REINFORCE with group-normalized advantages, the very
gradient grpo.py computes then. It acts when the data are off-policy, which this file can produce on the
built-in task: --sampling-temperature 1.2 (μ at 1.2, π_θ at --temperature 1.0), --sync-every k (stale
rollouts), --engine-dtype bfloat16 (a lower-precision engine), --num-minibatches / --update-epochs > 1.

Changes relative to grpo.py: the clipped surrogate (and --clip-low/--clip-high) is replaced by the loss
above; ratios are taken against the engine's log-probs μ instead of π_old; a no-grad pass over each
optimizer step's tokens gives e_B before its first backward; flags for the off-policy settings;
--loss clip, the paper's GRPO baseline on the same data (the clipped surrogate with ρ = π_θ/μ, --clip-eps),
so that `./run.sh bench p3o` compares the two with everything else equal.

Implementation details
1. Ratios use the engine's own log-probs of the sampled tokens (as the authors' vLLM log-probs, notes §1):
   μ at the sampling temperature, π_θ at --temperature (the trainer divides its logits by it). Both are
   the processed, tempered log-probs here; FeynRL's vLLM returns raw (T = 1) log-probs (notes §6.2), with
   which a temperature shift alone would not move ρ. log ρ is set to 0 at prompt/pad positions before the
   exp, and clamped to ±10 (LOG_RATIO_LIMIT) for the ratio, the ESS and the KL alike. Evaluation samples
   at --temperature: it measures π_θ, not μ.
2. e_B is computed from the ratios of every valid token of one optimizer step (the paper's "tokens in the
   batch"): Σρ, Σρ², N are summed in float64 over micro-batches and over ranks (all-reduce), then
   e_B = (Σρ)²/(N·Σρ²), capped at 1 against rounding, and used as a Python float (no gradient). θ does
   not change within an optimizer step, so a no-grad pass gives the ratios the loss will see before the
   first backward (skipped when the step is a single micro-batch: its own forward pass is used). That
   pass costs one forward per step (about +30% train time on the CPU default; generation dominates at
   paper scale). The authors' code computes e_B per micro-batch (across ranks): --ess-scope micro-batch,
   no extra pass, a noisier e_B.
3. Weights sg(min(ρ, e_B)) are ≤ e_B ≤ 1 and never 0 (no token loses its signal); the KL term keeps its
   gradient; no importance weight multiplies the KL term (notes §2).
4. Fallback: with no valid token, or a non-finite Σρ or Σρ² (a NaN log-prob), e_B = 1 (weights min(ρ, 1),
   no KL term), as in the authors' code; counted in losses/ess_fallbacks. A NaN log-prob also makes the
   loss NaN, so that step is skipped (grpo.py's guard) and no NaN reaches the weights.
5. With several updates per batch ρ stays relative to μ (not to π_old): later minibatches see π_θ drift
   from μ, e_B drops and the update tightens by itself. π_old log-probs are computed only for the
   statistics (losses/approx_kl, mismatch/), as in grpo.py.
6. --sync-every k pushes the weights to the engine after every k-th step (and before each evaluation, so
   eval/ measures the trained policy): rollouts then come from a policy up to k − 1 steps old. The hf
   engine then keeps its own copy of the weights (share_weights=False). --resume restarts the engine from
   the checkpoint's weights, so a stale run resumes exactly only from a checkpoint at a push.
7. Several ranks (torchrun): as grpo.py, plus the ESS sums are all-reduced, so N ranks compute one e_B.

Known differences from the authors' code (FeynRL): e_B over the optimizer step instead of per micro-batch
(flag above); tempered behavior log-probs (detail 1); log ρ clamped to ±10 everywhere, where the authors
clamp only the exponent of 1/ρ in k3 (which flips the KL gradient's sign for log ρ < −10) and fall back to
e_B = 1 when a ratio overflows; no +1e-8 in the ESS denominator (ρ ≥ e^−10 > 0, so Σρ² > 0);
advantages divide by std + 1e-4, not 1e-8; AdamW betas (0.9, 0.99) as grpo.py, theirs (0.9, 0.95).

Logged metrics (metrics.jsonl in the run folder; wandb with --track; curves.png at the end)
  charts/reward, charts/accuracy       mean reward and fraction of correct rollouts of the step
  charts/no_answer_rate                fraction of rollouts with no extractable answer
  charts/response_length_mean|max      completion length in tokens (EOS included)
  charts/truncation_rate               fraction stopped by --max-new-tokens
  charts/zero_std_group_fraction       groups whose rewards are all equal (they carry no signal)
  charts/entropy                       mean full-vocabulary entropy of π_θ at response tokens
  charts/lr, charts/tokens_per_second, charts/skipped_steps
  losses/policy_loss                   the P3O loss above (plus the reference KL when β > 0); its value
                                       contains −A·log π, only its gradient means something
  losses/ess, losses/ess_min           e_B: token-weighted mean and minimum over the step's optimizer
                                       steps (micro-batches with --ess-scope micro-batch)
  losses/ess_fallbacks                 ESS computations of this step that fell back to e_B = 1
  losses/clip_fraction                 P3O has no clip: the fraction of capped tokens (ρ > e_B, weight
                                       e_B). On-policy ρ and e_B are 1 ± 1e-6, so the fraction is noise.
                                       With --loss clip: tokens whose clip is active
  losses/ratio_min|mean|max            ρ = π_θ/μ over the valid tokens of every update
  losses/kl_behavior                   k3 estimate of KL(π_θ ‖ μ), the regularizer before its (1 − e_B)
  losses/approx_kl                     k3 estimate of KL(π_old ‖ π_θ) (0 with one update per batch)
  losses/grad_norm (before clipping), losses/kl_ref (β > 0)
  mismatch/kl_k3, mismatch/max_abs_logprob_diff   KL(μ ‖ π_old) and max |log μ − log π_old|, with μ the
                                       engine's log-probs: the train-inference mismatch (and staleness)
  time/rollout|train|weight_sync|eval|step   seconds per phase
  eval/greedy_accuracy, eval/avg@k, eval/pass@k    on held-out prompts, every --eval-every steps

Run it
  python algorithms/p3o.py                                   # built-in tiny task, CPU: on-policy, = REINFORCE
  ./run.sh bench p3o                                         # P3O vs GRPO ε = 0.2/0.4/0.6, three settings (README)
  python algorithms/p3o.py --sampling-temperature 1.2        # off-policy: rollouts at T = 1.2, π_θ at 1.0
  python algorithms/p3o.py --sync-every 2                    # stale rollouts (one step behind every other step)
  python algorithms/p3o.py --engine-dtype bfloat16 --num-minibatches 4   # bf16 engine, 4 updates per batch
  # paper scale (Qwen3-4B-Thinking-2507 or Qwen2.5-1.5B, DeepScaleR-like data, 4,096-token rollouts, one
  # optimizer step per rollout batch; optimizer settings from the authors' DeepScaleR example config;
  # dapo_math stands in for DeepScaleR-Preview, or pass its .jsonl with --question-column problem):
  python algorithms/p3o.py --model Qwen/Qwen3-4B-Thinking-2507 --task dapo_math --eval-task aime24 \\
      --steps 500 --prompts-per-step 256 --group-size 4 --max-new-tokens 4096 --lr 1e-5 --weight-decay 0.01 \\
      --max-grad-norm 0.5 --warmup-steps 50 --num-minibatches 1 --micro-batch-size 4 --dtype bfloat16 \\
      --rollout-engine vllm --engine-dtype bfloat16 --vllm-sleep-mode --eval-every 25 --eval-k 16 --track
  # add --sampling-temperature 1.2 (temperature shift), --sync-every 2 (one-step-stale rollouts, the
  # asynchronous setting); torchrun --nproc_per_node 8 algorithms/p3o.py ... --rollout-engine hf for FSDP2
  python algorithms/p3o.py --resume auto                     # continue the newest run of this task/name/seed
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
    """temperature of π_θ (the trainer divides its logits by it); the sampling one too unless --sampling-temperature"""
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
    ess_scope: Literal["minibatch", "micro-batch"] = "minibatch"
    """e_B over all tokens of one optimizer step (the paper's batch) or of each micro-batch (authors' code); all ranks"""
    sampling_temperature: float | None = None
    """rollout temperature of the engine (μ) when it differs from --temperature (π_θ): off-policy data, e.g. 1.2"""
    sync_every: int = 1
    """push the weights to the engine every this many steps (k > 1: stale rollouts, up to k-1 steps old)"""
    loss: Literal["p3o", "clip"] = "p3o"
    """p3o: the loss above; clip: the paper's GRPO baseline, the clipped surrogate on the same ratio ρ = π_θ/μ"""
    clip_eps: float = 0.2
    """ε of --loss clip: ρ is clipped to [1 − ε, 1 + ε] (the paper's GRPO baselines: 0.2, 0.4, 0.6)"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    """token-mean over the minibatch (DAPO), or mean per completion then over completions (GRPO)"""
    kl_coef: float = 0.0
    """β of the k3 KL penalty to the initial policy (0: no reference model is loaded)"""


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
        ("sampling-temperature", args.sampling_temperature is not None and not args.sampling_temperature > 0, "> 0"),
        ("sync-every", args.sync_every < 1, ">= 1"),
        ("clip-eps", not 0 <= args.clip_eps < 1, "in [0, 1)"),
        ("kl-coef", args.kl_coef < 0, ">= 0"),
    ] if bad]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 < args.gpu_memory_utilization < 1:
        problems.append("--gpu-memory-utilization must be in (0, 1)")
    if args.prompts_per_step % world_size:
        problems.append(f"--prompts-per-step must be divisible by the number of ranks ({world_size})")
    if problems:
        raise ValueError("invalid arguments: " + "; ".join(problems))


# ALGO LOGIC: advantages, ratios to the behavior policy, the batch ESS, the P3O loss, token averaging
LOG_RATIO_LIMIT = 10.0  # |log ρ| ≤ 10: numerical safety only (the authors clamp k3's exponent at ±10, notes §2)


def compute_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards [prompts, G] -> advantages [prompts, G]: centred per group, optionally std-scaled."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps) if scale else centred


def behavior_log_ratio(logprobs, sampler_logprobs, mask):
    """log ρ = log π_θ − log μ at valid tokens, clamped to ±LOG_RATIO_LIMIT; 0 at prompt / pad positions
    (set before any exp, so padding can never turn into inf · 0 = NaN). All tensors [B, T]."""
    return torch.where(mask.bool(), logprobs - sampler_logprobs, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def ratio_sums(logprobs, sampler_logprobs, mask) -> dict[str, float]:
    """Σρ, Σρ² and N over the valid tokens, in float64: sums, so they add up over micro-batches and ranks."""
    ratio = torch.exp(behavior_log_ratio(logprobs.detach(), sampler_logprobs, mask).double())
    mask = mask.double()
    return {"ratio_sum": (ratio * mask).sum().item(), "ratio_sq_sum": (ratio.square() * mask).sum().item(),
            "tokens": mask.sum().item()}


def effective_sample_size(sums: dict[str, float]) -> tuple[float, bool]:
    """Normalized ESS e_B = (Σρ)² / (N·Σρ²) ∈ [1/N, 1] (notes §1), a plain float (no gradient), and
    whether it fell back: e_B = 1 (the authors' fallback) when there is no valid token or a sum is not finite."""
    total, squares, tokens = sums["ratio_sum"], sums["ratio_sq_sum"], sums["tokens"]
    if tokens == 0 or not (math.isfinite(total) and math.isfinite(squares)):
        return 1.0, True
    return min(1.0, total * total / (tokens * squares)), False  # ≤ 1 by Cauchy–Schwarz; min() for rounding


def p3o_loss(logprobs, sampler_logprobs, advantages, mask, ess):
    """Per-token P3O loss −sg(min(ρ, e_B))·A·log π_θ + (1 − e_B)·(log ρ + 1/ρ − 1), ρ = π_θ/μ (notes §2-3).
    Its gradient per token is [−min(ρ, e_B)·A + (1 − e_B)(1 − 1/ρ)]·∇log π_θ.
    logprobs / sampler_logprobs / mask: [B, T]; advantages: [B] (one per completion); ess: a float.
    Returns the token losses, ρ, where the cap is active (ρ > e_B) and the k3 values (no gradient)."""
    log_ratio = behavior_log_ratio(logprobs, sampler_logprobs, mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.detach().clamp(max=ess)  # sg(min(ρ, e_B)) ≤ e_B ≤ 1, never 0: the ESS-driven cap (Eq. 11)
    kl_behavior = log_ratio + torch.exp(-log_ratio) - 1  # k3 of KL(π_θ ‖ μ) at the sampled token, ≥ 0
    token_losses = -weight * advantages[:, None] * logprobs + (1 - ess) * kl_behavior
    return token_losses, ratio.detach(), ratio.detach() > ess, kl_behavior.detach()


def clipped_behavior_loss(logprobs, sampler_logprobs, advantages, mask, clip_eps):
    """--loss clip, the paper's GRPO baseline: per-token −min(ρA, clip(ρ, 1 − ε, 1 + ε)A) on the same
    ρ = π_θ/μ as P3O (FeynRL's GRPO also takes its old log-probs from the engine, notes §1), so the two
    compare on identical data. Returns what p3o_loss returns; "capped" means the clip is active."""
    log_ratio = behavior_log_ratio(logprobs, sampler_logprobs, mask)
    ratio = torch.exp(log_ratio)
    advantages = advantages[:, None]
    token_losses = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    clip_active = ((ratio < 1 - clip_eps) & (advantages < 0)) | ((ratio > 1 + clip_eps) & (advantages > 0))
    kl_behavior = log_ratio + torch.exp(-log_ratio) - 1
    return token_losses, ratio.detach(), clip_active, kl_behavior.detach()


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


# ALGO LOGIC: e_B of one optimizer step, known before its first backward
def minibatch_ess(policy, batch, minibatch, args, dist, autocast) -> tuple[float, bool]:
    """e_B over every valid token of one optimizer step, on all ranks: θ does not change until the step,
    so a no-grad pass gives exactly the ratios the loss will see; Σρ, Σρ², N are summed over ranks."""
    sums = dict.fromkeys(["ratio_sum", "ratio_sq_sum", "tokens"], 0.0)
    with torch.no_grad(), autocast:
        for micro in micro_batches(batch, minibatch, args.micro_batch_size):
            logprobs = token_logprobs(policy, micro, args.temperature)[0]
            for key, value in ratio_sums(logprobs, micro["sampler_logprobs"], micro["response_mask"]).items():
                sums[key] += value
    return effective_sample_size(fsdp.all_reduce_dict(sums, dist))
# END ALGO LOGIC


def update_policy(policy, reference, optimizer, scheduler, batch, args, dist, autocast) -> dict:
    """Old and reference log-probs, then minibatch updates on one rollout batch (this rank's share).
    Returns statistics summed over this rank's tokens (reduce them over ranks before dividing)."""
    # old log-probs only when π_θ will move away from π_old within this batch (else ratio ≡ 1)
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    with torch.no_grad(), autocast:
        for key, model in (("old_logprobs", policy if multiple_updates else None), ("ref_logprobs", reference)):
            if model is not None:
                batch[key] = torch.zeros_like(batch["sampler_logprobs"])
                for micro in micro_batches(batch, every_row, args.micro_batch_size):
                    logprobs = token_logprobs(model, micro, args.temperature)[0]
                    batch[key][micro["rows"], : logprobs.shape[1]] = logprobs
    stats = dict.fromkeys(["loss", "approx_kl", "clipped", "entropy", "kl_ref", "tokens", "grad_norm",
                           "updates", "skipped", "ratio_sum", "kl_behavior", "ess_tokens", "ess_fallbacks"], 0.0)
    stats.update(ratio_min=float("inf"), ratio_max=float("-inf"), ess_min=float("inf"))
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
            # ALGO LOGIC: e_B from each forward pass itself when that is its scope: per micro-batch (the
            # authors' code), or a step that is one micro-batch; else from a no-grad pass over the step
            ess_from_forward = args.ess_scope == "micro-batch" or len(minibatch) <= args.micro_batch_size
            if not ess_from_forward:
                ess, fell_back = minibatch_ess(policy, batch, minibatch, args, dist, autocast)
                stats["ess_fallbacks"] += fell_back
            # END ALGO LOGIC
            # with --ess-scope micro-batch each micro-batch has its own e_B: its rows stay a random draw
            for micro in micro_batches(batch, minibatch, args.micro_batch_size, by_length=args.ess_scope != "micro-batch"):
                mask = micro["response_mask"]
                with autocast:
                    logprobs, entropy = token_logprobs(policy, micro, args.temperature, with_entropy=True)
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # ALGO LOGIC: the P3O loss of this micro-batch
                if ess_from_forward:
                    ess, fell_back = effective_sample_size(
                        fsdp.all_reduce_dict(ratio_sums(logprobs, micro["sampler_logprobs"], mask), dist))
                    stats["ess_fallbacks"] += fell_back
                if args.loss == "p3o":
                    token_losses, ratio, clip_active, kl_behavior = p3o_loss(
                        logprobs, micro["sampler_logprobs"], micro["advantages"], mask, ess)
                else:  # the GRPO baseline: e_B is only logged
                    token_losses, ratio, clip_active, kl_behavior = clipped_behavior_loss(
                        logprobs, micro["sampler_logprobs"], micro["advantages"], mask, args.clip_eps)
                if reference is not None:
                    log_ref_ratio = micro["ref_logprobs"] - logprobs
                    kl_ref = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 estimate of KL(π_θ ‖ π_ref)
                    token_losses = token_losses + args.kl_coef * kl_ref
                    stats["kl_ref"] += (kl_ref.detach() * mask).sum().item()
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
                    stats["ratio_sum"] += (ratio * mask).sum().item()
                    stats["kl_behavior"] += (kl_behavior * mask).sum().item()
                    stats["ess_tokens"] += ess * mask.sum().item()  # e_B weighted by the tokens it applied to
                    stats["ess_min"] = min(stats["ess_min"], ess)
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
    # One rank: the hf engine can share the trainer's module; several, or stale rollouts: it keeps a full copy.
    policy = AutoModelForCausalLM.from_pretrained(checkpoint or args.model, dtype=torch.float32)
    share_weights = dist.world_size == 1 and args.sync_every == 1
    engine = make_engine(args.rollout_engine, policy, tokenizer, dtype=args.engine_dtype, share_weights=share_weights,
                         model_path=checkpoint or args.model, max_model_len=min(args.max_prompt_tokens + args.max_new_tokens,
                                           policy.config.max_position_embeddings),
                         seed=args.seed + dist.rank, gpu_memory_utilization=args.gpu_memory_utilization,
                         sleep_mode=args.vllm_sleep_mode, device=device)
    policy = policy.to(device)
    if args.gradient_checkpointing:  # before sharding; non-reentrant, as FSDP2 requires
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = fsdp.shard(policy, dist, cpu_offload=args.cpu_offload)
    reference = None
    if args.kl_coef > 0:
        reference = fsdp.shard(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval(),
                               dist, cpu_offload=args.cpu_offload)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    start_step, skipped_steps = 0, 0
    if checkpoint:
        state = fsdp.load_checkpoint(checkpoint, policy, optimizer, dist)
        scheduler.load_state_dict(state["scheduler"])
        start_step, skipped_steps = state["step"], state["skipped_steps"]
    tracker = Tracker(run_dir, os.path.basename(run_dir), asdict(args), args.track, args.wandb_project_name,
                      args.wandb_entity, enabled=dist.is_main, resume_step=start_step if checkpoint else None)

    eval_kwargs = dict(task=eval_task, k=args.eval_k, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, use_chat_template=args.chat_template, dist=dist)
    if args.eval_every and start_step == 0:
        tracker.log(evaluate(engine, tokenizer, eval_rows, **eval_kwargs), step=0)
    local_prompts = args.prompts_per_step // dist.world_size
    # μ samples at its own temperature when one is given (its log-probs too); π_θ's are at --temperature
    sampling_temperature = args.temperature if args.sampling_temperature is None else args.sampling_temperature

    progress = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not dist.is_main)
    for step in progress:
        step_start = time.time()
        # 1. rollout: G completions per prompt, with the sampler's log-probs μ of the sampled tokens
        #    (each rank takes whole groups, so group statistics are those of one process)
        indices = sample_batch(len(train_rows), step, args.prompts_per_step, args.seed)
        indices = indices[dist.rank * local_prompts : (dist.rank + 1) * local_prompts]
        step_prompts = [prompts[i] for i in indices]
        completions = engine.generate(step_prompts, args.group_size, args.max_new_tokens, sampling_temperature)
        rollout_seconds = time.time() - step_start

        # 2. rewards and advantages
        scores = score_completions(completions, [train_rows[i] for i in indices], args.group_size, tokenizer,
                                   bare=args.task == "arith")
        rewards = torch.tensor([s.reward for s in scores], device=device).view(-1, args.group_size)
        advantages = compute_advantages(rewards, args.scale_advantages).flatten()
        batch = make_batch(step_prompts, completions, args.group_size, tokenizer.pad_token_id, device)
        batch["advantages"] = advantages

        # 3-4. old / reference log-probs, then the minibatch updates (a sleeping engine frees the GPU)
        train_start = time.time()
        engine.sleep()
        stats = update_policy(policy, reference, optimizer, scheduler, batch, args, dist, autocast)
        skipped_steps += int(stats["skipped"])
        train_seconds = time.time() - train_start

        # 5. push the new weights to the engine (every rank gathers each full tensor in turn): every
        #    --sync-every steps (stale rollouts in between), and before an evaluation of the trained policy
        sync_start = time.time()
        evaluate_now = args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps)
        engine.wake_up(["weights"])
        if (step + 1) % args.sync_every == 0 or evaluate_now:
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
            "kl_ref": stats["kl_ref"], "mismatch_kl": mismatch["kl_sum"], "mismatch_tokens": mismatch["tokens"],
            "ratio_sum": stats["ratio_sum"], "kl_behavior": stats["kl_behavior"], "ess_tokens": stats["ess_tokens"],
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
            "charts/lr": scheduler.get_last_lr()[0],
            "charts/skipped_steps": skipped_steps,
            "charts/tokens_per_second": sums["length"] / step_seconds,
            "losses/policy_loss": stats["loss"] / max(stats["updates"], 1),  # already summed over ranks
            "losses/approx_kl": sums["approx_kl"] / sums["tokens"],
            "losses/clip_fraction": sums["clipped"] / sums["tokens"],
            "losses/ratio_min": -extremes["neg_ratio_min"],
            "losses/ratio_max": extremes["ratio_max"],
            "losses/ratio_mean": sums["ratio_sum"] / sums["tokens"],
            "losses/kl_behavior": sums["kl_behavior"] / sums["tokens"],
            "losses/ess": sums["ess_tokens"] / sums["tokens"],
            "losses/ess_min": stats["ess_min"],  # e_B is the same on every rank
            "losses/ess_fallbacks": stats["ess_fallbacks"],
            "losses/grad_norm": stats["grad_norm"] / max(stats["updates"], 1),  # the global norm
            "mismatch/kl_k3": sums["mismatch_kl"] / sums["mismatch_tokens"],
            "mismatch/max_abs_logprob_diff": extremes["mismatch_max"],
            "time/rollout": rollout_seconds,
            "time/train": train_seconds,
            "time/weight_sync": sync_seconds,
            "time/step": step_seconds,
        }
        if reference is not None:
            metrics["losses/kl_ref"] = sums["kl_ref"] / sums["tokens"]
        if evaluate_now:
            eval_start = time.time()
            metrics.update(evaluate(engine, tokenizer, eval_rows, **eval_kwargs))
            metrics["time/eval"] = time.time() - eval_start
        tracker.log(metrics, step=step + 1)
        progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}", **(
            {"eval_greedy": f"{metrics['eval/greedy_accuracy']:.3f}"} if "eval/greedy_accuracy" in metrics else {}))
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
            trainer_state = {"step": step + 1, "skipped_steps": skipped_steps, "scheduler": scheduler.state_dict(),
                             "args": asdict(args)}
            fsdp.save_checkpoint(run_dir, step + 1, policy, tokenizer, optimizer, trainer_state, dist,
                                 args.keep_checkpoints)

    plot = tracker.close(plot_keys=[
        "charts/reward", "eval/greedy_accuracy", f"eval/avg@{args.eval_k}", "charts/entropy",
        "charts/response_length_mean", "losses/ess", "losses/kl_behavior", "losses/clip_fraction",
        "losses/grad_norm", "mismatch/kl_k3"])
    if dist.is_main:
        print(f"run folder: {run_dir}" + (f" (plot: {plot})" if plot else ""))
    fsdp.barrier(dist)
    engine.close()
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(tyro.cli(Args))
