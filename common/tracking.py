"""Metrics: recorded where they are computed, reduced over ranks once per step, written to a JSONL file
in the run folder always, to wandb with --track, and drawn as a PNG of the curves at the end.

    metrics = StepMetrics()
    metrics.mean("charts/entropy", entropy_sum, token_count)   # Σ sums / Σ counts, over every call and rank
    metrics.max("losses/ratio_max", ratio)                     # the largest number (or tensor element) seen
    with metrics.timer("time/train"): ...                      # seconds, this rank's
    tracker = Tracker(run_dir, config=flat(args), tracking=args.tracking)
    tracker.log(metrics.reduce(dist), step)                    # one collective for the whole step
    tracker.close(plot_keys=[...])                             # writes curves.png

On resume, records after the checkpoint's step are dropped from the JSONL (they are about to be
recomputed), so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time


class StepMetrics:
    """One step's statistics on this rank. `reduce(dist)` combines every rank's in one collective: a
    mean is the sum of its numerators over its denominator's sum (so a token mean over ranks is the
    mean over all their tokens), sums add, maxima and minima compare; `set` values are this rank's."""

    def __init__(self):
        self.means: dict[str, list[float]] = {}  # name -> [Σ numerators, Σ denominators]
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}
        self.values: dict[str, float] = {}

    def mean(self, name: str, total, count) -> None:
        """Add `total` (a sum of values) and `count` (how many values it sums) to the mean `name`."""
        accumulated = self.means.setdefault(name, [0.0, 0.0])
        accumulated[0] += float(total)
        accumulated[1] += float(count)

    def sum(self, name: str, value) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def max(self, name: str, value) -> None:
        """The largest number recorded under `name`."""
        if hasattr(value, "numel"):  # a tensor: its largest element, none if it is empty
            if value.numel() == 0:
                return
            value = value.max()
        self.maxima[name] = _keep_nan(max, self.maxima.get(name, -math.inf), float(value))

    def min(self, name: str, value) -> None:
        """The smallest number recorded under `name`."""
        if hasattr(value, "numel"):  # a tensor: its smallest element, none if it is empty
            if value.numel() == 0:
                return
            value = value.min()
        self.minima[name] = _keep_nan(min, self.minima.get(name, math.inf), float(value))

    def set(self, name: str, value) -> None:
        """A value that is not reduced (the same on every rank, or rank 0's is the one logged)."""
        self.values[name] = float(value)

    def update(self, values: dict) -> None:
        for name, value in values.items():
            self.set(name, value)

    def merge(self, other: "StepMetrics") -> None:
        """Add another StepMetrics' statistics to these, as if they had been recorded here."""
        for name, (total, count) in other.means.items():
            self.mean(name, total, count)
        for name, value in other.sums.items():
            self.sum(name, value)
        for name, value in other.maxima.items():
            self.max(name, value)
        for name, value in other.minima.items():
            self.min(name, value)
        self.update(other.values)

    @contextlib.contextmanager
    def timer(self, name: str):
        start = time.time()
        yield
        self.set(name, time.time() - start)

    def gpu_memory(self, device) -> None:
        """memory/peak_allocated_gib and memory/peak_reserved_gib: the most GPU memory this process's tensors held,
        and the most its caching allocator held, since the previous call (the first call: since the start, so
        the set-up's peak is in step 1), the largest rank's; then the peaks are reset. What the estimate of
        `python -m common.memory` predicts, measured. Nothing on a CPU: absent, not zero."""
        if device.type != "cuda":
            return
        import torch

        self.max("memory/peak_allocated_gib", torch.cuda.max_memory_allocated(device) / 2**30)
        self.max("memory/peak_reserved_gib", torch.cuda.max_memory_reserved(device) / 2**30)
        torch.cuda.reset_peak_memory_stats(device)

    def reduce(self, dist=None) -> dict[str, float]:
        """{name: number} over all ranks (every rank calls this; one all_gather). A mean whose counts
        add up to 0 is NaN: nothing was measured."""
        parts = [(self.means, self.sums, self.maxima, self.minima)]
        if dist is not None and dist.world_size > 1:
            import torch.distributed

            parts = [None] * dist.world_size
            torch.distributed.all_gather_object(parts, (self.means, self.sums, self.maxima, self.minima))
        means, sums, maxima, minima = {}, {}, {}, {}
        for rank_means, rank_sums, rank_maxima, rank_minima in parts:  # in rank order: deterministic sums
            for name, (total, count) in rank_means.items():
                accumulated = means.setdefault(name, [0.0, 0.0])
                accumulated[0] += total
                accumulated[1] += count
            for name, value in rank_sums.items():
                sums[name] = sums.get(name, 0.0) + value
            for name, value in rank_maxima.items():
                maxima[name] = _keep_nan(max, maxima.get(name, -math.inf), value)
            for name, value in rank_minima.items():
                minima[name] = _keep_nan(min, minima.get(name, math.inf), value)
        reduced = {name: total / count if count else math.nan for name, (total, count) in means.items()}
        return {**reduced, **sums, **maxima, **minima, **self.values}


