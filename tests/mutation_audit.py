"""Mutation audit, on mutmut 3 (https://github.com/boxed/mutmut): which lines of a method can be broken with
every fast test still green?

    .venv/bin/python tests/mutation_audit.py              # the functions changed since the kept audit (CI does this)
    .venv/bin/python tests/mutation_audit.py --all        # every target function again (about an hour on 2 cores)
    .venv/bin/python tests/mutation_audit.py grpo --list  # grpo.py's functions and whether their verdicts are current
    .venv/bin/python tests/mutation_audit.py --rejudge --only update_policy  # after new tests: survivors' functions

The lines mutated are each script's `# ALGO LOGIC` regions and its `update_policy`, and the common/ functions that
carry the methods' math (COMMON). mutmut writes every mutant of a function beside the original (operators, numbers,
names, arguments swapped, calls dropped) and runs, for each, the fast tests that called that function in a first
clean run: a mutant is *killed* when one of them fails. It runs in a scratch copy of the repository.

The verdicts are kept per function in tests/mutation_audit_results/results.jsonl, each under the hash of the code it
judged (the function's code, comments and formatting apart, and which of its statements are mutated) and the commit it
was judged at. A function whose hash differs from its kept one is *stale*: its verdicts do not count, and a run judges
it again. A survivor needs a reason (REASONS: a message's wording, a second path to the same numbers) or a test that
kills it. The ratchet, which CI runs (`--check`, tests/test_mutation_audit.py): a run fails when a function it judged
has a survivor without a reason that the kept verdicts of that function did not have, or when a file's share of killed
mutants falls. summary.md lists every file's score and its survivors, with or without a reason.

What mutmut does not reach: a decorated function (isopo.py's capture(), a context manager), and main(), whose tests
start it as a subprocess, which mutmut's switch between mutants does not reach; summary.md lists them as not audited."""

import argparse
import ast
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize

from helpers import ALGORITHMS, REPO

