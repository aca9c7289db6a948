"""Speed work: the sampler's padding bound and guarantees, and the benchmark scripts' own logic."""

import contextlib
import gc
import io
import json
import runpy
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import REPO, run_process, sentiment_rows, train_args, write_rows
from datasets import Dataset

import src.loaders
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, LengthGroupedSampler, collating_workers, lengths_of

sys.path.insert(0, str(REPO / "benchmarks"))


def sst2_like_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Token counts shaped like SST-2's training phrases: median ~10, a long tail up to ~65."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mean=2.1, sigma=0.8, size=count)) + 2, 3, 66).astype(int)


def padding(lengths, order, batch_size) -> float:
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    padded = sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)
    return 1 - sum(lengths) / padded


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_sampler_keeps_padding_under_5_percent(seed):
    lengths = sst2_like_lengths(6000, seed)
    sampler = LengthGroupedSampler(lengths, batch_size=32, seed=seed)
    assert padding(lengths, list(sampler), 32) <= 0.05
    # The old window of 16 batches wasted more than twice as much on the same data.
    assert padding(lengths, list(LengthGroupedSampler(lengths, 32, seed=seed, groups=16)), 32) > 0.09


def test_sampler_guarantees_hold_with_wide_windows():
    """Every example once, the order a function of (seed, epoch), the short last batch last."""
    lengths = sst2_like_lengths(1001)
    sampler = LengthGroupedSampler(lengths.tolist(), batch_size=32, seed=5)
    first = list(sampler)
    assert sorted(first) == list(range(1001))
    assert list(LengthGroupedSampler(lengths, 32, seed=5)) == first, "a list or an array: the same order"
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(1001)) and second != first
    assert first[-(1001 % 32) :] == sorted(first[-(1001 % 32) :], key=lambda i: lengths[i]), "last batch stays last"


def test_lengths_of_reads_the_column_in_row_order():
    dataset = Dataset.from_dict({INDEX_COLUMN: [0, 1, 2, 3], LENGTH_COLUMN: [5, 3, 9, 1]}).select([3, 2, 1, 0])
    assert lengths_of(dataset).tolist() == [1, 9, 3, 5]


