"""What a run settles after its flags are parsed: the precision, threads and collating workers the machine gets, the
batch sizes the probe found, the text length the model allows, the metric for the best model, and the step counts
that follow from the sharded data. Built once, by `make_plan`, and saved with the flags; the flags themselves are never
changed."""

import math
from dataclasses import dataclass

from src.errors import UserError


@dataclass(frozen=True)
class BatchSizes:
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    per_device_eval_batch_size: int


@dataclass(frozen=True)
class Plan:
    mixed_precision: str
    mixed_precision_reason: str
    cpu_threads: int
    dataloader_num_workers: int
    learning_rate: float
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    per_device_eval_batch_size: int
    max_length: int | None
    metric_for_best_model: str
    greater_is_better: bool
    max_train_steps: int
    num_epochs: int
    total_train_batch_size: int


def best_metric(args, task) -> tuple[str, bool]:
    """--metric_for_best_model (the task's main metric by default), checked against what evaluation reports for this
    task, and whether greater is better (--greater_is_better, else lower for losses and errors)."""
    name = (args.metric_for_best_model or task.main_metric).removeprefix("eval_")
    known = task.metric_names()
    if name not in known:
        per_label = dict.fromkeys(f"{k.split('/')[0]}/<label>" for k in known if "/" in k)  # one per kind, in order
        listed = ", ".join([k for k in known if "/" not in k] + list(per_label))
        if not args.metric_for_best_model:  # the task's own default: a task author's slip, not the user's
            raise UserError(f"{type(task).__name__}.main_metric {name!r} is not in its metric_names() ({listed})")
        raise UserError(
            f"--metric_for_best_model {name!r} is not reported for {task.describe()}; use one of {listed} (a metric of "
            "your own: return it from the task's metrics() and name it in metric_names())"
        )
    greater = args.greater_is_better if args.greater_is_better is not None else name not in task.lower_is_better
    return name, greater


def learning_rate(args, task) -> float:
    return args.learning_rate or task.default_learning_rate


def make_plan(args, accelerator, task, sizes: BatchSizes, max_length, precision_reason: str, cpu_threads: int,
              train_dataloader) -> Plan:  # fmt: skip
    """`train_dataloader`: the training loader after prepare() sharded it."""
    # The engine's accumulation counts (DeepSpeed's config overrides the flag).
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader) / accumulation)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    metric, greater = best_metric(args, task)
    return Plan(
        mixed_precision=accelerator.mixed_precision,
        mixed_precision_reason=precision_reason,
        cpu_threads=cpu_threads,
        dataloader_num_workers=train_dataloader.num_workers,
        learning_rate=learning_rate(args, task),
        per_device_train_batch_size=sizes.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation,
        per_device_eval_batch_size=sizes.per_device_eval_batch_size,
        max_length=max_length,
        metric_for_best_model=metric,
        greater_is_better=greater,
        max_train_steps=max_train_steps,
        num_epochs=math.ceil(max_train_steps / steps_per_epoch),
        total_train_batch_size=sizes.per_device_train_batch_size * accelerator.num_processes * accumulation,
    )
