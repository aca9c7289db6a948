"""Really 2 and 3 CPU processes: training under accelerate_configs/cpu.yaml, evaluation under three launchers.

Each launch is shared by the tests that check different things about the same run (see the fixtures).
"""

import json
import os
import sys

import pytest
import torch
from conftest import (
    LOSS_ATOL,
    REPO,
    WEIGHTS_ATOL,
    another_run_holding,
    free_port,
    launch,
    reference_logits,
    run_in_process,
    run_process,
    score_rows,
    sentiment_rows,
    tensor_names,
    train_args,
    write_rows,
)
from safetensors.torch import load_file
from scipy.stats import pearsonr
from transformers import AutoModelForSequenceClassification

from src.errors import UserError


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def results(folder) -> dict:
    return json.loads((folder / "all_results.json").read_text())


def max_difference(a, b) -> float:
    first, second = load_file(a), load_file(b)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


def checkpoints(folder) -> list[str]:
    return sorted((p.name for p in folder.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


@pytest.fixture(scope="module")
def one_rank_twin(two_rank_run, tmp_path_factory):
    """The 2-rank run on 1 rank of 8 rows (in this process): the same examples in every optimizer step."""
    out = tmp_path_factory.mktemp("one-rank") / "out"
    flags = [*two_rank_run["flags"], "--per_device_train_batch_size", "8"]
    run_in_process("train", train_args(*two_rank_run["args"], out, *flags))
    return out


def test_two_ranks_of_four_train_like_one_rank_of_eight(two_rank_run, one_rank_twin):
    """Gradients averaged over ranks, each rank its half of every batch: the same run up to float rounding."""
    one, two = one_rank_twin, two_rank_run["output_dir"]
    assert results(two)["num_processes"] == 2 and results(two)["total_train_batch_size"] == 8
    assert results(two)["eval_samples"] == 21, "21 rows on 2 ranks: the repeat that evens them out is not counted"
    assert results(two)["global_step"] == results(one)["global_step"]
    # The last epoch's mean step loss, each step's summed over both ranks (not one rank's, nor their mean).
    assert results(two)["train_loss"] == pytest.approx(results(one)["train_loss"], abs=LOSS_ATOL)

    # Every record (the training loss of each step, each evaluation) at the same step with the same values.
    first, second = records(one), records(two)
    assert [(r["step"], sorted(r)) for r in first] == [(r["step"], sorted(r)) for r in second]
    for a, b in zip(first, second):
        for key in ("loss", "learning_rate", "eval_loss", "eval_accuracy", "eval_f1"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=LOSS_ATOL), f"step {a['step']}: {key}"

    # The final model (the best checkpoint's) and the newest checkpoint, saved in epoch 2.
    newest = checkpoints(two)[-1]
    assert checkpoints(one) == checkpoints(two)
    for name in ("model.safetensors", f"{newest}/model.safetensors"):
        worst = max_difference(one / name, two / name)
        assert worst < WEIGHTS_ATOL, f"{name}: weights differ by up to {worst}"  # sums in another order


def test_two_ranks_write_each_file_once_with_plain_weight_names(two_rank_run, one_rank_twin, tiny_model_no_dropout):
    one, two = one_rank_twin, two_rank_run["output_dir"]
    assert two_rank_run["log"].count("Running training") == 1, "only the main process logs"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    # A second writer would append every record twice.
    assert len(records(two)) == len(records(one))

    # The whole safetensors header holds the names of the model the run started from: nothing wrapped in DDP's
    # `module.`, nothing missing or added, in the final model and in the checkpoints.
    expected = tensor_names(tiny_model_no_dropout / "model.safetensors")
    for path in [two / "model.safetensors", *sorted(two.glob("checkpoint-*/model.safetensors"))]:
        names = tensor_names(path)
        assert not [n for n in names if n.startswith("module.")], path
        assert names == expected, path
        # Readable by whoever may read its folder's config, whichever rank wrote it (safetensors alone: 0600).
        assert path.stat().st_mode == (two / "config.json").stat().st_mode, path
    model, info = AutoModelForSequenceClassification.from_pretrained(two, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.id2label == {0: "negative", 1: "positive"}


def test_best_model_rotation_and_early_stopping_on_two_ranks(two_rank_run):
    """--greater_is_better with --metric_for_best_model loss: the *highest* eval loss is the best (on this data,
    an early one), and three evaluations without a higher one stop the run (patience 3)."""
    out, log = two_rank_run["output_dir"], two_rank_run["log"]
    evaluations = [(r["step"], r["eval_loss"]) for r in records(out) if "eval_loss" in r]
    steps = [step for step, _ in evaluations]
    best_step, best_loss = max(evaluations, key=lambda e: e[1])
    stop = steps[steps.index(best_step) + 3]
    assert steps[-1] == stop and results(out)["global_step"] == stop, f"every rank stopped at once: {evaluations}"
    assert f"Early stopping at step {stop}" in log
    assert best_step < stop, "the final model is not simply the last one"

    # Checkpoints every 2 steps, 2 kept (Trainer's --save_total_limit): the best one, never deleted, and the newest.
    periodic = [s for s in range(2, stop + 1, 2)]
    assert checkpoints(out) == [f"checkpoint-{s}" for s in sorted({best_step, periodic[-1]})]
    assert max_difference(out / "model.safetensors", out / f"checkpoint-{best_step}" / "model.safetensors") == 0.0
    assert results(out)["eval_loss"] == best_loss


def test_resume_on_another_number_of_processes_is_refused(two_rank_run, tmp_path):
    """The data order depends on the number of ranks: a 2-rank checkpoint cannot continue exactly on 1."""
    checkpoint = two_rank_run["output_dir"] / checkpoints(two_rank_run["output_dir"])[-1]
    args = train_args(*two_rank_run["args"], tmp_path / "out", *two_rank_run["flags"])
    with pytest.raises(UserError, match="written by 2 processes and this run has 1; resume with the same number"):
        run_in_process("train", [*args, "--resume_from_checkpoint", str(checkpoint)])
    # Said first also where the run's steps fall short of the checkpoint's: the number of processes is the cause
    # (it changes how many steps an epoch takes), which the count of steps would not name.
    with pytest.raises(UserError, match="written by 2 processes and this run has 1"):
        run_in_process("train", [*args, "--resume_from_checkpoint", str(checkpoint), "--max_train_steps", "1"])
    assert {path.name for path in (tmp_path / "out").iterdir()} == {".lock"}, "nothing written but the folder's lock"


def test_a_folder_in_use_stops_both_ranks_of_a_second_run(two_rank_run, tmp_path):
    """Only rank 0 takes the output folder's lock, but every rank looks whether the folder is in use before its
    first collective: each stops with the reason (or is stopped by the launcher once rank 0 has), none waits in a
    collective for ever; nothing is written. A real 2-rank launch. (Another run that takes the lock after that look
    is refused at rank 0's lock, and rank 1 told by errors_reach_every_rank, as test_errors.py tests.)"""
    out = tmp_path / "out"
    with another_run_holding(out) as holder:
        result = launch("train.py", train_args(*two_rank_run["args"], out, *two_rank_run["flags"]), timeout=180)
    assert result.returncode != 0
    # Whichever rank says it first, the launcher then stops the other: at least one says it.
    said = f"] error: --output_dir {out} is in use by another run (train.py, pid {holder}"
    assert f"[rank 0{said}" in result.stderr or f"[rank 1{said}" in result.stderr, result.stderr[-2000:]
    assert {path.name for path in out.iterdir()} == {".lock"}, "nothing written"


def test_regression_with_dropout_on_two_ranks(two_rank_dropout_run, tiny_model_no_dropout, tmp_path):
    out = two_rank_dropout_run["output_dir"]
    assert results(out)["num_processes"] == 2 and results(out)["eval_samples"] == 21

    # What the 2 ranks gathered is the saved model's regression on every validation row, computed here row by row.
    rows = score_rows(21, seed=2)
    predicted = reference_logits(out, [r["sentence1"] for r in rows], [r["sentence2"] for r in rows]).squeeze(-1)
    scores = torch.tensor([r["score"] for r in rows])
    # The 2 ranks computed each prediction in a padded batch, this row by row: other summation orders, so each may
    # differ by eps, a few float32 roundings (2^-24) of the ~100 terms of each sum, taken as 1e-5 of its size. Then
    # mse moves by at most 2 eps mean|p - s| + eps^2, and Pearson's r, a sum of products of standardised
    # predictions, by at most 2 eps / std(p): near-constant predictions make r ill-conditioned, so the bound is
    # derived from this run's spread rather than fixed (a fixed 1e-4 failed on one CPU and passed on another).
    eps = 1e-5 * max(1.0, predicted.abs().max().item())
    error = (predicted - scores).abs()
    assert results(out)["eval_mse"] == pytest.approx(
        (error**2).mean().item(), abs=2 * eps * error.mean().item() + eps**2
    )
    assert results(out)["eval_pearson"] == pytest.approx(
        pearsonr(scores, predicted).statistic, abs=2 * eps / predicted.std().item()
    )

    # Dropout is on under DDP: the same run without dropout (on 1 rank of 8, which equals 2 of 4 without dropout,
    # as tested above) ends elsewhere. That it is reproducible is tested by test_multinode, which runs it again.
    flags = [*two_rank_dropout_run["flags"], "--per_device_train_batch_size", "8"]
    _, train_file, dev_file = two_rank_dropout_run["args"]
    run_in_process("train", train_args(tiny_model_no_dropout, train_file, dev_file, tmp_path / "no-dropout", *flags))
    assert max_difference(out / "model.safetensors", tmp_path / "no-dropout" / "model.safetensors") > 1e-3


# 45 rows, 3 ranks x 4: the global batches are 12, 12, 12 and a short one of 9. Accelerate (even_batches) gives
# every rank a full batch by repeating the epoch's first 3 rows in that last step; the 1-rank twin trains on 9.
UNEVEN = ["--no-group_by_length", "--logging_steps", "1", "--checkpointing_steps", "3"]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, tiny_model_no_dropout):
    """A real 3-rank DDP group on uneven data, and its 1-rank twin of 12 rows in this process."""
    folder = tmp_path_factory.mktemp("three-ranks")
    train_file = write_rows(folder / "train.csv", sentiment_rows(45, seed=5))
    args = [tiny_model_no_dropout, train_file, write_rows(folder / "dev.csv", sentiment_rows(21, seed=6))]
    result = launch("train.py", train_args(*args, folder / "three", *UNEVEN, "--per_device_train_batch_size", "4"), 3)
    assert result.returncode == 0, result.stderr[-3000:]
    run_in_process("train", train_args(*args, folder / "one", *UNEVEN, "--per_device_train_batch_size", "12"))
    return folder / "three", folder / "one"


def test_three_ranks_with_uneven_shards_and_a_short_last_batch(three_ranks):
    three, one = three_ranks
    assert results(three)["num_processes"] == 3 and results(three)["total_train_batch_size"] == 12
    assert results(three)["global_step"] == results(one)["global_step"] == 8, "4 updates per epoch on both"
    assert results(three)["eval_samples"] == 21
    # Rows trained on: 45 per epoch on 1 rank; 45 and the 3 repeats on 3 ranks.
    for folder, rows in ((one, 2 * 45), (three, 2 * 48)):
        trained = results(folder)["train_samples_per_second"] * results(folder)["train_runtime"]
        assert trained == pytest.approx(rows), folder.name

    losses = {folder.name: {r["step"]: r for r in records(folder) if "loss" in r} for folder in (one, three)}
    assert sorted(losses["three"]) == sorted(losses["one"]) == list(range(1, 9))
    assert [losses["three"][s]["epoch"] for s in (4, 8)] == [1.0, 2.0], "the short batch ends each epoch"
    for step in (1, 2, 3):  # the same 12 rows in each of the first 3 updates, their gradients averaged over 3 ranks
        assert losses["three"][step]["loss"] == pytest.approx(losses["one"][step]["loss"], abs=LOSS_ATOL), step
    worst = max_difference(one / "checkpoint-3" / "model.safetensors", three / "checkpoint-3" / "model.safetensors")
    assert worst < WEIGHTS_ATOL, f"weights differ by up to {worst} before the short batch"


def test_three_ranks_resume_to_the_same_weights(three_ranks, tmp_path):
    """DDP reorders its gradient buckets after a process's first step; a resumed process must sum the 3 ranks'
    gradients in the same order as the uninterrupted run did at that step (with 2 ranks any order sums alike)."""
    three, _ = three_ranks
    args = json.loads((three / "args.json").read_text())
    flags = [*train_args(args["model_name_or_path"], args["train_file"], args["validation_file"], tmp_path, *UNEVEN),
             "--per_device_train_batch_size", "4", "--resume_from_checkpoint", str(three / "checkpoint-3")]  # fmt: skip
    result = launch("train.py", flags, 3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_difference(three / "model.safetensors", tmp_path / "model.safetensors") == 0
    assert results(tmp_path)["train_loss"] == results(three)["train_loss"]


@pytest.fixture(scope="module")
def single_process_evaluation(trained_tiny_model, tmp_path_factory):
    """A real `accelerate launch` of 1 process (the launcher's single-process path), the reference for the others."""
    folder = tmp_path_factory.mktemp("single")
    data = write_rows(folder / "eval.csv", sentiment_rows(37, seed=5))
    args = ["--model_name_or_path", str(trained_tiny_model), "--validation_file", str(data),
            "--output_dir", str(folder), "--per_device_eval_batch_size", "8"]  # fmt: skip
    result = launch("evaluate.py", args, num_processes=1)
    assert result.returncode == 0, result.stderr[-2000:]
    return data, folder


@pytest.mark.parametrize("launcher,num_processes,batch_size", [("torchrun", 2, 4), ("accelerate --multi_gpu", 3, 5)])
def test_each_launcher_forms_one_group_that_counts_every_example_once(
    trained_tiny_model, single_process_evaluation, tmp_path, launcher, num_processes, batch_size
):
    """On a machine without GPUs these launchers would start N unrelated single-process runs without cpu=True.
    37 rows do not split evenly over 2 or 3 ranks: the padded repeats must not be counted, and rows come back in
    order, so the files equal those of 1 process."""
    data, single_dir = single_process_evaluation
    script_args = [str(REPO / "evaluate.py"), "--model_name_or_path", str(trained_tiny_model),
                   "--validation_file", str(data), "--output_dir", str(tmp_path),
                   "--per_device_eval_batch_size", str(batch_size)]  # fmt: skip
    port, n = free_port(), str(num_processes)
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", n, "--master_port", port]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", n,
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", port]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_process([*command, *script_args], 300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(f"with {n} process(es)") == 1, "one group of ranks, logging once"
    for name in ("eval_results.json", "predictions.csv"):
        assert (single_dir / name).read_text() == (tmp_path / name).read_text(), name
    assert json.loads((tmp_path / "eval_results.json").read_text())["eval_samples"] == 37
    rows = (tmp_path / "predictions.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(37))
