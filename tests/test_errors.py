"""User mistakes end in one line that names the culprit, exit status 2, no traceback, and no lost files."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from accelerate import PartialState
from conftest import REPO, free_port, launch, load_script, run_process, sentiment_rows, train_args, write_rows

import src.runtime
from src.checkpoint import newest_checkpoint
from src.errors import UserError, main_process_first, unused_parameters_explained

train = load_script("train")
evaluate_script = load_script("evaluate")


def run_script(*argv):
    """A real process: what a user sees is its stderr and exit status, which only a command line shows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_process([sys.executable, *argv], 120, cwd=REPO, env=env)


def assert_one_line_error(result, culprit):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and culprit in lines[0], result.stderr[-2000:]


def test_data_mistake_on_the_command_line_keeps_the_output_dir(tmp_path, tiny_model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_script("train.py", "--model_name_or_path", str(tiny_model), "--train_file",
                        str(tmp_path / "missing.csv"), "--output_dir", str(out))  # fmt: skip
    assert_one_line_error(result, "missing.csv: no such file")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


# DDP's two texts of "Expected to have finished reduction in the prior iteration" (torch's reducer.cpp): with the search
# for unused parameters off, and on. Only the first is what --ddp_find_unused_parameters mends.
DDP_SEARCH_OFF = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
                  "indicates that your module has parameters that were not used in producing loss. You can enable "
                  "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
                  "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` function outputs "
                  "participate in calculating loss.")  # fmt: skip
DDP_SEARCH_ON = ("Expected to have finished reduction in the prior iteration before starting a new one. Since "
                 "`find_unused_parameters=True` is enabled, this likely  means that not all `forward` outputs "
                 "participate in computing loss.")  # fmt: skip


def test_ddp_unused_parameters_error_names_the_flag_only_where_the_flag_mends_it():
    with pytest.raises(UserError, match="pass --ddp_find_unused_parameters") as caught, unused_parameters_explained():
        raise RuntimeError(DDP_SEARCH_OFF)
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="Since `find_unused_parameters=True`"), unused_parameters_explained():
        raise RuntimeError(DDP_SEARCH_ON)


def test_flag_mistake_is_one_line(tmp_path):
    result = run_script("evaluate.py", "--model_name_or_path", str(tmp_path), "--per_device_eval_batch_size", "0")
    assert_one_line_error(result, "--per_device_eval_batch_size: must be a positive integer")


def test_an_error_on_every_rank_stops_them_all_promptly(tmp_path, tiny_model):
    """Real ranks: rank 0 finds the mistake inside main_process_first while rank 1 waits for it there."""
    train_file = write_rows(
        tmp_path / "train.csv", [{"review": r["sentence"], "y": r["label"]} for r in sentiment_rows(16)]
    )
    started = time.monotonic()
    result = launch("train.py", ["--model_name_or_path", str(tiny_model), "--train_file", str(train_file),
                                 "--output_dir", str(tmp_path / "out")], timeout=120)  # fmt: skip
    assert result.returncode == 1, "a multi-process accelerate launch exits 1 when a rank fails (README)"
    assert time.monotonic() - started < 90, "no rank waits for a collective that never comes"
    assert "no text column found among: review, y; name it with --text_column" in result.stderr
    assert "[rank 0] error:" in result.stderr and "[rank 1] error:" in result.stderr


