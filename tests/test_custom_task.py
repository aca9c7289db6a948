"""A task of one's own, named by import path (examples/custom_task.py: a plain nn.Module): trained on 2 real ranks,
resumed from a checkpoint, evaluated by evaluate.py, all through the task interface; and the one-line errors."""

import json
import os
import shutil

import pytest
import torch
from conftest import LOSS_ATOL, launch, launch_together, load_script, run_in_process, sentiment_files, train_args
from datasets import Dataset
from safetensors.torch import load_file

from examples.custom_task import BagOfWordsClassification
from src.args import parse_train_args
from src.errors import UserError
from src.record import task_spec
from src.tasks import TASKS, detect_task, task_class
from src.tasks.base import Step, Task
from src.tasks.sequence_classification import SequenceClassification

TASK = "examples.custom_task:BagOfWordsClassification"


@pytest.fixture(scope="module")
def custom_runs(tmp_path_factory, tiny_model):
    """An uninterrupted 2-rank run of the example task, and a second one resumed from the first's step-3 checkpoint.

    Two ranks because that is how the example says to run it: the task's own model must survive DDP's wrapping, the
    sharded loaders and the gathered evaluation like a Transformers one.
    """
    folder = tmp_path_factory.mktemp("custom")
    train, dev = sentiment_files(folder, 48, 21)
    flags = ["--task", TASK, "--embedding_dim", "16", "--per_device_train_batch_size", "4", "--max_train_steps", "6",
             "--checkpointing_steps", "3", "--learning_rate", "5e-3"]  # fmt: skip
    whole = launch("train.py", train_args(tiny_model, train, dev, folder / "whole", *flags))
    assert whole.returncode == 0, whole.stderr[-3000:]
    resume = ["--resume_from_checkpoint", str(folder / "whole" / "checkpoint-3")]
    resumed = launch("train.py", train_args(tiny_model, train, dev, folder / "resumed", *flags, *resume))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"whole": folder / "whole", "resumed": folder / "resumed", "dev": dev, "log": resumed.stderr}


