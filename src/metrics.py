"""Metrics through the `evaluate` library, from the modules in src/metric_modules.

`evaluate.load("accuracy")` fetches its module from the Hub; loading the shipped files works offline.
"""

import importlib
import math
import sys
import warnings
from functools import cache
from pathlib import Path

from src.errors import UserError
from src.task import Task

MODULES = Path(__file__).parent / "metric_modules"
CLASSIFICATION_METRICS = ("accuracy", "f1", "matthews_correlation")
REGRESSION_METRICS = ("pearsonr", "spearmanr", "mse")
LOWER_IS_BETTER = ("mse", "loss")


def main_metric(task: Task) -> str:
    if task.is_multi_label:
        return "f1_micro"  # exact match is harsh with many labels, and macro F1 noisy with rare ones
    return "mse" if task.is_regression else "accuracy"


def check_best_metric(name: str | None, task: Task) -> str:
    """--metric_for_best_model, defaulted and checked against what evaluation reports for this task."""
    if name is None:
        return main_metric(task)
    if task.is_regression:
        known = ["pearson", "spearmanr", "mse", "loss"]
    elif task.is_multi_label:
        known = ["f1_micro", "f1_macro", "exact_match", "loss"] + [f"f1/{label}" for label in task.label_names]
    else:
        known = ["accuracy", "f1", "matthews_correlation", "loss"]
    name = name.removeprefix("eval_")
    if name not in known:
        choices = ", ".join(known[:4]) + (" or f1/<label>" if task.is_multi_label else "")
        raise UserError(f"--metric_for_best_model {name!r} is not reported for {task.describe()}; use one of {choices}")
    return name


def greater_is_better(metric: str) -> bool:
    return metric not in LOWER_IS_BETTER


def _evaluate_library():
    """The `evaluate` package itself: run from the repo root, the project's evaluate.py would shadow it."""
    repo = Path(__file__).resolve().parents[1]
    if hasattr(sys.modules.get("evaluate"), "load"):
        return sys.modules["evaluate"]
    sys.modules.pop("evaluate", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != repo]
    try:
        return importlib.import_module("evaluate")
    finally:
        sys.path[:] = saved


@cache
def load_metric(name: str):
    # keep_in_memory: every rank computes the same metric; files in a shared cache would collide.
    return _evaluate_library().load(str(MODULES / f"{name}.py"), keep_in_memory=True)


def compute_metrics(predictions: list, references: list, task: Task) -> dict:
    """Unprefixed metric values, e.g. {'accuracy': 0.9, 'f1': 0.88, 'matthews_correlation': 0.8}; for multi-label,
    {'exact_match', 'f1_micro', 'f1_macro', 'f1/<label>' for each label}."""
    results = {}
    if task.is_multi_label:
        references = [[int(v) for v in row] for row in references]  # the multi-hot float targets
        scores = load_metric("multi_label").compute(predictions=predictions, references=references)
        per_label = scores.pop("f1_per_label")
        return {**scores, **{f"f1/{label}": value for label, value in zip(task.label_names, per_label)}}
    if task.is_regression:
        with warnings.catch_warnings():  # SciPy warns about constant input; the NaN is replaced below
            warnings.simplefilter("ignore")
            for name in REGRESSION_METRICS:
                results.update(load_metric(name).compute(predictions=predictions, references=references))
        # A constant prediction has no correlation: report 0 rather than NaN so "best model" stays comparable.
        return {k: 0.0 if math.isnan(v) else v for k, v in results.items()}
    for name in CLASSIFICATION_METRICS:
        options = {"average": "binary" if task.num_labels == 2 else "macro"} if name == "f1" else {}
        results.update(load_metric(name).compute(predictions=predictions, references=references, **options))
    return results
