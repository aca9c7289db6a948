"""Training flags whose effect can be measured: accumulation, precision, steps and schedule, weight decay, subsets.

All in this process on the tiny BERT without dropout (so that runs can be compared weight for weight).
"""

import argparse
import json
import math

import pytest
import torch
from conftest import WEIGHTS_ATOL, load_script, run_in_process, train_args
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

train = load_script("train")


def results(folder) -> dict:
    return json.loads((folder / "all_results.json").read_text())


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def max_difference(a, b) -> float:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max((first[k] - second[k]).abs().max().item() for k in first)


def test_gradient_accumulation_equals_the_larger_batch(tiny_model_no_dropout, tiny_data, tmp_path):
    """4 rows accumulated twice update the model as 8 rows at once, with the default length grouping. 60 rows: each
    epoch ends with an update of 4 rows, one batch where 2 are accumulated."""
    sixty = ["--max_train_samples", "60"]
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, tmp_path / "eight", *sixty))
    accumulate = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", *sixty]
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, tmp_path / "four-twice", *accumulate))
    eight, accumulated = results(tmp_path / "eight"), results(tmp_path / "four-twice")
    assert accumulated["total_train_batch_size"] == eight["total_train_batch_size"] == 8
    assert accumulated["global_step"] == eight["global_step"] == 16, "steps count updates, not batches"
    worst = max_difference(tmp_path / "eight", tmp_path / "four-twice")
    assert worst < WEIGHTS_ATOL, f"weights differ by up to {worst}"  # sums in another order


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant_with_warmup"])
def test_max_train_steps_and_the_learning_rate_schedule(tiny_model_no_dropout, tiny_data, tmp_path, schedule):
    """--max_train_steps 10 overrides the 5 epochs (8 steps each); 20% of the steps warm up; the scheduler moves once
    per update, and metrics.jsonl logs the rate each step trained with."""
    out = tmp_path / "out"
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, out, "--num_train_epochs", "5",
                                       "--max_train_steps", "10", "--warmup_ratio", "0.2", "--lr_scheduler_type",
                                       schedule, "--logging_steps", "1"))  # fmt: skip
    assert results(out)["global_step"] == 10
    logged = [r for r in records(out) if "learning_rate" in r]
    assert [r["step"] for r in logged] == list(range(1, 11)) and logged[-1]["epoch"] == 1.25
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [8, 10], "each epoch's end and the last step"

    peak, warmup, total = 1e-3, 2, 10

    def rate(step):
        if step < warmup:
            return peak * step / warmup
        progress = (step - warmup) / (total - warmup)
        return {"linear": peak * (1 - progress), "cosine": peak * 0.5 * (1 + math.cos(math.pi * progress)),
                "constant_with_warmup": peak}[schedule]  # fmt: skip

    assert [r["learning_rate"] for r in logged] == pytest.approx([rate(s) for s in range(1, 11)], abs=1e-12)


def test_the_schedules_own_arguments(capsys):
    """--lr_scheduler_kwargs reaches the schedule (cosine_with_restarts' cycles: without them it is plain cosine); a
    keyword it does not take, one for a constant schedule, or text that is not a JSON object is one line."""

    def rates(*flags, steps=8):
        args = train.parse_train_args(
            ["--lr_scheduler_type", "cosine_with_restarts", "--num_warmup_steps", "0", *flags]
        )
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = train.build_scheduler(optimizer, args, steps)
        return [scheduler.get_last_lr()[0] for _ in range(steps) if not optimizer.step() and not scheduler.step()]

    cycle = [0.5 * (1 + math.cos(math.pi * step / 4)) for step in range(1, 4)]
    assert rates("--lr_scheduler_kwargs", '{"num_cycles": 2}') == pytest.approx([*cycle, 1.0, *cycle, 0.0])
    assert rates()[3] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8))), "one cycle by default"
    with pytest.raises(train.UserError, match=r"--lr_scheduler_kwargs \{\"cycles\": 2\}: .*unexpected keyword"):
        rates("--lr_scheduler_kwargs", '{"cycles": 2}')
    # A value the schedule cannot use is found before training, not at the end of the warmup.
    with pytest.raises(train.UserError, match=r"--lr_scheduler_kwargs \{\"num_cycles\": \"x\"\}: could not convert"):
        rates("--lr_scheduler_kwargs", '{"num_cycles": "x"}', "--num_warmup_steps", "2")
    with pytest.raises(train.UserError, match=r"--lr_scheduler_kwargs \{\"lr_end\": 2.0\}: lr_end \(2.0\) must be"):
        rates("--lr_scheduler_kwargs", '{"lr_end": 2.0}', "--lr_scheduler_type", "polynomial")
    # --warmup_ratio's share of the steps is rounded up, as Trainer's: 25% of 10 steps warm up for 3.
    args = train.parse_train_args(["--lr_scheduler_type", "linear", "--warmup_ratio", "0.25"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    (rate_at,) = train.build_scheduler(optimizer, args, 10).lr_lambdas
    assert [rate_at(step) for step in (2, 3)] == pytest.approx([2 / 3, 1.0])
    with pytest.raises(train.UserError, match="--lr_scheduler_type constant takes no --lr_scheduler_kwargs"):
        rates("--lr_scheduler_kwargs", '{"num_cycles": 2}', "--lr_scheduler_type", "constant")
    # A schedule of transformers' added to SCHEDULERS (src/args.py) whose own arguments are missing: one line too.
    wsd = argparse.Namespace(**{**vars(args), "lr_scheduler_type": "warmup_stable_decay"})
    with pytest.raises(train.UserError, match="type warmup_stable_decay: .*num_decay_steps.* go in --lr_scheduler_kw"):
        train.build_scheduler(optimizer, wsd, 10)
    with pytest.raises(SystemExit):
        rates("--lr_scheduler_kwargs", "num_cycles=2")
    assert "--lr_scheduler_kwargs: must be a JSON object" in capsys.readouterr().err


def test_the_schedule_waits_out_an_update_the_gradient_scaler_skipped(tiny_model_no_dropout, tiny_data, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """fp16's gradient scaler skips the update of a step whose gradients overflowed: the learning rate moves on only
    with real updates. No GPU here: the optimizer reports its 2nd step skipped."""
    from accelerate.optimizer import AcceleratedOptimizer

    steps, step = [], AcceleratedOptimizer.step
    monkeypatch.setattr(AcceleratedOptimizer, "step", lambda self, *args: steps.append(1) or step(self, *args))
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: len(steps) == 2))
    out = tmp_path / "out"
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, out, "--max_train_steps", "4",
                                       "--num_warmup_steps", "0", "--lr_scheduler_type", "linear",
                                       "--logging_steps", "1"))  # fmt: skip
    logged = [r["learning_rate"] for r in records(out) if "learning_rate" in r]
    assert logged == pytest.approx([1e-3 * 3 / 4, 1e-3 * 3 / 4, 1e-3 * 2 / 4, 1e-3 * 1 / 4], abs=1e-12)


