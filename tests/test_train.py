"""End-to-end runs of train.py's and evaluate.py's main() in this process, on a tiny random BERT."""

import json

import pytest
import torch
from conftest import load_script, sentiment_rows, train_args, write_rows
from transformers import AutoConfig, AutoModelForSequenceClassification

train = load_script("train")
evaluate_script = load_script("evaluate")


def run_train(*argv):
    return train.main(train.parse_train_args(list(argv)))


def test_classification_end_to_end(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    results = run_train(
        *train_args(
            tiny_model, *tiny_data, out, "--eval_steps", "3", "--logging_steps", "2", "--report_to", "tensorboard"
        )
    )

    saved = json.loads((out / "all_results.json").read_text())
    assert saved == pytest.approx(results)
    for key in (
        "eval_accuracy",
        "eval_f1",
        "eval_matthews_correlation",
        "eval_loss",
        "train_runtime",
        "train_samples_per_second",
        "num_processes",
        "total_train_batch_size",
        "global_step",
    ):
        assert key in saved, key
    assert saved["num_processes"] == 1 and saved["total_train_batch_size"] == 8 and saved["global_step"] == 16
    assert saved["eval_samples"] == 37

    # String labels became ids, and the mapping travels with the model.
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert model.config.label2id == {"negative": 0, "positive": 1}
    weights = (out / "model.safetensors").read_bytes()[:4000].decode("latin-1")
    assert "module." not in weights

    args = json.loads((out / "args.json").read_text())
    assert args["text_column"] == "sentence" and args["label_column"] == "label"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r and "learning_rate" in r for r in records)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [3, 6, 8, 9, 12, 15, 16]
    assert (out / "training_curves.png").stat().st_size > 10_000
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))


def test_regression_with_text_pairs(tiny_model, tmp_path):
    rows = [
        {"sentence1": r["sentence"], "sentence2": "so so", "score": float(i % 5) / 2}
        for i, r in enumerate(sentiment_rows(40))
    ]
    train_file = write_rows(tmp_path / "train.jsonl", rows[:32])
    dev_file = write_rows(tmp_path / "dev.parquet", rows[32:])
    out = tmp_path / "out"
    results = run_train(*train_args(tiny_model, train_file, dev_file, out, "--label_column", "score"))
    assert {"eval_mse", "eval_pearson", "eval_spearmanr"} <= results.keys()
    config = AutoConfig.from_pretrained(out)
    assert config.num_labels == 1 and config.problem_type == "regression"
    args = json.loads((out / "args.json").read_text())
    assert (args["text_column"], args["text_pair_column"]) == ("sentence1", "sentence2")
    assert args["metric_for_best_model"] == "mse" and args["greater_is_better"] is False

    metrics = evaluate_script.main(
        evaluate_script.parse_eval_args(["--model_name_or_path", str(out), "--validation_file", str(dev_file)])
    )
    assert metrics["eval_samples"] == 8 and (out / "predictions_vs_labels.png").stat().st_size > 5_000
    predictions = (out / "predictions.csv").read_text().splitlines()
    assert predictions[0] == "index,label,prediction" and len(predictions) == 9


def test_validation_split_carved_from_train_and_int_labels(tiny_model, tmp_path):
    rows = [{"text": r["sentence"], "label": 3 if r["label"] == "positive" else 7} for r in sentiment_rows(50)]
    train_file = write_rows(tmp_path / "train.tsv", rows)
    out = tmp_path / "out"
    results = run_train(
        "--model_name_or_path",
        str(tiny_model),
        "--train_file",
        str(train_file),
        "--output_dir",
        str(out),
        "--num_train_epochs",
        "1",
        "--report_to",
        "none",
        "--validation_split_percentage",
        "20",
    )
    assert results["eval_samples"] == 10
    assert AutoConfig.from_pretrained(out).id2label == {0: "3", 1: "7"}