def _keep_nan(pick, a: float, b: float) -> float:
    """max / min of two numbers that keeps a NaN visible (Python's max(-inf, nan) is -inf)."""
    return math.nan if math.isnan(a) or math.isnan(b) else pick(a, b)


class Tracker:
    """Writes a run's metrics (rank 0: enabled=True); the run is named after its folder."""

    def __init__(
        self,
        run_dir,
        config,
        tracking=None,
        enabled=True,
        resume_step: int | None = None,
    ):
        """`config`: the run's settings (config.json); `tracking`: common.flags.Tracking (None: no wandb)."""
        track = tracking is not None and tracking.track
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_dir = run_dir
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            kept = records_to_resume(self.path, resume_step)
            with open(self.path + ".tmp", "w") as f:  # a kill meanwhile leaves the file as it was
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)
        if "output_dir" in config:  # where the run is (a resumed run's own folder, whatever the command said)
            config = {**config, "output_dir": os.path.dirname(os.path.normpath(run_dir))}
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        if track:
            import wandb

            run_name = os.path.basename(os.path.normpath(run_dir))
            self.wandb = wandb.init(
                project=tracking.wandb_project_name,
                entity=tracking.wandb_entity,
                name=run_name,
                config=config,
                dir=run_dir,
                save_code=True,
                resume="allow",
                id=run_name.replace("/", "_"),
            )

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self, plot_keys: list[str]) -> str | None:
        """Finish wandb, plot `plot_keys` to curves.png, and say where the run folder and its plot are."""
        if not self.enabled:
            return None
        if self.wandb is not None:
            self.wandb.finish()
        plot = plot_curves(self.path, os.path.join(self.run_dir, "curves.png"), plot_keys)
        print(f"run folder: {self.run_dir}" + (f" (plot: {plot})" if plot else ""))
        return plot


def records_to_resume(path: str, resume_step: int, verbose: bool = True) -> list[str]:
    """The lines of a run's metrics.jsonl that a resume from `resume_step` keeps: its records up to
    that step. A last line that is not a whole record is what a kill while it was being written
    leaves: it is dropped (with a warning, `verbose`) and the run resumes. A damaged line before the
    last is not a kill's doing: a BadInput names the file and the line (checks.check_resume calls
    this before anything loads)."""
    from common.errors import BadInput

    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    kept = []
    for index, (number, line) in enumerate(lines):
        try:
            step = json.loads(line)["step"]
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                raise TypeError(f"its step is {step!r}")
        except (ValueError, KeyError, TypeError) as error:
            if index == len(lines) - 1:  # torn by a kill mid-write: its step is recomputed
                if verbose:
                    print(f"warning: {path}:{number}: the last line is not a whole record (the run "
                          "was killed while writing it?): dropped", file=sys.stderr)  # fmt: skip
                break
            what = "no 'step'" if isinstance(error, KeyError) else str(error).splitlines()[0]
            raise BadInput(
                f"{path}:{number}: not a metrics record ({what}), and not the last line (which a "
                "killed run may leave torn): the file was damaged or edited. Fix or remove the "
                "line, then resume"
            ) from None
        if step <= resume_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


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
    for axis in list(axes.flat)[len(series) :]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path
