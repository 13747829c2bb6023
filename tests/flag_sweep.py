"""Flag sweep: each script's own flags, once away from their defaults, through a short run and its resume.

    .venv/bin/python tests/flag_sweep.py                  # every script (about an hour on 2 cores)
    .venv/bin/python tests/flag_sweep.py p3o gtpo --list  # the runs only, nothing run

For each flag value (with the companion flags it needs, VALUES below), three runs of 2 steps on the built-in
task: straight; 1 step, then --resume to 2. Two findings per value:
- `no effect`: its metrics equal, key for key, those of the run with the companions alone (the flag changed
  nothing a metric shows);
- `resume differs`: the resumed step 2 differs from the straight one (a state that is not in the checkpoint).
Flags that are expected to change nothing here say why (EXPECTED_EQUAL). Results go to OUT/results.jsonl (a
rerun skips what is there) and OUT/summary.md. Slow: not part of the test suite (the suite's own tests run the
flags that matter most end to end)."""

import argparse
import dataclasses
import importlib
import json
import math
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from helpers import ALGORITHMS  # noqa: E402

from common.errors import BadInput  # noqa: E402

# the runs: 8 prompts x 4 completions, two minibatches (so that ratios leave 1), no evaluation
BASE = dict(steps=2, prompts_per_step=8, group_size=4, num_minibatches=2, eval_every=0, save_every=0)
BASE_OF = {"tis_icepop": dict(engine_dtype="bfloat16")}  # a bf16 engine: μ ≠ π_old, the corrections act
# not swept: the experiment's bookkeeping and sizes (they change everything or nothing by design)
NOT_SWEPT = {"exp_name", "seed", "model", "task", "output_dir", "resume", "steps", "prompts_per_step", "group_size"}
# flag -> [(value, companions)]: the values each flag is tried at, with the flags it needs to act (a choice
# flag is tried at each of the script's own choices but its default; a value equal to the default is skipped).
# The built-in arith model answers in 2 to 4 tokens: --max-new-tokens 3 cuts some answers off.
VALUES = {
    "max_prompt_tokens": [(16, {})],
    "max_new_tokens": [(3, {})],
    "temperature": [(0.7, {})],
    "dynamic_sampling": [(True, {})],
    "max_sampling_rounds": [(1, {"dynamic_sampling": True})],
    "overlong_buffer": [(2, {"max_new_tokens": 4})],
    "mask_truncated": [(True, {"max_new_tokens": 3})],
    "clip_low": [(0.02, {})],
    "clip_high": [(0.02, {})],
    "scale_advantages": [(False, {})],
    "loss_aggregation": [("sequence-mean", {}), ("token-sum-norm", {})],
    "ratio_level": [("sequence", {})],
    "ratio_to": [("behavior", {})],
    "kl_coef": [(0.1, {})],
    "lr": [(1e-3, {})],
    "warmup_steps": [(3, {})],
    "weight_decay": [(0.5, {"lr": 1e-2})],
    "max_grad_norm": [(0.01, {})],
    "num_minibatches": [(4, {})],
    "update_epochs": [(2, {})],
    "micro_batch_size": [(4, {})],  # ISOPO: a multiple of --block-size (VALUES_OF)
    # ema_kpo
    "smoother": [("kalman", {}), ("fixed", {"alpha": 0.01})],
    "kalman_q": [(1e-2, {"smoother": "kalman"})],
    "kalman_v": [(0.1, {"smoother": "kalman"})],
    "p0": [(0.1, {"smoother": "kalman"})],
    "alpha": [(0.9, {"smoother": "fixed", "alpha": 0.01})],
    # p3o
    "ess_scope": [("micro-batch", {"micro_batch_size": 8})],
    "sampling_temperature": [(1.2, {})],
    "loss": [("clip", {})],
    "clip_eps": [(0.05, {"loss": "clip"})],
    # gtpo
    "conflict_masks": [(False, {})],
    "mask_combine": [("product", {})],
    "divide_by_conflict_count": [(True, {})],
    "entropy_coef": [(0.5, {})],
    "entropy_filter": [("on", {}), ("off", {})],
    "entropy_threshold": [(0.1, {"entropy_filter": "on"})],
    "entropy_ini_prompts": [(20, {})],
    # isopo
    "block_size": [(4, {})],
    "variant": [("interacting", {})],
    "p": [(-0.5, {})],
    "q": [(-0.5, {})],
    "r": [(-1.0, {})],
    "n_overlap": [(4, {})],
    "reg_coef": [(1.0, {})],
    "reg_form": [("authors", {"reg_coef": 1.0})],
    "ntk_reg_coef": [(0.1, {"variant": "interacting"})],
    "ntk_scale": [("authors", {"variant": "interacting"})],
    "ema_decay": [(0.5, {"reg_coef": 1.0})],
    "log_kl_ref": [(True, {})],
    # tis_icepop
    "correction": [(c, {}) for c in ("none", "tis-seq", "mis", "mis-seq", "icepop", "kpop", "seq-mask")],
    "tis_cap": [(1.01, {})],
    "mis_low": [(0.99, {"correction": "mis"})],
    "mis_high": [(1.01, {"correction": "mis"})],
    "icepop_alpha": [(0.99, {"correction": "icepop"})],
    "icepop_beta": [(1.01, {"correction": "icepop"})],
    "kpop_phi": [(1e-6, {"correction": "kpop"})],  # a bf16 engine: binary KLs of about 1e-4 and less
    "seq_mask_delta": [(0.001, {"correction": "seq-mask"})],
}
# flags whose run is expected to equal the companions' run here, and why
EXPECTED_EQUAL = {
    "max_prompt_tokens": "no built-in prompt is longer than 16 tokens",
    "micro_batch_size": "gradient accumulation: the same sums in another order (float32 rounding at most)",
    ("smoother", "kalman"): "the Kalman gains do not depend on the data: the filter is the EMA with α_t = K_t (Eq. 9)",
    "mask_combine": "λ^fw·λ^bw differs from the or only where a forward and a backward span overlap: none in 2 steps",
    ("entropy_filter", "on"): "auto is on here (the built-in model's ⟨H⟩_ini is below ln 2)",
    **{
        ("correction", c): "a bf16 engine's π_old/μ stays inside the default thresholds, where this weights a token as"
        " TIS does (the thresholds moved to 0.99 / 1.01 act)"
        for c in ("mis", "icepop", "kpop")
    },
}
# flags whose resumed run is expected to differ here, and why (the split is at step 1)
EXPECTED_RESUME_DIFF = {}
NOT_HERE = {"router_replay": "needs a mixture-of-experts model with a routing engine (tests/test_moe.py)"}


