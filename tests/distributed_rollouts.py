"""A step's rollouts as grpo.py draws them (its `rollout`, common.rollouts' PromptSampler and dynamic sampling)
on a scripted engine, on however many ranks this is launched with:

    torchrun --nproc_per_node 2 tests/distributed_rollouts.py OUT_PREFIX

Rank 0's engine gives informative groups from its first call, rank 1's only from its third call, so rank
0 is full after round 0 and rank 1 after round 2. Each rank writes OUT_PREFIX.rank<r>.json: the rounds it
counted, its engine calls, its groups, and the step's metrics reduced over ranks.

Also the scripted engine and tokenizer test_rollouts.py uses: prompt i is the token list [i]; a completion
is [1] * length (decoded "7", the right answer) or [2] * length ("8", a wrong one)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functools import partial
from types import SimpleNamespace

from algorithms import grpo
from common import flags, fsdp
from common.engines import Completion
from common.rollouts import PromptSampler
from common.tasks import Row
from common.tracking import StepMetrics


class DigitTokenizer:
    """Decodes a completion of 1s as "7" and one of 2s as "8" (bare answers, as on the built-in task)."""

    def batch_decode(self, token_ids, skip_special_tokens=True):
        return ["7" if ids and ids[0] == 1 else "8" for ids in token_ids]


class ScriptedEngine:
    """`informative(call, prompt)`: whether the group of `prompt` at generate call `call` (0, 1, ...) has
    one right answer among wrong ones; otherwise all G answers are wrong. `length(call, prompt, j)`:
    the j-th completion's token count; it is truncated ("length") when it reaches max_new_tokens."""

    def __init__(self, informative, length=lambda call, prompt, j: 1):
        self.informative, self.length, self.calls = informative, length, []

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p=1.0, top_k=0, sampling_mask=True):
        call = len(self.calls)
        self.calls.append([p[0] for p in prompt_ids])
        completions = []
        for prompt in self.calls[-1]:
            for j in range(n):
                token = 1 if j == 0 and self.informative(call, prompt) else 2
                length = min(self.length(call, prompt, j), max_new_tokens)
                completions.append(
                    Completion([token] * length, [-1.0] * length, "length" if length == max_new_tokens else "stop")
                )
        return completions


def scripted_step(engine, dist, step, metrics, num_rows=100, prompts_per_step=8, group_size=4, **options):
    """Step `step`'s groups over `num_rows` prompts [i] whose gold answer is "7", drawn as grpo.py's main() draws
    them; `options`: grpo.Args' dynamic_sampling, max_sampling_rounds, overlong_buffer, mask_truncated."""
    rows = [Row(f"question {i}", "7") for i in range(num_rows)]
    args = flags.make(grpo.Args, group_size=group_size, max_new_tokens=8, temperature=1.0, task="arith", **options)
    data = SimpleNamespace(prompts=[[i] for i in range(num_rows)], train_rows=rows)  # as common.tasks.RunPrompts
    sampler = PromptSampler(data, dist, prompts_per_step, 3, args.max_sampling_rounds)
    prompt_ids, rows = sampler.step_prompts(step)
    groups = grpo.rollout(engine, DigitTokenizer(), prompt_ids, rows, args, metrics)
    if args.dynamic_sampling:
        more = partial(grpo.rollout, engine, DigitTokenizer(), args=args, metrics=metrics)
        groups = sampler.dynamic_sampling(groups, step, more, metrics)
    return groups


def main(out_prefix):
    dist = fsdp.setup()
    engine = ScriptedEngine(lambda call, prompt: dist.rank == 0 or call >= 2)
    metrics = StepMetrics()
    groups = scripted_step(engine, dist, 5, metrics, dynamic_sampling=True, max_sampling_rounds=8)
    logged = metrics.reduce(dist)
    with open(f"{out_prefix}.rank{dist.rank}.json", "w") as f:
        json.dump(
            {
                "calls": engine.calls,
                "groups": len(groups.rows),
                "informative": int((groups.rewards.std(1) > 0).sum()),
                "rounds": metrics.values["sampling/rounds"],
                "logged": logged,
            },
            f,
        )
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(sys.argv[1])
