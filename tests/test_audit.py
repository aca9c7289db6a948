"""Flags and guarantees that no other test pinned down: each test here fails when the behaviour it names breaks.

All in this process on the tiny BERT and a few rows, except the --max_time vote, which needs two real ranks.
"""

import argparse
import importlib.util
import json
import signal

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from conftest import (
    LOSS_ATOL,
    launch,
    load_script,
    reference_logits,
    sentiment_files,
    sentiment_rows,
    train_args,
    write_rows,
)
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import src.runtime
from src.checkpoint import resolve_checkpoint
from src.errors import UserError, run_cli

train = load_script("train")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 training rows (2 steps of 8 an epoch) and 8 validation rows: the least that trains and evaluates."""
    folder = tmp_path_factory.mktemp("audit-data")
    return sentiment_files(folder, 16, 8)


def run_train(argv: list[str]) -> dict:
    """This module's train.main (the one the tests patch), leaving no Accelerate state behind for the next call.

    One CPU thread unless the test names a number: the tiny model gains nothing from more, and on a busy machine
    OpenMP threads that wait for each other make every step several times slower."""
    if "--cpu_threads" not in argv:
        argv = [*argv, "--cpu_threads", "1"]
    try:
        return train.main(train.parse_train_args(argv))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def results(folder) -> dict:
    return json.loads((folder / "all_results.json").read_text())


def checkpoints(folder) -> list[str]:
    return sorted((p.name for p in folder.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


def grad_norm(parameters) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def record_optimizer_steps(record):
    """Call record(optimizer) before every real update (accelerate skips the update inside accumulation), by whatever
    optimizer src/optimizer.py builds."""

    def hook(optimizer, args, kwargs):
        if not isinstance(optimizer, AcceleratedOptimizer):  # the wrapper, whose step() calls the optimizer's
            record(optimizer)

    return register_optimizer_step_pre_hook(hook)


# ---------------------------------------------------------------- checkpoints


def test_latest_is_the_newest_checkpoint_after_rotation(tiny_model, data, tmp_path, monkeypatch):
    """10 steps of 1 row, a checkpoint every 2, the newest 2 kept: 'latest' is checkpoint-10, which sorts before
    checkpoint-8 as text, so only the step number ordering picks it."""
    out = tmp_path / "out"
    args = train_args(tiny_model, *data, out, "--per_device_train_batch_size", "1", "--max_train_steps", "10",
                      "--checkpointing_steps", "2", "--save_total_limit", "2")  # fmt: skip
    run_train(args)
    assert checkpoints(out) == ["checkpoint-8", "checkpoint-10"]
    assert resolve_checkpoint("latest", out) == out / "checkpoint-10"

    loaded, load_checkpoint = [], train.load_checkpoint

    def recording_load(accelerator, path, *settings):
        loaded.append(path)
        return load_checkpoint(accelerator, path, *settings)

    monkeypatch.setattr(train, "load_checkpoint", recording_load)
    resumed = run_train([*args, "--resume_from_checkpoint", "latest"])
    assert loaded == [out / "checkpoint-10"]
    assert resumed["global_step"] == 10, "resumed at the last step: nothing left to train"
    assert resumed["train_padding_fraction"] == 0.0, "no tokens trained: no padding either"


def test_ranks_resuming_from_different_steps_are_refused(tiny_model, data, tmp_path, monkeypatch):
    """--save_on_each_node: each node's 'latest' is its own folder's, and nodes that kept different checkpoints
    would resume from different steps. The ranks compare their steps (a gather) and refuse, before anything is
    written. One process here: the other node's rank is played by the gather that compares the steps."""
    out = tmp_path / "out"
    args = train_args(tiny_model, *data, out, "--max_train_steps", "2", "--checkpointing_steps", "2",
                      "--save_on_each_node")  # fmt: skip
    run_train(args)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    load_checkpoint = train.load_checkpoint

    def load_with_another_node_ahead(accelerator, path, *settings):
        # While the checkpoint loads, a gather answers for this rank and for one that resumed 2 steps further on.
        accelerator.gather = lambda tensor: torch.cat([tensor, tensor + 2])
        try:
            return load_checkpoint(accelerator, path, *settings)
        finally:
            del accelerator.gather  # the class's own again

    monkeypatch.setattr(train, "load_checkpoint", load_with_another_node_ahead)
    expected = (
        r"the ranks resumed from different steps \(\[2, 4\]\): the nodes' --output_dir folders hold different "
        r"checkpoints; pass the same checkpoint path on every node"
    )
    with pytest.raises(UserError, match=expected):
        run_train([*args, "--resume_from_checkpoint", "latest"])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, "nothing touched"


