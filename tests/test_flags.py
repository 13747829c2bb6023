"""common/flags.py: a script's Args holds the shared groups, whose flags keep their plain names on the command line,
and the helpers that read and build such an Args by flag name (what common/ and the tests use instead of fields)."""

import dataclasses
import os
import types

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


def test_checkpoints_are_due_every_save_every_steps_and_at_the_end():
    due = [step for step in range(1, 8) if flags.Checkpoints(save_every=3).due(step, 7)]
    assert due == [3, 6, 7]
    assert [step for step in range(1, 8) if flags.Checkpoints(save_every=0).due(step, 7)] == [7]


@pytest.mark.parametrize("keep, kept", [(2, [3, 4]), (0, [1, 2, 3, 4])])
def test_save_checkpoint_keeps_the_newest_keep_checkpoints(tmp_path, keep, kept):
    import torch
    from helpers import one_process
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.checkpoint import save_checkpoint

    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, num_key_value_heads=2, **shape))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    tokenizer = types.SimpleNamespace(save_pretrained=lambda folder: None)  # the weights are what is pruned
    checkpoints = flags.Checkpoints(keep_checkpoints=keep)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, scheduler, {}, one_process(), checkpoints)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step_{step:08d}" for step in kept]
