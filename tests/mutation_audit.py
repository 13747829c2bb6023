"""Mutation audit: which lines of a method can be broken with every fast test still green?

    .venv/bin/python tests/mutation_audit.py                       # every script, then common/'s math
    .venv/bin/python tests/mutation_audit.py grpo isopo --list     # the mutants only, nothing run
    .venv/bin/python tests/mutation_audit.py common --out /tmp/audit
    .venv/bin/python tests/mutation_audit.py ema_kpo p3o --own-lines  # a fork's lines that grpo.py lacks

Each mutant changes one thing in a copy of the repository: a statement replaced by `pass`, a comparison
negated (< and >=, == and !=, in and not in, is and is not), or an arithmetic operator swapped (+ and -,
* and /). The places mutated are each script's `# ALGO LOGIC` sections and its `update_policy`, and the
common/ functions that carry the methods' math (TARGETS). A mutant is *killed* when the fast tier of the
tests that look at its file fails (pytest -x, stopped at the first failure); else it *survives*, and the
line needs a test, or a reason it cannot matter (REASONS below: a log line, a check of a flag already
refused elsewhere). Results go to OUT/results.jsonl, one line per mutant, and a rerun skips the mutants
already there (delete the file to start over). A mutant is named by the text of its mutated section or
function, so an edit elsewhere in the file keeps its verdict and an edit of that section runs it again;
OUT/summary.md lists the survivors per file. OUT defaults to tests/mutation_audit_results/, which the
repository keeps: a clone goes on where the last audit stopped, and its summary.md is the latest word.
--own-lines leaves out a fork's lines that are also in grpo.py: grpo.py's audit covers those, and a change
to one shows in `diff algorithms/grpo.py algorithms/X.py`. Slow (about 20-60 s a mutant on 2 cores, so
hours for all): not part of the test suite."""

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from helpers import ALGORITHMS, REPO

FAST = ["-m", "not slow", "-x", "-q", "-p", "no:cacheprovider"]

# common/ functions that carry a method's math, and the tests that look at them
COMMON = {
    "common/logprobs.py": (
        ["output_layer_scores", "_same", "_post_head_transform", "chunked_scores", "_scores", "log_softmax_gather"],
        ["tests/test_logprobs.py", "tests/test_scripts.py"],
    ),
    "common/batches.py": (None, ["tests/test_batches.py", "tests/test_scripts.py", "tests/test_grpo.py"]),
    "common/moe.py": (None, ["tests/test_moe.py", "tests/test_tis_icepop.py"]),
    "common/rollouts.py": (
        ["RolloutQueue", "record_staleness"],
        ["tests/test_rollouts.py", "tests/test_moe.py", "tests/test_fsdp.py"],
    ),
}
NEGATED = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
SWAPPED = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
SYMBOL = {
    ast.Lt: "<", ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
    ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
}  # fmt: skip
# Lines that may survive, each with the reason (matched against the stripped source line)
REASONS = {
    "# END ALGO LOGIC": "a comment",
    "if cap is None and scaling == 1 and scale == 1:": "a fast path: without it the identity transform is applied",
    "assert queued.step == step": "a check of the queue's own schedule, which the schedule's tests show holds",
    # isopo.weighted_gradient: which side of the one GEMM the weights multiply (the cheaper); the product is the same
    "if g.shape[-1] >= a.shape[-1]:": "a choice of the cheaper side: both sides give the same Σ_t w_t g_t a_tᵀ",
    "return g.flatten(0, 1).T @ (a * weights[:, None, None]).flatten(0, 1)": "the same product, the other side",
}


def algorithm_ranges(source: str) -> list[tuple[int, int]]:
    """1-based inclusive line ranges of a script's ALGO LOGIC sections and of its update_policy."""
    lines, ranges, start = source.splitlines(), [], None
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("# ALGO LOGIC") and start is None:
            start = number
        elif line.strip().startswith("# END ALGO LOGIC") and start is not None:
            ranges.append((start, number))
            start = None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "update_policy":
            ranges.append((node.lineno, node.end_lineno))
    return ranges


