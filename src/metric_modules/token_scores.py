"""Scores of token classification, over the tags of each example's words: `iob` (entity-level precision, recall and
F1 with seqeval, the field's reference implementation, per entity type too, and tag accuracy) and `tags` (POS-style
tags, which seqeval would misread as chunk prefixes: accuracy and macro F1 over the tags), the configurations.

An `evaluate` metric module shipped with the project, so that `evaluate.load` needs no network.
"""

import datasets
from seqeval.metrics import accuracy_score, classification_report
from sklearn.metrics import f1_score

import evaluate


class TokenScores(evaluate.Metric):
    def _info(self):
        tags = datasets.Sequence(datasets.Value("string"))
        return evaluate.MetricInfo(
            description=__doc__.splitlines()[0],
            citation="",
            inputs_description="predictions and references: the tags of one example's words",
            features=datasets.Features({"predictions": tags, "references": tags}),
        )

    def _compute(self, predictions, references):
        if self.config_name == "tags":
            flat_true = [tag for row in references for tag in row]
            flat_predicted = [tag for row in predictions for tag in row]
            return {
                "accuracy": float(sum(t == p for t, p in zip(flat_true, flat_predicted)) / max(1, len(flat_true))),
                "f1": float(f1_score(flat_true, flat_predicted, average="macro", zero_division=0)),
            }
        report = classification_report(references, predictions, output_dict=True, zero_division=0)
        overall = report.pop("micro avg")
        by_entity = {
            entity: {"precision": v["precision"], "recall": v["recall"], "f1": v["f1-score"], "number": v["support"]}
            for entity, v in report.items()
            if entity not in ("macro avg", "weighted avg")
        }
        return {
            "precision": float(overall["precision"]),
            "recall": float(overall["recall"]),
            "f1": float(overall["f1-score"]),
            "accuracy": float(accuracy_score(references, predictions)),
            # The entity counts stay whole numbers, as run_ner_no_trainer.py reports them.
            "by_entity": {
                k: {m: int(v) if m == "number" else float(v) for m, v in values.items()}
                for k, values in by_entity.items()
            },  # fmt: skip
        }