def test_a_warmup_as_long_as_the_run_is_refused_before_anything_is_written(tiny_model_no_dropout, tiny_data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(train.UserError, match="--num_warmup_steps 10 is not less than the run's 10 optimizer steps"):
        run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, out, "--max_train_steps", "10",
                                           "--num_warmup_steps", "10"))  # fmt: skip
    assert not out.exists()


def test_weight_decay_spares_biases_and_layer_norms(tiny_model_no_dropout):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_no_dropout)
    optimizer = train.build_optimizer(model, argparse.Namespace(weight_decay=0.1), torch.device("cpu"), 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, spared = ([names[id(p)] for p in group["params"]] for group in optimizer.param_groups)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert sorted(decayed + spared) == sorted(names.values()), "every parameter in one group"
    assert spared and all(n.endswith("bias") or "LayerNorm" in n for n in spared)
    assert "bert.embeddings.word_embeddings.weight" in decayed and "classifier.weight" in decayed

    # With no gradient, one step only decays: decayed weights shrink by lr x decay, the spared ones stay.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in spared)
    assert all(torch.allclose(after[n], before[n] * (1 - 0.01 * 0.1)) for n in decayed)


def test_subsets_and_length_grouping(tiny_model_no_dropout, tiny_data, tmp_path):
    """--max_train_samples and --max_eval_samples take the first rows; --no-group_by_length batches them at random,
    which pads more than batches of similar length."""
    subset = ["--max_train_samples", "40", "--max_eval_samples", "7"]
    for name, grouping in (("grouped", []), ("random", ["--no-group_by_length"])):
        run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, tmp_path / name, *subset, *grouping))
        assert results(tmp_path / name)["eval_samples"] == 7
        trained = results(tmp_path / name)["train_samples_per_second"] * results(tmp_path / name)["train_runtime"]
        assert trained == pytest.approx(2 * 40)
    assert json.loads((tmp_path / "random" / "args.json").read_text())["group_by_length"] is False
    grouped, random = (results(tmp_path / name)["train_padding_fraction"] for name in ("grouped", "random"))
    assert grouped < random


def test_an_uneven_accumulation_and_steps_beyond_the_epochs(tiny_model_no_dropout, tiny_data, tmp_path):
    """8 batches an epoch accumulated 3 at a time are 3 updates (the last of 2 batches), not 2: one epoch trains every
    batch. --max_train_steps beyond --num_train_epochs' steps goes on into further epochs."""
    uneven = tmp_path / "uneven"
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, uneven, "--num_train_epochs", "1",
                                       "--gradient_accumulation_steps", "3"))  # fmt: skip
    assert (results(uneven)["global_step"], results(uneven)["epoch"]) == (3, 1.0)
    longer = tmp_path / "longer"
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, longer, "--num_train_epochs", "1",
                                       "--max_train_steps", "12"))  # fmt: skip
    assert (results(longer)["global_step"], results(longer)["epoch"]) == (12, 1.5)
    assert json.loads((longer / "args.json").read_text())["num_epochs"] == 2


def test_the_subsets_are_the_files_first_rows(tiny_model_no_dropout, tiny_data, tmp_path):
    """--max_train_samples 16 and --max_eval_samples 7 train and evaluate exactly as files of the first 16 and 7 rows
    do: the same weights and the same evaluation."""
    first = []
    for path, count in zip(tiny_data, (16, 7)):
        first.append(tmp_path / f"first-{path.name}")
        first[-1].write_text("".join(path.read_text().splitlines(keepends=True)[: count + 1]))  # with the header
    subset = ["--max_train_samples", "16", "--max_eval_samples", "7", "--num_train_epochs", "1"]
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, tmp_path / "subset", *subset))
    run_in_process("train", train_args(tiny_model_no_dropout, *first, tmp_path / "first", "--num_train_epochs", "1"))
    assert max_difference(tmp_path / "subset", tmp_path / "first") == 0
    assert results(tmp_path / "subset")["eval_loss"] == results(tmp_path / "first")["eval_loss"]
