"""Checkpoints: rotation, best model, saves cut short, refusals. Interrupted runs: test_preemption.py.

Best model, rotation and early stopping on 2 ranks: test_distributed.py (the shared 2-rank run).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_script, sentiment_files, train_args
from safetensors.torch import load_file

train = load_script("train")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return sentiment_files(folder, 64, 20)


def run_main(*argv):
    return train.main(train.parse_train_args(list(argv)))


def logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_files(out) -> dict:
    """The run's files and when each was last written; not the lock file, which the next run into the folder takes."""
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("limit", [1, 3, 9])  # 9: more than the run saves, so none goes
def test_rotation_keeps_the_newest_and_the_best(tiny_model, data, tmp_path, limit):
    """Trainer's rule: --save_total_limit checkpoints in all, the best and the newest (to resume from) among them, so
    a limit of 1 keeps those two."""
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "1",
                         "--eval_steps", "2", "--save_total_limit", str(limit), "--metric_for_best_model", "loss",
                         "--load_best_model_at_end"))  # fmt: skip
    evaluations = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    best = min(evaluations, key=lambda r: r["eval_loss"])
    assert best["step"] < 7, "this data makes an early evaluation the best"
    newest = [f"checkpoint-{step}" for step in range(9 - max(1, limit - 1), 9)]  # and the best
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{best['step']}", *newest})
    kept = load_file(out / f"checkpoint-{best['step']}" / "model.safetensors")
    final = load_file(out / "model.safetensors")
    assert all((kept[k] == final[k]).all() for k in final), "the final model is the best one"
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == best["eval_loss"]
    assert "examples), of the best model by loss:" in (out / "README.md").read_text(), "the card says which results"


def test_the_refusal_to_train_over_a_run_offers_a_resume_only_where_a_checkpoint_is(tmp_path):
    """A finished run that kept no checkpoint cannot be continued: following the hint would fail next."""
    from src.checkpoint import check_output_dir

    def refusal(folder):
        with pytest.raises(train.UserError) as refused:
            check_output_dir(folder, overwrite=False, resume_from=None)
        return str(refused.value)

    folder = tmp_path
    (folder / "all_results.json").write_text("{}")
    assert "--resume_from_checkpoint" not in refusal(folder) and "--overwrite_output_dir" in refusal(folder)
    (folder / "checkpoint-4").mkdir()
    (folder / "checkpoint-4" / "training_state.json").write_text("{}")
    assert "--resume_from_checkpoint latest to continue it" in refusal(folder)