ROOT = REPO  # the repository audited (--repo: another copy of it)
RESULTS = os.path.join("tests", "mutation_audit_results")
# common/ files, the functions of each whose math a method uses (None: all), and the tests that look at them
COMMON = {
    "common/logprobs.py": (
        ["post_head_logits", "chunked_scores", "_scores", "log_softmax_gather", "_same"],
        ["tests/test_logprobs.py"],
    ),
    "common/batches.py": (None, ["tests/test_batches.py", "tests/test_grpo.py"]),
    "common/moe.py": (None, ["tests/test_moe.py", "tests/test_tis_icepop.py"]),
    "common/rollouts.py": (
        ["RolloutQueue", "record_staleness"],
        ["tests/test_rollouts.py", "tests/test_moe.py", "tests/test_no_run_lost.py"],
    ),
}
# Survivors that may stay, each with its reason: (the original line, the mutated line: regular expressions, both
# searched), reason[, where: a regular expression searched in "file:function" (any without it)]
REASONS = [
    # isopo.weighted_gradient: which side of the one GEMM the weights multiply (the cheaper); the product is the same
    (r"^if g\.shape\[-1\] >= a\.shape\[-1\]:", "", "a choice of the cheaper side: both give the same Σ_t w_t g_t a_tᵀ"),
    (r"^return g\.flatten\(0, 1\)\.T @ \(a \* weights", "", "the same product as the other side's"),
    (
        r"device",
        r"device=None|, None\)|, \)|\.to\(None\)",
        "where a tensor is made: these tests run on the CPU, the one device",
    ),
    (r"dist\.world_size", "", "one process here, world size 1: the two-rank runs (torchrun, test_fsdp.py) judge it"),
    (r"zero_grad\(set_to_none=True\)", "", "zeroed gradients and none make the same next step (memory only)"),
    (r'^metrics\.mean\("losses/grad_norm", grad_norm, 1\)', r", 2\)$", "one weight for every minibatch: the same mean"),
    (
        r"^if torch\.isfinite\(grad_norm\) and math\.isfinite\(minibatch_loss\):",
        r" or ",
        "a loss that is not finite makes the gradient not finite (its backward): `or` skips the same steps",
    ),
    (r"by_length=False", r"by_length=None", "None is false as False is: the same micro-batches"),
    # micro-batches (memory only) change no number: test_micro_batches_change_no_number
    (r"by_length=args\.ess_scope", r"by_length=None", "micro-batches by length save padding only: the same numbers"),
    (
        r"len\(minibatch\) <= args\.micro_batch_size",
        r" < ",
        "a step of one micro-batch: the no-grad pass's e_B is the forward's",
    ),
    (
        r"collections\.Counter\(",
        r"Counter\((\w+=0\.0(, ?)?)*\)",
        "a Counter counts a missing key from 0: the same sums",
    ),
    (r"argsort\(descending=True, stable=True\)", "", "blocks of one length in another order: the same sums, reordered"),
    # the Kalman filter is the EMA at the Kalman gains (Eq. 9 = Eqs. 4-7, test_kalman_filter_equals_the_scheduled_ema)
    (r'args\.smoother == "kalman"', "", "the Kalman filter and the EMA at its gains are one filter (Eq. 9 = Eqs. 4-7)"),
    (r"scaler\.unscale_\(optimizer\)", "", "ISOPO refuses float16: its loss scaler is off", r"isopo\.py:"),
    (r'float\("-inf"\)', r'float\("-INF"\)', "float() reads inf in any case"),
    (r"torch\.einsum\(", r'einsum\("[A-Z,>-]+"', "einsum's subscripts in capitals: the same contraction"),
    (r"nan_to_num\(total, nan=0\.0\)", r"nan_to_num\(total, (nan=None)?\)", "nan_to_num's default is nan=0.0"),
    # any block size gives the same filter (test_vectorized_filter_any_length_and_block)
    (r"block: int = 64", "", "the block size is speed, not the numbers (any block: the same filter)"),
    (r"clamp\(min=-50\)\.cumsum", "", "a floor of log(1 − α) far below float64's sums (e^-50 ≈ 2e-22)"),
    # P3O's e_B = (Σρ)² / (N Σρ²): every sum negated leaves it as it was
    (r"^sums\[key\] \+= value", r"-=", "every sum negated: (−Σρ)² / ((−N)(−Σρ²)) is e_B"),
    (r"^inside = torch\.where\(advantages > 0", r">= 0", "A_i = 0 has no span (conflict_masks): its λ is unused"),
    (r"rows_per_forward = max\(1,", "", "rows per forward pass: memory, not the numbers"),
    # common/logprobs.py's _scores works on [positions, vocabulary] chunks (chunked_scores flattens them)
    (r"-1[,)]", r"\+1[,)]", "a [positions, vocabulary] chunk: dim 1 is dim −1", r"logprobs\.py:_scores$"),
    (r"def _scores\(.*float32=False", r"float32=True", "every caller passes float32: the default is never used"),
    (r"nan_to_num\(neginf=0\.0\)", "", "where the log-prob is −inf its probability is 0: any stand-in adds 0"),
    (r"per_chunk = max\(1,", "", "the chunk size: memory, not the numbers"),
    (r"weight\.dtype == torch\.float32 and low in", r" or ", "a weight in the low dtype already: cast to itself"),
    # micro-batches and their order are memory, not the numbers (test_micro_batches_change_no_number)
    (r"def micro_batches\(.*by_length=True", r"by_length=False", "micro-batches: memory, not the numbers"),
    (r"argsort\(descending=True, stable=True\)\]$", "", "micro-batches: memory, not the numbers", r"batches\.py:"),
    (r"width = int\(columns\[-1\]\) \+ 1 if len\(columns\) else 0", "", "a micro-batch without a response: masked"),
    # right padding comes after a sequence's last token: a causal model's positions before it never see it
    (
        r"\[0\] \* right\)$|\[0\.0\] \* right\)$|\+ \[0\] \* right\)$",
        r"\[1(\.0)?\] \* right",
        "right padding: masked, and after every token a causal model scores",
    ),  # fmt: skip
    (r"completions\[0\]\.trainer_logprobs is not None", r"completions\[1\]", "a batch is scored whole"),
    (
        r'^"call queue\.score_under_sampling_weights',
        "",
        "the wording of a message (the tests check which check refuses)",
    ),
    # --overlap-rollouts: what runs on a GPU only (tests/test_gpu.py::test_overlapped_rollouts_on_cuda), one process
    (
        r'"cuda"|cuda\.Event|pushed|^stream|torch\.cuda\.stream',
        "",
        "CUDA's streams: a GPU's (tests/test_gpu.py)",
        r"rollouts\.py:RolloutQueue\.(sample|_sample_beside)$",
    ),  # fmt: skip
    (r"collectives_on\(self\.group\)", "", "one process here, world size 1: the two-rank runs (test_fsdp.py) judge it"),
    (r"ThreadPoolExecutor\(1,", "", "one job in flight at a time: a pool of any size runs it on one thread"),
    (r"overlap = systems\.overlap_rollouts and self\.lag > 0", r">= 0", "at lag 0 nothing is sampled ahead"),
    (
        r"copy\.copy\(o\) if isinstance\(o, torch\.autocast\)",
        "",
        "a race of two threads in one autocast object: no test makes it happen on demand",
    ),  # fmt: skip
    (r"^self\.sampling \|= \{ahead: StepMetrics\(\)", r"^self\.sampling = ", "it holds the batches in flight alone"),
    # common/moe.py: a router's tensors are [tokens, experts]; a routing compared is [tokens, layers, k]
    (r"-1", r"\+1", "a router's logits are [tokens, experts]: dim 1 is dim −1", r"moe\.py:Routing\._hook$"),
    (r"to\(device=own\.device", r"to\(dtype=", "where a tensor is made: these tests run on the CPU, the one device"),
    (r"^device = next\(iter\(records", "", "where a tensor is made: these tests run on the CPU, the one device"),
    (r"^self\.is_recording = False", r"= None$", "None is false as False is"),
    (r"\.any\(dim=-1\)", r"\.any\(dim=-2\)", "|A ∩ B| counted from B's side: both hold k distinct experts"),
    (r"~same_set\.all\(dim=-1\)", r"dim=\+1", "same_set is [tokens, layers]: dim 1 is dim −1"),
    # isopo.py: two forms of one quantity, and pieces of a computation (test_gram_and_materialized_forms_agree_...)
    (
        r'form: str = "auto"|^if form == "gram" or form == "auto" and|max\(1, budget //',
        "",
        "which of two forms (or how many numbers a piece holds): the same result, test_gram_and_materialized_forms",
        r"isopo\.py:(ntk|sequence_norms|sequence_gradients)$",
    ),
    (r'form(: str)? ?= ?"paper"', "", "any form but authors is the paper's", r"isopo\.py:"),
    # Eq. 6 over token rows: a pad row's g is 0 (and index_add sums in any order)
    (
        r"^if valid is None|argsort\(dim=1, descending=True, stable=True\)|\.expand\(n, -1\)|rows, valid\)",
        "",
        "which token rows, in which order: pad rows have g = 0 and add nothing (valid only saves their FLOPs)",
        r"isopo\.py:(fisher_norms|IsopoGradients\._scales)$",
    ),
    (r"norm\(dim=-1, keepdim=True\)", r"dim=\+1", "[blocks, k]: dim 1 is dim −1", r"isopo\.py:fisher_norms$"),
    (r"masked_fill\(~valid, 2\.0\)", r"3\.0\)", "any key >= 1 puts the pads after every non-pad row (keys < 1)"),
    (r"topk\(.*dim=1, largest", r"max\(\)\)\), largest", "[blocks, b·T]: topk's dim −1 is dim 1"),
    (
        r"args\.block_size < 1 or|args\.num_minibatches < 1 or",
        r"<= 1 or|< 2 or",
        "at 1 everything divides: the guard is against 0 alone",
    ),
    (r"torch\.where\(finite, K, 0\)", "", "a non-finite K's result is NaN whatever eigh was given"),
    (r"expectations\[key\] if reg_coef else 0\.0", "", "λ = 0: λ·E is 0 whatever E"),
    (r"recurse=False", r"recurse=None", "None is false as False is"),
    (
        r"recurse=False",
        r"recurse=True",
        "a module run twice owns no module with parameters (a Linear in it would run twice: an error)",
        r"_module_forward$",
    ),
    (r"self\._armed\(name, module\)", r"_armed\(name, None\)", "_armed checks a Linear's calls: this is no Linear"),
    (
        r"isinstance\(x, torch\.Tensor\) and x\.requires_grad",
        r"torch\.Tensor\) or x\.requires_grad",
        "a module's first input is a tensor: token ids then take functional_call, the same output without gradient",
    ),
    (r'micro\["bypass"\] = None', r'= ""', "any value but the module itself is no bypass"),
    (r"values\.detach\(\) if isinstance", "", "what is logged is made under no_grad (the update's): nothing to detach"),
    (r"if g\.dim\(\) != 3 or a\.dim\(\) != 3", r" and ", "a Linear's g and a share their leading dimensions"),
    (r"^dtype = torch\.float64 if", r" or True", "float64 for float32: the same update, more exact (.grad is cast)"),
    (
        r"\.to\(dtype, copy=True\)\.mul_",
        r"\.to\(dtype, \)\.mul_|copy=False",
        "g masked in place: it may be a residual add's gradient too, but zeroed only at left pads and rows that do not"
        " train, which no parameter's update reads (a safeguard)",
    ),
    (r"if ctx\.needs_input_grad\[0\] else None", r" or True", "a gradient for an input that needs none is dropped"),
    (r"end_minibatch\(commit, self\.dist\)", "", "one process here, world size 1: the two-rank runs judge it"),
    (r"if dist else", r"\(dist\) and False", "one process here, world size 1: the two-rank runs judge it"),
    (r"sorted\(self\.pending, key=str\)", "", "one process: any order is every rank's (the two-rank runs judge it)"),
]
# lines whose strings are messages to a user: a refusal (require, checks.unused), an error, a warning
MESSAGES = r"\b(require|unused|BadInput|ValueError|RuntimeError|print|warn)\("
# Tests that fail under mutmut's own capture of the output (they read the file descriptors a worker writes to)
DESELECTED = ["tests/test_bad_input.py::test_a_tool_that_exits_is_reported_as_exiting_and_a_flood_is_cut"]
KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # a test run that failed or never finished


