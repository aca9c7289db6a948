"""The tasks users bring: multi-label, class imbalance, GLUE by name, run_glue_no_trainer.py's flags, notebooks."""

import csv
import functools
import json
import os
import random
import signal
import subprocess
import sys
import types
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, free_port, launch, load_script, reference_logits, sentiment_rows, train_args, write_rows
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value
from sklearn.metrics import f1_score
from transformers import AutoConfig, AutoTokenizer

import src.runtime
from src.args import build_train_parser, parse_args, validate_train_args
from src.data import load_file
from src.errors import UserError
from src.loaders import build_eval_dataloader, build_train_dataloader, padding_options
from src.plan import best_metric
from src.tasks.sequence_classification import MULTI_LABEL, REGRESSION, SINGLE_LABEL, SequenceClassification

train = load_script("train")
evaluate_script = load_script("evaluate")

TOPICS = {"acting": ("acting", "cast"), "music": ("soundtrack",), "story": ("plot", "script", "story", "ending")}


def ticket_rows(count: int, seed: int) -> list[dict]:
    """Multi-label rows: the topics a review names, plus 'praise' when positive; some rows have no label."""
    rows = []
    for row in sentiment_rows(count, seed):
        words = row["sentence"].split()
        labels = [topic for topic, names in TOPICS.items() if any(w in words for w in names)]
        rows.append({"text": row["sentence"], "labels": labels + (["praise"] if row["label"] == "positive" else [])})
    return rows


def detect_task(dataset, label_column, class_weights="none", threshold=0.5, max_train_samples=None):
    """The task that train.py finds in these training rows (columns detected, labels from `label_column`)."""
    args = SimpleNamespace(text_column=None, text_pair_column=None, label_column=label_column,
                           class_weights=class_weights, multi_label_threshold=threshold,
                           max_train_samples=max_train_samples, model_name_or_path=None)  # fmt: skip
    return SequenceClassification.from_data(args, dataset)


def compute_metrics(predictions, references, task):
    return task.metrics({"prediction": torch.tensor(predictions), "label": torch.tensor(references)})


def check_best_metric(name, task):
    return best_metric(SimpleNamespace(metric_for_best_model=name, greater_is_better=None), task)[0]


def parse(*argv):
    parser = build_train_parser()
    return validate_train_args(parser, parse_args(parser, list(argv)))


# ---------------------------------------------------------------- multi-label


def test_lists_of_labels_mean_multi_label(tmp_path):
    rows = [{"text": "a", "labels": ["bug", "billing"]}, {"text": "b", "labels": []}, {"text": "c", "labels": ["bug"]}]
    for suffix in (".jsonl", ".json", ".parquet"):
        task = detect_task(load_file(write_rows(tmp_path / f"d{suffix}", rows)), "labels")
        assert task == SequenceClassification(MULTI_LABEL, ("billing", "bug"), columns=("text", None, "labels")), suffix
    assert task.config_fields()["problem_type"] == "multi_label_classification"
    assert task.config_fields()["id2label"] == {0: "billing", 1: "bug"}

    hub_style = Dataset.from_dict(
        {"text": ["a", "b"], "labels": [[2, 0], []]},
        features=Features({"text": Value("string"), "labels": List(ClassLabel(names=["x", "y", "z"]))}),
    )
    expected = SequenceClassification(MULTI_LABEL, ("x", "y", "z"), columns=("text", None, "labels"))
    assert detect_task(hub_style, "labels") == expected
    ids = Dataset.from_dict({"text": ["a", "b"], "labels": [[10, 2], [2]]})
    assert detect_task(ids, "labels").label_names == ("2", "10")

    with pytest.raises(UserError, match=r"empty values; use \[\] for a row without labels"):
        detect_task(Dataset.from_dict({"text": ["a", "b"], "labels": [["x"], None]}), "labels")
    with pytest.raises(UserError, match="holds only empty lists"):
        detect_task(load_file(write_rows(tmp_path / "e.jsonl", [{"text": "a", "labels": []}])), "labels")
    # One label is a yes/no task: as multi-label its metrics and its saved config (num_labels=1) would mislead.
    with pytest.raises(UserError, match=r"names one label only \('spam'\): multi-label needs at least 2"):
        detect_task(Dataset.from_dict({"text": ["a", "b"], "labels": [["spam"], []]}), "labels")
    with pytest.raises(UserError, match=r"holds one label only \('pos'\): classification needs at least 2"):
        detect_task(Dataset.from_dict({"text": ["a", "b"], "label": ["pos", "pos"]}), "label")


def test_messy_classification_data_gets_a_warning_that_says_what_to_fix(tmp_path, caplog, tiny_model):
    from accelerate import PartialState

    rows = [{"text": "a", "labels": "neg,long"}, {"text": "b", "labels": "pos"}]
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("WARNING"):
        task = detect_task(load_file(write_rows(tmp_path / "c.csv", rows)), "labels")
    assert task.problem_type == SINGLE_LABEL and task.label_names == ("neg,long", "pos")
    assert "hold commas ('neg,long'): each is one class; for multi-label, give lists of labels" in caplog.text
    # Tags of a sentence's words in one CSV cell: as many classes as sentences, which a tagger's user would not see.
    tagged = [{"text": f"w{i} x", "bio": f"B-PER O{' O' * (i % 5)} I-{i}"} for i in range(40)]
    with caplog.at_level("WARNING"):
        task = detect_task(load_file(write_rows(tmp_path / "t.csv", tagged)), "bio")
    assert "holds 40 classes, most with spaces ('B-PER O" in caplog.text and "for token classification" in caplog.text
    caplog.clear()
    intents = [{"text": f"w{i}", "intent": f"book a flight to city {i}"} for i in range(40)]  # many classes, not tags
    with caplog.at_level("WARNING"):
        detect_task(load_file(write_rows(tmp_path / "i.csv", intents)), "intent")
    assert "for token classification" not in caplog.text
    with caplog.at_level("WARNING"):
        detect_task(Dataset.from_dict({"text": ["a", "b", "c"], "label": ["pos", " pos", "neg"]}), "label")
    assert "labels in 'label' have spaces around them (' pos'): each spelling is a class of its own" in caplog.text
    (tmp_path / "mixed.jsonl").write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n')
    with pytest.raises(UserError, match=r"label column 'label' mixes value types \(int, str\): write every label"):
        detect_task(load_file(tmp_path / "mixed.jsonl"), "label")
    with pytest.raises(UserError, match=r"not among the model's labels \(B-PER O I-0, .*, \.\.\.\), those of its"):
        task.features(Dataset.from_list([{"text": "a", "bio": "O"}]), AutoTokenizer.from_pretrained(tiny_model), 8)
    # A CSV's empty cells (missing) and blank ones: each is read as an empty text, with a warning.
    # Examples as long as --max_length (most of them cut there) are counted.
    rows = [
        {"text": text, "labels": label} for text, label in (("", "pos"), ("b", "neg"), (" ", "pos"), ("a " * 9, "neg"))
    ]
    blank = load_file(write_rows(tmp_path / "b.csv", rows))
    with caplog.at_level("INFO"):
        detect_task(blank, "labels").features(blank, AutoTokenizer.from_pretrained(tiny_model), 8)
    assert "2 of 4 rows have no text in column 'text' (empty or missing): it is read as an empty text" in caplog.text
    assert "1 of 4 examples reach --max_length 8 tokens: longer texts are cut there" in caplog.text


