"""Held-out evaluation: greedy accuracy, and avg@k / pass@k from k samples per prompt.

    metrics = evaluate(engine, tokenizer, rows, task="arith", k=4, max_new_tokens=16)
"""

from __future__ import annotations

from math import comb

from common.reward import check_answer, encode_prompt


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021, arXiv:2107.03374)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(
    engine, tokenizer, rows, task: str, k: int, max_new_tokens: int, temperature: float = 1.0,
    use_chat_template: bool = True, dist=None,
) -> dict[str, float]:
    """Greedy accuracy, avg@k (mean accuracy of k samples) and pass@k over `rows`. With `dist` (several
    ranks), each rank scores every world_size-th row and the means are combined over ranks."""
    if dist is not None and dist.world_size > 1:
        from common.fsdp import all_reduce, all_reduce_dict

        local_rows = rows[dist.rank :: dist.world_size]
        local = evaluate(engine, tokenizer, local_rows, task, k, max_new_tokens, temperature, use_chat_template)
        weighted = all_reduce_dict({key: value * len(local_rows) for key, value in local.items()}, dist)
        return {key: value / all_reduce(len(local_rows), dist) for key, value in weighted.items()}
    prompts = [encode_prompt(row.question, tokenizer, task, use_chat_template) for row in rows]
    bare = task == "arith"

    greedy = score_completions(engine.generate(prompts, 1, max_new_tokens, 0.0), rows, 1, tokenizer, bare)
    metrics = {
        "eval/greedy_accuracy": sum(s.correct for s in greedy) / len(rows),
        "eval/greedy_no_answer_rate": sum(not s.found for s in greedy) / len(rows),
    }
    if k > 0:
        sampled = score_completions(engine.generate(prompts, k, max_new_tokens, temperature), rows, k, tokenizer, bare)
        correct_per_prompt = [sum(s.correct for s in sampled[i * k : (i + 1) * k]) for i in range(len(rows))]
        metrics[f"eval/avg@{k}"] = sum(correct_per_prompt) / (k * len(rows))
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(k, c, k) for c in correct_per_prompt) / len(rows)
    return metrics


def score_completions(completions, rows, n: int, tokenizer, bare: bool):
    """Score each completion against its prompt's gold answer (prompt i owns completions[i*n:(i+1)*n])."""
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return [check_answer(text, rows[i // n].answer, bare) for i, text in enumerate(texts)]
