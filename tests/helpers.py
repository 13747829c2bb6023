"""What the tests share: runners for the scripts (one process or torchrun), the rollouts the brute-force
tests use, the metrics every script logs, and assertions on checkpoints and run folders."""

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
# every script of algorithms/, grpo.py (the baseline) first: a new fork gets every per-script test without being named
ALGORITHMS = ["grpo"] + sorted(
    os.path.basename(path)[: -len(".py")]
    for path in glob.glob(os.path.join(REPO, "algorithms", "[!_]*.py"))
    if os.path.basename(path) != "grpo.py"
)


def one_process():
    """The fsdp.Dist of a plain process on the CPU (world size 1), for tests that call an update directly."""
    import torch

    from common import fsdp

    return fsdp.Dist(0, 1, 0, torch.device("cpu"))


# what every script logs each step; a method's tests add its own metrics
BASE_LOGGED = [
    "charts/reward",
    "charts/accuracy",
    "charts/no_answer_rate",
    "charts/response_length_mean",
    "charts/response_length_max",
    "charts/truncation_rate",
    "charts/zero_std_group_fraction",
    "charts/entropy",
    "charts/lr",
    "charts/tokens_per_second",
    "charts/skipped_steps",
    "losses/policy_loss",
    "losses/approx_kl",
    "losses/grad_norm",
    "mismatch/kl_k3",
    "mismatch/max_abs_logprob_diff",
    "sampling/rollouts",
    "time/rollout",
    "time/train",
    "time/weight_sync",
    "time/step",
]
CLIP_LOGGED = ["losses/clip_fraction", "losses/ratio_min", "losses/ratio_max"]  # scripts with a ratio

# Reward signal in end-to-end runs. An update moves the policy only if a group in its minibatch, or in an earlier one
# (Adam's momentum carries a step on), has rewards that differ. At temperature 1 a group of 4 completions has equal
# rewards for 48% of the built-in arith model's training prompts (products 43%, sums 36%, tiny-moe 29%; measured on
# 256-512 prompts). A model built on another processor is another sample of the same warm start and samples other
# completions, so a test that needs a signal within its first n groups fails on about 0.48^n of machines: such tests
# draw enough groups for that to stay under 1e-4 (n >= 13), each saying how many it draws beside what it asserts.


def compute_dtype(dtype="float32"):
    """The scripts' compute dtype for --dtype on the CPU (auto: float32)."""
    import torch

    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]


def precision(dtype="float32"):
    """fsdp.Precision (dtype, autocast, scaler) of the scripts' --dtype on the CPU: bf16 / fp16 autocast, and
    fp16's loss scale, starting at 2^10 rather than the scripts' 2^16: the built-in model's first-step activation
    gradients times 2^16 overflow float16, a skipped step that a one-update test cannot recover from."""
    import torch

    from common.fsdp import Precision

    compute = compute_dtype(dtype)
    return Precision(
        compute,
        torch.autocast("cpu", compute, enabled=compute != torch.float32),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=compute == torch.float16),
    )


