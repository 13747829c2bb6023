"""Multi-turn rollouts with tools (common/tools.py): the engines stop at a call, the episode is the policy's tokens and
the tools' outputs (token in, token out), the limits, errors and time-outs, and the math of a method that runs along
the response skipping a tool's output. What every script does with a tool's tokens: test_scripts.py
(test_a_tool_output_is_context_not_action)."""

import dataclasses
import textwrap

import pytest
import torch

from algorithms.ema_kpo import ema_filter
from algorithms.gtpo import conflict_masks
from common import tools
from common.engines import Completion, HFEngine, per_prompt_budgets
from common.errors import BadInput
from common.task_files import load_task_file
from common.tools import ToolEngine, policy_first, restore_order
from common.tracking import StepMetrics

CALCULATOR = textwrap.dedent(
    """
    import time

    def rows(split):
        return [{"question": "Q: 2*3="}]

    def score(completion, row):
        return 0.0

    def multiply(expression):
        if expression == "hang":
            time.sleep(600)
        if expression == "bytes":
            return b"\\x00"  # the task file's mistake: the run stops
        if expression == "file":
            return "caf\\udce9.txt"  # os.fsdecode of a Latin-1 name: a lone surrogate, which UTF-8 cannot hold
        if expression == "object":
            return Unprintable()
        a, b = expression.split("*")  # "boom": ValueError
        return int(a) * int(b)  # not a string: shown as str()

    class Unprintable:
        def __str__(self):
            raise ValueError("no text")

    TOOLS = {"calc": multiply}
    TOOL_SECONDS = 2
    """
)


@pytest.fixture
def calculator(tmp_path):
    path = tmp_path / "calculator.py"
    path.write_text(CALCULATOR)
    return load_task_file(str(path))


class ScriptedPolicy:
    """An engine whose next turn is `script(context text)`, with log-prob −0.5 per token; it records every context it
    is given as token ids, and honours max_new_tokens (one, or one per context) and the stop strings as the real
    engines do. With `max_model_len` it refuses a request as vLLM does: a context + its budget past the length."""

    def __init__(self, tokenizer, script, max_model_len=None):
        self.tokenizer, self.script, self.contexts, self.max_model_len = tokenizer, script, [], max_model_len

    def generate(self, contexts, n, max_new_tokens, temperature, top_p=1.0, top_k=0, ignore_eos=False, stop=(), **_):
        turns, budgets = [], per_prompt_budgets(max_new_tokens, len(contexts))
        for context, max_new_tokens in zip(contexts, budgets):
            if self.max_model_len and len(context) + max_new_tokens > self.max_model_len:
                raise ValueError(f"{len(context)} + {max_new_tokens} tokens exceed max_model_len {self.max_model_len}")
            for _ in range(n):
                self.contexts.append(list(context))
                text = self.script(self.tokenizer.decode(context))
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ends = text.endswith("$") or any(text.endswith(s) for s in stop)
                ids = (ids[:-1] + [self.tokenizer.eos_token_id]) if text.endswith("$") else ids
                finish = "stop" if ends and len(ids) <= max_new_tokens else "length"
                ids = ids[:max_new_tokens]
                mask = torch.tensor(ids, dtype=torch.int32)[:, None] if top_k else None
                turns.append(Completion(ids, [-0.5] * len(ids), finish, sampling_mask=mask))
        return turns


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_transformers_engine_stops_where_a_stop_string_completes(tiny):
    """Same seed with and without a stop string: each completion is the unstopped one up to the token that completes
    the string (its log-probs too), ending "stop"; a completion without the string is unchanged."""
    model, tokenizer = tiny
    engine, prompts = HFEngine(model, tokenizer), [encode(tokenizer, "Q: 37+48="), encode(tokenizer, "Q: 5+6=")]
    torch.manual_seed(0)
    free = engine.generate(prompts, 16, 6, 1.0)
    torch.manual_seed(0)
    stopped = engine.generate(prompts, 16, 6, 1.0, stop=("8",))
    cut = 0
    for whole, part in zip(free, stopped):
        text = tokenizer.decode(whole.token_ids)
        if "8" in text:
            end = text.index("8") + 1  # one character per token
            assert part.token_ids == whole.token_ids[:end] and part.finish_reason == "stop"
            assert part.logprobs == pytest.approx(whole.logprobs[:end], abs=1e-6)
            cut += end < len(whole.token_ids)
        else:
            assert (part.token_ids, part.finish_reason) == (whole.token_ids, whole.finish_reason)
    assert cut > 0