def test_evaluate_script_writes_results_predictions_and_picture(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    run_train(*train_args(tiny_model, *tiny_data, out, "--num_train_epochs", "1"))
    args = evaluate_script.parse_eval_args(
        ["--model_name_or_path", str(out), "--validation_file", str(tiny_data[1]), "--per_device_eval_batch_size", "5"]
    )
    metrics = evaluate_script.main(args)
    assert metrics == pytest.approx(json.loads((out / "eval_results.json").read_text()), abs=1e-6)
    lines = (out / "predictions.csv").read_text().splitlines()
    assert lines[0] == "index,label,prediction" and len(lines) == 38
    assert [int(line.split(",")[0]) for line in lines[1:]] == list(range(37))
    labels = [row["label"] for row in sentiment_rows(37, seed=2)]
    assert [line.split(",")[1] for line in lines[1:]] == labels
    assert (out / "confusion_matrix.png").stat().st_size > 5_000


def test_trained_weights_match_the_saved_model(tiny_model, tiny_data, tmp_path):
    """What from_pretrained reads back predicts exactly what the run evaluated."""
    out = tmp_path / "out"
    results = run_train(*train_args(tiny_model, *tiny_data, out, "--num_train_epochs", "1"))
    metrics = evaluate_script.main(
        evaluate_script.parse_eval_args(["--model_name_or_path", str(out), "--validation_file", str(tiny_data[1])])
    )
    assert metrics["eval_accuracy"] == pytest.approx(results["eval_accuracy"])
    assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], abs=1e-5)
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


@pytest.mark.slow
def test_demo_task_starts_at_chance_with_the_packaged_model(tmp_path):
    """The default run's premise: MiniLM with a fresh head knows nothing of the demo task."""
    from accelerate import Accelerator

    from src.data import build_eval_dataloader, tokenize
    from src.demo_data import make_demo_splits
    from src.evaluation import evaluate
    from src.model import default_model_path, load_model, load_tokenizer
    from src.task import SINGLE_LABEL, Task

    accelerator = Accelerator(cpu=True)
    tokenizer = load_tokenizer(default_model_path())
    task = Task(SINGLE_LABEL, ("negative", "positive"))
    model = load_model(default_model_path(), task)
    validation = make_demo_splits()["validation"]
    dataset = tokenize(validation, tokenizer, ("sentence", None, "label"), 64, task)
    loader = accelerator.prepare(build_eval_dataloader(dataset, tokenizer, 64))
    metrics, _ = evaluate(accelerator.prepare_model(model, evaluation_mode=True), loader, accelerator, task)
    assert 0.4 < metrics["eval_accuracy"] < 0.6


def test_evaluate_without_labels_writes_predictions_only(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    run_train(*train_args(tiny_model, *tiny_data, out, "--num_train_epochs", "1"))
    unlabelled = write_rows(tmp_path / "test.csv", [{"sentence": r["sentence"]} for r in sentiment_rows(5)])
    args = ["--model_name_or_path", str(out), "--validation_file", str(unlabelled), "--output_dir", str(tmp_path / "e")]
    assert evaluate_script.main(evaluate_script.parse_eval_args(args)) == {"eval_samples": 5}
    lines = (tmp_path / "e" / "predictions.csv").read_text().splitlines()
    assert lines[0] == "index,prediction" and len(lines) == 6
    assert {line.split(",")[1] for line in lines[1:]} <= {"negative", "positive"}


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    from src.reporting import keep_records_up_to, read_jsonl

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 0.7}\n{"step": 2, "loss": 0.6}\n{"step": 3, "lo')
    assert read_jsonl(log) == [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}]
    keep_records_up_to(log, 1)
    assert read_jsonl(log) == [{"step": 1, "loss": 0.7}]


def test_evaluate_ignores_a_damaged_args_json(tmp_path):
    (tmp_path / "args.json").write_text("{not json")
    assert evaluate_script.training_settings(str(tmp_path)) == {}