def test_collating_workers_default_to_a_share_of_the_cpus_on_gpus_and_to_none_without(monkeypatch):
    """On a CUDA GPU the batches are collated beside each process (up to 4 workers, one CPU of each process's share left
    to it); elsewhere the CPUs compute, so the process collates; a number given is kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert collating_workers(None, cpu) == 0 and collating_workers(3, cpu) == 3
    monkeypatch.setattr(src.loaders, "usable_cpu_count", lambda: 16)
    expected = {1: 4, 4: 3, 8: 1, 16: 0}  # processes on the machine: workers each
    for processes, workers in expected.items():
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        assert collating_workers(None, cuda) == workers, processes
    assert collating_workers(0, cuda) == 0


def test_logged_throughput_is_of_the_training_time_since_the_last_log(monkeypatch):
    """metrics.jsonl's samples/s and tokens/s: the rows and real (unpadded) tokens since the last log over the time
    trained since then, evaluations and checkpoints (`paused`) left out; the run's totals keep every row and token."""
    from types import SimpleNamespace

    import src.throughput
    from src.throughput import ThroughputWindow

    now = [100.0]
    monkeypatch.setattr(src.throughput, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    one_rank = SimpleNamespace(reduce=lambda tensor, reduction: tensor)
    window = ThroughputWindow("cpu")
    step = SimpleNamespace(loss=torch.tensor(6.0), units=torch.tensor(3))
    now[0] += 2
    window.add(step, (3, 30, 40))  # 3 rows of 30 real tokens, padded to 40
    with window.paused():
        now[0] += 100  # an evaluation
    now[0] += 1
    window.add(step, (3, torch.tensor(30), 40))
    assert window.flush(one_rank) == {"loss": 2.0, "samples_per_second": 2.0, "tokens_per_second": 20.0}
    now[0] += 4
    window.add(step, (4, 20, 40))
    assert window.flush(one_rank) == {"loss": 2.0, "samples_per_second": 1.0, "tokens_per_second": 5.0}
    assert window.totals == {"samples": 10, "tokens": 80, "padded_tokens": 120}


def test_benchmark_targets_report_met_and_missed():
    from run_benchmark import target_lines

    def summary(wall, accuracy, tokens_per_second=1000.0, padding=0.03, outside=4.0, threads=2):
        return {"wall_seconds": wall, "accuracy": accuracy, "tokens_per_second": tokens_per_second,
                "padding_fraction": padding, "outside_seconds": outside, "eval_seconds": 1.5,
                "threads": threads}  # fmt: skip

    lines = target_lines(
        {
            "project": summary(40.0, 0.820),
            "launch": summary(41.0, 0.820, tokens_per_second=900.0, threads=1),
            "trainer_grouped": summary(50.0, 0.825),
            "trainer": summary(100.0, 0.835),
        }
    )
    assert lines[0].startswith("- train.py wall / tuned Trainer wall = 0.80 (<= 0.8)") and lines[0].endswith("MET")
    assert lines[1].startswith("- train.py wall / Trainer as it comes wall = 0.40 (<= 0.5)") and lines[1].endswith(
        "MET"
    )
    assert "best peer (Trainer as it comes) 0.8350: -1.5 points" in lines[2] and lines[2].endswith("MISSED")
    assert lines[3].endswith("MET") and lines[4].endswith("MET")
    assert "accelerate launch / python = 0.90 (1 vs 2 threads" in lines[5] and lines[5].endswith("MISSED")
    slower = target_lines({"project": summary(60.0, 0.82), "trainer_grouped": summary(70.0, 0.82)})
    assert slower[0].startswith("- train.py wall / tuned Trainer wall = 0.86") and slower[0].endswith("MISSED")


def test_overhead_counts_each_sample_for_the_innermost_named_step_and_adds_up_to_the_wall_time():
    from overhead import EXIT, IMPORTS, OTHER, STARTUP, phase_of, phases

    main = ("/repo/train.py", "main")
    loop = [("/repo/train.py", "train_loop"), main, ("/repo/src/errors.py", "run_cli")]
    assert phase_of([("/venv/transformers/__init__.py", "<module>"), ("/repo/train.py", "<module>")], False) == IMPORTS
    assert phase_of([("/venv/torch/nn/modules/module.py", "_call_impl"), *loop], True) == "training steps"
    evaluation = [("/venv/torch/nn/modules/module.py", "_call_impl"), ("/repo/src/evaluation.py", "evaluate"), *loop]
    assert phase_of(evaluation, True) == "evaluation (forward passes, gathering)"
    assert phase_of([("/repo/src/metrics.py", "load_metric"), *evaluation], True).startswith("loading the metric")
    assert phase_of([("/repo/train.py", "log"), main], True) == OTHER
    measured = {"totals": {IMPORTS: [3.0, 3.0], "training steps": [50.0, 95.0], OTHER: [7.2, 7.0]},
                "sampled_from": 100.1, "startup_cpu": 0.05, "ended_at": 160.3}  # fmt: skip
    rows = {name: (wall, cpu) for name, wall, cpu in phases(measured, 100.0, 160.5, process_cpu=105.5)}
    assert list(rows) == [STARTUP, IMPORTS, "training steps", OTHER, EXIT]
    assert rows[STARTUP] == pytest.approx((0.1, 0.05)) and rows[EXIT] == pytest.approx((0.2, 0.45))
    assert sum(wall for wall, _ in rows.values()) == pytest.approx(60.5)


@pytest.mark.slow
def test_gpu_benchmark_runs_end_to_end_on_tiny_models(tmp_path):
    """The GPU benchmark's plumbing on the CPU: model making, both runners, the steady-rate reading, the table."""
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_benchmark.py"), "--tiny", "--only", "minilm",
               "--runners", "ours", "trainer-workers", "--report_dir", str(tmp_path / "report"),
               "--work_dir", str(tmp_path / "work")]  # fmt: skip
    done = run_process(command, 600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {run["run"]: run for run in json.loads((tmp_path / "report" / "gpu_benchmark.json").read_text())["runs"]}
    assert set(runs) == {"minilm train.py", "minilm Trainer, collating workers"}
    for run in runs.values():
        assert run["status"] == "ok" and run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1
    sync = json.loads((tmp_path / "report" / "gpu_benchmark.json").read_text())["sync"]
    assert sync == {"steps": 6, "places": {}}, "the sync check ran train.py to its end (no CUDA: nothing to count)"
    table = (tmp_path / "report" / "gpu_benchmark.md").read_text()
    assert "| minilm train.py | 1 | 4 x 6 |" in table and "x |" in table.split("minilm train.py")[1].split("\n")[0]


# Runs a script as `python <script>.py ARGS` does, noting the garbage collections from its gc.disable() to its
# gc.enable() (its setup: imports, data, model), and at each gc.freeze() how many had run and how much was frozen.
COLLECTIONS_DURING_SETUP = """
import gc, json, runpy, sys
collections, marks, freezes = [], {}, []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
for name in ("disable", "enable", "freeze"):
    def marked(original=getattr(gc, name), name=name):
        if name == "freeze" and "enable" not in marks:
            freezes.append([len(collections), gc.get_freeze_count()])
        marks.setdefault(name, len(collections))
        marks.setdefault(name + " with the model's code", "transformers.models.bert.modeling_bert" in sys.modules)
        marks.setdefault(name + ": frozen", gc.get_freeze_count())
        original()
    setattr(gc, name, marked)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print(json.dumps({"marks": marks, "freezes": freezes, "enabled": gc.isenabled()}))
"""


def test_the_scripts_set_up_without_collecting_garbage_then_collect_again(tiny_model, tiny_data, tmp_path):
    """~1.3 s of a run's ~5 s of setup on a small CPU was garbage collection that found nothing to free. A tiny run
    and an evaluation, as scripts (at once): none during the setup but the one that clears its little garbage, then
    what the setup made is frozen."""
    rows = [{"sentence": row["sentence"], "label": int(row["label"] == "positive")} for row in sentiment_rows(16)]
    arguments = {
        "train.py": train_args(tiny_model, *tiny_data, tmp_path / "out", "--num_train_epochs", "1"),
        # The tiny model as a model from elsewhere, whose labels are 0 and 1.
        "evaluate.py": ["--model_name_or_path", str(tiny_model), "--validation_file",
                        str(write_rows(tmp_path / "label-ids.csv", rows)), "--output_dir", str(tmp_path / "eval")],
    }  # fmt: skip
    commands = [[sys.executable, "-c", COLLECTIONS_DURING_SETUP, script, *argv] for script, argv in arguments.items()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda command: run_process(command, 300, cwd=REPO), commands)
    for script, finished in zip(arguments, done):
        seen = json.loads(finished.stdout.splitlines()[-1])
        marks = seen["marks"]
        assert "enable" in marks, f"{script} never collects garbage again:\n{finished.stderr[-3000:]}"
        assert marks["enable with the model's code"], f"{script} collects again before it loads the model"
        during = marks["enable"] - marks["disable"]
        assert during == 1, f"{script}'s setup ran {during} garbage collections, not one"
        # Frozen after its imports, then again after that one collection (frozen first, its garbage would stay).
        assert [at for at, _ in seen["freezes"]] == [marks["disable"], marks["enable"]], f"{script}: {seen['freezes']}"
        setup_frozen = marks["enable: frozen"] - seen["freezes"][-1][1]
        assert setup_frozen > 50_000, f"{script}: {setup_frozen} objects of the setup frozen"
        assert seen["enabled"], f"{script} left garbage collection off"


def test_imported_or_under_ipython_the_scripts_leave_garbage_collection_as_it_was(monkeypatch):
    """A notebook or the tests import them, and IPython's `%run train.py` runs one in a kernel that goes on: their own
    garbage stays collectable, and collection stays as they set it, also when the script stops early (`--help`)."""
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    gc.disable()
    try:
        for script in ("train.py", "evaluate.py"):
            runpy.run_path(str(REPO / script), run_name=script.removesuffix(".py"))
            assert not gc.isenabled() and not freezes, script
        shell = types.ModuleType("IPython")
        shell.get_ipython = lambda: object()  # a running IPython, as under `%run`
        monkeypatch.setitem(sys.modules, "IPython", shell)
        monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
        for script in ("train.py", "evaluate.py"):
            with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(REPO / script), run_name="__main__")
            assert not gc.isenabled() and not freezes, f"%run {script}"
    finally:
        gc.enable()