# A bug in the task's step at the third batch: not a UserError, so Python prints its traceback and keeps it to the end.
CRASHING_STEP = """
import runpy, sys
import src.tasks.sequence_classification as task
step, calls = task.SequenceClassification.step, []
def crashing(self, model, batch):
    calls.append(batch)
    if len(calls) == 3:
        raise RuntimeError("a bug in the step")
    return step(self, model, batch)
task.SequenceClassification.step = crashing
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_crash_with_collating_workers_exits_with_its_traceback(tmp_path, tiny_model, tiny_data):
    """The traceback holds the run's frames, so its DataLoader lives to the end, and multiprocessing stops the workers
    as the process exits, with SIGTERM, and waits for them: a worker that ignored every SIGTERM (src/signals.py) kept
    the process waiting for ever."""
    args = train_args(tiny_model, *tiny_data, tmp_path / "out", "--dataloader_num_workers", "1")
    result = run_script("-c", CRASHING_STEP, *args)
    assert result.returncode == 1 and "RuntimeError: a bug in the step" in result.stderr, result.stderr[-2000:]


def test_unreachable_model_is_named(tmp_path, tiny_data):
    args = train_args("no-such-org/no-such-model", *tiny_data, tmp_path / "out")
    with pytest.raises(train.UserError, match="--model_name_or_path no-such-org/no-such-model: cannot load"):
        train.main(train.parse_train_args(args))
    assert not (tmp_path / "out").exists()


def test_unreachable_hub_dataset_is_named(tmp_path, tiny_model):
    args = ["--model_name_or_path", str(tiny_model), "--dataset_name", "no-such-org/no-such-data", "--output_dir",
            str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(train.UserError, match="--dataset_name no-such-org/no-such-data: cannot be loaded"):
        train.main(train.parse_train_args(args))


def test_labels_the_model_does_not_know(tmp_path, trained_tiny_model):
    data = write_rows(tmp_path / "other.csv", [{"sentence": "fine", "label": "neutral"}])
    args = evaluate_script.parse_eval_args(["--model_name_or_path", str(trained_tiny_model), "--validation_file",
                                            str(data), "--output_dir", str(tmp_path / "e")])  # fmt: skip
    with pytest.raises(evaluate_script.UserError, match="neutral in column 'label' are not among the model's labels"):
        evaluate_script.main(args)
    assert not (tmp_path / "e").exists()


def test_missing_labels_in_training_data(tmp_path, tiny_model):
    rows = [{"sentence": "good", "label": "positive"}, {"sentence": "bad", "label": None}] * 4
    train_file = write_rows(tmp_path / "train.jsonl", rows)
    args = train_args(tiny_model, train_file, train_file, tmp_path / "out")
    with pytest.raises(train.UserError, match="label column 'label' has empty values"):
        train.main(train.parse_train_args(args))
    # Only in the validation data: the error says which split holds the row.
    clean = write_rows(tmp_path / "clean.jsonl", [{"sentence": "bad", "label": "negative"}, *rows[:1]] * 4)
    args = train_args(tiny_model, clean, train_file, tmp_path / "out")
    with pytest.raises(train.UserError, match="^the validation data: label column 'label' has empty values"):
        train.main(train.parse_train_args(args))


def test_too_few_rows_to_hold_some_out_for_validation_is_one_line(tmp_path, tiny_model):
    rows = [{"sentence": "good", "label": "positive"}, {"sentence": "bad", "label": "negative"}]
    two = write_rows(tmp_path / "two.jsonl", rows)
    args = [*train_args(tiny_model, two, two, tmp_path / "out"), "--validation_split_percentage", "90"]
    args[args.index("--validation_file") : args.index("--validation_file") + 2] = []
    with pytest.raises(
        train.UserError,
        match=r"90% of 2 training row\(s\) held out for validation \(at least one\) leaves none to train on: give",
    ):
        train.main(train.parse_train_args(args))


def test_settings_a_task_cannot_use(tmp_path, tiny_model, tiny_data):
    with pytest.raises(train.UserError, match="--metric_for_best_model 'pearson' is not reported for classification"):
        train.main(train.parse_train_args(train_args(tiny_model, *tiny_data, tmp_path / "a", "--metric_for_best_model",
                                                     "pearson")))  # fmt: skip
    with pytest.raises(train.UserError, match="--max_length 100 is more than the model's 64 positions"):
        train.main(train.parse_train_args(train_args(tiny_model, *tiny_data, tmp_path / "b", "--max_length", "100")))


def test_evaluating_a_model_without_a_fine_tuned_head(tmp_path, tiny_data):
    from conftest import make_tiny_model
    from transformers import BertConfig, BertModel

    base = make_tiny_model(tmp_path / "base")
    BertModel(BertConfig.from_pretrained(base)).save_pretrained(base)  # an encoder with no classifier weights
    args = evaluate_script.parse_eval_args(["--model_name_or_path", str(base), "--validation_file", str(tiny_data[1])])
    with pytest.raises(evaluate_script.UserError, match=r"has no fine-tuned head \(missing classifier\.bias"):
        evaluate_script.main(args)


def test_evaluating_a_folder_that_is_not_a_model_is_one_line(tmp_path, tiny_data, capsys):
    """A mistyped folder (read as a Hub name, offline here), and a training checkpoint (accelerate's state, no
    config)."""
    missing = ["--model_name_or_path", str(tmp_path / "typo"), "--validation_file", str(tiny_data[1])]
    with pytest.raises(evaluate_script.UserError, match=r"typo: cannot load a model config"):
        evaluate_script.main(evaluate_script.parse_eval_args([*missing, "--output_dir", str(tmp_path / "e")]))
    checkpoint = tmp_path / "run" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "training_state.json").write_text("{}")
    with pytest.raises(SystemExit):
        evaluate_script.parse_eval_args(["--model_name_or_path", str(checkpoint), *missing[2:]])
    expected = "is a checkpoint, for train.py --resume_from_checkpoint; evaluate its run's output folder"
    expected += f" ({checkpoint.parent})"
    assert expected in capsys.readouterr().err
    (checkpoint.parent / "args.json").write_text("{}")  # stopped before its end, or started again over a finished run
    with pytest.raises(SystemExit):
        evaluate_script.parse_eval_args(["--model_name_or_path", str(checkpoint.parent), *missing[2:]])
    assert "holds a train.py run that has not finished (no all_results.json" in capsys.readouterr().err


def test_resume_with_other_batching_settings_is_refused(tmp_path, tiny_model, tiny_data):
    out = tmp_path / "out"
    first = train.main(train.parse_train_args(train_args(tiny_model, *tiny_data, out, "--checkpointing_steps", "4")))
    changed = train_args(tiny_model, *tiny_data, out, "--resume_from_checkpoint", "latest", "--seed", "8")
    with pytest.raises(train.UserError, match=r"made with other settings \(--seed 7 -> 8\)"):
        train.main(train.parse_train_args(changed))
    # Without a validation file the percentage decides which rows train.
    other_split = train_args(tiny_model, *tiny_data, out, "--resume_from_checkpoint", "latest",
                             "--validation_split_percentage", "20")  # fmt: skip
    with pytest.raises(train.UserError, match=r"other settings \(--validation_split_percentage \d+ -> 20\)"):
        train.main(train.parse_train_args(other_split))
    # The optimizer's state and the schedule come from the checkpoint: another learning rate would be ignored.
    other_rate = train_args(tiny_model, *tiny_data, out, "--resume_from_checkpoint", "latest", "--learning_rate", "1")
    with pytest.raises(train.UserError, match=r"other settings \(--learning_rate 0.001 -> 1.0\)"):
        train.main(train.parse_train_args(other_rate))
    # So would other clipping: each update would differ from the run's, and args.json would say it was the run's.
    clipped = [*changed[:-2], "--max_grad_norm", "0.5"]
    with pytest.raises(train.UserError, match=r"other settings \(--max_grad_norm 1.0 -> 0.5\)"):
        train.main(train.parse_train_args(clipped))
    # What deals the rows into updates, and the schedule's shape: the run would go on with other batches or rates.
    for flag, value, said in (("--per_device_train_batch_size", "4", "8 -> 4"),
                              ("--gradient_accumulation_steps", "2", "1 -> 2"),
                              ("--group_by_length", "false", "True -> False"),
                              ("--lr_scheduler_type", "cosine", "linear -> cosine")):  # fmt: skip
        with pytest.raises(train.UserError, match=rf"other settings \({flag} {said}\)"):
            train.main(train.parse_train_args([*changed[:-2], flag, value]))
    # The best model so far was chosen by accuracy: its value is not a loss to compare with.
    other_metric = [*changed[:-2], "--metric_for_best_model", "loss"]
    with pytest.raises(train.UserError, match=r"other settings \(--metric_for_best_model accuracy -> loss; --greater"):
        train.main(train.parse_train_args(other_metric))
    # The task, and its own flags, named as flags (not the class weights the task records because of one).
    other_task = [*changed[:-2], "--task", "examples.custom_task:BagOfWordsClassification"]
    with pytest.raises(train.UserError, match=r"other settings \(--task sequence-classification -> examples\.custom"):
        train.main(train.parse_train_args(other_task))
    weighted = [*changed[:-2], "--class_weights", "balanced"]
    with pytest.raises(train.UserError, match=r"other settings \(--class_weights none -> balanced\)"):
        train.main(train.parse_train_args(weighted))
    # The training file by its contents: a copy elsewhere resumes (a job's scratch folder), with a validation file that
    # changed too (corrected, say); without the validation file its share of the training rows would be held out, so
    # that is refused, as is a changed training file.
    copies = tmp_path / "scratch"
    copies.mkdir()
    train_copy, dev_copy = (Path(shutil.copy(file, copies)) for file in tiny_data)
    dev_copy.write_text("".join(dev_copy.read_text().splitlines(keepends=True)[:-1]))  # one row fewer
    resumed = train.main(train.parse_train_args(
        train_args(tiny_model, train_copy, dev_copy, out, "--resume_from_checkpoint", "latest")))  # fmt: skip
    assert resumed["global_step"] == first["global_step"] and resumed["eval_samples"] == first["eval_samples"] - 1
    no_dev = train_args(tiny_model, train_copy, dev_copy, out, "--resume_from_checkpoint", "latest")
    no_dev[no_dev.index("--validation_file") : no_dev.index("--validation_file") + 2] = []
    with pytest.raises(train.UserError, match=r"other settings \(validation_file: one then, none now\)"):
        train.main(train.parse_train_args(no_dev))
    train_copy.write_text(train_copy.read_text().replace("negative", "positive", 1))
    changed_data = train_args(tiny_model, train_copy, dev_copy, out, "--resume_from_checkpoint", "latest")
    with pytest.raises(train.UserError, match=r"other settings \(train_file: other contents\)"):
        train.main(train.parse_train_args(changed_data))
    # A checkpoint of an earlier version holds the training file's path only: that is compared.
    state_file = newest_checkpoint(out) / "training_state.json"
    state = json.loads(state_file.read_text())
    del state["args"]["train_file_sha256"], state["args"]["validation_held_out"]
    state_file.write_text(json.dumps(state))
    by_path = rf"other settings \(--train_file {tiny_data[0]} -> {train_copy} \(a checkpoint of an earlier version"
    with pytest.raises(train.UserError, match=by_path):
        train.main(train.parse_train_args(changed_data))
    with pytest.raises(train.UserError, match=r"validation_file: one then, none now"):  # told by its flags then
        train.main(train.parse_train_args(no_dev))


def test_an_error_on_one_rank_only_stops_every_rank_promptly(two_rank_run, tmp_path):
    """Only rank 1 meets the problem: its own RNG state file in the checkpoint is damaged (a bad copy to one node's
    disk, say). Rank 0 loads the checkpoint and waits for rank 1 in the next collective; rank 1's one-line error
    must end both, promptly. A real launch: the other rank must be stopped from outside its own process."""
    out = tmp_path / "out"
    shutil.copytree(two_rank_run["output_dir"], out)
    checkpoint = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name[11:]))[-1]
    (checkpoint / "random_states_1.pkl").write_bytes(b"not a pickle")
    args = train_args(*two_rank_run["args"], out, *two_rank_run["flags"], "--resume_from_checkpoint", str(checkpoint))
    started = time.monotonic()
    result = launch("train.py", args, timeout=120)
    assert result.returncode == 1, "a multi-process accelerate launch exits 1 when a rank fails (README)"
    assert time.monotonic() - started < 60, "rank 0 is not left waiting for a collective that never comes"
    errors = [line for line in result.stderr.splitlines() if " error: " in line]
    assert len(errors) == 1 and errors[0].startswith("[rank 1] error: checkpoint ") and "cannot be loaded" in errors[0]
    assert "Running training" not in result.stdout + result.stderr, "no rank went on to train"


def prepare_slowly_then_train(folder, data_timeout):
    """Rank 0 prepares the data for 4 s while the run's collectives time out after 2 s; then one collective."""
    import datetime

    import torch.distributed as dist

    state = PartialState(cpu=True, timeout=datetime.timedelta(seconds=2))
    with main_process_first(state, data_timeout):
        if state.is_main_process:
            time.sleep(4)
    dist.barrier()  # a training collective, on the run's own group
    (folder / f"rank-{state.process_index}").write_text("done")


