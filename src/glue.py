"""The nine GLUE tasks of `--task_name`, as the Hub's nyu-mll/glue holds them.

src/args.py reads the table while parsing flags: the libraries the labelling needs are imported when it runs.
"""

GLUE_DATASET = "nyu-mll/glue"

# task: (text column, text pair column, label names in id order or None for regression, metric for the best model).
# The metrics are GLUE's own: CoLA is ranked by Matthews correlation, MRPC and QQP by F1 (accuracy is reported
# too), STS-B by Pearson correlation (and Spearman's), the others by accuracy.
GLUE_TASKS = {
    "cola": ("sentence", None, ("unacceptable", "acceptable"), "matthews_correlation"),
    "sst2": ("sentence", None, ("negative", "positive"), "accuracy"),
    "mrpc": ("sentence1", "sentence2", ("not_equivalent", "equivalent"), "f1"),
    "qqp": ("question1", "question2", ("not_duplicate", "duplicate"), "f1"),
    "stsb": ("sentence1", "sentence2", None, "pearson"),
    "mnli": ("premise", "hypothesis", ("entailment", "neutral", "contradiction"), "accuracy"),
    "qnli": ("question", "sentence", ("entailment", "not_entailment"), "accuracy"),
    "rte": ("sentence1", "sentence2", ("entailment", "not_entailment"), "accuracy"),
    "wnli": ("sentence1", "sentence2", ("not_entailment", "entailment"), "accuracy"),
}
# MNLI's second validation set (other genres than training): evaluated at the end, reported with this suffix
# as run_glue.py does (eval_accuracy_mm).
MNLI_MISMATCHED = ("validation_mismatched", "mm")


def glue_labels(dataset, task_name: str, label_column: str | None):
    """A local file in GLUE's columns, labelled as the Hub's copy is: the task's label names for ids 0, 1, ...
    (or the names themselves), and STS-B's scores as floats, so that integer scores still mean regression."""
    from datasets import ClassLabel, Value

    from src.errors import UserError

    label_column = label_column or "label"
    if label_column not in dataset.column_names or isinstance(dataset.features[label_column], ClassLabel):
        return dataset  # unlabelled, or labelled already
    names = GLUE_TASKS[task_name][2]
    if names is None:
        return dataset.cast_column(label_column, Value("float32"))
    allowed = set(names) | set(range(-1, len(names)))  # -1: GLUE's unlabelled test rows
    wrong = [v for v in dataset.unique(label_column) if v not in allowed]
    if wrong:
        raise UserError(
            f"--task_name {task_name}: label column {label_column!r} holds {', '.join(map(str, wrong[:5]))}; "
            f"GLUE's {task_name} labels are {', '.join(names)} or their ids 0-{len(names) - 1}"
        )
    return dataset.cast_column(label_column, ClassLabel(names=list(names)))
