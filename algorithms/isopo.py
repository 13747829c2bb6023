"""ISOPO: per-sequence log-prob gradients, Fisher-normalized layer by layer, in one backward pass.

Paper: ISOPO: Proximal policy gradients without pi-old (Abrahamsen, 2025, arXiv:2512.23353);
the authors' code: github.com/nilin/isopo (verl/workers/actor/dp_actor.py). Advantages as in
GRPO (DeepSeekMath, arXiv:2402.03300).

Objective. For each prompt q, sample a group of G completions o_1..o_G from the old policy, score
them (reward r_i in {0, 1}), and maximize E[r] by plain gradient steps (no π_old, ratio or clip)
built per Linear layer l (lm_head too): with v_i = ∇_{θ_l} log π_θ(o_i | q_i) (V_i as a matrix),
M the minibatch's non-empty sequences,

    A_i  = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)     (--no-scale-advantages: no division)

the policy gradient g_l = (1/M) Σ_i A_i v_i (§1.2) becomes, non-interacting
(default; §2, Alg. 2, Fig. 3),
    u_l = (1/M) Σ_i A_i s_i v_i,    s_i = reg2(‖v_i‖_F)^p · reg2(‖v_i‖)^q · reg2(‖v_i‖_F / ‖v_i‖)^r
    ‖v_i‖_F ≈ sqrt(Σ_j (g0_j · V_i a0_j)²) / sqrt(Σ_j (‖g0_j‖ ‖a0_j‖)²)   (Eq. 6; g0_j, a0_j:
    --n-overlap token rows of i's block of --block-size sequences),
    reg2(x) = sqrt(x² + λ·E[x²] + 1e-8), E = EMA (decay 0.9) of trailing minibatch means, per layer
(p, q, r: see --help) or, interacting (--variant interacting; §3, Alg. 6), with
J = [v_1; ..; v_m] over a block,
    u_l = (1/M) Σ_blocks Jᵀ (K + cI)⁻¹ A,  K = J Jᵀ (the layer's NTK),
    c = --ntk-reg-coef × E[mean eig K]
AdamW steps on −u_l; every other parameter (embeddings, norms, biases) takes
(1/M) Σ_i A_i ∇ log π (REINFORCE).

What this file changes relative to grpo.py: no loss, ratio or clip; one backward of Σ log π
builds every gradient (`IsopoGradients`: each Linear's backward returns ISOPO's weight
update); --block-size (8) is part of the math, its blocks cut from whole groups; full
logits; --log-kl-ref for --kl-coef.

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
tokens. Each per-sequence gradient of Eq. 6 sums the policy's tokens only: an output is context for
the forward, never a gradient term.

LoRA. With --lora-rank the Linear layers of Eq. 6 are each adapter's A [r, in] and B [out, r], the
only trained parameters: every v_i is normalized in the Fisher metric of A or B on its own, not of
the adapted W (another geometry than ISOPO on full weights: the paper's runs train every weight);
lm_head, embeddings and norms are frozen.

Run it
  python algorithms/isopo.py                      # the built-in task on a CPU, a few minutes
  python algorithms/isopo.py --help               # every flag, with its default
  python algorithms/isopo.py --variant interacting  # the NTK variant (Alg. 6)
  python algorithms/isopo.py --p 0 --q -1 --r -2  # Fig. 4's scales
  python algorithms/isopo.py --resume auto        # continue the newest run of this task/name/seed
  ./run.sh bench isopo                            # ISOPO vs REINFORCE vs GRPO: accuracy vs KL drift
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

from common import checks, fsdp, memory, moe
from common.adapters import load_policy
from common.batches import make_batch, micro_batches
from common.checkpoint import load_checkpoint, locked_run_folder, save_checkpoint, seed_everything
from common.checks import require
from common.engines import load_tokenizer, make_training_engine
from common.errors import BadInput
from common.evaluate import Evaluator
from common.flags import Checkpoints, Evaluation, Group, Sampling, Systems, TaskFormat, Tools, Tracking, flat
from common.rollouts import Groups, PromptSampler, RolloutQueue, record_rollouts, record_staleness
from common.scoring import overlong_penalty, score_completions
from common.stopping import StopSignals
from common.tasks import load_prompts
from common.tiny import resolve_model
from common.tools import episode_tokens, record_tool_use, record_turn_mismatch, with_tools
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
    block_size: int = 8
    """sequences sharing one Fisher-estimate pool (Eq. 6) and one NTK (§3), the paper's
    micro-batch of 8: part of the math, cut in order from whole groups shuffled together (with
    --group-size 8, one prompt's group each)"""
    variant: Literal["non-interacting", "interacting"] = "non-interacting"
    """non-interacting: rescale each sequence's gradient by s_i (Alg. 2, Fig. 3); interacting:
    precondition the advantages with each layer's micro-batch NTK (Alg. 6)"""
    p: float = -1.0
    """exponent of the Fisher-norm estimate ‖v_i‖_F in s_i (Fig. 3; −1: the same
    KL for every sequence, §2.0.1)"""
    q: float = 0.0
    """exponent of the Euclidean norm ‖v_i‖ in s_i (Fig. 3; −1: Euclidean normalization)"""
    r: float = 0.0
    """exponent of the relative Fisher norm ‖v_i‖_F/‖v_i‖ in s_i (Fig. 3; −2 with p = q = 0: the
    multiple of v_i closest to the natural gradient, §2.0.3, Eq. 7)"""
    n_overlap: int = 250
    """token rows per layer and micro-batch sampled for the Fisher-norm estimate (Eq. 6)"""
    reg_coef: float = 0.0
    """λ in reg2(x) = sqrt(x² + λ·E[x²] + 1e-8), E an EMA of trailing minibatch means per layer
    (0: none, as in the paper's runs)"""
    reg_form: Literal["paper", "authors"] = "paper"
    """paper: reg2(x) = sqrt(x² + λE[x²]) (Fig. 3); authors: the official
    code's default sqrt(x²/(λE[x²]) + 1), where λ = 1 (--reg-coef 1)"""
    ntk_reg_coef: float = 1.0
    """interacting: c = this × EMA of the NTK's mean eigenvalue (Fig. 7: 1.0)"""
    ntk_scale: Literal["paper", "authors"] = "paper"
    """interacting: paper: v = Jᵀ(K + cI)⁻¹A (Alg. 6); authors: v = Jᵀ c(K + cI)⁻¹A
    as the official code computes it"""
    ema_decay: float = 0.9
    """decay of the EMA over trailing minibatch means that sets the regularization"""
    scale_advantages: bool = True
    """divide group-centred rewards by the group's std (GRPO); --no-scale-advantages is Dr. GRPO"""
    log_kl_ref: bool = False
    """log KL(π_θ ‖ π_ref) to the initial policy, the paper's KL drift (Fig. 5);
    loads a reference model"""

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


# ALGO LOGIC: Fisher norms, sequence scales, the NTK preconditioner, the ISOPO backward, advantages
# A Linear layer's block below is g [b, T, out] (gradients of Σ log π w.r.t. its outputs, zero
# at pads) and a [b, T, in] (its inputs), with a leading [n] for n blocks at once;
# V_i = Σ_t g_it a_itᵀ over row i's non-pad positions (prompt too) is ∇ log π(o_i | q_i).
def overlap_rows(valid: torch.Tensor, n: int) -> torch.Tensor:
    """Eq. 6's sample (Alg. 2 line 6): [blocks, min(n, most non-pad rows in a block)] distinct
    indices into each block's b·T token rows, uniform among its non-pad rows
    (`valid` [blocks, b, T]); a block with fewer gets pads (0)."""
    valid = valid.flatten(1)
    keys = torch.rand(valid.shape, device=valid.device).masked_fill(~valid, 2.0)
    return keys.topk(min(n, int(valid.sum(1).max())), dim=1, largest=False).indices


def fisher_norms(g, a, rows, valid=None) -> torch.Tensor:
    """Eq. 6's estimate of ‖v_i‖_F [blocks, b] over each block's token rows `rows`,
    in k·N·(out+in) FLOPs per block of N non-pad rows (`valid` [blocks, b, T];
    None: every row): no V_i is formed."""
    n, b, T, _ = g.shape
    g, a, block = g.flatten(1, 2), a.flatten(1, 2), torch.arange(n, device=g.device)[:, None]
    g0, a0 = g[block, rows], a[block, rows]  # [blocks, k, out], [blocks, k, in]
    tokens = (
        torch.arange(b * T, device=g.device).expand(n, -1)
        if valid is None
        # the non-pad rows first
        else valid.flatten(1)
        .float()
        .argsort(dim=1, descending=True, stable=True)[:, : int(valid.flatten(1).sum(1).max())]
    )
    # (g0_j · g_t)(a0_j · a_t) per token row t, summed over the t of sequence i:
    # g0_j · V_i a0_j (Eq. 4), [blocks, b, k]
    products = (g[block, tokens] @ g0.mT) * (a[block, tokens] @ a0.mT)
    overlaps = (
        products.new_zeros(n * b, rows.shape[1])
        .index_add_(0, (block * b + tokens // T).flatten(), products.flatten(0, 1))
        .view(n, b, -1)
    )
    # Eq. 5
    return overlaps.norm(dim=-1) / ((g0.norm(dim=-1) * a0.norm(dim=-1)).norm(dim=-1, keepdim=True) + 1e-12)


def sequence_gradients(g: torch.Tensor, a: torch.Tensor, budget: int = 2**24):
    """V_i for all rows i of g [B, T, out], a block of output rows at a time
    ([B, rows, in], at most `budget` numbers)."""
    step = max(1, budget // (g.shape[0] * a.shape[-1]))
    for start in range(0, g.shape[-1], step):
        yield torch.einsum("bto,bti->boi", g[..., start : start + step], a)


def sequence_norms(g: torch.Tensor, a: torch.Tensor, form: str = "auto") -> torch.Tensor:
    """‖V_i‖ [B] for rows [B, T, ·]: gram, Σ_{t,t'} (g_t·g_t')(a_t·a_t') in B·T²·(out+in) FLOPs,
    or materialize V_i (B·T·out·in); auto: the cheaper."""
    _, T, out = g.shape
    if form == "gram" or form == "auto" and T * (out + a.shape[-1]) <= out * a.shape[-1]:
        squares = ((g @ g.mT) * (a @ a.mT)).sum((1, 2))
    else:
        squares = sum(block.square().sum((1, 2)) for block in sequence_gradients(g, a))
    return squares.clamp(min=0).sqrt()


def ntk(g: torch.Tensor, a: torch.Tensor, form: str = "auto", budget: int = 2**24) -> torch.Tensor:
    """Each block's empirical NTK K_ij = ⟨V_i, V_j⟩ (§3) [blocks, b, b]: gram,
    Σ_{t∈i,t'∈j} (g_t·g_t')(a_t·a_t') from the token Gram matrices of a few blocks at a time (at
    most `budget` numbers), or materialize the V_i."""
    # auto: the cheaper, gram's (bT)²·(out+in) FLOPs or materialize's b·T·out·in + b²·out·in
    n, b, T, out = g.shape
    if form == "gram" or form == "auto" and b * T * T * (out + a.shape[-1]) <= out * a.shape[-1] * (T + b):
        g, a, step = g.flatten(1, 2), a.flatten(1, 2), max(1, budget // (b * T) ** 2)
        K = torch.cat(
            [
                ((g[s : s + step] @ g[s : s + step].mT) * (a[s : s + step] @ a[s : s + step].mT))
                .view(-1, b, T, b, T)
                .sum((2, 4))
                for s in range(0, n, step)
            ]
        )
    else:
        K = sum(V.view(n, b, -1) @ V.view(n, b, -1).mT for V in sequence_gradients(g.flatten(0, 1), a.flatten(0, 1)))
    return (K + K.mT) / 2


def reg2(x: torch.Tensor, coef: float, expectation, form: str = "paper") -> torch.Tensor:
    """Fig. 3: sqrt(x² + λ·E[x²] + 1e-8) (paper), or (authors)
    sqrt(x² / (λ·E[x²] + 1e-8) + 1) ≈ that / sqrt(λE[x²])."""
    if form == "authors" and coef > 0:
        return torch.sqrt(x.square() / (coef * expectation + 1e-8) + 1)
    return torch.sqrt(x.square() + coef * expectation + 1e-8)


def sequence_scales(quantities: dict, p: float, q: float, r: float, reg_coef: float, expectations: dict, form="paper"):
    """Fig. 3: s = reg2(‖v‖_F)^p · reg2(‖v‖)^q · reg2(‖v‖_F/‖v‖)^r per sequence, from
    {"fisher": ‖v‖_F, if q or r needs them "euclid": ‖v‖, "rel": the ratio} and E[x²]
    (batch-size free: v_i = ∇ log π). p + q = −1, λ = 0: v's scale cancels."""
    scales = torch.ones_like(quantities["fisher"])
    for key, power in (("fisher", p), ("euclid", q), ("rel", r)):
        if power:
            scales = scales * reg2(quantities[key], reg_coef, expectations[key] if reg_coef else 0.0, form) ** power
    return scales


class TrailingMeans:
    """E[·] of Alg. 2 / Fig. 3 / Fig. 7 per (layer, quantity): an EMA of the means of
    *finished* minibatches (the first as is; a skipped step's is not committed), so s_i is
    known during the backward of the current one."""

    def __init__(self, decay: float):
        self.decay, self.ema, self.pending = decay, {}, {}

    def get(self, key):
        return self.ema.get(key)

    def add(self, key, values: torch.Tensor) -> None:
        self.pending.setdefault(key, []).append(values.detach().reshape(-1))

    def end_minibatch(self, commit: bool = True, dist=None) -> None:
        """Commit the finished minibatch's means over every rank (one all-reduce of
        sums and counts), or drop them."""
        # the same keys, in the same order, on every rank
        keys = sorted(self.pending, key=str) if commit else []
        values = [torch.cat(self.pending[key]).double() for key in keys]
        sums = torch.stack([v.sum() for v in values]).tolist() if keys else []  # one device sync
        totals = (
            fsdp.all_reduce_dict(
                {**{f"sum{i}": s for i, s in enumerate(sums)}, **{f"count{i}": len(v) for i, v in enumerate(values)}},
                dist,
            )
            if dist
            else None
        )
        for i, key in enumerate(keys):
            count = totals[f"count{i}"] if dist else len(values[i])
            if not count:  # no row of the minibatch trained (rows left empty): nothing to average
                continue
            mean = (totals[f"sum{i}"] if dist else sums[i]) / count
            self.ema[key] = mean if key not in self.ema else self.decay * self.ema[key] + (1 - self.decay) * mean
        self.pending = {}


def preconditioned_weights(K: torch.Tensor, weights: torch.Tensor, c, form: str = "paper", eigenvalues=False):
    """Alg. 6 per block: (K + cI)⁻¹ A through K = U diag(D) Uᵀ (paper), or c (K + cI)⁻¹ A (authors);
    also D if asked. K [blocks, b, b], A [blocks, b], c a number or one per block. In float64; a
    non-finite K gives a non-finite result (the step is then skipped), not an error in eigh."""
    finite = torch.isfinite(K).all()
    D, U = torch.linalg.eigh(torch.where(finite, K, 0).double())
    c = torch.as_tensor(c, dtype=torch.float64, device=K.device).reshape(-1, 1)
    # K is PSD and c > 0: D + c > 0 except for K = 0, c = 0
    inverse = torch.where(D + c > 0, 1 / (D + c), 0)
    result = (U @ (inverse * (U.mT @ weights.double()[..., None])[..., 0])[..., None])[..., 0]
    result = torch.where(finite, c * result if form == "authors" else result, torch.nan).to(weights.dtype)
    return (result, D) if eigenvalues else result


def weighted_gradient(g: torch.Tensor, a: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_b weights_b V_b = Σ_t w_t g_t a_tᵀ in one GEMM ([out, in]), weighting the narrower side."""
    if g.shape[-1] >= a.shape[-1]:
        return g.flatten(0, 1).T @ (a * weights[:, None, None]).flatten(0, 1)
    return (g * weights[:, None, None]).flatten(0, 1).T @ a.flatten(0, 1)


def split_blocks(x: torch.Tensor, rows: slice, size: int) -> torch.Tensor:
    """Rows `rows` of x [B, ...] as [blocks, size, ...]: the blocks of
    --block-size rows of one micro-batch."""
    return x[rows].unflatten(0, (-1, size))


def block_entry(values: dict, block: int) -> dict:
    """One block's entries of a dict of per-block tensors (other values as
    they are): a row of the trace."""
    return {key: value[block] if isinstance(value, torch.Tensor) else value for key, value in values.items()}


class IsopoLinear(torch.autograd.Function):
    """y = a Wᵀ + b whose backward passes the usual g W to the input (earlier layers see the
    plain gradient of Σ log π) and gives W and b what `update(a, g)` builds from the same g and
    a: no autograd weight GEMM is wasted, and the gradient lands in .grad where FSDP2
    reduce-scatters it like any other."""

    @staticmethod
    def forward(ctx, a, weight, bias, update):
        ctx.save_for_backward(a, weight)
        ctx.update = update
        return torch.nn.functional.linear(a, weight, bias)

    @staticmethod
    def backward(ctx, g):
        a, weight = ctx.saved_tensors
        grad_input = g @ weight.to(g.dtype) if ctx.needs_input_grad[0] else None
        grad_weight, grad_bias = ctx.update(a, g)
        return grad_input, grad_weight, grad_bias, None


class IsopoGradients:
    """Makes one backward of Σ log π leave the ISOPO gradient in every parameter's .grad (on N
    ranks FSDP2 reduces it). Every Linear runs as IsopoLinear; every other module owning parameters
    (embeddings, norms) runs twice, once with its parameters detached (the signal to earlier
    layers) and once with its inputs detached, whose output gradient is weighted by −A_i/M
    (REINFORCE). Per micro-batch: the forward and backward inside
    capture(mask, weights_i = −A_i/M); per minibatch: end_minibatch(commit); per batch:
    record(metrics). A Linear run twice per forward is an error."""

    def __init__(self, model: torch.nn.Module, args: Args, dist=None, state: dict | None = None):
        self.args, self.dist, self.stats = args, dist, TrailingMeans(args.ema_decay)
        # a checkpoint's "isopo": exact --resume
        self.stats.ema = dict(state["ema"]) if state is not None else {}
        # trace: a list records each layer (tests)
        self.micro, self.log, self.modules, self.trace = None, {}, {}, None
        # an MoE layer sends a flat list of tokens to its experts: no per-sequence inputs there
        if moe.is_moe(model):
            raise BadInput(
                "ISOPO uses each layer's per-sequence inputs (Eq. 6): mixture-of-experts models are not supported"
            )
        for name, module in model.named_modules():
            own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if isinstance(module, torch.nn.Linear) and set(own) - {"weight", "bias"}:
                raise ValueError(f"ISOPO: Linear module {name} has parameters {own}; only weight and bias are handled")
            # an instance attribute: nn.Module.__call__ (hooks, FSDP2's unsharded weights) runs it
            if own:
                wrapper = self._linear_forward if isinstance(module, torch.nn.Linear) else self._module_forward
                module.forward, self.modules[name] = partial(wrapper, name, module, module.forward), module

    def remove(self) -> None:
        for module in self.modules.values():
            del module.forward

    @contextlib.contextmanager
    def capture(self, attention_mask, weights, response_mask=None):
        """Arm the forwards for one micro-batch: [B, T] non-pad mask, [B] weights, [B, T'] the
        tokens that train (None: all). A row without one (--mask-truncated, a filler group) has
        v_i = 0: it counts as padding, out of the statistics and of E[·]."""
        valid = attention_mask.bool()
        valid = valid if response_mask is None else valid & response_mask.bool().any(1)[:, None]
        weights = weights.detach() * valid.any(1)
        self.micro = {"valid": valid, "weights": weights, "ran": set(), "backward": False}
        try:
            yield
        finally:
            self.micro = None

    def backward(self, objective: torch.Tensor) -> None:
        """objective.backward() while armed (--gradient-checkpointing re-runs
        forwards in it); every module ran."""
        self.micro["backward"] = True
        objective.backward()
        if missing := sorted(set(self.modules) - self.micro["ran"]):
            raise ValueError(f"ISOPO: module {missing[0]} never ran inside capture(); its parameters got no gradient")

    def end_minibatch(self, commit: bool) -> None:
        self.stats.end_minibatch(commit, self.dist)

    def record(self, metrics) -> None:
        """The per-group statistics since the last call: means (NaN left out),
        minima or maxima; empty: none."""
        for (group, key, how), values in sorted(self.log.items()):
            values = torch.cat([torch.as_tensor(v).reshape(-1).double() for v in values]).cpu()
            values = values[~values.isnan()]
            if len(values) and how == "mean":
                metrics.mean(f"isopo/{group}/{key}", values.sum(), len(values))
            elif len(values):
                getattr(metrics, how)(f"isopo/{group}/{key}", values)
        self.log = {}

    def _armed(self, name, module):  # the micro-batch, if this call builds ISOPO gradients
        micro = self.micro
        if micro is None or not torch.is_grad_enabled():
            return None  # rollouts, evaluation, no-grad passes: the module's own forward
        if isinstance(module, torch.nn.Linear) and name in micro["ran"] and not micro["backward"]:
            raise ValueError(
                f"ISOPO: Linear {name} ran twice in one forward pass; its per-sequence statistics need one call"
            )
        micro["ran"].add(name)
        return micro

    def _linear_forward(self, name, module, forward, input):
        if (micro := self._armed(name, module)) is None:
            return forward(input)
        return IsopoLinear.apply(input, module.weight, module.bias, partial(self._linear_update, name, micro))

    def _module_forward(self, name, module, forward, *args, **kwargs):
        if (micro := self._armed(name, module)) is None or micro.get("bypass") is module:
            return forward(*args, **kwargs)
        detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x
        through_parameters = forward(*map(detach, args), **{k: detach(v) for k, v in kwargs.items()})
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in (*args, *kwargs.values())):
            frozen = {n: p.detach() for n, p in module.named_parameters(recurse=False)}
            # functional_call calls module(...), which comes back here: the plain forward
            micro["bypass"] = module
            through_inputs = torch.func.functional_call(module, frozen, args, kwargs)
            micro["bypass"] = None
        else:  # e.g. the embedding lookup of token ids
            through_inputs = through_parameters.detach()
        out = through_parameters
        if out.dim() < 2 or out.shape[:1] != micro["valid"].shape[:1] or out.shape[1] > micro["valid"].shape[1]:
            raise ValueError(f"ISOPO: module {name} returned {tuple(out.shape)}; expected [batch, positions, ...]")
        weights = (micro["weights"][:, None] * micro["valid"][:, -out.shape[1] :]).to(out.dtype)
        weights = weights.view(*out.shape[:2], *[1] * (out.dim() - 2))
        # the value of through_inputs; gradients: g to the inputs, g_t·(−A_i/M)
        # to the parameters (REINFORCE)
        return through_inputs + (out - out.detach()) * weights

    # in IsopoLinear's backward: ISOPO for W, REINFORCE for b
    def _linear_update(self, name, micro, a, g):
        if g.dim() != 3 or a.dim() != 3:
            raise ValueError(
                f"ISOPO: Linear {name} saw {tuple(a.shape)} -> {tuple(g.shape)}; expected [batch, positions, features]"
            )
        # lm_head sees only the last positions (logits_to_keep)
        valid = micro["valid"][:, -g.shape[1] :]
        dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        # one copy of g, pads masked
        g, a = g.to(dtype, copy=True).mul_(valid[..., None]), a.to(dtype)
        weights = micro["weights"].to(dtype)
        # statistics per layer group (q_proj, ..., lm_head; LoRA: q_proj.lora_A, ...), over its
        # layers; peft's last part of a name is the adapter's (default)
        parts = name.split(".")
        group = ".".join(parts[-3:-1]) if parts[-2:-1] in (["lora_A"], ["lora_B"]) else parts[-1]
        module = self.modules[name]
        coefficients, size = [], self.args.block_size
        with torch.no_grad():
            # the micro-batch's blocks of --block-size rows, all at once; a
            # minibatch's last block may be shorter
            for rows in (slice(0, len(g) - len(g) % size), slice(len(g) - len(g) % size, len(g))):
                if rows.stop > rows.start:
                    blocks = partial(split_blocks, rows=rows, size=min(size, rows.stop - rows.start))
                    if self.args.variant == "non-interacting":
                        coefficients.append(
                            blocks(weights) * self._scales(name, group, blocks(g), blocks(a), blocks(valid))
                        )
                    else:
                        coefficients.append(self._precondition(name, group, blocks(g), blocks(a), blocks(weights)))
            grad_weight = weighted_gradient(g, a, torch.cat([c.flatten() for c in coefficients]))
            # a bias is not a Linear weight: the REINFORCE gradient Σ_t (−A_i/M) g_t
            grad_bias = torch.einsum("bto,b->o", g, weights) if module.bias is not None else None
        return grad_weight, grad_bias

    # non-interacting: Fig. 3's s_i from Eq. 6 (and ‖v_i‖ for q, r)
    def _scales(self, name, group, g, a, valid):
        args, trains = self.args, valid.any(-1)  # [blocks, b]: a row that does not train is padding
        rows = overlap_rows(valid, args.n_overlap)
        quantities = {"fisher": fisher_norms(g, a, rows, valid)}  # [blocks, b]
        if args.q or args.r:
            euclid = sequence_norms(g.flatten(0, 1), a.flatten(0, 1)).view_as(quantities["fisher"])
            quantities.update(euclid=euclid, rel=quantities["fisher"] / (euclid + 1e-12))
        expectations = {}
        for key, x in quantities.items():
            # None before any minibatch has finished: the block's own mean
            trailing, squares = self.stats.get((name, key)), x.square()
            own = (squares * trains).sum(1, keepdim=True) / trains.sum(1, keepdim=True).clamp(min=1)
            expectations[key] = own if trailing is None else trailing
            self.stats.add((name, key), squares[trains])
            # isopo/<group>/fisher_norm, euclid_norm, rel_fisher_norm: mean ‖v_i‖_F
            # (Eq. 6), ‖v_i‖, ‖v_i‖_F/‖v_i‖
            metric = {"fisher": "fisher_norm", "euclid": "euclid_norm", "rel": "rel_fisher_norm"}[key]
            self._log(group, metric, x[trains])
            # λ·E[x²], under reg2's root (no trailing mean yet: each training block's own)
            self._log(group, f"reg_{key}", args.reg_coef * (own[trains.any(1)] if trailing is None else trailing))
        scales = sequence_scales(quantities, args.p, args.q, args.r, args.reg_coef, expectations, args.reg_form)
        # scale_mean, scale_min, scale_max: of the sequence scales s_i (Fig. 3)
        for how in ("mean", "min", "max"):
            self._log(group, f"scale_{how}", scales[trains], how=how)
        for i in range(len(rows)) if self.trace is not None else ():  # one entry per block
            pick = partial(block_entry, block=i)
            self.trace.append(
                dict(
                    layer=name,
                    rows=rows[i],
                    quantities=pick(quantities),
                    expectations=pick(expectations),
                    scales=scales[i],
                )
            )
        return scales

    # interacting: (K + cI)⁻¹ A (Alg. 6, Fig. 7)
    def _precondition(self, name, group, g, a, weights):
        K = ntk(g, a)  # [blocks, b, b]
        diagonal, trailing = K.diagonal(dim1=1, dim2=2), self.stats.get((name, "ntk_eig"))
        # mean eig = trace/b, over rows that train (a row that does not: K_ii = 0)
        trains = diagonal > 0
        own = (diagonal * trains).sum(1) / trains.sum(1).clamp(min=1)
        c = self.args.ntk_reg_coef * (own if trailing is None else trailing)
        self.stats.add((name, "ntk_eig"), diagonal[trains])
        preconditioned, eigenvalues = preconditioned_weights(K, weights, c, self.args.ntk_scale, eigenvalues=True)
        # mean and largest eigenvalue of the blocks' NTK K
        self._log(group, "ntk_eig_mean", diagonal[trains])
        self._log(group, "ntk_eig_max", eigenvalues, how="max")
        # c = --ntk-reg-coef × E[mean eig K] (before a trailing mean: each training block's own)
        self._log(group, "ntk_reg", c[trains.any(1)] if trailing is None else c)
        # ‖c (K + cI)⁻¹ A‖ / ‖A‖ per block: 1 = vanilla policy gradient, → 0 = damped; NaN
        # (left out) when every A_i = 0
        c = torch.as_tensor(c, device=K.device).reshape(-1, 1).expand(len(K), 1)  # one per block
        damped = preconditioned if self.args.ntk_scale == "authors" else c * preconditioned
        self._log(group, "shrink", damped.norm(dim=1) / weights.norm(dim=1))
        for i in range(len(K)) if self.trace is not None else ():  # one entry per block
            self.trace.append({"layer": name, "K": K[i], "c": c[i, 0], "weights": preconditioned[i]})
        return preconditioned

    # kept as they are (record() reduces them): no device sync here
    def _log(self, group, key, values, how="mean"):
        self.log.setdefault((group, key, how), []).append(
            values.detach() if isinstance(values, torch.Tensor) else values
        )


def isopo_backward(policy, isopo, micro, temperature, total_sequences, autocast, world_size=1):
    """One micro-batch: the forward and one backward of Σ log π without advantages (Alg. 2 line 2),
    the ISOPO forwards armed: every parameter's .grad gains this micro-batch's share. Returns
    logprobs, entropy, L (losses/policy_loss; ISOPO transforms ∇L)."""
    # ∂L/∂log π(o_i|q_i), L = −(1/M) Σ_i A_i log π(o_i|q_i), M = total_sequences: those of the
    # minibatch that train, over every rank
    weights = -micro["advantages"] / total_sequences
    # FSDP2 averages over ranks: × N undoes it
    with isopo.capture(micro["attention_mask"], weights * world_size, micro["response_mask"]):
        with autocast:
            logprobs, entropy = token_logprobs(policy, micro, temperature, with_entropy=True)
        sequence_logprobs = (logprobs * micro["response_mask"]).sum(1)
        isopo.backward(sequence_logprobs.sum())
    return logprobs, entropy, (weights * sequence_logprobs.detach()).sum()


def compute_advantages(rewards, scale=True, eps=1e-4):
    """rewards [prompts, G] -> advantages [prompts, G]: centred per group, optionally divided by
    the group's std, the unbiased one (n − 1) as in TRL and verl (DeepSeekMath does not say).
    In float64, where the mean of equal float32 rewards is exactly theirs (float32's mean of
    eight 0.8s is not 0.8): a group whose rewards are all equal gets advantages of exactly 0."""
    rewards64 = rewards.double()
    centred = rewards64 - rewards64.mean(dim=1, keepdim=True)
    advantages = centred / (rewards64.std(dim=1, keepdim=True) + eps) if scale else centred
    return advantages.to(rewards.dtype)


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
    """Log-probs [B, T] of the response tokens under `model` at `temperature` (and their
    entropy, no gradient). Full [B, T, vocabulary] logits: ISOPO needs lm_head's output
    gradient."""
    response_ids = micro["response_ids"]  # [B, T]
    logits = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        # the output layer runs only where a response token is predicted
        logits_to_keep=response_ids.shape[1] + 1,
        use_cache=False,
    ).logits[:, :-1]  # the last position predicts past the end
    logprobs, logp_all = policy_logprobs(logits.float(), response_ids, temperature)
    # top-p / top-k: π renormalised over the kept ids of each position (−1: padding),
    # log π_kept(o) = log π(o) − log Σ_kept π
    if "sampling_mask" in micro:
        kept = micro["sampling_mask"].long()
        counts = torch.zeros_like(logp_all, dtype=torch.long).scatter_add_(-1, kept.clamp(min=0), (kept >= 0).long())
        member = counts > 0
        member |= ~member.any(-1, keepdim=True)  # no kept set: the full vocabulary
        kept_mass = torch.logsumexp(logp_all.masked_fill(~member, -math.inf), dim=-1)
        logp_all = (logp_all - kept_mass[..., None]).masked_fill(~member, -math.inf)
        logprobs = logprobs - kept_mass
    plogp = (logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logprobs, (-plogp.detach() if with_entropy else None)


def check_full_logits(args) -> None:
    """Refuse, before minutes of set-up, a micro-batch whose full logits cannot fit: the stage
    holds about four float32 [B, T, vocabulary] tensors beside the training state (16 bytes
    per parameter over the ranks) and an awake vLLM engine's share. The model's config is
    read, not its weights."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    # the built-in model of --task for tiny
    config = memory.load_config(resolve_model(args.model, args.task))
    vocab, parameters = config.vocab_size, memory.parameter_counts(config)["total"]
    need = memory.full_logits_bytes(
        args.micro_batch_size, episode_tokens(args.task, args.max_new_tokens, args.tools), vocab
    )  # a tool's output included
    total = memory.device_bytes(device)
    engine_share = (
        args.systems.gpu_memory_utilization * total if device.type == "cuda" and not args.systems.vllm_sleep_mode else 0
    )
    room = total - 16 * parameters / world_size - engine_share
    if need > room:
        gib = lambda n: f"{max(n, 0) / 2**30:.{1 if n >= 2**30 else 4}f} GiB"
        positions = episode_tokens(args.task, args.max_new_tokens, args.tools) + 1
        raise ValueError(
            f"ISOPO keeps full logits: --micro-batch-size {args.micro_batch_size} × {positions} positions × "
            f"{vocab:,} vocabulary needs about {gib(need)} for the output layer's stage, where "
            f"{gib(room)} of {gib(total)} are left beside the training state"
            f"{' and the engine' if engine_share else ''}: lower --micro-batch-size (a multiple of --block-size) or "
            f"--max-new-tokens, add --vllm-sleep-mode or ranks (python -m common.memory --full-logits estimates a plan)"
        )


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
PLOTTED += ["losses/kl_ref", "losses/grad_norm", "isopo/lm_head/fisher_norm"]
PLOTTED += ["isopo/lm_head/ntk_reg", "mismatch/kl_k3"]
PROGRESS = ["charts/reward", "eval/greedy_accuracy", "memory/peak_allocated_gib"]
# END TRY NOT TO MODIFY


def update_policy(policy, reference, optimizer, scheduler, batch, args, dist, precision, metrics, isopo):
    """Old and reference log-probs, then the minibatch updates on one rollout batch (this rank's
    share). Records the statistics in `metrics`; returns how many optimizer steps were skipped."""
    autocast, scaler = precision.autocast, precision.scaler  # bf16 / fp16 (fsdp.mixed_precision)
    # ALGO LOGIC: what the loss needs before the updates (grpo.py: the log-probs of π_old and π_ref)
    # old log-probs only when π_θ will move away from π_old within this batch. ISOPO has no ratio:
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
    for _ in range(args.update_epochs):
        # ALGO LOGIC: whole groups in a random order, so that a block of G rows (or of a divisor of
        # G) holds completions of one prompt, and is the same block on any number of ranks
        groups = torch.randperm(len(every_row) // args.group_size, device=every_row.device)
        order = (groups[:, None] * args.group_size + torch.arange(args.group_size, device=groups.device)).flatten()
        # END ALGO LOGIC
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
            # ALGO LOGIC: micro-batches of whole blocks (--block-size rows in the minibatch's
            # order), the blocks sorted by their longest response so that a micro-batch pads little;
            # a shorter last block stays last
            whole = len(minibatch) - len(minibatch) % args.block_size
            blocks = minibatch[:whole].view(-1, args.block_size)
            longest = batch["response_mask"][blocks].sum(-1).amax(1)
            minibatch = torch.cat([blocks[longest.argsort(descending=True, stable=True)].flatten(), minibatch[whole:]])
            # END ALGO LOGIC
            for micro in micro_batches(batch, minibatch, args.micro_batch_size, by_length=False):
                mask = micro["response_mask"]
                # ALGO LOGIC: one backward of Σ log π builds this micro-batch's
                # share of every ISOPO gradient
                logprobs, entropy, loss = isopo_backward(
                    policy, isopo, micro, args.temperature, totals["sequences"], autocast, dist.world_size
                )
                # π_old: the trainer before this batch's updates (the pass above), or at one update
                # π_θ itself, detached (ρ = 1), never the engine's μ: where a staleness fix begins
                old_logprobs = micro["old_logprobs"] if multiple_updates else logprobs.detach()
                # --log-kl-ref: the drift from the initial policy (Fig. 5), a metric only
                if reference is not None:
                    log_ref_ratio = micro["ref_logprobs"] - logprobs
                    kl_ref = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 KL(π_θ ‖ π_ref)
                    metrics.mean("losses/kl_ref", (kl_ref.detach() * mask).sum(), mask.sum())
                # END ALGO LOGIC
                minibatch_loss += loss.item()
                with torch.no_grad():  # statistics of the response tokens
                    log_ratio, tokens = (logprobs - old_logprobs).detach(), mask.sum()
                    k3 = torch.exp(log_ratio) - 1 - log_ratio  # k3 estimate of KL(π_old ‖ π_θ)
                    metrics.mean("losses/approx_kl", (k3 * mask).sum(), tokens)
                    # entropy of π_θ (over the kept ids under --top-k/--top-p)
                    metrics.mean("charts/entropy", (entropy * mask).sum(), tokens)
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
            # ALGO LOGIC: a stepped minibatch joins the trailing means E[·] of Alg. 2
            stepped = bool(torch.isfinite(grad_norm)) and math.isfinite(minibatch_loss)
            isopo.end_minibatch(commit=stepped)  # (a skipped one does not)
            # END ALGO LOGIC
    isopo.record(metrics)  # isopo/<group>/...: the per-layer statistics of the step
    return skipped


def check_args(args: Args) -> None:
    """Every flag's range, before anything loads: one error lists every problem (NaN fails all)."""
    problems = checks.shared_flags(args)  # experiment, rollouts, optimization, evaluation, systems
    # ALGO LOGIC: this method's flags
    problems += require(args.block_size >= 1, "--block-size", ">= 1")
    problems += require(
        not args.systems.fp32_lm_head,
        "--fp32-lm-head",
        "off: ISOPO builds its own per-sequence gradient of the output layer",
    )
    problems += require(
        # (< 1: reported above)
        args.block_size < 1 or args.micro_batch_size % args.block_size == 0,
        "--micro-batch-size",
        "a multiple of --block-size",
    )
    prompts = args.prompts_per_step // checks.world_size()  # a rank's
    problems += require(
        args.num_minibatches < 1 or prompts % args.num_minibatches == 0,
        "--num-minibatches",
        f"a divisor of the {prompts} prompts of a rank: its blocks are cut from whole groups",
    )
    problems += require(math.isfinite(args.p), "--p", "a finite number")
    problems += require(math.isfinite(args.q), "--q", "a finite number")
    problems += require(math.isfinite(args.r), "--r", "a finite number")
    problems += require(args.n_overlap >= 1, "--n-overlap", ">= 1")
    problems += require(0 <= args.reg_coef < math.inf, "--reg-coef", ">= 0 and finite")
    problems += require(0 < args.ntk_reg_coef < math.inf, "--ntk-reg-coef", "> 0 and finite (a singular NTK otherwise)")
    problems += require(0 <= args.ema_decay < 1, "--ema-decay", "in [0, 1)")
    problems += require(
        args.systems.dtype != "float16",
        "--dtype",
        "auto, float32 or bfloat16: Eq. 6 normalizes each sequence's"
        " gradient, which a float16 loss scale would change (it is not linear in the scale)",
    )
    if args.variant == "interacting":
        non_interacting = ["p", "q", "r", "n_overlap", "reg_coef", "reg_form"]
        problems += checks.unused(args, non_interacting, "applies to --variant non-interacting only")
    else:
        problems += checks.unused(args, ["ntk_reg_coef", "ntk_scale"], "applies to --variant interacting only")
        # λ = 0: reg2(x) = sqrt(x² + 1e-8), no E[x²] to keep and no form to choose
        if not args.reg_coef:
            no_reg = "applies with --reg-coef > 0 only"
            problems += checks.unused(args, ["reg_form", "ema_decay"], no_reg)
    # END ALGO LOGIC
    checks.refuse(problems)
    check_full_logits(args)


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
    reference = fsdp.load_reference(args.model, dist, systems, precision.dtype) if args.log_kl_ref else None
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    state = load_checkpoint(checkpoint, policy, optimizer, scheduler, precision.scaler, dist) if checkpoint else {}
    start_step, skipped_steps = state.get("step", 0), state.get("skipped_steps", 0)
    # idle outside capture(); exact resume
    isopo = IsopoGradients(policy, args, dist, state.get("isopo"))
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
                policy, reference, optimizer, scheduler, batch, args, dist, precision, metrics, isopo
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
        # the running statistics: exact resume
        trainer_state["isopo"] = {"ema": dict(isopo.stats.ema)}
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


# Paper scale: the paper's setting (§2.1; the authors' run.sh), Qwen3-0.6B on GSM8K on one GPU
#   python algorithms/isopo.py --model Qwen/Qwen3-0.6B --task gsm8k --eval-task gsm8k --steps 102 \
#       --prompts-per-step 128 --group-size 8 --max-prompt-tokens 512 --max-new-tokens 2048 \
#       --lr 2e-6 --weight-decay 0.01 --num-minibatches 2 --block-size 8 --micro-batch-size 8 \
#       --dtype bfloat16 --gradient-checkpointing --rollout-engine vllm --vllm-sleep-mode \
#       --eval-every 10 --eval-prompts 1319 --eval-k 1 --log-kl-ref --track
# (micro-batches of one block: ISOPO keeps full [B, T, vocabulary] logits, whose gradient lm_head's
# update needs; a micro-batch whose logits cannot fit on the device is refused at start-up).
# Memory on one 80 GB GPU (`python -m common.memory --full-logits` with these flags): the full
# logits 37.1 GiB (four float32 tensors of 8 × 2,049 × 151,936), training state 8.9
# (16 bytes × 0.60 B parameters), checkpointed activations 4.5 (80 KiB per token per layer),
# bf16 weight casts 0.3, the sleeping engine 1.0, CUDA 1.5: 53 GiB. Without --vllm-sleep-mode (vLLM
# keeps 24 GiB) or --gradient-checkpointing (45 GiB of activations) it does not fit. On N GPUs: the
# same flags after `torchrun --nproc_per_node N` (N dividing 128: every rank holds whole groups).
# Add --variant interacting (Fig. 7), --p 0 --q -1 --r -2 (Fig. 4), --p 0 --q -1 (Fig. 5, yellow).
# Overlapped, the engine on a GPU of its own (2 GPUs): --rollout-lag 1 --overlap-rollouts
# --engine-process --gpu-memory-utilization 0.9 in place of the sleep mode: the trainer's GPU 52.3
# GiB (its full logits set it), the engine's 72 (1.1 of it weights).
#
# Differences from the authors' code (commit 2686cda), each deliberate. There, non-Linear parameters
# (RMSNorm, untied embeddings) get an advantage-free gradient (token-mean −log π: SFT on the own
# samples), tied embeddings lose their lookup gradient (lm_head's update overwrites it) and Linear
# biases are zeroed; here all get REINFORCE gradients and the tied contributions add. Its exponents,
# negated and reordered: p, q, r = −overlap_neg_power, −norm_neg_power, −rel_overlap_neg_power. Its
# default regularization (keep_small_invariant) is --reg-form authors, with each sequence's own
# value as E before any history (here the micro-batch mean); the paper's runs and run.sh use none
# when non-interacting (--reg-coef 0). Interacting, it computes the dimensionless
# v = Jᵀ c(K + cI)⁻¹A, which tends to the vanilla gradient where K ≪ c (--ntk-scale authors). Its
# v_i is ∇ of the token-mean loss over the gradient-accumulation count, its update a sum over the
# minibatch; here v_i = ∇ log π and a mean: a factor M apart for p + q = −1 without regularization,
# a batch-dependent scale otherwise (AdamW mostly absorbs it). It computes and discards autograd's
# weight gradients and materializes every V_i; here neither. Its AdamW: betas (0.9, 0.999), weight
# decay 0.01 (grpo.py's (0.9, 0.99) kept). It runs on one GPU; here torchrun works as for every
# script: FSDP2 reduce-scatters the weight gradients IsopoLinear returns, and the EMA's minibatch
# means are all-reduced. Its micro-batches are cut in rollout order (verl keeps that order on one
# GPU), where a prompt's 8 completions are adjacent: with --block-size 8 and --group-size 8, one
# group per block, as here.