def fail_on_rank_0_while_preparing(state, folder, error):
    """Rank 0 raises `error` inside main_process_first; each rank writes what it raised."""
    try:
        with main_process_first(state, 20):
            if state.is_main_process:
                raise error
    except Exception as err:
        (folder / f"rank-{state.process_index}").write_text(f"{type(err).__name__}: {err}")


def crash_on_rank_0_while_preparing(folder):
    """A crash, not a UserError."""
    fail_on_rank_0_while_preparing(PartialState(cpu=True), folder, OSError("No space left on device"))


def prepare_on_rank_0_first(folder):
    """Rank 0 prepares (1 s) while rank 1 waits; then rank 0 finds a mistake in the data (a UserError)."""
    state = PartialState(cpu=True)
    with main_process_first(state, 20):
        if state.is_main_process:
            time.sleep(1)
            (folder / "prepared").write_text("")
        else:
            (folder / "rank-1 found it prepared").write_text(str((folder / "prepared").exists()))
    fail_on_rank_0_while_preparing(state, folder, UserError("label column 'y' has empty values"))


def test_the_other_ranks_prepare_after_rank_0_and_get_its_mistake_in_its_words(tmp_path):
    """The other ranks start their block (reading what rank 0 downloaded and tokenised into the cache) only once rank
    0 has finished its own; rank 0's UserError reaches them as its one line, without a type name."""
    from accelerate import notebook_launcher

    notebook_launcher(prepare_on_rank_0_first, (tmp_path,), num_processes=2, use_port=free_port())
    assert (tmp_path / "rank-1 found it prepared").read_text() == "True"
    assert (tmp_path / "rank-0").read_text() == "UserError: label column 'y' has empty values"
    assert (tmp_path / "rank-1").read_text() == "UserError: rank 0: label column 'y' has empty values"


