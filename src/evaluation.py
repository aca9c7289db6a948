"""Distributed evaluation: every example counted exactly once, results returned in row order, for any task."""

import numpy as np
import torch

from src.errors import UserError
from src.loaders import INDEX_COLUMN

# Outputs of different lengths (a label per token) are padded with this, the ignore index of the labels, so that
# the task's metrics skip the padding as they skip the labels it stands beside.
PAD = -100


def evaluate(model, dataloader, accelerator, task) -> tuple[dict, dict]:
    """(metrics prefixed 'eval_', the per-example outputs of `task.step` in row order, with each row's number in
    'index') over the whole dataset, on any number of processes.

    The distributed sampler pads the last batches with repeated examples so that every rank gets the same number;
    `gather_for_metrics` drops those repeats, `pad_across_processes` evens out outputs whose length differs from rank
    to rank, and the row index puts the length-sorted batches back in dataset order.
    """
    model.eval()
    parts = {}
    for batch in dataloader:
        index = batch.pop(INDEX_COLUMN, None)
        if index is None:  # a task author's slip, caught at its first use
            raise UserError(f"{type(task).__name__}.collator() left each row's {INDEX_COLUMN!r} out of the batch: "
                            "evaluation puts the gathered outputs back in row order with it; keep it as a tensor "
                            "(see Task.collator in src/tasks/base.py)")  # fmt: skip
        labelled = "labels" in batch
        with torch.no_grad():
            outputs = task.step(model, batch).outputs
        if labelled and not {"loss", "units"} <= outputs.keys():  # a task author's slip, caught at its first use
            raise UserError(f"{type(task).__name__}.step() left out each example's 'loss' and 'units' from its outputs "
                            "on labelled data: evaluation sums them (eval_loss) and scores only labelled outputs; see "
                            "Step in src/tasks/base.py")  # fmt: skip
        outputs = accelerator.pad_across_processes({"index": index, **outputs}, dim=1, pad_index=PAD)
        for key, value in accelerator.gather_for_metrics(outputs).items():
            parts.setdefault(key, []).append(value.cpu())
    model.train()

    columns = {key: _concatenate(values) for key, values in parts.items()}
    order = torch.argsort(columns["index"])
    columns = {key: value[order] for key, value in columns.items()}
    # The data rows' numbers, each once (a task may have dropped rows: a causal LM's prompt that fills max_length).
    expected = torch.as_tensor(np.sort(dataloader.dataset.with_format("numpy")[INDEX_COLUMN][:]))
    if not torch.equal(columns["index"], expected):
        raise RuntimeError("evaluation did not see every example exactly once; please report this as a bug")

    metrics = {"eval_samples": len(order)}
    if "loss" in columns:  # labelled data: `loss` and `units` hold each example's summed loss and its units
        metrics["eval_loss"] = (columns["loss"].double().sum() / columns["units"].sum()).item()
        metrics.update({f"eval_{name}": value for name, value in task.metrics(columns).items()})
    return metrics, columns


def with_top_level_metrics(metrics: dict, task) -> dict:
    """`metrics` and, without their eval_ prefix, the task's `top_level_metrics` (a causal LM's perplexity), which the
    transformers examples write so: all_results.json, and run_clm.py's eval_results.json."""
    top_level = {name: metrics[f"eval_{name}"] for name in task.top_level_metrics if f"eval_{name}" in metrics}
    return {**metrics, **top_level}


def _concatenate(values: list[torch.Tensor]) -> torch.Tensor:
    """One tensor from the batches' tensors, padded to the longest along the second dimension when they differ."""
    longest = max(value.shape[1] for value in values) if values[0].dim() > 1 else None
    if longest is not None:
        values = [torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, longest - v.shape[1]), value=PAD)
                  for v in values]  # fmt: skip
    return torch.cat(values)


def evaluate_more(model, loaders: dict, accelerator, task) -> dict:
    """Metrics on further validation splits, each suffixed with the split's name: {'validation_mm': loader} gives
    eval_accuracy_mm (MNLI's mismatched set, evaluated once at the end as run_glue.py does)."""
    return {f"{key}_{name.removeprefix('validation_')}": value for name, loader in loaders.items()
            for key, value in evaluate(model, loader, accelerator, task)[0].items()}  # fmt: skip
