"""What the model learns: single-label classification or regression, found from the labels, and what that
means for the model's head, the loss and the predictions."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, Value

from src.errors import UserError

SINGLE_LABEL = "single_label_classification"
REGRESSION = "regression"


@dataclass(frozen=True)
class Task:
    problem_type: str
    label_names: tuple[str, ...] = ()  # class names in id order; empty for regression

    @property
    def is_regression(self) -> bool:
        return self.problem_type == REGRESSION

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.label_names)}

    def describe(self) -> str:
        return "regression" if self.is_regression else f"classification into {self.num_labels} classes"

    def config_fields(self) -> dict:
        """What a model config needs to carry this task (and its label names, for from_pretrained users)."""
        fields = {"num_labels": self.num_labels, "problem_type": self.problem_type}
        if not self.is_regression:
            fields.update(id2label=dict(enumerate(self.label_names)), label2id=self.label2id)
        return fields

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = logits.float()  # the loss in fp32 even when the forward pass ran under bf16 autocast
        if self.is_regression:
            return F.mse_loss(logits.squeeze(-1), labels.float(), reduction=reduction)
        return F.cross_entropy(logits, labels, reduction=reduction)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().squeeze(-1) if self.is_regression else logits.argmax(dim=-1)


def task_of_config(config) -> Task:
    """The task a fine-tuned model was trained for, from its config."""
    if config.problem_type == REGRESSION or config.num_labels == 1:
        return Task(REGRESSION)
    names = [config.id2label[i] for i in range(config.num_labels)]
    if names == [f"LABEL_{i}" for i in range(len(names))]:
        names = [str(i) for i in range(len(names))]  # no label names saved: the labels are the ids
    return Task(SINGLE_LABEL, tuple(names))


def detect_task(dataset: Dataset, label_column: str) -> Task:
    """Classification for integer, string or ClassLabel labels (names in sorted order), regression for floats."""
    feature = dataset.features[label_column]
    if isinstance(feature, ClassLabel):
        return Task(SINGLE_LABEL, tuple(feature.names))
    if not isinstance(feature, Value):
        raise UserError(f"label column {label_column!r} holds {feature}; labels must be numbers or strings")
    values = dataset.unique(label_column)
    if None in values:
        raise UserError(f"label column {label_column!r} has empty values; fill or drop those rows")
    if feature.dtype.startswith("float"):
        return Task(REGRESSION)
    if feature.dtype.startswith(("int", "uint")):
        return Task(SINGLE_LABEL, tuple(str(v) for v in sorted(values)))
    if feature.dtype in ("string", "large_string"):
        return Task(SINGLE_LABEL, tuple(sorted(values)))
    raise UserError(f"label column {label_column!r} has type {feature.dtype}; use integers, strings or floats")
