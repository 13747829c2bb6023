"""Every algorithm file documents itself the same way: its docstring has the anatomy the README promises
and defines every metric the script logs."""

import ast
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "algorithms", "*.py")))
METRIC = r"(?:charts|losses|mismatch|conflict|correction|time|eval|isopo)/"


def documented_metrics(docstring: str) -> set[str]:
    """Metric names in a docstring, with its shorthands expanded: `charts/response_length_mean|max` is
    charts/response_length_mean and charts/response_length_max; `time/rollout|train` is time/rollout and
    time/train."""
    names = set()
    for token in re.findall(METRIC + r"[A-Za-z_@0-9|]+", docstring):
        prefix, rest = token.split("/", 1)
        first, *others = rest.split("|")
        names.add(f"{prefix}/{first}")
        stem = first.rsplit("_", 1)[0]
        for other in others:
            names.update({f"{prefix}/{other}", f"{prefix}/{stem}_{other}"})
    return names


def test_shorthand_expansion():
    assert documented_metrics("  charts/response_length_mean|max   x\n  time/rollout|train") >= {
        "charts/response_length_mean", "charts/response_length_max", "time/rollout", "time/train"}


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_docstring_anatomy_and_every_logged_metric(path):
    source = open(path).read()
    docstring = ast.get_docstring(ast.parse(source))
    for section in ("Implementation details", "Logged metrics", "Run it", "./run.sh bench", "arXiv"):
        assert section in docstring, f"{os.path.basename(path)}: no {section!r} in the docstring"
    if not path.endswith("grpo.py"):  # the baseline has no authors' code to differ from
        assert re.search(r"differences from the (authors'|frameworks') code", docstring, re.I)
    code = source[source.index(docstring.splitlines()[-1]) :]
    logged = set(re.findall(r'"(' + METRIC + r'[A-Za-z_@0-9]+)"', code))
    assert logged, "no metric found in the code"
    missing = sorted(logged - documented_metrics(docstring))
    assert not missing, f"{os.path.basename(path)} logs metrics its docstring does not define: {missing}"
