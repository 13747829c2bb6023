"""Multi-turn rollouts with tools: the policy calls a tool, the tool's output joins the context, the policy goes on.

A task file (common/task_files.py) declares its tools; the built-in `sums-calc` task has a calculator:

    def calculator(expression): ...       # a tool: a function of a string that returns a string
    TOOLS = {"calc": calculator}          # the policy calls it by writing <calc>12*34</calc>
    TOOL_SECONDS = 5                      # optional: the time limit of one call (default 10)
    TOOL_RESULT = "<result>{}</result>"   # optional: how the output is shown to the policy (this is the default)
    TOOL_CALL = "json"                    # optional: a chat model's call, <tool_call>{"name": "calc", "arguments":
                                          # {...}}</tool_call> (Hermes / Qwen); the tool gets the arguments as JSON text

A chat model is told about its tools by the task's SYSTEM_PROMPT, and its TOOL_RESULT holds the chat template's turn
markers around the output (for Qwen: `<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n
<|im_start|>assistant\n`), so that the episode's tokens are what the template would have written.

    engine = with_tools(make_engine(...), tokenizer, task, tools, max_new_tokens)  # itself for a task without
    completions = engine.generate(prompt_ids, n=8, max_new_tokens=64, temperature=1.0)

An episode: the engine samples until an EOS or a call's closing marker (`</calc>`); the text between the call's
opening and closing markers goes to the tool, which runs in a worker process under the time limit (a user's tool is
the user's code: a tool that executes code needs a sandbox, which this project does not provide); its output,
formatted by TOOL_RESULT and tokenized, is appended to the episode, and the engine continues from the episode's token
ids, up to --max-turns turns of the policy. Token in, token out: the policy's own tokens are never decoded and encoded
again (only the tool's output is encoded). A call on the last turn is not run: the episode ends there ("turns").

A tool's output is context, not an action: `Completion.tool_mask` marks its tokens, and the scripts give them no
loss, no ratio and no place in any per-token statistic (their response mask is 0 there). --max-new-tokens bounds the
policy's own tokens of an episode, --max-episode-tokens all of them (the tools' included); an output that would pass
the episode's limit is cut there and ends the episode ("length"). A call that raises, names no tool, or runs out of
time is answered with `error: ...` and counted (tools/errors, tools/timeouts); a tool that ends its process is
answered `error: the tool exited`, with a warning on the console once. An output is cut at 100,000 characters
(common.task_files.OUTPUT_CHARS), and what a tool prints goes to stderr, bounded.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import torch

from common.engines import Completion
from common.errors import BadInput
from common.task_files import TaskFile, is_task_file, load_task_file, run_each


def toolbox_of(task: str) -> TaskFile | None:
    """The task file of `task` when it declares tools, else None."""
    if not is_task_file(task):
        return None
    task_file = load_task_file(task)
    return task_file if task_file.tools else None


def episode_tokens(task: str, max_new_tokens: int, tools) -> int:
    """Tokens after the prompt an episode may hold: --max-new-tokens without tools, --max-episode-tokens of `tools`
    (common.flags.Tools; 0: twice --max-new-tokens) with them. What the engine's context must fit beside the prompt."""
    if toolbox_of(task) is None:
        return max_new_tokens
    return tools.max_episode_tokens or 2 * max_new_tokens


def with_tools(engine, tokenizer, task: str, tools, max_new_tokens: int):
    """`engine`, or, for a task with tools, an engine that generates multi-turn episodes (this module's docstring)."""
    toolbox = toolbox_of(task)
    if toolbox is None:
        return engine
    if getattr(engine, "routing", None):
        raise BadInput(
            "routing replay (--router-replay) is not supported with tools yet: the episodes' routing is not kept"
        )
    return ToolEngine(engine, tokenizer, toolbox, tools.max_turns, episode_tokens(task, max_new_tokens, tools))


@dataclass
class Episode:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)  # top-p / top-k: each turn's kept ids [len, K]
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    finish: str = "stop"
    # (tool, argument, None), or (tool or None, None, what is wrong with it), of the call that ended the last turn
    call: tuple[str | None, str | None, str | None] | None = None

    @property
    def policy_tokens(self) -> int:
        return len(self.tokens) - sum(self.tool_mask)