def test_multi_label_encoding_loss_and_predictions(tmp_path, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = load_file(write_rows(tmp_path / "d.jsonl", ticket_rows(6, seed=0)))
    task = detect_task(data, "labels")
    assert task.columns == ("text", None, "labels")
    encoded = task.features(data, tokenizer, 16)
    expected = [[float(name in row["labels"]) for name in task.label_names] for row in ticket_rows(6, seed=0)]
    assert encoded["labels"] == expected
    upper = tuple(name.upper() for name in task.label_names)
    assert replace(task, label_names=upper).features(data, tokenizer, 16)["labels"] == expected
    # A parquet file's Arrow large types in a column called `labels`: the multi-hot rows stay numbers, not strings.
    import pyarrow as pa
    import pyarrow.parquet as pq

    lists = pa.array([row["labels"] for row in ticket_rows(6, seed=0)], pa.large_list(pa.large_string()))
    pq.write_table(pa.table({"text": data["text"], "labels": lists}), tmp_path / "large.parquet")
    assert task.features(load_file(tmp_path / "large.parquet"), tokenizer, 16)["labels"] == expected

    logits, targets = torch.tensor([[2.0, -1.0], [0.1, -0.3]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    weighted = SequenceClassification(MULTI_LABEL, ("a", "b"), class_weights=(3.0, 0.5), threshold=0.5)
    manual = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=torch.tensor([3.0, 0.5]), reduction="none")
    assert torch.allclose(weighted.losses(logits, targets), manual.mean(-1))
    assert weighted.predictions(logits).tolist() == [[1, 0], [1, 0]]  # sigmoid(0.1) = 0.52 > 0.5
    stricter = SequenceClassification(MULTI_LABEL, ("a", "b"), threshold=0.6)
    assert stricter.predictions(logits).tolist() == [[1, 0], [0, 0]]

    with pytest.raises(UserError, match=r"label\(s\) praise in column 'labels' are not among the model's labels"):
        replace(task, label_names=("acting", "music", "story")).features(data, tokenizer, 16)
    single = load_file(write_rows(tmp_path / "s.csv", sentiment_rows(4)))
    with pytest.raises(UserError, match="holds one label per row, but the model does multi-label"):
        replace(task, columns=("sentence", None, "label")).features(single, tokenizer, 16)


@pytest.mark.parametrize(
    ("label", "says"),
    [("NaN", "holds nan: regression needs finite numbers"), ("Infinity", "holds inf: regression needs finite"),
     ('"high"', "holds 'high', and the model does regression"), ("null", "has empty values; fill or drop")],
)  # fmt: skip
def test_a_regression_target_that_is_no_finite_number_is_one_line(tmp_path, tiny_model, label, says):
    """A NaN (what json.dumps writes for float("nan")) in validation rows trained to the end and failed in the
    metrics; in training rows it was reported as a diverging loss."""
    path = tmp_path / "scores.jsonl"
    path.write_text(f'{{"text": "a", "label": 0.5}}\n{{"text": "b", "label": {label}}}\n')
    task = SequenceClassification(REGRESSION, columns=("text", None, "label"))
    with pytest.raises(UserError, match=f"label column 'label' {says}"):
        task.features(load_file(path), AutoTokenizer.from_pretrained(tiny_model), 8)


def test_whole_numbers_written_as_floats_train_a_regression_and_say_so(tmp_path, caplog):
    """One "1.0" among a CSV's 0 and 1 makes the column float: a regression, which a classifier's user would not see."""
    from accelerate import PartialState

    rows = [{"text": "a", "label": 0}, {"text": "b", "label": 1}, {"text": "c", "label": "1.0"}]
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("WARNING"):
        assert detect_task(load_file(write_rows(tmp_path / "c.csv", rows)), "label").problem_type == REGRESSION
    assert "holds whole numbers written as floats (0.0, 1.0): trained as regression" in caplog.text


def test_a_head_trained_on_these_labels_keeps_its_order(tmp_path, tiny_model):
    """A checkpoint fine-tuned on the same labels in another order (roberta-large-mnli's CONTRADICTION, NEUTRAL,
    ENTAILMENT for GLUE's entailment, neutral, contradiction) keeps its head, of the right size, as it is: the label
    ids must follow its rows (matched ignoring case, as run_glue_no_trainer.py does), or every prediction is another
    class. Two copies of one classifier that says "negative", its head's rows and names stored in either order."""
    from transformers import AutoModelForSequenceClassification

    train_file = write_rows(tmp_path / "train.csv", sentiment_rows(16, seed=1))
    dev_file = write_rows(tmp_path / "dev.csv", [r for r in sentiment_rows(40, seed=2) if r["label"] == "negative"])
    results = {}
    for names in (["negative", "positive"], ["POSITIVE", "NEGATIVE"]):
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
        with torch.no_grad():
            model.classifier.bias.copy_(torch.tensor([5.0, -5.0]))
            if names[0] == "POSITIVE":
                model.classifier.weight.copy_(model.classifier.weight.flip(0))
                model.classifier.bias.copy_(model.classifier.bias.flip(0))
        model.config.id2label, model.config.label2id = dict(enumerate(names)), {n: i for i, n in enumerate(names)}
        folder = tmp_path / names[0]
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
        out = tmp_path / f"out-{names[0]}"
        argv = train_args(folder, train_file, dev_file, out, "--learning_rate", "1e-12", "--max_train_steps", "1")
        results[names[0]] = train.main(train.parse_train_args(argv))
        saved = AutoConfig.from_pretrained(out).id2label
        assert saved == ({0: "negative", 1: "positive"} if names[0] == "negative" else {0: "positive", 1: "negative"})
    assert results["negative"]["eval_accuracy"] == results["POSITIVE"]["eval_accuracy"] == 1.0
    assert results["POSITIVE"]["eval_loss"] == pytest.approx(results["negative"]["eval_loss"], rel=1e-5)


def test_a_head_trained_on_other_labels_is_said_and_a_folder_without_a_model_has_no_head(tmp_path, tiny_model, caplog):
    """A head of the same size for other labels is kept, and reused in the data's order: said. A folder of a tokenizer
    alone (a task of one's own builds its model itself) has no head whose order to follow."""
    from accelerate import PartialState
    from transformers import BertConfig

    from src.model import in_checkpoint_order

    BertConfig(id2label={0: "spam", 1: "ham"}).save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "tokenizer")
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("WARNING"):
        other = SimpleNamespace(model_name_or_path=str(tmp_path / "other"), trust_remote_code=False)
        assert in_checkpoint_order(other, ("negative", "positive")) == ("negative", "positive")
    assert "head was trained on other labels (spam, ham); it is kept and its rows now stand for" in caplog.text
    tokenizer_only = SimpleNamespace(model_name_or_path=str(tmp_path / "tokenizer"), trust_remote_code=False)
    assert in_checkpoint_order(tokenizer_only, ("b", "a")) == ("b", "a")


def test_evaluate_reads_the_columns_the_model_was_trained_on(tiny_model):
    """A run trained with --text_column review --label_column stars: evaluate.py reads those columns again without the
    flags, not the conventional 'text' and 'label' beside them; a flag still wins, and a column the data lacks is
    found anew."""
    record = {"text_column": "review", "text_pair_column": None, "label_column": "stars"}

    def columns(names, **flags):
        args = SimpleNamespace(**{"text_column": None, "text_pair_column": None, "label_column": None, **flags},
                               multi_label_threshold=None, trust_remote_code=False)  # fmt: skip
        return SequenceClassification.from_record(record, args, str(tiny_model), names).columns

    assert columns(["text", "review", "label", "stars"]) == ("review", None, "stars")
    assert columns(["text", "review", "label", "stars"], text_column="text") == ("text", None, "stars")
    assert columns(["text", "label"]) == ("text", None, "label")


def test_string_labels_in_a_column_named_labels_become_class_ids(tmp_path, tiny_model):
    """datasets types an output column like the input column of the same name: a CSV's `labels` of class names
    would come back as the ids written as strings, which no collator can batch."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"text": r["sentence"], "labels": r["label"]} for r in sentiment_rows(6)]
    for suffix in (".csv", ".tsv", ".jsonl"):
        data = load_file(write_rows(tmp_path / f"d{suffix}", rows))
        task = detect_task(data, "labels")
        encoded = task.features(data, tokenizer, 16)
        assert encoded.features["labels"] == Value("int64"), suffix
        assert encoded["labels"] == [task.label2id[r["labels"]] for r in rows], suffix
    # The same for a column of that name that is not the label column.
    beside = [{"text": r["text"], "sentiment": r["labels"], "labels": "unrelated"} for r in rows]
    data = load_file(write_rows(tmp_path / "beside.csv", beside))
    task = detect_task(data, "sentiment")
    assert task.features(data, tokenizer, 16)["labels"] == [task.label2id[r["labels"]] for r in rows]


def test_multi_label_metrics_agree_with_scikit_learn():
    task = SequenceClassification(MULTI_LABEL, ("a", "b", "c"))
    predictions = [[1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 1]]
    references = [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    scores = compute_metrics(predictions, references, task)
    ints = [[int(v) for v in row] for row in references]
    assert scores["exact_match"] == pytest.approx(0.5)
    assert scores["f1_micro"] == pytest.approx(f1_score(ints, predictions, average="micro"))
    assert scores["f1_macro"] == pytest.approx(f1_score(ints, predictions, average="macro", zero_division=0))
    assert [scores[f"f1/{n}"] for n in "abc"] == pytest.approx([1.0, 0.0, 1.0])
    assert check_best_metric(None, task) == "f1_micro" and check_best_metric("eval_f1/b", task) == "f1/b"
    with pytest.raises(UserError, match="use one of f1_micro, f1_macro, exact_match, loss, f1/<label> "):
        check_best_metric("accuracy", task)


def test_a_metric_missing_from_metric_names_says_where_it_belongs():
    """A metric added to the metric module alone is refused naming metric_names(), per-label ones by their kind; a
    task whose main_metric is not among them is the task author's slip, not a --metric_for_best_model the user never
    gave."""
    with pytest.raises(UserError, match=r"return it from the task's metrics\(\) and name it in metric_names\(\)"):
        check_best_metric("made_up_score", SequenceClassification(SINGLE_LABEL, ("neg", "pos")))

    class RecallPerLabel(SequenceClassification):
        def metric_names(self):
            return [*super().metric_names(), *(f"recall/{label}" for label in self.label_names)]

    with pytest.raises(UserError, match=r"use one of accuracy, f1, matthews_correlation, loss, recall/<label> \("):
        check_best_metric("recall", RecallPerLabel(SINGLE_LABEL, ("neg", "pos")))

    class ErrorRate(SequenceClassification):
        main_metric = "error_rate"

    with pytest.raises(UserError, match=r"ErrorRate.main_metric 'error_rate' is not in its metric_names\(\)"):
        check_best_metric(None, ErrorRate(SINGLE_LABEL, ("neg", "pos")))


@pytest.fixture(scope="module")
def multi_label_run(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("multi-label")
    train_file = write_rows(folder / "train.jsonl", ticket_rows(48, seed=1))
    dev_file = write_rows(folder / "dev.jsonl", ticket_rows(37, seed=2))
    out = folder / "out"
    args = train_args(tiny_model, train_file, dev_file, out, "--class_weights", "balanced", "--eval_steps", "4")
    results = train.main(train.parse_train_args(args))
    return {"out": out, "dev": dev_file, "results": results, "folder": folder}


def test_multi_label_training_saves_labels_metrics_and_weights(multi_label_run):
    out, results = multi_label_run["out"], multi_label_run["results"]
    config = AutoConfig.from_pretrained(out)
    assert config.problem_type == "multi_label_classification"
    assert config.id2label == {0: "acting", 1: "music", 2: "praise", 3: "story"}
    per_label = {f"eval_f1/{name}" for name in ("acting", "music", "praise", "story")}
    assert {"eval_exact_match", "eval_f1_micro", "eval_f1_macro", *per_label} <= results.keys()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(per_label <= r.keys() for r in records if "eval_loss" in r)

    settings = json.loads((out / "args.json").read_text())
    assert settings["metric_for_best_model"] == "f1_micro" and settings["multi_label_threshold"] == 0.5
    # pos_weight = negatives / positives in the 48 training rows
    rows = ticket_rows(48, seed=1)
    positives = {name: sum(name in r["labels"] for r in rows) for name in ("acting", "music", "praise", "story")}
    assert settings["class_weight_values"] == pytest.approx({n: (48 - p) / p for n, p in positives.items()})
    card = (out / "README.md").read_text()
    assert "multi-label classification (4 labels" in card and "top_k=None" in card and "| 2 | praise |" in card


def test_evaluate_writes_label_sets_and_reproduces_the_weighted_loss(multi_label_run, tmp_path):
    args = ["--model_name_or_path", str(multi_label_run["out"]), "--validation_file", str(multi_label_run["dev"]),
            "--output_dir", str(tmp_path), "--per_device_eval_batch_size", "5"]  # fmt: skip
    (tmp_path / "confusion_matrix.png").write_bytes(b"an earlier single-label evaluation's, into the same folder")
    metrics = evaluate_script.main(evaluate_script.parse_eval_args(args))
    # The run's class weights and threshold come from its args.json: the same loss as the run's last evaluation.
    assert metrics["eval_loss"] == pytest.approx(multi_label_run["results"]["eval_loss"], abs=1e-5)
    assert metrics["eval_f1_micro"] == pytest.approx(multi_label_run["results"]["eval_f1_micro"])
    with open(tmp_path / "predictions.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [int(r["index"]) for r in rows] == list(range(37))
    assert [json.loads(r["label"]) for r in rows] == [sorted(r["labels"]) for r in ticket_rows(37, seed=2)]
    assert all(set(json.loads(r["prediction"])) <= {"acting", "music", "praise", "story"} for r in rows)
    assert not (tmp_path / "confusion_matrix.png").exists()

    # A stricter threshold predicts a subset of the labels.
    strict = evaluate_script.main(evaluate_script.parse_eval_args([*args[:4], "--output_dir", str(tmp_path / "s"),
                                                                   "--multi_label_threshold", "0.99"]))  # fmt: skip
    assert strict["eval_loss"] == pytest.approx(metrics["eval_loss"])


def test_the_multi_label_threshold_decides_predictions_and_metrics(tmp_path, tiny_model):
    """A label is predicted when its probability is above --multi_label_threshold (README): train.py's threshold
    decides its metrics and is the one evaluate.py uses, unless evaluate.py is given another."""
    train_file = write_rows(tmp_path / "train.jsonl", ticket_rows(32, seed=1))
    rows = ticket_rows(16, seed=2)
    dev_file = write_rows(tmp_path / "dev.jsonl", rows)
    out = tmp_path / "out"
    results = train.main(train.parse_train_args(train_args(tiny_model, train_file, dev_file, out, "--max_train_steps",
                                                           "8", "--learning_rate", "5e-3", "--multi_label_threshold",
                                                           "0.3")))  # fmt: skip
    names = ("acting", "music", "praise", "story")
    assert tuple(AutoConfig.from_pretrained(out).id2label.values()) == names
    # The saved model's probabilities, without src/: what each threshold should predict.
    probabilities = reference_logits(out, [r["text"] for r in rows]).sigmoid()
    truth = [[int(name in r["labels"]) for name in names] for r in rows]

    def predicted(threshold) -> list[list[int]]:
        return (probabilities > threshold).long().tolist()

    # evaluate.py's own threshold: halfway between the likeliest label's probability and the next one's. The run's
    # 0.3, the default 0.5 and this one predict three different label sets (so the test tells them apart), and no
    # probability is so close to one of them that float rounding could tip it.
    by_label = probabilities.mean(0).sort().values
    own = round(((by_label[-1] + by_label[-2]) / 2).item(), 3)
    assert len({str(predicted(t)) for t in (0.3, 0.5, own)}) == 3
    assert all((probabilities - t).abs().min() > 1e-3 for t in (0.3, 0.5, own))

    assert results["eval_f1_micro"] == pytest.approx(f1_score(truth, predicted(0.3), average="micro"))
    assert results["eval_exact_match"] == pytest.approx(sum(p == t for p, t in zip(predicted(0.3), truth)) / 16)

    def evaluated(name, *flags) -> tuple[dict, list[list[str]]]:
        args = ["--model_name_or_path", str(out), "--validation_file", str(dev_file), "--output_dir",
                str(tmp_path / name), *flags]  # fmt: skip
        metrics = evaluate_script.main(evaluate_script.parse_eval_args(args))
        with open(tmp_path / name / "predictions.csv", newline="") as file:
            return metrics, [json.loads(r["prediction"]) for r in csv.DictReader(file)]

    def as_names(multi_hot) -> list[list[str]]:
        return [[name for name, bit in zip(names, row) if bit] for row in multi_hot]

    metrics, table = evaluated("run's")  # the run's 0.3, from its args.json
    assert table == as_names(predicted(0.3)) and metrics["eval_f1_micro"] == pytest.approx(results["eval_f1_micro"])
    metrics, table = evaluated("own", "--multi_label_threshold", str(own))
    assert table == as_names(predicted(own))
    expected = f1_score(truth, predicted(own), average="micro", zero_division=0)
    assert metrics["eval_f1_micro"] == pytest.approx(expected)


def test_a_label_the_model_never_saw_is_named(multi_label_run, tmp_path):
    data = write_rows(tmp_path / "new.jsonl", [{"text": "the plot was dull", "labels": ["story", "refund"]}])
    args = ["--model_name_or_path", str(multi_label_run["out"]), "--validation_file", str(data), "--output_dir",
            str(tmp_path)]  # fmt: skip
    with pytest.raises(UserError, match=r"label\(s\) refund in column 'labels' are not among the model's labels"):
        evaluate_script.main(evaluate_script.parse_eval_args(args))


@pytest.mark.parametrize("num_processes,batch_size", [(2, 4), (3, 5)])
def test_multi_label_predictions_are_the_same_on_2_and_3_processes(multi_label_run, tmp_path, num_processes,
                                                                   batch_size):  # fmt: skip
    """37 rows do not split evenly over the ranks: padding repeats are dropped, label sets come back in order."""
    common = ["--model_name_or_path", str(multi_label_run["out"]), "--validation_file", str(multi_label_run["dev"])]
    single = tmp_path / "single"
    evaluate_script.main(evaluate_script.parse_eval_args([*common, "--output_dir", str(single), "--cpu_threads", "1"]))
    result = launch("evaluate.py", [*common, "--output_dir", str(tmp_path / "multi"), "--per_device_eval_batch_size",
                                    str(batch_size)], num_processes=num_processes)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("eval_results.json", "predictions.csv"):
        assert (single / name).read_text() == (tmp_path / "multi" / name).read_text(), name


# ---------------------------------------------------------------- class weights


def test_balanced_weights_and_the_weighted_loss():
    rows = [{"text": "x", "label": name} for name in ["a"] * 6 + ["b"] * 2]
    task = detect_task(Dataset.from_list(rows), "label", class_weights="balanced")
    assert task.class_weights == pytest.approx((8 / (2 * 6), 8 / (2 * 2)))  # n_rows / (n_classes * count)
    # --max_train_samples: the weights of the rows that train (3 a, 1 b), not of the whole split (4 and 4).
    rows = [{"text": "x", "label": name} for name in ["a", "b", "a", "a", "b", "b", "b", "b"]]
    kept = detect_task(Dataset.from_list(rows), "label", class_weights="balanced", max_train_samples=4)
    assert kept.class_weights == pytest.approx((4 / (2 * 3), 4 / (2 * 1)))
    logits, labels = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]]), torch.tensor([0, 1, 1])
    per_example = F.cross_entropy(logits, labels, reduction="none") * torch.tensor([2 / 3, 2.0, 2.0])
    assert torch.allclose(task.losses(logits, labels), per_example)
    assert task.losses(logits, labels).mean() == pytest.approx(per_example.mean().item())  # a mean over examples
    step = task.step(lambda **batch: {"logits": logits}, {"labels": labels})  # what the loop sums and divides
    assert step.loss == pytest.approx(per_example.sum().item()) and step.units == 3
    with pytest.raises(UserError, match="--class_weights balanced is for classification"):
        detect_task(Dataset.from_list([{"text": "x", "label": 0.5}]), "label", class_weights="balanced")
    hub_style = Dataset.from_dict({"text": ["x"], "label": [0]}, features=Features(
        {"text": Value("string"), "label": ClassLabel(names=["a", "b"])}))  # fmt: skip
    with pytest.raises(UserError, match="label\\(s\\) b have no training examples"):
        detect_task(hub_style, "label", class_weights="balanced")


def test_a_regression_loss_is_each_examples_squared_error():
    """The head's (batch, 1) output against (batch,) scores: each example's own squared error, not a (batch, batch)
    broadcast of every prediction against every score, which would train every prediction towards the mean score."""
    task = SequenceClassification(REGRESSION)
    logits, scores = torch.tensor([[0.5], [2.0], [-1.0]]), torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    step = task.step(lambda **batch: {"logits": logits}, {"labels": scores})
    assert step.outputs["loss"].tolist() == pytest.approx([0.25, 0.0, 2.25])
    assert step.loss.item() == pytest.approx(2.5) and step.units == 3
    assert step.outputs["prediction"].tolist() == [0.5, 2.0, -1.0]


def test_balanced_class_weights_raise_the_minority_class_recall(tmp_path, tiny_model):
    """90 negative and 10 positive reviews: unweighted, the model learns to say 'negative'."""
    rows = sentiment_rows(400, seed=11)
    positive = [r for r in rows if r["label"] == "positive"]
    negative = [r for r in rows if r["label"] == "negative"]
    skewed = negative[:90] + positive[:10]
    random.Random(0).shuffle(skewed)
    train_file = write_rows(tmp_path / "train.csv", skewed)
    dev_file = write_rows(tmp_path / "dev.csv", negative[90:120] + positive[10:40])

    def minority_recall(*extra):
        out = tmp_path / ("weighted" if extra else "plain")
        train.main(train.parse_train_args(train_args(tiny_model, train_file, dev_file, out, *extra)))
        args = ["--model_name_or_path", str(out), "--validation_file", str(dev_file)]
        evaluate_script.main(evaluate_script.parse_eval_args(args))
        with open(out / "predictions.csv", newline="") as file:
            found = [r["prediction"] == "positive" for r in csv.DictReader(file) if r["label"] == "positive"]
        return sum(found) / len(found)

    plain, weighted = minority_recall(), minority_recall("--class_weights", "balanced")
    assert weighted > plain, (plain, weighted)  # measured: 0.0 unweighted, 1.0 weighted (seed 7, 26 steps)
    settings = json.loads((tmp_path / "weighted" / "args.json").read_text())
    assert settings["class_weight_values"] == pytest.approx({"negative": 100 / 180, "positive": 100 / 20})


# ---------------------------------------------------------------- GLUE by name


@pytest.mark.parametrize(
    "task_name,columns,metric",
    [
        ("cola", ("sentence", None), "matthews_correlation"),
        ("sst2", ("sentence", None), "accuracy"),
        ("mrpc", ("sentence1", "sentence2"), "f1"),
        ("qqp", ("question1", "question2"), "f1"),
        ("stsb", ("sentence1", "sentence2"), "pearson"),
        ("mnli", ("premise", "hypothesis"), "accuracy"),
        ("qnli", ("question", "sentence"), "accuracy"),
        ("rte", ("sentence1", "sentence2"), "accuracy"),
        ("wnli", ("sentence1", "sentence2"), "accuracy"),
    ],
)
def test_glue_task_names_set_columns_and_the_metric_for_the_best_model(task_name, columns, metric):
    args = parse("--task_name", task_name)
    assert (args.text_column, args.text_pair_column, args.metric_for_best_model) == (*columns, metric)
    assert parse("--task_name", task_name, "--metric_for_best_model", "loss").metric_for_best_model == "loss"


def mrpc_rows(count: int, seed: int) -> list[dict]:
    """GLUE MRPC's columns as nyu-mll/glue writes them to CSV: ids for labels, and an idx column."""
    return [
        {"sentence1": r["sentence"], "sentence2": "the film was fine", "label": int(r["label"] == "positive"), "idx": i}
        for i, r in enumerate(sentiment_rows(count, seed))
    ]


def test_a_run_glue_no_trainer_command_with_local_files(tmp_path, tiny_model):
    """The README's command, with local files for the Hub and several of the script's flags together."""
    train_file = write_rows(tmp_path / "train.csv", mrpc_rows(48, seed=1))
    dev_file = write_rows(tmp_path / "dev.csv", mrpc_rows(20, seed=2))
    out = tmp_path / "mrpc"
    command = f"""
        --model_name_or_path {tiny_model} --task_name mrpc --train_file {train_file} --validation_file {dev_file}
        --max_length 32 --pad_to_max_length --per_device_train_batch_size 8 --per_device_eval_batch_size 8
        --learning_rate 2e-5 --num_train_epochs 2 --num_warmup_steps 3 --weight_decay 0.0 --lr_scheduler_type linear
        --seed 42 --checkpointing_steps epoch --with_tracking --report_to tensorboard --trust_remote_code False
        --ignore_mismatched_sizes --output_dir {out}/
    """.split()
    results = train.main(train.parse_train_args([*command, "--mixed_precision", "no", "--logging_steps", "1"]))

    assert AutoConfig.from_pretrained(out).id2label == {0: "not_equivalent", 1: "equivalent"}
    assert {"eval_f1", "eval_accuracy"} <= results.keys()
    settings = json.loads((out / "args.json").read_text())
    assert settings["metric_for_best_model"] == "f1" and settings["trust_remote_code"] is False
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]  # each epoch
    # The trackers get the final results too, at the last step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "tensorboard").rglob("events.out.tfevents.*")))).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(12, pytest.approx(results["train_loss"]))]
    # --num_warmup_steps 3 wins over the default --warmup_ratio 0.1 (which would warm up for 2 of 12 steps).
    rates = {r["step"]: r["learning_rate"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "learning_rate" in r}  # fmt: skip
    assert rates[1] == pytest.approx(2e-5 / 3) and rates[2] == pytest.approx(2e-5 * 2 / 3)
    assert rates[3] == pytest.approx(2e-5)
    # --pad_to_max_length: every batch is 32 tokens long, so the padding is what 32 minus each length leaves.
    tokenizer = AutoTokenizer.from_pretrained(out)
    real = sum(len(tokenizer(r["sentence1"], r["sentence2"])["input_ids"]) for r in mrpc_rows(48, seed=1))
    assert results["train_padding_fraction"] == pytest.approx(1 - real / (48 * 32))

    # evaluate.py on a local file with GLUE's label ids: the same names as the model's.
    metrics = evaluate_script.main(
        evaluate_script.parse_eval_args(["--model_name_or_path", str(out), "--validation_file", str(dev_file)])
    )
    assert metrics["eval_f1"] == pytest.approx(results["eval_f1"])
    with open(out / "predictions.csv", newline="") as file:
        labels = [row["label"] for row in csv.DictReader(file)]
    assert labels == [["not_equivalent", "equivalent"][r["label"]] for r in mrpc_rows(20, seed=2)]


def test_pad_to_max_length_pads_every_batch(tmp_path, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = load_file(write_rows(tmp_path / "d.csv", sentiment_rows(21)))
    task = SequenceClassification(SINGLE_LABEL, ("negative", "positive"), columns=("sentence", None, "label"))
    dataset = task.features(data, tokenizer, 24)
    fixed = task.collator(tokenizer, **padding_options(torch.device("cpu"), 24))
    loaders = [build_train_dataloader(dataset, fixed, 8, 1, 0), build_eval_dataloader(dataset, fixed, 8)]
    assert {tuple(b["input_ids"].shape[1:]) for loader in loaders for b in loader} == {(24,)}
    dynamic = build_eval_dataloader(dataset, task.collator(tokenizer, **padding_options(torch.device("cpu"))), 8)
    assert max(b["input_ids"].shape[1] for b in dynamic) < 24
    # Every task's batches are --max_length long, also where a GPU rounds dynamic padding up to a multiple of 8.
    from src.tasks.causal_lm import TEXT, CausalLM
    from src.tasks.token_classification import TokenClassification

    on_gpu = padding_options(torch.device("cuda"), 10)
    tagger = TokenClassification(("B-X", "O"), ("tokens", "tags"))
    tagged = Dataset.from_list([{"tokens": ["a", "b"], "tags": ["O", "B-X"]}])
    lm, texts = CausalLM(TEXT), Dataset.from_list([{"text": "a b"}])
    for other, data in ((tagger, tagged), (lm, texts)):
        own = other.load_tokenizer(str(tiny_model), SimpleNamespace(trust_remote_code=False))  # a causal LM's EOS
        rows = other.training_rows(other.features(data, own, 10), 10).remove_columns(["example_index", "length"])
        assert other.collator(own, **on_gpu)(list(rows))["input_ids"].shape == (1, 10)


def test_sts_b_scores_are_regression_even_as_integers(tmp_path, tiny_model):
    rows = [
        {"sentence1": r["sentence"], "sentence2": "so so", "label": i % 6} for i, r in enumerate(sentiment_rows(40))
    ]
    train_file, dev_file = write_rows(tmp_path / "train.csv", rows[:32]), write_rows(tmp_path / "dev.csv", rows[32:])
    assert detect_task(load_file(train_file), "label").problem_type == SINGLE_LABEL  # without --task_name
    out = tmp_path / "out"
    results = train.main(train.parse_train_args(train_args(tiny_model, train_file, dev_file, out, "--task_name", "stsb",
                                                           "--num_train_epochs", "1")))  # fmt: skip
    assert AutoConfig.from_pretrained(out).problem_type == REGRESSION
    assert {"eval_pearson", "eval_spearmanr"} <= results.keys()
    settings = json.loads((out / "args.json").read_text())
    assert settings["metric_for_best_model"] == "pearson" and settings["greater_is_better"] is True


def test_mnli_from_the_hub_reports_matched_and_mismatched(tmp_path, tiny_model, monkeypatch):
    """nyu-mll/glue's mnli as load_dataset returns it (ClassLabel names, two validation sets); no network here."""
    names = ["entailment", "neutral", "contradiction"]
    features = Features({"premise": Value("string"), "hypothesis": Value("string"),
                         "label": ClassLabel(names=names), "idx": Value("int32")})  # fmt: skip

    def split(count, seed, unlabelled=False):
        rows = sentiment_rows(count, seed)
        return Dataset.from_dict({"premise": [r["sentence"] for r in rows], "hypothesis": ["the film was fine"] * count,
                                  "label": [-1 if unlabelled else i % 3 for i in range(count)],
                                  "idx": list(range(count))}, features=features)  # fmt: skip

    hub = DatasetDict(train=split(32, 1), validation_matched=split(12, 2), validation_mismatched=split(9, 3),
                      test_matched=split(5, 4, unlabelled=True))  # fmt: skip
    asked = []
    monkeypatch.setattr("src.data.load_dataset", lambda *args, **kwargs: asked.append(args) or hub)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model), "--task_name", "mnli", "--output_dir", str(out),
            "--report_to", "none", "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
            "--mixed_precision", "no"]  # fmt: skip
    results = train.main(train.parse_train_args(args))
    assert asked == [("nyu-mll/glue", "mnli")]
    assert results["eval_samples"] == 12 and results["eval_samples_mm"] == 9
    assert {"eval_accuracy", "eval_accuracy_mm", "eval_loss_mm"} <= results.keys()
    assert AutoConfig.from_pretrained(out).id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}
    assert "GLUE MNLI (the Hub)" in (out / "README.md").read_text()