def run_script(script, *flags, timeout=600, check=True, env=None):
    """Run `python <script> <flags>` (or `python -m <module> <flags>`) from the repository root, with
    `env` on top of the offline environment; returns the CompletedProcess."""
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    target = [script, *map(str, flags)] if script == "-m" else [os.path.join(REPO, script), *map(str, flags)]
    result = subprocess.run(
        [sys.executable, *target], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def torchrun(nproc, script, *flags, timeout=600):
    """`torchrun --standalone --nproc_per_node nproc <script> <flags>` (gloo on CPU, one thread per rank)."""
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        os.path.join(REPO, script),
        *map(str, flags),
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 and GLOO_ABORT in result.stderr:
        # gloo's worker threads can abort a rank (std::terminate, SIGABRT) when a process tears down while they
        # hold work (pytorch/pytorch#179291), seen once so far in this suite's CI runs: run it once more, and only
        # a second failure counts
        print(f"torchrun {script}: a rank aborted in gloo ({GLOO_ABORT!r}); running it again", file=sys.stderr)
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun {script} failed:\n{result.stderr[-5000:]}"
    return result


GLOO_ABORT = "terminate called without an active exception"


def assert_two_ranks_update_like_one(tmp_path, *script_args, tokens_seen=2 * 49, weight_atol=1e-6):
    """tests/distributed_update.py on 1 process and on 2 FSDP2 ranks (gloo): every statistic the update logs and every
    updated weight agree (to `weight_atol` plus 1e-4 relative); `tokens_seen`: the response tokens its updates saw
    (49 in each of the 2 epochs)."""
    import torch

    run_script("tests/distributed_update.py", tmp_path / "one.json", *script_args)
    torchrun(2, "tests/distributed_update.py", tmp_path / "two.json", *script_args)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one.keys() == two.keys() and {"losses/policy_loss", "losses/grad_norm", "charts/entropy"} <= one.keys()
    assert one["tokens_seen"] == two["tokens_seen"] == tokens_seen
    for key in one:
        assert abs(two[key] - one[key]) <= 1e-4 * abs(one[key]) + 1e-7, (key, one[key], two[key])
    weights_one, weights_two = (torch.load(tmp_path / f"{n}.json.weights.pt") for n in ("one", "two"))
    assert weights_one.keys() == weights_two.keys()
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=weight_atol, msg=key)
    return one


def help_text(script, args_class, count_defaults=True):
    """`<script> --help`, checked to document every field of `args_class` as a flag; returns the text."""
    from common.flags import names

    text = run_script(script, "--help").stdout
    fields = names(args_class)
    for field in fields:
        assert "--" + field.replace("_", "-") in text, field
    if count_defaults:
        assert text.count("(default") >= len(fields) - 2
    # no paragraph printed under several headings (a source comment above the groups once was, under all seven)
    lines = [line.strip("│╭╮╰╯─ ") for line in text.splitlines()]
    repeated = {line for line in lines if len(line) > 40 and "(default" not in line and lines.count(line) > 1}
    assert not repeated, repeated
    return text


def assert_weights_unchanged(checkpoint, tiny_dir):
    """The checkpoint's weights are exactly the built-in model's (every step was skipped)."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for (name, p), q in zip(saved.named_parameters(), initial.parameters()):
        assert torch.equal(p, q), name


def assert_weights_changed(checkpoint, tiny_dir):
    """The checkpoint's embedding differs from the built-in model's (the run trained)."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert not torch.equal(saved.model.embed_tokens.weight, initial.model.embed_tokens.weight)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logged_numbers(record) -> set:
    """The keys of a metrics record that two runs of the same steps log alike (all but times and speeds)."""
    return {key for key in record if not key.startswith("time/") and key != "charts/tokens_per_second"}


def assert_same_run(expected, actual, first_end=None, rel=0.0):
    """Every number each step logged (times aside) equal, and no step or number logged by one run alone. `first_end`:
    the step a resumed `actual` first ended at, where it evaluated (a run evaluates at its last step) and `expected`
    need not have: those eval/* numbers are its own. `rel`: equal to within this relative tolerance instead."""
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for a, b in zip(expected, actual, strict=True):
        extra = logged_numbers(b) - logged_numbers(a)
        own_evaluation = b["step"] == first_end and all(key.startswith("eval/") for key in extra)
        assert logged_numbers(a) <= logged_numbers(b) and (own_evaluation or not extra), (a["step"], extra)
        for key in logged_numbers(a):
            assert b[key] == (pytest.approx(a[key], rel=rel, abs=1e-12) if rel else a[key]), (a["step"], key)


def only_run_dir(output_dir):
    runs = [os.path.join(output_dir, d) for d in os.listdir(output_dir)]
    assert len(runs) == 1, runs
    return runs[0]


def two_group_rollouts(tokenizer, responses=("3$", "12", "4$", "396", "96$", "9", "91$", "906$")):
    """Two prompts ("Q: 1+2=", "Q: 45+51=") with four completions each, of different lengths, for the
    brute-force tests; a `$` ending a response is EOS. Returns the prompts' token ids and the Completions
    (placeholder log-probs -1.0)."""
    from common.engines import Completion

    prompts = [tokenizer(q)["input_ids"] for q in ["Q: 1+2=", "Q: 45+51="]]
    completions = []
    for text in responses:
        ids = tokenizer(text.removesuffix("$"), add_special_tokens=False)["input_ids"]
        ids += [tokenizer.eos_token_id] if text.endswith("$") else []
        completions.append(Completion(ids, [-1.0] * len(ids), "stop"))
    return prompts, completions


