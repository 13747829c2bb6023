"""isopo.py: every hook-built gradient against brute force (per-sequence autograd, the explicit Fisher
estimate with the same overlap rows, an explicit NTK solve), the paper's special cases, then the script.

Exact checks (<= 1e-8 relative) use a small pure-PyTorch float64 model: transformers' Llama keeps its
norms, rotary embeddings and softmax in float32, so it is checked at 1e-5."""

import dataclasses
import os
import types
from functools import partial

import pytest
import torch
from helpers import (
    BASE_LOGGED,
    assert_weights_unchanged,
    only_run_dir,
    read_jsonl,
    run_script,
    torchrun,
    two_group_rollouts,
)
from torch import nn

from algorithms import isopo
from common import flags
from common.engines import Completion
from common.errors import BadInput

NO_AUTOCAST = torch.autocast("cpu", enabled=False)


# --- a tiny float64 causal LM and its rollouts -------------------------------------------------


class ScaleNorm(nn.Module):
    """An RMSNorm-like module: a parameter that is not a Linear weight."""

    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(size))

    def forward(self, x):
        return self.weight * x / (x.square().mean(-1, keepdim=True) + 1e-3).sqrt()


class TinyLM(nn.Module):
    """Embedding -> Linear (with bias) and tanh -> causal prefix mean over non-pad positions -> norm ->
    Linear -> residual -> output Linear (tied to the embedding or not). Pure float64."""

    def __init__(self, vocab=10, hidden=6, inner=5, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, inner)
        self.norm = ScaleNorm(inner)
        self.fc2 = nn.Linear(inner, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask)[..., None].double()
        x = self.embed(input_ids)
        h = torch.tanh(self.fc1(x)) * mask
        h = h.cumsum(1) / mask.cumsum(1).clamp(min=1)  # the causal mixing step
        x = x + self.fc2(self.norm(h))
        return types.SimpleNamespace(logits=self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x))


def tiny_lm(tied, seed=0):
    torch.manual_seed(seed)
    return TinyLM(tied=tied).double()


def untied_twin(model):
    """The same function with lm_head's weight as a parameter of its own: its per-sequence gradients
    separate the embedding lookup's part from lm_head's."""
    twin = TinyLM(tied=False).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    twin.load_state_dict(state)
    return twin


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
RESPONSES = [[3, 4, 2], [5], [9, 9, 1, 2], [2, 2], [7, 1, 3, 3], [8], [4, 6], [1, 5, 7], [3]]
GROUP = 3
ADVANTAGES = torch.tensor([1.0, -0.5, 0.7, 0.0, -1.2, 0.3, 0.9, -0.4, -0.8], dtype=torch.float64)


def rollouts():
    completions = [Completion(r, [-1.0] * len(r), "stop") for r in RESPONSES]
    batch = isopo.make_batch(PROMPTS, completions, GROUP, 0, torch.device("cpu"))
    batch["advantages"] = ADVANTAGES.clone()
    return batch


def token_logprobs64(model, micro, temperature, with_entropy=False):
    """isopo.token_logprobs without its float32 cast of the logits (the models here are float64)."""
    width = micro["response_ids"].shape[1]
    logits = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        logits_to_keep=width + 1,
    ).logits[:, :-1]
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, micro["response_ids"][..., None]).squeeze(-1), torch.zeros_like(logp[..., 0])


@pytest.fixture
def float64_logprobs(monkeypatch):
    monkeypatch.setattr(isopo, "token_logprobs", token_logprobs64)


def make_args(**overrides):
    return flags.make(isopo.Args, **{"n_overlap": 5, **overrides})


def script_gradients(model, args, batch, order, micro_size, isopo_gradients=None):
    """The script's path for one minibatch: isopo_backward per micro-batch (one block each unless `isopo_gradients`
    says otherwise), the gradients accumulating in .grad."""
    isopo_gradients = isopo_gradients or isopo.IsopoGradients(model, dataclasses.replace(args, block_size=micro_size))
    isopo_gradients.trace = []
    micros = list(isopo.micro_batches(batch, order, micro_size, by_length=False))
    for micro in micros:
        isopo.isopo_backward(model, isopo_gradients, micro, 1.0, len(order), NO_AUTOCAST)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, isopo_gradients, micros


# --- brute force --------------------------------------------------------------------------------


def sequence_logprob(model, index):
    """log π(o_i | q_i) of one rollout, run alone without any padding."""
    prompt, response = PROMPTS[index // GROUP], RESPONSES[index]
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).sum()


def per_sequence_gradients(model):
    """{parameter name: [sequences, *shape]}: v_i = ∇ log π(o_i | q_i) by plain autograd, one sequence at a time."""
    names, params = zip(*model.named_parameters())
    grads = [torch.autograd.grad(sequence_logprob(model, i), params) for i in range(len(RESPONSES))]
    return {name: torch.stack([g[k] for g in grads]) for k, name in enumerate(names)}


def token_gradients(model, micro):
    """Inputs a_t and output gradients g_t (of Σ log π) of every Linear, for one padded micro-batch."""
    saved, handles = {}, []

    def keep(name, module, inputs, output):
        output.retain_grad()
        saved[name] = (inputs[0].detach(), output)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(partial(keep, name)))
    logprobs, _ = token_logprobs64(model, micro, 1.0)
    (logprobs * micro["response_mask"]).sum().backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return {name: (a, output.grad) for name, (a, output) in saved.items()}


def explicit_fisher_norm(G, g0, a0):
    """Eq. 6 with the matrix V = G written out: sqrt(Σ_j (g0_j · G a0_j)²) / sqrt(Σ_j ‖g0_j‖² ‖a0_j‖²)."""
    return torch.einsum("jo,oi,ji->j", g0, G, a0).norm() / ((g0.norm(dim=1) * a0.norm(dim=1)).norm() + 1e-12)


def explicit_reg2(x, coef, expectation, form):
    if form == "authors" and coef > 0:
        return (x**2 / (coef * expectation + 1e-8) + 1) ** 0.5
    return (x**2 + coef * expectation + 1e-8) ** 0.5


def reference_gradients(model, args, micros, trace, sequences):
    """ISOPO's update from explicit per-sequence matrices V_i (first minibatch: E = micro-batch mean)."""
    tied = model.lm_head.weight is model.embed.weight
    twin = untied_twin(model)
    v = per_sequence_gradients(twin)
    weights = -ADVANTAGES / sequences
    reinforce = {name: torch.einsum("s,s...->...", weights, v[name]) for name in v}
    reference = {name: reinforce[name] for name in ("embed.weight", "fc1.bias", "norm.weight")}
    by_layer = {}
    for entry in trace:
        by_layer.setdefault(entry["layer"], []).append(entry)
    tokens = [token_gradients(twin, micro) for micro in micros]
    for layer in ("fc1", "fc2", "lm_head"):
        update = torch.zeros_like(v[f"{layer}.weight"][0])
        for index, micro in enumerate(micros):
            rows, entry = micro["rows"].tolist(), by_layer[layer][index]
            G = v[f"{layer}.weight"][rows]
            if args.variant == "interacting":
                J = G.flatten(1)
                K = J @ J.T
                c = args.ntk_reg_coef * K.diagonal().mean()
                solved = torch.linalg.solve(K + c * torch.eye(len(rows), dtype=K.dtype), weights[rows])
                update += (J.T @ (c * solved if args.ntk_scale == "authors" else solved)).view_as(update)
                continue
            a, g = tokens[index][layer]
            g0, a0 = g.flatten(0, 1)[entry["rows"]], a.flatten(0, 1)[entry["rows"]]
            fisher = torch.stack([explicit_fisher_norm(Gi, g0, a0) for Gi in G])
            euclid = G.flatten(1).norm(dim=1)
            torch.testing.assert_close(entry["quantities"]["fisher"], fisher, rtol=1e-10, atol=0)
            quantities = {"fisher": fisher, "euclid": euclid, "rel": fisher / (euclid + 1e-12)}
            scales = torch.ones(len(rows), dtype=torch.float64)
            for key, power in (("fisher", args.p), ("euclid", args.q), ("rel", args.r)):
                if power:
                    expectation = quantities[key].square().mean()  # no trailing minibatch yet
                    scales *= explicit_reg2(quantities[key], args.reg_coef, expectation, args.reg_form) ** power
            update += torch.einsum("s,soi->oi", weights[rows] * scales, G)
        if tied and layer == "lm_head":
            reference["embed.weight"] = reference["embed.weight"] + update  # the two uses of one tensor add
        else:
            reference[f"{layer}.weight"] = update
    return reference, reinforce


def relative_error(actual, expected):
    assert expected.norm() > 0
    return ((actual - expected).norm() / expected.norm()).item()


# --- every gradient against brute force ---------------------------------------------------------

