"""What one training forward leaves alive for the backward, on however many ranks this is launched with
(`torchrun --nproc_per_node N tests/distributed_forward_memory.py OUT.json DTYPE`):

The built-in model is set up as the scripts set it up (fsdp.prepare_for_training, then fsdp.shard with the
compute dtype) and scores one short response with grpo.py's token_logprobs under the scripts' autocast.
Every tensor autograd saves for the backward is recorded; after the forward, the bytes of the storages
still allocated are counted (a weight FSDP2 gathered and freed again holds none). Writes, from rank 0:
{"saved_bytes": ..., "layer_weight_bytes": ...}, the latter the size of all decoder layers' weights in DTYPE.
The response is short, so the activations are small beside the weights: what is left is the weights'."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from helpers import compute_dtype, precision

from algorithms import grpo
from common import fsdp
from common.engines import Completion
from common.tiny import load, tiny_model_dir


def main(out_path, dtype):
    dist = fsdp.setup()
    model, tokenizer = load(tiny_model_dir())
    layer_weight_bytes = sum(p.numel() * compute_dtype(dtype).itemsize for p in model.model.layers.parameters())
    policy = fsdp.shard(fsdp.prepare_for_training(model), dist, compute_dtype=compute_dtype(dtype))
    prompt = tokenizer("Q: 1+2=")["input_ids"]
    batch = grpo.make_batch(
        [prompt],
        [Completion(tokenizer("3", add_special_tokens=False)["input_ids"], [-1.0], "stop")],
        1,
        tokenizer.pad_token_id,
        dist.device,
    )
    saved = []
    with (
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
        precision(dtype).autocast,
    ):
        logprobs, _ = grpo.token_logprobs(policy, batch, temperature=1.0)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    saved_bytes = sum(size for pointer, size in storages.items() if pointer)
    saved.clear()
    logprobs.sum().backward()  # the saved tensors are still usable: the backward runs
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump({"saved_bytes": saved_bytes, "layer_weight_bytes": layer_weight_bytes}, f)
    fsdp.cleanup(dist)


if __name__ == "__main__":
    main(*sys.argv[1:])