def test_a_crash_on_rank_0_while_preparing_stops_the_waiting_rank_with_its_message(tmp_path):
    """Not only a UserError: whatever stops rank 0 while it prepares the data (a full disk, a failed download)
    reaches the rank waiting for it, at once and in its words, instead of that rank's wait timing out."""
    from accelerate import notebook_launcher

    notebook_launcher(crash_on_rank_0_while_preparing, (tmp_path,), num_processes=2, use_port=free_port())
    assert (tmp_path / "rank-0").read_text() == "OSError: No space left on device"
    assert (tmp_path / "rank-1").read_text() == "UserError: rank 0: OSError: No space left on device"


@pytest.mark.parametrize("data_timeout", [60, None], ids=["own timeout", "the run's timeout"])
def test_the_wait_for_data_preparation_outlasts_the_training_timeout(tmp_path, data_timeout):
    """--data_preparation_timeout: the ranks waiting for rank 0's data wait on a group with their own, longer
    timeout; on the run's group (--ddp_timeout, 2 s here) the same wait fails. Two forked gloo processes, started
    by notebook_launcher, whose ranks create their process group themselves (debug_launcher's has its own timeout)."""
    from accelerate import notebook_launcher

    def start():
        notebook_launcher(prepare_slowly_then_train, (tmp_path, data_timeout), num_processes=2, use_port=free_port())

    if data_timeout is None:
        with pytest.raises(Exception, match="(?i)timed out|connection closed"):
            start()
    else:
        start()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-1"]