def script_lines(source: str, inside_main: bool = False) -> set[int]:
    """The lines of a script that are mutated: its ALGO LOGIC regions (main() apart) and its update_policy; or, with
    `inside_main`, the ALGO LOGIC lines in main(), which the tests start as a subprocess (not audited)."""
    lines, regions, start = source.splitlines(), set(), None
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("# ALGO LOGIC") and start is None:
            start = number
        elif line.strip().startswith("# END ALGO LOGIC") and start is not None:
            regions |= set(range(start, number + 1))
            start = None
        elif re.search(r"\S  # ALGO LOGIC", line):  # a one-line region: its code, then the marker
            regions.add(number)
    chosen, in_main = set(regions), set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "update_policy":
            chosen |= set(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.FunctionDef) and node.name == "main":  # run as a subprocess: mutmut cannot
            in_main = regions & set(range(node.lineno, node.end_lineno + 1))
    return in_main if inside_main else chosen - in_main


def target_files(names: list[str]) -> dict[str, tuple[set[int], list[str]]]:
    """{file: (its mutated lines, the tests that look at it)} for each name: a script, or "common"."""
    chosen = {}
    for name in names:
        if name in ALGORITHMS:
            path = f"algorithms/{name}.py"
            # test_grpo.py and test_scripts.py also check every fork's copy of grpo.py's functions (by name)
            tests = sorted(
                {f"tests/test_{name}.py", "tests/test_grpo.py", "tests/test_scripts.py", "tests/test_bad_input.py"}
            )
            chosen[path] = (script_lines(_read(path)), tests)
        elif name == "common":
            for path, (functions, tests) in COMMON.items():
                nodes = [
                    n for n in _units(ast.parse(_read(path))) if functions is None or n[0].split(".")[0] in functions
                ]
                chosen[path] = ({line for _, node in nodes for line in range(node.lineno, node.end_lineno + 1)}, tests)
        else:
            raise SystemExit(f"unknown target {name!r}: one of {' '.join(ALGORITHMS)} common")
    return chosen


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _units(tree):
    """(qualified name, node) of every function mutmut mutates on its own: top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from ((f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, ast.FunctionDef))


def functions(source: str, lines: set[int]) -> dict[str, dict]:
    """{qualified name: {hash, lines, decorated}} of the functions of `source` with a mutated line among `lines`."""
    found = {}
    for name, node in _units(ast.parse(source)):
        mutated = sorted(set(range(node.lineno, node.end_lineno + 1)) & lines)
        if mutated:
            # the code, and which of its statements are audited (by their code: comments and formatting apart)
            audited = [ast.unparse(s) for s in ast.walk(node) if isinstance(s, ast.stmt) and s.lineno in lines]
            code = ast.unparse(node) + "\n" + "\n".join(audited)
            digest = hashlib.sha256(code.encode()).hexdigest()[:16]
            # mutmut leaves a decorated function alone, but for one @staticmethod or @classmethod
            plain = [ast.unparse(d) for d in node.decorator_list] in ([], ["staticmethod"], ["classmethod"])
            found[name] = {"hash": digest, "decorated": not plain, "lines": len(mutated)}
    return found


def mutmut_name(path: str, function: str) -> str:
    """mutmut's name pattern of a function's mutants: algorithms.grpo.x_aggregate__mutmut_*."""
    module = path[: -len(".py")].replace("/", ".")
    if "." in function:
        cls, method = function.split(".")
        return f"{module}.xǁ{cls}ǁ{method}__mutmut_*"
    return f"{module}.x_{function}__mutmut_*"


def load_results() -> dict[tuple[str, str], dict]:
    path = os.path.join(ROOT, RESULTS, "results.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(r["file"], r["function"]): r for r in map(json.loads, f) if "function" in r}


def only_text_changed(original: str, mutated: str) -> bool:
    """The mutant changes a string's text (or puts None in its place) and nothing else."""
    try:
        before, after = (list(tokenize.generate_tokens(io.StringIO(line).readline)) for line in (original, mutated))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return False
    text = lambda token: token.type == tokenize.STRING or token.string == "None"  # noqa: E731
    same = [a.string == b.string or text(a) and text(b) for a, b in zip(before, after)]
    return len(before) == len(after) and all(same) and original != mutated


