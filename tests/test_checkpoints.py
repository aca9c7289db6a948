"""Checkpoints: rotation, best model, early stopping, refusals. Interrupted runs are in test_preemption.py."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, launch_command, load_script, sentiment_rows, train_args, write_rows
from safetensors.torch import load_file

train = load_script("train")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return write_rows(folder / "train.csv", sentiment_rows(64, seed=1)), write_rows(
        folder / "dev.csv", sentiment_rows(20, seed=2)
    )


def run(num_processes, args):
    command = [sys.executable, str(REPO / "train.py")] if num_processes == 1 else launch_command("train.py", [], 2)
    result = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_main(*argv):
    return train.main(train.parse_train_args(list(argv)))


def test_rotation_keeps_the_newest_and_the_best(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "1",
                         "--eval_steps", "2", "--save_total_limit", "2", "--metric_for_best_model", "loss",
                         "--load_best_model_at_end"))  # fmt: skip
    evaluations = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    best = min(evaluations, key=lambda r: r["eval_loss"])
    assert best["step"] < 7, "this data makes an early evaluation the best"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{best['step']}", "checkpoint-7",
                                                                       "checkpoint-8"})  # fmt: skip
    kept = load_file(out / f"checkpoint-{best['step']}" / "model.safetensors")
    final = load_file(out / "model.safetensors")
    assert all((kept[k] == final[k]).all() for k in final), "the final model is the best one"
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == best["eval_loss"]


def test_early_stopping_stops_every_rank_at_the_same_step(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    # A learning rate this small changes no prediction: the second evaluation is no better than the first.
    result = run(2, train_args(tiny_model, *data, out, "--learning_rate", "1e-12", "--eval_steps", "2",
                               "--early_stopping_patience", "1", "--metric_for_best_model", "accuracy"))  # fmt: skip
    assert json.loads((out / "all_results.json").read_text())["global_step"] == 4
    assert "Early stopping at step 4" in result.stdout + result.stderr


def test_refuses_to_train_over_a_finished_run(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "epoch"))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(train.UserError, match="--overwrite_output_dir.*|--resume_from_checkpoint latest"):
        run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1"))
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}, "nothing touched"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--overwrite_output_dir"))
    assert not list(out.glob("checkpoint-*")), "the old run's checkpoints went with it"


def test_broken_checkpoints_get_a_clear_error(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "4"))
    args = train_args(tiny_model, *data, out, "--num_train_epochs", "1")
    with pytest.raises(train.UserError, match="no such folder"):
        run_main(*args, "--resume_from_checkpoint", str(tmp_path / "missing"))
    incomplete = out / "checkpoint-4"
    (incomplete / "training_state.json").rename(tmp_path / "state.json")
    with pytest.raises(train.UserError, match="not a complete checkpoint"):
        run_main(*args, "--resume_from_checkpoint", str(incomplete))
    (tmp_path / "state.json").rename(incomplete / "training_state.json")
    (incomplete / "model.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(train.UserError, match="checkpoint-4 cannot be loaded.*damaged"):
        run_main(*args, "--resume_from_checkpoint", str(incomplete))


def test_partial_save_is_not_a_checkpoint(tiny_model, data, tmp_path):
    """A folder left by a kill during saving is ignored by 'latest' and replaced by the next save."""
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "4"))
    (out / "checkpoint-6.incomplete").mkdir()
    from src.checkpoint import resolve_checkpoint

    assert resolve_checkpoint("latest", out).name == "checkpoint-8"


def test_diverging_loss_stops_with_the_step(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(train.UserError, match=r"NaN or infinite by step \d+"):
        run_main(*train_args(tiny_model, *data, out, "--learning_rate", "1e30", "--max_grad_norm", "0"))


def test_resuming_a_finished_run_only_evaluates(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    first = run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "epoch"))
    again = run_main(
        *train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--resume_from_checkpoint", "latest")
    )
    assert again["global_step"] == first["global_step"] and again["eval_accuracy"] == first["eval_accuracy"]
