"""Rollout engines timed against each other: hf (transformers generate) and vllm when it is installed."""

import time

from common.engines import make_engine, vllm_available
from common.tasks import arith_rows
from common.tiny import load, tiny_model_dir


def benchmark(model_dir: str | None = None) -> None:
    """`python -m common.bench.engines`: engine start-up and rollout seconds, hf vs vllm, on the default
    workload (32 prompts x 8 samples, up to 16 new tokens) and a long one (256 x 64 tokens, forced)."""
    model_dir = model_dir or tiny_model_dir()
    model, tokenizer = load(model_dir)
    prompts = [tokenizer(row.question)["input_ids"] for row in arith_rows("train")[:256]]
    workloads = {
        "default 32x8, <=16 tokens": (prompts[:32], 8, 16, False),
        "long 256x1, 64 tokens": (prompts, 1, 64, True),
    }
    kinds = ["hf"] + (["vllm"] if vllm_available() else [])
    for kind in kinds:
        start = time.time()
        engine = make_engine(kind, model, tokenizer, model_path=model_dir, max_model_len=128)
        print(f"{kind}: start-up {time.time() - start:.1f} s")
        engine.generate(prompts[:8], 2, 4, 1.0)  # warm-up
        for name, (batch, n, tokens, ignore_eos) in workloads.items():
            seconds = []
            for _ in range(3):
                start = time.time()
                completions = engine.generate(batch, n, tokens, 1.0, ignore_eos=ignore_eos)
                seconds.append(time.time() - start)
            generated = sum(len(c.token_ids) for c in completions)
            print(f"{kind}: {name}: {min(seconds):.3f} s (best of 3), {generated / min(seconds):.0f} tokens/s")


if __name__ == "__main__":
    benchmark()
