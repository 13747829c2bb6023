"""`python -m common.bench` (what `./run.sh bench` runs): see common/bench/runner.py."""

import tyro

from common.bench import runner

raise SystemExit(
    runner.main(tyro.cli(runner.BenchArgs, prog="python -m common.bench", description=runner.__doc__.split("\n")[0]))
)
