"""End-to-end runs of train.py's and evaluate.py's main() in this process, on a tiny random BERT.

What the scripts report is checked against the saved model run here independently (`reference_logits`: plain
transformers, one row at a time), never against the files the same call wrote.
"""

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from accelerate import PartialState
from conftest import (
    LOSS_ATOL,
    free_port,
    load_script,
    reference_logits,
    run_in_process,
    run_model_card_snippet,
    score_rows,
    sentiment_rows,
    tensor_names,
    train_args,
    write_rows,
)
from datasets import ClassLabel, Dataset, Features, Value
from sklearn.metrics import f1_score, matthews_corrcoef
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import src.plots
from src.errors import UserError, run_cli

train = load_script("train")
evaluate_script = load_script("evaluate")


def run_train(*argv):
    return train.main(train.parse_train_args([str(a) for a in argv]))


def run_evaluate(*argv):
    return evaluate_script.main(evaluate_script.parse_eval_args([str(a) for a in argv]))


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def predictions_csv(folder) -> list[list[str]]:
    return [line.split(",") for line in (folder / "predictions.csv").read_text().splitlines()]


def expected_classification(model_dir, rows) -> tuple[list[str], dict]:
    """The saved model's predicted label names and eval_* metrics on `rows`, computed without src/."""
    config = AutoConfig.from_pretrained(model_dir)
    logits = reference_logits(model_dir, [r["sentence"] for r in rows])
    labels = torch.tensor([config.label2id[str(r["label"])] for r in rows])
    predicted = logits.argmax(-1)
    return [config.id2label[i] for i in predicted.tolist()], {
        "eval_accuracy": (predicted == labels).sum().item() / len(rows),
        "eval_loss": F.cross_entropy(logits, labels).item(),
        "eval_f1": f1_score(labels, predicted),
        "eval_matthews_correlation": matthews_corrcoef(labels, predicted),
    }


def recording(monkeypatch, module, name) -> list:
    """Replace module.name (a plotting function) by one that also keeps what the original returned."""
    original, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *args: calls.append(original(*args)))
    return calls