def per_sequence_logprobs(model, prompts, completions, group):
    """Each completion's token log-probs and entropies under `model` (temperature 1), one forward of its prompt and
    response without padding: the brute force that the scripts' padded, micro-batched path is checked against."""
    import torch

    found = []
    for i, completion in enumerate(completions):
        prompt, response = prompts[i // group], completion.token_ids
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits, -1)
        found.append((logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)))
    return found


def gradient_recorder(parameters):
    """An optimizer that keeps the gradients of each of its steps (`.steps`) and changes no weight."""
    import torch

    class GradientRecorder(torch.optim.Optimizer):
        def __init__(self, parameters):
            super().__init__(list(parameters), {"lr": 0.0})
            self.steps = []

        def step(self, closure=None):
            self.steps.append([p.grad.clone() for group in self.param_groups for p in group["params"]])

    return GradientRecorder(parameters)


def adapted_tiny(tiny_dir, rank=4, alpha=8.0, seed=0, scale=0.5, targets=("all-linear",)):
    """The built-in model with LoRA adapters as the scripts make them (common.adapters.load_policy, float32), each B
    drawn at random (`scale` × its A's std) so that the adapters change the model and A gets a gradient too."""
    import torch

    from common.adapters import load_policy
    from common.flags import Systems

    systems = Systems(lora_rank=rank, lora_alpha=alpha, lora_target_modules=targets)
    torch.manual_seed(seed)  # peft draws A from the global generator
    policy = load_policy(tiny_dir, None, systems)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator) / rank)
    return policy


def peak_rss_of(script, *flags, timeout=900):
    """The peak resident memory (bytes) of `python script flags...` alone: a launcher whose only child it is."""
    launcher = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run(
        [sys.executable, "-c", launcher, sys.executable, os.path.join(REPO, script), *map(str, flags)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


def tie_routers(model, epsilon=1e-5, seed=0):
    """Make every router of an MoE model (8 experts, 2 per token, as tiny-moe) choose its second expert between two
    whose rows are equal in bfloat16 and differ in float32 by `epsilon` relative noise, for every token; returns the
    model. A bf16 engine and a float32 trainer then disagree on about half the token-layers (bf16 sees a tie, float32
    sees the noise), so a test that needs routing flips has them on any machine instead of waiting for a rare one.

    The rows are multiples of one seeded row w ~ N(0, 0.02²) (the upcycled router's scale, rounded to bf16), whatever
    the model's own routers were: [2w, -2w, w, w', -w, -w', w/2, -w/2], w' = w · (1 + ε·N(0, 1)). With z = w·h > 0 the
    top expert is 0 (2z) and the second is 2 or 3 (z, z + ε-noise), above 6 (z/2); with z < 0 the top is 1 (2|z|) and
    the second 4 or 5. Float32 picks the second by the sign of the noise's product with h; bf16, where w' rounds to w,
    by its top-k's tie-break: independent choices. ε = 1e-5 is far below bf16's resolution (2^-9 relative) and far
    above float32's (6e-8), and the ties outlast a few Adam steps at a learning rate up to 1e-5 (each moves a row
    element of about 0.02 by about lr), but not at 1e-3."""
    import torch

    from common import moe

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in moe.routers(model):
            assert (router.num_experts, router.top_k) == (8, 2), "tie_routers is made for 8 experts, 2 per token"
            w = (0.02 * torch.randn(router.weight.shape[1], generator=generator)).bfloat16().float()
            near = [w * (1 + epsilon * torch.randn(w.shape, generator=generator)) for _ in range(2)]
            router.weight.copy_(torch.stack([2 * w, -2 * w, w, near[0], -w, -near[1], w / 2, -w / 2]))
            assert torch.equal(near[0].bfloat16(), w.bfloat16()) and torch.equal(near[1].bfloat16(), w.bfloat16())
    return model
