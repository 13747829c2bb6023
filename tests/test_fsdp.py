"""Several ranks (FSDP2 over gloo on CPU, launched with torchrun), exact resume after SIGKILL, and
deterministic runs."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
from helpers import OFFLINE, REPO, assert_same_run, only_run_dir, read_jsonl, run_script, torchrun

from common import fsdp

pytestmark = pytest.mark.slow


def _one_and_two_ranks(tmp_path, *flags):
    run_script("tests/distributed_update.py", tmp_path / "one.json", *flags)
    torchrun(2, "tests/distributed_update.py", tmp_path / "two.json", *flags)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    weights = [torch.load(tmp_path / f"{n}.json.weights.pt") for n in ("one", "two")]
    return one, two, weights


@pytest.mark.parametrize(
    "variant", ['{"loss_aggregation": "token-sum-norm"}', '{"ratio_level": "sequence"}'], ids=["dr-grpo", "gspo"]
)
def test_two_ranks_equal_one_with_grpo_loss_variants(tmp_path, variant):
    """Dr. GRPO's constant (the minibatch's completions on all ranks × --max-new-tokens) and GSPO's sequence
    ratio (two epochs: the ratios move off 1) through update_policy: every statistic and weight agree."""
    one, two, (weights_one, weights_two) = _one_and_two_ranks(tmp_path, "grpo", variant)
    assert one["losses/approx_kl"] > 0 and one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-4, atol=1e-6, msg=name)


def test_two_ranks_equal_one_with_the_output_layer_in_chunks(tmp_path):
    """Chunks of 5 positions through the tied output layer, recomputed in the backward: under FSDP2 the
    root unit still gathers the embedding / output weight and reduces its gradient."""
    one, two, (weights_one, weights_two) = _one_and_two_ranks(tmp_path, "grpo", "{}", 4 * 100 * 5)
    assert two["losses/grad_norm"] == pytest.approx(one["losses/grad_norm"], rel=1e-4)
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-4, atol=1e-6, msg=name)
    run_script("tests/distributed_update.py", tmp_path / "plain.json")
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert one["losses/policy_loss"] == pytest.approx(plain["losses/policy_loss"], rel=1e-5)  # chunks change no number


@pytest.mark.parametrize("head", ["bf16 head", "fp32 head"])
def test_two_ranks_equal_one_in_bfloat16(tmp_path, head):
    """--dtype bfloat16: FSDP2 ranks gather every weight in bf16 (fsdp.shard's MixedPrecisionPolicy); the one
    process runs the same bf16 weights (a cast of each float32 weight, tests/distributed_update.py), so both
    compute the same update up to bf16 rounding of rows padded differently on each rank (one update: a second
    epoch would amplify those differences through the first step). Plain autocast over float32 weights is
    another computation: on the built-in model its gradient norm differs by a factor of about 3, a gradient
    whose completions' terms nearly cancel in float32. With --fp32-lm-head the root unit (embedding, final norm,
    output layer) stays float32 on both sides."""
    settings = {"dtype": "bfloat16", "update_epochs": 1, "fp32_lm_head": head == "fp32 head"}
    one, two, (weights_one, weights_two) = _one_and_two_ranks(tmp_path, "grpo", json.dumps(settings))
    assert two["losses/grad_norm"] == pytest.approx(one["losses/grad_norm"], rel=1e-2)
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-3, atol=1e-3, msg=name)


def test_two_ranks_equal_one_in_float16(tmp_path):
    """--dtype float16: fp16 autocast under torch's dynamic loss scale. One process and two FSDP2 ranks take
    the same step (the scaler's overflow check is reduced over ranks), and the unscaled gradient is float32's
    up to fp16 rounding: a scale left in it would multiply the norm by the scale."""
    one, two, (weights_one, weights_two) = _one_and_two_ranks(
        tmp_path, "grpo", '{"dtype": "float16", "update_epochs": 1}'
    )
    run_script("tests/distributed_update.py", tmp_path / "fp32.json", "grpo", '{"update_epochs": 1}')
    fp32 = json.loads((tmp_path / "fp32.json").read_text())
    assert one["skipped"] == two["skipped"] == 0
    # fp16 rounding moves this small, cancelling gradient by a few percent; a scale left in would be 2^10 times
    assert one["losses/grad_norm"] == pytest.approx(fp32["losses/grad_norm"], rel=0.1)
    assert two["losses/grad_norm"] == pytest.approx(one["losses/grad_norm"], rel=1e-2)
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=1e-3, atol=1e-3, msg=name)


def test_grpo_on_two_ranks_end_to_end_and_resume(tmp_path):
    """Two ranks, two steps, then resumed for a third, at --rollout-lag 1 with dynamic sampling: each rank's queue of
    rollouts sampled ahead is in the checkpoint, the third step trains on the batch the second step's weights sampled,
    and the resumed run logs what a run of three steps straight does. The stopped and resumed run samples beside its
    updates (--overlap-rollouts: each rank's sampler thread reduces its rounds' counts on a process group of its own
    while FSDP's collectives run), the straight one does not: the same numbers."""
    from transformers import AutoModelForCausalLM

    flags = [
        "--prompts-per-step",
        4,
        "--group-size",
        4,
        "--eval-prompts",
        16,
        "--eval-k",
        2,
        "--eval-every",
        2,
        "--save-every",
        2,
        "--rollout-lag",
        1,
        "--dynamic-sampling",
        "--max-sampling-rounds",
        2,
    ]
    torchrun(2, "algorithms/grpo.py", "--steps", 3, "--output-dir", tmp_path / "straight", *flags)
    flags.append("--overlap-rollouts")
    torchrun(2, "algorithms/grpo.py", "--steps", 2, "--output-dir", tmp_path / "split", *flags)
    torchrun(2, "algorithms/grpo.py", "--steps", 3, "--output-dir", tmp_path / "split", "--resume", "auto", *flags)
    run_dir = only_run_dir(tmp_path / "split")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # the resumed run is the uninterrupted one: each rank's queue, optimizer shard and random state came back
    assert_same_run(read_jsonl(os.path.join(only_run_dir(tmp_path / "straight"), "metrics.jsonl")), records)
    assert all(isinstance(records[-1][k], float) for k in ("charts/reward", "losses/grad_norm", "mismatch/kl_k3"))
    assert [r["charts/rollout_lag"] for r in records[1:]] == [0, 1, 1]
    # each rank's engine copy received every push: at the weights that sampled, engine and trainer agree (the
    # staleness itself is > 0 only if step 2 had a group with a reward spread, 1 - 0.48^4 of machines: not asserted)
    assert records[-1]["mismatch/kl_k3_discrepancy"] < 1e-6
    checkpoint = os.path.join(run_dir, "checkpoints", "step_00000003")
    assert sorted(f for f in os.listdir(checkpoint) if f.startswith("rng")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert sorted(f for f in os.listdir(checkpoint) if f.startswith("rollouts")) == [
        "rollouts_rank0.pt",
        "rollouts_rank1.pt",
    ]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # full weights in Hugging Face format
    assert model.model.embed_tokens.weight.shape == (100, 256)


def test_lora_on_two_ranks_with_offload_checkpointing_and_bf16(tmp_path):
    """--lora-rank on 2 FSDP2 ranks with --cpu-offload and --gradient-checkpointing: each rank's engine copy receives
    the merged weights (its log-probs match π_old to float32 rounding after the adapters moved), the checkpoint is
    the adapter; then in bf16, where the frozen weights are bf16 and the adapters float32 in the same FSDP2 units."""
    # 8 prompts: the third step's second minibatch sees moved adapters unless all 20 groups before it had equal
    # rewards, on 0.48^20 < 1e-6 of machines (helpers.py, reward signal; with 4 prompts 10 groups, 6e-4)
    flags = ["--lora-rank", 4, "--lr", 1e-2, "--prompts-per-step", 8, "--group-size", 4, "--num-minibatches", 2]
    flags += ["--eval-every", 0, "--cpu-offload", "--gradient-checkpointing"]
    torchrun(2, "algorithms/grpo.py", "--steps", 3, "--output-dir", tmp_path / "fp32", *flags)
    run_dir = only_run_dir(tmp_path / "fp32")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert records[-1]["losses/approx_kl"] > 0 and records[-1]["mismatch/max_abs_logprob_diff"] < 1e-3, records[-1]
    checkpoint = os.listdir(os.path.join(run_dir, "checkpoints", "step_00000003"))
    assert {"adapter_model.safetensors", "rng_rank0.pt", "rng_rank1.pt"} <= set(checkpoint)
    torchrun(2, "algorithms/grpo.py", "--steps", 1, "--output-dir", tmp_path / "bf16", *flags, "--dtype", "bfloat16")
    record = read_jsonl(os.path.join(only_run_dir(tmp_path / "bf16"), "metrics.jsonl"))[-1]
    assert math.isfinite(record["losses/grad_norm"]) and record["charts/skipped_steps"] == 0


FLAGS = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 0, "--num-minibatches", 2]


def _start(output_dir, steps, *extra):
    env = {
        **os.environ,
        **OFFLINE,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }  # as run_script: same numbers
    return subprocess.Popen(
        [
            sys.executable,
            "algorithms/grpo.py",
            "--steps",
            str(steps),
            "--output-dir",
            str(output_dir),
            *map(str, FLAGS),
            *map(str, extra),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a run under nohup inherits an ignored SIGHUP, which the run then leaves alone: not the case tested
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )


def _wait_until(predicate, process, timeout=300):
    deadline = time.time() + timeout
    while not predicate():
        assert process.poll() is None, f"the run ended before the kill: {process.stderr.read()[-3000:]}"
        assert time.time() < deadline, "timed out waiting to kill the run"
        time.sleep(0.001)


def _steps_logged(output_dir):
    runs = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    path = os.path.join(output_dir, runs[0], "metrics.jsonl") if runs else ""
    return len(read_jsonl(path)) if os.path.exists(path) else 0


def test_sigkill_in_training_and_during_a_checkpoint_write_then_resume(tmp_path):
    run_script("algorithms/grpo.py", "--steps", 6, "--save-every", 2, "--output-dir", tmp_path / "straight", *FLAGS)
    straight = read_jsonl(os.path.join(only_run_dir(tmp_path / "straight"), "metrics.jsonl"))

    # 1. killed in the middle of training (after step 3 was logged, the newest checkpoint is step 2)
    killed = tmp_path / "killed"
    process = _start(killed, 6, "--save-every", 2)
    _wait_until(lambda: _steps_logged(killed) >= 3, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    run_script(
        "algorithms/grpo.py", "--steps", 6, "--save-every", 2, "--output-dir", killed, "--resume", "auto", *FLAGS
    )
    assert_same_run(straight, read_jsonl(os.path.join(only_run_dir(killed), "metrics.jsonl")))

    # 2. killed while a checkpoint is being written: the half-written folder is never "latest". The run is
    #    frozen (SIGSTOP) as soon as a step_N.tmp folder shows; if the rename won the race, it thaws and the
    #    next checkpoint is tried, so the kill always lands inside a write.
    interrupted = tmp_path / "interrupted"
    process = _start(interrupted, 6, "--save-every", 1)

    def checkpoint_folder(step, suffix=""):
        runs = os.listdir(interrupted) if os.path.isdir(interrupted) else []
        return os.path.join(interrupted, runs[0] if runs else "-", "checkpoints", f"step_{step:08d}{suffix}")

    def checkpoint_started(step):
        return os.path.isdir(checkpoint_folder(step, ".tmp")) or os.path.isdir(checkpoint_folder(step))

    for step in range(2, 6):
        _wait_until(partial(checkpoint_started, step), process)
        process.send_signal(signal.SIGSTOP)
        if os.path.isdir(checkpoint_folder(step, ".tmp")):
            break  # frozen inside the write of this step's checkpoint
        process.send_signal(signal.SIGCONT)
    process.send_signal(signal.SIGKILL)
    process.wait()
    run_dir = only_run_dir(interrupted)
    complete = sorted(d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if not d.endswith(".tmp"))
    assert complete[-1] == f"step_{step - 1:08d}" and os.path.isdir(checkpoint_folder(step, ".tmp"))
    run_script(
        "algorithms/grpo.py", "--steps", 6, "--save-every", 1, "--output-dir", interrupted, "--resume", "auto", *FLAGS
    )
    assert_same_run(straight, read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
    assert not any(d.endswith(".tmp") for d in os.listdir(os.path.join(run_dir, "checkpoints")))


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_or_sigterm_checkpoints_the_step_then_resume_continues_exactly(tmp_path, stop):
    """--save-every 0 (a checkpoint only at the end), and a signal once step 2 is logged (SIGHUP: the terminal was
    closed, the ssh connection dropped; it was lost with the run before): the step under way
    finishes and is checkpointed, the run exits with 128 + the signal's number saying how to resume (no traceback),
    and --resume then ends where an uninterrupted run does, every metric equal."""
    run_script("algorithms/grpo.py", "--steps", 5, "--save-every", 0, "--output-dir", tmp_path / "straight", *FLAGS)
    straight = read_jsonl(os.path.join(only_run_dir(tmp_path / "straight"), "metrics.jsonl"))
    stopped = tmp_path / "stopped"
    process = _start(stopped, 5, "--save-every", 0)
    _wait_until(lambda: _steps_logged(stopped) >= 2, process)
    process.send_signal(stop)
    stderr = process.communicate(timeout=300)[1]
    run_dir = only_run_dir(stopped)
    assert process.returncode == 128 + stop and "Traceback" not in stderr, stderr[-3000:]
    assert f"continue with --resume {run_dir}" in stderr
    done = _steps_logged(stopped)  # the steps logged: 2, or 3 when the signal came during step 3
    assert done in (2, 3) and os.listdir(os.path.join(run_dir, "checkpoints")) == [f"step_{done:08d}"]
    run_script("algorithms/grpo.py", "--steps", 5, "--output-dir", stopped, "--resume", "auto", *FLAGS)
    assert_same_run(straight, read_jsonl(os.path.join(run_dir, "metrics.jsonl")))


@pytest.mark.slow
def test_a_reader_gone_with_the_terminal_loses_no_step(tmp_path):
    """`./run.sh 2>&1 | tee log`, then the terminal is closed: its SIGHUP ends tee as well, and the progress bar's next
    line to the pipe failed with EPIPE, ending the run (exit 1, a traceback) before the step's checkpoint. The output
    now goes to /dev/null, and the step is checkpointed (exit 129)."""
    process = _start(tmp_path, 8, "--save-every", 0)  # stderr: a pipe, read by this test
    _wait_until(lambda: _steps_logged(tmp_path) >= 1, process)
    process.stderr.close()  # the reader is gone
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=300) == 128 + signal.SIGHUP
    done = _steps_logged(tmp_path)
    assert done < 8 and os.listdir(os.path.join(only_run_dir(tmp_path), "checkpoints")) == [f"step_{done:08d}"]


def test_a_checkpoint_is_on_disk_before_it_is_named(tiny, tmp_path, monkeypatch):
    """Every file of a checkpoint is fsynced before its folder is renamed into place, and the rename after: an OS
    crash or power loss could leave a named checkpoint of empty files (the page cache survives a killed process
    only), with the older ones already removed."""
    import copy

    from helpers import one_process

    from common import checkpoint
    from common.flags import Checkpoints

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or replace(a, b))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    final = checkpoint.save_checkpoint(
        str(tmp_path), 3, model, tokenizer, optimizer, scheduler, scaler, {}, one_process(), Checkpoints()
    )
    renamed = events.index(("replace", final + ".tmp"))
    synced_before = {path for kind, path in events[:renamed] if kind == "fsync"}
    written = {
        os.path.join(root, name).replace(final, final + ".tmp") for root, _, names in os.walk(final) for name in names
    }
    assert written and written <= synced_before, written - synced_before
    assert ("fsync", str(tmp_path / "checkpoints")) in events[renamed:]


def test_a_second_ctrl_c_waits_for_the_checkpoint_being_written(tiny, tmp_path, monkeypatch):
    """Two Ctrl-C in a row, the second arriving while the first's checkpoint is being written: the write
    finishes (the checkpoint is whole, no .tmp folder), then the run stops at once with 130 and no
    traceback. A second signal outside a write stops at once with 128 + its number (143 for SIGTERM)."""
    import copy

    from helpers import one_process

    from common import checkpoint, checks, stopping
    from common.flags import Checkpoints

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rng_state = checkpoint.rng_state

    def two_ctrl_c_mid_write():  # called inside the write, after the weights
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return rng_state()

    monkeypatch.setattr(checkpoint, "rng_state", two_ctrl_c_mid_write)
    stop = stopping.StopSignals(str(tmp_path))
    try:
        with pytest.raises(SystemExit) as exit:
            checkpoint.save_checkpoint(
                str(tmp_path), 3, model, tokenizer, optimizer, scheduler, scaler, {}, one_process(), Checkpoints()
            )
        assert exit.value.code == 130 and stop.received == signal.SIGINT
        assert os.listdir(tmp_path / "checkpoints") == ["step_00000003"]
        checks.check_checkpoint_files(str(tmp_path / "checkpoints" / "step_00000003"))
        with pytest.raises(SystemExit) as exit:  # a second signal between writes: now, with its own number
            stop._handle(signal.SIGTERM, None)
        assert exit.value.code == 143
    finally:
        stop.received = None
        stop.finish(one_process())  # the handlers as they were


def test_under_torchrun_a_repeated_signal_is_the_agents_copy_and_another_ranks_signal_stops_this_one(monkeypatch):
    """A scheduler (SLURM) or a Ctrl-C signals every process, and torchrun's agent forwards its own copy: a worker
    gets SIGTERM twice at once, which is one request, not "stop now". A rank that got no signal stops after the
    same step as the one that did, with the same exit code."""
    from helpers import one_process

    from common import fsdp, stopping

    monkeypatch.setattr(stopping, "_UNDER_TORCHRUN", True)
    stop = stopping.StopSignals("unused")
    try:
        stop._handle(signal.SIGTERM, None)
        stop._handle(signal.SIGTERM, None)  # the agent's copy: no SystemExit
        stop.when -= stopping.REPEAT_SECONDS
        with pytest.raises(SystemExit) as exit:  # a real second request
            stop._handle(signal.SIGTERM, None)
        assert exit.value.code == 143
        stop.received = None

        def other_ranks(*received):  # what the all-reduce sums: each rank's one-hot of the signal it received
            return lambda values, dist: {key: float(sum(str(int(n)) == key for n in received)) for key in values}

        monkeypatch.setattr(fsdp, "all_reduce_dict", other_ranks(signal.SIGTERM))
        assert stop.requested(one_process()) and stop.received == signal.SIGTERM  # the other rank's
        # ranks that received different signals: the most common, not their mean (SIGHUP and SIGTERM gave 8, SIGFPE)
        for received, agreed in (((signal.SIGHUP, signal.SIGTERM, signal.SIGTERM), signal.SIGTERM),
                                 ((signal.SIGHUP, signal.SIGTERM), signal.SIGTERM)):  # fmt: skip
            stop.received = None
            monkeypatch.setattr(fsdp, "all_reduce_dict", other_ranks(*received))
            assert stop.requested(one_process()) and stop.received == agreed
        stop.received = None
        monkeypatch.setattr(fsdp, "all_reduce_dict", other_ranks())
        assert not stop.requested(one_process()) and stop.received is None
    finally:
        stop.received = None
        stop.finish(one_process())


def test_after_a_main_that_raised_the_next_ctrl_c_reaches_the_handler_that_was_there_before():
    """A main() that raises never calls StopSignals.finish. In a long-lived process (a notebook, a test runner, a
    sweep that calls main() in a loop) the next Ctrl-C must still interrupt: the stale handler gives it to the
    handler it replaced, and restores that one."""
    from common.stopping import StopSignals

    def main():
        StopSignals("unused")
        raise RuntimeError("a run that failed")

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RuntimeError):
            main()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # main's, left behind
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_agents_shutdown_timeout_is_read_from_its_command_line_or_environment():
    """torchrun's agent is the worker's parent: its --shutdown-timeout (either spelling, with = or not), else
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else torchrun's default of 30 s."""
    child = "from common.stopping import _agent_shutdown_timeout as t; print(t())"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    cases = [([], {}, "30.0"), (["--shutdown-timeout", "900"], {}, "900.0"), (["--shutdown_timeout=7"], {}, "7.0")]
    cases.append(([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, "120.0"))
    for argv, env, said in cases:
        environ = {**os.environ, "PYTHONPATH": REPO, **env}
        environ.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None) if not env else None
        result = subprocess.run([sys.executable, "-c", parent, *argv], env=environ, capture_output=True, text=True)
        assert result.stdout.strip() == said, (argv, env, result.stdout, result.stderr[-2000:])


def test_a_step_longer_than_half_the_agents_timeout_warns_once(monkeypatch, capfd):
    """Under torchrun a stop must fit a step and its checkpoint into the agent's --shutdown-timeout: rank 0 warns
    once, after the first step that takes more than half of it, with the flag to restart with."""
    from helpers import one_process

    from common import stopping

    monkeypatch.setattr(stopping, "_UNDER_TORCHRUN", True)
    monkeypatch.setattr(stopping, "_agent_shutdown_timeout", lambda: 30.0)
    clock = iter([100.0, 110.0, 130.0, 160.0])  # steps of 10 s (fine), then 20 s, then 30 s
    monkeypatch.setattr(stopping.time, "monotonic", lambda: next(clock))
    stop = stopping.StopSignals("unused")
    try:
        said = []
        for _ in range(4):
            assert not stop.requested(one_process())
            said.append(capfd.readouterr().err)
        assert said[:2] == ["", ""] and said[3] == "", said
        assert "a step takes 20 s, and torchrun kills its workers 30 s after it forwards a signal" in said[2]
        assert "Restart with torchrun --shutdown-timeout 900 to stop safely" in said[2]
    finally:
        stop.finish(one_process())


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_the_step_on_every_rank(tmp_path):
    """A scheduler's SIGTERM to torchrun's agent: the agent forwards it to both ranks, which finish the step under
    way, checkpoint it together (--save-every 0: no other checkpoint) and exit saying how to resume, before the
    agent's --shutdown-timeout."""
    from helpers import OFFLINE

    from common import checks

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [os.path.join(REPO, "algorithms/grpo.py"), "--steps", 30, "--save-every", 0, "--output-dir", tmp_path]
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(list(map(str, command + FLAGS)), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    _wait_until(lambda: _steps_logged(tmp_path) >= 2, agent)
    agent.send_signal(signal.SIGTERM)
    stderr = agent.communicate(timeout=300)[1]
    run_dir = only_run_dir(tmp_path)
    assert f"stopped by SIGTERM: continue with --resume {run_dir}" in stderr, stderr[-3000:]
    (checkpoint,) = os.listdir(os.path.join(run_dir, "checkpoints"))
    assert int(checkpoint.split("_")[1]) == _steps_logged(tmp_path) >= 2  # the last step logged
    checks.check_checkpoint_files(os.path.join(run_dir, "checkpoints", checkpoint))  # whole: both ranks' shards


def test_a_signal_during_the_last_step_ends_a_complete_run_without_resume_advice(tmp_path, capfd):
    """The last step's checkpoint is the end of the run: no `--resume` advice for a run with nothing left, exit 0;
    one step earlier, the advice and exit code 128 + the signal's number."""
    from helpers import one_process

    from common.stopping import StopSignals

    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    for steps, code, said in ((5, None, "the run is complete"), (6, 143, f"continue with --resume {tmp_path}")):
        stop = StopSignals(str(tmp_path))
        stop.received = signal.SIGTERM
        if code is None:
            stop.finish(one_process(), steps)
        else:
            with pytest.raises(SystemExit) as exit:
                stop.finish(one_process(), steps)
            assert exit.value.code == code
        assert said in capfd.readouterr().err


def test_runs_started_in_the_same_second_get_their_own_folders_and_a_run_has_one_writer(tmp_path, monkeypatch):
    """Two runs of one name in the same second (a sweep in a shell loop): two folders, created exclusively. A run
    folder is locked while its run lives: a second process resuming it is refused, naming the holder."""
    from helpers import one_process

    from common.checkpoint import open_run_folder
    from common.errors import BadInput

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    first, _ = open_run_folder(str(tmp_path), None, "arith__grpo__1", {}, one_process())
    second, _ = open_run_folder(str(tmp_path), None, "arith__grpo__1", {}, one_process())
    assert os.path.basename(first) == "arith__grpo__1__1800000000" and second == first + "-2"
    holder = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('process X'); "
        "f.flush(); print('held', flush=True); time.sleep(60)"
    )
    third = tmp_path / "held"
    third.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", holder, str(third / "run.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "held"
        from common.checkpoint import _lock

        with pytest.raises(BadInput, match=f"run folder {third} is in use by process X"):
            _lock(str(third))
    finally:
        process.kill()
        process.wait()
    _lock(str(third))  # the holder is gone: the system released its lock


def test_same_seed_same_metrics(tmp_path):
    for name in ("a", "b"):
        run_script("algorithms/grpo.py", "--steps", 2, "--output-dir", tmp_path / name, *FLAGS)
    assert_same_run(*(read_jsonl(os.path.join(only_run_dir(tmp_path / n), "metrics.jsonl")) for n in ("a", "b")))


def test_resume_finds_only_complete_checkpoints(tmp_path):
    from common.checkpoint import find_checkpoint

    run = tmp_path / "arith__grpo__1__100" / "checkpoints"
    for name in ("step_00000002", "step_00000004", "step_00000006.tmp"):
        (run / name).mkdir(parents=True)
    for name in ("step_00000002", "step_00000006.tmp"):
        (run / name / "trainer_state.pt").write_bytes(b"")
    # step 4 has no trainer state (an older layout or a broken copy), step 6 is half-written
    assert find_checkpoint("auto", str(tmp_path), "arith__grpo__1__") == str(run / "step_00000002")
    assert find_checkpoint(str(tmp_path / "arith__grpo__1__100"), str(tmp_path), "x") == str(run / "step_00000002")
    shutil.rmtree(run / "step_00000002")
    assert find_checkpoint("auto", str(tmp_path), "arith__grpo__1__") is None  # a new run starts
    with pytest.raises(ValueError, match="no complete checkpoint"):
        find_checkpoint(str(tmp_path / "arith__grpo__1__100"), str(tmp_path), "x")


def test_resume_auto_takes_the_newest_run_with_these_settings(tmp_path, capsys):
    """--resume auto continues the newest run (by when it started, not by its step) made with this command's
    settings: each point of a restarted sweep finds its own run, and a point with none starts a new one. Its run
    folder is locked before a checkpoint is read."""
    from helpers import one_process

    from common.checkpoint import _LOCKS, find_checkpoint, open_run_folder, release_run_folder

    def run(stamp, step, lr, model="Qwen/Qwen2.5-0.5B"):
        folder = tmp_path / f"arith__grpo__1__{stamp}" / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        torch.save({"args": {"lr": lr, "steps": 10, "resume": None, "model": model}}, folder / "trainer_state.pt")

    run("1800000100", 3, 1e-4)  # the older run of lr 1e-4 is further along
    run("1800000200", 2, 1e-4)
    run("1800000200-2", 4, 3e-4)  # started in the same second, by the next command of a sweep
    # a sweep over models: --model is a flag a resume may change (a model moved), but another model is another point
    run("1800000300", 5, 1e-4, model="Qwen/Qwen2.5-1.5B")
    settings = lambda lr, model="Qwen/Qwen2.5-0.5B": {"lr": lr, "steps": 10, "resume": "auto", "model": model}  # noqa: E731
    found = lambda *given: find_checkpoint("auto", str(tmp_path), "arith__grpo__1__", settings(*given))  # noqa: E731
    assert found(1e-4) == str(tmp_path / "arith__grpo__1__1800000200" / "checkpoints" / "step_00000002")
    assert found(1e-4, "Qwen/Qwen2.5-1.5B") == str(
        tmp_path / "arith__grpo__1__1800000300" / "checkpoints" / "step_00000005"
    )
    assert found(3e-4) == str(tmp_path / "arith__grpo__1__1800000200-2" / "checkpoints" / "step_00000004")
    assert found(1e-3) is None
    held = len(_LOCKS)
    folder, checkpoint = open_run_folder(str(tmp_path), "auto", "arith__grpo__1", settings(1e-3), one_process())
    assert checkpoint is None and folder.startswith(str(tmp_path / "arith__grpo__1__")) and len(_LOCKS) == held + 1
    # what kept the newest run from matching (a flag set otherwise, or a default the code has since changed)
    assert (
        f"--resume auto: no run arith__grpo__1__* in {tmp_path} with these settings has a checkpoint; the newest, "
        f"{tmp_path}/arith__grpo__1__1800000300, differs: --lr 0.0001 in the run, 0.001 now, --model "
        "Qwen/Qwen2.5-1.5B in the run, Qwen/Qwen2.5-0.5B now: a new run starts"
    ) in capsys.readouterr().err
    release_run_folder(folder)


def test_two_ranks_keep_no_bf16_copy_of_the_weights_for_the_backward(tmp_path):
    """bf16 on FSDP2 ranks: the weights are gathered in bf16 and freed after each layer's forward. Under
    autocast alone each gathered float32 weight would be cast, and the cast kept for the backward: a full
    bf16 copy of every layer per rank. After the forward, what autograd holds is the activations alone."""
    torchrun(2, "tests/distributed_forward_memory.py", tmp_path / "bf16.json", "bfloat16")
    measured = json.loads((tmp_path / "bf16.json").read_text())
    assert measured["saved_bytes"] < 0.1 * measured["layer_weight_bytes"], measured


def test_one_rank_moves_the_model_to_its_device_when_it_shards_it(tiny_dir):
    """The scripts pass fsdp.shard a model still in CPU memory (so that several ranks receive their shards one unit
    at a time); on one rank shard moves it whole to the rank's device (here the meta device stands for a GPU)."""
    from transformers import AutoModelForCausalLM

    dist = fsdp.Dist(0, 1, 0, torch.device("meta"))
    model = fsdp.shard(fsdp.prepare_for_training(AutoModelForCausalLM.from_pretrained(tiny_dir)), dist)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_training_mode_leaves_no_router_jitter():
    """Mixtral's router multiplies its input by noise in training mode when router_jitter_noise > 0: the policy
    the update scores would be random. prepare_for_training turns it off: two forwards agree exactly."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.5,
    )
    torch.manual_seed(0)
    model, ids = MixtralForCausalLM(config).train(), torch.randint(3, 50, (2, 9))
    assert not torch.equal(model(ids).logits, model(ids).logits)  # the noise is there before
    model = fsdp.prepare_for_training(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_a_max_grad_norm_of_zero_measures_the_norm_and_clips_nothing():
    """--max-grad-norm 0 is off, as every other flag's 0: the norm is measured (and logged), the gradients kept."""
    model = torch.nn.Linear(3, 2)  # 8 parameters, each gradient 2: norm 2·√8
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 2.0)
    assert fsdp.clip_grad_norm(model, 0.0, torch.device("cpu")).item() == pytest.approx(2.0 * math.sqrt(8))
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())
    fsdp.clip_grad_norm(model, 1.0, torch.device("cpu"))
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item() == pytest.approx(1.0, rel=1e-5)
