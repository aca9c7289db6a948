"""Multi-label scores: exact match (subset accuracy), micro- and macro-averaged F1, and F1 per label.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from sklearn.metrics import accuracy_score, f1_score

import evaluate


class MultiLabel(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Exact match, micro and macro F1, and F1 per label for multi-label classification.",
            citation="",
            inputs_description="predictions and references: one multi-hot list of 0/1 per example",
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
        )

    def _compute(self, predictions, references):
        # zero_division=0: a label never predicted nor present scores 0, without a warning per evaluation.
        return {
            "exact_match": float(accuracy_score(references, predictions)),
            "f1_micro": float(f1_score(references, predictions, average="micro", zero_division=0)),
            "f1_macro": float(f1_score(references, predictions, average="macro", zero_division=0)),
            "f1_per_label": [float(v) for v in f1_score(references, predictions, average=None, zero_division=0)],
        }
