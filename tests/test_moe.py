"""Mixture-of-experts models and routing replay (common/moe.py, tis_icepop.py --router-replay): replay is exact, its
gradient is the router's, it survives gradient checkpointing, the engine's captured routing reproduces the engine's
log-probs, and the built-in tiny-moe model trains with R3 restoring the engine's routing."""

import os

import pytest
import torch
from helpers import ALGORITHMS, assert_two_ranks_update_like_one, one_process, only_run_dir, read_jsonl, run_script

import algorithms.tis_icepop as tim
from common import flags, fsdp, moe
from common.engines import Completion, HFEngine
from common.errors import BadInput
from common.rollouts import Groups, RolloutQueue
from common.tracking import StepMetrics


def small_moe(kind: str, dtype=torch.float32, seed: int = 0):
    """A random 2-layer MoE of each router family transformers 5 has (4 experts, 2 per token), in train mode."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shared = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    shared |= dict(num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**shared, intermediate_size=48, num_local_experts=4))
    elif kind == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(**shared, intermediate_size=48, num_experts=4, norm_topk_prob=False))
    elif kind == "qwen3-dense-first":  # three layers, the first without experts (mlp_only_layers)
        shared |= dict(num_hidden_layers=3, mlp_only_layers=[0], intermediate_size=48)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shared, moe_intermediate_size=48, num_experts=4))
    else:  # Qwen3-MoE, with and without renormalising the top-k weights
        config = Qwen3MoeConfig(**shared, moe_intermediate_size=48, num_experts=4, norm_topk_prob=kind == "qwen3")
        model = Qwen3MoeForCausalLM(config)
    for router, _ in ((r, 0) for _, r in moe.routers(model)):
        torch.nn.init.normal_(router.weight, std=0.5)  # Qwen3's router starts at zero: every choice would be a tie
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return model.to(dtype).train()


CPU = torch.device("cpu")
KINDS = ["mixtral", "qwen3", "qwen3-unnormalised", "olmoe"]
IDS = torch.randint(3, 50, (3, 11), generator=torch.Generator().manual_seed(0))


def other_experts(routing, experts):
    """A routing where every token goes to other experts than in `routing` (k = 2 of `experts`)."""
    shifted = (routing.long() + 1) % experts
    return torch.where(shifted[..., :1] == shifted[..., 1:], (shifted + 1) % experts, shifted).to(routing.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_replaying_a_forwards_own_routing_is_exact(kind, dtype):
    """In bfloat16 too: the replayed weights are the router's softmax in float32, cast back as the router casts."""
    model = small_moe(kind, dtype)
    routing = moe.Routing(model)
    with routing.recording():
        plain = model(IDS).logits
    used, own = routing.take(len(IDS))
    assert used.shape == (3, 11, 2, 2) and torch.equal(used, own)
    routing.replay(used)
    assert torch.equal(model(IDS).logits, plain)  # bit for bit


def test_a_dense_layer_keeps_its_place_and_is_left_out_of_the_statistics():
    """Qwen3-MoE with a dense first layer: its routers are those of decoder layers 1 and 2 (not 0 and 1), a
    routing keeps layer 0's slot empty (0), replaying the forward's own routing is exact, and the agreement is the
    MoE layers' alone, whatever a dense layer's slot holds."""
    model = small_moe("qwen3-dense-first")
    assert [layer for layer, _ in moe.routers(model)] == [1, 2]
    routing = moe.Routing(model)
    with routing.recording():
        plain = model(IDS).logits
    used, own = routing.take(len(IDS))
    assert used.shape == (3, 11, 3, 2) and torch.equal(used, own) and not used[:, :, 0].any()
    assert (used[:, :, 1:, 0] != used[:, :, 1:, 1]).all()  # two experts a token at the MoE layers
    routing.replay(used)
    assert torch.equal(model(IDS).logits, plain)
    routing.replay(None)
    engine = used.clone()
    engine[:, :, 0] = 3  # a dense layer's slot, unlike the trainer's 0s: not compared
    engine[:, :, 2] = other_experts(used[:, :, 2], 4)
    metrics = StepMetrics()
    moe.record_agreement(metrics, engine, used, own, torch.ones(3, 11, dtype=torch.bool), [1, 2])
    logged = metrics.reduce()
    assert (logged["routing/agreement_layer1"], logged["routing/agreement_layer2"]) == (1, 0)
    assert logged["routing/agreement"] == logged["routing/own_agreement"] == 0.5
    assert logged["routing/tokens_differing"] == 1
    metrics = StepMetrics()
    moe.record_drift(metrics, engine, own, torch.ones(3, 11, dtype=torch.bool), [1, 2])
    assert metrics.reduce()["routing/drift"] == 0.5


