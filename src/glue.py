"""The nine GLUE tasks of `--task_name`, as the Hub's nyu-mll/glue holds them.

No imports: src/args.py reads this table while parsing flags, before any heavy library is loaded.
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
