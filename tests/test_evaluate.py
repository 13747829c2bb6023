"""Evaluation: the unbiased pass@k estimator, and the command that scores any model or checkpoint."""

import itertools
import json

import pytest
from helpers import run_script

from common.evaluate import evaluate, pass_at_k


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (5, 2), (6, 3), (8, 8)])
def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_correct_sample(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_a_rank_left_without_held_out_rows_scores_zeros_under_every_key(tiny):
    """Fewer held-out rows than ranks (--eval-prompts 4 on 8 GPUs): a rank with none divided by zero. Its zeros
    count for nothing in the ranks' combined means (weighted by its 0 rows), and it has every key the all-reduce
    expects."""
    keys = ["eval/greedy_accuracy", "eval/greedy_no_answer_rate", "eval/avg@4", "eval/pass@1", "eval/pass@2"]
    assert evaluate(None, tiny[1], [], "arith", 4, 8) == dict.fromkeys([*keys, "eval/pass@4"], 0.0)


def test_evaluate_command_on_the_tiny_model():
    result = run_script("-m", "common.evaluate", "--k", 4, "--prompts", 32, "--engine", "hf")
    metrics = json.loads(result.stdout[result.stdout.index("{") :])
    assert metrics["prompts"] == 32
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/avg@4"])  # pass@1 is the mean accuracy
    assert metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"]
    # greedy answers do not depend on a sample: 8 of the 32 right on one build (0.25); a build that reached the warm
    # start's 20% sampled accuracy is far from getting none or all of them
    assert 0 < metrics["eval/greedy_accuracy"] < 1


def test_evaluate_command_rejects_bad_input():
    assert "unknown task" in run_script("-m", "common.evaluate", "--task", "nope", check=False).stderr
    assert "--k must be >= 1" in run_script("-m", "common.evaluate", "--k", 0, check=False).stderr


def test_evaluate_command_refuses_a_generation_longer_than_the_context_before_loading():
    """The built-in model's context is 256 tokens: prompt + 250 new tokens cannot fit, say so up front."""
    result = run_script("-m", "common.evaluate", "--max-new-tokens", 250, "--prompts", 4, check=False)
    assert result.returncode != 0
    assert "+ --max-new-tokens 250 exceeds" in result.stderr and "context of 256 tokens" in result.stderr