CASES = {
    "p=-1 (default: equal KL per sequence)": dict(),
    "r=-2 (closest to the natural gradient)": dict(p=0.0, r=-2.0),
    "q=-1, r=-2 (Fig. 4)": dict(p=0.0, q=-1.0, r=-2.0),
    "q=-1 (Euclidean)": dict(p=0.0, q=-1.0),
    "regularized": dict(reg_coef=0.7),
    "mixed exponents, authors' regularization": dict(p=-0.5, q=0.3, r=1.0, reg_coef=0.4, reg_form="authors"),
    "interacting": dict(variant="interacting"),
    "interacting, authors' scale": dict(variant="interacting", ntk_reg_coef=0.3, ntk_scale="authors"),
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_matches_brute_force(float64_logprobs, case, tied):
    """Linear weights: ISOPO from explicit V_i, the explicit Eq. 6 with the script's overlap rows, or an
    explicit (K + cI)⁻¹A solve; everything else: REINFORCE. Micro-batches of 4, 4 and 1 sequences."""
    model, args = tiny_lm(tied), make_args(**CASES[case])
    order = torch.tensor([4, 0, 7, 2, 8, 1, 5, 3, 6])
    grads, isopo_gradients, micros = script_gradients(model, args, rollouts(), order, micro_size=4)
    reference, _ = reference_gradients(model, args, micros, isopo_gradients.trace, len(order))
    assert set(grads) == set(reference)
    for name in grads:
        assert relative_error(grads[name], reference[name]) <= 1e-8, name
    if args.variant == "non-interacting":
        for entry in isopo_gradients.trace:  # distinct rows; 5 of them (a strict subsample) where there are more
            assert len(set(entry["rows"].tolist())) == len(entry["rows"]) <= 5
        assert sum(len(e["rows"]) == 5 for e in isopo_gradients.trace) >= 6


@pytest.mark.parametrize("variant", ["non-interacting", "interacting"])
def test_blocks_not_micro_batches_set_the_update(float64_logprobs, variant):
    """--block-size is the math, --micro-batch-size only memory: blocks of 4 (the last one of 1) give the same gradients
    computed one block per micro-batch or two per micro-batch (every token row in Eq. 6's pool: no random draw), the
    regularizer's E[x²] included (before a trailing mean: each block's own, not the micro-batch's)."""
    args = make_args(variant=variant, n_overlap=1000, block_size=4, p=-1.0, q=-0.5, reg_coef=0.7)
    order = torch.tensor([4, 0, 7, 2, 8, 1, 5, 3, 6])
    grads = []
    for micro_size in (4, 8):
        model = tiny_lm(True)
        grads.append(script_gradients(model, args, rollouts(), order, micro_size, isopo.IsopoGradients(model, args))[0])
    for name in grads[0]:
        assert relative_error(grads[1][name], grads[0][name]) <= 1e-12, name


def test_overlap_rows_are_distinct_non_pad_positions():
    valid = torch.tensor(
        [[[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 1, 1]], [[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]]
    ).bool()  # 2 blocks of 3 rows
    for block in range(2):
        positions = set(valid[block].flatten().nonzero().squeeze(1).tolist())
        seen = set()
        for _ in range(50):
            rows = isopo.overlap_rows(valid, 4)[block].tolist()
            assert len(set(rows)) == 4 and set(rows) <= positions
            seen |= set(rows)
        assert seen == positions  # every non-pad row of the block gets drawn
        assert positions <= set(isopo.overlap_rows(valid, 100)[block].tolist())  # more asked than there are: all


# --- the paper's special cases, against the explicit Fisher matrix ---------------------------------


@pytest.mark.parametrize("p, q, r", [(-1.0, 0.0, 0.0), (0.0, 0.0, -2.0), (0.0, -1.0, 0.0), (0.0, 0.0, 0.0)])
def test_rescalings_of_the_paper(float64_logprobs, p, q, r):
    """With F̂ = Σ_j vec(g0_j a0_jᵀ) vec(g0_j a0_jᵀ)ᵀ / Σ_j ‖g0_j‖²‖a0_j‖² the Fisher estimate (Eq. 3) as a
    matrix: p = −1 gives every sequence's step unit Fisher norm (§2.0.1); r = −2 gives the multiple of v
    closest to the natural gradient, vᵀv / vᵀF̂v (Eq. 7); q = −1 unit Euclidean norm; p = q = r = 0 s = 1."""
    model, args = tiny_lm(False), make_args(p=p, q=q, r=r)
    grads, isopo_gradients, micros = script_gradients(model, args, rollouts(), torch.arange(9), micro_size=5)
    v = per_sequence_gradients(model)["fc2.weight"]
    a, g = token_gradients(model, micros[0])["fc2"]
    entry = next(e for e in isopo_gradients.trace if e["layer"] == "fc2")  # the first micro-batch's
    g0, a0 = g.flatten(0, 1)[entry["rows"]], a.flatten(0, 1)[entry["rows"]]
    samples = torch.einsum("jo,ji->joi", g0, a0).flatten(1)
    fisher_matrix = samples.T @ samples / (g0.norm(dim=1) * a0.norm(dim=1)).square().sum()
    for i in range(5):
        vi, s = v[i].flatten(), entry["scales"][i]
        quadratic = vi @ fisher_matrix @ vi
        assert entry["quantities"]["fisher"][i].item() ** 2 == pytest.approx(quadratic.item(), rel=1e-10)
        # tolerances: only Fig. 3's + 1e-8 under the root separates s from the ideal value
        if (p, q, r) == (-1.0, 0.0, 0.0):  # the KL of each sequence's step is the same
            assert (s**2 * quadratic).item() == pytest.approx(1.0, abs=1e-8 / quadratic.item() + 1e-12)
        elif (p, q, r) == (0.0, 0.0, -2.0):  # Eq. 7's minimizer divided by A_i
            ideal = (vi @ vi / quadratic).item()
            assert s.item() == pytest.approx(ideal, rel=1e-8 * ideal + 1e-12)
        elif (p, q, r) == (0.0, -1.0, 0.0):
            assert (s * vi).norm().item() == pytest.approx(1.0, abs=1e-8 / (vi @ vi).item() + 1e-12)
        else:
            assert s.item() == 1.0


@pytest.mark.parametrize("micro_size", [1, 4, 9])
@pytest.mark.parametrize(
    "overrides",
    [dict(p=0.0), dict(variant="interacting", ntk_scale="authors", ntk_reg_coef=1e12)],
    ids=["all s_i = 1", "interacting, c -> inf"],
)
def test_unit_scales_give_vanilla_reinforce(float64_logprobs, overrides, micro_size):
    """s_i = 1 for every sequence (p = q = r = 0), or c(K + cI)⁻¹ -> I: the whole model's gradient is the
    REINFORCE gradient −(1/M) Σ_i A_i ∇ log π(o_i|q_i), tied embeddings included, for any micro-batching."""
    model = tiny_lm(True)
    grads, _, _ = script_gradients(model, make_args(**overrides), rollouts(), torch.arange(9), micro_size)
    model.zero_grad()
    (-(ADVANTAGES * torch.stack([sequence_logprob(model, i) for i in range(9)])).sum() / 9).backward()
    tolerance = 1e-10 if overrides.get("variant") is None else 1e-9
    for name, parameter in model.named_parameters():
        assert relative_error(grads[name], parameter.grad) <= tolerance, name


def test_non_linear_parameters_get_the_advantage_weighted_gradient(float64_logprobs):
    """Under default ISOPO, the embedding, the norm and the bias take −(1/M) Σ_i A_i ∇ log π_i (the authors'
    code gives them an advantage-free gradient); with tied embeddings lm_head's ISOPO update adds to it."""
    model = tiny_lm(True)
    grads, isopo_gradients, micros = script_gradients(model, make_args(), rollouts(), torch.arange(9), micro_size=4)
    reference, reinforce = reference_gradients(model, make_args(), micros, isopo_gradients.trace, 9)
    for name in ("fc1.bias", "norm.weight"):
        assert relative_error(grads[name], reinforce[name]) <= 1e-10, name
    lookup_only = reinforce["embed.weight"]
    assert relative_error(grads["embed.weight"] - lookup_only, reference["embed.weight"] - lookup_only) <= 1e-8
    assert relative_error(grads["embed.weight"], lookup_only + reinforce["lm_head.weight"]) > 1e-3  # ISOPO ≠ REINFORCE
    advantage_free = -per_sequence_gradients(model)["norm.weight"].sum(0) / 9  # what the official code would use
    assert relative_error(grads["norm.weight"], advantage_free) > 1e-2


def test_regularization_uses_trailing_minibatches(float64_logprobs):
    """E[F²] of a minibatch is the mean over the previous minibatch (then an EMA with decay 0.9), never
    the minibatch itself; an uncommitted (skipped) minibatch leaves it unchanged."""
    model, args = tiny_lm(False), make_args(reg_coef=1.0)
    isopo_gradients = isopo.IsopoGradients(model, args)
    batch, first, second = rollouts(), torch.arange(0, 5), torch.arange(5, 9)
    _, _, _ = script_gradients(model, args, batch, first, 5, isopo_gradients)
    first_fisher = {e["layer"]: e["quantities"]["fisher"] for e in isopo_gradients.trace}
    isopo_gradients.end_minibatch(commit=True)
    _, _, _ = script_gradients(model, args, batch, second, 4, isopo_gradients)
    for entry in isopo_gradients.trace:
        expected = first_fisher[entry["layer"]].square().mean().item()
        assert entry["expectations"]["fisher"] == pytest.approx(expected, rel=1e-12)
        torch.testing.assert_close(entry["scales"], (entry["quantities"]["fisher"] ** 2 + expected + 1e-8) ** -0.5)
    isopo_gradients.end_minibatch(commit=False)  # a skipped step
    assert isopo_gradients.stats.get(("fc2", "fisher")) == pytest.approx(first_fisher["fc2"].square().mean().item())
    _, _, _ = script_gradients(model, args, batch, second, 4, isopo_gradients)
    second_fisher = {e["layer"]: e["quantities"]["fisher"] for e in isopo_gradients.trace}
    isopo_gradients.end_minibatch(commit=True)
    expected = 0.9 * first_fisher["fc2"].square().mean() + 0.1 * second_fisher["fc2"].square().mean()
    assert isopo_gradients.stats.get(("fc2", "fisher")) == pytest.approx(expected.item(), rel=1e-12)


def test_update_policy_commits_each_stepped_minibatch(float64_logprobs):
    """Through the script's update_policy (three minibatches of one group, one block each): each minibatch's
    scales read the EMA of the minibatches that stepped before it (the first its own block's mean), and the
    run's state holds the EMA of all three afterwards, with nothing left pending. Without the commit the
    later minibatches would read their own means and the checkpoint an empty EMA."""
    from helpers import one_process, precision

    from common.tracking import StepMetrics

    model, args = (
        tiny_lm(False),
        make_args(reg_coef=1.0, num_minibatches=3, block_size=3, micro_batch_size=3, group_size=GROUP),
    )
    isopo_gradients = isopo.IsopoGradients(model, args)
    isopo_gradients.trace = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    batch, dist = rollouts(), one_process()
    batch["sampler_logprobs"] = batch["sampler_logprobs"].double()  # π_old's pass writes float64 log-probs there
    skipped = isopo.update_policy(
        model, None, optimizer, scheduler, batch, args, dist, precision(), StepMetrics(), isopo_gradients
    )
    assert skipped == 0 and isopo_gradients.stats.pending == {}
    for layer in ("fc1", "fc2", "lm_head"):
        entries = [e for e in isopo_gradients.trace if e["layer"] == layer]
        assert len(entries) == 3  # one block per minibatch
        means = [e["quantities"]["fisher"].square().mean().item() for e in entries]
        trailing = [means[0], means[0], 0.9 * means[0] + 0.1 * means[1]]
        for entry, expected in zip(entries, trailing):
            trailing_mean = torch.as_tensor(entry["expectations"]["fisher"], dtype=torch.float64).item()
            assert trailing_mean == pytest.approx(expected, rel=1e-12)
        final = 0.9 * trailing[2] + 0.1 * means[2]
        assert isopo_gradients.stats.get((layer, "fisher")) == pytest.approx(final, rel=1e-12)


def test_trailing_means_by_hand():
    means = isopo.TrailingMeans(decay=0.9)
    assert means.get("x") is None
    means.add("x", torch.tensor([1.0, 3.0]))
    means.add("x", torch.tensor([5.0]))
    assert means.get("x") is None  # not before the minibatch ends
    means.end_minibatch()
    assert means.get("x") == pytest.approx(3.0)
    means.add("x", torch.tensor([13.0]))
    means.end_minibatch(commit=False)
    assert means.get("x") == pytest.approx(3.0)
    means.add("x", torch.tensor([13.0]))
    means.end_minibatch()
    assert means.get("x") == pytest.approx(0.9 * 3.0 + 0.1 * 13.0)
    # a key whose minibatch had no row (no row trained) keeps its mean; the keys after it are committed
    means.add("a", torch.tensor([]))
    means.add("b", torch.tensor([2.0]))
    means.end_minibatch()
    assert means.get("a") is None and means.get("b") == pytest.approx(2.0)


def test_trailing_means_all_reduced_over_ranks():
    """The scripts pass their process group: each minibatch mean is then the all-reduced sum over the all-reduced
    count of every rank's values. On one rank that is the plain mean, committed and decayed as without a group."""
    from helpers import one_process

    means = isopo.TrailingMeans(decay=0.9)
    means.add("x", torch.tensor([1.0, 3.0]))
    means.add("x", torch.tensor([5.0]))
    means.add("y", torch.tensor([2.0, 4.0]))
    means.end_minibatch(dist=one_process())
    assert means.get("x") == pytest.approx(3.0) and means.get("y") == pytest.approx(3.0)
    means.add("x", torch.tensor([13.0]))
    means.end_minibatch(dist=one_process())
    assert means.get("x") == pytest.approx(0.9 * 3.0 + 0.1 * 13.0) and means.get("y") == pytest.approx(3.0)


def test_a_checkpoints_trailing_means_are_restored(float64_logprobs):
    """--resume: the EMA saved in the checkpoint ("isopo": {"ema": ...}) is E[x²] from the first minibatch on, in
    place of the block's own mean; the checkpoint's dict itself is not changed by later commits."""
    model, args = tiny_lm(False), make_args(reg_coef=1.0, block_size=9)  # one block
    state = {"ema": {("fc2", "fisher"): 2.5}}
    isopo_gradients = isopo.IsopoGradients(model, args, state=state)
    script_gradients(model, args, rollouts(), torch.arange(9), 9, isopo_gradients)
    entry = next(e for e in isopo_gradients.trace if e["layer"] == "fc2")
    assert entry["expectations"]["fisher"] == 2.5
    fisher = entry["quantities"]["fisher"]
    torch.testing.assert_close(entry["scales"], (fisher**2 + 2.5 + 1e-8) ** -0.5, rtol=1e-12, atol=0)
    isopo_gradients.end_minibatch(commit=True)
    assert state == {"ema": {("fc2", "fisher"): 2.5}}
    expected = 0.9 * 2.5 + 0.1 * fisher.square().mean().item()
    assert isopo_gradients.stats.get(("fc2", "fisher")) == pytest.approx(expected, rel=1e-12)


def test_reg2_forms_by_hand():
    x = torch.tensor([0.0, 3.0])
    torch.testing.assert_close(isopo.reg2(x, 0.0, 5.0), torch.sqrt(x**2 + 1e-8))
    torch.testing.assert_close(isopo.reg2(x, 2.0, 8.0), torch.sqrt(x**2 + 16 + 1e-8))
    torch.testing.assert_close(isopo.reg2(x, 2.0, 8.0, "authors"), torch.sqrt(x**2 / (16 + 1e-8) + 1))
    # λ = 0: nothing to divide by, the authors' form is the paper's
    torch.testing.assert_close(isopo.reg2(x, 0.0, 8.0, "authors"), torch.sqrt(x**2 + 1e-8))
    # the regularized p = −1 scale is a soft clip: ≈ 1/sqrt(λE) for small x, ≈ 1/x for large x
    scales = isopo.sequence_scales({"fisher": torch.tensor([1e-4, 1e3])}, -1.0, 0.0, 0.0, 1.0, {"fisher": 4.0})
    torch.testing.assert_close(scales, torch.tensor([0.5, 1e-3]), rtol=1e-5, atol=0)


# --- the Gram forms, the GEMM and the solve ------------------------------------------------------


def _random_layer(B, T, out, inp, seed=0):
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(B, T, out, generator=generator, dtype=torch.float64)
    g[0, :2] = 0  # padding rows carry no gradient
    return g, torch.randn(B, T, inp, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(3, 4, 7, 6), (2, 30, 5, 3)], ids=["gram-cheaper", "materialize-cheaper"])
def test_gram_and_materialized_forms_agree_with_explicit_matrices(shape):
    g, a = _random_layer(*shape)
    V = torch.einsum("bto,bti->boi", g, a)  # the per-sequence matrices the Gram forms avoid
    blocks = lambda x: torch.cat([x, x.flip(0)]).unflatten(0, (2, -1))  # 2 blocks: the rows, reversed
    for form in ("auto", "gram", "materialize"):
        torch.testing.assert_close(isopo.sequence_norms(g, a, form), V.flatten(1).norm(dim=1), rtol=1e-12, atol=0)
        K = V.flatten(1) @ V.flatten(1).T
        expected = torch.stack([K, K.flip(0, 1)])
        torch.testing.assert_close(isopo.ntk(blocks(g), blocks(a), form), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(isopo.ntk(blocks(g), blocks(a), form, budget=1), expected, rtol=1e-12, atol=1e-12)
    chunks = list(isopo.sequence_gradients(g, a, budget=2 * shape[0] * shape[3]))
    assert len(chunks) > 1 and torch.allclose(torch.cat(chunks, 1), V)
    weights = torch.randn(shape[0], dtype=torch.float64)
    for gg, aa, VV in ((g, a, V), (a, g, V.transpose(1, 2))):  # both sides of weighted_gradient
        torch.testing.assert_close(isopo.weighted_gradient(gg, aa, weights), torch.einsum("b,boi->oi", weights, VV))
    rows = torch.tensor([[5, 1, 2], [0, 3, 4]])  # each block's own token rows
    norms = isopo.fisher_norms(blocks(g), blocks(a), rows)
    for block, Vs in enumerate((V, V.flip(0))):
        gb, ab = blocks(g)[block].flatten(0, 1), blocks(a)[block].flatten(0, 1)
        expected = torch.stack([explicit_fisher_norm(Vb, gb[rows[block]], ab[rows[block]]) for Vb in Vs])
        torch.testing.assert_close(norms[block], expected, rtol=1e-12, atol=0)


def test_auto_form_takes_the_cheaper_computation(monkeypatch):
    """Both forms are exact (the test above), so only the route shows which one `auto` takes: the cheaper by FLOPs.
    sequence_norms materializes V_i when T·(out+in) > out·in, ntk when b·T²·(out+in) > out·in·(T+b); "gram" and
    "materialize" are taken as asked. sequence_gradients, the materializing form's helper, tells the route."""
    calls, real = [], isopo.sequence_gradients
    monkeypatch.setattr(isopo, "sequence_gradients", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))

    def materializes(function, shape, form):
        calls.clear()
        g, a = _random_layer(*shape)
        function(g, a, form) if function is isopo.sequence_norms else function(g[None], a[None], form)
        return bool(calls)

    # sequence_norms [B, T, out, in]: 2·16 <= 64 (gram); 10·16 > 64 (materialize)
    assert not materializes(isopo.sequence_norms, (2, 2, 8, 8), "auto")
    assert materializes(isopo.sequence_norms, (2, 10, 8, 8), "auto")
    assert not materializes(isopo.sequence_norms, (2, 10, 8, 8), "gram")
    assert materializes(isopo.sequence_norms, (2, 2, 8, 8), "materialize")
    # ntk, one block of b sequences: 2·1·16 <= 64·3 (gram); 3·100·16 > 64·13 (materialize)
    assert not materializes(isopo.ntk, (2, 1, 8, 8), "auto")
    assert materializes(isopo.ntk, (3, 10, 8, 8), "auto")
    assert not materializes(isopo.ntk, (3, 10, 8, 8), "gram")
    assert materializes(isopo.ntk, (2, 1, 8, 8), "materialize")


def test_preconditioner_is_the_regularized_solve():
    g, a = _random_layer(4, 3, 2, 2)  # 4 sequences, rank-deficient NTK (4 > 2·2)
    K, A = isopo.ntk(g[None], a[None]), torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64)
    solved = torch.linalg.solve(K[0] + 0.3 * torch.eye(4, dtype=torch.float64), A[0])
    torch.testing.assert_close(isopo.preconditioned_weights(K, A, 0.3)[0], solved, rtol=1e-10, atol=0)
    torch.testing.assert_close(isopo.preconditioned_weights(K, A, 0.3, "authors")[0], 0.3 * solved, rtol=1e-10, atol=0)
    # two blocks with a c each: each its own solve
    both = isopo.preconditioned_weights(
        torch.cat([K, 2 * K]), torch.cat([A, A]), torch.tensor([0.3, 0.6], dtype=torch.float64)
    )
    torch.testing.assert_close(both[0], solved, rtol=1e-10, atol=0)
    torch.testing.assert_close(
        both[1], torch.linalg.solve(2 * K[0] + 0.6 * torch.eye(4, dtype=torch.float64), A[0]), rtol=1e-10, atol=0
    )
    # solved in float64, returned in the weights' dtype
    single = isopo.preconditioned_weights(K.float(), A.float(), 0.3)
    assert single.dtype == torch.float32 and torch.allclose(single[0].double(), solved, rtol=1e-6)
    # a block without a row that trains: K = 0, and c (a multiple of its mean K_ii) = 0: weights 0, not 1/0
    assert torch.equal(isopo.preconditioned_weights(torch.zeros_like(K), A, 0.0), torch.zeros_like(A))
    K[0, 1, 2] = float("nan")
    assert torch.isnan(isopo.preconditioned_weights(K, A, 0.3)).all()  # no eigh error: the step gets skipped


