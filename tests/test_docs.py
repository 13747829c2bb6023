"""How the algorithm files read: each opens with a short docstring of the anatomy the README promises
and closes with its paper-scale command and differences, its `main()` fits a screen or two, a fork stays
grpo.py plus its method, and the repository stands alone. Also: common/ has no import cycle."""

import ast
import difflib
import glob
import math
import os
import re
import subprocess
import sys

import pytest
from helpers import ALGORITHMS, REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "algorithms", "[!_]*.py")))  # a new fork is held to the rules too
# lines of `diff algorithms/grpo.py algorithms/<fork>.py` at most: what is left is the method, and the ~35
# lines of grpo.py's own loss variants that no fork carries (Dr. GRPO's token-sum-norm, GSPO's sequence ratio).
# ISOPO's method includes the backward it builds (IsopoLinear and the forwards of every module with parameters)
# code lines, closing notes apart; tis_icepop.py also carries routing replay for mixture-of-experts models (R2, R3).
# Each docstring says how its method treats a tool's output (EMA-KPO's filter and GTPO's spans skip it: 4 lines)
# Prose is wrapped at 100 columns: a method's paragraphs take more lines than at 120 (and so does its diff).
MAX_DIFF = {
    "ema_kpo": 266,
    "p3o": 288,
    "gtpo": 313,
    "tis_icepop": 389,
    "isopo": 773,
}  # isopo: + 4 for end_minibatch (stop 49); all + 5: grpo.py's own variants explained; p3o + 10: its metrics (stop 54);
# tis_icepop + 19: --rollout-lag's log π_s routed as its log π_old (R3: the engine's routing; stop 57); stop 61: rows
# that do not train (--mask-truncated) left out of a method's statistics (gtpo + 1, tis_icepop + 2, isopo + 9); stop 62:
# gtpo + 6, ⟨H⟩_ini sampled with the run's --top-k/--top-p and its mask, and which rows define conflicts; isopo + 8:
# LoRA's statistics per adapter matrix, and minibatches of whole groups; stop 63: isopo + 1, the first minibatch's
# ntk_reg of the blocks that train; the clip flags refused with one update per batch (grpo.py's 4 lines, the ratio-level
# flag grpo.py's alone: ema_kpo + 4, which needs several updates anyway, isopo + 4, gtpo and tis_icepop + 2); stop 64:
# method flags refused where their variant ignores them (isopo + 4: --reg-form, --ema-decay at λ = 0)
# stop 70: ema_kpo + 2, its formulas wrapped at 100 columns (ruff's max-doc-length); all + 2, grpo.py's docstring
# on a stale batch and on dynamic sampling's round cap (tis_icepop + 1: its Tools paragraph a line shorter); tis_icepop
# + 4: its record_mismatch an ALGO LOGIC region of its own, no longer one inside the helpers' TRY NOT TO MODIFY;
# stop 74: grpo.py's --ratio-to (its field, ρ's denominator, the one-update refusal it lifts): + 2 to + 4 each
# stop 71: the files shortened (grpo.py 580 -> 559 lines; isopo's code diff 474 -> 461), each limit set to its diff
NEW_FORK_DIFF = 400  # a fork not in MAX_DIFF (a user's new method): its docstring, flags and ALGO LOGIC sections


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_docstring_main_and_closing_notes(path):
    source = _read(path)
    tree = ast.parse(source)
    docstring = ast.get_docstring(tree, clean=False)
    assert docstring.count("\n") + 1 <= 65, "the module docstring is what a reader meets first: at most 65 lines"
    for section in ("Run it", "./run.sh bench", "arXiv"):
        assert section in docstring, f"{os.path.basename(path)}: no {section!r} in the docstring"
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    # counted in statements, not lines: the formatter decides how many lines a call with many arguments takes
    statements = sum(isinstance(node, ast.stmt) for node in ast.walk(main)) - 1
    assert statements <= 90, f"main() should read as one story: {statements} statements"
    # and fits a screen: the set-up in a few named calls of common/ (grpo.py: 99 lines, 39 before the loop; a
    # fork adds its method's own set-up: gtpo.py and tis_icepop.py 105 lines)
    loop = next(node for node in main.body if isinstance(node, ast.For))
    assert main.end_lineno - main.lineno + 1 <= 105 and loop.lineno - main.lineno <= 46
    # code keeps the formatter's 120 columns, prose 100: few lines pass 100 (grpo.py 4.0%; isopo.py, whose
    # ISOPO backward is dense machinery, 5.9%)
    lines = source.splitlines()
    # the file every reader starts with and every fork copies: its length is a budget
    assert not path.endswith("grpo.py") or len(lines) <= 560, f"grpo.py has {len(lines)} lines (at most 560)"
    wide = sum(len(line) > 100 for line in lines)
    assert wide <= (0.05 if path.endswith("grpo.py") else 0.06) * len(lines), f"{wide} of {len(lines)} lines over 100"
    closing = source[source.index('if __name__ == "__main__":') :]
    assert "# Paper scale" in closing
    if not path.endswith("grpo.py"):  # the baseline has no authors' code to differ from
        differences = r"# Differences from the (authors'|frameworks') code|# The authors published no code"
        assert re.search(differences, closing, re.I), "the closing notes: differences from the authors' code, or none"


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_markers_close_and_never_nest(path):
    """Each `# ALGO LOGIC` region closes with its `# END ALGO LOGIC` before another region opens, and each `# TRY
    NOT TO MODIFY` region (the helpers) with its END: a reader knows at every line whose it is. Outside both, the
    code is plumbing too. (A one-line region is a trailing `# ALGO LOGIC: ...` comment.)"""
    source = _read(path)
    markers = re.findall(r"^\s*# (END )?(ALGO LOGIC|TRY NOT TO MODIFY)", source, re.M)
    assert markers and markers[0] == ("", "ALGO LOGIC")
    opened = None
    for end, region in markers:
        assert (opened == region) if end else (opened is None), f"{end}{region} inside {opened}"
        opened = None if end else region
    assert opened is None and ("", "TRY NOT TO MODIFY") in markers


