"""Fraction of predictions equal to the references.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from sklearn.metrics import accuracy_score

import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions and references: one int64 per example",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(accuracy_score(references, predictions))}