def test_an_episode_is_the_policys_turns_and_the_tools_outputs_token_in_token_out(tiny, calculator):
    _, tokenizer = tiny
    script = lambda context: "<calc>2*3</calc>" if "<result>" not in context else " #### 6$"
    policy = ScriptedPolicy(tokenizer, script)
    engine = ToolEngine(policy, tokenizer, calculator, max_turns=4, max_episode_tokens=100)
    prompt = encode(tokenizer, "Q: 2*3=")
    (episode,) = engine.generate([prompt], 1, 50, 1.0)
    call, result, answer = (encode(tokenizer, t) for t in ("<calc>2*3</calc>", "<result>6</result>", " #### 6"))
    assert episode.token_ids == call + result + answer + [tokenizer.eos_token_id]
    assert episode.tool_mask == [0] * len(call) + [1] * len(result) + [0] * (len(answer) + 1)
    assert episode.logprobs == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * (len(answer) + 1)
    assert (episode.finish_reason, episode.turns, episode.tool_calls, episode.tool_errors) == ("stop", 2, 1, 0)
    assert episode.policy_length == len(call) + len(answer) + 1
    # the second turn continues from the episode's own token ids: nothing was decoded and encoded again
    assert policy.contexts == [prompt, prompt + call + result]
    assert tools.later_turns(episode) == [0] * len(call) + [1] * (len(result) + len(answer) + 1)


def test_a_tool_result_with_braces_of_its_own_shows_the_output_in_its_one_pair(tiny, calculator):
    """TOOL_RESULT is checked to hold one {} where the output goes; other braces (a JSON wrapper) stay as they are:
    str.format read '{"output": {}}' as a field named '"output"' and stopped the run at the first call."""
    _, tokenizer = tiny
    toolbox = dataclasses.replace(calculator, tool_result='{"output": {}}')
    script = lambda context: "<calc>2*3</calc>" if "output" not in context else " #### 6$"
    engine = ToolEngine(ScriptedPolicy(tokenizer, script), tokenizer, toolbox, max_turns=4, max_episode_tokens=100)
    (episode,) = engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 50, 1.0)
    shown = [t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool]
    assert tokenizer.decode(shown) == '{"output": 6}'


def test_errors_and_time_outs_are_answered_and_counted_and_the_worker_is_replaced(tiny, calculator):
    _, tokenizer = tiny
    calls = iter(["<calc>boom</calc>", "<calc>hang</calc>", "<calc>4*5</calc>", "done$"])
    engine = ToolEngine(ScriptedPolicy(tokenizer, lambda _: next(calls)), tokenizer, calculator, 5, 400)
    (episode,) = engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 100, 1.0)
    text = tokenizer.decode([t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool])
    assert text.startswith("<result>error: ValueError: not enough values to unpack")
    assert "<result>error: the tool ran past 2 s</result><result>20</result>" in text  # a new worker answered
    assert (episode.tool_calls, episode.tool_errors, episode.tool_timeouts, episode.turns) == (3, 2, 1, 4)