def function_ranges(source: str, names: list[str] | None) -> list[tuple[int, int]]:
    """The line ranges of the module-level functions and classes named (all of them: None)."""
    return [
        (node.lineno, node.end_lineno)
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (names is None or node.name in names)
    ]


def inside(node, ranges) -> bool:
    return any(start <= node.lineno and node.end_lineno <= end for start, end in ranges)


def docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def mutants(path: str, ranges) -> list[dict]:
    """Every mutant of the file at `path` (relative to REPO) within `ranges`: {file, line, kind, text, source}."""
    source = open(os.path.join(REPO, path)).read()
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not hasattr(node, "lineno") or not inside(node, ranges):
            continue
        skipped = (ast.Pass, ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.AnnAssign)  # not the math
        if isinstance(node, ast.stmt) and not docstring(node) and not isinstance(node, skipped):
            indent = lines[node.lineno - 1][: node.col_offset]
            if lines[node.lineno - 1][: node.col_offset].strip():  # a statement after another on its line
                continue
            blank = "\n" * (node.end_lineno - node.lineno)  # the line numbers stay
            mutated = lines[: node.lineno - 1] + [indent + "pass\n" + blank] + lines[node.end_lineno :]
            text = lines[node.lineno - 1].strip()
            found.append(dict(file=path, line=node.lineno, kind="delete", text=text, source="".join(mutated)))
        pairs = []
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in NEGATED:
            pairs = [(node.left, node.comparators[0], type(node.ops[0]), NEGATED[type(node.ops[0])])]
        elif isinstance(node, ast.BinOp) and type(node.op) in SWAPPED:
            pairs = [(node.left, node.right, type(node.op), SWAPPED[type(node.op)])]
        for left, right, old, new in pairs:
            if left.end_lineno != right.lineno:
                continue  # an operator on a line of its own: not mutated
            line = lines[left.end_lineno - 1]
            gap = line[left.end_col_offset : right.col_offset]
            if gap.strip().strip("()") != SYMBOL[old] and gap.replace("(", "").replace(")", "").strip() != SYMBOL[old]:
                continue
            replaced = gap.replace(SYMBOL[old], SYMBOL[new], 1)
            mutated_line = line[: left.end_col_offset] + replaced + line[right.col_offset :]
            mutated = lines[: left.end_lineno - 1] + [mutated_line] + lines[left.end_lineno :]
            text = f"{line.strip()}   [{SYMBOL[old]} -> {SYMBOL[new]} at column {left.end_col_offset}]"
            found.append(dict(file=path, line=left.end_lineno, kind="operator", text=text, source="".join(mutated)))
    for mutant in found:  # named by its mutated range alone: an edit elsewhere in the file keeps its verdict
        start, end = next((start, end) for start, end in ranges if start <= mutant["line"] <= end)
        region = "".join(mutant["source"].splitlines(keepends=True)[start - 1 : end])
        mutant["id"] = hashlib.sha1((mutant["file"] + region).encode()).hexdigest()[:12]
    return sorted(found, key=lambda m: (m["line"], m["kind"], m["text"]))


def own_lines(mutants_found: list[dict], path: str) -> list[dict]:
    """The mutants of a fork whose line is not a line of grpo.py (the method's own lines)."""
    baseline = {line.strip() for line in open(os.path.join(REPO, "algorithms", "grpo.py"))}
    lines = open(os.path.join(REPO, path)).read().splitlines()
    return [m for m in mutants_found if lines[m["line"] - 1].strip() not in baseline]


def targets(names: list[str]) -> list[tuple[str, list, list[str]]]:
    """(file, line ranges, the tests that look at it) for each name: a script, or "common"."""
    chosen = []
    for name in names:
        if name in ALGORITHMS:
            path = f"algorithms/{name}.py"
            tests = [f"tests/test_{name}.py", "tests/test_scripts.py", "tests/test_bad_input.py"]
            chosen.append((path, algorithm_ranges(open(os.path.join(REPO, path)).read()), tests, name))
        elif name == "common":
            for path, (functions, tests) in COMMON.items():
                chosen.append((path, function_ranges(open(os.path.join(REPO, path)).read(), functions), tests, None))
        else:
            raise SystemExit(f"unknown target {name!r}: one of {' '.join(ALGORITHMS)} common")
    return chosen