def test_the_timeouts_reach_the_process_group(monkeypatch, tiny_model, tmp_path):
    """--ddp_timeout sets the timeout of train.py's process group; the data wait has its own, of hours."""
    import datetime

    seen = []
    monkeypatch.setattr(
        src.runtime, "PartialState", lambda **kwargs: seen.append(kwargs["timeout"]) or PartialState(cpu=True)
    )
    args = train.parse_train_args(["--model_name_or_path", str(tiny_model), "--ddp_timeout", "77",
                                   "--mixed_precision", "no", "--output_dir", str(tmp_path)])  # fmt: skip
    assert (args.ddp_timeout, args.data_preparation_timeout) == (77, 12 * 3600)
    train.build_accelerator(args, None)
    assert seen == [datetime.timedelta(seconds=77)]


@pytest.mark.parametrize("script", ["train", "evaluate"])
def test_fsdp_on_a_machine_without_gpus_is_refused_before_anything_is_written(script, tmp_path, tiny_model, tiny_data,
                                                                              monkeypatch):  # fmt: skip
    """accelerate shards with FSDP only on GPUs: on CPUs the run would train and evaluate as plain DDP, and say
    nothing. `accelerate launch --config_file accelerate_configs/fsdp.yaml` tells the ranks by ACCELERATE_USE_FSDP."""
    import torch

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # this machine's case, wherever it runs
    out = tmp_path / "out"
    if script == "train":
        args = train.parse_train_args(train_args(tiny_model, *tiny_data, out, "--max_train_steps", "1"))
    else:
        unlabelled = write_rows(tmp_path / "test.csv", [{"sentence": r["sentence"]} for r in sentiment_rows(5)])
        args = evaluate_script.parse_eval_args(["--model_name_or_path", str(tiny_model), "--validation_file",
                                                str(unlabelled), "--output_dir", str(out)])  # fmt: skip
    module = train if script == "train" else evaluate_script
    with pytest.raises(module.UserError, match=r"needs GPUs.*--config_file accelerate_configs/cpu\.yaml instead$"):
        module.main(args)
    assert not out.exists()


