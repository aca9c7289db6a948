"""Distributed evaluation: every example counted exactly once, results returned in row order."""

import torch

from src.data import INDEX_COLUMN
from src.metrics import compute_metrics
from src.task import Task


def evaluate(model, dataloader, accelerator, task: Task) -> tuple[dict, dict]:
    """(metrics prefixed 'eval_', per-example columns) over the whole dataset, on any number of processes.

    The distributed sampler pads the last batches with repeated examples so that every rank gets the same
    number; `gather_for_metrics` drops those repeats, and the row index puts the length-sorted batches
    back in dataset order.
    """
    model.eval()
    gathered = {"index": [], "prediction": [], "label": [], "loss": []}
    for batch in dataloader:
        index = batch.pop(INDEX_COLUMN)
        labels = batch.pop("labels", None)
        with torch.no_grad():
            logits = model(**batch).logits
        values = {"index": index, "prediction": task.predictions(logits)}
        if labels is not None:
            values["label"] = labels
            # Per-example losses: the batch mean would weigh the padding repeats in.
            values["loss"] = task.loss(logits, labels, reduction="none")
        for key, value in accelerator.gather_for_metrics(values).items():
            gathered[key].append(value.cpu())
    model.train()

    columns = {key: torch.cat(parts) for key, parts in gathered.items() if parts}
    order = torch.argsort(columns["index"])
    columns = {key: value[order] for key, value in columns.items()}
    if not torch.equal(columns["index"], torch.arange(len(dataloader.dataset))):
        raise RuntimeError("evaluation did not see every example exactly once; please report this as a bug")

    metrics = {"eval_samples": len(order)}
    if "label" in columns:
        metrics["eval_loss"] = columns["loss"].mean().item()
        scores = compute_metrics(columns["prediction"].tolist(), columns["label"].tolist(), task)
        metrics.update({f"eval_{name}": value for name, value in scores.items()})
    return metrics, {key: columns[key].tolist() for key in ("index", "label", "prediction") if key in columns}


def evaluate_more(model, loaders: dict, accelerator, task: Task) -> dict:
    """Metrics on further validation splits, each suffixed with the split's name: {'validation_mm': loader} gives
    eval_accuracy_mm (MNLI's mismatched set, evaluated once at the end as run_glue.py does)."""
    results = {}
    for name, loader in loaders.items():
        suffix = name.removeprefix("validation_")
        results.update(
            {f"{key}_{suffix}": value for key, value in evaluate(model, loader, accelerator, task)[0].items()}
        )
    return results