def test_a_dense_model_has_no_routing():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM has no mixture-of-experts router"):
        moe.Routing(LlamaForCausalLM(config))


@pytest.mark.parametrize("kind", KINDS)
def test_a_replayed_routing_is_used_and_recorded(kind):
    """Replaying other experts changes the forward; the recording tells the experts used from the router's choice."""
    model = small_moe(kind)
    routing = moe.Routing(model)
    with routing.recording():
        plain = model(IDS).logits
    own = routing.take(len(IDS))[1]
    replayed = other_experts(own, 4)
    routing.replay(replayed)
    with routing.recording():
        rerouted = model(IDS).logits
    used, own_again = routing.take(len(IDS))
    # the first layer's routers see the same input and choose as before; later layers see the rerouted ones' output
    assert torch.equal(used, replayed) and torch.equal(own_again[:, :, 0], own[:, :, 0])
    assert (rerouted - plain).abs().max() > 1e-3
    routing.replay(None)
    assert torch.equal(model(IDS).logits, plain)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3", "qwen3-unnormalised"])
def test_replayed_weights_gradient_matches_a_float64_reference(kind):
    """The MoE block under replay against the formula written out per token, in float64: y_n = Σ_j w_nj E_{e_nj}(h_n)
    with w_n = softmax(W h_n)[e_n] (renormalised over e_n when the model renormalises), E(h) = down(silu(gate h) ·
    up h). Outputs and the gradients of the router, the experts and the input agree."""
    model = small_moe(kind, torch.float64)
    block = model.model.layers[0].mlp
    routing = moe.Routing(model)
    hidden = torch.randn(1, 7, 32, dtype=torch.float64, requires_grad=True)
    chosen = other_experts(torch.randint(0, 4, (1, 7, 2, 2)), 4)  # distinct experts per token
    routing.replay(chosen)
    output = block(hidden)
    upstream = torch.randn_like(output)
    gradients = torch.autograd.grad((output * upstream).sum(), [hidden, block.gate.weight, *block.experts.parameters()])

    reference_hidden = hidden.detach().clone().requires_grad_()
    router, gate_up, down = (
        p.detach().clone().requires_grad_() for p in (block.gate.weight, *block.experts.parameters())
    )
    renormalise = kind != "qwen3-unnormalised"
    rows = []
    for n in range(7):
        h = reference_hidden[0, n]
        experts = chosen[0, n, 0].long()
        weights = torch.softmax(router @ h, dim=-1)[experts]
        weights = weights / weights.sum() if renormalise else weights
        out = torch.zeros_like(h)
        for j, e in enumerate(experts):
            g, u = (gate_up[e] @ h).chunk(2)
            out = out + weights[j] * (down[e] @ (torch.nn.functional.silu(g) * u))
        rows.append(out)
    reference = torch.stack(rows)[None]
    torch.testing.assert_close(output, reference, rtol=1e-12, atol=1e-12)
    expected = torch.autograd.grad((reference * upstream).sum(), [reference_hidden, router, gate_up, down])
    assert gradients[1].abs().sum() > 0  # the router learns under replay
    for got, want in zip(gradients, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_replay_holds_through_gradient_checkpointing():
    """With checkpointing the backward recomputes each layer: a replay that lapsed there would route the recomputation
    by the router's own choice and give other gradients. Same gradients as without checkpointing; and the
    recomputation does run (the routers are called twice per layer)."""
    grads, calls = {}, {}
    for checkpointing in (False, True):
        model = fsdp.prepare_for_training(small_moe("qwen3"), checkpointing)
        routing = moe.Routing(model)
        with routing.recording():
            model(IDS)
        replayed = other_experts(routing.take(len(IDS))[1], 4)
        counter = [0]

        def count(*_, counter=counter):
            counter[0] += 1

        for _, router in routing.routers:
            router.register_forward_hook(count)
        routing.replay(replayed)
        model(IDS).logits.square().mean().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        calls[checkpointing] = counter[0]
    assert calls == {False: 2, True: 4}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_routing_is_kept_in_one_byte_an_expert_and_only_while_recording():
    """The routing's memory: an expert id takes one byte up to 256 experts (two above, where uint8 would wrap), and
    forwards outside `recording()` keep nothing (the engine's and trainer's other forwards would otherwise pile up
    [tokens, k] tensors per layer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = small_moe("qwen3")
    routing = moe.Routing(model)
    model(IDS)  # before any recording
    used, own = routing.take(len(IDS))  # nothing recorded: an empty routing
    assert used.shape == own.shape == (len(IDS), 0, 2, 2) and used.dtype == torch.uint8
    with routing.recording():
        model(IDS)
    used, own = routing.take(len(IDS))
    assert used.dtype == own.dtype == torch.uint8 and used.shape == (*IDS.shape, 2, 2)
    model(IDS)
    assert routing.used == {} and routing.own == {}
    sizes = dict(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    for experts, dtype in ((256, torch.uint8), (257, torch.int16)):  # ids up to 255 fit in a byte, 256 does not
        config = Qwen3MoeConfig(**sizes, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=2)
        assert moe.Routing(Qwen3MoeForCausalLM(config)).dtype == dtype
    torch.manual_seed(0)
    wide = Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes, num_experts=300, num_experts_per_tok=2, moe_intermediate_size=2))
    torch.nn.init.normal_(moe.routers(wide)[0][1].weight, std=0.5)
    wide.config._experts_implementation = "eager"
    routing = moe.Routing(wide)
    with routing.recording():
        wide(IDS)
    used = routing.take(len(IDS))[0]
    assert used.dtype == torch.int16 and used.max() > 255  # ids above 255 kept as they are


def test_a_replayed_routing_for_another_batch_is_refused():
    """A routing replayed into a forward of another shape (the micro-batch's rows or its trimmed width) is an error
    that says so, not experts taken from the wrong tokens."""
    model = small_moe("mixtral")
    routing = moe.Routing(model)
    with routing.recording():
        model(IDS)
    used = routing.take(len(IDS))[0]
    routing.replay(used[:, :-1])  # one position short
    with pytest.raises(ValueError, match=f"replayed routing of {3 * 10} tokens for a forward of {3 * 11}"):
        model(IDS)


def test_agreement_counts_sets_not_order():
    first = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]]]])  # [1, 2 tokens, 2 layers, k 2]
    second = torch.tensor([[[[1, 0], [2, 3]], [[0, 2], [3, 1]]]])
    result = moe.agreement(first, second, torch.ones(1, 2, dtype=torch.bool), [0, 1])
    assert result["same_set"].tolist() == [0.5, 0.5] and result["overlap"].tolist() == [0.75, 0.75]
    assert result["differs"].tolist() == [False, True]
    # three layers, three tokens (the second position not scored), k 2: each statistic per layer, per token
    first = torch.tensor([[[[0, 1], [2, 3], [4, 5]]] * 3])
    second = torch.tensor([[[[0, 1], [2, 6], [7, 6]], [[7, 6]] * 3, [[1, 0], [3, 2], [5, 6]]]])
    result = moe.agreement(first, second, torch.tensor([[True, False, True]]), [0, 1, 2])
    assert result["same_set"].tolist() == [1.0, 0.5, 0.0] and result["overlap"].tolist() == [1.0, 0.75, 0.25]
    assert result["differs"].tolist() == [True, True]


def test_the_engines_routing_lands_where_the_batch_holds_each_token():
    """batch_routing by hand: one prompt of 2 tokens beside one of 3 (left-padded), one completion each; the engine
    recorded the routing of every token it fed (the prompt and the response but its last token); the rest (padding,
    the last token) gets experts 0..k−1. scored_positions: the last prompt token and each response token but the
    last, where the response mask is set."""
    prompts = [[5, 6], [7, 8, 9]]
    completions = [
        Completion([10, 11], [-1.0, -1.0], "stop", routing=torch.full((3, 2, 2), 7, dtype=torch.uint8)),
        Completion([12], [-1.0], "stop", routing=torch.full((3, 2, 2), 9, dtype=torch.uint8)),
    ]
    batch = tim.make_batch(prompts, completions, 1, 0, CPU)  # [left-padded prompt 3 | response 2]
    routing = moe.batch_routing(prompts, completions, 1, batch)
    filler = torch.tensor([0, 1], dtype=torch.uint8)
    expected = filler.expand(2, 5, 2, 2).clone()
    expected[0, 1:4], expected[1, 0:3] = 7, 9
    assert routing.dtype == torch.uint8 and torch.equal(routing, expected)
    assert moe.scored_positions(batch).tolist() == [
        [False, False, True, True, False],
        [False, False, True, False, False],
    ]
    one = moe.batch_routing(prompts[:1], completions[:1], 1, tim.make_batch(prompts[:1], completions[:1], 1, 0, CPU))
    assert torch.equal(one, expected[:1, 1:])  # a batch of one completion


def test_routing_statistics_by_hand_and_a_micro_batch_without_scored_tokens_records_none():
    """Each routing statistic against its count by hand (three tokens, two layers, top 2), and a micro-batch whose
    completions are all empty: it scores no position, so its agreement and drift (0 / 0) are left out and the
    step's means are those of the micro-batches that scored tokens, not NaN."""
    engine = torch.tensor([[[[0, 1], [2, 3]]] * 3])  # [1, 3 tokens, 2 layers, k 2]
    used = torch.tensor([[[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[2, 3], [3, 2]]]])  # layer 0: 1 set of 3 the same
    own = torch.tensor([[[[0, 1], [0, 1]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]]])  # layer 1: 2 of 3
    scored, none = torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool)
    logged = {}
    for micro_batches in ([scored], [scored, none]):
        metrics = StepMetrics()
        for positions in micro_batches:
            moe.record_agreement(metrics, engine, used, own, positions, [0, 1])
            moe.record_drift(metrics, engine, used, positions, [0, 1])
        logged[len(micro_batches)] = metrics.reduce()
    assert logged[1] == pytest.approx(
        {
            "routing/agreement": (1 / 3 + 1) / 2,
            "routing/agreement_layer0": 1 / 3,
            "routing/agreement_layer1": 1.0,
            "routing/overlap": ((1 + 0.5 + 0) / 3 + 1) / 2,  # |A ∩ B| / k per token
            "routing/tokens_differing": 2 / 3,
            "routing/own_agreement": (1 + 2 / 3) / 2,
            "routing/drift": 1 - (1 / 3 + 1) / 2,  # π_old's routing `engine` here, π_θ's `used`
        }
    )
    assert logged[2] == logged[1]


def test_an_unknown_router_is_refused():
    class GptOssTopKRouter(torch.nn.Module):
        pass

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].router = GptOssTopKRouter()
    with pytest.raises(BadInput, match="GptOssTopKRouter"):
        moe.routers(model)