def test_refuses_to_train_over_a_finished_run(tiny_model, data, tmp_path, monkeypatch, caplog, capsys):
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "epoch"))
    (checkpoint,) = out.glob("checkpoint-*")  # its weights readable by whoever may resume (safetensors alone: 0600)
    assert (checkpoint / "model.safetensors").stat().st_mode == (checkpoint / "training_state.json").stat().st_mode
    before = run_files(out)
    with pytest.raises(train.UserError, match="--overwrite_output_dir.*|--resume_from_checkpoint latest"):
        run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1"))
    assert before == run_files(out), "nothing touched"

    # A tracker that cannot start (wandb without an API key, say) stops the run before the old one is removed.
    def refuse(self, project, config, init_kwargs):
        assert init_kwargs == {"wandb": {"name": "out"}}  # W&B's run named after the folder, as Trainer names it
        raise RuntimeError("tracker refused to start")

    with monkeypatch.context() as patch:
        patch.setattr(train.Accelerator, "init_trackers", refuse)
        with pytest.raises(RuntimeError, match="tracker refused"):
            run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--overwrite_output_dir"))
    assert before == run_files(out), "nothing touched"
    # The old run's files go too: a LoRA run's adapter_config.json left beside a whole model would make evaluate.py,
    # from_pretrained and the card read the folder as that adapter; a chat template would change the tokenizer.
    (out / "adapter_config.json").write_text("{}")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("logs")
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--overwrite_output_dir"))
    assert not list(out.glob("checkpoint-*")), "the old run's checkpoints went with it"
    assert not (out / "adapter_config.json").exists() and not (out / "chat_template.jinja").exists()
    assert (out / "tensorboard" / "events").is_file(), "its TensorBoard logs stay"
    assert "library_name: transformers" in (out / "README.md").read_text()
    # Overwritten by a run that stops before its end: the old run's results (its mark of being done) go too, and its
    # model, which the stopped run has not replaced. What this run reads stays: its data and --config kept there.
    kept_data = [shutil.copy(file, out / f"kept_{file.name}") for file in data]
    (out / "run.yaml").write_text("max_time: 1.0e-9\n")
    with pytest.raises(SystemExit), caplog.at_level("INFO"):
        run_main(*train_args(tiny_model, *kept_data, out, "--overwrite_output_dir", "--config", str(out / "run.yaml")))
    assert "run the same command without --overwrite_output_dir, with --resume_from_checkpoint latest" in caplog.text
    assert "Saved checkpoint" in caplog.text and "Optimizer state saved" not in caplog.text, "not accelerate's per file"
    assert not (out / "all_results.json").exists() and not (out / "README.md").exists()
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert all(Path(file).is_file() for file in kept_data) and (out / "run.yaml").is_file()
    # A folder that holds no run (no args.json) is not emptied, nor may a run write over the model it starts from.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        run_main(*train_args(tiny_model, *data, mine, "--overwrite_output_dir", "--max_time", "1e-9"))
    assert (mine / "config.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        train.parse_train_args(train_args(tiny_model, *data, tiny_model, "--overwrite_output_dir"))
    assert "is --model_name_or_path's folder: the run would write over what it starts from" in capsys.readouterr().err


def test_broken_checkpoints_get_a_clear_error(tiny_model, data, tmp_path):
    with pytest.raises(
        train.UserError,
        match="--resume_from_checkpoint latest: no complete checkpoint in .* yet; to start the run, drop --resume_from",
    ):
        run_main(*train_args(tiny_model, *data, tmp_path / "new", "--resume_from_checkpoint", "latest"))
    finished = tmp_path / "finished"  # without checkpoints: the next step is a new run from its model
    results = run_main(*train_args(tiny_model, *data, finished, "--max_train_steps", "1"))
    # Its card's epochs are those trained, as all_results.json's (and Trainer's) `epoch`: 1 step of 8.
    assert results["epoch"] == 1 / 8 and "| epochs | 0.125 |" in (finished / "README.md").read_text()
    with pytest.raises(train.UserError, match=f"finished run that kept no checkpoint.*--model_name_or_path {finished}"):
        run_main(*train_args(tiny_model, *data, finished, "--resume_from_checkpoint", "latest"))
    out = tmp_path / "out"
    run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "4"))
    args = train_args(tiny_model, *data, out, "--num_train_epochs", "1")
    with pytest.raises(train.UserError, match="no such folder$"):
        run_main(*args, "--resume_from_checkpoint", str(tmp_path / "missing"))
    with pytest.raises(train.UserError, match=r"True: no such folder \(Trainer's True is 'latest' here"):
        run_main(*args, "--resume_from_checkpoint", "True")
    incomplete = out / "checkpoint-4"
    state = (incomplete / "training_state.json").read_text()
    (incomplete / "training_state.json").unlink()
    with pytest.raises(train.UserError, match="not a complete checkpoint"):
        run_main(*args, "--resume_from_checkpoint", str(incomplete))
    (incomplete / "training_state.json").write_text(state[: len(state) // 2])  # cut short
    with pytest.raises(train.UserError, match="training_state.json is unreadable or incomplete"):
        run_main(*args, "--resume_from_checkpoint", str(incomplete))
    (incomplete / "training_state.json").write_text(state)
    (incomplete / "model.safetensors").write_bytes(b"\0" * 100)
    # Damaged, or a model or optimizer of another shape: a flag of one's own that shapes them, not in SAME_ON_RESUME.
    with pytest.raises(train.UserError, match="checkpoint-4 cannot be loaded.*damaged.*SAME_ON_RESUME.*there is none"):
        run_main(*args, "--resume_from_checkpoint", str(incomplete))
    # 'latest' would pick the damaged one again: the error names the one before it.
    (out / "checkpoint-8" / "model.safetensors").write_bytes(b"\0" * 100)
    earlier = f"damaged.*: use an earlier checkpoint \\(--resume_from_checkpoint {out / 'checkpoint-4'}\\)"
    with pytest.raises(train.UserError, match=earlier):
        run_main(*args, "--resume_from_checkpoint", "latest")


def test_a_save_cut_short_is_ignored_and_replaced_by_the_next_one(tiny_model, data, tmp_path):
    """A kill while saving checkpoint-8 leaves checkpoint-8.incomplete, here with its state file and junk in it:
    'latest' resumes from checkpoint-4, and the resumed run's own save at step 8 replaces the leftover."""
    out = tmp_path / "out"
    args = train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "4")
    run_main(*args)
    reference = {k: v.clone() for k, v in load_file(out / "checkpoint-8" / "model.safetensors").items()}  # not mmap
    logged = logged_steps(out)
    leftover = out / "checkpoint-8.incomplete"
    (out / "checkpoint-8").rename(leftover)
    (leftover / "model.safetensors").write_bytes(b"\0" * 100)
    (leftover / "junk.bin").write_bytes(b"junk")
    (out / "all_results.json").unlink()  # the killed run never got to its end
    from src.checkpoint import resolve_checkpoint

    assert resolve_checkpoint("latest", out).name == "checkpoint-4"
    with pytest.raises(train.UserError, match="checkpoint-8.incomplete: a save that was cut short; use an earlier"):
        resolve_checkpoint(str(leftover), out)  # named by hand: never resumed from (it would then be removed)
    run_main(*args, "--resume_from_checkpoint", "latest")
    assert not leftover.exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert not (out / "checkpoint-8" / "junk.bin").exists()
    saved = load_file(out / "checkpoint-8" / "model.safetensors")
    assert all(torch.equal(saved[k], reference[k]) for k in reference), "steps 5-8 again, to the same weights"
    assert logged_steps(out) == logged, "the records of steps 5-8 replaced, not doubled"
    # Resumed from an earlier checkpoint, the run goes on from there afresh: the later checkpoint is of the
    # continuation it replaces, and would be 'latest' and outrank the new ones in the rotation.
    run_main(*args, "--resume_from_checkpoint", str(out / "checkpoint-4"), "--max_train_steps", "6")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert resolve_checkpoint("latest", out).name == "checkpoint-4"
    assert logged_steps(out) == [6, 6], "the replaced continuation's records went too: step 6's log and evaluation"


def test_diverging_loss_stops_with_the_step(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(train.UserError, match=r"NaN or infinite by step \d+"):
        run_main(*train_args(tiny_model, *data, out, "--learning_rate", "1e30", "--max_grad_norm", "0"))


def test_resuming_a_finished_run_only_evaluates(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    first = run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--checkpointing_steps", "epoch"))
    # What the end of the run and evaluate.py wrote goes as the resume starts (the run writes its own as it ends): left,
    # an adapter_config.json from a --use_peft end, resumed with --merge_lora, made the merged model read as that
    # adapter, and evaluate.py's files would describe a model that is gone.
    stale = ["adapter_config.json", "eval_results.json", "predictions.csv", "confusion_matrix.png"]
    for name in stale:
        (out / name).write_text("{}")
    (out / "notes.md").write_text("mine")  # the user's, and a job's log appended to: they stay
    (out / "train.log").write_text("started\n")
    logged = logged_steps(out)
    again = run_main(
        *train_args(tiny_model, *data, out, "--num_train_epochs", "1", "--resume_from_checkpoint", "latest")
    )
    assert again["global_step"] == first["global_step"] and again["eval_accuracy"] == first["eval_accuracy"]
    assert not any((out / name).exists() for name in stale) and (out / "model.safetensors").is_file()
    assert (out / "notes.md").read_text() == "mine" and (out / "train.log").is_file()
    assert logged_steps(out)[: len(logged)] == logged, "the run's records, which the resume continues, are kept"
    # Resumed for fewer steps than its checkpoint's, it would end at once with the checkpoint as its final model.
    shorter = ["--max_train_steps", str(first["global_step"] - 1), "--resume_from_checkpoint", "latest"]
    with pytest.raises(train.UserError, match=f"at step {first['global_step']}, past this run's"):
        run_main(*train_args(tiny_model, *data, out, *shorter))
    # Resumed for longer and stopped, the run is no longer finished: evaluate.py refuses the folder (no results).
    with pytest.raises(SystemExit):
        run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "2", "--resume_from_checkpoint", "latest",
                             "--max_time", "1e-9"))  # fmt: skip
    assert not (out / "all_results.json").exists() and not (out / "README.md").exists()


def test_patience_that_runs_out_on_a_timed_out_step_ends_the_run_as_without_the_stop(tiny_model, data, tmp_path):
    """The validation loss of this data rises from step 1, so nothing beats step 1: patience 2 runs out at step 3,
    which ends the run. --max_time 1e-9 stops every step; resumed step by step, the run must end at that same step
    with the same model (the stop at step 3 must not leave a checkpoint to continue from past the early stop)."""
    flags = ["--eval_steps", "1", "--early_stopping_patience", "2", "--metric_for_best_model", "loss",
             "--load_best_model_at_end", "--max_train_steps", "8"]  # fmt: skip
    whole = run_main(*train_args(tiny_model, *data, tmp_path / "whole", *flags))
    assert whole["global_step"] == 3
    timed = [*train_args(tiny_model, *data, tmp_path / "timed", *flags, "--max_time", "1e-9")]
    for _ in range(2):  # steps 1 and 2, each stopped by the clock
        with pytest.raises(SystemExit):
            run_main(*timed, *(["--resume_from_checkpoint", "latest"] if (tmp_path / "timed").exists() else []))
    resumed = run_main(*timed, "--resume_from_checkpoint", "latest")  # step 3: patience and the clock run out together
    assert resumed["global_step"] == 3 and resumed["eval_loss"] == whole["eval_loss"]
    final, expected = (
        load_file(tmp_path / "timed" / "model.safetensors"),
        load_file(tmp_path / "whole" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_patience_counts_the_evaluations_since_the_last_strict_improvement(tiny_model, data, tmp_path, monkeypatch):
    """Accuracies scripted per evaluation: 0.5, 0.4, 0.6 (better: the count starts again), 0.6 (a tie is no better),
    0.5: the second evaluation in a row without a better one, at step 5, ends the run with patience 2. The best model is
    step 3's, the first to reach 0.6."""
    scores, evaluate = iter([0.5, 0.4, 0.6, 0.6, 0.5, 0.4, 0.3, 0.2]), train.evaluate

    def scripted(*args):
        metrics, outputs = evaluate(*args)
        return {**metrics, "eval_accuracy": next(scores)}, outputs

    monkeypatch.setattr(train, "evaluate", scripted)
    out = tmp_path / "out"
    results = run_main(*train_args(tiny_model, *data, out, "--eval_steps", "1", "--early_stopping_patience", "2",
                                   "--load_best_model_at_end", "--max_train_steps", "8"))  # fmt: skip
    assert results["global_step"] == 5 and results["eval_accuracy"] == 0.6
    best, final = load_file(out / "checkpoint-3" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(best[k], final[k]) for k in final), "the first of the tied evaluations is the best"


def test_a_resume_in_a_later_epoch_continues_that_epochs_shuffle(tiny_model, data, tmp_path, monkeypatch):
    """64 rows in batches of 16, 3 epochs: each epoch deals the rows in an order of its own (the sampler's epoch),
    and a run resumed from checkpoint-6 (step 2 of epoch 1) trains on the batches the whole run trained on after it,
    into epoch 2, to the same weights."""
    batches, build = [], train.build_train_dataloader

    def recording(dataset, collator, *args, **kwargs):
        def collate(rows):
            batches.append([tuple(row["input_ids"]) for row in rows])
            return collator(rows)

        return build(dataset, collate, *args, **kwargs)

    monkeypatch.setattr(train, "build_train_dataloader", recording)
    flags = ["--per_device_train_batch_size", "16", "--num_train_epochs", "3", "--checkpointing_steps", "6"]
    run_main(*train_args(tiny_model, *data, tmp_path / "whole", *flags))
    whole = batches[:]
    assert len(whole) == 12
    epochs = [whole[i : i + 4] for i in (0, 4, 8)]
    assert sorted(sum(epochs[0], [])) == sorted(sum(epochs[1], [])) and epochs[0] != epochs[1] != epochs[2]
    batches.clear()
    resumed = tmp_path / "resumed"
    run_main(*train_args(tiny_model, *data, resumed, *flags, "--resume_from_checkpoint",
                         str(tmp_path / "whole" / "checkpoint-6")))  # fmt: skip
    assert batches == whole[6:], "the same batches, in the same order, from the same place in epoch 1"
    first, second = load_file(tmp_path / "whole" / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_the_best_model_is_found_beside_the_checkpoint_resumed_from(tiny_model, data, tmp_path):
    """A job requeued with its output copied elsewhere (or started from another directory) resumes from the new
    folder, and a run may resume another folder's checkpoint into its own --output_dir: the best checkpoint so far is
    the one of that name beside the checkpoint resumed from."""
    flags = ["--eval_steps", "1", "--metric_for_best_model", "loss", "--load_best_model_at_end", "--max_train_steps",
             "3"]  # fmt: skip
    with pytest.raises(SystemExit):  # stopped by the clock after step 1, its best so far
        run_main(*train_args(tiny_model, *data, tmp_path / "old", *flags, "--max_time", "1e-9"))
    (tmp_path / "old").rename(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "copy")
    resumed = run_main(*train_args(tiny_model, *data, tmp_path / "new", *flags, "--resume_from_checkpoint", "latest"))
    whole = run_main(*train_args(tiny_model, *data, tmp_path / "whole", *flags))
    assert resumed["eval_loss"] == whole["eval_loss"]
    elsewhere = [*flags, "--resume_from_checkpoint", str(tmp_path / "copy" / "checkpoint-1")]
    before = run_files(tmp_path / "whole")
    with pytest.raises(train.UserError, match="already holds a run .* is another folder's checkpoint"):
        run_main(*train_args(tiny_model, *data, tmp_path / "whole", *elsewhere))  # a finished run, not overwritten
    assert run_files(tmp_path / "whole") == before
    assert run_main(*train_args(tiny_model, *data, tmp_path / "other", *elsewhere))["eval_loss"] == whole["eval_loss"]
    # A best checkpoint still where it was recorded (another run's folder, after a chain of resumes) is used there;
    # one neither there nor beside the checkpoint resumed from is found out before training, not after it.
    (tmp_path / "copy" / "checkpoint-1").rename(tmp_path / "copy" / "checkpoint-one")
    shutil.copytree(tmp_path / "new" / "checkpoint-1", tmp_path / "old" / "checkpoint-1")
    latest = [*flags, "--resume_from_checkpoint", str(tmp_path / "copy" / "checkpoint-one")]
    assert run_main(*train_args(tiny_model, *data, tmp_path / "chain", *latest))["eval_loss"] == whole["eval_loss"]
    shutil.rmtree(tmp_path / "old")
    with pytest.raises(train.UserError, match=r"best checkpoint so far, .*old/checkpoint-1, is gone, and not beside"):
        run_main(*train_args(tiny_model, *data, tmp_path / "fresh", *latest))


def test_a_second_run_into_a_folder_in_use_is_refused_until_the_first_ends(tiny_model, data, tmp_path):
    """Two runs started into one folder (a duplicate job, or a requeued one while the old ranks still save) would
    mix their checkpoints, args.json and model; the second is refused before it writes anything, and once the first
    process has ended, however it ended, the folder is free."""
    import subprocess
    import sys

    from conftest import REPO, another_run_holding

    out = tmp_path / "out"
    with another_run_holding(out):
        with pytest.raises(train.UserError, match=rf"--output_dir {out} is in use by another run \(train.py, pid "):
            run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1"))
        assert {p.name for p in out.iterdir()} == {".lock"}, "nothing written"
        # With the first run's checkpoint there, it is still the folder in use that is said, not a resume to try.
        (out / "checkpoint-2").mkdir()
        (out / "checkpoint-2" / "training_state.json").write_text("{}")
        for resume in ([], ["--resume_from_checkpoint", "latest"]):
            with pytest.raises(train.UserError, match=rf"--output_dir {out} is in use by another run \(train.py, pid "):
                run_main(*train_args(tiny_model, *data, out, "--num_train_epochs", "1", *resume))
        shutil.rmtree(out / "checkpoint-2")
    # A run that ends, also with an error, lets go of the folder in a process that goes on (a notebook's kernel, whose
    # last traceback keeps the run's objects alive, its DataLoader's workers too): another process may resume.
    diverging = ["--learning_rate", "1e30", "--max_grad_norm", "0", "--dataloader_num_workers", "1"]
    with pytest.raises(train.UserError, match="NaN or infinite") as failed:
        run_main(*train_args(tiny_model, *data, out, *diverging))
    lock = f"from src.checkpoint import _lock; assert _lock({str(out)!r}, False)"
    again = subprocess.run([sys.executable, "-c", lock], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-500:]
    assert failed.traceback, "the failed run's frames were still alive"


def test_a_run_over_an_earlier_one_keeps_the_folder_locked(tiny_model, data, tmp_path, monkeypatch):
    """--overwrite_output_dir removes the earlier run's files, but not the lock this run holds: deleted, it would let a
    second run create a lock file of its own there and write into the folder alongside this one."""
    from src.checkpoint import _in_use_by

    out = tmp_path / "out"
    out.mkdir()
    (out / "args.json").write_text("{}")  # an earlier run's folder
    holders, train_loop = [], train.train_loop

    def recording_loop(run):
        holders.append(_in_use_by(out))
        return train_loop(run)

    monkeypatch.setattr(train, "train_loop", recording_loop)
    run_main(*train_args(tiny_model, *data, out, "--max_train_steps", "1", "--overwrite_output_dir"))
    assert holders[0] and holders[0].startswith("train.py, pid"), "the folder is still held while the run trains"


def test_the_folder_is_free_once_the_run_ends_though_its_forked_workers_live_on(tmp_path):
    """Collating workers forked while the run held the folder share its open lock file: closing it in the run would
    not let go of the lock while a worker lives on (a notebook's kernel keeping a failed run's DataLoader)."""
    import argparse
    import multiprocessing
    import subprocess
    import sys

    from conftest import REPO

    from src.checkpoint import holding_output_dir

    accelerator = argparse.Namespace(num_processes=1, is_main_process=True, is_local_main_process=True)
    out = tmp_path / "out"
    with holding_output_dir(accelerator, out):
        worker = multiprocessing.get_context("fork").Process(target=__import__("time").sleep, args=(60,))
        worker.start()
    try:
        probe = f"from src.checkpoint import _in_use_by; print(_in_use_by({str(out)!r}))"
        holder = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
        assert holder.stdout == "None\n", holder.stdout + holder.stderr[-500:]
    finally:
        worker.kill()
        worker.join()
