"""The mutation audit (tests/mutation_audit.py, on mutmut): a kept verdict stands for the code it judged, and CI judges
every audited function that changed since the audit was kept (the ratchet)."""

import os
import shutil
import subprocess
import sys

import mutation_audit as audit
import pytest
from helpers import REPO

GRPO = os.path.join(REPO, "algorithms", "grpo.py")


def _hashes(source):
    return {name: info["hash"] for name, info in audit.functions(source, audit.script_lines(source)).items()}


def test_a_verdict_stands_for_the_code_it_judged():
    """A function's hash changes with its code and with which of its lines are audited, not with a comment or the
    formatting; main() (a subprocess in every test) is not audited, update_policy and the ALGO LOGIC regions are."""
    with open(GRPO) as f:
        source = f.read()
    hashes = _hashes(source)
    assert {"clipped_surrogate_loss", "aggregate", "update_policy", "check_args"} <= set(hashes)
    assert "main" not in hashes and "rollout" not in hashes  # plumbing: no ALGO LOGIC line
    line = '        return (token_losses * mask).sum() / totals["tokens"]\n'
    assert source.count(line) == 1
    edited = {
        "a comment": source.replace(line, line.rstrip() + "  # a comment\n"),
        "a one-line change": source.replace(line, line.replace("tokens", "token_budget")),
    }
    assert _hashes(edited["a comment"]) == hashes
    changed = _hashes(edited["a one-line change"])
    assert {name for name in hashes if changed[name] != hashes[name]} == {"aggregate"}
    # the same code with one more of its lines audited (a region's END marker moved down) is another audit
    widened = source.replace(
        "    # END ALGO LOGIC\n    checks.refuse(problems)", "    checks.refuse(problems)\n    # END ALGO LOGIC"
    )
    assert widened != source and _hashes(widened)["check_args"] != hashes["check_args"]


def test_a_survivor_needs_a_reason():
    assert audit.reason({"original": "skipped += 1", "mutated": "skipped = 1"}) == ""
    device = {
        "original": 'x = torch.zeros(3, device=batch["advantages"].device)',
        "mutated": "x = torch.zeros(3, device=None)",
    }
    assert "CPU" in audit.reason(device)
    # a reason bound to one file: ISOPO's loss scaler is off (it refuses float16); grpo.py's is not
    unscaled = {"original": "scaler.unscale_(optimizer)", "mutated": "scaler.unscale_(None)"}
    assert "float16" in audit.reason(dict(unscaled, file="algorithms/isopo.py", function="update_policy"))
    assert audit.reason(dict(unscaled, file="algorithms/grpo.py")) == ""


@pytest.mark.slow
def test_the_kept_audit_judges_todays_code():
    """CI's ratchet: every audited function whose code differs from the kept audit's has its mutants judged now
    (nothing is kept; `tests/mutation_audit.py` keeps them), and a survivor without a reason fails."""
    done = subprocess.run(
        [sys.executable, "tests/mutation_audit.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.slow
def test_a_changed_function_whose_tests_were_weakened_fails_the_ratchet(tmp_path):
    """A one-line change to GSPO's completion_mean_logprob in a copy of the repository whose tests of grpo.py are
    cut down to one that only checks a shape: the ratchet judges that function's mutants (grpo.py's other functions
    are current and are not run), they survive, and it fails naming them."""
    copy = tmp_path / "repo"
    for folder in ("algorithms", "common"):
        shutil.copytree(os.path.join(REPO, folder), copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "tests", "mutation_audit_results"), copy / "tests" / "mutation_audit_results")
    for name in ("helpers.py", "conftest.py", "mutation_audit.py"):
        shutil.copy(os.path.join(REPO, "tests", name), copy / "tests")
    shutil.copy(os.path.join(REPO, "pytest.ini"), copy)
    os.symlink(os.path.join(REPO, ".cache"), copy / ".cache")  # the built-in models
    script = copy / "algorithms" / "grpo.py"
    line = "    per_completion = (values * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)\n"
    source = script.read_text()
    assert source.count(line) == 1
    script.write_text(source.replace(line, line.replace("clamp(min=1)", "clamp(min=1.0)")))
    weak = "import torch\nfrom algorithms import grpo\n\n\ndef test_shape():\n    x = torch.ones(2, 3)\n"
    weak += "    assert grpo.completion_mean_logprob(x, x).shape == (2, 3)\n"
    (copy / "tests" / "test_grpo.py").write_text(weak)
    for name in ("test_scripts.py", "test_bad_input.py"):  # grpo.py's other tests, emptied
        (copy / "tests" / name).write_text("")
    command = [sys.executable, str(copy / "tests" / "mutation_audit.py"), "grpo", "--check", "--repo", str(copy)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    assert "judging 1 functions: algorithms/grpo.py:completion_mean_logprob" in done.stdout
    failures = [line for line in done.stdout.splitlines() if line.startswith("  algorithms/grpo.py")]
    survivors = [line for line in failures if line.startswith("  algorithms/grpo.py completion_mean_logprob: ")]
    assert survivors and len(failures) == len(survivors) + 1, done.stdout  # and the file's score fell
    assert "of its mutants killed" in failures[-1] and "in the kept audit" in failures[-1]
