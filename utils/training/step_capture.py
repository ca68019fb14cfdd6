"""The training step's forward and backward captured once per length bucket and replayed (CUDA_GRAPHS).

A BERT-base LoRA step is about 1,100 small kernels launched from Python: on an H200 the GPU was busy 7 ms of a
45 ms step. As a CUDA graph a micro-batch is one launch, and the length buckets (utils/training/trainer.py) give a
few shapes, one graph each. A graph needs static inputs (buffers per bucket), static gradients (every `.grad` a
view of one flat buffer, all-reduced after the replay instead of DDP's hooks) and the random state kept across
its warm-up. Clipping, the optimizer, the scheduler and evaluation stay eager. On the CPU the same function runs
on the same buffers without a graph: the tests hold it to the eager step there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from utils.training.rng import rng_preserved

log = logging.getLogger(__name__)
# Runs of the whole step before a capture: the first builds cuBLAS handles, cuDNN's attention plans and the
# allocator's blocks (none of which may happen during a capture), the second runs on what the first built.
WARMUP_RUNS = 2
# Families whose attention takes a ready 4D mask as it is (transformers' create_bidirectional_mask returns it) and
# computes with it what it computes with the 2D one: their SDPA attention (ModernBERT's sliding window builds more).
FOUR_D_MASK_FAMILIES = frozenset({"bert", "roberta", "xlm-roberta", "electra"})


def takes_4d_mask(config) -> bool:
    """Whether the model gets the job's own 4D attention mask (`four_d_mask`): an SDPA model of a family above."""
    return config.model_type in FOUR_D_MASK_FAMILIES and getattr(config, "_attn_implementation", None) == "sdpa"


def four_d_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The 2D padding mask as SDPA's boolean (batch, 1, 1, length) one: given a 2D mask, transformers reads
    `mask.all()` on the host at every forward (a sync each step) and drops a mask without padding (another graph)."""
    return attention_mask[:, None, None, :].bool()


@dataclass
class Bucket:
    inputs: dict[str, torch.Tensor]  # the static input buffers
    loss: torch.Tensor | None = None  # the graph's static output (CUDA), else the last call's
    graph: torch.cuda.CUDAGraph | None = None


class CapturedStep:
    """Forward and backward of one micro-batch on static buffers, one set (and one CUDA graph) per input shape.
    `loss_of(inputs)` is the eager step's own loss; `graphs`: capture CUDA graphs (else call the function directly)."""

    def __init__(
        self,
        loss_of: Callable[[dict], torch.Tensor],
        trainable: list[torch.nn.Parameter],
        device: torch.device,
        graphs: bool,
    ):
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) != 1:
            raise ValueError(f"the trainable weights come in several dtypes {sorted(map(str, dtypes))}: one expected")
        self.loss_of, self.trainable, self.device, self.graphs = loss_of, trainable, device, graphs
        # Every .grad a view of one buffer: the same addresses at every replay, and one all-reduce under DDP.
        self.flat = torch.zeros(sum(p.numel() for p in trainable), dtype=dtypes.pop(), device=device)
        self.grads, offset = [], 0
        for parameter in trainable:
            self.grads.append(self.flat[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
        self.attach_grads()
        # The micro-batches of this optimizer step, which the loss is divided by: a device value the graph reads.
        self.divisor = torch.ones((), device=device)
        self.buckets: dict[tuple, Bucket] = {}
        self.capture_s = 0.0

    def attach_grads(self) -> None:
        for parameter, grad in zip(self.trainable, self.grads, strict=True):
            parameter.grad = grad

    def zero_grad(self) -> None:
        self.flat.zero_()

    @staticmethod
    def key(inputs: dict) -> tuple:
        return tuple(
            (name, tuple(value.shape), value.dtype) for name, value in inputs.items() if torch.is_tensor(value)
        )

    def prepare(self, batches: list[dict]) -> None:
        """Static buffers and, on CUDA, a graph for each batch's shape, warmed up and captured before training."""
        started = time.perf_counter()
        for batch in batches:
            if self.key(batch) not in self.buckets:
                self._prepare_bucket(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - started
        log.info(
            "the training step %s for %d input shape(s) in %.1f s",
            "captured as CUDA graphs" if self.graphs else "prepared on static buffers",
            len(self.buckets),
            self.capture_s,
        )

    def _prepare_bucket(self, batch: dict) -> Bucket:
        bucket = Bucket({name: torch.zeros_like(value, device=self.device) for name, value in batch.items()})
        self._copy_in(bucket, batch)
        self.buckets[self.key(batch)] = bucket
        kept = self.flat.clone()
        with rng_preserved(self.device):
            stream = torch.cuda.Stream(self.device) if self.graphs else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for _ in range(WARMUP_RUNS):
                    self._forward_backward(bucket.inputs)
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                bucket.graph = torch.cuda.CUDAGraph()
                # thread_local: the loader's pin-memory thread goes on pinning the next batches meanwhile.
                with torch.cuda.graph(bucket.graph, capture_error_mode="thread_local"):
                    bucket.loss = self._forward_backward(bucket.inputs)
        self.flat.copy_(kept)
        return bucket

    def _forward_backward(self, inputs: dict) -> torch.Tensor:
        loss = self.loss_of(inputs) / self.divisor
        grads = torch.autograd.grad(loss, self.trainable, allow_unused=True)
        used = [(mine, new) for mine, new in zip(self.grads, grads, strict=True) if new is not None]
        torch._foreach_add_([mine for mine, _ in used], [new for _, new in used])
        return loss.detach()

    def _copy_in(self, bucket: Bucket, batch: dict) -> None:
        for name, value in batch.items():
            bucket.inputs[name].copy_(value, non_blocking=True)

    def run(self, batch: dict, micro_batches: int) -> torch.Tensor:
        """One micro-batch's forward and backward on its bucket's buffers; its loss, as the eager step returns it."""
        bucket = self.buckets.get(self.key(batch))
        if bucket is None:  # a shape no warm-up batch had: prepared now (a log line says so)
            log.warning("a batch of a new shape %s: preparing its step inside the epoch", self.key(batch))
            started = time.perf_counter()
            bucket = self._prepare_bucket(batch)
            self.capture_s += time.perf_counter() - started
        self.divisor.fill_(micro_batches)
        self._copy_in(bucket, batch)
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.loss.clone()  # the next replay overwrites the static output
        return self._forward_backward(bucket.inputs)

    def record(self) -> dict:
        """logs/rank-R.json's `capture`."""
        return {
            "graphs": self.graphs,
            "shapes": [dict((name, list(shape)) for name, shape, _ in key) for key in self.buckets],
            "capture_s": round(self.capture_s, 3),
        }

    def all_reduce(self, group) -> None:
        """The gradients averaged over the replicas as DDP's reducer does it: divided, then summed."""
        self.flat.div_(torch.distributed.get_world_size(group))
        torch.distributed.all_reduce(self.flat, group=group)