def reason(mutant: dict) -> str:
    message = re.search(MESSAGES, mutant["original"]) or re.fullmatch(r'f?"[^"]*",?', mutant["original"].strip())
    if only_text_changed(mutant["original"], mutant["mutated"]) and message:  # (a line of a message split over lines)
        return "the wording of a message (the tests check which check refuses, not its words)"
    for old, new, why, *scope in REASONS:
        if re.search(old, mutant["original"]) and re.search(new, mutant["mutated"]):
            if not scope or re.search(scope[0], f"{mutant.get('file', '')}:{mutant.get('function', '')}"):
                return why
    return ""


def run_mutmut(files: dict, stale: list[tuple[str, str]], workers: int) -> list[dict]:
    """Every mutant of the `stale` functions, judged in a scratch copy: [{file, function, original, mutated,
    status}]."""
    with tempfile.TemporaryDirectory(prefix="mutation_audit_") as work:
        for folder in ("algorithms", "common", "tests"):
            shutil.copytree(os.path.join(ROOT, folder), os.path.join(work, folder), ignore=_ignored)
        shutil.copy(os.path.join(ROOT, "pytest.ini"), work)
        os.makedirs(os.path.join(work, "mutants"))
        os.symlink(os.path.join(REPO, ".cache"), os.path.join(work, "mutants", ".cache"))  # the built-in models
        tests = sorted({test for path in {p for p, _ in stale} for test in files[path][1]})
        config = [
            "[mutmut]",
            "source_paths =\n    algorithms/\n    common/",
            "only_mutate =\n" + "".join(f"    {p}\n" for p in sorted({p for p, _ in stale})),
            "also_copy =\n    pytest.ini",
            # one process (mutmut's stats are collected in it), one thread: the fast tier of the file's tests
            "pytest_add_cli_args =\n    -n\n    0\n    -p\n    no:cacheprovider\n    -q\n"
            + "".join(f"    --deselect\n    {test}\n" for test in DESELECTED),
            "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests) + "    -m\n    not slow",
        ]
        with open(os.path.join(work, "setup.cfg"), "w") as f:
            f.write("\n".join(config) + "\n")
        lines = {path: sorted(files[path][0]) for path in files}
        env = dict(os.environ, MUTATION_AUDIT_LINES=json.dumps(lines), OMP_NUM_THREADS="1")
        patterns = [mutmut_name(path, function) for path, function in stale]
        command = [sys.executable, os.path.abspath(__file__), "--mutmut"]
        subprocess.run([*command, "run", "--max-children", str(workers), *patterns], cwd=work, env=env, check=True)
        report = subprocess.run([*command, "report", *patterns], cwd=work, env=env, check=True, capture_output=True)
        return json.loads(report.stdout.decode().splitlines()[-1])


