"""Sequence classification: single-label or multi-label classification, or regression, found from the labels; one
score or class per text (or text pair). GLUE's tasks are this task with GLUE's columns and labels (src/glue.py)."""

import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache

import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from datasets import ClassLabel, Dataset, Json, LargeList, List, Value

from src.data import detect_columns
from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN
from src.tasks.base import Step, Task, label_finder

logger = get_logger(__name__)

SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
REGRESSION = "regression"


@dataclass(frozen=True)
class SequenceClassification(Task):
    problem_type: str = SINGLE_LABEL
    label_names: tuple[str, ...] = ()  # class names in id order; empty for regression
    # Per label: the cross-entropy weight of the class (single-label) or BCE's pos_weight (multi-label).
    class_weights: tuple[float, ...] | None = None
    threshold: float = 0.5  # multi-label: a label is predicted when its probability is above this
    columns: tuple[str | None, str | None, str | None] = (None, None, None)  # text, text pair, label

    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    lower_is_better = ("loss", "mse")
    name = "sequence-classification"
    pictures = ("confusion_matrix.png", "predictions_vs_labels.png")

    @staticmethod
    def add_arguments(parser):
        group = parser.add_argument_group("sequence classification")
        group.add_argument(
            "--class_weights",
            choices=["none", "balanced"],
            default="none",
            help="balanced: weigh each class's loss by n_rows / (n_classes * its count) in the training data; for "
            "multi-label, each label's positives by its negatives / positives (BCE pos_weight). Saved in args.json "
            "(class_weight_values) and applied to the evaluation loss too.",
        )

    @staticmethod
    def recognises(train: Dataset, label_column: str | None = None) -> str | None:
        return "no other task's columns: a text and a label per row"  # what no other task claims

    @classmethod
    def from_data(cls, args, train: Dataset) -> "SequenceClassification":
        """Classification for integer, string or ClassLabel labels (names sorted, or in the order of a checkpoint's
        head trained on them), multi-label for lists of them, regression for floats. `--class_weights balanced`
        weighs the loss by inverse label frequencies."""
        from src.model import in_checkpoint_order

        columns = detect_columns(train.column_names, args.text_column, args.text_pair_column, args.label_column)
        label_column = columns[2]
        if isinstance(train.features[columns[0]], (List, LargeList)):
            raise UserError(
                f"text column {columns[0]!r} holds lists of words: that is token classification (--task auto or "
                f"token-classification), not {cls.name}; the columns are {', '.join(train.column_names)}"
            )
        feature = train.features[label_column]
        if isinstance(feature, (List, LargeList)):
            task = cls(MULTI_LABEL, _multi_label_names(train, label_column), threshold=args.multi_label_threshold)
        elif isinstance(feature, ClassLabel):
            task = cls(SINGLE_LABEL, tuple(feature.names))
        else:
            task = _single_value_task(cls, train, label_column, feature)
        task = replace(task, columns=columns, label_names=in_checkpoint_order(args, task.label_names))
        if not task.is_regression and len(task.label_names) < 2:
            only = f"one label only ({task.label_names[0]!r})"
            if task.is_multi_label:
                raise UserError(
                    f"label column {label_column!r} names {only}: multi-label needs at least 2; for one yes/no "
                    "label, give each row a single label instead (e.g. spam / not spam)"
                )
            raise UserError(
                f"the training rows' label column {label_column!r} holds {only}: classification needs at least 2 "
                "(check the file; float labels train a regression)"
            )
        if args.class_weights == "balanced":
            if task.is_regression:
                raise UserError(
                    "--class_weights balanced is for classification, and these labels are numbers (regression)"
                )
            of_row, _ = label_namer(train, label_column)
            # Over the rows that train (--max_train_samples), though the labels are those of the whole split.
            trained = train.take(args.max_train_samples) if args.max_train_samples else train
            task = replace(task, class_weights=balanced_weights(task, [of_row(v) for v in trained[label_column]]))
        return task

    @classmethod
    def from_record(cls, record: dict, args, model_dir, column_names: list[str]) -> "SequenceClassification":
        """The labels from the model's config (a train.py folder or any fine-tuned classifier), with the run's class
        weights and threshold from `record`, its args.json; the columns given, else those the model was trained on
        where the evaluated data has them, else found."""
        remembered = {k: v for k, v in record.items() if k.endswith("_column") and v in column_names}
        columns = detect_columns(
            column_names,
            args.text_column or remembered.get("text_column"),
            args.text_pair_column or remembered.get("text_pair_column"),
            args.label_column or remembered.get("label_column"),
            need_label=False,
        )
        problem_type, names = cls.trained_labels(model_dir, args)
        saved = record.get("class_weight_values")
        weights = tuple(saved[n] for n in names) if saved and set(saved) == set(names) else None
        threshold = args.multi_label_threshold or record.get("multi_label_threshold") or 0.5
        return cls(problem_type=problem_type, label_names=tuple(names), class_weights=weights, threshold=threshold,
                   columns=columns)  # fmt: skip

    @staticmethod
    def trained_labels(model_dir, args) -> tuple[str, list[str]]:
        """(problem type, label names) of a trained model, from its config."""
        from src.model import load_trained_config

        config = load_trained_config(model_dir, args.trust_remote_code)
        if config.problem_type == REGRESSION or config.num_labels == 1:
            return REGRESSION, []
        names = [config.id2label[i] for i in range(config.num_labels)]
        if names == [f"LABEL_{i}" for i in range(len(names))]:
            names = [str(i) for i in range(len(names))]  # no label names saved: the labels are the ids
        return (MULTI_LABEL if config.problem_type == MULTI_LABEL else SINGLE_LABEL), names

    def record(self) -> dict:
        # The keys args.json has always had: evaluate.py reads them from folders of earlier versions too.
        text_column, text_pair_column, label_column = self.columns
        return {
            "text_column": text_column,
            "text_pair_column": text_pair_column,
            "label_column": label_column,
            "class_weight_values": dict(zip(self.label_names, self.class_weights)) if self.class_weights else None,
            "multi_label_threshold": self.threshold,
        }

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

    @property
    def main_metric(self) -> str:
        if self.is_multi_label:
            return "f1_micro"  # exact match is harsh with many labels, and macro F1 noisy with rare ones
        return "mse" if self.is_regression else "accuracy"

    def describe(self) -> str:
        if self.is_regression:
            return "regression"
        kind = "multi-label classification over" if self.is_multi_label else "classification into"
        weighted = ", class-weighted loss" if self.class_weights else ""
        return f"{kind} {self.num_labels} {'labels' if self.is_multi_label else 'classes'}{weighted}"

    # --- the model ---
    def config_fields(self) -> dict:
        """What a model config needs to carry this task (and its label names, for from_pretrained users)."""
        fields = {"num_labels": self.num_labels, "problem_type": self.problem_type}
        if not self.is_regression:
            fields.update(id2label=dict(enumerate(self.label_names)), label2id=self.label2id)
        return fields

    # --- the data ---
    def features(self, dataset: Dataset, tokenizer, max_length: int, num_proc: int | None = None) -> Dataset:
        """Token ids, `labels` (in the form this task trains on) and the row's position.

        Raises UserError for a label the task does not know, e.g. evaluating on a class the model never saw.
        """
        text_column, text_pair_column, label_column = self.columns
        if label_column and label_column not in dataset.column_names:
            label_column = None
        feature = dataset.features.get(label_column) if label_column else None
        if isinstance(feature, ClassLabel) and -1 in dataset.unique(label_column):
            if set(dataset.unique(label_column)) != {-1}:
                raise UserError(f"label column {label_column!r} marks some rows as unlabelled (-1); drop those rows")
            label_column = None  # an unlabelled split, e.g. GLUE's test sets
        name_of, multi_label = label_namer(dataset, label_column) if label_column else (None, self.is_multi_label)
        if multi_label != self.is_multi_label:
            rows = "lists of labels" if multi_label else "one label per row"
            raise UserError(f"label column {label_column!r} holds {rows}, but the model does {self.describe()}")
        id_of = label_finder(self.label_names)
        for column in filter(None, (text_column, text_pair_column)):
            if blank := _blank_texts(dataset, column):  # a CSV's empty cells
                logger.warning(f"{blank} of {len(dataset)} rows have no text in column {column!r} (empty or missing): "
                               "it is read as an empty text; drop or fill those rows")  # fmt: skip

        def encode(rows, indices):
            texts = [str(t) if t is not None else "" for t in rows[text_column]]
            pairs = [str(t) if t is not None else "" for t in rows[text_pair_column]] if text_pair_column else None
            encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
            encoded[INDEX_COLUMN] = indices
            encoded[LENGTH_COLUMN] = [len(ids) for ids in encoded["input_ids"]]
            if label_column is None:
                return encoded
            raw = rows[label_column]
            if self.is_regression:
                encoded["labels"] = [_score(v, label_column) for v in raw]
                return encoded
            names = [name_of(v) for v in raw]
            unknown = sorted({n for row in names for n in (row if multi_label else [row]) if id_of(n) is None})
            if unknown:
                raise UserError(
                    f"label(s) {', '.join(unknown[:10])} in column {label_column!r} are not among the model's "
                    f"labels ({', '.join(self.label_names[:30])}{', ...' if self.num_labels > 30 else ''}), those of "
                    "its training data: drop those rows, or train on data that has them"
                )
            if multi_label:  # multi-hot floats, the targets of BCE-with-logits
                chosen_ids = [{id_of(n) for n in row} for row in names]
                encoded["labels"] = [[float(i in chosen) for i in range(self.num_labels)] for chosen in chosen_ids]
            else:
                encoded["labels"] = [id_of(n) for n in names]
            return encoded

        encoded = dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names,
                              num_proc=num_proc, desc="Tokenizing")  # fmt: skip
        # datasets types an output column as the input column of the same name: strings in a column called `labels`
        # (the class names, or another column beside --label_column) would leave the class ids written as strings.
        typed = Value("float64") if self.is_regression else List(Value("float64")) if multi_label else Value("int64")
        if encoded.features.get("labels") not in (None, typed):
            encoded = encoded.cast_column("labels", typed)
        reaching = pc.sum(pc.equal(encoded.with_format("arrow")[LENGTH_COLUMN], max_length)).as_py()  # most cut short
        if reaching:
            logger.info(f"{reaching} of {len(encoded)} examples reach --max_length {max_length} tokens: longer texts "
                        "are cut there")  # fmt: skip
        return encoded

    # --- one batch ---
    def step(self, model, batch: dict) -> Step:
        """Each example's loss (with class weights, scaled by its class's weight, so that the mean over any split
        into ranks and batches is the mean over examples; PyTorch's weighted mean would divide by the batch's
        summed weights instead), summed; the predictions and losses per example for evaluation."""
        labels = batch.pop("labels", None)
        logits = model(**batch)["logits"].float()  # the loss in fp32 even when the forward ran under autocast
        outputs = {"prediction": self.predictions(logits)}
        if labels is None:  # data without labels: predictions only
            return Step(logits.new_zeros(()), logits.new_zeros(()), outputs)
        losses = self.losses(logits, labels)
        units = torch.ones_like(losses)
        return Step(losses.sum(), units.sum(), outputs | {"label": labels, "loss": losses, "units": units})

    def losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each example's loss."""
        if self.is_regression:
            return F.mse_loss(logits.squeeze(-1), labels.float(), reduction="none")
        weights = _on_device(self.class_weights, logits.device) if self.class_weights else None
        if self.is_multi_label:
            per_label = F.binary_cross_entropy_with_logits(logits, labels.float(), pos_weight=weights, reduction="none")
            return per_label.mean(dim=-1)
        return F.cross_entropy(logits, labels, weight=weights, reduction="none")

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Class ids, multi-hot rows of 0/1 (multi-label), or values (regression)."""
        if self.is_regression:
            return logits.squeeze(-1)
        if self.is_multi_label:
            return (logits.sigmoid() > self.threshold).long()
        return logits.argmax(dim=-1)

    # --- evaluation ---
    def metric_names(self) -> list[str]:
        if self.is_regression:
            return ["pearson", "spearmanr", "mse", "loss"]
        if self.is_multi_label:
            return ["f1_micro", "f1_macro", "exact_match", "loss"] + [f"f1/{label}" for label in self.label_names]
        return ["accuracy", "f1", "matthews_correlation", "loss"]

    def metrics(self, columns: dict) -> dict:
        """{'accuracy', 'f1', 'matthews_correlation'}; for regression {'pearson', 'spearmanr', 'mse'}; for
        multi-label {'exact_match', 'f1_micro', 'f1_macro', 'f1/<label>' for each label}."""
        from src.metrics import load_metric

        predictions, references = columns["prediction"].tolist(), columns["label"].tolist()
        options = {}
        if self.is_multi_label:
            references = [[int(v) for v in row] for row in references]  # the multi-hot float targets
        elif not self.is_regression:
            options["average"] = "binary" if self.num_labels == 2 else "macro"
        with warnings.catch_warnings():  # SciPy warns about constant input; the NaN is replaced below
            warnings.simplefilter("ignore")
            metric = load_metric("sequence_scores", self.problem_type)
            scores = metric.compute(predictions=predictions, references=references, **options)
        per_label = {f"f1/{label}": v for label, v in zip(self.label_names, scores.pop("f1_per_label", []))}
        # A constant prediction has no correlation: report 0 rather than NaN so "best model" stays comparable.
        return {k: 0.0 if math.isnan(v) else v for k, v in scores.items()} | per_label

    def show(self, value) -> str:
        if self.is_regression:
            return f"{value:.4f}"
        if self.is_multi_label:  # a JSON list of names: unambiguous whatever the names hold, [] for none
            return json.dumps([n for n, v in zip(self.label_names, value) if v >= 0.5], ensure_ascii=False)
        return self.label_names[value]

    def prediction_rows(self, columns: dict, data) -> dict[str, list]:
        shown = {"label": columns["label"]} if "label" in columns else {}
        return {key: [self.show(v) for v in values.tolist()] for key, values in (shown | {
            "prediction": columns["prediction"]}).items()}  # fmt: skip

    def write_pictures(self, columns: dict, output_dir) -> list[str]:
        """A confusion matrix, or predicted-vs-true for regression; multi-label has per-label F1 in its results."""
        for name in self.pictures:  # an earlier evaluation's, into this folder, would stand beside predictions that
            (output_dir / name).unlink(missing_ok=True)  # it does not show
        if "label" not in columns or self.is_multi_label:
            return []
        from src.plots import plot_confusion_matrix, plot_regression

        labels, predictions = columns["label"].tolist(), columns["prediction"].tolist()
        if self.is_regression:
            plot_regression(labels, predictions, output_dir / "predictions_vs_labels.png")
            return ["predictions_vs_labels.png"]
        plot_confusion_matrix(labels, predictions, list(self.label_names), output_dir / "confusion_matrix.png")
        return ["confusion_matrix.png"]

    # --- the model card ---
    def model_card(self, where: str, base_name: str, adapter: bool) -> dict:
        kind = {
            REGRESSION: "regression (one score per text)",
            MULTI_LABEL: f"multi-label classification ({self.num_labels} labels, any number per text)",
        }.get(self.problem_type, f"classification into {self.num_labels} classes")
        if adapter:
            usage = self.adapter_usage(where, base_name)
        else:
            top_k = ", top_k=None" if self.is_multi_label else ""
            pair = self.columns[1] is not None  # trained on text pairs: the pipeline takes both, in one dict
            text = '{"text": "First text", "text_pair": "Second text"}' if pair else '"Your text here"'
            usage = [
                "from transformers import pipeline",
                "",
                f'classifier = pipeline("text-classification", model="{where}"{top_k})',
                f"print(classifier({text}))",
            ]
            if self.is_regression:
                usage.append("# {'label': 'LABEL_0', 'score': the predicted value}")
            if self.is_multi_label:
                usage.append(
                    f"# every label with its sigmoid score; the run predicts the labels scoring above {self.threshold}"
                )
        labels = [] if self.is_regression else list(self.label_names)
        return {"kind": kind, "pipeline_tag": "text-classification", "labels": labels, "usage": usage}


@cache
def _on_device(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    # Made once per device: a fresh host-to-GPU copy at every step would make the host wait for the GPU.
    return torch.tensor(values, dtype=torch.float32, device=device)


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


def _score(value, label_column: str) -> float:
    """A regression target: a finite number (a NaN would train to the end and fail in the metrics)."""
    if value is None:
        raise UserError(f"label column {label_column!r} has empty values; fill or drop those rows")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise UserError(f"label column {label_column!r} holds {value!r}, and the model does regression: give numbers "
                        "(or train a classifier on these labels)") from None  # fmt: skip
    if not math.isfinite(score):
        raise UserError(f"label column {label_column!r} holds {value}: regression needs finite numbers; fix or drop "
                        "those rows")  # fmt: skip
    return score


def _single_value_task(cls, dataset: Dataset, label_column: str, feature) -> SequenceClassification:
    if isinstance(feature, Json):  # how datasets reads a JSON column of mixed types, such as 1 and "pos"
        kinds = sorted({type(value).__name__ for value in dataset[label_column]})
        raise UserError(f"label column {label_column!r} mixes value types ({', '.join(kinds)}): write every label "
                        "the same way, all numbers or all strings")  # fmt: skip
    if not isinstance(feature, Value):
        raise UserError(
            f"label column {label_column!r} holds {feature}; labels must be numbers or strings, or lists of them "
            "for multi-label"
        )
    values = dataset.unique(label_column)
    if None in values:
        raise UserError(f"label column {label_column!r} has empty values; fill or drop those rows")
    if feature.dtype.startswith("float"):
        if len(values) <= 20 and all(float(value).is_integer() for value in values):  # one "1.0" in a CSV of 0 and 1
            shown = ", ".join(map(str, sorted(values)[:5]))
            logger.warning(f"label column {label_column!r} holds whole numbers written as floats ({shown}): trained as "
                           "regression; if they are classes, write them as integers (1, not 1.0)")  # fmt: skip
        return cls(REGRESSION)
    if feature.dtype.startswith(("int", "uint")) or feature.dtype == "bool":  # True/False: pandas' to_csv of a flag
        return cls(SINGLE_LABEL, tuple(str(v) for v in sorted(values)))
    if feature.dtype in ("string", "large_string"):
        if commas := [value for value in values if "," in value]:  # "neg,long": a CSV cell cannot hold a list
            logger.warning(
                f"labels in {label_column!r} hold commas ({commas[0]!r}): each is one class; for multi-label, give "
                "lists of labels in a .jsonl or .parquet file"
            )
        if padded := [value for value in values if value != value.strip()]:  # "pos " and "pos": two classes
            logger.warning(f"labels in {label_column!r} have spaces around them ({padded[0]!r}): each spelling is a "
                           "class of its own; strip them in the file (a CSV's 'text, pos' holds ' pos')")  # fmt: skip
        spaced = [value for value in values if " " in value.strip() and value.isupper()]  # "B-PER O O", "NOUN DET"
        if len(values) > 20 and 2 * len(spaced) > len(values):  # a CSV cell of tags, one per word
            logger.warning(
                f"label column {label_column!r} holds {len(values)} classes, most with spaces ({spaced[0]!r}): each is "
                "one class; for token classification, give lists of words and tags in a .jsonl or .parquet file"
            )
        return cls(SINGLE_LABEL, tuple(sorted(values)))
    raise UserError(
        f"label column {label_column!r} has type {feature.dtype}; use integers, strings, booleans or floats"
    )


def _blank_texts(dataset: Dataset, column: str) -> int:
    """The rows whose text in `column` is missing or only whitespace, counted by Arrow (no Python loop over rows)."""
    texts = dataset.with_format("arrow")[column]
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        return texts.null_count  # numbers, say: read as their text
    blank = pc.or_(pc.equal(pc.utf8_length(texts), 0), pc.utf8_is_space(texts))  # null where the text is
    return pc.sum(pc.fill_null(blank, True)).as_py() or 0


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


def balanced_weights(task: SequenceClassification, rows: list) -> tuple[float, ...]:
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