def test_glue_without_the_hub_or_files_says_how_to_pass_files(tmp_path, tiny_model):
    args = ["--model_name_or_path", str(tiny_model), "--task_name", "rte", "--output_dir", str(tmp_path / "out")]
    expected = (
        "--task_name rte (nyu-mll/glue): cannot be loaded, the Hugging Face Hub is unreachable (HF_HUB_OFFLINE is "
        "set); pass local files instead: --train_file and --validation_file with GLUE's columns (sentence1, "
        "sentence2, label)"
    )
    with pytest.raises(UserError) as error:
        train.main(train.parse_train_args(args))
    assert str(error.value) == expected
    assert not (tmp_path / "out").exists()


def test_glue_labels_outside_the_task_are_named(tmp_path, tiny_model):
    rows = [{**row, "label": 5 if row["idx"] == 3 else row["label"]} for row in mrpc_rows(8, seed=1)]
    train_file = write_rows(tmp_path / "train.csv", rows)
    args = train_args(tiny_model, train_file, train_file, tmp_path / "out", "--task_name", "mrpc")
    with pytest.raises(UserError, match="--task_name mrpc: label column 'label' holds 5; GLUE's mrpc labels are "
                                        "not_equivalent, equivalent or their ids 0-1"):  # fmt: skip
        train.main(train.parse_train_args(args))


