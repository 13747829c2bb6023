"""pytest set-up: offline everywhere, the built-in tiny model as fixtures, and which files are collected.
What tests import (the script runners, shared rollouts, assertions) is in helpers.py."""

import os

import pytest
from helpers import OFFLINE

os.environ.update(OFFLINE)  # tests never download weights or data

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `-n N` workers (pytest.ini: one per core)
    # One thread per worker, in its own process and in the scripts it starts: N workers share N cores. OpenMP threads
    # wait passively, not spinning at their barriers: a busy core is not taken from the other worker (spinning made
    # runs beside another job about five times slower on two cores).
    os.environ.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir():
    from common.tiny import tiny_model_dir

    return tiny_model_dir()


def _built(task, moe=False):
    """The built-in model of `task`, built on first use (with common.tiny.BUILD_THREADS, whatever a worker's)."""
    from common.tiny import tiny_model_dir

    return tiny_model_dir(task, moe=moe)


@pytest.fixture(scope="session")
def tiny_sums_dir(tiny_dir):
    """The built-in model of the `sums` task (warm-started from the arith one)."""
    return _built("sums")


@pytest.fixture(scope="session")
def tiny_products_dir(tiny_dir):
    """The built-in model of the tool task `products` (warm-started from the arith one to call a calculator)."""
    return _built("products")


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_dir):
    """The built-in mixture-of-experts model of the `arith` task (upcycled from the dense one)."""
    return _built("arith", moe=True)


@pytest.fixture(scope="session")
def tied_moe_dir(tiny_moe_dir, tmp_path_factory):
    """The built-in mixture-of-experts model with routers whose second choice is a bf16 tie decided in float32 by
    noise (helpers.tie_routers): a bf16 engine routes about half its token-layers otherwise than a float32 trainer,
    whatever machine built the model. The tokenizer is the built-in one."""
    from helpers import tie_routers

    from common.tiny import load

    model, tokenizer = load(tiny_moe_dir)
    path = tmp_path_factory.mktemp("tied_moe")
    tie_routers(model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the built-in model, float32, eval mode. Tests must not modify the model."""
    from common.tiny import load

    model, tokenizer = load(tiny_dir)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def readme_task_file(tmp_path_factory):
    """The README's example task file (the code block that starts `# my_task.py`), written to a temporary folder."""
    import re

    from helpers import REPO

    with open(os.path.join(REPO, "README.md")) as f:
        source = re.search(r"```python\n(# my_task\.py.*?)```", f.read(), re.S).group(1)
    path = tmp_path_factory.mktemp("task") / "my_task.py"
    path.write_text(source)
    return str(path)


def pytest_ignore_collect(collection_path, config):
    """tests/test_gpu.py runs when it is named (`./run.sh test tests/test_gpu.py` on a GPU machine, where
    it skips what that machine lacks, with the reason); the default suite is the CPU suite, with no skips."""
    if collection_path.name == "test_gpu.py" and not any("test_gpu.py" in str(arg) for arg in config.args):
        return True
    return None