def test_a_series_of_one_point_is_drawn_as_a_dot(tmp_path, monkeypatch):
    """A short run logs its training loss once: drawn as a line only, one point would not show."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda figure: None)  # kept open, to be read back
    records = [
        {"step": 6, "loss": 0.7, "learning_rate": 1e-5},
        {"step": 2, "eval_loss": 0.8, "eval_samples": 9},
        {"step": 6, "eval_loss": 0.6, "eval_samples": 9, "eval_f1/acting": 0.5},  # a count, a label's score: no panel
    ]
    src.plots.plot_training_curves(records, tmp_path / "curves.png")
    markers = {ax.get_title(): ax.lines[0].get_marker() for ax in plt.gcf().axes if ax.lines}
    assert markers == {"training loss": "o", "learning rate": "o", "validation loss": "o"}
    plt.close("all")


def test_classification_end_to_end(tiny_model, tiny_data, tmp_path, monkeypatch):
    plots = recording(monkeypatch, src.plots, "plot_training_curves")
    out = tmp_path / "out"
    run_train(*train_args(tiny_model, *tiny_data, out, "--eval_steps", "3", "--logging_steps", "2",
                          "--report_to", "tensorboard"))  # fmt: skip

    results = json.loads((out / "all_results.json").read_text())
    assert results["num_processes"] == 1 and results["total_train_batch_size"] == 8 and results["global_step"] == 16
    assert results["eval_samples"] == 37
    assert results["train_samples_per_second"] * results["train_runtime"] == pytest.approx(2 * 64), "rows trained on"
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokens = sum(len(tokenizer(r["sentence"])["input_ids"]) for r in sentiment_rows(64, seed=1))
    assert results["train_tokens_per_second"] * results["train_runtime"] == pytest.approx(2 * tokens), "real tokens"
    # The reported metrics are those of the saved model on the validation rows.
    _, expected = expected_classification(out, sentiment_rows(37, seed=2))
    assert results["eval_accuracy"] == expected["eval_accuracy"]
    for key in ("eval_loss", "eval_f1", "eval_matthews_correlation"):
        assert results[key] == pytest.approx(expected[key], abs=1e-5), key

    # String labels became ids, the mapping travels with the model, and the weights load with nothing left over.
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert results["trainable_parameters"] == results["total_parameters"] == model.num_parameters()
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert model.config.label2id == {"negative": 0, "positive": 1}
    assert tensor_names(out / "model.safetensors") == tensor_names(tiny_model / "model.safetensors")
    # Readable by whoever may read the config (safetensors 0.8 alone leaves its files 0600: a teammate could not load).
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    args = json.loads((out / "args.json").read_text())
    assert args["text_column"] == "sentence" and args["label_column"] == "label"
    assert args["dataloader_num_workers"] == 0, "the workers the run used (no GPU: none), not the flag's None"

    logged = records(out)
    losses, evaluations = [r for r in logged if "loss" in r], [r for r in logged if "eval_loss" in r]
    assert [r["step"] for r in losses] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [r["step"] for r in evaluations] == [3, 6, 8, 9, 12, 15, 16]

    # The picture shows exactly the logged series, one panel each, read back from the figure.
    (plotted,) = plots
    expected_panels = {
        "training loss": ([r["step"] for r in losses], [r["loss"] for r in losses]),
        "learning rate": ([r["step"] for r in losses], [r["learning_rate"] for r in losses]),
    }
    for key in ("eval_loss", "eval_accuracy", "eval_f1", "eval_matthews_correlation"):
        title = "validation " + key.removeprefix("eval_").replace("_", " ")
        expected_panels[title] = ([r["step"] for r in evaluations], [r[key] for r in evaluations])
    assert plotted == expected_panels
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # TensorBoard received the same values.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard")).Reload()  # the scalars' event file; hparams are in a subfolder
    for key, source in (("loss", losses), ("eval_accuracy", evaluations)):
        scalars = [(e.step, e.value) for e in board.Scalars(key)]
        assert scalars == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in source], key


def test_regression_with_text_pairs(tiny_model, tmp_path, monkeypatch):
    rows = score_rows(40)
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
    # The model card's snippet gives the pipeline both texts, and prints the model's score of the pair.
    [pair_score] = reference_logits(out, ["First text"], ["Second text"]).squeeze(-1).tolist()
    printed = run_model_card_snippet(out)
    assert float(re.search(r"'score': ([-\d.e]+)", printed).group(1)) == pytest.approx(pair_score, abs=1e-4), printed

    points = recording(monkeypatch, src.plots, "plot_regression")
    metrics = run_evaluate("--model_name_or_path", out, "--validation_file", dev_file, "--output_dir", tmp_path / "e")
    expected = reference_logits(out, [r["sentence1"] for r in rows[32:]], [r["sentence2"] for r in rows[32:]])
    expected, scores = expected.squeeze(-1).tolist(), [r["score"] for r in rows[32:]]
    assert metrics["eval_samples"] == 8
    assert metrics["eval_mse"] == pytest.approx(sum((p - s) ** 2 for p, s in zip(expected, scores)) / 8, rel=1e-4)
    table = predictions_csv(tmp_path / "e")
    assert table[0] == ["index", "label", "prediction"] and len(table) == 9
    assert [float(row[2]) for row in table[1:]] == pytest.approx(expected, abs=1e-4)
    # The scatter plot shows each row's (true, predicted) pair.
    assert points == [[pytest.approx([score, prediction], abs=1e-5) for score, prediction in zip(scores, expected)]]


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


def test_a_run_leaves_the_float32_matmul_precision_as_it_found_it():
    """A run on a GPU computes what stays fp32 in TF32 (make_accelerator, for train.py and evaluate.py alike); what the
    process computes after main() returns has the precision it had before."""
    from src.runtime import accelerate_state_of_this_run

    before = torch.get_float32_matmul_precision()
    with accelerate_state_of_this_run():
        torch.set_float32_matmul_precision("medium" if before == "high" else "high")
    assert torch.get_float32_matmul_precision() == before
    # Set through torch's newer switches, which the older getter refuses to read: a run still starts.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        with accelerate_state_of_this_run():
            pass
    finally:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.set_float32_matmul_precision(before)


def test_a_failed_run_ends_the_process_group_it_set_up(monkeypatch):
    """Left to the interpreter's exit, a failed rank's gloo threads were torn down in no set order, and a rank
    sometimes aborted (SIGABRT, 'terminate called without an active exception') instead of exiting with status 2."""
    import torch.distributed as dist

    from src.runtime import accelerate_state_of_this_run

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", free_port())
    with pytest.raises(UserError), accelerate_state_of_this_run():
        dist.init_process_group("gloo", rank=0, world_size=1)  # as the run's PartialState does on each rank
        raise UserError("a mistake in the data")
    assert not dist.is_initialized()


def test_evaluate_script_writes_results_predictions_and_picture(trained_tiny_model, tmp_path, monkeypatch):
    rows = sentiment_rows(37, seed=2)
    data = write_rows(tmp_path / "dev.csv", rows)
    pictures = recording(monkeypatch, src.plots, "plot_confusion_matrix")
    out = tmp_path / "eval"
    run_evaluate("--model_name_or_path", trained_tiny_model, "--validation_file", data,
                 "--per_device_eval_batch_size", "5", "--output_dir", out)  # fmt: skip
    assert not PartialState._shared_state, "Accelerate's state is left for a later run or notebook_launcher to set up"

    predicted, expected = expected_classification(trained_tiny_model, rows)
    written = json.loads((out / "eval_results.json").read_text())
    assert written["eval_samples"] == 37
    for key, value in expected.items():
        assert written[key] == pytest.approx(value, abs=2e-6), key  # the file rounds to 6 digits
    table = predictions_csv(out)
    assert table[0] == ["index", "label", "prediction"] and len(table) == 38
    assert [int(row[0]) for row in table[1:]] == list(range(37))
    assert [row[1] for row in table[1:]] == [r["label"] for r in rows]
    assert [row[2] for row in table[1:]] == predicted
    # The confusion matrix shows the counts of (true, predicted) pairs.
    names = ["negative", "positive"]
    counts = [[sum(r["label"] == t and p == q for r, p in zip(rows, predicted)) for q in names] for t in names]
    assert pictures == [counts] and sum(map(sum, counts)) == 37


def test_evaluate_writes_its_files_from_the_main_process_only(trained_tiny_model, tmp_path, monkeypatch):
    """Every rank evaluates and returns the metrics; only the main process writes them (the others would write the
    same files at once). Here this process plays a rank other than the main one."""
    from accelerate import Accelerator

    data = write_rows(tmp_path / "dev.csv", sentiment_rows(5, seed=2))
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))
    metrics = run_evaluate("--model_name_or_path", trained_tiny_model, "--validation_file", data,
                           "--output_dir", tmp_path / "eval")  # fmt: skip
    assert metrics["eval_samples"] == 5
    assert not (tmp_path / "eval").exists(), "nothing written by a rank other than the main one"


def test_a_failed_run_leaves_no_accelerate_state_behind(tiny_model, trained_tiny_model, tmp_path):
    """A run that fails once Accelerate is set up (here: validation data without the label column) drops its state as
    a finished run does, so that the next run in the notebook, in another precision, starts as in a new process."""
    train_file = write_rows(tmp_path / "train.csv", sentiment_rows(8))
    unlabelled = write_rows(tmp_path / "dev.csv", [{"sentence": r["sentence"]} for r in sentiment_rows(4, seed=1)])
    with pytest.raises(UserError, match="the validation data has no column 'label'"):
        run_train("--model_name_or_path", tiny_model, "--train_file", train_file, "--validation_file", unlabelled,
                  "--output_dir", tmp_path / "out", "--mixed_precision", "no", "--report_to", "none")  # fmt: skip
    assert not PartialState._shared_state, "train.py's failed run left Accelerate's state"
    with pytest.raises(UserError, match="--text_column"):
        run_evaluate("--model_name_or_path", trained_tiny_model, "--validation_file", unlabelled,
                     "--text_column", "title", "--output_dir", tmp_path / "eval")  # fmt: skip
    assert not PartialState._shared_state, "evaluate.py's failed run left Accelerate's state"


def test_a_failed_run_lets_go_of_its_model_and_collating_workers(tiny_model, tmp_path, monkeypatch):
    """A notebook keeps the traceback of a run that failed (IPython's sys.last_traceback), and with it every frame's
    variables: the model and optimizer (GPU memory that the next try needs) and a persistent collating worker. They
    must go when the run fails, as they do when it ends, and without waiting for a garbage collection."""
    import weakref

    import psutil

    import src.model

    models = []

    def prepared(*args):
        models.append(weakref.ref(model := src.model.prepare_for_training(*args)))
        return model

    def forward(model):
        raise ValueError("a forward pass failed")

    def failing_evaluation(model, *args):
        try:
            forward(model)  # an error turned into another: the first one's frames hold the model too
        except ValueError as err:
            raise RuntimeError("evaluation failed") from err

    monkeypatch.setattr(train, "prepare_for_training", prepared)
    monkeypatch.setattr(train, "evaluate", failing_evaluation)
    data = write_rows(tmp_path / "train.csv", sentiment_rows(16))
    argv = ["--model_name_or_path", tiny_model, "--train_file", data, "--validation_file", data, "--eval_steps", "1",
            "--dataloader_num_workers", "1", "--output_dir", tmp_path / "out", "--report_to", "none"]  # fmt: skip

    def collating_workers():  # the children of this process's fork server (src/signals.py), which stays
        return {child for child in psutil.Process().children(recursive=True) if child.ppid() != os.getpid()}

    before = collating_workers()
    with pytest.raises(RuntimeError, match="evaluation failed") as failure:
        run_train(*argv)
    assert failure.value.__traceback__ is not None, "the traceback is kept, as a notebook keeps it"
    assert models and models[0]() is None, "the failed run's model is still alive"
    assert collating_workers() <= before, "the failed run's collating worker still runs"
    # As a script (run_cli) the process ends with the run: its variables stay for a post-mortem (python -m pdb).
    with pytest.raises(RuntimeError, match="evaluation failed") as failure:
        run_cli(train.main, lambda: train.parse_train_args([str(a) for a in argv + ["--overwrite_output_dir"]]))
    assert models[1]() is not None, "a script's failed run kept no variables for the debugger"


def test_evaluating_data_without_the_label_column_says_so(trained_tiny_model, tmp_path, caplog):
    """A label column of another name than in training: predictions only, and a warning that names the fix."""
    rows = [{"sentence": r["sentence"], "sentiment": r["label"]} for r in sentiment_rows(5, seed=2)]
    data = write_rows(tmp_path / "dev.csv", rows)
    with caplog.at_level("WARNING"):
        run_evaluate("--model_name_or_path", trained_tiny_model, "--validation_file", data, "--output_dir", tmp_path)
    assert json.loads((tmp_path / "eval_results.json").read_text()) == {"eval_samples": 5}
    assert (
        "(its columns: sentence, sentiment; name the label column with --label_column): predictions only" in caplog.text
    )


def test_evaluate_pads_batches_as_train_does(tiny_model, tmp_path, monkeypatch):
    """Multiples of 8 on CUDA (for tensor cores), in both scripts, from one helper. No GPU here: the helper is asked
    about this machine's device and answers as on CUDA; every batch either script builds then comes out so."""
    from types import SimpleNamespace

    from src.loaders import padding_options
    from src.model import load_tokenizer
    from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification

    assert padding_options(torch.device("cuda")) == {"pad_to_multiple_of": 8, "pad_to_length": None}
    assert padding_options(torch.device("cpu"), 64) == {"pad_to_multiple_of": None, "pad_to_length": 64}
    asked, widths = [], []

    def as_on_cuda(device, *rest):
        asked.append(device.type)
        return padding_options(torch.device("cuda"), *rest)

    rows = sentiment_rows(13)
    tokenizer = load_tokenizer(str(tiny_model))
    task = SequenceClassification(SINGLE_LABEL, ("negative", "positive"), columns=("sentence", None, "label"))
    dataset = task.features(Dataset.from_list(rows), tokenizer, 64)
    monkeypatch.setattr(train, "padding_options", as_on_cuda)
    batching = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "per_device_eval_batch_size": 4,
                "group_by_length": True, "dataloader_num_workers": 0}  # fmt: skip
    args = SimpleNamespace(max_length=64, pad_to_max_length=False, auto_find_batch_size=False, seed=0, **batching)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, gradient_accumulation_steps=1)
    _, train_loader, eval_loaders = train.build_dataloaders(
        args, accelerator, None, {"train": dataset, "validation": dataset}, tokenizer, task, None, 64
    )
    widths += [batch["input_ids"].shape[1] for loader in (train_loader, *eval_loaders.values()) for batch in loader]

    monkeypatch.setattr(evaluate_script, "padding_options", as_on_cuda)
    evaluate = evaluate_script.evaluate

    def evaluating(model, dataloader, *rest):
        widths.extend(batch["input_ids"].shape[1] for batch in dataloader)
        return evaluate(model, dataloader, *rest)

    monkeypatch.setattr(evaluate_script, "evaluate", evaluating)
    unlabelled = write_rows(tmp_path / "test.csv", [{"sentence": r["sentence"]} for r in rows])
    run_evaluate("--model_name_or_path", tiny_model, "--validation_file", unlabelled, "--per_device_eval_batch_size",
                 "4", "--output_dir", tmp_path / "eval")  # fmt: skip
    assert asked == ["cpu", "cpu"] and len(widths) == 4 + 4 + 4
    assert all(width % 8 == 0 for width in widths), widths