def test_an_output_without_utf8_or_without_text_is_answered_not_fatal(tiny, calculator):
    """A lone surrogate in an output (os.fsdecode of a file name) is shown replaced: the tokenizer raised on it, in the
    trainer; an output whose str() raises is the tool's error, as a raise in the call (it ended the worker)."""
    _, tokenizer = tiny
    calls = iter(["<calc>file</calc>", "<calc>object</calc>", "done$"])
    engine = ToolEngine(ScriptedPolicy(tokenizer, lambda _: next(calls)), tokenizer, calculator, 5, 400)
    (episode,) = engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 100, 1.0)
    text = tokenizer.decode([t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool])
    assert text == "<result>caf?.txt</result><result>error: ValueError: no text (calculator.py:24)</result>"
    assert (episode.tool_calls, episode.tool_errors, episode.turns) == (2, 1, 3)


def test_a_tool_that_returns_bytes_stops_the_run_naming_it(tiny, calculator):
    _, tokenizer = tiny
    engine = ToolEngine(ScriptedPolicy(tokenizer, lambda _: "<calc>bytes</calc>"), tokenizer, calculator, 5, 400)
    with pytest.raises(BadInput, match="the tool 'calc' returned bytes, not a string"):
        engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 100, 1.0)


def test_the_limits_turns_policy_tokens_and_the_whole_episode(tiny, calculator):
    _, tokenizer = tiny
    always_call = lambda _: "<calc>2*3</calc>"  # 16 tokens a turn; the output <result>6</result> is 18
    prompt = encode(tokenizer, "Q: 2*3=")

    def run(max_turns, max_new_tokens, max_episode_tokens):
        engine = ToolEngine(
            ScriptedPolicy(tokenizer, always_call), tokenizer, calculator, max_turns, max_episode_tokens
        )
        return engine.generate([prompt], 1, max_new_tokens, 1.0)[0]

    last_turn_call = run(max_turns=2, max_new_tokens=100, max_episode_tokens=200)  # the second call is not run
    assert (last_turn_call.finish_reason, last_turn_call.turns, last_turn_call.tool_calls) == ("turns", 2, 1)
    assert last_turn_call.policy_length == 32
    own_tokens = run(max_turns=9, max_new_tokens=40, max_episode_tokens=200)  # 16 + 16 + 8 of the policy's own
    assert (own_tokens.finish_reason, own_tokens.policy_length, own_tokens.tool_calls) == ("length", 40, 2)
    whole = run(max_turns=9, max_new_tokens=100, max_episode_tokens=40)  # 16 + 18 + 6: the second turn is cut
    assert (whole.finish_reason, len(whole.token_ids), whole.policy_length) == ("length", 40, 22)
    cut_output = run(max_turns=9, max_new_tokens=100, max_episode_tokens=20)  # the output itself is cut
    assert (cut_output.finish_reason, len(cut_output.token_ids), sum(cut_output.tool_mask)) == ("length", 20, 4)
    last_token_call = run(max_turns=9, max_new_tokens=16, max_episode_tokens=200)  # the call took the last token
    assert (last_token_call.finish_reason, last_token_call.tool_calls, sum(last_token_call.tool_mask)) == (
        "length",
        0,
        0,
    )
    metrics = StepMetrics()
    tools.record_tool_use(metrics, [last_turn_call, own_tokens, whole, cut_output], max_new_tokens=40)
    assert metrics.means["tools/turn_limit_rate"] == [1, 4] and metrics.means["tools/policy_limit_rate"] == [1, 4]
    assert metrics.means["tools/episode_limit_rate"] == [2, 4] and metrics.means["tools/calls_per_episode"] == [5, 4]