def run(mutant: dict, tests: list[str], keyword: str | None, workdir: str, timeout: int) -> tuple[str, float, str]:
    """Write the mutant into the copy, run the fast tests, put the file back: (killed / survived / timeout, s, why)."""
    target = os.path.join(workdir, mutant["file"])
    original = open(target).read()
    try:
        open(target, "w").write(mutant["source"])
        start = time.time()
        for group in (tests[:1], tests[1:]):  # the file's own tests first (they kill most mutants, in seconds)
            command = [sys.executable, "-m", "pytest", *FAST, "-n", "0", *group]
            if keyword and group != tests[:1]:  # the per-script checks of test_scripts / test_bad_input: this one's
                command += ["-k", f"{keyword} or not ({' or '.join(a for a in ALGORITHMS if a != keyword)})"]
            try:
                done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return "timeout", time.time() - start, ""
            if done.returncode != 0:
                tail = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:1]
                return "killed", time.time() - start, tail[0] if tail else done.stdout.strip().splitlines()[-1:]
        return "survived", time.time() - start, ""
    finally:
        open(target, "w").write(original)


def summary(results: list[dict]) -> str:
    lines = ["# Mutation audit: survivors", ""]
    for path in sorted({r["file"] for r in results}):
        mine = [r for r in results if r["file"] == path]
        survivors = [r for r in mine if r["verdict"] == "survived"]
        lines += [f"## {path}: {len(survivors)} of {len(mine)} mutants survive", ""]
        for r in survivors:
            reason = next((why for text, why in REASONS.items() if r["text"].startswith(text)), "")
            lines.append(f"- line {r['line']} ({r['kind']}): `{r['text']}`" + (f" — {reason}" if reason else ""))
        lines += [""] if survivors else []
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=[*ALGORITHMS, "common"], help="scripts, or common")
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "mutation_audit_results"), help="results folder")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--own-lines", action="store_true", help="a fork's lines that are not in grpo.py only")
    args = parser.parse_args()
    chosen = targets(args.names)

    def mutants_of(path, ranges):
        found = mutants(path, ranges)
        fork = path.startswith("algorithms/") and path != "algorithms/grpo.py"  # common/'s lines are all its own
        return own_lines(found, path) if args.own_lines and fork else found

    if args.list:
        for path, ranges, _, _ in chosen:
            for mutant in mutants_of(path, ranges):
                print(f"{mutant['file']}:{mutant['line']} {mutant['kind']}: {mutant['text']}")
        return
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.jsonl")
    done = {}
    if os.path.exists(results_path):
        done = {r["id"]: r for r in map(json.loads, open(results_path)) if r["verdict"] != "timeout"}
    # a copy of the repository, outside it: the mutants never touch the working tree
    workdir = os.path.join(REPO, "runs", "mutation_audit_repo")
    shutil.rmtree(workdir, ignore_errors=True)
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", "*.egg-info")
    shutil.copytree(REPO, workdir, ignore=ignore)
    current = {m["id"] for path, ranges, _, _ in chosen for m in mutants_of(path, ranges)}
    for path, ranges, tests, keyword in chosen:
        todo = [m for m in mutants_of(path, ranges) if m["id"] not in done]
        print(f"{path}: {len(todo)} mutants to run", file=sys.stderr)
        for number, mutant in enumerate(todo, 1):
            verdict, seconds, why = run(mutant, tests, keyword, workdir, args.timeout)
            record = {k: mutant[k] for k in ("id", "file", "line", "kind", "text")}
            record.update(verdict=verdict, seconds=round(seconds, 1), why=why)
            with open(results_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            done[mutant["id"]] = record
            print(f"[{number}/{len(todo)}] {verdict} {seconds:.0f}s {path}:{mutant['line']} {mutant['text']}")
        with open(os.path.join(args.out, "summary.md"), "w") as f:  # after each file: a run cut off keeps its part
            f.write(summary([r for r in done.values() if r["id"] in current]))
    print(f"survivors: {os.path.join(args.out, 'summary.md')}")


if __name__ == "__main__":
    main()
