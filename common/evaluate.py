"""Held-out evaluation: greedy accuracy, and avg@k / pass@k from k samples per prompt.

    metrics = evaluate(engine, tokenizer, rows, task="arith", k=4, max_new_tokens=16)

As a command, it scores any checkpoint folder or Hugging Face model on a task's test split (a
local data file's held-out rows: the seeded 10% that training on the file holds out; with --whole-file,
every row, as a run given the file as --eval-task scored it):

    python -m common.evaluate --model runs/<run>/checkpoints/step_00000060 --task arith --k 16
    python -m common.evaluate --model Qwen/Qwen2.5-Math-1.5B --task aime24 --k 16 --max-new-tokens 4096 --engine vllm

It prints greedy accuracy, avg@k (the mean accuracy of k samples at --temperature, 1.0 as the papers
report) and the unbiased pass@j for j = 1, 2, 4, ... up to k, as one JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb
from typing import Literal

from common.flags import Group, Tools
from common.scoring import score_completions
from common.tasks import encode_prompt


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021, arXiv:2107.03374)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(
    engine,
    tokenizer,
    rows,
    task: str,
    k: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    use_chat_template: bool = True,
    dist=None,
) -> dict[str, float]:
    """Greedy accuracy, avg@k (mean accuracy of k samples) and pass@k over `rows`. With `dist` (several
    ranks), each rank scores every world_size-th row and the means are combined over ranks (a rank left without a
    row, fewer held-out rows than ranks, gives zeros weighted by its 0 rows)."""
    if dist is not None and dist.world_size > 1:
        from common.fsdp import all_reduce, all_reduce_dict

        local_rows = rows[dist.rank :: dist.world_size]
        local = evaluate(engine, tokenizer, local_rows, task, k, max_new_tokens, temperature, use_chat_template)
        weighted = all_reduce_dict({key: value * len(local_rows) for key, value in local.items()}, dist)
        return {key: value / all_reduce(len(local_rows), dist) for key, value in weighted.items()}
    prompts = [encode_prompt(row.question, tokenizer, task, use_chat_template) for row in rows]
    count = max(1, len(rows))  # no rows: zeros

    def scored(n, temperature):  # n completions of each row, scored (a rank without rows generates nothing)
        if not rows:
            return []
        return score_completions(engine.generate(prompts, n, max_new_tokens, temperature), rows, n, tokenizer, task)

    greedy = scored(1, 0.0)
    metrics = {
        "eval/greedy_accuracy": sum(s.correct for s in greedy) / count,
        "eval/greedy_no_answer_rate": sum(not s.found for s in greedy) / count,
    }
    if k > 0:
        sampled = scored(k, temperature)
        correct_per_prompt = [sum(s.correct for s in sampled[i * k : (i + 1) * k]) for i in range(len(rows))]
        metrics[f"eval/avg@{k}"] = sum(correct_per_prompt) / (k * count)
        for j in sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k}):
            metrics[f"eval/pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct_per_prompt) / count
    return metrics


class Evaluator:
    """A training run's held-out evaluation: `evaluate` on the run's held-out rows (common.tasks.RunPrompts) with
    its settings, every --eval-every steps (common.flags.Evaluation; 0: never) and at the last step."""

    def __init__(self, engine, tokenizer, prompts, evaluation, max_new_tokens: int, temperature: float, dist):
        self.engine, self.tokenizer, self.rows, self.dist = engine, tokenizer, prompts.eval_rows, dist
        self.task, self.use_chat_template = prompts.eval_task, prompts.use_chat_template
        self.every, self.k = evaluation.eval_every, evaluation.eval_k
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after `step` (0: before training)."""
        return bool(self.every) and (step % self.every == 0 or step == last_step)

    def __call__(self) -> dict[str, float]:
        """eval/greedy_accuracy, eval/avg@k and eval/pass@k on the held-out rows (evaluate). Its samples leave the
        training run's random stream as they found it (the transformers engine draws from torch's): a run extended
        past its old last step, where it evaluated, goes on as one that ran straight through."""
        import torch

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            return evaluate(
                self.engine,
                self.tokenizer,
                self.rows,
                self.task,
                self.k,
                self.max_new_tokens,
                self.temperature,
                self.use_chat_template,
                self.dist,
            )