def test_evaluate_without_labels_writes_predictions_only(trained_tiny_model, tmp_path):
    rows = sentiment_rows(5)
    unlabelled = write_rows(tmp_path / "test.csv", [{"sentence": r["sentence"]} for r in rows])
    out = tmp_path / "e"
    assert run_evaluate("--model_name_or_path", trained_tiny_model, "--validation_file", unlabelled,
                        "--output_dir", out) == {"eval_samples": 5}  # fmt: skip
    table = predictions_csv(out)
    assert table[0] == ["index", "prediction"]
    assert [row[1] for row in table[1:]] == expected_classification(trained_tiny_model, rows)[0]
    assert not list(out.glob("*.png"))


def test_a_model_without_label_names_reads_labels_as_ids(trained_tiny_model, tmp_path):
    """A classifier fine-tuned elsewhere may carry only LABEL_0, LABEL_1: data labelled 0 and 1 then matches it."""
    model = tmp_path / "model"
    shutil.copytree(trained_tiny_model, model)
    (model / "args.json").unlink()
    config = AutoConfig.from_pretrained(model)
    config.id2label, config.label2id = {0: "LABEL_0", 1: "LABEL_1"}, {"LABEL_0": 0, "LABEL_1": 1}
    config.save_pretrained(model)
    rows = sentiment_rows(20, seed=7)
    ids = [{"sentence": r["sentence"], "label": int(r["label"] == "positive")} for r in rows]
    metrics = run_evaluate("--model_name_or_path", model, "--validation_file", write_rows(tmp_path / "d.csv", ids),
                           "--output_dir", tmp_path / "e")  # fmt: skip
    predicted, expected = expected_classification(trained_tiny_model, rows)
    assert metrics["eval_accuracy"] == pytest.approx(expected["eval_accuracy"])
    table = predictions_csv(tmp_path / "e")
    assert [row[1] for row in table[1:]] == [str(r["label"]) for r in ids]
    assert [row[2] for row in table[1:]] == [str(["negative", "positive"].index(p)) for p in predicted]


