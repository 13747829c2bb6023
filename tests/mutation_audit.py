"""Mutation audit, on mutmut 3 (https://github.com/boxed/mutmut): which lines of a method can be broken with
every fast test still green?

    .venv/bin/python tests/mutation_audit.py              # the functions changed since the kept audit (CI does this)
    .venv/bin/python tests/mutation_audit.py --all        # every target function again (about an hour on 2 cores)
    .venv/bin/python tests/mutation_audit.py grpo --list  # grpo.py's functions and whether their verdicts are current

The lines mutated are each script's `# ALGO LOGIC` regions and its `update_policy`, and the common/ functions that
carry the methods' math (COMMON). mutmut writes every mutant of a function beside the original (operators, numbers,
names, arguments swapped, calls dropped) and runs, for each, the fast tests that called that function in a first
clean run: a mutant is *killed* when one of them fails. It runs in a scratch copy of the repository.

The verdicts are kept per function in tests/mutation_audit_results/results.jsonl, each under the hash of the code it
judged (the function's code, comments and formatting apart, and which of its lines were mutated). A function whose
hash differs from its kept one is *stale*: its verdicts do not count, and a run judges it again. A survivor needs a
reason (REASONS: a statement that cannot change the update, a second path to the same numbers) or a test that kills
it; a survivor without one makes this script exit 1, which is CI's ratchet (tests/test_docs.py runs the stale
functions' mutants). summary.md lists every file's score, its survivors and the commit it describes.

What mutmut does not reach: a decorated function (a context manager: common/logprobs.py's output_layer_scores and
_post_head_transform, isopo.py's capture), and main(), which the tests run as a subprocess; their lines are listed
in summary.md as not audited."""

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from helpers import ALGORITHMS, REPO

OUT = os.path.join(REPO, "tests", "mutation_audit_results")
# common/ files, the functions of each whose math a method uses (None: all), and the tests that look at them
COMMON = {
    "common/logprobs.py": (["chunked_scores", "_scores", "log_softmax_gather", "_same"], ["tests/test_logprobs.py"]),
    "common/batches.py": (None, ["tests/test_batches.py", "tests/test_grpo.py"]),
    "common/moe.py": (None, ["tests/test_moe.py", "tests/test_tis_icepop.py"]),
    "common/rollouts.py": (["RolloutQueue", "record_staleness"], ["tests/test_rollouts.py", "tests/test_moe.py"]),
}
# Survivors that may stay, each with its reason: (the original line, the mutated line: regular expressions, both
# searched), reason
REASONS = [
    # isopo.weighted_gradient: which side of the one GEMM the weights multiply (the cheaper); the product is the same
    (r"^if g\.shape\[-1\] >= a\.shape\[-1\]:", "", "a choice of the cheaper side: both give the same Σ_t w_t g_t a_tᵀ"),
    (r"^return g\.flatten\(0, 1\)\.T @ \(a \* weights", "", "the same product as the other side's"),
    (
        r"device=",
        r"device=None|^(?!.*device=)",
        "where a tensor is made: the tests here run on the CPU, its only device",
    ),
    (r"dist\.world_size", "", "one process here, world size 1: the two-rank runs (torchrun, test_fsdp.py) judge it"),
    (r"zero_grad\(set_to_none=True\)", "", "zeroed gradients and none make the same next step (memory only)"),
    (r'^metrics\.mean\("losses/grad_norm", grad_norm, 1\)', r", 2\)$", "one weight for every minibatch: the same mean"),
    (
        r"^if torch\.isfinite\(grad_norm\) and math\.isfinite\(minibatch_loss\):",
        r" or ",
        "a loss that is not finite makes the gradient not finite (its backward): `or` skips the same steps",
    ),
]
# Tests that fail under mutmut's own capture of the output (they read the file descriptors a worker writes to)
DESELECTED = ["tests/test_bad_input.py::test_a_tool_that_exits_is_reported_as_exiting_and_a_flood_is_cut"]
KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # a test run that failed or never finished


def script_lines(source: str) -> set[int]:
    """The lines of a script that are mutated: its ALGO LOGIC regions (main() apart) and its update_policy."""
    lines, chosen, start = source.splitlines(), set(), None
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("# ALGO LOGIC") and start is None:
            start = number
        elif line.strip().startswith("# END ALGO LOGIC") and start is not None:
            chosen |= set(range(start, number + 1))
            start = None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "update_policy":
            chosen |= set(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.FunctionDef) and node.name == "main":  # a subprocess in every test: not reached
            chosen -= set(range(node.lineno, node.end_lineno + 1))
    return chosen


