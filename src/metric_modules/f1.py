"""F1 score: of the positive class for two classes, macro-averaged for more.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from sklearn.metrics import f1_score

import evaluate


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="F1 score: of the positive class for two classes, macro-averaged for more.",
            citation="",
            inputs_description="predictions and references: one int64 per example",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="binary"):
        return {"f1": float(f1_score(references, predictions, average=average))}
