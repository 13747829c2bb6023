"""common/flags.py: a script's Args holds the shared groups, whose flags keep their plain names on the command line,
and the helpers that read and build such an Args by flag name (what common/ and the tests use instead of fields)."""

import dataclasses

import pytest
import tyro

from common import flags


@dataclasses.dataclass
class Args:
    """A fork's Args in small: two flags of its own and two shared groups."""

    lr: float = 1e-4
    """the script's own flag"""
    steps: int = 60
    """another"""
    evaluation: flags.Group[flags.Evaluation] = dataclasses.field(default_factory=flags.Evaluation)
    systems: flags.Group[flags.Systems] = dataclasses.field(default_factory=flags.Systems)


def test_group_flags_keep_their_plain_names_on_the_command_line():
    args = tyro.cli(Args, args=["--lr", "0.5", "--lora-rank", "8", "--eval-every", "3"])
    assert (args.lr, args.systems.lora_rank, args.evaluation.eval_every) == (0.5, 8, 3)
    with pytest.raises(SystemExit):  # the group's name is not a prefix
        tyro.cli(Args, args=["--systems.lora-rank", "8"])


def test_flat_names_make_and_replace_see_one_namespace():
    args = flags.make(Args, lr=2.0, lora_rank=4, eval_k=2)
    assert (args.lr, args.systems.lora_rank, args.evaluation.eval_k) == (2.0, 4, 2)
    values = flags.flat(args)
    assert values["lr"] == 2.0 and values["lora_rank"] == 4 and "systems" not in values
    assert (
        set(values)
        == flags.names(Args)
        == {"lr", "steps"} | set(flags.flat(flags.Evaluation())) | set(flags.flat(flags.Systems()))
    )
    changed = flags.replace(args, steps=5, dtype="bfloat16")
    assert (changed.steps, changed.systems.dtype, changed.systems.lora_rank) == (5, "bfloat16", 4)
    assert (args.steps, args.systems.dtype) == (60, "auto")  # a copy: the original is unchanged
    with pytest.raises(TypeError, match=r"Args has no flag\(s\) \['lora_rnak'\]"):
        flags.make(Args, lora_rnak=4)


def test_a_fork_without_a_group_has_none_of_its_flags():
    @dataclasses.dataclass
    class Small:
        lr: float = 1e-4

    assert flags.names(Small) == {"lr"}
    with pytest.raises(TypeError):
        flags.make(Small, lora_rank=4)