def test_validation_data_without_the_training_columns_is_refused_before_training(tmp_path, tiny_model, tiny_data):
    """A validation file without labels (or with the text under another name) would train until the first
    evaluation, and then fail with an error about the task's metrics, or a KeyError."""
    rows = sentiment_rows(8, seed=3)
    unlabelled = write_rows(tmp_path / "unlabelled.csv", [{"sentence": row["sentence"]} for row in rows])
    renamed = write_rows(tmp_path / "renamed.csv", [{"text": row["sentence"], "label": row["label"]} for row in rows])
    for dev, missing in ((unlabelled, "'label'"), (renamed, "'sentence'")):
        argv = train_args(tiny_model, tiny_data[0], dev, tmp_path / dev.stem, "--checkpointing_steps", "1")
        with pytest.raises(train.UserError, match=f"the validation data has no column {missing}, which the training"):
            train.main(train.parse_train_args(argv))
        assert not (tmp_path / dev.stem / "checkpoint-1").exists(), "refused before the first step"


def test_an_output_folder_that_cannot_be_written_or_a_model_cut_short_is_one_line(tmp_path, trained_tiny_model):
    """Found before any work (a path through a file; a read-only folder takes the same check), and a weights file
    cut short by a kill during the final save is named, not a safetensors traceback."""
    (tmp_path / "file").write_text("")
    dev = write_rows(tmp_path / "dev.csv", sentiment_rows(4, seed=5))
    with pytest.raises(train.UserError, match=r"--output_dir .*file/run: .*file is a file, not a folder"):
        train.main(train.parse_train_args(train_args(trained_tiny_model, dev, dev, tmp_path / "file" / "run")))
    evaluate_args = ["--model_name_or_path", str(trained_tiny_model), "--validation_file", str(dev)]
    with pytest.raises(evaluate_script.UserError, match=r"is a file, not a folder; choose another --output_dir"):
        evaluate_script.main(evaluate_script.parse_eval_args([*evaluate_args, "--output_dir", str(tmp_path / "file")]))
    cut = tmp_path / "cut"
    shutil.copytree(trained_tiny_model, cut)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(evaluate_script.UserError, match=r"cut: cannot load a fine-tuned model \(.*incomplete"):
        evaluate_script.main(evaluate_script.parse_eval_args(["--model_name_or_path", str(cut), *evaluate_args[2:]]))


