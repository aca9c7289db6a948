"""--auto_find_batch_size: the largest per-device batch, up to the one asked for, whose worst case fits in memory,
with gradient accumulation raised so that the total batch stays the one asked for; and the largest evaluation
batch, up to --per_device_eval_batch_size, that fits beside the training state.

Each rank probes on its own, before `prepare()`: one forward and backward pass on the longest training examples,
outside any DDP gradient synchronisation, so a rank that runs out of memory leaves no other rank waiting in an
all-reduce. The ranks then take the smallest size any of them found. FSDP and DeepSpeed shard the model inside
`prepare()`: there is no safe probe before it, and one inside would run out of memory within their collectives.
"""

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from src.checkpoint import read_checkpoint_args
from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, lengths_of
from src.plan import BatchSizes

logger = get_logger(__name__)


def next_smaller(size: int, requested: int) -> int:
    """The largest divisor of `requested` no more than half of `size` (0 after 1): halving, kept to divisors so that
    more accumulation steps make up the total batch exactly."""
    return max((d for d in range(1, size // 2 + 1) if requested % d == 0), default=0)


def fit_batch_sizes(sizes: BatchSizes, accelerator, model, splits, collator, task, resume_path=None) -> BatchSizes:
    """The largest per-device training batch, up to the one asked for, that fits on every rank (with the gradient
    accumulation that keeps the total batch), then the evaluation batch likewise; a resumed run keeps the training
    sizes its checkpoint was made with. `splits`: 'train' and 'validation'; `collator`: the loaders' own."""
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UserError(
            f"--auto_find_batch_size cannot probe memory under {accelerator.distributed_type.value}, which shards the "
            "model as it trains: leave it off and set --per_device_train_batch_size yourself"
        )
    model.to(accelerator.device)  # where prepare() would put it
    probe = _Probe(accelerator, model, collator, task)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sizes = _fit_train_batch_size(sizes, probe, splits["train"], resume_path, trainable)
    accelerator.gradient_accumulation_steps = sizes.gradient_accumulation_steps
    return _fit_eval_batch_size(sizes, probe, splits["validation"], trainable)


def _fit_train_batch_size(sizes, probe, dataset, resume_path, trainable: int) -> BatchSizes:
    requested, accumulation = sizes.per_device_train_batch_size, sizes.gradient_accumulation_steps
    if resume_path is not None:
        saved = read_checkpoint_args(resume_path)
        found = saved.get("per_device_train_batch_size"), saved.get("gradient_accumulation_steps")
        if not all(isinstance(n, int) for n in found):
            return sizes  # an unreadable checkpoint: loading it says what is wrong
        if found[0] * found[1] != requested * accumulation:  # in the sizes asked for: the run may have found others
            raise UserError(
                f"checkpoint {resume_path} was made with {found[0] * found[1]} examples per process and optimizer step "
                f"(--per_device_train_batch_size {found[0]} x --gradient_accumulation_steps {found[1]}) and this run "
                f"asks for {requested * accumulation} ({requested} x {accumulation}): resume with sizes that make "
                f"{found[0] * found[1]}, so that the run continues exactly"
            )
        why = f"the batch size found when the run started (checkpoint {resume_path})"
        return _use(sizes, probe.accelerator, *found, why)
    # A training step holds AdamW's two fp32 moments per trainable weight (made at the first real step) and, on
    # more than one process, DDP's gradient buckets (a copy of the gradients): the probe runs without DDP.
    reserve = 2 * trainable + (trainable if probe.accelerator.num_processes > 1 else 0)
    fix = "lower --max_length, add --gradient_checkpointing or --use_peft, or use FSDP to shard the model"
    size, longest = probe.largest_that_fits(dataset, requested, reserve, True, "example", fix)
    if size == requested:
        logger.info(f"--auto_find_batch_size: {requested} examples of up to {longest} tokens per device fit in memory")
        return sizes
    why = f"{requested} examples of up to {longest} tokens per device do not fit in memory"
    return _use(sizes, probe.accelerator, size, accumulation * (requested // size), why)


def _fit_eval_batch_size(sizes, probe, dataset, trainable: int) -> BatchSizes:
    """Evaluation runs between training steps, beside AdamW's moments: a decoder LLM that trains fine can run out of
    memory at its first evaluation. Halving only: the evaluation batch has no accumulation to make up for it."""
    requested = sizes.per_device_eval_batch_size
    fix = "lower --max_length or use FSDP to shard the model"
    size, longest = probe.largest_that_fits(dataset, requested, 2 * trainable, False, "validation example", fix)
    if size < requested:
        logger.warning(
            f"--auto_find_batch_size: {requested} validation examples of up to {longest} tokens per device do not fit "
            f"in memory; evaluating with --per_device_eval_batch_size {size}"
        )
    return replace(sizes, per_device_eval_batch_size=size)


def _use(sizes: BatchSizes, accelerator, size: int, accumulation: int, why: str) -> BatchSizes:
    if (size, accumulation) == (sizes.per_device_train_batch_size, sizes.gradient_accumulation_steps):
        return sizes
    total = size * accumulation * accelerator.num_processes
    logger.warning(
        f"--auto_find_batch_size: {why}; training with --per_device_train_batch_size {size} and "
        f"--gradient_accumulation_steps {accumulation} (was {sizes.per_device_train_batch_size} and "
        f"{sizes.gradient_accumulation_steps}): the same total batch of {total}"
    )
    return replace(sizes, per_device_train_batch_size=size, gradient_accumulation_steps=accumulation)


@dataclass(frozen=True)
class _Probe:
    """Steps on the longest rows, through the loop's own collator and `task.step`, before `prepare()`."""

    accelerator: Any
    model: Any
    collator: Any
    task: Any

    def largest_that_fits(
        self, dataset, requested: int, reserve: int, train: bool, what: str, fix: str
    ) -> tuple[int, int]:
        """(the largest size, from `requested` down, whose step fits on every rank, the longest example's tokens); an
        error with `fix` if not even 1 `what` does. Training sizes (`train`) stay divisors of `requested`
        (`next_smaller`); evaluation sizes halve."""
        size = requested
        while size and not self.step_fits(self.longest_batch(dataset, size), reserve, train):
            clear_device_cache(garbage_collection=True)  # the failed attempt's tensors, freed with its traceback
            size = next_smaller(size, requested) if train else size // 2
        size = int(self.accelerator.gather(torch.tensor([size], device=self.accelerator.device)).min())  # every rank
        longest = int(lengths_of(dataset).max())
        if size == 0:
            raise UserError(f"--auto_find_batch_size: even 1 {what} of {longest} tokens per device runs out of memory; "
                            f"{fix}")  # fmt: skip
        return size, longest

    def longest_batch(self, dataset, size: int) -> dict:
        longest = np.argsort(-lengths_of(dataset), kind="stable")[:size].tolist()
        rows = dataset.select(longest).remove_columns([INDEX_COLUMN, LENGTH_COLUMN])
        return self.collator([row for row in rows])

    def step_fits(self, batch, reserve: int, train: bool) -> bool:
        """Whether one step on `batch` fits in memory beside `reserve` fp32 values held elsewhere: a training step
        (forward, backward, gradients) or an evaluation step (forward without gradients). The RNG (dropout) is left
        as it was, and the model in training mode without gradients."""
        device, model = self.accelerator.device, self.model
        batch = {key: value.to(device) for key, value in batch.items()}
        model.train(train)
        try:
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                reserved = torch.empty(reserve, dtype=torch.float32, device=device)
                with torch.set_grad_enabled(train), self.accelerator.autocast():
                    loss = self.task.step(model, batch).loss
                if train:
                    loss.backward()
                del reserved, loss
            return True
        except Exception as err:  # only out-of-memory errors mean "smaller"; anything else is a real failure
            if not should_reduce_batch_size(err):
                raise
            return False
        finally:
            model.zero_grad(set_to_none=True)
            model.train()
