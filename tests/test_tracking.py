"""common/tracking.py: the step metrics' arithmetic and their reduction over ranks; --track: a Weights &
Biases run (offline here) holds the config and every logged metric."""

import glob
import json
import math
import struct

import pytest
import torch
from helpers import only_run_dir, read_jsonl, run_script

from common.tracking import StepMetrics, Tracker


@pytest.mark.parametrize("merged", [False, True], ids=["recorded", "merged"])
def test_step_metrics_by_hand(merged):
    """Each kind of statistic by hand; the same when half of them were recorded into another StepMetrics and merged
    (a batch sampled ahead at --rollout-lag k brings its own)."""
    metrics = StepMetrics()
    other = StepMetrics() if merged else metrics
    metrics.mean("entropy", torch.tensor(3.0), torch.tensor(2.0))  # two micro-batches: (3 + 1) / (2 + 2)
    other.mean("entropy", 1.0, 2)
    metrics.sum("tokens_per_second", 10.0)
    other.sum("tokens_per_second", 5)
    other.max("ratio_max", torch.tensor([0.5, 2.0]))
    metrics.max("ratio_max", 1.5)
    metrics.max("ratio_max", torch.tensor([]))  # an empty micro-batch records nothing
    other.min("ratio_min", torch.tensor([[0.7, 0.2]]))
    metrics.min("ratio_min", torch.tensor([0.9]))
    metrics.min("ratio_min", torch.tensor([]))
    metrics.mean("nothing", 0.0, 0)  # no count: not a number, nothing was measured
    other.set("lr", 1e-4)
    metrics.update({"eval/greedy_accuracy": 0.5})
    if merged:
        metrics.merge(other)
    with metrics.timer("time/train"):
        pass
    logged = metrics.reduce()
    assert {k: v for k, v in logged.items() if k not in ("nothing", "time/train")} == {
        "entropy": 1.0,
        "tokens_per_second": 15.0,
        "ratio_max": 2.0,
        "ratio_min": pytest.approx(0.2),
        "lr": 1e-4,
        "eval/greedy_accuracy": 0.5,
    }
    assert math.isnan(logged["nothing"]) and 0 <= logged["time/train"] < 1
    metrics = StepMetrics()
    metrics.max("diff", torch.tensor([1.0, float("nan")]))  # a NaN stays visible, whatever comes after it
    metrics.max("diff", 2.0)
    metrics.min("ratio", 0.5)
    metrics.min("ratio", float("nan"))
    assert all(math.isnan(v) for v in metrics.reduce().values())


def test_gpu_memory_is_the_peak_since_the_last_step_and_absent_on_a_cpu(monkeypatch):
    """On a GPU the allocator's peaks are recorded in GiB and then reset, so each step's figure is its own; on a CPU
    nothing is recorded (a 0 would read as a measurement)."""
    metrics = StepMetrics()
    metrics.gpu_memory(torch.device("cpu"))
    assert metrics.reduce() == {}
    peaks, resets = {"allocated": 3 * 2**30, "reserved": 5 * 2**30}, []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    metrics.gpu_memory(torch.device("cuda", 0))
    assert metrics.reduce() == {"memory/peak_allocated_gib": 3.0, "memory/peak_reserved_gib": 5.0}
    assert resets == [torch.device("cuda", 0)]


def test_tracker_drops_records_after_the_resumed_step(tmp_path):
    tracker = Tracker(str(tmp_path / "run"), {"lr": 1.0})
    for step in range(4):
        tracker.log({"charts/reward": step / 4, "charts/nan": float("nan")}, step)
    Tracker(str(tmp_path / "run"), {"lr": 1.0}, resume_step=2).log({"charts/reward": 1.0}, 3)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1] == {"step": 3, "charts/reward": 1.0}
    assert records[0]["charts/nan"] == "nan"  # JSON has no NaN: kept visible as a string


def wandb_records(path):
    """The protobuf records of a W&B run file (`run-<id>.wandb`): a ':W&B' header, then LevelDB-log
    framing (32 KiB blocks; each chunk has a 7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST).
    wandb 0.31 ships no Python reader for it (its core is in Go), so the test reads the format itself."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's last bytes, too few for a header, are padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zero-filled tail
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_track_writes_the_config_and_every_metric_to_an_offline_wandb_run(tmp_path):
    run_script(
        "algorithms/grpo.py",
        "--steps",
        2,
        "--prompts-per-step",
        4,
        "--eval-every",
        2,
        "--eval-prompts",
        8,
        "--track",
        "--output-dir",
        tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    run_dir = only_run_dir(tmp_path)
    [run_file] = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    config, history = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            # a key is stored in `key` or, when it holds a "/", in `nested_key`
            values = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
            }
            history[record.history.step.num] = values
    # the config is the script's Args, as in the run folder's config.json
    with open(f"{run_dir}/config.json") as f:
        expected_config = json.load(f)
    for key, value in expected_config.items():
        assert config[key] == value, key
    assert config["track"] is True and config["prompts_per_step"] == 4
    # every metric of every step of metrics.jsonl, with the same value
    logged = read_jsonl(f"{run_dir}/metrics.jsonl")
    assert [r["step"] for r in logged] == [0, 1, 2] and sorted(history) == [0, 1, 2]
    for record in logged:
        for key, value in record.items():
            if key != "step":
                assert math.isclose(history[record["step"]][key], value, rel_tol=1e-12), (record["step"], key)
    assert "charts/reward" in history[2] and "eval/greedy_accuracy" in history[2]