# --- ISOPO on a transformers Llama (float64 weights, float32 inside: 1e-5) ------------------


@pytest.mark.parametrize("variant", ["non-interacting", "interacting", "reinforce"])
def test_llama_linear_layers_match_brute_force(tiny, float64_logprobs, variant):
    model, tokenizer = tiny
    llama = type(model)(model.config)
    llama.load_state_dict(model.state_dict())
    llama = llama.double()
    prompts, completions = two_group_rollouts(tokenizer)
    responses = [c.token_ids for c in completions]
    batch = isopo.make_batch(
        prompts,
        [Completion(r, [0.0] * len(r), "stop") for r in responses],
        4,
        tokenizer.pad_token_id,
        torch.device("cpu"),
    )
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.0, -0.9, 0.4], dtype=torch.float64)
    batch["advantages"] = advantages
    args = make_args(
        **{"non-interacting": {}, "interacting": {"variant": "interacting"}, "reinforce": {"p": 0.0}}[variant]
    )
    grads, isopo_gradients, micros = script_gradients(llama, args, batch, torch.arange(8), micro_size=4)

    names, params = zip(*llama.named_parameters())
    per_sequence = []
    for i, response in enumerate(responses):
        prompt = prompts[i // 4]
        logits = llama(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprob = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).sum()
        per_sequence.append(torch.autograd.grad(logprob, params))
    v = {name: torch.stack([grads_i[k] for grads_i in per_sequence]) for k, name in enumerate(names)}
    reinforce = {name: torch.einsum("s,s...->...", -advantages / 8, v[name]) for name in names}
    if variant == "reinforce":  # every parameter, the tied embedding / lm_head included
        for name in names:
            assert relative_error(grads[name], reinforce[name]) <= 1e-5, name
        return
    tokens = [token_gradients(llama, micro) for micro in micros]
    for name in names:
        if not name.endswith("proj.weight"):  # norms, embedding (+ tied lm_head: checked on TinyLM)
            if "norm" in name:
                assert relative_error(grads[name], reinforce[name]) <= 1e-5, name
            continue
        layer = name[: -len(".weight")]
        entries = [e for e in isopo_gradients.trace if e["layer"] == layer]
        update = torch.zeros_like(v[name][0])
        for micro, entry, token in zip(micros, entries, tokens):
            rows = micro["rows"].tolist()
            G = v[name][rows]
            w = -advantages[rows] / 8
            if variant == "interacting":
                J = G.flatten(1)
                K = J @ J.T
                w = torch.linalg.solve(K + K.diagonal().mean() * torch.eye(len(rows), dtype=K.dtype), w)
            else:
                a, g = token[layer]
                g0, a0 = g.flatten(0, 1)[entry["rows"]], a.flatten(0, 1)[entry["rows"]]
                w = w / torch.stack([(explicit_fisher_norm(Gi, g0, a0) ** 2 + 1e-8) ** 0.5 for Gi in G])
            update += torch.einsum("s,soi->oi", w, G)
        assert relative_error(grads[name], update) <= 1e-5, name


def test_gradient_checkpointing_gives_the_same_gradients(tiny, float64_logprobs):
    """--gradient-checkpointing re-runs each decoder layer's forward inside the backward: the ISOPO forwards run
    again there (no "ran twice" error) and every gradient is the same."""
    model, tokenizer = tiny
    prompts, completions = two_group_rollouts(tokenizer)
    batch = isopo.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.0, -0.9, 0.4])
    grads = []
    for checkpointing in (False, True):
        llama = type(model)(model.config)
        llama.load_state_dict(model.state_dict())
        llama = llama.double().train()
        if checkpointing:
            llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        grads.append(script_gradients(llama, make_args(variant="interacting"), batch, torch.arange(8), micro_size=4)[0])
    for name in grads[0]:
        assert relative_error(grads[1][name], grads[0][name]) <= 1e-12, name