# --- the engine's routing, then replay in the trainer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_dir):
    from common.tiny import load

    return load(tiny_moe_dir)


def _rollout_batch(model, tokenizer, engine_dtype=None, n=3, prompts=3, top_k=0):
    engine = HFEngine(model, tokenizer, dtype=engine_dtype, share_weights=False, routing=True)
    questions = ["Q: 12+30=", "Q: 7+5=", "Q: 199+99="] + [f"Q: {a}+{3 * a + 7}=" for a in range(11, 20)]
    prompts = [tokenizer(q)["input_ids"] for q in questions[:prompts]]
    torch.manual_seed(0)
    completions = engine.generate(prompts, n, 8, 1.0, top_k=top_k)
    batch = tim.make_batch(prompts, completions, n, tokenizer.pad_token_id, torch.device("cpu"))
    return prompts, completions, batch


@pytest.mark.parametrize("top_k", [0, 5])
def test_engine_routing_then_r3_reproduces_the_engines_logprobs(tiny_moe, top_k):
    """The transformers engine (KV cache, one token per step, prompts left-padded together) records its routing; the
    trainer's full forward over the padded batch, replaying it, scores the sampled tokens as the engine did. With
    top-k the kept sets come back too (renormalised over in the trainer), and each completion's routing is still cut
    at its own prompt's padding, not at the widest kept set's."""
    model, tokenizer = tiny_moe
    prompts, completions, batch = _rollout_batch(model, tokenizer, top_k=top_k)
    assert all((completion.sampling_mask is not None) == (top_k > 0) for completion in completions)
    for index, completion in enumerate(completions):  # one row per fed token: the prompt, the completion but its last
        assert completion.routing.shape == (len(prompts[index // 3]) + len(completion.token_ids) - 1, 4, 2)
        assert completion.routing.untyped_storage().nbytes() == completion.routing.nbytes  # not a view of the chunk's
    batch["engine_routing"] = moe.batch_routing(prompts, completions, 3, batch)
    trainer = model.train()
    routing = moe.routing_of(trainer)
    routing.replay(batch["engine_routing"])
    with torch.no_grad():
        logprobs = tim.token_logprobs(trainer, batch, 1.0)[0]
    routing.replay(None)
    mask = batch["response_mask"].bool()
    # float32 both; the engine computes with a KV cache, one position at a time (1.7e-6 and 1.6e-5 measured on two
    # builds of the model, which differ by processor)
    assert (logprobs - batch["sampler_logprobs"])[mask].abs().max() <= 5e-5


def test_no_routing_recorded_gives_no_batch_routing():
    """A dense model's completions (or vLLM's on a CPU) carry no routing: the batch gets none, not an error."""
    prompts, completions = [[1, 3, 4]], [Completion([5, 2], [-1.0, -1.0], "stop"), Completion([6], [-1.0], "stop")]
    batch = tim.make_batch(prompts, completions, 2, 0, torch.device("cpu"))
    assert moe.batch_routing(prompts, completions, 2, batch) is None


def test_a_bfloat16_engine_routes_otherwise_and_r3_restores_it(tied_moe_dir):
    """bf16 engine, float32 trainer: some tokens go to other experts (agreement < 1); the trainer replaying the
    engine's routing uses exactly its experts (agreement 1), while its own routers would still choose otherwise.
    The routers are tied (helpers.tie_routers): bf16 flips a choice in 36% of the token-layers of 104 arithmetic
    lines (measured), where the built-in model's routers flip 0.6% of them: on some machines none of a small batch."""
    from common.tiny import load

    model, tokenizer = load(tied_moe_dir)
    prompts, completions, batch = _rollout_batch(model, tokenizer, torch.bfloat16, n=4, prompts=4)
    batch["engine_routing"] = moe.batch_routing(prompts, completions, 4, batch)
    positions = moe.scored_positions(batch)
    results = {}
    for replayed in (None, batch["engine_routing"]):
        routing = moe.routing_of(model)
        routing.replay(replayed)
        with torch.no_grad(), routing.recording():
            tim.token_logprobs(model, batch, 1.0)
        used, own = routing.take(len(batch["input_ids"]))
        routing.replay(None)
        layers = [layer for layer, _ in routing.routers]
        results[replayed is not None] = moe.agreement(batch["engine_routing"], used, positions, layers)[
            "same_set"
        ].mean()
        results["own"] = moe.agreement(batch["engine_routing"], own, positions, layers)["same_set"].mean()
    assert results[False] < 1 and results[True] == 1 and results["own"] < 1


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_a_queued_batch_is_scored_at_its_sampling_weights_routed_as_pi_old_is(tiny_moe, replay):
    """--rollout-lag's log π_s (tis_icepop.sampling_weights_logprobs through the queue): under r3 with the engine's
    routing replayed, as log π_old is, so the split's engine part holds no routing difference r3 removes; otherwise
    the trainer's own routing. The engine's routing is made unlike the trainer's (every token to other experts)."""
    model, tokenizer = tiny_moe
    prompts, completions, _ = _rollout_batch(model, tokenizer)
    for completion in completions:
        completion.routing = other_experts(completion.routing, 4)
    groups = Groups(prompts, [None] * 3, completions, [None] * 9, torch.zeros(3, 3), [True] * 9)
    queue = RolloutQueue(flags.Systems(rollout_lag=1), one_process(), tokenizer.pad_token_id)
    queue.put(1, groups)
    args = flags.make(tim.Args, router_replay=replay, micro_batch_size=2)
    queue.score_under_sampling_weights(tim.sampling_weights_logprobs, model, args, torch.autocast("cpu", enabled=False))
    batch = tim.make_batch(prompts, completions, 3, tokenizer.pad_token_id, torch.device("cpu"))
    routing = moe.routing_of(model)
    routing.replay(moe.batch_routing(prompts, completions, 3, batch))
    with torch.no_grad():
        replayed = tim.token_logprobs(model, batch, 1.0)[0]
    routing.replay(None)
    with torch.no_grad():
        own = tim.token_logprobs(model, batch, 1.0)[0]
    mask = batch["response_mask"].bool()
    scored = batch["sampling_weights_logprobs"][mask]
    expected, other = (replayed, own) if replay == "r3" else (own, replayed)
    torch.testing.assert_close(scored, expected[mask], rtol=1e-5, atol=1e-5)
    assert (scored - other[mask]).abs().max() > 1e-2  # the routing matters


# --- tis_icepop.py --router-replay -----------------------------------------------------------------------------------

# 8 prompts: one step of a script moves the routers and experts unless its 8 groups all had equal rewards, on 0.29^8
# < 1e-4 of machines (helpers.py, reward signal; with 4 prompts on 0.7% of them)
TINY_MOE = ["--model", "tiny-moe", "--steps", 2, "--prompts-per-step", 8, "--group-size", 4, "--eval-every", 0]


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_router_replay_with_a_bfloat16_engine(tmp_path, tied_moe_dir, replay):
    """The done-when command of the feature: R3 logs routing agreement 1, no replay below 1; R2 (two minibatches)
    records π_old's routing and logs the drift of π_θ's routers.

    The model is tiny-moe with tied routers (helpers.tie_routers), so that the bf16 engine routes otherwise than the
    float32 trainer in every step: the built-in model's routers flip 0.6% of the token-layers, none at all in the
    2 × 16 short completions the test used to sample on some machines. Over run seeds 1-3 here: own agreement
    0.35-0.43 and 0.62-0.77 in steps 1 and 2, 57-100% of the tokens differing without R3, drift 0.03-0.31. The
    learning rate is 1e-5, not 1e-3: a step at 1e-3 moves a router row element (about 0.02) by about 5%, undoing the
    bf16 ties by step 2 (own agreement 1 again, measured)."""
    # π_θ's routers drift only once an update has moved it, which needs a reward spread in a group before the last
    # update: 6 prompts in 2 minibatches put 9 groups there, all equal on 0.29^9 < 1e-4 of machines (helpers.py,
    # reward signal; 4 prompts put 6 there: 6e-4)
    flags = ["--model", tied_moe_dir, "--steps", 2, "--prompts-per-step", 6, *TINY_MOE[6:]]
    flags += ["--engine-dtype", "bfloat16", "--router-replay", replay]
    run_script("algorithms/tis_icepop.py", *flags, "--num-minibatches", 2, "--lr", 1e-5, "--output-dir", tmp_path)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for record in records:
        assert 0 < record["routing/own_agreement"] < 1  # the trainer's routers disagree with bf16's, R3 or not
        assert (record["routing/agreement"] == 1) == (replay == "r3") == (record["routing/tokens_differing"] == 0)
        assert 0 <= record["routing/drift"] <= 1
    assert any(record["routing/drift"] > 0 for record in records)  # π_θ's routers move within a batch


@pytest.mark.slow
def test_resume_with_r3_continues_exactly(tmp_path):
    """4 steps straight = 2 steps, then --resume for 2 more: the same rewards, losses and routing statistics."""
    flags = [*TINY_MOE[:2], *TINY_MOE[4:], "--router-replay", "r3", "--engine-dtype", "bfloat16", "--save-every", 2]
    flags += ["--num-minibatches", 2]
    run_script("algorithms/tis_icepop.py", *flags, "--steps", 4, "--output-dir", tmp_path / "straight")
    run_script("algorithms/tis_icepop.py", *flags, "--steps", 2, "--output-dir", tmp_path / "split")
    run_script("algorithms/tis_icepop.py", *flags, "--steps", 4, "--output-dir", tmp_path / "split", "--resume", "auto")
    straight, split = (
        read_jsonl(os.path.join(only_run_dir(tmp_path / n), "metrics.jsonl")) for n in ("straight", "split")
    )
    assert [r["step"] for r in straight] == [r["step"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(straight, split, strict=True):
        for key in (
            "charts/reward",
            "losses/policy_loss",
            "losses/grad_norm",
            "routing/own_agreement",
            "routing/drift",
        ):
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_script_trains_a_mixture_of_experts_model(name, tmp_path, tiny_moe_dir):
    """One step of each script on the tiny MoE moves its experts and routers; ISOPO refuses it, saying why."""
    flags = ["--output-dir", tmp_path, "--model", "tiny-moe", "--steps", 1, *TINY_MOE[4:]]
    if name == "isopo":
        result = run_script(f"algorithms/{name}.py", *flags, check=False)
        assert result.returncode == 2 and "mixture-of-experts models are not supported" in result.stderr
        return
    run_script(f"algorithms/{name}.py", *flags)
    from transformers import AutoModelForCausalLM

    checkpoint = os.path.join(only_run_dir(tmp_path), "checkpoints", "step_00000001")
    trained, initial = (AutoModelForCausalLM.from_pretrained(path) for path in (checkpoint, tiny_moe_dir))
    for parameter in ("model.layers.0.mlp.gate.weight", "model.layers.3.mlp.experts.down_proj"):
        assert not torch.equal(trained.get_parameter(parameter), initial.get_parameter(parameter)), parameter


HASHED_REWARD_TASK = """import zlib


def rows(split):
    return [{"question": f"Q: {a}+{b}="} for a in range(40) for b in range(40)]


def score(completion, row):
    return zlib.crc32(completion.encode()) % 1000 / 1000
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "olmoe"])
def test_qwen3_moe_and_olmoe_checkpoints_train_with_replay(kind, tmp_path, tiny):
    """A random Qwen3-MoE / OLMoE checkpoint with the built-in tokenizer: tis_icepop.py replays a bf16 engine's
    routing in it (agreement 1) and the routers and experts train."""
    from transformers import AutoModelForCausalLM

    model = small_moe(kind)
    model.config.vocab_size = len(tiny[1])
    model.resize_token_embeddings(len(tiny[1]))
    model.save_pretrained(tmp_path / "model")
    tiny[1].save_pretrained(tmp_path / "model")
    flags = ["--model", tmp_path / "model", "--steps", 1, *TINY_MOE[4:], "--output-dir", tmp_path / "runs"]
    # a random model answers nothing and runs to the length limit in about 94% of its completions, so DAPO's length
    # penalty left every group without a reward spread on about a third of machines; a reward that hashes the text
    # differs between the distinct completions of a group, so the routers get gradients on every machine
    (tmp_path / "hashed.py").write_text(HASHED_REWARD_TASK)
    flags += ["--task", tmp_path / "hashed.py"]
    run_script("algorithms/tis_icepop.py", *flags, "--router-replay", "r3", "--engine-dtype", "bfloat16")
    assert read_jsonl(os.path.join(only_run_dir(tmp_path / "runs"), "metrics.jsonl"))[-1]["routing/agreement"] == 1
    trained = AutoModelForCausalLM.from_pretrained(
        os.path.join(only_run_dir(tmp_path / "runs"), "checkpoints", "step_00000001")
    )
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    for name, parameter in initial.named_parameters():
        if "gate.weight" in name or "experts" in name:
            assert not torch.equal(trained.get_parameter(name), parameter), name


def test_router_replay_refusals(tiny, tiny_moe):
    with pytest.raises(BadInput, match="--router-replay r2 must be used with several updates"):
        tim.check_args(flags.make(tim.Args, router_replay="r2"))  # one update per batch: nothing to replay
    tim.check_args(flags.make(tim.Args, router_replay="r2", num_minibatches=2))
    with pytest.raises(BadInput, match="not a mixture-of-experts model"):
        moe.engine_records_routing(tiny[0], "r3", "hf", "tiny")
    assert not moe.engine_records_routing(tiny[0], "none", "hf", "tiny")  # a dense model: no routing to record
    model = tiny_moe[0]
    assert moe.engine_records_routing(model, "none", "hf", "tiny-moe")  # the hf engine records for routing/*
    # vLLM on a CPU cannot record: the routing/* metrics are left out, and r3 asks for it (refused by the engine)
    assert moe.engine_records_routing(model, "none", "vllm", "tiny-moe") == torch.cuda.is_available()
    assert moe.engine_records_routing(model, "r3", "vllm", "tiny-moe")


@pytest.mark.slow
def test_r3_on_two_ranks_updates_exactly_like_one(tmp_path):
    """The tiny MoE model replaying an engine routing under FSDP2 on 2 gloo ranks: the same statistics and weights as
    one process (the routers replay inside FSDP2's unsharded layers; each rank holds its own rows' routing)."""
    settings = '{"model": "tiny-moe", "router_replay": "r3", "lr": 0.05}'  # the whole batch, twice
    # two SGD steps at lr 0.05 of a 20M-parameter model: float32 sums in another order differ by 2e-6 (measured); at
    # lr 0.5 (approx_kl 3.6) 1 and 2 ranks moved 1e-4 apart on some processors
    logged = assert_two_ranks_update_like_one(tmp_path, "tis_icepop", settings, weight_atol=1e-5)
    # the routing replayed is the engine's (synthetic, unlike the routers' own choice): equal results without a replay
    # on either side would pass the comparison above
    assert logged["routing/agreement"] == 1 and logged["routing/tokens_differing"] == 0
    assert logged["routing/own_agreement"] < 1 and logged["routing/drift"] >= 0