def target_files(names: list[str]) -> dict[str, tuple[set[int], list[str]]]:
    """{file: (its mutated lines, the tests that look at it)} for each name: a script, or "common"."""
    chosen = {}
    for name in names:
        if name in ALGORITHMS:
            path = f"algorithms/{name}.py"
            tests = [f"tests/test_{name}.py", "tests/test_scripts.py", "tests/test_bad_input.py"]
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
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _units(tree):
    """(qualified name, node) of every function mutmut mutates on its own: top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from ((f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, ast.FunctionDef))


def functions(path: str, lines: set[int]) -> dict[str, dict]:
    """{qualified name: {hash, mutated, decorated}} of the file's functions with a mutated line."""
    source = _read(path)
    found = {}
    for name, node in _units(ast.parse(source)):
        mutated = sorted(set(range(node.lineno, node.end_lineno + 1)) & lines)
        if mutated:
            code = ast.unparse(node) + "\n" + "\n".join(source.splitlines()[n - 1].strip() for n in mutated)
            digest = hashlib.sha256(code.encode()).hexdigest()[:16]
            found[name] = {"hash": digest, "decorated": bool(node.decorator_list), "lines": len(mutated)}
    return found


def mutmut_name(path: str, function: str) -> str:
    """mutmut's name pattern of a function's mutants: algorithms.grpo.x_aggregate__mutmut_*."""
    module = path[: -len(".py")].replace("/", ".")
    if "." in function:
        cls, method = function.split(".")
        return f"{module}.xǁ{cls}ǁ{method}__mutmut_*"
    return f"{module}.x_{function}__mutmut_*"


def load_results() -> dict[tuple[str, str], dict]:
    path = os.path.join(OUT, "results.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(r["file"], r["function"]): r for r in map(json.loads, f) if "function" in r}


def reason(mutant: dict) -> str:
    matches = (re.search(old, mutant["original"]) and re.search(new, mutant["mutated"]) for old, new, _ in REASONS)
    return next((why for match, (_, _, why) in zip(matches, REASONS) if match), "")


def run_mutmut(files: dict, stale: list[tuple[str, str]], workers: int) -> list[dict]:
    """Every mutant of the `stale` functions, judged in a scratch copy: [{file, function, original, mutated,
    status}]."""
    with tempfile.TemporaryDirectory(prefix="mutation_audit_") as work:
        for folder in ("algorithms", "common", "tests"):
            shutil.copytree(os.path.join(REPO, folder), os.path.join(work, folder), ignore=_ignored)
        shutil.copy(os.path.join(REPO, "pytest.ini"), work)
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


def summary(results: dict, files: dict, commit: str) -> str:
    out = ["# Mutation audit: survivors", "", f"Judged on the code of commit {commit} (mutmut 3.8.1).", ""]
    for path in sorted({p for p, _ in results}):
        units = [r for (p, _), r in sorted(results.items()) if p == path]
        mutants = [m for r in units for m in r["mutants"]]
        killed = sum(m["status"] in KILLED for m in mutants)
        out += [f"## {path}: {killed} of {len(mutants)} mutants killed", ""]
        for r in units:
            for m in r["mutants"]:
                if m["status"] not in KILLED:
                    why = reason(m) or "NO REASON"
                    out.append(f"- {r['function']} ({m['status']}): `{m['original']}` → `{m['mutated']}` — {why}")
        skipped = (
            [f for f, info in functions(path, files[path][0]).items() if info["decorated"]] if path in files else []
        )
        if skipped:
            out.append(f"- not audited (decorated, which mutmut leaves alone): {', '.join(skipped)}")
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
    args = parser.parse_args()
    files = target_files(args.targets)
    results = load_results()
    stale = []
    for path, (lines, _) in files.items():
        for function, info in functions(path, lines).items():
            kept = results.get((path, function))
            current = kept is not None and kept["hash"] == info["hash"]
            if args.list:
                print(f"{path} {function}: {'current' if current else 'stale'}{' (decorated)' * info['decorated']}")
            if (args.all or not current) and not info["decorated"]:
                stale.append((path, function, info["hash"]))
    if args.list:
        return
    if stale:
        print(f"judging {len(stale)} functions: {', '.join(f'{p}:{f}' for p, f, _ in stale)}", flush=True)
        verdicts = run_mutmut(files, [(p, f) for p, f, _ in stale], args.workers)
        for path, function, digest in stale:
            mine = [m for m in verdicts if (m["file"], m["function"]) == (path, function)]
            results[(path, function)] = dict(file=path, function=function, hash=digest, mutants=mine)
        with open(os.path.join(OUT, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for _, r in sorted(results.items()))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        with open(os.path.join(OUT, "summary.md"), "w") as f:
            f.write(summary(results, files, commit.stdout.strip() or "unknown"))
    judged = [(key, m) for key, r in results.items() if key[0] in files for m in r["mutants"]]
    unexplained = [(key, m) for key, m in judged if m["status"] not in KILLED and not reason(m)]
    print(f"{len(judged)} mutants, {len(unexplained)} survivors without a reason (tests/mutation_audit_results)")
    for (path, function), m in unexplained:
        print(f"  {path} {function}: `{m['original']}` → `{m['mutated']}` ({m['status']})")
    sys.exit(1 if unexplained else 0)


if __name__ == "__main__":
    main()