def test_each_episode_asks_for_its_own_budget_within_the_engines_length(tiny, calculator):
    """A long prompt whose episode is bound by --max-episode-tokens beside a short one with more room: the next turn
    asks the engine for each episode's own budget, so an engine with vLLM's per-request rule (prompt + max_tokens
    within max_model_len) serves both; with the largest budget for every context it refused the whole batch."""
    _, tokenizer = tiny
    calls = {True: "<calc>99*99</calc>", False: "<calc>2*3</calc>"}  # 18 and 16 tokens; outputs of 21 and 18
    script = lambda context: calls["1+1" in context] if "<result>" not in context else "12$"
    long_prompt, short_prompt = encode(tokenizer, "Q: " + "1+" * 18 + "1="), encode(tokenizer, "Q: 2*3=")
    max_episode_tokens = 40  # after the output, the long prompt's episode has room for 1 more token, the other 6
    policy = ScriptedPolicy(tokenizer, script, max_model_len=len(long_prompt) + max_episode_tokens)
    engine = ToolEngine(policy, tokenizer, calculator, max_turns=4, max_episode_tokens=max_episode_tokens)
    long_episode, short_episode = engine.generate([long_prompt, short_prompt], 1, 30, 1.0)
    assert (long_episode.finish_reason, len(long_episode.token_ids)) == ("length", max_episode_tokens)
    assert (short_episode.finish_reason, len(short_episode.token_ids)) == ("stop", 16 + 18 + 3)  # its answer, whole
    assert policy.contexts[2:] == [
        long_prompt + long_episode.token_ids[:39],
        short_prompt + short_episode.token_ids[:34],
    ]


def test_a_call_without_its_opening_marker_is_an_error_and_the_sampling_mask_spans_the_episode(tiny, calculator):
    _, tokenizer = tiny
    script = lambda context: "2*3</calc>" if "<result>" not in context else "6$"
    engine = ToolEngine(ScriptedPolicy(tokenizer, script), tokenizer, calculator, 4, 100)
    (episode,) = engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 50, 1.0, top_k=5)
    output = tokenizer.decode([t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool])
    assert output == "<result>error: no <calc> opens the call</result>" and episode.tool_errors == 1
    assert episode.sampling_mask[:, 0].tolist() == episode.token_ids  # each turn's kept ids, and the outputs' own


def test_a_chat_models_json_tool_call(tiny, tmp_path):
    """TOOL_CALL = "json": one closing marker for every tool, the name and arguments read from the JSON (the tool gets
    the arguments as JSON text); malformed JSON and an unknown name are answered as errors, not run."""
    import json

    path = tmp_path / "chat_tools.py"
    path.write_text(
        CALCULATOR.replace("a, b = expression.split", "a, b = __import__('json').loads(expression)['x'].split")
        + "TOOL_CALL = 'json'\nTOOL_RESULT = '<tool_response>{}</tool_response>'\n"
    )
    _, tokenizer = tiny
    calls = iter(
        [
            '<tool_call>{"name": "calc", "arguments": {"x": "2*3"}}</tool_call>',
            "<tool_call>{name: calc}</tool_call>",
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
            "ok$",
        ]
    )
    engine = ToolEngine(ScriptedPolicy(tokenizer, lambda _: next(calls)), tokenizer, load_task_file(str(path)), 5, 1000)
    (episode,) = engine.generate([encode(tokenizer, "Q: 2*3=")], 1, 200, 1.0)
    outputs = tokenizer.decode([t for t, tool in zip(episode.token_ids, episode.tool_mask) if tool])
    outputs = (
        outputs.removeprefix("<tool_response>")
        .removesuffix("</tool_response>")
        .split("</tool_response><tool_response>")
    )
    assert outputs[0] == "6" and json.loads('{"x": "2*3"}') == {"x": "2*3"}
    assert outputs[1].startswith("error: the call is not a JSON object with a name (JSONDecodeError")
    assert outputs[2] == "error: no tool named 'search' (the tools: calc)"
    assert (episode.tool_calls, episode.tool_errors, episode.turns) == (3, 2, 4)
    nested = engine._parse_call("<tool_call>" + "[" * 100_000, None)  # a policy repeating "[": json's recursion
    assert nested[:2] == (None, None) and nested[2].startswith("the call is not a JSON object with a name (Recursion")