# --- IsopoGradients: scope and clear errors ---------------------------------------------------------------


def test_isopo_forwards_are_idle_outside_capture():
    """Outside capture() the model computes and differentiates as plain PyTorch; remove() restores its forwards."""
    model, plain = tiny_lm(False), tiny_lm(False)
    isopo_gradients = isopo.IsopoGradients(model, make_args())
    for m in (model, plain):
        m(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()  # a plain pass: ordinary autograd
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert "forward" in vars(model.fc1) and "forward" in vars(model.norm)
    isopo_gradients.remove()
    assert "forward" not in vars(model.fc1) and "forward" not in vars(model.norm)


def test_a_linear_called_twice_is_refused():
    class Twice(TinyLM):
        def forward(self, input_ids, **kwargs):
            x = self.embed(input_ids)
            return types.SimpleNamespace(logits=self.lm_head(self.fc2(torch.tanh(self.fc1(x)) + self.fc1(x))))

    model = Twice().double()
    isopo_gradients = isopo.IsopoGradients(model, make_args())
    with pytest.raises(ValueError, match="fc1 ran twice"), isopo_gradients.capture(torch.ones(1, 3), torch.ones(1)):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_module_that_never_runs_is_refused(float64_logprobs):
    """Its parameter is used outside its module's forward (which ISOPO cannot see): an error naming the module."""

    class Bypass(TinyLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
            x = self.embed(input_ids) * self.norm.weight[0]  # norm.weight outside the norm's forward
            return types.SimpleNamespace(logits=self.lm_head(self.fc2(self.fc1(x)))[:, -logits_to_keep:])

    model = Bypass().double()
    batch = rollouts()
    with pytest.raises(ValueError, match="module norm never ran inside capture"):
        script_gradients(model, make_args(), batch, torch.arange(9), 9)


def test_a_mixture_of_experts_model_is_refused():
    """An MoE layer sends a flat list of tokens to its experts: no per-sequence inputs for Eq. 6, so a model with a
    router is refused as bad input (one line), before any forward is wrapped."""

    class ToyRouter(nn.Module):
        pass

    model = tiny_lm(False)
    model.router = ToyRouter()
    with pytest.raises(BadInput, match="mixture-of-experts models are not supported"):
        isopo.IsopoGradients(model, make_args())
    assert "forward" not in vars(model.fc1)


def test_a_linear_with_other_parameters_is_refused():
    """IsopoLinear builds the gradients of W and b only: a Linear owning another trained parameter (an adapter kept
    inside it) would get none, so it is an error naming the module."""
    model = tiny_lm(False)
    model.fc2.register_parameter("adapter", nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"Linear module fc2 has parameters \['weight', 'adapter'\]"):
        isopo.IsopoGradients(model, make_args())


def test_outputs_that_are_not_batch_by_position_are_refused():
    """A module with parameters must return [batch, positions, ...] for its REINFORCE weights −A_i/M to be put on
    the right rows: a time-major [positions, batch, ...] output is an error (unchecked, the 3 × 2 weights would fit
    it silently); so is a Linear that sees [batch, features] (a pooled input), in its backward."""

    class TimeMajor(TinyLM):
        def forward(self, input_ids, **kwargs):
            h = torch.tanh(self.fc1(self.embed(input_ids)))
            return types.SimpleNamespace(logits=self.lm_head(self.fc2(self.norm(h.transpose(0, 1)))))

    class Pooled(TinyLM):
        def forward(self, input_ids, **kwargs):
            h = self.norm(torch.tanh(self.fc1(self.embed(input_ids))))
            return types.SimpleNamespace(logits=self.lm_head(self.fc2(h[:, -1])))

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    model = TimeMajor().double()
    isopo_gradients = isopo.IsopoGradients(model, make_args())
    with pytest.raises(ValueError, match=r"module norm returned \(3, 2, 5\); expected \[batch, positions"):
        with isopo_gradients.capture(torch.ones(2, 3), torch.ones(2, dtype=torch.float64)):
            model(input_ids=ids)
    model = Pooled().double()
    isopo_gradients = isopo.IsopoGradients(model, make_args())
    with pytest.raises(ValueError, match=r"Linear lm_head saw \(2, 6\) -> \(2, 10\); expected \[batch, positions"):
        with isopo_gradients.capture(torch.ones(2, 3), torch.ones(2, dtype=torch.float64)):
            isopo_gradients.backward(model(input_ids=ids).logits.sum())


class Scaled(nn.Module):
    """A module with a parameter, called with keyword arguments, that returns [batch, positions]."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x, *, shift, factor=1.0):
        return (x * self.weight + shift).sum(-1) * factor


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_module_called_with_keywords_gets_them_in_both_of_its_calls(dtype):
    """A module that is not a Linear runs twice under capture() (its parameters detached, then its inputs): both calls
    get its keyword arguments (a tensor's and a number's), as its plain call outside capture() does; an output of
    [batch, positions] takes its rows' weights; in bfloat16 the output stays bfloat16. The input gets the plain
    gradient, the parameter the one weighted by −A_i/M (REINFORCE)."""
    module = Scaled().to(dtype)
    plain = partial(Scaled.forward, module)  # the class's forward: not the one ISOPO puts on the instance
    isopo_gradients = isopo.IsopoGradients(module, make_args())
    x = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    shift = torch.tensor([0.25, 0.5, -1.0], dtype=dtype)
    expected = plain(x, shift=shift, factor=3.0)
    assert torch.equal(module(x, shift=shift, factor=3.0), expected)  # outside capture()
    x.requires_grad_()
    weights = torch.tensor([1.0, -2.0], dtype=torch.float64)
    with isopo_gradients.capture(torch.ones(2, 3), weights):
        out = module(x, shift=shift, factor=3.0)
        assert out.dtype == dtype and torch.equal(out.detach(), expected)
        isopo_gradients.backward(out.sum())
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-12, atol=0)
    torch.testing.assert_close(x.grad, (3.0 * module.weight.detach()).expand(2, 3, 3), **tolerance)
    reinforce = 3.0 * (weights[:, None, None] * x.detach().double()).sum((0, 1))
    torch.testing.assert_close(module.weight.grad.double(), reinforce, **tolerance)


def test_isopo_linear_gives_the_input_its_plain_gradient():
    """IsopoLinear's backward passes g W to its input, where W is frozen too (LoRA's base weights), and under
    bfloat16 autocast in bfloat16 (g is bfloat16, W the float32 master weight)."""
    a = torch.randn(2, 3, 4, requires_grad=True)
    frozen = torch.randn(5, 4)
    isopo.IsopoLinear.apply(a, frozen, None, lambda a, g: (None, None)).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(2, 3, 5) @ frozen)
    a.grad, weight = None, nn.Parameter(torch.randn(5, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = isopo.IsopoLinear.apply(a, weight, None, lambda a, g: (torch.zeros_like(weight), None))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(2, 3, 5) @ weight.detach(), rtol=2e-2, atol=2e-2)


def test_a_bfloat16_linears_update_is_computed_in_float32():
    """A Linear in bfloat16 (autocast) builds its ISOPO update from g and a cast to float32, with float32 weights:
    the same bits as from the float32 copies of the same g and a."""
    model = tiny_lm(False)
    isopo_gradients = isopo.IsopoGradients(model, make_args(block_size=3))
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[0, 0] = False  # a left pad
    micro = {"valid": valid, "weights": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)}
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(3, 4, 5, generator=generator).bfloat16()  # fc1: 6 inputs -> 5 outputs
    a = torch.randn(3, 4, 6, generator=generator).bfloat16()
    updates = []
    for g_in, a_in in ((g, a), (g.float(), a.float())):
        torch.manual_seed(0)  # Eq. 6's sample of rows
        updates.append(isopo_gradients._linear_update("fc1", micro, a_in, g_in))
    (weight, bias), (weight32, bias32) = updates
    assert weight.dtype == bias.dtype == torch.float32
    assert torch.equal(weight, weight32) and torch.equal(bias, bias32)


class NormTwiceLM(TinyLM):
    """TinyLM with its norm run twice in a row."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask)[..., None].double()
        x = self.embed(input_ids)
        h = torch.tanh(self.fc1(x)) * mask
        h = h.cumsum(1) / mask.cumsum(1).clamp(min=1)
        x = x + self.fc2(self.norm(self.norm(h)))
        return types.SimpleNamespace(logits=self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x))


