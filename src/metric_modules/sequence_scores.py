"""Scores of sequence classification: `classification` (accuracy, F1, Matthews correlation), `regression` (Pearson
and Spearman correlations, MSE) and `multi_label` (exact match, micro/macro F1, F1 per label), the configurations.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, mean_squared_error

import evaluate

VALUES = {
    "single_label_classification": datasets.Value("int64"),
    "regression": datasets.Value("float32"),
    "multi_label_classification": datasets.Sequence(datasets.Value("int64")),  # a multi-hot row of 0/1 per example
}


class SequenceScores(evaluate.Metric):
    def _info(self):
        value = VALUES[self.config_name]
        return evaluate.MetricInfo(
            description=__doc__.splitlines()[0],
            citation="",
            inputs_description=f"predictions and references: one {value} per example",
            features=datasets.Features({"predictions": value, "references": value}),
        )

    def _compute(self, predictions, references, average="binary"):
        y, p = references, predictions
        if self.config_name == "regression":
            return {"pearson": float(pearsonr(y, p)[0]), "spearmanr": float(spearmanr(y, p)[0]),
                    "mse": float(mean_squared_error(y, p))}  # fmt: skip
        if self.config_name == "single_label_classification":
            # average: of the positive class for two classes ("binary"), "macro" over more.
            return {"accuracy": float(accuracy_score(y, p)), "f1": float(f1_score(y, p, average=average)),
                    "matthews_correlation": float(matthews_corrcoef(y, p))}  # fmt: skip
        # zero_division=0: a label never predicted nor present scores 0, without a warning per evaluation.
        return {
            "exact_match": float(accuracy_score(y, p)),
            "f1_micro": float(f1_score(y, p, average="micro", zero_division=0)),
            "f1_macro": float(f1_score(y, p, average="macro", zero_division=0)),
            "f1_per_label": [float(v) for v in f1_score(y, p, average=None, zero_division=0)],
        }
