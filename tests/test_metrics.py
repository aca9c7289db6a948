"""Metrics come from the shipped `evaluate` modules and agree with scikit-learn and SciPy."""

import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import load_script
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from src.metrics import load_metric
from src.plan import best_metric
from src.tasks.sequence_classification import REGRESSION, SINGLE_LABEL, SequenceClassification

BINARY = SequenceClassification(SINGLE_LABEL, ("a", "b"))
THREE_CLASSES = SequenceClassification(SINGLE_LABEL, ("a", "b", "c"))
SCORES = SequenceClassification(REGRESSION)


def compute_metrics(predictions, references, task):
    return task.metrics({"prediction": torch.tensor(predictions), "label": torch.tensor(references)})


def greater_is_better(metric, task):
    return best_metric(SimpleNamespace(metric_for_best_model=metric, greater_is_better=None), task)[1]


def test_classification_metrics():
    predictions, references = [0, 1, 1, 1, 1, 2], [0, 1, 0, 0, 1, 2]
    binary = compute_metrics(predictions[:5], references[:5], BINARY)
    assert binary["accuracy"] == pytest.approx(0.6)
    # Two classes: F1 of the positive one (2/3), as run_glue reports it; the classes' mean would be 7/12.
    assert binary["f1"] == pytest.approx(f1_score(references[:5], predictions[:5])) == pytest.approx(2 / 3)
    assert binary["matthews_correlation"] == pytest.approx(matthews_corrcoef(references[:5], predictions[:5]))
    multi = compute_metrics(predictions, references, THREE_CLASSES)
    assert multi["f1"] == pytest.approx(f1_score(references, predictions, average="macro"))


def test_a_notebooks_import_evaluate_keeps_its_main_after_the_metric_modules_load(monkeypatch):
    """`import evaluate` in a notebook at the repo root is the project's script; the metric modules need the library
    of that name while they load, and the script is put back after, so that a second evaluate.main() works."""
    script = load_script("evaluate")
    monkeypatch.setitem(sys.modules, "evaluate", script)
    load_metric.cache_clear()  # loaded anew, as by a notebook's first run
    assert compute_metrics([0, 1, 1], [0, 1, 0], BINARY)["accuracy"] == pytest.approx(2 / 3)
    assert sys.modules["evaluate"] is script and hasattr(script, "main")


def test_regression_metrics():
    predictions, references = [0.1, 0.9, 2.2, 3.1], [0.0, 1.0, 2.0, 3.0]
    scores = compute_metrics(predictions, references, SCORES)
    assert scores["pearson"] == pytest.approx(pearsonr(references, predictions)[0])
    assert scores["spearmanr"] == pytest.approx(spearmanr(references, predictions)[0])
    assert scores["mse"] == pytest.approx(sum((p - r) ** 2 for p, r in zip(predictions, references)) / 4, rel=1e-5)
    assert compute_metrics([1.0, 1.0], [0.0, 2.0], SCORES)["pearson"] == 0.0


def test_best_model_defaults():
    assert BINARY.main_metric == "accuracy" and SCORES.main_metric == "mse"
    assert greater_is_better("accuracy", BINARY)
    assert not greater_is_better("mse", SCORES) and not greater_is_better("loss", BINARY)