class ToolEngine:
    """An engine whose `generate` returns whole episodes: policy turns and tool outputs (the module's docstring).
    Everything else (weight push, sleep, close) is the wrapped engine's."""

    def __init__(self, engine, tokenizer, toolbox: TaskFile, max_turns: int, max_episode_tokens: int):
        self.engine, self.tokenizer, self.toolbox = engine, tokenizer, toolbox
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        if toolbox.tool_call == "json":  # one marker for every tool: the name is in the JSON
            self.closing = {"</tool_call>": None}
        else:
            self.closing = {f"</{name}>": name for name in toolbox.tools}

    def __getattr__(self, name):  # load_weights, sleep, wake_up, close, dtype, ...
        return getattr(self.engine, name)

    def generate(
        self, prompt_ids, n, max_new_tokens, temperature, top_p=1.0, ignore_eos=False, top_k=0, sampling_mask=True
    ):
        sample = dict(temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
        sample |= dict(stop=tuple(self.closing), sampling_mask=sampling_mask)
        episodes = [Episode(prompt_ids[i // n]) for i in range(len(prompt_ids) * n)]
        turns = self.engine.generate(prompt_ids, n, max_new_tokens, **sample)
        active = episodes
        while True:
            for episode, turn in zip(active, turns):
                self._add_turn(episode, turn, max_new_tokens)
            active = [e for e in active if e.call is not None]
            # a call that took the policy's last token is not run (no turn could read its output): the episode ends
            active = [e for e in active if self._budget(e, max_new_tokens) > 0]
            if not active:
                break
            self._answer_calls(active)
            active = [e for e in active if e.finish == "stop"]  # not cut by the episode's limit
            budgets = [self._budget(e, max_new_tokens) for e in active]
            active = [e for e, budget in zip(active, budgets) if budget > 0]
            if not active:
                break
            contexts = [e.prompt + e.tokens for e in active]
            # each episode its own budget: another episode's larger one would take a long prompt's context past the
            # engine's length (vLLM checks prompt + max_tokens per request)
            turns = self.engine.generate(contexts, 1, [b for b in budgets if b > 0], **sample)
        return [self._completion(e) for e in episodes]

    def _room(self, episode: Episode, max_new_tokens: int) -> int:
        """The tokens the policy may still sample: within its own limit and the episode's."""
        return min(max_new_tokens - episode.policy_tokens, self.max_episode_tokens - len(episode.tokens))

    def _budget(self, episode: Episode, max_new_tokens: int) -> int:
        """The tokens the policy may sample in its next turn; an episode with none left ends ("length")."""
        budget = self._room(episode, max_new_tokens)
        if budget <= 0:
            episode.finish = "length"
        return budget

    def _add_turn(self, episode: Episode, turn: Completion, max_new_tokens: int) -> None:
        """The policy's tokens of one turn (cut to the episode's budget), and the call it ends with, if any."""
        budget = self._room(episode, max_new_tokens)
        tokens, cut = turn.token_ids[:budget], len(turn.token_ids) > budget
        episode.tokens += tokens
        episode.logprobs += turn.logprobs[: len(tokens)]
        episode.tool_mask += [0] * len(tokens)
        if turn.sampling_mask is not None:
            episode.masks.append(turn.sampling_mask[: len(tokens)])
        episode.turns += 1
        episode.finish, episode.call = ("length" if cut else turn.finish_reason), None
        if cut or turn.finish_reason != "stop" or not tokens:
            return
        # a closing marker stops the engine as it completes, so one in this turn's text is the call that ended it
        text = self.tokenizer.decode(tokens)
        closing = next((marker for marker in self.closing if marker in text), None)
        if closing is None:  # an EOS ended the turn: the episode is over
            return
        if episode.turns == self.max_turns:  # no turn left to read the output
            episode.finish = "turns"
            return
        episode.call = self._parse_call(text[: text.index(closing)], self.closing[closing])

    def _parse_call(self, body: str, name: str | None) -> tuple[str | None, str | None, str | None]:
        """(tool, argument, None), or (tool or None, None, the problem): the text of `<name>argument</name>`, or the
        JSON of `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (its arguments passed as JSON text)."""
        opening = "<tool_call>" if name is None else f"<{name}>"
        start = body.rfind(opening)
        if start < 0:
            return name, None, f"no {opening} opens the call"
        argument = body[start + len(opening) :]
        if name is not None:
            return name, argument, None
        try:
            call = json.loads(argument)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError, RecursionError) as error:  # RecursionError: [[[[... nested deep
            return None, None, f"the call is not a JSON object with a name ({type(error).__name__}: {error})"
        if name not in self.toolbox.tools:
            return None, None, f"no tool named {name!r} (the tools: {', '.join(self.toolbox.tools)})"
        return name, arguments if isinstance(arguments, str) else json.dumps(arguments), None

    def _answer_calls(self, episodes: list[Episode]) -> None:
        """Run every pending call (in the task file's worker, each under the time limit), then append each output."""
        toolbox = self.toolbox
        runnable = [e for e in episodes if e.call[2] is None]
        outcomes = run_each(toolbox, [("tool", *e.call[:2]) for e in runnable], toolbox.tool_seconds)
        answers = dict(zip(map(id, runnable), outcomes))
        for episode in episodes:
            outcome = answers.get(id(episode), ("raised", episode.call[2]))
            episode.calls += 1
            if outcome is None:
                episode.timeouts += 1
                output = f"error: the tool ran past {toolbox.tool_seconds:g} s"
            elif outcome[0] == "raised":
                output = f"error: {outcome[1]}"
            elif outcome[0] == "not a string":  # the task file's mistake, not the policy's: the run stops
                raise BadInput(
                    f"{toolbox.path}: the tool {episode.call[0]!r} returned {outcome[1]}, not a string (the policy "
                    "would read its repr): return text, e.g. decoded bytes"
                )
            elif outcome[0] == "exited":  # sys.exit, os._exit, a crash: a new worker takes the next
                output = "error: the tool exited"
                tool, argument = episode.call[:2]
                what = f"exited ({outcome[1]}) on the argument {argument!r:.200}"
                _warn_once(toolbox, tool, what)
            else:
                output = outcome[1]
            episode.errors += outcome is None or outcome[0] != "value"
            # the output where TOOL_RESULT's one {} is (not str.format: other braces, such as JSON's, stay)
            shown = toolbox.tool_result.replace("{}", output)
            ids = self.tokenizer(shown, add_special_tokens=False)["input_ids"]
            kept = ids[: self.max_episode_tokens - len(episode.tokens)]  # cut at the episode's limit
            episode.tokens += kept
            episode.logprobs += [0.0] * len(kept)
            episode.tool_mask += [1] * len(kept)
            if episode.masks:  # a tool's token was not sampled: its kept set is itself (never scored: masked)
                episode.masks.append(torch.tensor(kept, dtype=torch.int32)[:, None])
            episode.finish = "length" if len(kept) < len(ids) else "stop"

    def _completion(self, episode: Episode) -> Completion:
        mask = None
        if episode.masks:
            width = max(m.shape[1] for m in episode.masks)
            mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1]), value=-1) for m in episode.masks])
        return Completion(
            episode.tokens,
            episode.logprobs,
            episode.finish,
            sampling_mask=mask,
            tool_mask=episode.tool_mask,
            turns=episode.turns,
            tool_calls=episode.calls,
            tool_errors=episode.errors,
            tool_timeouts=episode.timeouts,
        )


