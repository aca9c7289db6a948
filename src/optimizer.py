"""The optimizer and the learning-rate schedule."""

import json
import math

import torch
from accelerate.utils import DistributedType

from src.errors import UserError


def build_optimizer(model, args, device, learning_rate: float) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and LayerNorm weights (the 1-D parameters).

    fused: one kernel for all tensors instead of a loop over ~100; on 2 CPU cores MiniLM's update drops from
    ~190 to ~40 ms per step. Groups of your own (another learning rate for the head, say) go in parameter_groups():
    under FSDP, use_sharded_parameters() regroups the sharded parameters by it, group for group.
    """
    decayed, not_decayed = parameter_groups(model)
    groups = [{"params": decayed, "weight_decay": args.weight_decay}, {"params": not_decayed, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, fused=device.type in ("cpu", "cuda"))


def parameter_groups(model) -> tuple[list, list]:
    """The trainable parameters with weight decay (matrices) and without (biases, LayerNorm weights)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return [p for p in parameters if p.ndim >= 2], [p for p in parameters if p.ndim < 2]


def use_sharded_parameters(optimizer, model, accelerator):
    """Under FSDP, point the optimizer at the prepared model's sharded parameters, in build_optimizer's groups.

    accelerate builds the optimizer before sharding (FSDP2 wants both in one prepare() call) and then swaps each
    parameter for its shard by matching data pointers. With fsdp_cpu_ram_efficient_loading, the ranks other than 0
    build the model on the meta device (src/model.py, `weights_come_from_rank_0`), where every pointer is 0: all
    parameters would become one in the optimizer, and the others would never be trained on those ranks. Before the
    first step the optimizer holds no state, so regrouping loses nothing.
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    for group, parameters in zip(optimizer.param_groups, parameter_groups(model), strict=True):
        group["params"] = parameters


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters; a LoRA model's total includes its adapters. DeepSpeed ZeRO-3 (zero3_init_flag)
    leaves each parameter empty on the ranks and records its size as `ds_numel`."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(size for size, trainable in sizes if trainable), sum(size for size, _ in sizes)


def build_scheduler(optimizer, args, max_train_steps: int):
    """--lr_scheduler_type (with --lr_scheduler_kwargs) over the run's optimizer steps, after --num_warmup_steps (or
    --warmup_ratio of them)."""
    from transformers import get_scheduler  # its module imports peft: 1.7 s for a fork server that needs neither

    warmup_steps = args.num_warmup_steps if args.num_warmup_steps is not None else args.warmup_ratio * max_train_steps
    if warmup_steps >= max_train_steps > 0:  # the learning rate would never reach --learning_rate
        raise UserError(f"--num_warmup_steps {args.num_warmup_steps} is not less than the run's {max_train_steps} "
                        "optimizer steps: lower it, or use --warmup_ratio")  # fmt: skip
    steps = {"num_warmup_steps": math.ceil(warmup_steps), "num_training_steps": max_train_steps}
    options = args.lr_scheduler_kwargs or {}
    if options and args.lr_scheduler_type.startswith("constant"):  # get_scheduler would ignore them without a word
        raise UserError(f"--lr_scheduler_type {args.lr_scheduler_type} takes no --lr_scheduler_kwargs: drop them")
    try:
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, **steps, scheduler_specific_kwargs=options)
        # A value the schedule cannot use ("3" for num_cycles) fails only where the warmup ends: tried here, not
        # hours into the run.
        for rate_at in getattr(scheduler, "lr_lambdas", []):  # a LambdaLR, as all of SCHEDULERS are
            rate_at(steps["num_warmup_steps"]), rate_at(max_train_steps)
    except (TypeError, ValueError) as err:  # a keyword the schedule does not take or lacks, a value it cannot use
        given = f" --lr_scheduler_kwargs {json.dumps(options)}" if options else ""
        raise UserError(f"--lr_scheduler_type {args.lr_scheduler_type}{given}: {err} (the schedule's own arguments "
                        "go in --lr_scheduler_kwargs)") from err  # fmt: skip
    return scheduler