class LeakyLM(TinyLM):
    """TinyLM whose mixing step ignores the attention mask: the left pads feed every later position."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        x = self.embed(input_ids)
        h = torch.tanh(self.fc1(x))
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        x = x + self.fc2(self.norm(h))
        return types.SimpleNamespace(logits=self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x))


def test_a_module_run_twice_in_a_row_gets_reinforce_from_both_calls(float64_logprobs):
    """A module that is not a Linear may run more than once per forward, here the norm twice in a row: each call's
    parameter path is weighted by −A_i/M (the plain forward is taken only inside that call's own functional_call),
    so with s_i = 1 (p = 0) every gradient is the REINFORCE gradient, by brute force."""
    torch.manual_seed(0)
    model = NormTwiceLM().double()
    grads, _, _ = script_gradients(model, make_args(p=0.0), rollouts(), torch.arange(9), micro_size=9)
    model.zero_grad()
    (-(ADVANTAGES * torch.stack([sequence_logprob(model, i) for i in range(9)])).sum() / 9).backward()
    for name, parameter in model.named_parameters():
        assert relative_error(grads[name], parameter.grad) <= 1e-10, name


def test_pad_rows_never_enter_a_linear_update(float64_logprobs):
    """V_i sums g_t a_tᵀ over row i's non-pad positions only. Under a model that lets the left pads feed later
    positions their output gradients are not 0, yet they add nothing to a Linear's weight or bias: with s_i = 1
    (p = 0) the update is Σ_i (−A_i/M) Σ_{t non-pad} g_t a_tᵀ, from plain autograd's g_t and a_t."""
    torch.manual_seed(0)
    model = LeakyLM().double()
    grads, _, micros = script_gradients(model, make_args(p=0.0), rollouts(), torch.arange(9), micro_size=9)
    a, g = token_gradients(model, micros[0])["fc1"]
    valid, weights = micros[0]["attention_mask"].bool(), -ADVANTAGES / 9
    assert g[~valid].abs().max() > 1e-3  # the pads' outputs do get gradients
    g = g * valid[..., None]
    torch.testing.assert_close(grads["fc1.weight"], torch.einsum("b,bto,bti->oi", weights, g, a), rtol=1e-10, atol=0)
    torch.testing.assert_close(grads["fc1.bias"], torch.einsum("b,bto->o", weights, g), rtol=1e-10, atol=0)


# --- the statistics, the loss and the minibatches ------------------------------------------------------


def _recorded(isopo_gradients):
    """What record() puts in a step's metrics, reduced as the scripts log them."""
    from common.tracking import StepMetrics

    metrics = StepMetrics()
    isopo_gradients.record(metrics)
    return metrics.reduce()


@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("variant", ["non-interacting", "interacting"])
def test_rows_that_do_not_train_change_neither_the_update_nor_the_statistics(float64_logprobs, variant, block_size):
    """Rows without a token to train (--mask-truncated, dynamic sampling's filler groups) have v_i = 0: beside them
    a block updates, logs and averages E[·] exactly as the rows that train would alone (every token row a probe).
    They entered the statistics once: s_i = 1/‖0‖ = 1e12 in scale_max, and zeros in E[x²] and in c's mean K_ii.
    With blocks of one group (`block_size` 3), the third is a block without a training row: the first minibatch's
    reg_* and ntk_reg (each block's own mean, none trailing yet) averaged its 0 in."""
    args = make_args(variant=variant, p=-1.0, reg_coef=0.5, n_overlap=1000)
    completions = [Completion(r, [-1.0] * len(r), "stop") for r in RESPONSES]
    runs = {}
    for rows in (6, 9):  # the first two groups alone, or beside a third that does not train
        batch = isopo.make_batch(
            PROMPTS[: rows // GROUP], completions[:rows], GROUP, 0, torch.device("cpu"), [True] * 6 + [False] * 3
        )
        batch["advantages"] = ADVANTAGES[:rows].clone()
        model = tiny_lm(False)
        isopo_gradients = isopo.IsopoGradients(model, dataclasses.replace(args, block_size=block_size or rows))
        micro = next(isopo.micro_batches(batch, torch.arange(rows), rows, by_length=False))
        isopo.isopo_backward(model, isopo_gradients, micro, 1.0, 6, NO_AUTOCAST)  # M = 6 sequences train
        isopo_gradients.end_minibatch(commit=True)
        grads = {name: p.grad for name, p in model.named_parameters()}
        runs[rows] = grads, _recorded(isopo_gradients), isopo_gradients.stats.ema
    (alone, logged_alone, means_alone), (beside, logged_beside, means_beside) = runs[6], runs[9]
    for name in alone:
        torch.testing.assert_close(beside[name], alone[name], rtol=1e-9, atol=1e-12, msg=name)
    assert logged_beside.keys() == logged_alone.keys() and means_beside.keys() == means_alone.keys()
    for key in logged_alone:
        assert logged_beside[key] == pytest.approx(logged_alone[key], rel=1e-9, abs=1e-12), key
    for key in means_alone:
        assert means_beside[key] == pytest.approx(means_alone[key], rel=1e-9), key


def test_non_interacting_statistics_are_logged(float64_logprobs):
    """isopo/<layer>/...: the means over the step's sequences of ‖v_i‖_F (Eq. 6), ‖v_i‖ and their ratio, the mean
    over blocks of λ·E[x²], and the mean, minimum and maximum of s_i (Fig. 3), all from explicit V_i; record()
    empties the log, so the next step starts afresh."""
    model, args = tiny_lm(False), make_args(p=-1.0, q=-0.5, r=0.5, reg_coef=0.7)
    order = torch.tensor([4, 0, 7, 2, 8, 1, 5, 3, 6])
    _, isopo_gradients, micros = script_gradients(model, args, rollouts(), order, micro_size=4)
    logged, v = _recorded(isopo_gradients), per_sequence_gradients(model)
    for layer in ("fc1", "fc2", "lm_head"):
        entries = [e for e in isopo_gradients.trace if e["layer"] == layer]
        values, regularizers, scales = (
            {"fisher": [], "euclid": [], "rel": []},
            {"fisher": [], "euclid": [], "rel": []},
            [],
        )
        for micro, entry in zip(micros, entries):  # one block per micro-batch
            G = v[f"{layer}.weight"][micro["rows"]]
            a, g = token_gradients(model, micro)[layer]
            g0, a0 = g.flatten(0, 1)[entry["rows"]], a.flatten(0, 1)[entry["rows"]]
            fisher = torch.stack([explicit_fisher_norm(Gi, g0, a0) for Gi in G])
            euclid = G.flatten(1).norm(dim=1)
            s = torch.ones(len(G), dtype=torch.float64)
            for key, x, power in (("fisher", fisher, -1.0), ("euclid", euclid, -0.5), ("rel", fisher / euclid, 0.5)):
                expectation = x.square().mean()  # the block's own: no minibatch has finished
                values[key].append(x)
                regularizers[key].append(0.7 * expectation)
                s = s * explicit_reg2(x, 0.7, expectation, "paper") ** power
            scales.append(s)
        scales = torch.cat(scales)
        expected = {f"reg_{key}": torch.stack(regularizers[key]).mean() for key in regularizers}
        expected |= {
            "fisher_norm": torch.cat(values["fisher"]).mean(),
            "euclid_norm": torch.cat(values["euclid"]).mean(),
        }
        expected |= {"rel_fisher_norm": torch.cat(values["rel"]).mean(), "scale_mean": scales.mean()}
        expected |= {"scale_min": scales.min(), "scale_max": scales.max()}
        for key, value in expected.items():
            assert logged[f"isopo/{layer}/{key}"] == pytest.approx(value.item(), rel=1e-9), (layer, key)
    assert len(logged) == 3 * len(expected)
    assert _recorded(isopo_gradients) == {}  # the next step's statistics start afresh
    isopo_gradients.end_minibatch(commit=True)  # then λ·E[x²] is λ times the trailing mean, not the block's own
    script_gradients(model, args, rollouts(), order[:4], 4, isopo_gradients)
    logged = _recorded(isopo_gradients)
    for layer in ("fc1", "fc2", "lm_head"):
        trailing = isopo_gradients.stats.get((layer, "fisher"))
        assert logged[f"isopo/{layer}/reg_fisher"] == pytest.approx(0.7 * trailing, rel=1e-6)


def test_lora_statistics_are_logged_per_adapter_matrix():
    """With LoRA each adapter's A and B is normalized in its own Fisher metric, and logged under its own group
    (q_proj.lora_A, ...): peft names the module by its adapter (default), under which every group was merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.tracking import StepMetrics

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    adapters = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), adapters)
    isopo_gradients = isopo.IsopoGradients(model, make_args(block_size=4))
    ids = torch.randint(0, 32, (4, 6))
    with isopo_gradients.capture(torch.ones_like(ids), torch.tensor([1.0, -1.0, 0.5, -0.5])):
        logits = model(input_ids=ids).logits[:, :-1]
        isopo_gradients.backward(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum())
    metrics = StepMetrics()
    isopo_gradients.record(metrics)
    groups = {key.split("/")[1] for key in metrics.reduce()}
    assert groups == {"q_proj.lora_A", "q_proj.lora_B", "v_proj.lora_A", "v_proj.lora_B"}


@pytest.mark.parametrize("scale", ["paper", "authors"])
def test_interacting_statistics_are_logged_and_the_trailing_eigenvalue_sets_c(float64_logprobs, scale):
    """isopo/<layer>/ntk_eig_mean (the mean of the K_ii = ‖v_i‖²), ntk_eig_max (the largest eigenvalue of any block's
    K), ntk_reg (c per block) and shrink (‖c (K + cI)⁻¹A‖/‖A‖ per block, whichever --ntk-scale; NaN, left out, for
    the block whose only A_i is 0), from explicit K = J Jᵀ; the trace holds each block's K, c and weights. Once the
    minibatch is committed, the next one's c is --ntk-reg-coef times the trailing mean of its K_ii, not its own."""
    model, args = tiny_lm(False), make_args(variant="interacting", ntk_reg_coef=0.3, ntk_scale=scale)
    order = torch.tensor([4, 0, 7, 2, 8, 1, 5, 6, 3])  # the last block: sequence 3 alone, whose A_i = 0
    _, isopo_gradients, micros = script_gradients(model, args, rollouts(), order, micro_size=4)
    logged, v = _recorded(isopo_gradients), per_sequence_gradients(model)
    for layer in ("fc1", "fc2", "lm_head"):
        diagonals, largest, regularizers, shrinks = [], [], [], []
        entries = [e for e in isopo_gradients.trace if e["layer"] == layer]
        for micro, entry in zip(micros, entries, strict=True):  # one block per micro-batch
            J = v[f"{layer}.weight"][micro["rows"]].flatten(1)
            K, A = J @ J.T, -ADVANTAGES[micro["rows"]] / 9
            c = 0.3 * K.diagonal().mean()
            solved = torch.linalg.solve(K + c * torch.eye(len(K), dtype=K.dtype), A)
            torch.testing.assert_close(entry["K"], K, rtol=1e-9, atol=1e-12)
            assert entry["c"].item() == pytest.approx(c.item(), rel=1e-9)
            torch.testing.assert_close(entry["weights"], solved * (c if scale == "authors" else 1), rtol=1e-8, atol=0)
            diagonals.append(K.diagonal())
            largest.append(torch.linalg.eigvalsh(K).max())
            regularizers.append(c)
            if A.norm() > 0:
                shrinks.append((c * solved).norm() / A.norm())
        expected = {"ntk_eig_mean": torch.cat(diagonals).mean(), "ntk_eig_max": torch.stack(largest).max()}
        expected |= {"ntk_reg": torch.stack(regularizers).mean(), "shrink": torch.stack(shrinks).mean()}
        assert len(shrinks) == 2
        for key, value in expected.items():
            assert logged[f"isopo/{layer}/{key}"] == pytest.approx(value.item(), rel=1e-9), (layer, key)
    isopo_gradients.end_minibatch(commit=True)
    script_gradients(model, args, rollouts(), order[:4], 4, isopo_gradients)
    logged = _recorded(isopo_gradients)
    for layer in ("fc1", "fc2", "lm_head"):
        trailing = v[f"{layer}.weight"].flatten(1).square().sum(1).mean()  # the mean K_ii of the 9 sequences
        assert isopo_gradients.stats.get((layer, "ntk_eig")) == pytest.approx(trailing.item(), rel=1e-10)
        # (a number, logged through float32)
        assert logged[f"isopo/{layer}/ntk_reg"] == pytest.approx(0.3 * trailing.item(), rel=1e-6)


def test_isopo_backward_returns_the_loss_and_undoes_the_rank_average(float64_logprobs):
    """isopo_backward's third value is L = −(1/M) Σ_i A_i log π(o_i|q_i) of its micro-batch (losses/policy_loss, and
    the finiteness check of the step), from the plain −A_i/M; its gradients carry × world size, which FSDP2's
    average over the ranks undoes: with s_i = 1 (p = 0), twice the REINFORCE gradient at world size 2."""
    model = tiny_lm(True)
    isopo_gradients = isopo.IsopoGradients(model, make_args(p=0.0, block_size=9))
    micro = next(isopo.micro_batches(rollouts(), torch.arange(9), 9, by_length=False))
    _, _, loss = isopo.isopo_backward(model, isopo_gradients, micro, 1.0, 9, NO_AUTOCAST, world_size=2)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = -(ADVANTAGES * torch.stack([sequence_logprob(model, i) for i in range(9)])).sum() / 9
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    expected.backward()
    for name, parameter in model.named_parameters():
        assert relative_error(grads[name], 2 * parameter.grad) <= 1e-10, name


def _token_logprobs_alone(model, index):
    """log π(o_t | q, o_<t) of each token of one rollout, run alone without any padding."""
    prompt, response = PROMPTS[index // GROUP], RESPONSES[index]
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_update_policy_cuts_blocks_from_whole_groups_longest_first(float64_logprobs, monkeypatch):
    """update_policy shuffles whole groups, so that a block of --group-size rows is one prompt's group, and runs a
    minibatch's blocks longest response first (the group whose longest has 3 tokens after those of 4), a shorter last
    block last. With one update approx_kl is exactly 0 (π_old = π_θ); --log-kl-ref logs k3 KL(π_θ ‖ π_ref) over the
    response tokens, here from explicit per-token log-probs of another model as the reference."""
    from helpers import one_process, precision

    from common.tracking import StepMetrics

    seen, real_backward = [], isopo.isopo_backward

    def recording_backward(policy, isopo_gradients, micro, *rest):
        seen.append(micro["rows"].tolist())
        return real_backward(policy, isopo_gradients, micro, *rest)

    monkeypatch.setattr(isopo, "isopo_backward", recording_backward)

    def update(seed, reference=None, **overrides):
        seen.clear()
        model, args = tiny_lm(False), make_args(group_size=GROUP, **overrides)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the model stays the one measured below
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        batch, metrics, isopo_gradients = rollouts(), StepMetrics(), isopo.IsopoGradients(model, args)
        batch["sampler_logprobs"] = batch["sampler_logprobs"].double()
        torch.manual_seed(seed)  # the shuffle of the groups
        isopo.update_policy(
            model, reference, optimizer, scheduler, batch, args, one_process(), precision(), metrics, isopo_gradients
        )
        return model, metrics.reduce()

    reference = tiny_lm(False, seed=1)
    model, logged = update(0, reference, block_size=GROUP, micro_batch_size=GROUP)  # seed 0 shuffles to 2, 0, 1
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert logged["losses/approx_kl"] == 0.0 and logged["isopo/fc2/scale_max"] > 0  # ISOPO's statistics too
    k3 = []
    for i in range(9):
        log_ratio = _token_logprobs_alone(reference, i) - _token_logprobs_alone(model, i)
        k3.append(torch.exp(log_ratio) - log_ratio - 1)
    assert logged["losses/kl_ref"] == pytest.approx(torch.cat(k3).mean().item(), rel=1e-10)
    # L = −(1/M) Σ_i A_i log π(o_i|q_i), M the minibatch's 9 sequences
    sequence_logprobs = torch.stack([_token_logprobs_alone(model, i).sum() for i in range(9)])
    assert logged["losses/policy_loss"] == pytest.approx(-(ADVANTAGES * sequence_logprobs).sum().item() / 9, rel=1e-9)
    for seed in (1, 2, 3):  # other shuffles: whole groups, each a block
        update(seed, block_size=GROUP, micro_batch_size=GROUP)
        assert sorted(seen) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and seen[2] == [6, 7, 8]
    update(0, block_size=2, micro_batch_size=4)  # 4 blocks of 2, then one of 1
    assert [len(rows) for rows in seen] == [4, 4, 1] and sorted(sum(seen, [])) == list(range(9))
    update(0, block_size=2, micro_batch_size=10)  # the same in one micro-batch: the block of 1 (row 5) last
    assert len(seen) == 1 and sorted(seen[0]) == list(range(9)) and seen[0][-1] == 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"q": float("nan")}, "--q must be a finite number"),
        ({"r": float("inf")}, "--r must be a finite number"),
        ({"dtype": "bfloat16", "fp32_lm_head": True}, "--fp32-lm-head must be off: ISOPO builds its own"),
    ],
)
def test_scale_exponents_and_fp32_lm_head_are_checked(overrides, message):
    """Each exponent of s_i is checked (a NaN one makes every scale NaN: every step skipped), and --fp32-lm-head,
    which replaces the output layer ISOPO builds lm_head's per-sequence update in, is refused even where the shared
    check allows it (bfloat16)."""
    with pytest.raises(BadInput, match=message):
        isopo.check_args(make_args(**overrides))


