"""Metrics: a JSONL file in the run folder always, wandb with --track, a PNG of the curves at the end.

    tracker = Tracker(run_dir, run_name, config=vars(args), track=args.track, ...)
    tracker.log({"charts/reward": 0.4, ...}, step)
    tracker.close(plot_keys=[...])      # writes curves.png

On resume, records after the checkpoint's step are dropped from the JSONL (they are about to be
recomputed), so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os


class Tracker:
    def __init__(self, run_dir, run_name, config, track=False, project="clean-llm-rl", entity=None,
                 enabled=True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_dir = run_dir
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            kept = [line for line in open(self.path) if line.strip() and json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        if track:
            import wandb

            self.wandb = wandb.init(project=project, entity=entity, name=run_name, config=config,
                                    dir=run_dir, save_code=True, resume="allow", id=run_name.replace("/", "_"))

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self, plot_keys: list[str]) -> str | None:
        if not self.enabled:
            return None
        if self.wandb is not None:
            self.wandb.finish()
        return plot_curves(self.path, os.path.join(self.run_dir, "curves.png"), plot_keys)


def _plain(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)  # JSON has no NaN; keep it visible as "nan"


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str, png_path: str, keys: list[str]) -> str | None:
    """One panel per metric key present in the JSONL, against the training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            series[key] = points
    if not series:
        return None
    columns = min(3, len(series))
    rows = math.ceil(len(series) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3 * rows), squeeze=False)
    for axis, (key, points) in zip(axes.flat, series.items()):
        axis.plot(*zip(*points), marker="." if len(points) < 30 else None)
        axis.set_title(key, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(series):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path