def own_flags(module) -> list[str]:
    """The script's own flags: its Args fields that are not a shared group, less the experiment's."""
    fields = dataclasses.fields(module.Args)
    own = [f.name for f in fields if not dataclasses.is_dataclass(f.default_factory)]
    return [name for name in own if name not in NOT_SWEPT]


def values_of(module, flag: str) -> list[tuple]:
    """(value, companions) to try for the script's `flag`: VALUES' (a choice flag: the script's own choices),
    each away from the script's default."""
    import typing

    spec = next(f for f in dataclasses.fields(module.Args) if f.name == flag)
    listed = VALUES_OF.get((module.__name__.split(".")[-1], flag)) or VALUES.get(flag, [(None, None)])
    if typing.get_origin(spec.type) is typing.Literal:
        companions = dict(listed[0][1] or {}) if listed[0][1] is not None else {}
        listed = [(choice, VALUES_FOR_CHOICE.get((flag, choice), companions)) for choice in typing.get_args(spec.type)]
    return [(value, companions) for value, companions in listed if value != spec.default]


# a script's own values of a flag
VALUES_OF = {("isopo", "micro_batch_size"): [(16, {})]}
# a choice that needs companions of its own
VALUES_FOR_CHOICE = {("smoother", "fixed"): {"alpha": 0.01}, ("smoother", "kalman"): {}}


def comparable(record: dict) -> dict:
    """A step's metrics without the timings (they differ between any two runs)."""
    skip = ("time/", "memory/", "charts/tokens_per_second")
    return {k: v for k, v in record.items() if not k.startswith(skip)}