# ---------------------------------------------------------------- the training step


def test_gradients_are_clipped_once_per_update_on_accumulation_boundaries(tiny_model, data, tmp_path, monkeypatch):
    """16 rows in batches of 4, accumulated in pairs: 4 backward passes, 2 updates, so 2 clips, each with the whole
    accumulated gradient (sync_gradients), and AdamW steps on gradients whose norm is --max_grad_norm."""
    clips, updates = [], []
    clip = Accelerator.clip_grad_norm_

    def recording_clip(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        norm_before = clip(self, parameters, max_norm, norm_type)
        clips.append({"sync_gradients": self.sync_gradients, "max_norm": max_norm, "before": norm_before.item()})
        return norm_before

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", recording_clip)
    handle = record_optimizer_steps(
        lambda opt: updates.append(grad_norm(p for g in opt.param_groups for p in g["params"]))
    )
    try:
        accumulate = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
        clipped = ["--max_grad_norm", "0.01", "--num_train_epochs", "1"]
        run_train(train_args(tiny_model, *data, tmp_path / "clipped", *accumulate, *clipped))
        assert [(c["sync_gradients"], c["max_norm"]) for c in clips] == [(True, 0.01), (True, 0.01)]
        assert all(c["before"] > 0.01 for c in clips), "the gradients were larger: the clip had work to do"
        # Clipping scales by max_norm / (norm + 1e-6): for norm > 0.01 the result is within 1e-6 / 0.01 = 1e-4 of it.
        assert updates == pytest.approx([0.01, 0.01], rel=1e-4), "AdamW stepped on the clipped gradients"

        # --max_grad_norm 0 turns clipping off: the update sees the gradient as it is.
        clips.clear()
        updates.clear()
        unclipped = ["--max_grad_norm", "0", "--max_train_steps", "1"]
        run_train(train_args(tiny_model, *data, tmp_path / "unclipped", *accumulate, *unclipped))
        assert clips == [] and len(updates) == 1 and updates[0] > 0.01
    finally:
        handle.remove()


# ---------------------------------------------------------------- flags wired through main()


@pytest.mark.parametrize("trusted", [True, False])
def test_trust_remote_code_reaches_every_from_pretrained(tiny_model, data, tmp_path, monkeypatch, trusted):
    """The flag, and its default off, reach the loads of the tokenizer, the config and the model."""
    seen = {}
    for loader in (AutoTokenizer, AutoConfig, AutoModelForSequenceClassification):
        name = loader.__name__

        def recording(*args, _load=loader.from_pretrained, _name=name, **kwargs):
            seen.setdefault(_name, []).append(kwargs.get("trust_remote_code"))
            return _load(*args, **kwargs)

        monkeypatch.setattr(loader, "from_pretrained", recording)
    flag = ["--trust_remote_code"] if trusted else []
    run_train(train_args(tiny_model, *data, tmp_path / "out", "--max_train_steps", "1", *flag))
    # The config is read three times: for the order of the labels of the checkpoint's head, by AutoTokenizer (to find
    # the tokenizer's class, passing the flag on) and for the model.
    expected = {"AutoTokenizer": [trusted], "AutoConfig": [trusted] * 3,
                "AutoModelForSequenceClassification": [trusted]}  # fmt: skip
    assert seen == expected


def test_cpu_threads_sets_the_threads_of_the_run(tiny_model, data, tmp_path, monkeypatch):
    """Without the flag this run would take 8 threads (the 8 'cores' below); torch had 4 before it: 1 is the flag's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(src.runtime, "physical_cores", lambda: 8)
    torch.set_num_threads(4)  # the autouse fixture gives back the thread count of before the test
    threads = []
    handle = record_optimizer_steps(lambda opt: threads.append(torch.get_num_threads()))
    try:
        out = tmp_path / "out"
        run_train(train_args(tiny_model, *data, out, "--max_train_steps", "2", "--cpu_threads", "1"))
    finally:
        handle.remove()
    assert threads == [1, 1]
    assert results(out)["cpu_threads_per_process"] == 1


def test_the_seed_decides_the_weights(tiny_model, data, tmp_path):
    """The tiny BERT with dropout: the seed decides the data order and the dropout masks. The same seed gives the
    same weights to the bit; another seed other weights."""

    def weights(seed, name):
        run_train(train_args(tiny_model, *data, tmp_path / name, "--max_train_steps", "2", "--seed", seed))
        return load_file(tmp_path / name / "model.safetensors")

    first, again, other = weights("1", "first"), weights("1", "again"), weights("2", "other")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first), "the same seed: the same weights"
    assert not all(torch.equal(first[k], other[k]) for k in first), "another seed: other weights"


def test_lora_alpha_and_target_modules_reach_the_adapter(tiny_model, data, tmp_path):
    """--lora_target_modules query,value: adapters on those two layers of each attention block, nowhere else;
    --lora_alpha 8 with --lora_r 4 scales the updates by 2."""
    from src.model import load_trained_model

    out = tmp_path / "out"
    lora = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "query,value"]
    run_train(train_args(tiny_model, *data, out, "--max_train_steps", "1", *lora))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["query", "value"])
    adapted = {key.split(".lora_")[0] for key in load_file(out / "adapter_model.safetensors") if ".lora_" in key}
    assert adapted == {f"base_model.model.bert.encoder.layer.{i}.attention.self.{name}" for i in (0, 1)
                       for name in ("query", "value")}  # fmt: skip
    model = load_trained_model(AutoModelForSequenceClassification, str(out))
    assert {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)} == {8 / 4}


# ---------------------------------------------------------------- evaluate.py's overrides


def test_evaluate_overrides_max_eval_samples_max_length_and_precision(trained_tiny_model, tmp_path, monkeypatch):
    """The trained folder's args.json says max_length 64, fp32 and an evaluation batch of 8 (what fit beside
    training): evaluate.py takes them, and each flag wins over them."""
    evaluate_script = load_script("evaluate")
    rows = sentiment_rows(12, seed=5)
    dev = write_rows(tmp_path / "dev.csv", rows)
    precisions, longest, batches = [], [], []

    def recording_evaluate(model, dataloader, accelerator, task):
        precisions.append(accelerator.mixed_precision)
        longest.append(max(len(ids) for ids in dataloader.dataset["input_ids"]))
        batches.append(len(next(iter(dataloader))["labels"]))
        return evaluate(model, dataloader, accelerator, task)

    evaluate = evaluate_script.evaluate
    monkeypatch.setattr(evaluate_script, "evaluate", recording_evaluate)

    def run(name, *flags):
        args = evaluate_script.parse_eval_args(["--model_name_or_path", str(trained_tiny_model), "--validation_file",
                                                str(dev), "--output_dir", str(tmp_path / name), "--cpu_threads", "1",
                                                *flags])  # fmt: skip
        try:
            return evaluate_script.main(args)
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    config = AutoConfig.from_pretrained(trained_tiny_model)
    labels = torch.tensor([config.label2id[r["label"]] for r in rows])
    full_loss = F.cross_entropy(reference_logits(trained_tiny_model, [r["sentence"] for r in rows]), labels).item()

    # --max_eval_samples 5: the first 5 rows, in fp32 (the run's precision).
    first = run("first", "--max_eval_samples", "5")
    assert first["eval_samples"] == 5
    lines = (tmp_path / "first" / "predictions.csv").read_text().splitlines()
    assert [line.split(",")[1] for line in lines[1:]] == [r["label"] for r in rows[:5]]
    five = F.cross_entropy(reference_logits(trained_tiny_model, [r["sentence"] for r in rows[:5]]), labels[:5])
    assert first["eval_loss"] == pytest.approx(five.item(), abs=LOSS_ATOL)  # batched vs one by one: sum order

    # --max_length 4: every text cut to 4 tokens ([CLS], 2 words, [SEP]), as the model is then run on it.
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(trained_tiny_model).eval()
    with torch.no_grad():
        cut = torch.cat([model(**tokenizer(r["sentence"], truncation=True, max_length=4, return_tensors="pt")).logits
                         for r in rows])  # fmt: skip
    short = run("short", "--max_length", "4")
    lengths = [len(tokenizer(r["sentence"])["input_ids"]) for r in rows]
    assert min(lengths) > 4 and max(lengths) < 64, "4 cuts every text, the run's 64 none"
    assert longest == [max(lengths[:5]), 4]
    assert short["eval_loss"] == pytest.approx(F.cross_entropy(cut, labels).item(), abs=LOSS_ATOL)

    # --mixed_precision bf16 reaches the Accelerator (autocast): a loss close to the fp32 one. Not necessarily
    # another one: this barely trained model's logits are so close to 0 that bf16 may round them to the same loss.
    bf16 = run("bf16", "--mixed_precision", "bf16", "--per_device_eval_batch_size", "12")
    assert precisions == ["no", "no", "bf16"] and longest[2] == max(lengths)
    assert abs(bf16["eval_loss"] - full_loss) < 0.02
    assert batches == [5, 8, 12], "the run's 8 (5 rows in all for the first), then the flag's 12"


# ---------------------------------------------------------------- errors and signals


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "comet_ml", "clearml"])
def test_a_tracker_that_is_not_installed_is_one_line(tiny_model, data, tmp_path, capsys, tracker):
    """run_cli, as `python train.py` runs it: exit status 2 and one line that says what to install, before anything
    is loaded or written."""
    if importlib.util.find_spec(tracker) is not None:
        pytest.skip(f"{tracker} is installed here")
    out = tmp_path / "out"
    argv = train_args(tiny_model, *data, out, "--max_train_steps", "1")
    argv[argv.index("--report_to") + 1] = tracker
    with pytest.raises(SystemExit) as exited:
        run_cli(train.main, lambda: train.parse_train_args(argv))
    assert exited.value.code == 2
    package = tracker.replace("_", "-")
    assert capsys.readouterr().err == (
        f"train.py: error: --report_to {tracker}: the package is not installed; `pip install {package}` (see --help)\n"
    )
    assert not out.exists()


def test_main_gives_back_the_signal_handlers_when_it_raises(tiny_model, data, tmp_path, monkeypatch):
    """An error inside the training loop (here: the evaluation fails) leaves the handlers as main() found them,
    an ignored SIGHUP (nohup) included. test_preemption.py checks the same after a normal return."""

    def mine(signum, frame):
        pass

    found = {signal.SIGTERM: mine, signal.SIGINT: mine, signal.SIGUSR1: mine, signal.SIGHUP: signal.SIG_IGN}
    during = []

    def failing_evaluate(*args, **kwargs):
        during.append({signum: signal.getsignal(signum) for signum in found})
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(train, "evaluate", failing_evaluate)
    previous = {signum: signal.signal(signum, handler) for signum, handler in found.items()}
    try:
        with pytest.raises(RuntimeError, match="evaluation failed"):
            run_train(train_args(tiny_model, *data, tmp_path / "out", "--max_train_steps", "1"))
        after = {signum: signal.getsignal(signum) for signum in found}
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    # While the loop ran, main's own handler stood in for mine; the ignored SIGHUP stayed ignored.
    (inside,) = during
    assert all(
        getattr(inside[s], "__name__", None) == "handle" for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    )
    assert inside[signal.SIGHUP] is signal.SIG_IGN
    assert after == found


def test_max_time_counts_minutes(tiny_model, data, tmp_path, monkeypatch):
    """--max_time 1 is a minute: a clock 59 s past the loop's start lets the run finish, one 61 s past it stops the
    run after its first step with a checkpoint (the run's own clock, shifted: nothing waits a minute)."""
    clock = train.time.perf_counter
    for seconds, name in ((59, "on"), (61, "stopped")):
        monkeypatch.setattr(train, "time", argparse.Namespace(perf_counter=lambda s=seconds: clock() + s))
        args = train_args(tiny_model, *data, tmp_path / name, "--max_time", "1", "--num_train_epochs", "1")
        if name == "on":
            assert run_train(args)["global_step"] == 2 and checkpoints(tmp_path / name) == []
        else:
            with pytest.raises(SystemExit) as stopped:
                run_train(args)
            assert stopped.value.code == 0 and checkpoints(tmp_path / name) == ["checkpoint-1"]


# ---------------------------------------------------------------- two real ranks


def test_one_rank_over_max_time_stops_both_at_the_same_step(tiny_model_no_dropout, data, tmp_path, monkeypatch):
    """Rank 1's clock runs fast (tests/fast_clock.py): it alone is past --max_time 1 (a minute) at step 1, while
    rank 0's own clock is at a fraction of a second. The vote makes rank 0 stop too, at the same step: both save
    checkpoint-1 and exit with the planned stop's status 0. A real 2-process launch: the vote is an all-reduce
    between processes, and a rank that stopped alone would leave the other waiting in a collective."""
    out = tmp_path / "out"
    monkeypatch.setenv("FAST_CLOCK", "1")
    args = train_args(tiny_model_no_dropout, *data, out, "--per_device_train_batch_size", "4", "--max_time", "1",
                      "--logging_steps", "1")  # fmt: skip
    result = launch("tests/fast_clock.py", args, timeout=120)  # healthy: ~10 s; a rank left alone in a collective hangs
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "rank 1: the clock runs" in log and "rank 0: the clock runs" not in log
    assert "Stopped at step 1 (--max_time 1.0 minutes reached)" in log
    assert checkpoints(out) == ["checkpoint-1"]
    saved = out / "checkpoint-1"
    assert json.loads((saved / "training_state.json").read_text())["global_step"] == 1
    assert (saved / "random_states_0.pkl").is_file() and (saved / "random_states_1.pkl").is_file(), "both ranks saved"
    assert not (out / "all_results.json").exists(), "stopped, not finished"


def test_one_rank_over_max_time_on_the_last_step_lets_both_finish(tiny_model_no_dropout, data, tmp_path, monkeypatch):
    """Out of time on the run's last step: nothing is left to resume, so both ranks finish the run (final
    evaluation, saving: collectives of both) rather than checkpoint and stop. Rank 1 alone is out of time, as above."""
    out = tmp_path / "out"
    monkeypatch.setenv("FAST_CLOCK", "1")
    args = train_args(tiny_model_no_dropout, *data, out, "--per_device_train_batch_size", "4", "--max_time", "1",
                      "--max_train_steps", "1")  # fmt: skip
    result = launch("tests/fast_clock.py", args, timeout=120)  # a rank left alone in a collective hangs
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "rank 1: the clock runs" in log and "Stopped at step" not in log
    assert json.loads((out / "all_results.json").read_text())["global_step"] == 1, "finished"
    assert checkpoints(out) == [] and (out / "model.safetensors").is_file()