@pytest.mark.parametrize("name", [name for name in ALGORITHMS if name != "grpo"])
def test_a_fork_is_grpo_plus_its_method(name):
    """The code of a fork (everything above the closing notes, whose paper-scale command, memory budget and
    differences from the authors' code are each method's own) is grpo.py's plus its method."""
    paths = [os.path.join(REPO, "algorithms", f"{n}.py") for n in ("grpo", name)]
    code = [_read(p)[: _read(p).index('if __name__ == "__main__":')].splitlines() for p in paths]
    changed = sum(
        1
        for line in difflib.unified_diff(*code, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )
    assert changed <= MAX_DIFF.get(name, NEW_FORK_DIFF), f"{name}.py differs from grpo.py in {changed} lines"


def test_the_repository_stands_alone():
    """Nothing cites files a user of this repository does not have (the team's notes and design files)."""
    paths = [
        p
        for pattern in ("algorithms/*.py", "common/**/*.py", "tests/*.py", "*.md", "run.sh", ".ci/run")
        for p in glob.glob(os.path.join(REPO, pattern), recursive=True)
    ]
    needles = ["shared" + "/", "notes" + " §", "DESIGN" + ".md"]  # spelled apart so this file does not match
    found = [f"{os.path.relpath(p, REPO)}: {n}" for p in paths for n in needles if n in _read(p)]
    assert not found, found


def test_common_has_no_import_cycle():
    """Every `common.X` import, at the top of a module or inside a function, points down a DAG."""
    graph = {}
    for path in glob.glob(os.path.join(REPO, "common", "**", "*.py"), recursive=True):
        module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(_read(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common"):
                imported |= {node.module} if node.module != "common" else {f"common.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("common")}
        graph[module] = imported - {module}
    visiting, done = set(), set()

    def visit(module, path):
        assert module not in visiting, "import cycle: " + " -> ".join(path + [module])
        if module in done:
            return
        visiting.add(module)
        for target in graph.get(module, ()):
            visit(target, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in graph:
        visit(module, [])
    # the built-in model: its task, and for the tool task the episodes that measure its warm start
    assert graph["common.tiny"] <= {"common.tasks", "common.scoring", "common.errors", "common.task_files"} | {
        "common.engines",
        "common.tools",
    }


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    """The code is formatted by ruff and passes its linter (.ruff.toml: pyflakes, import order, bugbear, 120
    columns). To fix: `.venv/bin/ruff format . && .venv/bin/ruff check --fix .`"""
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_is_a_map_whose_links_resolve():
    """The README stays a map (at most 300 lines); every experiment's page is reachable from it, and every
    relative link of the README and of the pages points at a file that exists."""
    readme = _read(os.path.join(REPO, "README.md"))
    assert readme.count("\n") <= 300, "the README is a map: move details to the pages it links"
    results = os.path.join(REPO, "common", "bench", "results")
    index = _read(os.path.join(results, "README.md"))
    for page in glob.glob(os.path.join(results, "*.md")):
        name = os.path.basename(page)
        if name != "README.md":
            assert f"results/{name}" in readme or f"({name})" in index, f"{name} is linked from nowhere"
    for path in [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(results, "*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read(path)):
            assert os.path.exists(os.path.join(os.path.dirname(path), target)), f"{path}: broken link {target}"


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script name, flags, for a GPU machine) of every `python algorithms/X.py ...` or `torchrun ...
    algorithms/X.py ...` that a script's docstring or closing notes, or the README, give a reader to run:
    continuation lines joined, the comment after a command dropped. Placeholders (`...`, `<...>`) and files a
    reader brings (`--task my_task.py`) are not commands to check."""
    import shlex

    commands = []
    for path in [*SCRIPTS, os.path.join(REPO, "README.md")]:
        text = re.sub(r"\\{1,2}\n#?\s*", " ", _read(path))  # a command continued on the next line (closing notes: "# ")
        closing = text.find('if __name__ == "__main__":')
        closing_line = text[:closing].count("\n") + 1 if closing >= 0 else math.inf
        for number, line in enumerate(text.splitlines(), 1):
            found = re.search(r"(?:python|torchrun[^\n]*?)\s+algorithms/(\w+)\.py([^`#\n]*)", line)
            if not found or "..." in line or "<" in found.group(2) or "my_task.py" in line or "my.jsonl" in line:
                continue
            flags = shlex.split(found.group(2))
            if "--help" not in flags:
                commands.append((f"{os.path.basename(path)}:{number}", found.group(1), flags, number > closing_line))
    return commands


@pytest.mark.parametrize("where, name, flags, on_gpu", [pytest.param(*c, id=c[0]) for c in _documented_commands()])
def test_every_documented_command_is_accepted(where, name, flags, on_gpu, monkeypatch):
    """A command the docs give (a recipe, a paper-scale run) parses, and its script's flag checks find no problem
    (a closing note's DeepSeekMath recipe once was refused at one update per batch). A closing note's command is
    checked as on the GPU machine it is written for; what a script checks after its flags (a memory estimate from
    the model's config, which is on the hub) is for that machine to say."""
    import importlib

    import torch
    import tyro

    from common import checks, engines

    if on_gpu:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(engines, "vllm_available", lambda: True)
    found = []

    def refuse(problems):
        found.extend(problems)
        raise StopIteration  # the flags are checked: nothing after them

    monkeypatch.setattr(checks, "refuse", refuse)
    module = importlib.import_module(f"algorithms.{name}")
    with pytest.raises(StopIteration):
        module.check_args(tyro.cli(module.Args, args=flags))
    assert not found, f"{where}: {' '.join(flags)}"