def hub_style_dataset(folder):
    """A dataset folder that `load_dataset(path)` reads offline, laid out as on the Hub: one parquet file per split,
    ClassLabel features in the files' metadata, an unlabelled test split (-1, as GLUE's) and one half labelled."""
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"])})
    splits = {"train": sentiment_rows(64, 1), "validation": sentiment_rows(21, 2), "test": sentiment_rows(9, 3),
              "partly": sentiment_rows(4, 4)}  # fmt: skip
    (folder / "data").mkdir(parents=True)
    for name, rows in splits.items():
        labels = [features["label"].str2int(r["label"]) for r in rows]
        labels = {"test": [-1] * len(rows), "partly": [-1, -1] + labels[2:]}.get(name, labels)
        split = Dataset.from_dict({"sentence": [r["sentence"] for r in rows], "label": labels}, features=features)
        split.to_parquet(folder / "data" / f"{name}-00000-of-00001.parquet")
    return folder, splits


def test_hub_style_dataset_and_its_splits(tiny_model, tmp_path, caplog):
    data, splits = hub_style_dataset(tmp_path / "data")
    out = tmp_path / "out"
    results = run_train("--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--output_dir", str(out),
                        "--num_train_epochs", "1", "--report_to", "none", "--mixed_precision", "no")  # fmt: skip
    assert results["eval_samples"] == 21, "its validation split, not rows carved from train"
    assert AutoConfig.from_pretrained(out).id2label == {0: "negative", 1: "positive"}

    def evaluate_split(split):
        folder = tmp_path / f"eval-{split}"
        metrics = run_evaluate("--model_name_or_path", out, "--dataset_name", data, "--split", split,
                               "--output_dir", folder)  # fmt: skip
        return metrics, predictions_csv(folder)

    metrics, table = evaluate_split("valid")  # the first split whose name starts with it
    predicted, expected = expected_classification(out, splits["validation"])
    assert metrics["eval_samples"] == 21 and metrics["eval_accuracy"] == pytest.approx(expected["eval_accuracy"])
    assert [row[2] for row in table[1:]] == predicted

    with caplog.at_level("WARNING"):
        metrics, table = evaluate_split("test")  # unlabelled: predictions only
    assert metrics == {"eval_samples": 9} and table[0] == ["index", "prediction"]
    assert "its column 'label' holds none: an unlabelled split" in caplog.text and "--label_column" not in caplog.text
    assert [row[1] for row in table[1:]] == expected_classification(out, splits["test"])[0]

    with pytest.raises(UserError, match="marks some rows as unlabelled"):
        evaluate_split("partly")
    with pytest.raises(UserError, match="--split nope: .* has only train, validation, test, partly"):
        evaluate_split("nope")


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    from src.reporting import keep_records_up_to, read_jsonl

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 0.7}\n{"step": 2, "loss": 0.6}\n{"step": 3, "lo')
    assert read_jsonl(log) == [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}]
    keep_records_up_to(log, 1)
    assert read_jsonl(log) == [{"step": 1, "loss": 0.7}]