# --- the script ---------------------------------------------------------------------------------

SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 0]
# the end-to-end run needs a reward signal: every parameter trains in 2 steps of 8 groups unless all 16 have equal
# rewards, on 0.48^16 < 1e-5 of machines; the interacting run's first step (its shrink is NaN, left out, when every
# A_i = 0) has 16 groups (helpers.py, reward signal). With 4 prompts they failed on 0.3% and 5% of machines.
SIGNAL = {
    "non-interacting": ["--prompts-per-step", 8, *SMALL[2:]],
    "interacting": ["--prompts-per-step", 16, *SMALL[2:]],
}
LOGGED = BASE_LOGGED  # no ratio, no clip
GROUPS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.mark.slow
def test_both_variants_two_steps_end_to_end(tmp_path, tiny_dir):
    """Non-interacting (the defaults): its per-layer statistics, no ratio, π_old = π_θ, and every parameter
    trained by the isopo_gradients. Interacting, two minibatches, --log-kl-ref: the NTK statistics and the drift."""
    from transformers import AutoModelForCausalLM

    flags = ["--output-dir", tmp_path / "non-interacting", *SIGNAL["non-interacting"]]
    run_script("algorithms/isopo.py", "--steps", 2, *flags)
    run_dir = only_run_dir(tmp_path / "non-interacting")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    per_group = ["fisher_norm", "scale_mean", "scale_min", "scale_max", "reg_fisher"]
    for key in LOGGED + [f"isopo/{g}/{k}" for g in GROUPS for k in per_group]:
        assert isinstance(records[-1][key], float), key
    assert "losses/clip_fraction" not in records[-1] and "losses/ratio_max" not in records[-1]
    assert records[-1]["losses/approx_kl"] == 0.0  # one update per batch: π_θ = π_old when it is measured
    assert records[-1]["isopo/lm_head/fisher_norm"] > 0 and records[-1]["isopo/q_proj/scale_min"] > 0
    assert records[-1]["isopo/lm_head/reg_fisher"] == 0.0  # --reg-coef 0, as in the paper's runs
    assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 10_000
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "step_00000002"))
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for (name, p), q in zip(model.named_parameters(), initial.parameters()):
        assert not torch.equal(p, q), name  # every parameter trained (norms and the tied embedding included)

    run_script(
        "algorithms/isopo.py",
        "--steps",
        2,
        "--output-dir",
        tmp_path / "interacting",
        *SIGNAL["interacting"],
        "--variant",
        "interacting",
        "--num-minibatches",
        2,
        "--block-size",
        5,
        "--micro-batch-size",
        10,
        "--log-kl-ref",
        "--lr",
        1e-3,
    )
    first, last = read_jsonl(os.path.join(only_run_dir(tmp_path / "interacting"), "metrics.jsonl"))
    assert first["charts/zero_std_group_fraction"] < 1  # the first batch carries signal (16 groups: see SIGNAL)
    for key in (
        LOGGED
        + ["losses/kl_ref"]
        + [f"isopo/{g}/{k}" for g in GROUPS for k in ["ntk_eig_mean", "ntk_eig_max", "ntk_reg", "shrink"]]
    ):
        assert isinstance(first[key], float), key
    # the second minibatch is trained off-policy, uncorrected (its first minibatch holds 8 of the 16 groups)
    assert max(first["losses/approx_kl"], last["losses/approx_kl"]) > 0
    assert last["losses/kl_ref"] > 0  # the first step moved the policy away from the initial one
    assert 0 < first["isopo/lm_head/shrink"] < 1 and first["isopo/lm_head/ntk_reg"] > 0
    assert first["isopo/q_proj/ntk_eig_max"] >= first["isopo/q_proj/ntk_eig_mean"]