def _ignored(folder, names):
    return [n for n in names if n in ("__pycache__", "mutation_audit_results")]


def mutmut_main(argv: list[str]) -> None:
    """Inside the scratch copy: mutmut's command line, mutating only the audited lines (MUTATION_AUDIT_LINES); or
    `report PATTERN...`, the mutants' verdicts and their changed lines as JSON."""
    from mutmut.mutation import file_mutation

    allowed = {path: set(lines) for path, lines in json.loads(os.environ["MUTATION_AUDIT_LINES"]).items()}
    original = file_mutation.get_ignored_lines

    def ignored_lines(filename, source, *args, **kwargs):
        ignored = original(filename, source, *args, **kwargs)
        path = os.path.relpath(os.path.abspath(filename), os.getcwd())
        keep = allowed.get(path, set())
        ignored.no_mutate_lines |= set(range(1, source.count("\n") + 2)) - keep
        return ignored

    file_mutation.get_ignored_lines = ignored_lines
    if argv[0] != "report":
        from mutmut.__main__ import cli

        sys.argv = ["mutmut", *argv]
        cli()  # exits
    import fnmatch

    from mutmut.__main__ import get_diff_for_mutant, status_by_exit_code, walk_mutatable_files
    from mutmut.mutation.data import SourceFileMutationData

    verdicts = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in sorted(data.exit_code_by_key.items()):
            if not any(fnmatch.fnmatch(name, pattern) for pattern in argv[1:]):
                continue
            diff = get_diff_for_mutant(name, path=path).splitlines()
            removed = [line[1:].strip() for line in diff if line.startswith("-") and not line.startswith("---")]
            added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
            mangled = name.partition("__mutmut_")[0].rpartition(".")[2]
            function = mangled[2:] if mangled.startswith("x_") else ".".join(mangled.strip("xǁ").split("ǁ"))
            verdicts.append(
                dict(
                    file=str(path),
                    function=function,
                    mutant=int(name.rpartition("_")[2]),
                    original=" / ".join(removed),
                    mutated=" / ".join(added),
                    status=status_by_exit_code[code],
                )
            )
    print(json.dumps(verdicts))


