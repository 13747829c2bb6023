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


def test_a_flags_help_wrapped_in_the_source_reads_as_one_paragraph():
    """tyro kept the line break before each indented continuation line of a flag's docstring: --help broke its text
    mid-sentence ("... (advantage 0) are" / "replaced by ..."). common/flags.py dedents before tyro joins."""
    import tyro._docstrings

    from algorithms import grpo

    help_text = tyro._docstrings.get_field_docstring(grpo.Args, "dynamic_sampling", ())
    assert help_text.endswith("all equal (advantage 0) are replaced by newly drawn prompts"), help_text


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


def _checkpointed_training(tmp_path, keep=0, dtype=None):
    """What save_checkpoint and load_checkpoint are given: a one-layer model, its optimizer, scheduler and loss
    scale (float16's with `dtype` torch.float16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, num_key_value_heads=2, **shape))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2]])).logits.sum().backward()
    optimizer.step()  # an optimizer with a state to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    tokenizer = types.SimpleNamespace(save_pretrained=lambda folder: None)  # the weights are what is pruned
    return model, tokenizer, optimizer, scheduler, scaler, flags.Checkpoints(keep_checkpoints=keep)


@pytest.mark.parametrize(
    "keep, saved, kept",
    [
        (2, [1, 2, 3, 4], [3, 4]),
        (0, [1, 2, 3, 4], [1, 2, 3, 4]),
        # resumed from step 4 of a run that reached 8: the steps after 4 are rewritten, their checkpoints go
        (1, [2, 4, 6, 8, 5], [5]),
        (3, [2, 4, 6, 8, 5], [4, 5]),
        (0, [2, 4, 6, 8, 5], [2, 4, 5]),
    ],
)
def test_save_checkpoint_keeps_the_newest_keep_checkpoints_of_the_steps_it_continues(tmp_path, keep, saved, kept):
    from helpers import one_process

    from common.checkpoint import save_checkpoint

    model, tokenizer, optimizer, scheduler, scaler, checkpoints = _checkpointed_training(tmp_path, keep)
    for step in saved:
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, scheduler, scaler, {}, one_process(), checkpoints)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step_{step:08d}" for step in kept]


def test_a_checkpoint_keeps_float16s_loss_scale(tmp_path):
    """--dtype float16: the loss scale a run lowered after overflows is resumed, not the initial 2^16 (which would
    skip the resumed run's steps again)."""
    import torch
    from helpers import one_process

    from common.checkpoint import load_checkpoint, save_checkpoint

    model, tokenizer, optimizer, scheduler, scaler, checkpoints = _checkpointed_training(tmp_path, dtype=torch.float16)
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss
    for _ in range(3):  # three overflows: 2^16 halved three times
        scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {"cpu": torch.ones(())}
        scaler.update()
    assert scaler.get_scale() == 2.0**13
    save_checkpoint(tmp_path, 3, model, tokenizer, optimizer, scheduler, scaler, {}, one_process(), checkpoints)
    model, _, optimizer, scheduler, resumed, _ = _checkpointed_training(tmp_path, dtype=torch.float16)
    load_checkpoint(
        str(tmp_path / "checkpoints" / "step_00000003"), model, optimizer, scheduler, resumed, one_process()
    )
    assert resumed.get_scale() == 2.0**13


def _saved_run(run_dir, steps, keep=0):
    """A run folder with real checkpoints of `steps` (save_checkpoint of a one-layer model), saved with lr 1e-4."""
    from helpers import one_process

    from common.checkpoint import save_checkpoint

    model, tokenizer, optimizer, scheduler, scaler, checkpoints = _checkpointed_training(run_dir, keep)
    state = {"args": {"lr": 1e-4, "steps": 10, "resume": None}}
    for step in steps:
        save_checkpoint(
            run_dir, step, model, tokenizer, optimizer, scheduler, scaler, dict(state), one_process(), checkpoints
        )
    return model, tokenizer, optimizer, scheduler, scaler, checkpoints, state


def test_a_resume_from_an_earlier_checkpoint_drops_the_later_ones_once_its_checks_have_passed(tmp_path, capsys):
    """--resume <run>/checkpoints/step_2 of a run that reached step 4 rewrites steps 3 and 4, their metrics and their
    checkpoints. Opening the run deletes nothing (a resume refused later, on its rows or its model, kept them all);
    the later checkpoints go when the checkpoint is loaded, the last check of the set-up, before the metrics after
    step 2 are cut (tracking.Tracker). Left until the first save, a run stopped before it resumed from the abandoned
    step 4 over metrics cut to step 2, the steps between lost from both runs. The path as a shell completes it (a
    trailing /), and an --output-dir with glob characters in its name (a sweep's `runs/[lr=1e-4]`), are resumed
    alike."""
    from helpers import one_process

    from common.checkpoint import find_checkpoint, load_checkpoint, open_run_folder, release_run_folder

    output_dir = tmp_path / "runs [lr=1e-4]"
    run = output_dir / "arith__grpo__1__1800000100"
    # (a // in the path: compared as glob returns it, all went)
    model, _, optimizer, scheduler, scaler, _, _ = _saved_run(f"{output_dir}//{run.name}", [2, 4])
    checkpoints = run / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step_00000002", "step_00000004"]
    settings = {"lr": 1e-4, "steps": 10, "resume": "auto"}
    assert find_checkpoint("auto", str(output_dir), "arith__grpo__1__", settings) == str(checkpoints / "step_00000004")
    settings["resume"] = str(checkpoints / "step_00000002") + "/"
    folder, checkpoint = open_run_folder(str(output_dir), settings["resume"], "arith__grpo__1", settings, one_process())
    assert (folder, checkpoint) == (str(run), str(checkpoints / "step_00000002"))
    assert sorted(os.listdir(checkpoints)) == ["step_00000002", "step_00000004"]  # nothing deleted yet
    load_checkpoint(checkpoint, model, optimizer, scheduler, scaler, one_process())
    release_run_folder(folder)
    assert sorted(os.listdir(checkpoints)) == ["step_00000002"]
    assert "the run's later checkpoints (step_00000004) and metrics are dropped" in capsys.readouterr().err
    assert find_checkpoint("auto", str(output_dir), "arith__grpo__1__", settings) == checkpoint


def test_a_kill_while_a_checkpoint_is_removed_leaves_it_whole_or_gone(tmp_path, monkeypatch):
    """rmtree deletes in the file system's order: killed halfway through a checkpoint that a resumed run rewrites (the
    same step saved again), it left a trainer_state.pt beside missing optimizer shards, a checkpoint taken for complete
    that every --resume then found damaged. A checkpoint is moved aside in one rename before it is deleted."""
    import shutil

    from helpers import one_process

    from common import checkpoint as checkpoint_module
    from common.checkpoint import find_checkpoint, save_checkpoint
    from common.checks import check_checkpoint_files

    run = tmp_path / "run"
    model, tokenizer, optimizer, scheduler, scaler, checkpoints, state = _saved_run(run, [2, 4])
    delete = shutil.rmtree

    def killed_halfway(path, ignore_errors=False):  # the optimizer's shards go first, then the process is killed
        if os.path.isdir(os.path.join(path, "optimizer")):
            delete(os.path.join(path, "optimizer"))
            raise SystemExit(137)
        delete(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_halfway)
    with pytest.raises(SystemExit):
        save_checkpoint(run, 4, model, tokenizer, optimizer, scheduler, scaler, dict(state), one_process(), checkpoints)
    newest = find_checkpoint(str(run), str(tmp_path), "x")
    check_checkpoint_files(newest)  # whole: the new step 4 (or the old one), not half of one
    assert newest == str(run / "checkpoints" / "step_00000004")
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", delete)
    save_checkpoint(run, 5, model, tokenizer, optimizer, scheduler, scaler, dict(state), one_process(), checkpoints)
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{s:08d}" for s in (2, 4, 5)]  # the leftover is gone


def test_a_run_folder_that_cannot_be_written_is_named(tmp_path):
    """Resuming a run folder this process cannot write (another user's, a read-only mount: here its lock file cannot
    be opened, as root passes every permission check) names the folder, not a PermissionError's traceback."""
    from common.checkpoint import _lock
    from common.errors import BadInput

    (tmp_path / "run.lock").mkdir()
    with pytest.raises(BadInput, match=f"run folder {tmp_path} cannot be written .*: a run writes its folder"):
        _lock(str(tmp_path))