@pytest.mark.slow
def test_resume_continues_exactly_with_the_regularization_state(tmp_path):
    """With --reg-coef > 0 the update depends on the EMA of past minibatches: it must survive a resume."""
    flags = ["--save-every", 2, *SMALL, "--p", 0, "--q", -1, "--r", -2, "--reg-coef", 1.0, "--reg-form", "authors"]
    run_script("algorithms/isopo.py", "--steps", 4, "--output-dir", tmp_path / "straight", *flags)
    run_script("algorithms/isopo.py", "--steps", 2, "--output-dir", tmp_path / "split", *flags)
    run_script("algorithms/isopo.py", "--steps", 4, "--output-dir", tmp_path / "split", "--resume", "auto", *flags)
    straight = read_jsonl(os.path.join(only_run_dir(tmp_path / "straight"), "metrics.jsonl"))
    split = read_jsonl(os.path.join(only_run_dir(tmp_path / "split"), "metrics.jsonl"))
    assert [r["step"] for r in straight] == [r["step"] for r in split] == [1, 2, 3, 4]
    assert straight[-1]["isopo/q_proj/reg_rel"] > 0 and "isopo/q_proj/euclid_norm" in straight[-1]
    checkpoint = os.path.join(only_run_dir(tmp_path / "split"), "checkpoints", "step_00000002")
    saved = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)["isopo"]["ema"]
    assert saved and all(value > 0 for value in saved.values())  # the trailing means of step 2 are in the checkpoint
    for a, b in zip(straight, split, strict=True):
        for key in ("charts/reward", "losses/policy_loss", "losses/grad_norm", "isopo/q_proj/scale_mean"):
            assert a[key] == b[key], (a["step"], key)