def same(a: dict, b: dict) -> bool:
    """Equal key for key (NaN equals NaN)."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


def run(name: str, settings: dict, folder: str, resume: bool = False) -> list[dict]:
    """main() of the script in this process: its metrics.jsonl records (steps 1 and 2)."""
    from common import flags

    module = importlib.import_module(f"algorithms.{name}")
    if not resume:
        shutil.rmtree(folder, ignore_errors=True)
    values = {**BASE, **BASE_OF.get(name, {}), **settings, "output_dir": folder}
    if resume:
        values["resume"] = "auto"
    try:
        module.main(flags.make(module.Args, **values))
    finally:  # a main() that raised keeps its run folder's lock: release it for the next run here
        from common import checkpoint

        for locked in list(checkpoint._LOCKS):
            checkpoint.release_run_folder(locked)
    [run_dir] = [os.path.join(folder, d) for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))]
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=ALGORITHMS, help="scripts")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "flag_sweep"), help="results folder")
    parser.add_argument("--list", action="store_true", help="list the runs, run nothing")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.jsonl")
    done = {}
    if os.path.exists(results_path):
        done = {(r["script"], r["flag"], json.dumps(r["value"])): r for r in map(json.loads, open(results_path))}
    baselines = {}
    for name in args.names:
        module = importlib.import_module(f"algorithms.{name}")
        for flag in own_flags(module):
            if flag in NOT_HERE:
                print(f"{name} --{flag}: not here ({NOT_HERE[flag]})")
                continue
            for value, companions in values_of(module, flag):
                if companions is None:
                    print(f"{name} --{flag}: no value in VALUES", file=sys.stderr)
                    continue
                key = (name, flag, json.dumps(value))
                if args.list or key in done:
                    print(f"{name} --{flag} {value} {companions or ''}" + (" (done)" if key in done else ""))
                    continue
                record = {"script": name, "flag": flag, "value": value, "companions": companions}
                scratch = os.path.join(args.out, "scratch")
                try:
                    base_key = (name, json.dumps(companions, sort_keys=True))
                    if base_key not in baselines:
                        try:
                            baselines[base_key] = run(name, companions, os.path.join(scratch, "baseline"))
                        except BadInput:  # companions that need the flag itself (--alpha needs --smoother fixed)
                            baselines[base_key] = run(name, {}, os.path.join(scratch, "baseline"))
                    straight = run(name, {**companions, flag: value}, os.path.join(scratch, "straight"))
                    run(name, {**companions, flag: value, "steps": 1}, os.path.join(scratch, "split"))
                    split = run(name, {**companions, flag: value}, os.path.join(scratch, "split"), resume=True)
                    effect = not same(comparable(straight[-1]), comparable(baselines[base_key][-1]))
                    resumed = same(comparable(straight[-1]), comparable(split[-1]))
                    record.update(effect=effect, resume_exact=resumed)
                    if not resumed:
                        record["resume_diff"] = sorted(
                            k for k in comparable(straight[-1]) if straight[-1][k] != split[-1].get(k)
                        )[:8]
                except Exception as error:  # a refusal or a crash: itself a finding (a signal stops the sweep)
                    record.update(error=f"{type(error).__name__}: {error}"[:500])
                with open(results_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                done[key] = record
                print(json.dumps(record), flush=True)
    if not args.list:
        write_summary(list(done.values()), os.path.join(args.out, "summary.md"))


def write_summary(records: list[dict], path: str) -> None:
    lines = ["# Flag sweep: findings", ""]
    for r in records:  # the reasons as this file gives them now, where the finding is there
        equal = EXPECTED_EQUAL.get((r["flag"], r["value"])) or EXPECTED_EQUAL.get(r["flag"])
        r.update(expected_equal=equal if not r.get("effect", True) else None)
        r.update(expected_resume_diff=EXPECTED_RESUME_DIFF.get(r["flag"]) if not r.get("resume_exact", True) else None)
        flag = f"{r['script']} --{r['flag'].replace('_', '-')} {r['value']}"
        if "error" in r:
            lines.append(f"- {flag}: refused or failed: {r['error']}")
        elif not r["effect"] and not r.get("expected_equal"):
            lines.append(f"- {flag}: no effect on any metric")
        elif not r["resume_exact"] and not r.get("expected_resume_diff"):
            lines.append(f"- {flag}: the resumed step 2 differs ({', '.join(r['resume_diff'])})")
    total = len(records)
    expected = [r for r in records if r.get("expected_equal") or r.get("expected_resume_diff")]
    lines += ["", "Expected here:"] + [
        f"- {r['script']} --{r['flag'].replace('_', '-')} {r['value']}: "
        + (r.get("expected_equal") or r.get("expected_resume_diff"))
        for r in expected
    ]
    lines += ["", f"{total} flag values run; every value not listed changed the run and resumed exactly."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
