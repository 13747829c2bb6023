"""Errors in what a user gives (a flag, a task file, a model, a checkpoint), and how the commands show them.

raise BadInput("task file data/x.jsonl:3:14: not a JSON record (...)")
with clear_errors():        # around a command's main(): the message as one line, exit code 2
    main(args)
"""

from __future__ import annotations

import contextlib
import sys


class BadInput(ValueError):
    """An error in what the user gave (a flag, a task file, a model, a checkpoint): its message names the thing and
    what to do. The scripts print it as one line, without a traceback (`clear_errors`)."""


WHEN_A_RUN_FAILS = []  # what to do with an error before it ends a command (common/stopping.py adds the run's save)
# flags a script had and has no more, with what replaced them: named before the command line is parsed (the parser
# would say "Unrecognized options" and no more)
RETIRED_FLAGS = {
    "--sync-every": "p3o.py's --sync-every k (weights pushed every k steps) became --rollout-lag in every script: "
    "each step trains on rollouts sampled that many steps earlier (common/rollouts.py)",
}


@contextlib.contextmanager
def clear_errors():
    """Within the context, a BadInput ends the program with its message and exit code 2. Any error first goes to
    WHEN_A_RUN_FAILS (a run's StopSignals checkpoints the steps it finished, where it can: common/stopping.py)."""
    try:
        retired = [flag for flag in RETIRED_FLAGS if any(a.split("=")[0] == flag for a in sys.argv[1:])]
        if retired:
            raise BadInput(f"{retired[0]} is no longer a flag: {RETIRED_FLAGS[retired[0]]}")
        yield
    except BadInput as error:
        for then in WHEN_A_RUN_FAILS:
            then(error)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as error:
        for then in WHEN_A_RUN_FAILS:
            then(error)
        raise
