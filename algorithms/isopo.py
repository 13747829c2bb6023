"""ISOPO: per-sequence log-prob gradients normalized in the Fisher metric, layer by layer, in one backward pass.

Paper: ISOPO: Proximal policy gradients without pi-old (Abrahamsen, 2025, arXiv:2512.23353); the
authors' code is github.com/nilin/isopo (a verl fork, verl/workers/actor/dp_actor.py). Advantages as in
GRPO (DeepSeekMath, Shao et al., 2024, arXiv:2402.03300).

Objective. No π_old, no ratio, no clip: one plain gradient step, whose direction is built per Linear layer
l (lm_head included). With v_i = ∇_{θ_l} log π_θ(o_i | q_i) the gradient of a whole sequence's log-prob,
A_i the group-normalized advantage and M the number of sequences in the minibatch (those with a response
token), the vanilla policy
gradient g_l = (1/M) Σ_i A_i v_i (§1.2; g = (1/n) JᵀA in §3) becomes

  non-interacting (default; §2, Alg. 2, Fig. 3):
    u_l = (1/M) Σ_i A_i s_i v_i,     s_i = reg2(‖v_i‖_F)^p · reg2(‖v_i‖)^q · reg2(‖v_i‖_F / ‖v_i‖)^r
    ‖v_i‖_F ≈ sqrt(Σ_j (g0_j · V_i a0_j)²) / sqrt(Σ_j (‖g0_j‖ ‖a0_j‖)²)    (Eq. 6; V_i = v_i as a matrix,
              j over --n-overlap random token rows: output gradient g0_j and input a0_j of the layer)
    reg2(x)  = sqrt(x² + λ·E[x²] + 1e-8),   E = EMA (decay 0.9) of trailing minibatch means, per layer
    p = −1, q = r = 0 (default): every sequence moves the policy by the same KL (§2.0.1); p = q = 0, r = −2:
    the multiple of v_i closest to the natural gradient (§2.0.3, Eq. 7); q = −1: Euclidean normalization.

  interacting (--variant interacting; §3, Alg. 6):
    u_l = (1/M) Σ_micro-batches Jᵀ (K + cI)⁻¹ A,    J = [v_1; ..; v_m] over the m sequences of a micro-batch,
    K = J Jᵀ the layer's empirical NTK,  c = --ntk-reg-coef × EMA of trailing minibatch means of mean eig(K)

and AdamW steps on −u_l. Every other parameter (embeddings, norms, Linear biases) takes the vanilla
REINFORCE gradient (1/M) Σ_i A_i ∇ log π(o_i | q_i); A_i = (r_i − mean_G r) / (std_G r + 1e-4).

What changes relative to grpo.py: the loss is gone (no π_old, ratio, clip or loss aggregation); one
backward pass of Σ log π (no advantages) runs through hooks on every module that owns parameters, and
the hooks build every gradient (`IsopoHooks`); the micro-batch becomes part of the math (point 5);
--kl-coef becomes --log-kl-ref (a metric only); one rank only (point 9). The rest (rollouts, advantages,
minibatch loop, clipping of the global grad norm, logging, checkpoints) is grpo.py's.

Implementation details
1. One backward, no wasted weight gradients. A forward hook on every module that owns parameters keeps
   its input and hooks its output tensor; the backward is `torch.autograd.grad(Σ log π, embedding
   output)`, which carries output gradients g_t through every module but computes no parameter gradient:
   autograd's own weight GEMMs, which ISOPO would throw away (the authors' code computes and overwrites
   them), are skipped. The backward hooks assign every `.grad` themselves.
2. Per-sequence gradient of a Linear layer: V_i = Σ_{t ∈ row i} g_t a_tᵀ over every non-pad position of the
   row, prompt positions included (the response attends to them: this is exactly ∇ log π(o_i | q_i)); pads
   are masked (g_t = 0). The trainer's log-probs divide the logits by the temperature, as in grpo.py.
3. Gram forms, no [out, in] matrix per sequence:
   u_ij = g0_jᵀ V_i a0_j = Σ_{t∈i} (g0_j·g_t)(a0_j·a_t)        (Eq. 4, cost k·N·(out+in))
   ‖V_i‖² = Σ_{t,t'∈i} (g_t·g_t')(a_t·a_t'),   K_ij = Σ_{t∈i, t'∈j} (g_t·g_t')(a_t·a_t')
   (the last two switch to per-sequence matrices built a block of rows at a time when that costs fewer
   FLOPs), and the layer's update is one GEMM, Σ_t w_t g_t a_tᵀ, with w_t the weight of t's sequence.
4. Overlap rows (Eq. 6): --n-overlap token rows drawn uniformly without replacement among the non-pad
   positions the layer sees, afresh per layer and micro-batch and shared by the micro-batch's sequences
   (Alg. 2 line 6; they may include the sequence's own tokens). When a micro-batch has fewer rows, all are
   used (padding rows fill the sample and add exactly 0 to both sums). For lm_head the positions are those
   where logits are computed (grpo.py's logits_to_keep).
5. Micro-batches are part of the method: the Fisher-estimate pool (non-interacting) and the NTK
   (interacting) are per micro-batch, as in Alg. 2 and 6, so --micro-batch-size changes the update
   (the default 8 is the paper's). Per-sequence statistics never cross micro-batches, so nothing is
   kept beyond one micro-batch; the weights use the minibatch's M, so micro-batch updates add up to the
   minibatch update as in grpo.py's gradient accumulation.
6. Regularization E[x²] (and c's E[mean eig K]) is an EMA over *trailing* minibatch means, per layer
   (Alg. 2's comment, Fig. 7): s_i is then known while its micro-batch is in the backward, and the update
   is built on the fly. Before any minibatch has finished (the first one), E is the mean over the
   current micro-batch. The EMA is updated after each optimizer step (not after a skipped one) and saved
   in checkpoints, so --resume continues exactly.
7. Parameters other than Linear weights get the vanilla REINFORCE gradient: the hook of their module
   re-runs its forward on the detached inputs and takes the vector-Jacobian product with g_t weighted by
   −A_i/M, the REINFORCE loss's weight of t's sequence (a norm or a lookup: cheap); Linear biases get
   Σ_t (−A_i/M) g_t. With tied embeddings (the tiny model, Qwen3-0.6B) the embedding lookup's gradient and
   lm_head's ISOPO update add into the one tensor.
8. Units: v_i is the gradient of log π itself (a sum over the sequence's tokens), so E[·] does not depend
   on batch or micro-batch sizes. For p + q = −1 without regularization (every setting the paper ran) the
   update does not depend on the scale of v at all; the interacting update does.
9. One rank only (torchrun with more than one process is refused with an error): the hooks assemble full
   gradient tensors outside autograd, so under FSDP2 they would have to be summed over ranks and cut into
   each rank's shard by hand, and the EMA statistics all-reduced; that path is not written or tested
   here. The authors' code is single-GPU as well (it writes full gradients into the local shard), and the
   paper's model (Qwen3-0.6B) trains on one GPU.
10. A step whose loss or gradient norm is not finite is skipped (charts/skipped_steps) and leaves the EMA
   untouched; weights never become NaN. A module whose parameters are used outside its own forward, or a
   Linear called twice in one forward, gets a clear error rather than a silently wrong gradient.

Logged metrics (metrics.jsonl in the run folder; wandb with --track; curves.png at the end)
  charts/reward, charts/accuracy       mean reward and fraction of correct rollouts of the step
  charts/no_answer_rate                fraction of rollouts with no extractable answer
  charts/response_length_mean|max      completion length in tokens (EOS included)
  charts/truncation_rate               fraction stopped by --max-new-tokens
  charts/zero_std_group_fraction       groups whose rewards are all equal (they carry no signal)
  charts/entropy                       mean full-vocabulary entropy of π_θ at response tokens
  charts/lr, charts/tokens_per_second, charts/skipped_steps
  losses/policy_loss                   value of the REINFORCE loss −(1/M) Σ_i A_i log π(o_i|q_i) (the loss whose
                                       gradient ISOPO transforms; not minimized as such)
  losses/approx_kl                     k3 KL(π_old ‖ π_θ) on trained tokens: 0 with one update per batch, the
                                       uncorrected off-policy drift of later minibatches otherwise
  losses/grad_norm                     global norm of the assembled ISOPO gradient, before clipping
  losses/kl_ref                        k3 KL(π_θ ‖ π_ref) to the initial policy (with --log-kl-ref; Fig. 5's drift)
  mismatch/kl_k3, mismatch/max_abs_logprob_diff   KL(μ ‖ π_old) and max |log μ − log π_old| (engine μ)
  time/rollout|train|weight_sync|eval|step   seconds per phase
  eval/greedy_accuracy, eval/avg@k, eval/pass@k    on held-out prompts, every --eval-every steps
  Per layer group (the module name's last part: q_proj, ..., down_proj, lm_head), over the step's
  sequences and the group's layers:
  isopo/<group>/fisher_norm            mean Fisher-norm estimate ‖v_i‖_F (Eq. 6)          [non-interacting]
  isopo/<group>/euclid_norm, rel_fisher_norm   mean ‖v_i‖ and ‖v_i‖_F/‖v_i‖ (only when q or r ≠ 0)
  isopo/<group>/scale_mean|min|max     the sequence scales s_i (Fig. 3)
  isopo/<group>/reg_fisher (reg_euclid, reg_rel)   the regularization λ·E[x²] added under reg2's root
  isopo/<group>/ntk_eig_mean|max       mean and largest eigenvalue of the micro-batch NTK K  [interacting]
  isopo/<group>/ntk_reg                c = --ntk-reg-coef × E[mean eig K]
  isopo/<group>/shrink                 ‖c (K + cI)⁻¹ A‖ / ‖A‖: 1 = vanilla policy gradient, → 0 = damped
                                       (absent from a step in which every advantage is 0)
  Dropped from grpo.py: losses/clip_fraction and losses/ratio_min|max (there is no ratio and no clip).

Known differences from the authors' code (commit 2686cda), each a deliberate choice
  * Non-Linear parameters (RMSNorm, untied embeddings) receive an advantage-free gradient there (the
    gradient of token-mean −log π: SFT on the own samples), tied embeddings lose their lookup gradient
    (lm_head's update overwrites it), and Linear biases are zeroed. Here: REINFORCE gradients, and the
    two tied contributions add (point 7).
  * Exponents follow the paper (Fig. 3): the code's "neg powers" are negated and reordered (paper
    p = −overlap_neg_power, q = −norm_neg_power, r = −rel_overlap_neg_power).
  * Regularization: the paper's reg2(x) = sqrt(x² + λE[x²]); the code's default (keep_small_invariant)
    is sqrt(x²/(λE[x²]) + 1), the same up to a per-layer factor: --reg-form authors. Before any history the
    code uses each sequence's own value as E; here the micro-batch mean (point 6). The paper's runs and
    the code's run.sh use no regularization for the non-interacting variant, hence --reg-coef 0.
  * Interacting: the paper's v = Jᵀ(K + cI)⁻¹A; the code multiplies by c, v = Jᵀ c(K + cI)⁻¹A, which is
    dimensionless and tends to the vanilla gradient where K ≪ c: --ntk-scale authors.
  * The code's v_i is the gradient of the token-mean loss divided by the gradient-accumulation count,
    and its update a sum over the minibatch's sequences; here v_i is the gradient of log π (point 8) and
    the update a mean over sequences. For p + q = −1 without regularization the two differ by the
    constant factor M; otherwise by a batch-dependent scale (which AdamW mostly absorbs).
  * The code computes and discards autograd's weight gradients and materializes every V_i; here neither
    (points 1, 3). Its optimizer: AdamW betas (0.9, 0.999), weight decay 0.01; grpo.py's betas are
    (0.9, 0.99) and are kept.

Run it
  python algorithms/isopo.py                                  # built-in tiny task, CPU, a few minutes
  ./run.sh bench isopo                                        # accuracy vs KL drift on the built-in task (README)
  python algorithms/isopo.py --variant interacting            # the NTK variant
  # the paper's setting (§2.1; run.sh of the official code): Qwen3-0.6B on GSM8K, one GPU
  python algorithms/isopo.py --model Qwen/Qwen3-0.6B --task gsm8k --eval-task gsm8k \\
      --steps 102 --prompts-per-step 128 --group-size 8 --max-prompt-tokens 512 --max-new-tokens 2048 \\
      --lr 2e-6 --weight-decay 0.01 --num-minibatches 2 --micro-batch-size 8 --dtype bfloat16 \\
      --rollout-engine vllm --eval-every 10 --eval-prompts 1319 --eval-k 1 --log-kl-ref --track
  #   add --variant interacting for Fig. 7, --p 0 --q -1 --r -2 for Fig. 4, --p 0 --q -1 for Fig. 5 (yellow)
  python algorithms/isopo.py --resume auto                    # continue the newest run of this task/name/seed
"""

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro
from tqdm import tqdm