def summary(results: dict) -> str:
    files = target_files([*ALGORITHMS, "common"])
    commits = sorted({r.get("commit", "unknown") for r in results.values()})
    out = ["# Mutation audit: survivors", "", f"Judged by mutmut 3.8.1 on the code of commit {', '.join(commits)}", ""]
    out += ["(each function's verdicts are kept with the hash of its code: tests/mutation_audit_results/results.jsonl)"]
    out += [""]
    current = {(path, f): info["hash"] for path in files for f, info in functions(_read(path), files[path][0]).items()}
    for path in sorted({p for p, _ in results}):
        every = [r for (p, _), r in sorted(results.items()) if p == path]
        units = [r for r in every if current.get((path, r["function"])) == r["hash"]]
        mutants = [m for r in units for m in r["mutants"]]
        killed = sum(m["status"] in KILLED for m in mutants)
        out += [f"## {path}: {killed} of {len(mutants)} mutants killed", ""]
        stale = [r["function"] for r in every if r not in units]
        if stale:  # judged on code that has changed since: not counted
            out.append(f"- stale, not counted (their code changed since): {', '.join(stale)}")
        for r in units:
            for m in r["mutants"]:
                if m["status"] not in KILLED:
                    why = reason(m) or "NO REASON"
                    out.append(f"- {r['function']} ({m['status']}): `{m['original']}` → `{m['mutated']}` — {why}")
        skipped = (
            [f for f, info in functions(_read(path), files[path][0]).items() if info["decorated"]]
            if path in files
            else []
        )
        if skipped:
            out.append(f"- not audited (decorated, which mutmut leaves alone): {', '.join(skipped)}")
        in_main = script_lines(_read(path), inside_main=True) if path.startswith("algorithms/") else set()
        if in_main:
            out.append(f"- not audited: main()'s ALGO LOGIC lines {min(in_main)}-{max(in_main)} (run as a subprocess)")
        out.append("")
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["--mutmut"]:
        return mutmut_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", default=[*ALGORITHMS, "common"], help="scripts, or common")
    parser.add_argument("--all", action="store_true", help="judge every function again, current or not")
    parser.add_argument("--list", action="store_true", help="each function and whether its verdicts are current")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--check", action="store_true", help="judge the stale functions, keep nothing (CI)")
    parser.add_argument("--rejudge", action="store_true", help="judge again the functions with survivors (new tests)")
    parser.add_argument("--only", nargs="+", metavar="FUNCTION", help="with --rejudge or --all: these functions only")
    parser.add_argument("--repo", default=REPO, help="audit this copy of the repository (its results files too)")
    args = parser.parse_args()
    global ROOT
    ROOT = os.path.abspath(args.repo)
    files = target_files(args.targets)
    kept = load_results()
    present, stale = set(), []
    for path, (lines, _) in files.items():
        for function, info in functions(_read(path), lines).items():
            current = (path, function) in kept and kept[path, function]["hash"] == info["hash"]
            if args.list:
                print(f"{path} {function}: {'current' if current else 'stale'}{' (decorated)' * info['decorated']}")
            if not info["decorated"]:
                present.add((path, function))
                again = (
                    args.all or not current or args.rejudge and any(map(unexplained, kept[path, function]["mutants"]))
                ) and (not current or not args.only or function in args.only)
                stale += [(path, function, info["hash"])] if again else []
    if args.list:
        return
    results = dict(kept)
    if stale:
        print(f"judging {len(stale)} functions: {', '.join(f'{p}:{f}' for p, f, _ in stale)}", flush=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        verdicts = run_mutmut(files, [(p, f) for p, f, _ in stale], args.workers)
        for path, function, digest in stale:
            mine = [m for m in verdicts if (m["file"], m["function"]) == (path, function)]
            record = dict(file=path, function=function, hash=digest, commit=commit.stdout.strip() or "unknown")
            results[path, function] = dict(record, mutants=mine)
    # a function gone from a file audited here is gone from the results
    results = {key: r for key, r in results.items() if key in present or key[0] not in files}
    if not args.check:
        with open(os.path.join(ROOT, RESULTS, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for _, r in sorted(results.items()))
        with open(os.path.join(ROOT, RESULTS, "summary.md"), "w") as f:
            f.write(summary(results))
    # The ratchet: a function judged now may not have a survivor without a reason that its kept verdicts did not
    # have (a changed function: new lines untested, or a test weakened), and no file's share of killed mutants may fall
    failures = []
    for path, function, _ in stale:
        known = {(m["original"], m["mutated"]) for m in kept.get((path, function), {}).get("mutants", [])
                 if unexplained(m)}  # fmt: skip
        for m in results[path, function]["mutants"]:
            if unexplained(m) and (m["original"], m["mutated"]) not in known:
                failures.append(f"  {path} {function}: `{m['original']}` → `{m['mutated']}` ({m['status']})")
    for path in sorted({p for p, _, _ in stale}):
        before, after = score(kept, path, present), score(results, path, present)
        if before is not None and after < before:
            failures.append(f"  {path}: {after:.1%} of its mutants killed, {before:.1%} in the kept audit")
    survivors = sum(unexplained(m) for key in present for m in results[key]["mutants"])
    print(f"{sum(len(results[key]['mutants']) for key in present)} mutants of {len(present)} functions, "
          f"{survivors} survivors without a reason (summary.md); {len(failures)} new:")  # fmt: skip
    print("\n".join(failures))
    sys.exit(1 if failures else 0)


def unexplained(mutant: dict) -> bool:
    return mutant["status"] not in KILLED and not reason(mutant)


def score(results: dict, path: str, present: set) -> float | None:
    """The share of killed mutants of the file's current functions in `results` (None: none judged)."""
    mutants = [m for (p, f), r in results.items() if p == path and (p, f) in present for m in r["mutants"]]
    return sum(m["status"] in KILLED for m in mutants) / len(mutants) if mutants else None


if __name__ == "__main__":
    main()