def test_evaluate_refuses_a_damaged_args_json(trained_tiny_model, tmp_path):
    """Read past, the model would be evaluated in another precision, length and task than it was trained with."""
    assert evaluate_script.read_record(str(tmp_path)) == {}  # a model from elsewhere has none
    model = tmp_path / "model"
    shutil.copytree(trained_tiny_model, model)
    (model / "args.json").write_text((model / "args.json").read_text()[:-3])  # cut short
    with pytest.raises(UserError, match=r"args.json is damaged \(.*\): it records how the model was trained"):
        evaluate_script.main(
            evaluate_script.parse_eval_args(
                ["--model_name_or_path", str(model), "--validation_file", str(trained_tiny_model.parent / "dev.csv")]
            )
        )
    for other in ("null", "[]", '"args"'):  # valid JSON, yet no record: not read as a model from elsewhere's none
        (model / "args.json").write_text(other)
        with pytest.raises(UserError, match=r"args.json is damaged \(not a JSON object\)"):
            evaluate_script.read_record(str(model))


def test_train_loss_is_the_mean_step_loss_of_the_last_epoch(tiny_model, tiny_data, tmp_path):
    """all_results.json's train_loss, as the peers' scripts report it: each step's loss over all its units, averaged
    over the last epoch's steps (here logged one by one: --logging_steps 1)."""
    results = run_in_process("train", train_args(tiny_model, *tiny_data, tmp_path / "out", "--logging_steps", "1"))
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    last_epoch = [r["loss"] for r in logged if "loss" in r and r["epoch"] > 1]  # 64 rows / 8: 8 steps an epoch
    assert len(last_epoch) == 8
    assert results["train_loss"] == pytest.approx(sum(last_epoch) / 8, abs=LOSS_ATOL)