def test_ctrl_c_before_the_training_loop_is_one_line_and_status_130():
    """Loading or tokenising, before the loop turns a signal into a checkpoint: no KeyboardInterrupt traceback. A
    real SIGINT to the process group, as a terminal's Ctrl-C sends it."""
    import signal
    import subprocess

    waiting = "import time; from src.errors import run_cli; run_cli(lambda a: (print('ready'), time.sleep(60)), list)"
    process = subprocess.Popen([sys.executable, "-u", "-c", waiting], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert process.stdout.readline() == "ready\n"
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130 and stderr == "interrupted\n", stderr


@pytest.mark.parametrize("kernel,ends", [(None, True), (object(), False)], ids=["script", "IPython's %run"])
def test_a_script_keeps_a_failed_runs_variables_and_a_kernel_does_not(monkeypatch, kernel, ends):
    """run_cli's process ends with the run (its variables stay for `python -m pdb`), unless it runs in IPython
    (`%run train.py`): imported there by a library, IPython does not count; running, it does."""
    import types

    import src.errors

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
    assert src.errors.run_cli(lambda _: src.errors.process_ends_with_main, lambda: None) is ends
    assert src.errors.process_ends_with_main is False, "only while run_cli runs main()"


@pytest.mark.parametrize("raised,status", [(UserError("a mistake"), 2), (KeyboardInterrupt(), 130)])
def test_run_clis_exit_is_not_chained_to_the_error(raised, status, capsys):
    """IPython's %run (8.12) shows a SystemExit chained to another exception as a crash of its own, 100 lines after
    the one-line error."""
    import src.errors

    def main(_):
        raise raised

    with pytest.raises(SystemExit) as exited:
        src.errors.run_cli(main, lambda: None)
    assert exited.value.code == status and exited.value.__suppress_context__ and exited.value.__cause__ is None
    assert capsys.readouterr().err in ("error: a mistake\n", "interrupted\n")


def test_main_called_by_a_script_that_a_worker_imports_again_is_one_line():
    """A script looping over seeds without `if __name__ == "__main__":` is imported again, as `__mp_main__`, by the
    fork server of collating workers, whose import would start a second run (and meet the first's folder lock). A
    function that multiprocessing runs in a spawned process (torch.multiprocessing.spawn's target) may call main()."""
    from src.runtime import accelerate_state_of_this_run

    run = "with accelerate_state_of_this_run():\n    pass\n"
    script = run + "def target():\n" + "".join(f"    {line}\n" for line in run.splitlines())
    imported_again = {"__name__": "__mp_main__", "accelerate_state_of_this_run": accelerate_state_of_this_run}
    with pytest.raises(UserError, match='imported your script, which calls it outside `if __name__ == "__main__":`'):
        exec(compile(script, "seeds.py", "exec"), imported_again)
    exec(compile(script.split("\n", 2)[2], "seeds.py", "exec"), imported_again)
    imported_again["target"]()  # no error


def test_a_ranks_error_line_is_one_write(monkeypatch):
    """Each rank writes its error line to the shared stderr in one write, newline included: written apart (as print()
    does), another rank's line could come between them, and two errors read as one line."""
    import src.errors

    class Stderr:
        writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def fails(_):
        raise src.errors.UserError("no such file")

    with pytest.raises(SystemExit):
        src.errors.run_cli(fails, lambda: None)
    assert Stderr.writes == ["[rank 1] error: no such file\n"]