def test_a_filter_along_the_response_skips_a_tool_output():
    """EMA-KPO's lines: gathered policy-first, filtered, restored: at the policy's tokens the filter equals the one
    over the policy's tokens alone, whatever the tool's output holds."""
    z = torch.randn(3, 10, dtype=torch.float64)
    mask = torch.ones(3, 10)
    mask[0, 2:5] = 0  # a tool's output in the middle
    mask[1, 7:] = 0  # right padding only
    mask[2, 0:3] = 0  # an output first (cannot happen: shows the order is kept)
    gains = torch.full((10,), 0.3, dtype=torch.float64)
    order = policy_first(mask)
    filtered = restore_order(ema_filter((z * mask).gather(1, order), gains), order)
    for row in range(3):
        own = mask[row].bool()
        alone = ema_filter(z[row, own][None], gains)[0]
        assert torch.allclose(filtered[row, own], alone)
    assert torch.equal(policy_first(torch.tensor([[1, 1, 1, 0, 0]])), torch.arange(5)[None])  # no tools: identity


def test_gtpo_conflict_spans_skip_a_tool_output():
    """The same two groups with a tool's output inserted after the first token of some completions: the spans at the
    policy's tokens are the spans without it, and no output token is ever in a span."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8], [4, 6, 9, 8]])
    mask = torch.ones(4, 4)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    plain = conflict_masks(ids, mask, advantages, group_size=4)
    tool = torch.tensor([50, 51])
    with_tool = torch.stack(
        [torch.cat([row[:1], tool, row[1:]]) if i % 2 else torch.cat([row, tool]) for i, row in enumerate(ids)]
    )
    tool_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 1]] * 2, dtype=torch.float32)
    spans = conflict_masks(with_tool, tool_mask, advantages, group_size=4)
    for before, after in zip(plain, spans):
        for row in range(4):
            assert torch.equal(after[row][tool_mask[row].bool()], before[row]), row
        assert not after[~tool_mask.bool()].any()
    assert plain[0].any() and plain[1].any()  # there are spans to keep


# --- the built-in tool task -------------------------------------------------------------------


def _random_expression(generator, depth):
    if depth == 0 or generator.random() < 0.3:
        return str(generator.randint(0, 99))
    operator = generator.choice("+-*/")
    left, right = _random_expression(generator, depth - 1), _random_expression(generator, depth - 1)
    return f"({left}{operator}{right})" if generator.random() < 0.5 else f"{left} {operator} {right}"


def test_the_calculator_agrees_with_exact_python_arithmetic():
    """Random expressions against Python's own arithmetic on Fractions (eval is fine in a test, never in a tool)."""
    import random
    import re
    from fractions import Fraction

    from common.task_products import calculator

    generator, checked = random.Random(0), 0
    for _ in range(3000):
        expression = _random_expression(generator, 3)
        if len(expression) > 64:
            continue
        try:
            expected = eval(re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression), {"Fraction": Fraction})
        except ZeroDivisionError:
            with pytest.raises(ValueError, match="division by zero"):
                calculator(expression)
            continue
        assert Fraction(calculator(expression)) == expected, expression
        checked += 1
    assert checked > 1000
    for bad, message in [("2*", "ends too early"), ("x+1", "unexpected 'x'"), ("((1)", "not closed"), ("1" * 65, "64")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            calculator(bad)


def test_the_tool_task_rows_score_and_warm_start_targets():
    from common import task_products
    from common.tasks import load_task

    train, test = load_task("products", "train"), load_task("products", "test")
    assert (len(train), len(test)) == (7600, 500) and not {r.question for r in train} & {r.question for r in test}
    assert all(int(r.answer) == eval(r.question[3:-1]) for r in train[:50])
    row = test[0].data
    good, product = (
        f"<calc>{row['question'][3:-1]}</calc> = {row['answer']} #### {row['answer']}",
        row["answer"],
    )
    assert task_products.score(good, row) == 1.0 and task_products.score(f" #### {int(product) + 1}", row) == 0.0
    assert task_products.score(f"<calc>1*{product}</calc> = {product}", row) is None  # an output is no answer
    calls = sum("<calc>" in task_products.warm_start_target(r.data) for r in train) / len(train)
    assert 0.46 < calls < 0.54  # half