from common import fsdp
from common.evaluate import evaluate, score_completions
from common.reward import encode_prompts, load_task, sample_batch
from common.rollout import load_tokenizer, make_engine
from common.tiny import resolve_model
from common.tracking import Tracker


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the run: sampling, prompt order, minibatch order, overlap rows"""
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
    micro_batch_size: int = 8
    """sequences per forward/backward; in ISOPO also the block that shares one Fisher-estimate pool and one NTK (paper: 8), so it changes the update"""
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
    variant: Literal["non-interacting", "interacting"] = "non-interacting"
    """non-interacting: rescale each sequence's gradient by s_i (Alg. 2, Fig. 3); interacting: precondition the advantages with each layer's micro-batch NTK (Alg. 6)"""
    p: float = -1.0
    """exponent of the Fisher-norm estimate ‖v_i‖_F in s_i (Fig. 3; −1: equal KL per sequence)"""
    q: float = 0.0
    """exponent of the Euclidean norm ‖v_i‖ in s_i (Fig. 3; −1: Euclidean normalization)"""
    r: float = 0.0
    """exponent of the relative Fisher norm ‖v_i‖_F/‖v_i‖ in s_i (Fig. 3; −2 with p = q = 0: closest to the natural gradient, Eq. 7)"""
    n_overlap: int = 250
    """token rows per layer and micro-batch sampled for the Fisher-norm estimate (Eq. 6)"""
    reg_coef: float = 0.0
    """λ in reg2(x) = sqrt(x² + λ·E[x²] + 1e-8), E an EMA of trailing minibatch means per layer (0: none, as in the paper's runs)"""
    reg_form: Literal["paper", "authors"] = "paper"
    """paper: reg2(x) = sqrt(x² + λE[x²]) (Fig. 3); authors: the official code's default sqrt(x²/(λE[x²]) + 1)"""
    ntk_reg_coef: float = 1.0
    """interacting: c = this × EMA of the NTK's mean eigenvalue (Fig. 7: 1.0)"""
    ntk_scale: Literal["paper", "authors"] = "paper"
    """interacting: paper: v = Jᵀ(K + cI)⁻¹A (Alg. 6); authors: v = Jᵀ c(K + cI)⁻¹A as the official code computes it"""
    ema_decay: float = 0.9
    """decay of the EMA over trailing minibatch means that sets the regularization"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    log_kl_ref: bool = False
    """log KL(π_θ ‖ π_ref) to the initial policy, the paper's KL drift (Fig. 5); loads a reference model"""


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
        ("p", not math.isfinite(args.p), "a finite number"),
        ("q", not math.isfinite(args.q), "a finite number"),
        ("r", not math.isfinite(args.r), "a finite number"),
        ("n-overlap", args.n_overlap < 1, ">= 1"),
        ("reg-coef", not args.reg_coef >= 0, ">= 0"),
        ("ntk-reg-coef", not args.ntk_reg_coef > 0, "> 0 (the NTK of m sequences is singular when m exceeds its rank)"),
        ("ema-decay", not 0 <= args.ema_decay < 1, "in [0, 1)"),
    ] if bad]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        problems.append(f"isopo.py runs on one rank (WORLD_SIZE={world_size}): its hooks build full gradients outside "
                        "autograd, which FSDP2 would need summed over ranks and sharded by hand (see the docstring)")
    if not 0 < args.gpu_memory_utilization < 1:
        problems.append("--gpu-memory-utilization must be in (0, 1)")
    if args.prompts_per_step % world_size:
        problems.append(f"--prompts-per-step must be divisible by the number of ranks ({world_size})")
    if problems:
        raise ValueError("invalid arguments: " + "; ".join(problems))


