"""Really 2 (and 3) CPU processes under `accelerate launch --config_file accelerate_configs/cpu.yaml`."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import REPO, launch, load_script, sentiment_rows, train_args, write_rows
from safetensors.torch import load_file

train = load_script("train")


def test_two_ranks_of_four_train_like_one_rank_of_eight(two_rank_run, tmp_path):
    """Same examples in each update, gradients averaged over ranks: the same weights up to float rounding."""
    one, two = tmp_path / "one", two_rank_run["output_dir"]
    train.main(train.parse_train_args(train_args(*two_rank_run["args"], one)))

    assert two_rank_run["log"].count("Running training") == 1, "only the main process logs"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir()), "one copy of each file"
    results = json.loads((two / "all_results.json").read_text())
    assert results["num_processes"] == 2 and results["total_train_batch_size"] == 8 and results["eval_samples"] == 21
    assert results["global_step"] == json.loads((one / "all_results.json").read_text())["global_step"] == 16

    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys() and not any(k.startswith("module.") for k in b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, f"weights differ by up to {worst}"  # measured: ~1e-6 after 16 AdamW steps


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("trained")
    train_file = write_rows(folder / "train.csv", sentiment_rows(48, seed=3))
    dev_file = write_rows(folder / "dev.csv", sentiment_rows(16, seed=4))
    args = train_args(tiny_model, train_file, dev_file, folder / "model", "--num_train_epochs", "1")
    train.main(train.parse_train_args(args))
    return folder / "model"


@pytest.fixture(scope="module")
def single_process_evaluation(trained_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    data = write_rows(folder / "eval.csv", sentiment_rows(37, seed=5))
    args = ["--model_name_or_path", str(trained_model), "--validation_file", str(data), "--output_dir", str(folder)]
    result = launch("evaluate.py", [*args, "--per_device_eval_batch_size", "8"], num_processes=1)
    assert result.returncode == 0, result.stderr[-2000:]
    return data, folder


@pytest.mark.parametrize("num_processes,batch_size", [(2, 4), (3, 5)])
def test_evaluation_counts_every_example_once(trained_model, single_process_evaluation, tmp_path, num_processes,
                                              batch_size):  # fmt: skip
    """37 rows do not split evenly: padded repeats must not be counted, and rows come back in order."""
    data, single_dir = single_process_evaluation
    common = ["--model_name_or_path", str(trained_model), "--validation_file", str(data)]
    multi = launch(
        "evaluate.py",
        [*common, "--output_dir", str(tmp_path / "multi"), "--per_device_eval_batch_size", str(batch_size)],
        num_processes=num_processes,
    )
    assert multi.returncode == 0, multi.stderr[-2000:]
    for name in ("eval_results.json", "predictions.csv"):
        assert (single_dir / name).read_text() == (tmp_path / "multi" / name).read_text(), name
    results = json.loads((tmp_path / "multi" / "eval_results.json").read_text())
    assert results["eval_samples"] == 37
    rows = (tmp_path / "multi" / "predictions.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(37))
    assert torch.tensor(results["eval_accuracy"]).isfinite()


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate --multi_gpu"])
def test_other_launchers_start_real_ranks_on_cpu(trained_model, tmp_path, launcher):
    """On a machine without GPUs these would start 2 unrelated single-process runs without cpu=True."""
    data = write_rows(tmp_path / "eval.csv", sentiment_rows(9, seed=6))
    script_args = [str(REPO / "evaluate.py"), "--model_name_or_path", str(trained_model), "--validation_file",
                   str(data), "--output_dir", str(tmp_path / "out")]  # fmt: skip
    port = str(random.randint(20000, 40000))
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", port]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*command, *script_args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("with 2 process(es)") == 1, "one group of 2 ranks, logging once"
    assert json.loads((tmp_path / "out" / "eval_results.json").read_text())["eval_samples"] == 9