def test_a_local_glue_test_file_of_unlabelled_rows_is_predicted_not_refused(tiny_model):
    """GLUE's test splits label every row -1 (no label): a local copy is named as the Hub's is, and evaluate.py
    predicts it rather than refusing -1 as a label outside the task."""
    from src.glue import glue_labels

    rows = {"sentence1": ["the plot was good", "the acting"], "sentence2": ["so so"] * 2, "label": [-1, -1]}
    labelled = glue_labels(Dataset.from_dict(rows), "mrpc", None)
    assert labelled.features["label"] == ClassLabel(names=["not_equivalent", "equivalent"])
    task = SequenceClassification(SINGLE_LABEL, ("not_equivalent", "equivalent"),
                                  columns=("sentence1", "sentence2", "label"))  # fmt: skip
    assert "labels" not in task.features(labelled, AutoTokenizer.from_pretrained(tiny_model), 16).column_names


def test_a_local_file_without_the_glue_columns_names_the_task_not_a_flag_never_given(tmp_path, tiny_model):
    rows = [{"text_a": row["sentence1"], "text_b": row["sentence2"], "label": row["label"]} for row in mrpc_rows(8, 1)]
    train_file = write_rows(tmp_path / "train.csv", rows)
    expected = r"--task_name mrpc reads the column\(s\) sentence1, sentence2, and .*train.csv has no sentence1, "
    with pytest.raises(UserError, match=expected + r"sentence2 \(its columns: text_a, text_b, label\)"):
        train.main(train.parse_train_args(train_args(tiny_model, train_file, train_file, tmp_path / "o", "--task_name",
                                                     "mrpc")))  # fmt: skip
    # Named by the user, the columns are theirs to choose.
    named = train_args(tiny_model, train_file, train_file, tmp_path / "named", "--task_name", "mrpc", "--text_column",
                       "text_a", "--text_pair_column", "text_b", "--max_train_steps", "1")  # fmt: skip
    assert train.main(train.parse_train_args(named))["global_step"] == 1


