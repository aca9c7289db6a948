"""What the model learns: single-label or multi-label classification, or regression, found from the labels,
and what that means for the model's head, the loss (optionally class-weighted) and the predictions."""

from collections import Counter
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, LargeList, List, Value

from src.errors import UserError

SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
REGRESSION = "regression"


@dataclass(frozen=True)
class Task:
    problem_type: str
    label_names: tuple[str, ...] = ()  # class names in id order; empty for regression
    # Per label: the cross-entropy weight of the class (single-label) or BCE's pos_weight (multi-label).
    class_weights: tuple[float, ...] | None = None
    threshold: float = 0.5  # multi-label: a label is predicted when its probability is above this

    @property
    def is_regression(self) -> bool:
        return self.problem_type == REGRESSION

    @property
    def is_multi_label(self) -> bool:
        return self.problem_type == MULTI_LABEL

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.label_names)}

    def describe(self) -> str:
        if self.is_regression:
            return "regression"
        kind = "multi-label classification over" if self.is_multi_label else "classification into"
        weighted = ", class-weighted loss" if self.class_weights else ""
        return f"{kind} {self.num_labels} {'labels' if self.is_multi_label else 'classes'}{weighted}"

    def config_fields(self) -> dict:
        """What a model config needs to carry this task (and its label names, for from_pretrained users)."""
        fields = {"num_labels": self.num_labels, "problem_type": self.problem_type}
        if not self.is_regression:
            fields.update(id2label=dict(enumerate(self.label_names)), label2id=self.label2id)
        return fields

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The mean (or, with reduction='none', each example's) loss.

        With class weights each example's loss is scaled by its class's weight and the mean is over examples,
        so that a batch's mean is the mean of its examples' losses whatever the split over ranks and batches
        (PyTorch's weighted mean would divide by the batch's summed weights instead).
        """
        logits = logits.float()  # the loss in fp32 even when the forward pass ran under bf16 autocast
        if self.is_regression:
            return F.mse_loss(logits.squeeze(-1), labels.float(), reduction=reduction)
        weights = _on_device(self.class_weights, logits.device) if self.class_weights else None
        if self.is_multi_label:
            per_label = F.binary_cross_entropy_with_logits(logits, labels.float(), pos_weight=weights, reduction="none")
            per_example = per_label.mean(dim=-1)
        else:
            per_example = F.cross_entropy(logits, labels, weight=weights, reduction="none")
        return per_example if reduction == "none" else per_example.mean()

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Class ids, multi-hot rows of 0/1 (multi-label), or values (regression)."""
        if self.is_regression:
            return logits.float().squeeze(-1)
        if self.is_multi_label:
            return (logits.float().sigmoid() > self.threshold).long()
        return logits.argmax(dim=-1)

    def names_of(self, multi_hot: list) -> list[str]:
        """The label names set in a multi-hot row (of predictions or references)."""
        return [name for name, value in zip(self.label_names, multi_hot) if value >= 0.5]

    def weights_by_label(self) -> dict[str, float] | None:
        """The class weights by label name, as saved in args.json (None without weights)."""
        return dict(zip(self.label_names, self.class_weights)) if self.class_weights else None


@cache
def _on_device(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    # Made once per device: a fresh host-to-GPU copy at every step would make the host wait for the GPU.
    return torch.tensor(values, dtype=torch.float32, device=device)


def task_of_config(config, class_weights: dict | None = None, threshold: float = 0.5) -> Task:
    """The task a fine-tuned model was trained for, from its config (and the class weights its run saved)."""
    if config.problem_type == REGRESSION or config.num_labels == 1:
        return Task(REGRESSION)
    names = [config.id2label[i] for i in range(config.num_labels)]
    if names == [f"LABEL_{i}" for i in range(len(names))]:
        names = [str(i) for i in range(len(names))]  # no label names saved: the labels are the ids
    problem_type = MULTI_LABEL if config.problem_type == MULTI_LABEL else SINGLE_LABEL
    weights = tuple(class_weights[n] for n in names) if class_weights and set(class_weights) == set(names) else None
    return Task(problem_type, tuple(names), weights, threshold)


def label_namer(dataset: Dataset, label_column: str):
    """(a function from a row's raw label to its name, or to its list of names for multi-label; multi-label?)."""
    feature = dataset.features[label_column]
    multi_label = isinstance(feature, (List, LargeList))  # a list of labels per row
    if multi_label:
        feature = feature.feature
    names = feature.names if isinstance(feature, ClassLabel) else None

    def name(value):
        return names[value] if names else str(value)

    def of_row(value):
        if value is None:
            fix = "use [] for a row without labels" if multi_label else "fill or drop those rows"
            raise UserError(f"label column {label_column!r} has empty values; {fix}")
        return [name(v) for v in value] if multi_label else name(value)

    return of_row, multi_label


def detect_task(dataset: Dataset, label_column: str, class_weights: str | None = None, threshold: float = 0.5) -> Task:
    """Classification for integer, string or ClassLabel labels (names in sorted order), multi-label for lists of
    them, regression for floats. `class_weights='balanced'` weighs the loss by inverse label frequencies."""
    feature = dataset.features[label_column]
    if isinstance(feature, (List, LargeList)):
        task = Task(MULTI_LABEL, _multi_label_names(dataset, label_column), threshold=threshold)
    elif isinstance(feature, ClassLabel):
        task = Task(SINGLE_LABEL, tuple(feature.names))
    else:
        task = _single_value_task(dataset, label_column, feature)
    if not task.is_regression and len(task.label_names) < 2:
        only = f"one label only ({task.label_names[0]!r})"
        if task.is_multi_label:
            raise UserError(
                f"label column {label_column!r} names {only}: multi-label needs at least 2; for one yes/no label, "
                "give each row a single label instead (e.g. spam / not spam)"
            )
        raise UserError(
            f"the training rows' label column {label_column!r} holds {only}: classification needs at least 2 "
            "(check the file and --max_train_samples; float labels train a regression)"
        )
    if class_weights == "balanced":
        if task.is_regression:
            raise UserError("--class_weights balanced is for classification, and these labels are numbers (regression)")
        of_row, _ = label_namer(dataset, label_column)
        task = replace(task, class_weights=balanced_weights(task, [of_row(v) for v in dataset[label_column]]))
    return task


def _single_value_task(dataset: Dataset, label_column: str, feature) -> Task:
    if not isinstance(feature, Value):
        raise UserError(
            f"label column {label_column!r} holds {feature}; labels must be numbers or strings, or lists of them "
            "for multi-label"
        )
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


def _multi_label_names(dataset: Dataset, label_column: str) -> tuple[str, ...]:
    """The ClassLabel's names, else the sorted union of the rows' labels (numerically, for integers)."""
    item = dataset.features[label_column].feature
    if isinstance(item, ClassLabel):
        return tuple(item.names)
    integers = isinstance(item, Value) and item.dtype.startswith(("int", "uint"))
    if not (integers or isinstance(item, Value) and item.dtype in ("string", "large_string", "null")):
        raise UserError(f"label column {label_column!r} holds {item} lists; multi-label rows must list names or ids")
    of_row, _ = label_namer(dataset, label_column)
    names = {name for row in dataset[label_column] for name in of_row(row)}
    if not names:
        raise UserError(f"label column {label_column!r} holds only empty lists: there is no label to learn")
    return tuple(sorted(names, key=int) if integers else sorted(names))


def balanced_weights(task: Task, rows: list) -> tuple[float, ...]:
    """scikit-learn's 'balanced' class weights, n_rows / (n_classes * count), for single-label rows; for
    multi-label rows each label's negatives / positives, the BCE pos_weight that balances that label."""
    counts = Counter(name for row in rows for name in (set(row) if task.is_multi_label else [row]))
    absent = [name for name in task.label_names if not counts[name]]
    if absent:
        raise UserError(
            f"--class_weights balanced: label(s) {', '.join(absent[:10])} have no training examples, so their "
            "weight is undefined; add examples or drop --class_weights"
        )
    if task.is_multi_label:
        # A label on every row has no negatives: it keeps weight 1 rather than a pos_weight of 0 that unlearns it.
        return tuple((len(rows) - counts[n]) / counts[n] if counts[n] < len(rows) else 1.0 for n in task.label_names)
    return tuple(len(rows) / (task.num_labels * counts[name]) for name in task.label_names)
