"""The built-in tiny model: builds offline, reloads through the Auto classes, leaves RL room to learn."""

import json
import os
import shutil

import pytest
import torch

from common import tiny as tiny_module


def test_reloads_offline_through_auto_classes(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 4
    assert model.config.hidden_size == 256 and 3e6 < sum(p.numel() for p in model.parameters()) < 3.5e6
    assert tokenizer.padding_side == "left"


def test_character_tokenizer_round_trip(tiny):
    _, tokenizer = tiny
    text = "Q: 23+58= answer is \\boxed{81}."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # spaces survive
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}) == 4
    batch = tokenizer(["Q: 1+1=", "Q: 10+10="], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2  # left padding for generation


def test_warm_start_leaves_room_for_rl(tiny_dir):
    with open(os.path.join(tiny_dir, "build_info.json")) as f:
        info = json.load(f)
    assert info["version"] == tiny_module.VERSION
    # The build stops within TOLERANCE above its target of 0.35 (a check past that goes back and checks every step;
    # one step more than TOLERANCE past would take a sample four standard deviations off). Builds of seeds 0, 1, 2
    # here: 0.36, see issue notes; the v1 rule left 0.23 to 0.48 across processors.
    target = tiny_module.WARM_STARTS["arith"].target_accuracy
    assert target <= info["train_sampled_accuracy"] <= target + 2 * tiny_module.TOLERANCE, info
    # held out: 0.39 for the build of seed 0; 256 samples of one model spread ±0.02 over sampling seeds
    assert 0.25 <= info["test_sampled_accuracy"] <= 0.55, info


@pytest.mark.slow
def test_a_check_past_the_target_goes_back_and_lands_on_it(tmp_path, monkeypatch):
    """A warm start whose accuracy climbs 4 points a step past its first check: the check at step 75 is past
    target + TOLERANCE, so the build returns to step 50's state and checks every step, stopping at the first on
    target (step 60). The model equals one trained straight to step 60: going back replays the same batches."""
    from safetensors.torch import load_file

    optimizers = []

    class RecordedAdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            optimizers.append(self)

    def accuracy_at_this_step(model, *args, **kwargs):  # 0.1 at step 50, +0.01 a step: 0.2 at 60, 0.35 at 75
        state = optimizers[-1].state[optimizers[-1].param_groups[0]["params"][0]]
        return max(0.0, 0.01 * (int(state["step"]) - 40))

    monkeypatch.setattr(torch.optim, "AdamW", RecordedAdamW)
    monkeypatch.setattr(tiny_module, "sampled_accuracy", accuracy_at_this_step)
    for first_check, path in ((50, tmp_path / "went_back"), (60, tmp_path / "straight")):
        spec = tiny_module.WarmStart("v", "UNUSED", 0.2, 8, first_check, 200, 1e-3)
        monkeypatch.setattr(tiny_module, "warm_start", lambda task, moe=False, spec=spec: spec)
        tiny_module.build(str(path), "arith", batch_size=4)
    info = json.load(open(tmp_path / "went_back" / "build_info.json"))
    assert info["warm_start_steps"] == 60 and info["went_back_from"] == 75, info
    assert [step for step, _ in info["checks"]] == [50, 75, *range(51, 61)] and info["train_sampled_accuracy"] == 0.2
    went_back, straight = (load_file(tmp_path / name / "model.safetensors") for name in ("went_back", "straight"))
    assert all(torch.equal(went_back[key], straight[key]) for key in straight)


def test_warm_start_accuracy_is_what_build_info_says(tiny):
    model, tokenizer = tiny
    from common.tasks import arith_rows

    torch.manual_seed(0)
    accuracy = tiny_module.sampled_accuracy(model, tokenizer, arith_rows("test")[:256])
    assert 0.25 <= accuracy <= 0.55  # the same policy re-sampled (0.39 at build): 5 seeds of one within ±0.02


def test_sums_warm_start_leaves_room_for_rl(tiny_sums_dir, tiny_dir):
    """The reasoning task's model: sampled accuracy about 15-35%, re-measured here on 256
    held-out prompts, with completions that follow the scratchpad format whether right or wrong."""
    from common.scoring import extract_answer
    from common.tasks import load_task

    with open(os.path.join(tiny_sums_dir, "build_info.json")) as f:
        info = json.load(f)
    assert info["version"] == tiny_module.WARM_STARTS["sums"].version and info["task"] == "sums"
    target = tiny_module.WARM_STARTS["sums"].target_accuracy  # stops within TOLERANCE of it (0.26 here)
    assert target <= info["train_sampled_accuracy"] <= target + 2 * tiny_module.TOLERANCE, info
    # the build stops at 25% on 256 training prompts (two builds: 34% held out on both); 256 held-out samples of one
    # model spread 0.29-0.35 over 5 sampling seeds, so 0.40 was two spreads from a build seen, 0.45 is four
    assert 0.15 <= info["test_sampled_accuracy"] <= 0.45, info
    model, tokenizer = tiny_module.load(tiny_sums_dir)
    rows = load_task("sums", "test")[:256]
    torch.manual_seed(0)
    assert 0.10 <= tiny_module.sampled_accuracy(model, tokenizer, rows, "sums", 48) <= 0.45  # up to sampling noise
    prompt = tokenizer(rows[0].question, return_tensors="pt")
    completion = model.generate(**prompt, do_sample=False, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(completion[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.count("=") == rows[0].question.count("+") and extract_answer(text) is not None, text
    assert tiny_module.resolve_model("tiny", "sums") == tiny_sums_dir
    assert tiny_module.resolve_model("tiny", "gsm8k") == tiny_module.resolve_model("tiny") == tiny_dir


def test_unreadable_cache_is_detected(tiny_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert tiny_module._is_valid(str(copy))
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated download / disk error
    assert not tiny_module._is_valid(str(copy))
    assert not tiny_module._is_valid(str(tmp_path / "missing"))


def test_rebuilds_when_missing(tmp_path, monkeypatch, request):
    """tiny_model_dir() builds into an empty location (the build itself is stubbed for speed here;
    the real build runs once per session through the `tiny_dir` fixture), with BUILD_THREADS threads whatever the
    caller's (a float sum's order follows them: a test worker's one thread built another model than run.sh's)."""
    built, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as in a test worker; 8 on a larger machine did the same
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    def fake_build(path, task, moe=False):
        assert torch.get_num_threads() == tiny_module.BUILD_THREADS == 2
        built.append(path)
        os.makedirs(path)
        with open(os.path.join(path, "build_info.json"), "w") as f:
            json.dump({"version": tiny_module.VERSION}, f)

    monkeypatch.setenv("TINY_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setattr(tiny_module, "build", fake_build)
    monkeypatch.setattr(tiny_module, "load", lambda path: None)
    assert tiny_module.tiny_model_dir() == str(tmp_path / "model") and built == [str(tmp_path / "model")]
    assert tiny_module.tiny_model_dir() == str(tmp_path / "model") and len(built) == 1  # cached now
    assert torch.get_num_threads() == 1  # the caller's again
    # a trailing slash (TINY_MODEL_DIR=/x/model/) names the same folder: the lock and the build's temporary folder
    # beside it, not inside it
    monkeypatch.setenv("TINY_MODEL_DIR", str(tmp_path / "model") + "/")
    assert tiny_module.cache_dir() == str(tmp_path / "model")


def test_model_folder_without_a_model_gets_a_clear_error(tmp_path):
    import pytest

    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"holds no model \(no config.json\).*Hugging Face model id"):
        tiny_module.resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="no such model folder"):
        tiny_module.resolve_model(str(tmp_path / "missing"))
    assert tiny_module.resolve_model("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"  # a hub id: unchanged
    (tmp_path / "config.json").write_text("{}")
    assert tiny_module.resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_script_given_an_empty_folder_says_so(tmp_path):
    from helpers import run_script

    result = run_script("algorithms/grpo.py", "--model", tmp_path, "--steps", 1, check=False)
    assert result.returncode != 0
    assert "holds no model (no config.json)" in result.stderr and "sentencepiece" not in result.stderr


def test_upcycling_without_noise_computes_what_the_dense_model_does(tiny):
    """Every expert a copy of the layer's MLP: whatever the router picks, the two active experts' weights sum to 1,
    so the MoE's logits are the dense model's (float32 rounding apart); with the build's noise they are not."""
    dense, tokenizer = tiny
    ids = torch.tensor([tokenizer("Q: 37+48+91=37+48=85,85+91=176 #### 176")["input_ids"]])
    with torch.no_grad():
        exact = tiny_module.upcycle(dense, noise=0.0).eval()(ids).logits
        noisy = tiny_module.upcycle(dense).eval()(ids).logits
        reference = dense(ids).logits
    assert (exact - reference).abs().max() < 1e-4 < (noisy - reference).abs().max()


def test_the_moe_model_is_built_offline_and_leaves_room_for_rl(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    with open(os.path.join(tiny_moe_dir, "build_info.json")) as f:
        info = json.load(f)
    assert info["version"] == tiny_module.MOE_WARM_STARTS["arith"].version and info["experts"] == 8
    # at least 50 steps (the routers learn), then on to its target of 0.70: here 0.71 at step 50, held out 0.70
    # (the v1 rule stopped other builds at 0.49); a first check further past the target stops there
    assert info["train_sampled_accuracy"] >= tiny_module.MOE_WARM_STARTS["arith"].target_accuracy, info
    assert 0.55 <= info["test_sampled_accuracy"] <= 0.95, info
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert model.config.model_type == "mixtral" and not model.config.output_router_logits
    assert model.config.hidden_size == 256 and 19e6 < sum(p.numel() for p in model.parameters()) < 20e6
    assert tiny_module.resolve_model("tiny-moe") == tiny_moe_dir
