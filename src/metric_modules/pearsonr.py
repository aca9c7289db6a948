"""Pearson correlation between predicted and true values.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from scipy.stats import pearsonr

import evaluate


class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Pearson correlation between predicted and true values.",
            citation="",
            inputs_description="predictions and references: one float32 per example",
            features=datasets.Features(
                {"predictions": datasets.Value("float32"), "references": datasets.Value("float32")}
            ),
        )

    def _compute(self, predictions, references):
        return {"pearson": float(pearsonr(references, predictions)[0])}