def test_non_finite_update_skips_the_step(tmp_path, monkeypatch, tiny_dir):
    """A NaN in the ISOPO scales must never reach the weights: the step is skipped and counted."""
    monkeypatch.setattr(
        isopo, "sequence_scales", lambda quantities, *args, **kwargs: quantities["fisher"] * float("nan")
    )
    isopo.main(
        flags.make(isopo.Args, steps=2, eval_every=0, output_dir=str(tmp_path), prompts_per_step=4, group_size=4)
    )
    run_dir = only_run_dir(tmp_path)
    assert [r["charts/skipped_steps"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [1, 2]
    assert_weights_unchanged(os.path.join(run_dir, "checkpoints", "step_00000002"), tiny_dir)
    state = torch.load(os.path.join(run_dir, "checkpoints", "step_00000002", "trainer_state.pt"), weights_only=False)
    assert state["isopo"]["ema"] == {}  # skipped minibatches leave no trace in the regularization


@pytest.mark.slow
def test_two_ranks_end_to_end_and_exact_resume(tmp_path):
    """torchrun, 2 ranks (gloo): 3 steps straight equal 2 steps then --resume to 3, with the regularization on (its
    EMA, all-reduced over ranks, is part of the checkpoint); the per-layer statistics are logged. Both variants."""
    for variant in ("non-interacting", "interacting"):
        regularization = ["--reg-coef", 1.0] if variant == "non-interacting" else []  # interacting: its own (c)
        flags = ["--save-every", 2, *SMALL, *regularization, "--block-size", 4, "--variant", variant]
        out = tmp_path / variant
        torchrun(2, "algorithms/isopo.py", "--steps", 3, "--output-dir", out / "straight", *flags)
        torchrun(2, "algorithms/isopo.py", "--steps", 2, "--output-dir", out / "split", *flags)
        torchrun(2, "algorithms/isopo.py", "--steps", 3, "--output-dir", out / "split", "--resume", "auto", *flags)
        straight, split = (
            read_jsonl(os.path.join(only_run_dir(out / n), "metrics.jsonl")) for n in ("straight", "split")
        )
        assert [r["step"] for r in straight] == [r["step"] for r in split] == [1, 2, 3]
        statistic = "isopo/q_proj/reg_fisher" if variant == "non-interacting" else "isopo/q_proj/ntk_reg"
        assert straight[-1][statistic] > 0
        for a, b in zip(straight, split, strict=True):
            for key in ("charts/reward", "losses/policy_loss", "losses/grad_norm", statistic):
                assert a[key] == pytest.approx(b[key], rel=1e-6), (variant, a["step"], key)


def test_full_logits_that_cannot_fit_are_refused_before_set_up(tmp_path, monkeypatch):
    """ISOPO keeps [B, T, vocabulary] logits: a micro-batch whose logits stage exceeds the device is refused with the
    numbers and the flags that help, before the engine or the trainer is built. The stage's size: four float32
    tensors of micro-batch × (--max-new-tokens + 1) × vocabulary (the paper's 8 × 2049 × 151,936: 37 GiB)."""
    from common import memory

    assert memory.full_logits_bytes(8, 2048, 151936) == 16 * 8 * 2049 * 151936
    monkeypatch.setattr(memory, "device_bytes", lambda device: 2**20)  # a 1 MiB device: nothing fits
    with pytest.raises(
        ValueError,
        match=r"ISOPO keeps full logits: --micro-batch-size 64 × 17 positions × 100 vocabulary needs about 0.0016 GiB",
    ):
        isopo.main(flags.make(isopo.Args, steps=1, eval_every=0, output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())