_WARNED: set[tuple[str, str]] = set()  # (task file, tool) already warned about


def _warn_once(toolbox: TaskFile, tool: str, what: str) -> None:
    """A tool's own failure, on the console once per tool: later ones count in tools/errors."""
    if (toolbox.path, tool) in _WARNED:
        return
    _WARNED.add((toolbox.path, tool))
    print(
        f"warning: {toolbox.name}: the tool {tool} {what}; the policy reads `error: the tool "
        "exited`, and each such call counts in tools/errors (this warning is not repeated)",
        file=sys.stderr,
    )


def later_turns(completion: Completion) -> list[int]:
    """Per token of the completion: 1 after its first tool output (a later turn's), else 0."""
    if not completion.tool_mask or 1 not in completion.tool_mask:
        return [0] * len(completion.token_ids)
    first = completion.tool_mask.index(1)
    return [0] * first + [1] * (len(completion.token_ids) - first)


def record_tool_use(metrics, completions: list[Completion], max_new_tokens: int) -> None:
    """What the episodes did with their tools (a task with tools only)."""
    if all(c.tool_mask is None for c in completions):
        return
    episodes = len(completions)
    metrics.mean("tools/calls_per_episode", sum(c.tool_calls for c in completions), episodes)
    metrics.mean("tools/turns", sum(c.turns for c in completions), episodes)  # the policy's turns per episode
    metrics.sum("tools/errors", sum(c.tool_errors for c in completions))  # raised, no such call, or out of time
    metrics.sum("tools/timeouts", sum(c.tool_timeouts for c in completions))
    metrics.mean("tools/tool_tokens", sum(sum(c.tool_mask) for c in completions), episodes)  # per episode
    # which limit ended an episode cut short: the policy's own tokens (--max-new-tokens) or all of them
    policy_limit = sum(c.finish_reason == "length" and c.policy_length >= max_new_tokens for c in completions)
    metrics.mean("tools/policy_limit_rate", policy_limit, episodes)
    episode_limit = sum(c.finish_reason == "length" for c in completions) - policy_limit
    metrics.mean("tools/episode_limit_rate", episode_limit, episodes)  # --max-episode-tokens
    metrics.mean("tools/turn_limit_rate", sum(c.finish_reason == "turns" for c in completions), episodes)


def record_turn_mismatch(metrics, k3: torch.Tensor, mask: torch.Tensor, later: torch.Tensor | None) -> None:
    """Episodes with tools: the train-inference mismatch (k3 per token, [B, T]) of the first turn's response tokens,
    mismatch/kl_k3_first_turn, and of those after a tool's output (`later`: 1 there), mismatch/kl_k3_later_turns:
    a later turn continues from context the engine did not sample itself. Nothing without tools (`later` None)."""
    if later is None:
        return
    for turn, part in (("first_turn", mask * (1 - later)), ("later_turns", mask * later)):
        metrics.mean(f"mismatch/kl_k3_{turn}", (k3 * part).sum(), part.sum())


def policy_first(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] column order that moves each row's policy tokens (mask 1) to the front, in their order: a method whose
    math runs along the response (a filter, spans aligned by position) gathers with it, so that a tool's output in
    the middle of an episode is skipped as if absent, and scatters its result back with `restore_order`. The
    identity without tools (the mask is 1 up to each response's end)."""
    return torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)


def restore_order(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo `x.gather(1, order)`: the value computed at gathered column j returns to column order[:, j]."""
    return torch.empty_like(values).scatter_(1, order, values)