# ---------------------------------------------------------------- run_glue_no_trainer.py's other flags


@pytest.mark.parametrize(
    "argv,expected",
    [([], False), (["--trust_remote_code"], True), (["--trust_remote_code", "True"], True),
     (["--trust_remote_code", "False"], False), (["--trust_remote_code", "false"], False)],
)  # fmt: skip
def test_trust_remote_code_is_off_unless_asked(argv, expected):
    assert parse(*argv).trust_remote_code is expected


def test_trust_remote_code_from_a_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trust_remote_code: true\nmulti_label_threshold: 0.3\nclass_weights: balanced\n")
    args = parse("--config", str(config))
    assert args.trust_remote_code is True and args.multi_label_threshold == 0.3 and args.class_weights == "balanced"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--use_slow_tokenizer"], "--use_slow_tokenizer: transformers 5 loads every tokenizer with its fast"),
        (["--with_tracking", "--report_to", "none"], "--with_tracking asks for a tracker and --report_to none"),
        (["--task_name", "mrpc", "--dataset_name", "x"], "either --task_name (GLUE) or --dataset_name"),
        (["--hub_token", "hf_x"], "--hub_token is for --push_to_hub"),
        (["--hub_model_id", "me/model"], "--hub_model_id is for --push_to_hub"),
        (["--push_to_hub", "--hub_model_id", "a/b/c"], "--hub_model_id 'a/b/c' is not a Hub repository name"),
        (["--push_to_hub", "--output_dir", "/tmp/my run!"], "--output_dir's name 'my run!' is not a Hub repository"),
        (["--multi_label_threshold", "0"], "--multi_label_threshold: must be above 0 and below 1, got 0"),
        (["--trust_remote_code", "maybe"], "--trust_remote_code/--no-trust_remote_code: must be true or false"),
        (["--task_name", "squad"], "--task_name: 'squad' is not a GLUE task (cola, sst2,"),
        (["--class_weights", "inverse"], "--class_weights: invalid choice"),
    ],
)
def test_flags_that_cannot_work_say_what_to_do(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse(*argv)
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def model_args(model, trust_remote_code=False, ignore_mismatched_sizes=True):
    """What a task's build_model reads of train.py's flags."""
    return SimpleNamespace(model_name_or_path=str(model), use_peft=False, trust_remote_code=trust_remote_code,
                           ignore_mismatched_sizes=ignore_mismatched_sizes)  # fmt: skip


def test_remote_code_runs_only_when_trusted(tmp_path, tiny_model, monkeypatch):
    """A model folder with its own modelling code (auto_map): refused without --trust_remote_code, code not run."""
    folder = tmp_path / "custom"
    folder.mkdir()
    for file in tiny_model.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    marker = tmp_path / "code_ran"
    (folder / "custom_bert.py").write_text(
        "import os, pathlib\n"
        "from transformers import BertConfig, BertForSequenceClassification\n"
        "pathlib.Path(os.environ['CODE_RAN_MARKER']).touch()\n"
        "class CustomConfig(BertConfig):\n    model_type = 'custom-bert'\n"
        "class CustomModel(BertForSequenceClassification):\n    config_class = CustomConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    auto_map = {
        "AutoConfig": "custom_bert.CustomConfig",
        "AutoModelForSequenceClassification": "custom_bert.CustomModel",
    }
    config.update(model_type="custom-bert", auto_map=auto_map)
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("CODE_RAN_MARKER", str(marker))
    task = SequenceClassification(SINGLE_LABEL, ("negative", "positive"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    with pytest.raises(UserError, match="ships its own Python code; read it, then pass --trust_remote_code"):
        task.build_model(model_args(folder), tokenizer, "no")
    assert not marker.exists()
    model = task.build_model(model_args(folder, trust_remote_code=True), tokenizer, "no")
    assert marker.exists() and type(model).__name__ == "CustomModel"


def test_a_head_of_another_size_is_replaced_unless_refused(tmp_path, tiny_model):
    three = SequenceClassification(SINGLE_LABEL, ("a", "b", "c"))  # the tiny model's head has 2 labels
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert three.build_model(model_args(tiny_model), tokenizer, "no").config.num_labels == 3
    with pytest.raises(UserError, match="head for another number of labels; drop --no-ignore_mismatched_sizes"):
        three.build_model(model_args(tiny_model, ignore_mismatched_sizes=False), tokenizer, "no")


# ---------------------------------------------------------------- notebooks


def test_a_notebook_kernels_command_line_is_not_parsed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/lib/python3/site-packages/ipykernel_launcher.py", "-f", "/tmp/k.json"])
    args = train.parse_train_args()
    assert args.output_dir == build_train_parser().get_default("output_dir") and args.train_file is None
    assert train.parse_train_args(["--num_train_epochs", "1"]).num_train_epochs == 1
    # `%run train.py --seed 5` in a kernel: sys.argv is the script's, its flags are read.
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setattr(sys, "argv", ["train.py", "--seed", "5"])
    assert train.parse_train_args().seed == 5
    # A kernel started otherwise (Databricks', Spyder's launcher), with a kernel's `-f connection_file`.
    monkeypatch.setattr(sys, "argv", ["/databricks/python/db_ipykernel_launcher.py", "-f", "/tmp/k.json"])
    assert train.parse_train_args().seed == build_train_parser().get_default("seed")


def test_notebook_launcher_runs_two_cpu_processes(tmp_path, tiny_model):
    """What the README shows for notebooks, in a fresh interpreter with a kernel's sys.argv, after a run with
    collating workers in the kernel: the ranks are forked from a process that has a fork server of its own."""
    train_file = write_rows(tmp_path / "train.csv", sentiment_rows(32, seed=1))
    dev_file = write_rows(tmp_path / "dev.csv", sentiment_rows(9, seed=2))
    flags = train_args(tiny_model, train_file, dev_file, tmp_path / "out", "--num_train_epochs", "1",
                       "--dataloader_num_workers", "1")  # fmt: skip
    code = (
        "import sys\n"
        "sys.argv = ['ipykernel_launcher.py', '-f', '/tmp/kernel.json']\n"
        "from accelerate import notebook_launcher\n"
        "import train\n"
        "from src.signals import workers_context\n"
        "workers_context()  # the kernel's fork server, as a run in it with collating workers leaves it\n"
        f"notebook_launcher(train.main, (train.parse_train_args({flags!r}),), num_processes=2, "
        f"use_port='{free_port()}')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Its own session, so that a timeout ends the forked workers too, not only the launching interpreter.
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        log, _ = launcher.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)  # the session it started: the interpreter and its workers
        raise
    assert launcher.returncode == 0, log[-3000:]
    assert log.count("Running training") == 1 and "Processes = 2 on cpu" in log, "one group of 2, logging once"
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    share = max(1, src.runtime.physical_cores() // 2)  # each of the 2 processes its half of the cores
    assert (
        results["num_processes"] == 2 and results["cpu_threads_per_process"] == share and results["eval_samples"] == 9
    )


def test_a_collator_that_cannot_be_pickled_is_refused_before_training_with_workers():
    """A task of one's own with a closure for a collator: one line that names it and says what to do, not torch's
    traceback as the workers start. Without workers, nothing is pickled and it runs."""
    from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, build_eval_dataloader

    rows = Dataset.from_dict({"x": [1, 2], LENGTH_COLUMN: [1, 1], INDEX_COLUMN: [0, 1]})

    def collate(batch):
        return torch.tensor([row["x"] for row in batch])

    with pytest.raises(UserError, match=r"collator \(.*collate\) cannot be sent .* --dataloader_num_workers 0$"):
        build_eval_dataloader(rows, collate, 2, num_workers=1)
    assert next(iter(build_eval_dataloader(rows, collate, 2))).tolist() == [1, 2]
    # One at module level of a notebook or `python -c` pickles, but the workers cannot import it.
    script = (f"import datasets, torch\nfrom src.loaders import build_eval_dataloader\nrows = {rows.to_dict()}\n"
              "def collate(batch):\n    return torch.tensor([row['x'] for row in batch])\n"
              "build_eval_dataloader(datasets.Dataset.from_dict(rows), collate, 2, num_workers=1)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert "defined in a notebook or `python -c`, which the workers cannot import" in result.stderr, result.stderr


def test_a_collator_that_only_holds_the_text_main_goes_to_the_workers_from_a_notebook(monkeypatch):
    """What the pickle names is looked at, not its bytes: a code model's vocabulary has "__main__" as a token."""
    from src.loaders import _check_picklable

    notebook = types.ModuleType("__main__")  # a notebook's: no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    _check_picklable(functools.partial(dict.fromkeys, ["__main__", "def", "import"]))  # as a tokenizer's vocabulary
    exec("def collate(batch):\n    return batch\n", notebook.__dict__)
    with pytest.raises(UserError, match="it names collate, defined in a notebook"):  # a notebook's function still is
        _check_picklable(functools.partial(notebook.collate))


def test_every_tasks_collator_pickles_for_dataloader_workers_started_by_spawn():
    """--dataloader_num_workers sends the collator pickled to the workers (started by a fork server, or by spawn on
    macOS and Windows)."""
    import pickle

    from src.model import default_model_path, load_tokenizer
    from src.tasks.causal_lm import CausalLM
    from src.tasks.token_classification import TokenClassification

    tokenizer = load_tokenizer(default_model_path())
    tagger = TokenClassification(("B-LOC", "O"), ("tokens", "ner_tags"))
    rows = tagger.features(Dataset.from_list([{"tokens": ["in", "Oslo"], "ner_tags": ["O", "B-LOC"]}]), tokenizer, 16)
    rows = [{key: row[key] for key in ("input_ids", "attention_mask", "labels", "word_ids")} for row in rows]
    for task in (SequenceClassification(SINGLE_LABEL, ("a", "b")), CausalLM(), tagger):
        collator = pickle.loads(pickle.dumps(task.collator(tokenizer)))
        assert callable(collator), type(task).__name__
    assert collator(rows)["word_ids"].tolist() == [[-100, 0, 1, -100]]
