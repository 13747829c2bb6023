"""common.memory, the per-GPU estimate: its parts against exact counts, and its total against the peak memory of a
real training step measured on the CPU (a script run as users run it)."""

import dataclasses

import pytest
import torch
from helpers import peak_rss_of

from common import memory


def _llama_config(hidden, intermediate, layers, vocab, heads=8, kv_heads=2, context=1024):
    from transformers import LlamaConfig

    from common.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ), tokenizer


def test_parameter_counts_are_the_models(tiny):
    """Counted on the meta device: the same numbers as the built model (tied output layer counted once)."""
    model, _ = tiny
    counts = memory.parameter_counts(model.config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["layer"] == sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts["root"] + counts["layers"] * counts["layer"] == counts["total"]


def test_lora_parameters_are_the_adapters_peft_makes(tiny_dir):
    """The estimate's adapter count at rank 8 (r × (in + out) per Linear of the decoder layers) against the trainable
    parameters of the model the scripts build with --lora-rank 8."""
    from helpers import adapted_tiny

    policy = adapted_tiny(tiny_dir, rank=8)
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert (
        memory.lora_parameters(memory.load_config("tiny"), 8) == trained == 4 * 8 * (512 + 384 + 384 + 512 + 3 * 1024)
    )


def test_activations_grow_with_the_width_and_shrink_in_bf16():
    """Saved bytes per token per layer: more for a wider layer, about half in bf16 with a bf16 residual stream
    (float32 under autocast keeps the residual stream, norms and softmax inputs in float32)."""
    narrow, _ = _llama_config(256, 688, 1, 64)
    wide, _ = _llama_config(512, 1376, 1, 64)
    fp32 = [memory.activation_bytes_per_token(c, torch.float32, torch.float32) for c in (narrow, wide)]
    assert 1.8 < fp32[1] / fp32[0] < 2.2  # every saved tensor is a multiple of the widths
    bf16 = memory.activation_bytes_per_token(wide, torch.bfloat16, torch.bfloat16)
    assert 0.4 < bf16 / fp32[1] < 0.6
    autocast = memory.activation_bytes_per_token(wide, torch.bfloat16, torch.float32)
    assert bf16 < autocast < fp32[1]


def test_the_estimate_names_the_flags_that_would_make_a_plan_fit():
    """A 1.5B model at 4,096 tokens on one GPU without checkpointing does not fit; the advice starts with
    --gradient-checkpointing, and with it and --vllm-sleep-mode the plan fits."""
    config, _ = _llama_config(1536, 8960, 28, 151936, heads=12)
    plan = memory.Plan(model="1.5B", max_new_tokens=4096, micro_batch_size=8, prompts_per_step=64)
    result = memory.estimate(plan, config, per_token=116 * 1024)
    assert result["peak_bytes"] > 80 * memory.GiB and memory.advice(plan, result)[0].startswith(
        "--gradient-checkpointing"
    )
    assert "does NOT fit" in memory.report(plan, result)
    plan.gradient_checkpointing = plan.vllm_sleep_mode = True
    assert "fits in 80 GiB" in memory.report(plan, memory.estimate(plan, config, per_token=116 * 1024))


def test_a_config_whose_head_dim_is_null_is_estimated(tiny_moe_dir):
    """Mixtral's config (and the built-in MoE model's) says "head_dim": null: the transformers engine's KV cache takes
    hidden / heads per head, as the model does (getattr's default does not apply to an attribute set to None)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_moe_dir)
    assert config.head_dim is None
    plan = memory.Plan(model=tiny_moe_dir, device="cpu", rollout_engine="hf")
    assert memory.estimate(plan, config, per_token=1024)["peak_bytes"] > 0


def test_the_rollout_queue_is_counted_in_host_memory_at_its_measured_bytes_per_token():
    """--rollout-lag 2 queues 2 batches of a rank's rollouts: host memory beside a GPU's peak, part of a CPU
    process's; QUEUED_TOKEN_BYTES is what queued completions (ids, μ, π_s as the scripts hold them) take."""
    import dataclasses
    import tracemalloc

    from common.engines import Completion

    tracemalloc.start()
    queued = [
        Completion(torch.randint(0, 32000, (256,)).tolist(), torch.randn(256).tolist(), "stop") for _ in range(64)
    ]
    for completion in queued:
        completion.trainer_logprobs = torch.randn(256).tolist()
    measured = tracemalloc.get_traced_memory()[0] / (64 * 256)
    tracemalloc.stop()
    assert measured == pytest.approx(memory.QUEUED_TOKEN_BYTES, rel=0.2)
    config, _ = _llama_config(1536, 8960, 28, 151936, heads=12)
    plan = memory.Plan(model="1.5B", gpus=2, max_new_tokens=1024, prompts_per_step=64, group_size=8, rollout_lag=2)
    on_gpu = memory.estimate(plan, config, per_token=116 * 1024)
    queue = 2 * (64 // 2) * 8 * 1024 * memory.QUEUED_TOKEN_BYTES
    assert on_gpu["host"] == {"rollout queue (--rollout-lag)": queue} and "rollout queue" in memory.report(plan, on_gpu)
    on_policy = dataclasses.replace(plan, rollout_lag=0)  # the GPU's peak is the same
    assert on_gpu["peak_bytes"] == memory.estimate(on_policy, config, per_token=116 * 1024)["peak_bytes"]
    plan.device = "cpu"
    assert memory.estimate(plan, config, per_token=116 * 1024)["parts"]["rollout queue (--rollout-lag)"] == queue


def test_sampling_beside_the_update_adds_the_engines_copy_and_generation_to_it():
    """--overlap-rollouts: the hf engine samples on its own copy of the weights during the update and the optimizer
    step, so both hold that copy, its KV cache and its logits too, and an output-layer chunk of the pass that scores
    its batch; vLLM is awake throughout either way (its share holds its KV cache; it scores nothing), so its plan's
    peak does not change. Overlap needs a lag, and vLLM awake."""
    config, _ = _llama_config(1536, 8960, 28, 151936, heads=12)
    plan = memory.Plan(model="1.5B", max_new_tokens=1024, micro_batch_size=8, prompts_per_step=64, rollout_lag=1)
    for engine in ("hf", "vllm"):
        synchronous = memory.estimate(dataclasses.replace(plan, rollout_engine=engine), config, per_token=116 * 1024)
        overlapped = dataclasses.replace(plan, rollout_engine=engine, overlap_rollouts=True)
        result = memory.estimate(overlapped, config, per_token=116 * 1024)
        added = {k: v for k, v in result["parts"].items() if v != synchronous["parts"].get(k)}
        if engine == "vllm":
            assert added == {} and result["phases"] == synchronous["phases"]
            continue
        scoring = memory.CHUNK_BYTES  # the batch scored under the sampling weights: one output-layer chunk
        copy, generating = 4 * result["parameters"], sum(synchronous["generation"].values()) + scoring
        assert added == {"engine during the update": copy, "engine generating beside the update": generating}
        for phase in ("update", "optimizer step"):
            assert result["phases"][phase] == synchronous["phases"][phase] + copy + generating, phase
        assert any(tip.startswith("no --overlap-rollouts") for tip in memory.advice(overlapped, result))
    assert memory.plan_problems(dataclasses.replace(plan, rollout_lag=0, overlap_rollouts=True)) == [
        "--overlap-rollouts applies with --rollout-lag >= 1 only"
    ]
    asleep = dataclasses.replace(plan, overlap_rollouts=True, vllm_sleep_mode=True)
    assert memory.plan_problems(asleep) == [
        "--overlap-rollouts must be off with --vllm-sleep-mode (the engine samples during the update)"
    ]


def test_an_engine_on_a_gpu_of_its_own_is_counted_apart():
    """--engine-process: vLLM's share leaves the trainer's GPU in every phase (the colocated plan minus that share,
    or, in generation, where the trainer holds no engine either way, unchanged) and is that of the engine's own GPU:
    its weights in the engine's dtype (bf16 by default on a GPU: 2 bytes a parameter) and the rest of its share. A
    share its weights nearly fill is pointed out; a CPU or sleep mode is refused."""
    config, _ = _llama_config(1536, 8960, 28, 151936, heads=12)
    plan = memory.Plan(model="1.5B", max_new_tokens=1024, micro_batch_size=8, rollout_lag=1, overlap_rollouts=True)
    colocated = memory.estimate(plan, config, per_token=116 * 1024)
    own = dataclasses.replace(plan, engine_process=True, gpu_memory_utilization=0.9)
    result = memory.estimate(own, config, per_token=116 * 1024)
    share = 0.3 * 80 * memory.GiB
    for phase in ("start-up", "update", "optimizer step"):
        assert result["phases"][phase] == pytest.approx(colocated["phases"][phase] - share), phase
    assert result["phases"]["generation"] == pytest.approx(colocated["phases"]["generation"] - share)
    assert result["parts"]["engine during the update"] == 0 and result["generation"] == {}
    weights = 2 * result["parameters"]
    assert result["engine_gpu"] == {
        "vllm weights": weights,
        "vllm KV cache, activations, context": pytest.approx(0.9 * 80 * memory.GiB - weights),
    }
    assert "engine GPU (--engine-process, one per rank): vLLM's 0.9 of it" in memory.report(own, result)
    tight = dataclasses.replace(own, gpu_memory_utilization=0.039)  # 3.1 GiB, 2.9 of them weights
    assert "raise --gpu-memory-utilization" in memory.report(tight, memory.estimate(tight, config, per_token=1))
    assert memory.plan_problems(dataclasses.replace(own, device="cpu")) == [
        "--engine-process applies to --rollout-engine vllm on --device cuda only (a GPU of its own)"
    ]
    assert memory.plan_problems(dataclasses.replace(own, overlap_rollouts=False, vllm_sleep_mode=True)) == [
        "--engine-process must be off with --vllm-sleep-mode (the engine's GPU is its own)"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["plain", "checkpointed", "overlapped"])
def test_the_estimate_is_within_20_percent_of_a_measured_step(tmp_path, setting):
    """grpo.py, two steps (AdamW's state exists in the second), on a model of 2 layers of width 768 and a 16,000-token
    vocabulary whose responses are all 512 tokens (random weights almost never sample EOS): the peak RSS of the
    process against the estimate of the same settings on the CPU. Overlapped (--rollout-lag 1 --overlap-rollouts),
    three steps: the second's update, with AdamW's state, runs beside the third batch's sampling on the engine's own
    copy of the weights."""
    checkpointing = setting == "checkpointed"
    config, tokenizer = _llama_config(768, 3072, 2, 16000, heads=12)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    flags = [
        "--model",
        tmp_path / "model",
        "--steps",
        3 if setting == "overlapped" else 2,
        "--prompts-per-step",
        1,
        "--group-size",
        4,
        "--max-new-tokens",
        512,
        "--max-prompt-tokens",
        16,
        "--eval-every",
        0,
        "--output-dir",
        tmp_path / "runs",
        *(["--gradient-checkpointing"] if checkpointing else []),
        *(["--rollout-lag", 1, "--overlap-rollouts"] if setting == "overlapped" else []),
    ]
    measured = peak_rss_of("algorithms/grpo.py", *flags)
    plan = memory.Plan(
        model="test",
        device="cpu",
        gradient_checkpointing=checkpointing,
        max_prompt_tokens=16,
        max_new_tokens=512,
        prompts_per_step=1,
        group_size=4,
        rollout_engine="hf",
        rollout_lag=int(setting == "overlapped"),
        overlap_rollouts=setting == "overlapped",
    )
    estimated = memory.estimate(plan, config)["peak_bytes"]
    print(f"estimated {estimated / 1e9:.2f} GB, measured {measured / 1e9:.2f} GB")
    assert 0.8 < estimated / measured < 1.2, (estimated / 1e9, measured / 1e9)


@pytest.mark.slow
def test_lora_leaves_out_the_gradients_and_optimizer_state_of_the_frozen_weights(tmp_path):
    """grpo.py, two steps (AdamW's state exists in the second), 2 layers of width 768 and a 16,000-token vocabulary
    (31 M parameters), 64-token responses: the peak RSS with --lora-rank 16 against full fine-tuning. Full
    fine-tuning holds a float32 gradient and AdamW's two moments for every weight (12 bytes each, 0.37 GB here);
    LoRA holds them for its adapters alone (0.1% of the parameters here)."""
    config, tokenizer = _llama_config(768, 3072, 2, 16000, heads=12)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    flags = ["--model", tmp_path / "model", "--steps", 2, "--prompts-per-step", 1, "--group-size", 4]
    flags += ["--max-new-tokens", 64, "--max-prompt-tokens", 16, "--eval-every", 0]
    full = peak_rss_of("algorithms/grpo.py", *flags, "--output-dir", tmp_path / "full")
    lora = peak_rss_of("algorithms/grpo.py", *flags, "--output-dir", tmp_path / "lora", "--lora-rank", 16)
    print(f"full fine-tuning {full / 1e9:.2f} GB, LoRA {lora / 1e9:.2f} GB, {parameters / 1e6:.1f} M parameters")
    assert full - lora > 0.75 * 12 * parameters, (full / 1e9, lora / 1e9)


def _llama_8b():
    """Llama-3.1-8B's shape (8.03 B parameters), counted on the meta device."""
    config, _ = _llama_config(4096, 14336, 32, 128256, heads=32, kv_heads=8)
    config.tie_word_embeddings = False
    return config, memory.parameter_counts(config)


def test_start_up_holds_a_shard_of_the_weights_beside_an_awake_engine():
    """Start-up: vLLM is awake and the float32 weights reach the GPU. One GPU holds all of them; eight hold their
    shard and one unit in flight (the scripts shard a model still in CPU memory), so gtpo.py's 8B command at
    --gpu-memory-utilization 0.6 fits (the whole float32 model beside vLLM's 48 GiB would have been 79 GiB)."""
    config, counts = _llama_8b()
    awake, context = 0.6 * 80 * memory.GiB, memory.CUDA_CONTEXT
    one = memory.Plan(model="8B", gpu_memory_utilization=0.6, vllm_sleep_mode=True, gradient_checkpointing=True)
    result = memory.estimate(one, config, per_token=100 * 1024)
    assert result["phases"]["start-up"] == pytest.approx(4 * counts["total"] + awake + context)
    eight = memory.Plan(**{**one.__dict__, "gpus": 8, "micro_batch_size": 4, "max_new_tokens": 1024})
    result = memory.estimate(eight, config, per_token=100 * 1024)
    in_flight = 4 * max(counts["root"], counts["layer"])
    assert result["phases"]["start-up"] == pytest.approx(4 * counts["total"] / 8 + in_flight + awake + context)
    assert result["phases"]["start-up"] < 60 * memory.GiB and "fits in 80 GiB" in memory.report(eight, result)
    # --kl-coef: π_ref's shard is on the GPU all run, in every phase (generation and the optimizer step left it out);
    # a bf16 LoRA run's reference is its frozen base's dtype (fsdp.load_reference), 2 bytes a weight
    for lora_rank, reference_bytes in ((0, 4), (16, 2)):
        plan = memory.Plan(**{**eight.__dict__, "lora_rank": lora_rank})
        without, with_reference = (
            memory.estimate(dataclasses.replace(plan, kl_coef=kl), config, per_token=100 * 1024)["phases"]
            for kl in (0.0, 0.1)
        )
        for phase in without:
            added = with_reference[phase] - without[phase]
            assert added == pytest.approx(reference_bytes * counts["total"] / 8), (lora_rank, phase)


def test_float16_ranks_count_autocasts_casts_and_the_float32_head_its_root_and_copies():
    """FSDP2 in float16 gathers float32 weights, which autocast casts and autograd keeps: 2 bytes per weight of
    every layer (one layer with checkpointing). --fp32-lm-head gathers the root in float32 under bf16 ranks (2 more
    bytes per root parameter) and upcasts a frozen bf16 output layer per chunk (4 × vocabulary × width)."""
    config, counts = _llama_8b()
    fp16 = memory.Plan(model="8B", gpus=8, dtype="float16")
    parts = memory.estimate(fp16, config, per_token=1)["parts"]
    assert parts["weight casts for the backward"] == 2 * (counts["root"] + 32 * counts["layer"])
    fp16.gradient_checkpointing = True
    parts = memory.estimate(fp16, config, per_token=1)["parts"]
    assert parts["weight casts for the backward"] == 2 * (counts["root"] + counts["layer"])
    bf16 = memory.Plan(model="8B", gpus=8)
    plain, head = (
        memory.estimate(memory.Plan(**{**bf16.__dict__, "fp32_lm_head": f}), config, per_token=1)["parts"]
        for f in (False, True)
    )
    assert "weight casts for the backward" not in plain  # bf16 ranks gather bf16 weights: nothing to cast
    assert head["gathered weights"] - plain["gathered weights"] == 2 * counts["root"]
    lora = memory.Plan(model="8B", lora_rank=16)
    plain, head = (
        memory.estimate(memory.Plan(**{**lora.__dict__, "fp32_lm_head": f}), config, per_token=1)["parts"]
        for f in (False, True)
    )
    assert head["output layer (chunks)"] - plain["output layer (chunks)"] == 4 * 128256 * 4096