@dataclass
class EvalArgs:
    model: str = "tiny"
    """a checkpoint folder, a Hugging Face model id or local folder, or `tiny` (the built-in model of --task)"""
    task: str = "arith"
    """task whose test split is scored (as in the training scripts' --task); a local data file has
    none: its held-out rows are, the seeded 10% a training run on it never trains on"""
    whole_file: bool = False
    """a local data file: score every row, as a training run scores a file it was given as --eval-task"""
    k: int = 16
    """samples per prompt for avg@k and pass@j (j = 1, 2, 4, ... up to k)"""
    prompts: int = 0
    """score only the first this many prompts (0: all)"""
    max_new_tokens: int = 16
    """maximum completion length (a task with tools: the policy's own tokens of an episode)"""
    temperature: float = 1.0
    """sampling temperature for the k samples (greedy accuracy is always computed)"""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one"""
    question_column: str = "question"
    """question column of a local task file"""
    answer_column: str = "answer"
    """answer column of a local task file"""
    seed: int = 0
    """sampling seed"""
    tools: Group[Tools] = field(default_factory=Tools)


def main() -> None:
    import json
    import os
    import sys

    import torch
    import tyro
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import adapters, checks
    from common.engines import engine_kind, load_tokenizer, make_engine
    from common.errors import BadInput
    from common.tasks import load_task, load_train_and_eval, same_task
    from common.tiny import resolve_model
    from common.tools import episode_tokens, with_tools

    description = "Score a model on a task's test split: greedy, avg@k, pass@j."
    args = tyro.cli(EvalArgs, prog="python -m common.evaluate", description=description)
    # The scripts' checks of the flags this command shares with them: --max-new-tokens for the
    # task, --temperature, the tools' flags (with a task that has tools only), the columns (with a
    # data file only), the built-in model of the task.
    problems = checks.require(args.k >= 1, "--k", ">= 1")
    problems += checks.require(args.prompts >= 0, "--prompts", ">= 0 (0: all)")
    problems += checks.shared_flags(args) + checks.vllm_install_problems(args.engine, "--engine")
    torch.manual_seed(args.seed)
    columns = args.question_column, args.answer_column
    problems += checks.require(
        not args.whole_file or checks.is_data_file(args.task), "--whole-file", "used with a local data file as --task"
    )
    checks.refuse(problems)
    if args.whole_file:  # a file held out whole (a training run's --eval-task FILE)
        rows, split = load_task(args.task, "train", *columns), "all rows"
    elif checks.is_data_file(args.task):  # no test split: the seeded 10% a training run holds out
        rows, split = load_train_and_eval(args.task, None, *columns)[1], "held-out"
    else:
        rows, split = load_task(args.task, "test", *columns), "test"
    rows = rows[: args.prompts or None]
    where = "all rows" if args.whole_file else f"the {split} split"
    print(f"scoring {len(rows)} prompts of {where} of {args.task}", file=sys.stderr)
    path = resolve_model(args.model, args.task, adapter=True)  # a --lora-rank checkpoint too
    if checks.is_data_file(args.task) and os.path.isfile(os.path.join(path, "trainer_state.pt")):
        # a run with an --eval-task file of its own trained on every row of its --task file
        trained = checks.read_checkpoint_file(path, "trainer_state.pt").get("args", {})
        other_eval = trained.get("eval_task") and not same_task(trained["eval_task"], trained.get("task", ""))
        if trained.get("task") and same_task(trained["task"], args.task) and other_eval:
            print(f"warning: the run of {args.model} trained on every row of {args.task} (its --eval-task was "
                  f"{trained['eval_task']}): these rows are not held out from it", file=sys.stderr)  # fmt: skip
    adapter = adapters.is_adapter_folder(path)  # a --lora-rank checkpoint: base and adapter, merged
    base = adapters.existing_base(path) if adapter else path  # a base moved since the run: named
    if os.path.isdir(path):  # a checkpoint or a local model: a truncated weights file is named, not a traceback
        checks.check_checkpoint_files(path, weights_only=True)
    tokenizer = load_tokenizer(path)
    # the engine's context holds the longest prompt plus --max-new-tokens (a whole episode's tokens with tools; the
    # trainer bounds it the same way): checked before any weights are loaded
    longest = max(len(encode_prompt(row.question, tokenizer, args.task, args.chat_template)) for row in rows)
    config = AutoConfig.from_pretrained(base)
    model_limit, new_tokens = config.max_position_embeddings, episode_tokens(args.task, args.max_new_tokens, args.tools)
    if longest + new_tokens > model_limit:
        what = f"--max-new-tokens {args.max_new_tokens}"
        what += f" ({new_tokens} tokens an episode with tools)" if new_tokens != args.max_new_tokens else ""
        raise BadInput(
            f"the longest prompt ({longest} tokens) + {what} exceeds {args.model}'s context of {model_limit} tokens: "
            "lower --max-new-tokens"
        )
    kind = engine_kind(args.engine)
    model = None
    if kind == "hf" or adapter:  # vLLM loads its own weights: no second copy on the GPU
        model = (
            adapters.load_merged(path, checks.base_dtype_of(path))
            if adapter
            else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        )
        model.to("cuda" if torch.cuda.is_available() and kind == "hf" else "cpu")
    context, seed = longest + new_tokens, args.seed
    engine = make_engine(kind, model, tokenizer, model_path=base, seed=seed, max_model_len=context)
    if adapter and kind == "vllm":  # vLLM starts from the base model: the merged weights are pushed
        engine.load_weights(model.state_dict().items())
    engine = with_tools(
        engine, tokenizer, args.task, args.tools, args.max_new_tokens
    )  # a task with tools: multi-turn episodes (common/tools.py)
    metrics = evaluate(
        engine, tokenizer, rows, args.task, args.k, args.max_new_tokens, args.temperature, args.chat_template
    )
    engine.close()
    header = {"model": args.model, "task": args.task, "split": split, "prompts": len(rows)}
    print(json.dumps({**header, **metrics}, indent=2))


if __name__ == "__main__":
    from common.errors import clear_errors

    with clear_errors():  # a bad flag, file or model: one line that names it, not a traceback
        main()
