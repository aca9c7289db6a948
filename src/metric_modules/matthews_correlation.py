"""Matthews correlation coefficient between predicted and true classes.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from sklearn.metrics import matthews_corrcoef

import evaluate


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Matthews correlation coefficient between predicted and true classes.",
            citation="",
            inputs_description="predictions and references: one int64 per example",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
