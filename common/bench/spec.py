"""What a suite is made of: Config (a script and its flags), Panel (a plotted metric), Suite (the configs,
panels, steps and table of one experiment), and REPO. The bench is three files, each importing only the
ones above it in this list, so there is no import cycle:

    spec.py     these dataclasses (imports nothing of the bench)
    suites.py   the suites, what is measured: SUITES, QUICK, the long-response model (imports spec.py)
    runner.py   what runs them: runs, resuming, summaries, tables, plots, the command line (imports both)

The dataclasses are here rather than in runner.py because runner.py needs SUITES: suites.py importing them
from runner.py would be a cycle.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Config:
    label: str  # the legend's name
    script: str  # algorithms/<script>.py
    flags: tuple[str, ...] = ()


X_AXES = {"step": "step", "time": "training wall-clock (s)", "kl_drift": "KL(π_θ ‖ π_0) per token"}


@dataclass(frozen=True)
class Panel:
    key: str  # a metric of metrics.jsonl, or "kl_drift" (measured from the checkpoints)
    title: str
    x: str = "step"  # step | time (training seconds, evaluations excluded) | kl_drift
    labels: tuple[str, ...] | None = None  # only these configs (default: all)

    def __post_init__(self):
        if self.x not in X_AXES:
            raise ValueError(f"Panel {self.title!r}: x must be one of {', '.join(X_AXES)}, not {self.x!r}")


@dataclass
class Suite:
    name: str
    title: str
    configs: list[Config]
    panels: list[Panel]
    steps: int = 60
    flags: tuple[str, ...] = ()  # given to every config
    kl_drift: bool = False  # measure KL(π_θ ‖ π_0) at every checkpoint
    baseline: str | None = None  # a config's label: the others are judged against it (the "fails" column)
    # with labels "setting · method": the method every other one is compared with in its own setting (the
    # "verdict" column: whether the other method prevents the failure this one shows there)
    reference: str | None = None
    columns: tuple[tuple[str, str], ...] = ()  # (metric, header): its mean over every training step, extra columns
    extra_figures: dict[str, list[Panel]] = field(default_factory=dict)
    accuracy: bool = True  # the table's held-out accuracy columns (False: a cost table, the model learns nothing)
    checkpoints: int = 3  # per run at most, the last at the end (the KL-drift points; each a point to resume from)
    prepare: Callable[[], object] | None = None  # builds what the runs need (a model) before they start