# ALGO LOGIC: advantages, the Fisher-norm estimate, the sequence scales, the NTK preconditioner
def compute_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards [prompts, G] -> advantages [prompts, G]: centred per group, optionally std-scaled."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps) if scale else centred


# In the functions below a Linear layer's micro-batch is g [B, T, out] (gradients of Σ log π w.r.t. its
# outputs, zero at pads) and a [B, T, in] (its inputs); row b is sequence b, and V_b = Σ_t g_bt a_btᵀ.

def overlap_rows(valid: torch.Tensor, n: int) -> torch.Tensor:
    """Eq. 6's sample (Alg. 2 line 6): n distinct flat indices into [B*T], uniform among the non-pad
    positions `valid` [B, T]; with fewer than n of them, all, topped up with pads (which add 0)."""
    if valid.numel() <= n:  # every row (pads add 0): no draw needed
        return torch.arange(valid.numel(), device=valid.device)
    keys = torch.rand(valid.shape, device=valid.device).masked_fill(~valid, 2.0).flatten()
    return keys.topk(n, largest=False).indices


def fisher_norms(g: torch.Tensor, a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Eq. 6: ‖v_b‖_F ≈ sqrt(Σ_j (g0_j · V_b a0_j)²) / sqrt(Σ_j (‖g0_j‖ ‖a0_j‖)²) over the token rows `rows`,
    with g0_j · V_b a0_j = Σ_t (g0_j · g_bt)(a0_j · a_bt) (Eq. 4): no V_b is formed. Returns [B]."""
    g0, a0 = g.flatten(0, 1)[rows], a.flatten(0, 1)[rows]  # [k, out], [k, in]
    overlaps = ((g @ g0.T) * (a @ a0.T)).sum(1)  # [B, k]: Eq. 4's terms
    return overlaps.norm(dim=1) / ((g0.norm(dim=1) * a0.norm(dim=1)).norm() + 1e-12)  # Eq. 5: the denominator


def sequence_gradients(g: torch.Tensor, a: torch.Tensor, budget: int = 2**24):
    """V_b for all b, a block of output rows at a time ([B, rows, in], at most `budget` numbers)."""
    step = max(1, budget // (g.shape[0] * a.shape[-1]))
    for start in range(0, g.shape[-1], step):
        yield torch.einsum("bto,bti->boi", g[..., start : start + step], a)


def sequence_norms(g: torch.Tensor, a: torch.Tensor, form: str = "auto") -> torch.Tensor:
    """Euclidean (Frobenius) norms ‖V_b‖ [B]. gram: ‖V_b‖² = Σ_{t,t'} (g_t·g_t')(a_t·a_t'), B·T²·(out+in)
    FLOPs; materialize: V_b itself, B·T·out·in FLOPs; auto: the cheaper."""
    _, T, out = g.shape
    if form == "auto":
        form = "gram" if T * (out + a.shape[-1]) <= out * a.shape[-1] else "materialize"
    if form == "gram":
        squares = ((g @ g.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum((1, 2))
    else:
        squares = sum(block.square().sum((1, 2)) for block in sequence_gradients(g, a))
    return squares.clamp(min=0).sqrt()


def ntk(g: torch.Tensor, a: torch.Tensor, form: str = "auto") -> torch.Tensor:
    """The layer's empirical NTK K = J Jᵀ [B, B], K_bc = ⟨V_b, V_c⟩ (§3). gram: Σ_{t∈b, t'∈c} (g_t·g_t')(a_t·a_t'),
    B²·T²·(out+in) FLOPs; materialize: B·T·out·in + B²·out·in FLOPs; auto: the cheaper."""
    B, T, out = g.shape
    if form == "auto":
        form = "gram" if B * T * T * (out + a.shape[-1]) <= out * a.shape[-1] * (T + B) else "materialize"
    if form == "gram":
        K = torch.stack([((g @ g[b].T) * (a @ a[b].T)).sum((1, 2)) for b in range(B)])
    else:
        K = sum(block.flatten(1) @ block.flatten(1).T for block in sequence_gradients(g, a))
    return (K + K.T) / 2


def reg2(x: torch.Tensor, coef: float, expectation, form: str = "paper") -> torch.Tensor:
    """Fig. 3's regularized magnitude of x: sqrt(x² + λ·E[x²] + 1e-8) (paper), or the official code's
    default sqrt(x² / (λ·E[x²] + 1e-8) + 1), the paper's divided by sqrt(λ·E[x²]) (authors, λ > 0)."""
    if form == "authors" and coef > 0:
        return torch.sqrt(x.square() / (coef * expectation + 1e-8) + 1)
    return torch.sqrt(x.square() + coef * expectation + 1e-8)


def sequence_quantities(fisher: torch.Tensor, euclid: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The three magnitudes Fig. 3 rescales by: ‖v‖_F, ‖v‖ and ‖v‖_F/‖v‖ (the last two when ‖v‖ is known)."""
    if euclid is None:
        return {"fisher": fisher}
    return {"fisher": fisher, "euclid": euclid, "rel": fisher / (euclid + 1e-12)}


def sequence_scales(quantities: dict, p: float, q: float, r: float, reg_coef: float = 0.0,
                    expectations: dict | None = None, form: str = "paper") -> torch.Tensor:
    """Fig. 3: s = reg2(‖v‖_F)^p · reg2(‖v‖)^q · reg2(‖v‖_F/‖v‖)^r, per sequence; expectations[key] = E[x²]."""
    scales = torch.ones_like(quantities["fisher"])
    for key, power in (("fisher", p), ("euclid", q), ("rel", r)):
        if power:
            expectation = expectations[key] if reg_coef else 0.0
            scales = scales * reg2(quantities[key], reg_coef, expectation, form) ** power
    return scales


def preconditioned_weights(K: torch.Tensor, weights: torch.Tensor, c, form: str = "paper", eigenvalues=False):
    """Alg. 6: (K + cI)⁻¹ A through K = U diag(D) Uᵀ (paper), or c (K + cI)⁻¹ A (authors); also D if asked.
    In float64; a non-finite K gives a non-finite result (the step is then skipped), not an eigh error."""
    finite = torch.isfinite(K).all()
    D, U = torch.linalg.eigh(torch.where(finite, K, 0).double())
    c = torch.as_tensor(c, dtype=torch.float64, device=K.device)
    inverse = torch.where(D + c > 0, 1 / (D + c), 0)  # K is PSD and c > 0: D + c > 0 except for K = 0, c = 0
    result = U @ (inverse * (U.T @ weights.double()))
    if form == "authors":
        result = c * result
    result = torch.where(finite, result, torch.nan).to(weights.dtype)
    return (result, D) if eigenvalues else result


def weighted_gradient(g: torch.Tensor, a: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_b weights_b V_b = Σ_t w_t g_t a_tᵀ, one GEMM ([out, in]); the weight goes on the narrower side."""
    if g.shape[-1] >= a.shape[-1]:
        return g.flatten(0, 1).T @ (a * weights[:, None, None]).flatten(0, 1)
    return (g * weights[:, None, None]).flatten(0, 1).T @ a.flatten(0, 1)


class TrailingMeans:
    """E[·] of Alg. 2 / Fig. 3 / Fig. 7: per key (layer, quantity), an EMA over the means of *finished*
    minibatches (the first taken as is), so the current minibatch never enters its own regularization."""

    def __init__(self, decay: float):
        self.decay, self.ema, self.pending = decay, {}, {}

    def get(self, key):
        return self.ema.get(key)

    def add(self, key, values: torch.Tensor) -> None:
        self.pending.setdefault(key, []).append(values.detach().reshape(-1))

    def end_minibatch(self, commit: bool = True) -> None:
        for key, values in self.pending.items() if commit else ():
            mean = torch.cat(values).double().mean().item()
            self.ema[key] = mean if key not in self.ema else self.decay * self.ema[key] + (1 - self.decay) * mean
        self.pending = {}


class IsopoHooks:
    """Turns one backward of Σ log π into the ISOPO gradient of every parameter (points 1-7 of the docstring).

        hooks = IsopoHooks(model, args)
        with hooks.capture(micro["attention_mask"], weights):   # weights_i = −A_i/M = ∂L_REINFORCE/∂log π(o_i)
            logprobs = ...forward...
        hooks.backward((logprobs * response_mask).sum())        # per micro-batch: accumulates
        hooks.set_gradients()                                   # per minibatch: p.grad for every parameter
        hooks.end_minibatch(commit=step_was_taken)              # fold this minibatch into the EMA
    """

    def __init__(self, model: torch.nn.Module, args: Args):
        self.args, self.stats = args, TrailingMeans(args.ema_decay)
        self.parameters = {p: name for name, p in model.named_parameters() if p.requires_grad}
        self.micro, self.roots, self.grads, self.log, self.handles = None, [], {}, {}, []
        self.trace = None  # set to a list to record each layer's statistics (tests)
        for name, module in model.named_modules():
            own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if isinstance(module, torch.nn.Linear) and set(own) - {"weight", "bias"}:
                raise ValueError(f"ISOPO: Linear module {name} has parameters {own}; only weight and bias are handled")
            if own:
                self.handles.append(module.register_forward_hook(partial(self._forward, name), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @contextlib.contextmanager
    def capture(self, attention_mask: torch.Tensor, weights: torch.Tensor):
        """Arm the hooks for the forward pass of one micro-batch ([B, T] non-pad mask, [B] weights)."""
        self.micro = {"valid": attention_mask.bool(), "weights": weights.detach(), "called": set()}
        try:
            yield
        finally:
            self.micro = None

    def backward(self, objective: torch.Tensor) -> None:
        """Output gradients for every hooked module, no parameter gradient from autograd (point 1)."""
        roots, self.roots = self.roots, []
        if not roots:
            raise RuntimeError("ISOPO: no module output requires grad; run the forward inside capture()")
        torch.autograd.grad(objective, roots, allow_unused=True)

    def set_gradients(self) -> None:
        for parameter, name in self.parameters.items():
            if parameter not in self.grads:
                raise ValueError(f"ISOPO: no gradient reached parameter {name}: its module never ran inside "
                                 "capture(), or the parameter is used outside its module's forward")
            parameter.grad = self.grads.pop(parameter).to(parameter.dtype)

    def end_minibatch(self, commit: bool = True) -> None:
        self.stats.end_minibatch(commit)

    def state_dict(self) -> dict:
        return {"ema": dict(self.stats.ema)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.ema = dict(state["ema"])

    def metrics(self) -> dict[str, float]:
        """The per-group statistics since the last call: means (NaN entries left out), minima or maxima."""
        out = {}
        for (group, key, how), values in sorted(self.log.items()):
            values = torch.cat([torch.as_tensor(v).reshape(-1).double() for v in values]).cpu()
            values = values[~values.isnan()]
            if len(values):
                out[f"isopo/{group}/{key}"] = getattr(values, how)().item()
        self.log = {}
        return out

    # --- the hooks -----------------------------------------------------------------------------------------
    def _forward(self, name, module, args, kwargs, output):
        micro = self.micro
        if micro is None or not torch.is_grad_enabled():
            return  # rollouts, evaluation, no-grad passes: nothing to do
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if isinstance(module, torch.nn.Linear) and name in micro["called"]:
            raise ValueError(f"ISOPO: Linear {name} ran twice in one forward pass; "
                             "its per-sequence statistics need one call")
        micro["called"].add(name)
        if output.dim() < 2 or output.shape[:1] != micro["valid"].shape[:1] or output.shape[1] > micro["valid"].shape[1]:
            raise ValueError(f"ISOPO: module {name} returned {tuple(output.shape)}; expected [batch, positions, ...]")
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not any(t.requires_grad for t in inputs):
            self.roots.append(output)  # e.g. the embedding lookup: where the backward stops
        if isinstance(module, torch.nn.Linear):
            activations = (args[0] if args else kwargs["input"]).detach()
            output.register_hook(partial(self._linear_backward, name, module, activations, micro))
        else:
            detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
            autocast = (output.device.type, torch.is_autocast_enabled(output.device.type),
                        torch.get_autocast_dtype(output.device.type))
            output.register_hook(partial(self._module_backward, name, module, [detach(x) for x in args],
                                         {k: detach(v) for k, v in kwargs.items()}, autocast, micro))

    def _linear_backward(self, name, module, a, micro, g):
        """A Linear layer's ISOPO update for one micro-batch, added to its weight's gradient."""
        if g.dim() != 3 or a.dim() != 3:
            raise ValueError(f"ISOPO: Linear {name} saw {tuple(a.shape)} -> {tuple(g.shape)}; "
                             "expected [batch, positions, features]")
        valid = micro["valid"][:, -g.shape[1]:]  # lm_head sees only the last positions (logits_to_keep)
        dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        g, a = g.to(dtype, copy=True).mul_(valid[..., None]), a.to(dtype)  # one copy of g, pads masked
        weights = micro["weights"].to(dtype)
        group = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if self.args.variant == "non-interacting":
                coefficients = weights * self._scales(name, group, g, a, valid)
            else:
                coefficients = self._precondition(name, group, g, a, weights)
            self._add(module.weight, weighted_gradient(g, a, coefficients))
            if module.bias is not None:  # a bias is not a Linear weight: the REINFORCE gradient (point 7)
                self._add(module.bias, torch.einsum("bto,b->o", g, weights))

    def _scales(self, name, group, g, a, valid):
        """Non-interacting: s_i of Fig. 3 from the Eq. 6 estimate (and ‖v_i‖ when q or r needs it)."""
        args = self.args
        rows = overlap_rows(valid, args.n_overlap)
        euclid = sequence_norms(g, a) if args.q or args.r else None
        quantities = sequence_quantities(fisher_norms(g, a, rows), euclid)
        expectations = {}
        for key, x in quantities.items():
            trailing = self.stats.get((name, key))
            expectations[key] = x.square().mean() if trailing is None else trailing  # point 6
            self.stats.add((name, key), x.square())
            self._log(group, {"fisher": "fisher_norm", "euclid": "euclid_norm", "rel": "rel_fisher_norm"}[key], x)
            self._log(group, f"reg_{key}", args.reg_coef * expectations[key])
        scales = sequence_scales(quantities, args.p, args.q, args.r, args.reg_coef, expectations, args.reg_form)
        self._log(group, "scale_mean", scales)
        self._log(group, "scale_min", scales, how="min")
        self._log(group, "scale_max", scales, how="max")
        if self.trace is not None:
            self.trace.append({"layer": name, "rows": rows, "quantities": quantities, "expectations": expectations,
                               "scales": scales})
        return scales

    def _precondition(self, name, group, g, a, weights):
        """Interacting: (K + cI)⁻¹ A with the layer's micro-batch NTK, c = coef × E[mean eig K] (Alg. 6, Fig. 7)."""
        K = ntk(g, a)
        trailing = self.stats.get((name, "ntk_eig"))
        c = self.args.ntk_reg_coef * (K.diagonal().mean() if trailing is None else trailing)  # mean eig = trace/m
        self.stats.add((name, "ntk_eig"), K.diagonal())
        preconditioned, eigenvalues = preconditioned_weights(K, weights, c, self.args.ntk_scale, eigenvalues=True)
        damped = preconditioned if self.args.ntk_scale == "authors" else c * preconditioned
        self._log(group, "ntk_eig_mean", K.diagonal())
        self._log(group, "ntk_eig_max", eigenvalues, how="max")
        self._log(group, "ntk_reg", c)
        self._log(group, "shrink", damped.norm() / weights.norm())  # NaN (left out) when every A_i = 0
        if self.trace is not None:
            self.trace.append({"layer": name, "K": K, "c": c, "weights": preconditioned})
        return preconditioned

    def _module_backward(self, name, module, args, kwargs, autocast, micro, g):
        """Any other module with parameters: the REINFORCE gradient, as the vector-Jacobian product of its
        re-run forward with g_t weighted by its sequence's weight (point 7)."""
        valid = micro["valid"][:, -g.shape[1]:]
        weights = (micro["weights"][:, None] * valid).to(g.dtype).view(*g.shape[:2], *[1] * (g.dim() - 2))
        parameters = [p for p in module.parameters(recurse=False) if p.requires_grad]
        device_type, enabled, dtype = autocast
        with torch.enable_grad(), torch.autocast(device_type, dtype, enabled=enabled):
            output = module.forward(*args, **kwargs)  # forward(), not __call__: no hooks
            grads = torch.autograd.grad(output, parameters, g * weights)
        for parameter, grad in zip(parameters, grads):
            self._add(parameter, grad)

    def _add(self, parameter, grad):
        self.grads[parameter] = self.grads[parameter] + grad if parameter in self.grads else grad

    def _log(self, group, key, values, how="mean"):
        """Keep the values; they are reduced (no device sync before) in metrics()."""
        self.log.setdefault((group, key, how), []).append(values.detach() if isinstance(values, torch.Tensor) else values)


def isopo_backward(policy, hooks: IsopoHooks, micro: dict, temperature: float, minibatch_sequences: int, autocast):
    """One micro-batch: forward with the hooks armed, one backward of Σ log π without advantages (Alg. 2
    line 2); the hooks add this micro-batch's share of every gradient. Returns (logprobs, entropy, loss)."""
    mask = micro["response_mask"]
    weights = -micro["advantages"] / minibatch_sequences  # ∂L/∂log π(o_i|q_i), L = −(1/M) Σ_i A_i log π(o_i|q_i)
    with autocast, hooks.capture(micro["attention_mask"], weights):
        logprobs, entropy = token_logprobs(policy, micro, temperature, with_entropy=True)
    sequence_logprobs = (logprobs * mask).sum(1)
    hooks.backward(sequence_logprobs.sum())
    return logprobs, entropy, (weights * sequence_logprobs.detach()).sum()
# END ALGO LOGIC


def token_logprobs(model, micro, temperature, with_entropy=False):
    """Log-probs [B, T] of the response tokens under `model` at `temperature` (and their entropy)."""
    response_width = micro["response_ids"].shape[1]
    logits = model(
        input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], position_ids=micro["position_ids"],
        logits_to_keep=response_width + 1, use_cache=False,  # the lm_head only runs where a response token is predicted
    ).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, micro["response_ids"][..., None]).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


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


def update_policy(policy, reference, optimizer, scheduler, batch, args, dist, autocast, hooks) -> dict:
    """Old and reference log-probs (metrics only), then minibatch updates on one rollout batch.
    Returns statistics summed over this rank's tokens."""
    # old log-probs only when π_θ will move away from π_old within this batch (for the metrics: ISOPO has no ratio)
    multiple_updates = args.num_minibatches * args.update_epochs > 1
    every_row = torch.arange(len(batch["advantages"]), device=batch["advantages"].device)
    with torch.no_grad(), autocast:
        for key, model in (("old_logprobs", policy if multiple_updates else None), ("ref_logprobs", reference)):
            if model is not None:
                batch[key] = torch.zeros_like(batch["sampler_logprobs"])
                for micro in micro_batches(batch, every_row, args.micro_batch_size):
                    logprobs = token_logprobs(model, micro, args.temperature)[0]
                    batch[key][micro["rows"], : logprobs.shape[1]] = logprobs
    stats = dict.fromkeys(["loss", "approx_kl", "entropy", "kl_ref", "tokens", "grad_norm", "updates", "skipped"], 0.0)
    if multiple_updates:
        stats["mismatch"] = train_inference_mismatch(batch["old_logprobs"], batch["sampler_logprobs"], batch["response_mask"])

    for epoch in range(args.update_epochs):
        order = torch.randperm(len(every_row), device=every_row.device)
        for minibatch in order.chunk(args.num_minibatches):
            # sequence-mean counts the completions that have a response token (an empty one adds nothing)
            response_mask = batch["response_mask"][minibatch]
            counts = fsdp.all_reduce_dict({"tokens": response_mask.sum().item(),
                                           "sequences": response_mask.any(1).sum().item()}, dist)
            minibatch_tokens, minibatch_sequences = counts["tokens"], counts["sequences"]
            if minibatch_tokens == 0:  # no response token on any rank: nothing to learn, no step (counted)
                stats["skipped"] += 1
                continue
            minibatch_loss = 0.0
            # ISOPO's micro-batch is the block that shares one Fisher-estimate pool and one NTK (part of the
            # method): its rows stay a random draw, not sorted by length
            for micro in micro_batches(batch, minibatch, args.micro_batch_size, by_length=False):
                mask = micro["response_mask"]
                # ALGO LOGIC: one backward of Σ log π; the hooks build this micro-batch's share of the update
                logprobs, entropy, loss = isopo_backward(policy, hooks, micro, args.temperature, minibatch_sequences,
                                                         autocast)
                # END ALGO LOGIC
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                minibatch_loss += loss.item()
                with torch.no_grad():
                    log_ratio = (logprobs - old_logprobs).detach()
                    stats["approx_kl"] += ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum().item()
                    stats["entropy"] += (entropy * mask).sum().item()
                    stats["tokens"] += mask.sum().item()
                    if reference is not None:
                        log_ref_ratio = micro["ref_logprobs"] - logprobs.detach()
                        kl_ref = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 estimate of KL(π_θ ‖ π_ref)
                        stats["kl_ref"] += (kl_ref * mask).sum().item()
                    if not multiple_updates:  # this single pass sees every rollout once, under π_old
                        stats["mismatch"] = train_inference_mismatch(
                            old_logprobs, micro["sampler_logprobs"], mask, stats.get("mismatch"))
            hooks.set_gradients()
            grad_norm = fsdp.clip_grad_norm(policy, args.max_grad_norm, dist.device)
            minibatch_loss = fsdp.all_reduce(minibatch_loss, dist)
            finite = bool(torch.isfinite(grad_norm) and torch.isfinite(torch.tensor(minibatch_loss)))
            if finite:
                optimizer.step()
                scheduler.step()
            else:
                stats["skipped"] += 1  # never write NaN weights
            hooks.end_minibatch(commit=finite)  # trailing statistics for the next minibatch's regularization
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
    hooks = IsopoHooks(policy, args)  # inactive outside IsopoHooks.capture (rollouts, evaluation)
    reference = None
    if args.log_kl_ref:
        reference = fsdp.shard(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval(),
                               dist, cpu_offload=args.cpu_offload)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    start_step, skipped_steps = 0, 0
    if checkpoint:
        state = fsdp.load_checkpoint(checkpoint, policy, optimizer, dist)
        scheduler.load_state_dict(state["scheduler"])
        start_step, skipped_steps = state["step"], state["skipped_steps"]
        hooks.load_state_dict(state["isopo"])
    tracker = Tracker(run_dir, os.path.basename(run_dir), asdict(args), args.track, args.wandb_project_name,
                      args.wandb_entity, enabled=dist.is_main, resume_step=start_step if checkpoint else None)

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

        # 3-4. old / reference log-probs, then the minibatch updates (a sleeping engine frees the GPU)
        train_start = time.time()
        engine.sleep()
        stats = update_policy(policy, reference, optimizer, scheduler, batch, args, dist, autocast, hooks)
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
            "tokens": stats["tokens"], "approx_kl": stats["approx_kl"],
            "kl_ref": stats["kl_ref"], "mismatch_kl": mismatch["kl_sum"], "mismatch_tokens": mismatch["tokens"],
        }, dist)
        extremes = fsdp.all_reduce_dict({"length_max": lengths.max().item(), "mismatch_max": mismatch["max_abs_diff"]},
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
            "losses/grad_norm": stats["grad_norm"] / max(stats["updates"], 1),  # the global norm
            "mismatch/kl_k3": sums["mismatch_kl"] / sums["mismatch_tokens"],
            "mismatch/max_abs_logprob_diff": extremes["mismatch_max"],
            "time/rollout": rollout_seconds,
            "time/train": train_seconds,
            "time/weight_sync": sync_seconds,
            "time/step": step_seconds,
            **hooks.metrics(),  # Fisher norms, scales, regularization / NTK statistics per layer group
        }
        if reference is not None:
            metrics["losses/kl_ref"] = sums["kl_ref"] / sums["tokens"]
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            eval_start = time.time()
            metrics.update(evaluate(engine, tokenizer, eval_rows, **eval_kwargs))
            metrics["time/eval"] = time.time() - eval_start
        tracker.log(metrics, step=step + 1)
        progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}", **(
            {"eval_greedy": f"{metrics['eval/greedy_accuracy']:.3f}"} if "eval/greedy_accuracy" in metrics else {}))
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
            trainer_state = {"step": step + 1, "skipped_steps": skipped_steps, "scheduler": scheduler.state_dict(),
                             "args": asdict(args), "isopo": hooks.state_dict()}
            fsdp.save_checkpoint(run_dir, step + 1, policy, tokenizer, optimizer, trainer_state, dist,
                                 args.keep_checkpoints)

    plot = tracker.close(plot_keys=[
        "charts/reward", "eval/greedy_accuracy", f"eval/avg@{args.eval_k}", "charts/entropy",
        "charts/response_length_mean", "losses/kl_ref", "losses/grad_norm", "isopo/lm_head/fisher_norm",
        "isopo/lm_head/ntk_reg", "mismatch/kl_k3"])
    if dist.is_main:
        print(f"run folder: {run_dir}" + (f" (plot: {plot})" if plot else ""))
    fsdp.barrier(dist)
    engine.close()
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(tyro.cli(Args))