def test_a_task_of_ones_own_trains_on_two_ranks_and_resumes_exactly(custom_runs):
    whole, resumed = (load_file(custom_runs[name] / "model.safetensors") for name in ("whole", "resumed"))
    assert set(whole) == {"embedding.weight", "classifier.weight", "classifier.bias"}  # its own model, saved by it
    assert "resuming from" in custom_runs["log"]
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    # train_loss, the mean step loss of the epoch, carried across the resume at step 3 of its 6: to the last bit, as
    # each rank's sum so far is (a checkpoint that folded them in would round them at another place).
    losses = [
        json.loads((custom_runs[name] / "all_results.json").read_text())["train_loss"] for name in ("whole", "resumed")
    ]
    assert losses[0] == losses[1]
    steps = [json.loads(line) for line in (custom_runs["whole"] / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] > 0 and len([s for s in steps if "loss" in s]) >= 1
    record = json.loads((custom_runs["whole"] / "args.json").read_text())
    assert record["task"] == TASK and record["embedding_dim"] == 16  # its own flag, in the run record
    card = (custom_runs["whole"] / "README.md").read_text()
    assert "library_name" not in card and "from examples.custom_task import" in card, "the Hub offers no transformers"
    # Its weights are new: the packaged MiniLM gave the tokenizer only, so the card neither names it as the base model
    # nor says the model was fine-tuned from it.
    assert "base_model:" not in card and "Fine-tuned" not in card
    assert f"A new model with random weights (the tokenizer of `{record['tokenizer_name']}`)" in card


# The example task with a layer that its forward never calls: its parameters get no gradient in any step.
SPARE_LAYER_TASK = """
from torch import nn
from examples.custom_task import BagOfWordsClassification

class WithSpareLayer(BagOfWordsClassification):
    def build_model(self, args, tokenizer, mixed_precision):
        model = super().build_model(args, tokenizer, mixed_precision)
        model.spare = nn.Linear(2, 2)
        return model
"""


def test_a_model_with_parameters_that_get_no_gradient_trains_on_two_ranks_with_the_flag(
    tiny_model, tmp_path, monkeypatch
):
    """DDP on 2 ranks stops such a model at its second step unless it looks for unused parameters: Trainer's flag,
    which the error names (DDP's own names its keyword)."""
    (tmp_path / "spare_layer.py").write_text(SPARE_LAYER_TASK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    train, dev = sentiment_files(tmp_path, 16, 4)
    flags = ["--task", "spare_layer:WithSpareLayer", "--embedding_dim", "8", "--per_device_train_batch_size", "4",
             "--max_train_steps", "2"]  # fmt: skip
    without, result = launch_together(
        {"script": "train.py", "args": train_args(tiny_model, train, dev, tmp_path / "without", *flags)},
        {"script": "train.py", "args": train_args(tiny_model, train, dev, tmp_path / "out", *flags,
                                                  "--ddp_find_unused_parameters")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "args.json").read_text())["ddp_find_unused_parameters"] is True
    assert without.returncode == 1, without.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: some of the model's parameters got no gradient" in without.stderr
    assert "pass --ddp_find_unused_parameters" in without.stderr


def test_evaluate_py_takes_the_task_from_the_run_record(custom_runs, tmp_path):
    evaluate = load_script("evaluate")
    argv = ["--model_name_or_path", str(custom_runs["whole"]), "--validation_file", str(custom_runs["dev"]),
            "--output_dir", str(tmp_path), "--mixed_precision", "no"]  # fmt: skip
    metrics = evaluate.main(evaluate.parse_eval_args(argv))
    trained = json.loads((custom_runs["whole"] / "all_results.json").read_text())
    assert metrics["eval_samples"] == 21
    assert metrics["eval_accuracy"] == trained["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(trained["eval_loss"], abs=LOSS_ATOL)
    assert (tmp_path / "predictions.csv").read_text().count("\n") == 22


@pytest.mark.parametrize("flag", ["--use_peft", "--gradient_checkpointing"])
def test_features_that_need_a_transformers_model_are_refused_in_one_line(flag, tiny_model, tiny_data, tmp_path):
    train = load_script("train")
    args = parse_train_args(train_args(tiny_model, *tiny_data, tmp_path / "out", "--task", TASK, flag))
    with pytest.raises(UserError, match=f"{flag} needs a Transformers model"):
        train.main(args)


def test_a_task_is_a_listed_name_or_an_import_path():
    assert task_class("sequence-classification").name == "sequence-classification"
    assert task_class(TASK).name == "bag-of-words"
    for wrong, says in [("no_such_module:Task", "cannot import"), ("examples.custom_task:Nope", "has no Nope"),
                        ("token-classifier", "use one of"), ("src.errors:UserError", "not a subclass")]:  # fmt: skip
        with pytest.raises(UserError, match=says):
            task_class(wrong)
    assert set(TASKS) == {"sequence-classification", "token-classification", "causal-lm"}


class PairScores(Task):
    """A task added as docs/data_and_tasks.md says: one line at the end of TASKS."""

    @staticmethod
    def recognises(train, label_column=None):
        return "two texts and a score" if {"a", "b", "score"} <= set(train.column_names) else None


def test_a_task_added_to_the_list_is_found_before_sequence_classification(monkeypatch):
    """Sequence classification takes any text with a label, so it is asked last, wherever the new line goes."""
    monkeypatch.setitem(TASKS, "pair-scores", f"{__name__}:PairScores")
    pairs = Dataset.from_list([{"a": "a cat", "b": "a dog", "score": 0.5}])
    assert detect_task(pairs) == (PairScores, "two texts and a score")
    assert detect_task(Dataset.from_list([{"text": "good", "label": "pos"}]))[0] is SequenceClassification


class SmoothedClassification(SequenceClassification):
    """A listed task changed by subclassing, its name kept: the way a user changes the loss without editing src/."""


class TopTwoClassification(SequenceClassification):
    """Names a metric that its metrics() does not return: a task author's slip."""

    def metric_names(self):
        return [*super().metric_names(), "top2"]


def test_a_metric_named_but_not_returned_is_one_line_naming_the_task(tiny_model, tiny_data, tmp_path):
    argv = train_args(tiny_model, *tiny_data, tmp_path / "out", "--task", f"{__name__}:TopTwoClassification",
                      "--metric_for_best_model", "top2", "--max_train_steps", "1")  # fmt: skip
    with pytest.raises(UserError, match=r"TopTwoClassification.metric_names\(\) lists 'top2' and its metrics\(\) "):
        run_in_process("train", argv)


class OtherBatchKeys(BagOfWordsClassification):
    """The example task with batches of its own keys: no `input_ids` or `attention_mask` for the loop to read."""

    def collator(self, tokenizer, **options):
        pad = super().collator(tokenizer, **options)

        def collate(rows):
            batch = pad(rows)
            batch["words"], batch["word_mask"] = batch.pop("input_ids"), batch.pop("attention_mask")
            return batch

        return collate

    def step(self, model, batch):
        batch = dict(batch)
        batch["input_ids"], batch["attention_mask"] = batch.pop("words"), batch.pop("word_mask")
        return super().step(model, batch)


def test_batches_of_a_tasks_own_keys_train_and_count_their_examples(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    run_in_process("train", train_args(tiny_model, *tiny_data, out, "--task", f"{__name__}:OtherBatchKeys",
                                       "--max_train_steps", "2", "--logging_steps", "1"))  # fmt: skip
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [record for record in logged if "loss" in record]
    assert trained and all(r["samples_per_second"] > 0 and r["tokens_per_second"] == 0 for r in trained)


class NoLossPerExample(BagOfWordsClassification):
    def step(self, model, batch):
        loss, units, outputs = super().step(model, batch)
        return Step(loss, units, {key: outputs[key] for key in ("prediction", "label") if key in outputs})


def test_a_step_without_each_examples_loss_is_one_line_at_the_first_evaluation(tiny_model, tiny_data, tmp_path):
    argv = train_args(tiny_model, *tiny_data, tmp_path / "out", "--task", f"{__name__}:NoLossPerExample",
                      "--max_train_steps", "1")  # fmt: skip
    with pytest.raises(UserError, match=r"NoLossPerExample.step\(\) left out each example's 'loss' and 'units'"):
        run_in_process("train", argv)


class NoLengthColumn(BagOfWordsClassification):
    def features(self, dataset, tokenizer, max_length, num_proc=None):
        return super().features(dataset, tokenizer, max_length, num_proc).remove_columns("length")


class CollatorDropsTheIndex(BagOfWordsClassification):
    def collator(self, tokenizer, pad_to_multiple_of=None, pad_to_length=None):
        collate = super().collator(tokenizer, pad_to_multiple_of, pad_to_length)
        return lambda rows: {key: value for key, value in collate(rows).items() if key != "example_index"}


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("NoLengthColumn", r"training_rows\(\) for training\) lack the column 'length': the loaders batch"),
        ("CollatorDropsTheIndex", r"CollatorDropsTheIndex.collator\(\) left each row's 'example_index' out of"),
    ],
)
def test_a_task_without_the_columns_the_loaders_need_is_one_line(task, message, tiny_model, tiny_data, tmp_path):
    argv = train_args(tiny_model, *tiny_data, tmp_path / "out", "--task", f"{__name__}:{task}",
                      "--max_train_steps", "1")  # fmt: skip
    with pytest.raises(UserError, match=message):
        run_in_process("train", argv)


class WithEvaluationFlag(BagOfWordsClassification):
    """The example task with a flag of its own for evaluate.py, which its from_record reads (and notes here)."""

    seen = []

    @staticmethod
    def add_evaluation_arguments(parser):
        parser.add_argument("--confidence", type=float, default=0.5, help="A setting to try at evaluation.")

    @classmethod
    def from_record(cls, record, args, model_dir, column_names):
        cls.seen.append(args.confidence)
        return super().from_record(record, args, model_dir, column_names)


def test_a_tasks_own_evaluation_flags_reach_it_in_evaluate_py(tiny_model, tiny_data, tmp_path, capsys):
    WithEvaluationFlag.seen.clear()
    out = tmp_path / "out"
    run_in_process("train", train_args(tiny_model, *tiny_data, out, "--task", f"{__name__}:WithEvaluationFlag",
                                       "--max_train_steps", "1"))  # fmt: skip
    config = tmp_path / "eval.yaml"  # the model named in a --config file, as on the command line
    config.write_text(f"model_name_or_path: {out}\n")
    evaluate = ["--validation_file", str(tiny_data[1]), "--confidence", "0.9", "--output_dir", str(tmp_path / "eval")]
    run_in_process("evaluate", ["--config", str(config), *evaluate])
    assert WithEvaluationFlag.seen == [0.9]

    def refused(model) -> str:
        with pytest.raises(SystemExit):
            load_script("evaluate").parse_eval_args(["--model_name_or_path", str(model), *evaluate])
        return capsys.readouterr().err

    assert "unrecognized arguments: --confidence 0.9" in refused(tiny_model)  # a model of another task
    record = json.loads((out / "args.json").read_text())
    (out / "args.json").write_text(json.dumps(record | {"task": "not_installed:Task"}))
    hint = "the model's task, which may add flags, did not load (--task not_installed:Task: cannot import"
    assert hint in refused(out)


class RenamedBagOfWords(BagOfWordsClassification):
    """The example task, copied and renamed elsewhere."""


def test_the_example_tasks_card_imports_the_class_that_was_trained():
    usage = "\n".join(RenamedBagOfWords().model_card("out", "base", False)["usage"])
    assert f"from {__name__} import RenamedBagOfWords\n" in usage and "model = RenamedBagOfWords().load_model" in usage


def test_a_subclass_of_a_listed_task_is_recorded_by_its_import_path():
    """The listed name would make evaluate.py and a resume rebuild the base class, without the subclass's loss."""
    subclass = SmoothedClassification.__new__(SmoothedClassification)
    assert task_spec(subclass) == f"{__name__}:SmoothedClassification"
    assert task_class(task_spec(subclass)) is SmoothedClassification
    base = SequenceClassification.__new__(SequenceClassification)
    assert task_spec(base) == "sequence-classification"


def test_a_tasks_own_flags_exist_only_when_it_is_chosen(tiny_model, tiny_data, tmp_path):
    base = train_args(tiny_model, *tiny_data, tmp_path / "out")
    assert parse_train_args([*base, "--task", TASK, "--embedding_dim", "8"]).embedding_dim == 8
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--embedding_dim", "8"])  # sequence classification has no such flag
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--task", TASK, "--embedding_dim", "0"])  # a one-line error, not a traceback later
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--tas", TASK])  # no prefix matching: --tas is neither --task nor --task_name


def test_a_listed_tasks_flag_under_ones_own_task_says_whose_it_is(tiny_model, tiny_data, tmp_path, capsys):
    base = train_args(tiny_model, *tiny_data, tmp_path / "out")
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--task", TASK, "--packing"])
    assert "--packing is a flag of --task causal-lm" in capsys.readouterr().err
    # So under a listed task that was named: there, as under --task auto, it would be accepted and do nothing.
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--task", "token-classification", "--packing", "--class_weights", "balanced"])
    assert "--packing is a flag of --task causal-lm, --class_weights is a flag of --task sequence-classification" in (
        capsys.readouterr().err
    )
    config = tmp_path / "run.yaml"  # a --config file shared between tasks says as much
    config.write_text("task: token-classification\npacking: false\n")
    with pytest.raises(SystemExit):
        parse_train_args([*base, "--config", str(config)])
    assert "'packing' (a flag of --task causal-lm, not of this one: drop it" in capsys.readouterr().err


def test_output_folders_of_earlier_versions_still_evaluate(trained_tiny_model, tiny_data, tmp_path):
    """Folders written before runs recorded their task hold the same args.json without `task`: sequence
    classification, as they were. A recorded task that cannot be imported is a one-line error."""
    evaluate = load_script("evaluate")
    folder = tmp_path / "old"
    shutil.copytree(trained_tiny_model, folder)
    record = json.loads((folder / "args.json").read_text())
    (folder / "args.json").write_text(json.dumps({k: v for k, v in record.items() if k != "task"}))
    argv = ["--model_name_or_path", str(folder), "--validation_file", str(tiny_data[1]), "--mixed_precision", "no"]
    assert evaluate.main(evaluate.parse_eval_args(argv))["eval_samples"] == 37
    (folder / "args.json").write_text(json.dumps(record | {"task": "gone_package.tasks:MyTask"}))
    with pytest.raises(
        UserError, match="was trained with --task gone_package.tasks:MyTask: cannot import gone_package"
    ):
        evaluate.main(evaluate.parse_eval_args(argv))
