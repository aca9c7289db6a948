"""Beyond one machine: two launchers on loopback form one group; every config loads in accelerate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, kill_tree, train_args
from safetensors.torch import load_file

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
MULTI_NODE_CONFIG = REPO / "accelerate_configs" / "multi_node.yaml"


def launch_two_nodes(args_for_rank) -> list[subprocess.CompletedProcess]:
    """`accelerate launch` once per 'machine' (machine_rank 0 and 1, one CPU process each) on 127.0.0.1."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = []
    for machine_rank in (0, 1):
        # accelerate_configs/multi_node.yaml itself, with the fields it marks EDIT set for one CPU process per
        # "machine" on loopback (and fp32: bf16 autocast on CPU would change the numbers compared below).
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(MULTI_NODE_CONFIG),
                   "--num_machines", "2", "--machine_rank", str(machine_rank), "--num_processes", "2",
                   "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
                   str(REPO / "train.py"), *args_for_rank(machine_rank)]  # fmt: skip
        launchers.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
    results = []
    try:
        for launcher in launchers:
            output, _ = launcher.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, output))
    except subprocess.TimeoutExpired:
        for launcher in launchers:  # both machines' launchers and ranks: none may write on into the next test
            kill_tree(launcher)
        raise
    return results


@pytest.mark.slow
def test_two_machines_on_loopback_train_as_one_group(two_rank_run, tmp_path):
    """Shared output folder: one group of 2 that matches the 2-process single-machine run, best-model choice and
    early stop included."""
    shared = train_args(*two_rank_run["args"], tmp_path / "nodes", *two_rank_run["flags"])
    nodes = launch_two_nodes(lambda rank: shared)
    assert all(node.returncode == 0 for node in nodes), nodes[0].stdout[-3000:] + nodes[1].stdout[-3000:]

    reference = json.loads((two_rank_run["output_dir"] / "all_results.json").read_text())
    results = json.loads((tmp_path / "nodes" / "all_results.json").read_text())
    assert results["num_processes"] == 2 and results["eval_samples"] == 21
    assert results["global_step"] == reference["global_step"]
    a = load_file(two_rank_run["output_dir"] / "model.safetensors")
    b = load_file(tmp_path / "nodes" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "the same 2 ranks, the same sums: the same weights"


@pytest.mark.slow
def test_without_a_shared_folder_each_node_keeps_what_it_needs_to_resume(two_rank_dropout_run, tmp_path):
    """The 2-rank regression run with dropout, again, on two 'machines' that each write their own folder."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    args, flags = two_rank_dropout_run["args"], two_rank_dropout_run["flags"]
    nodes = launch_two_nodes(lambda rank: train_args(*args, folders[rank], *flags, "--save_on_each_node"))
    assert all(node.returncode == 0 for node in nodes), nodes[0].stdout[-3000:] + nodes[1].stdout[-3000:]
    for rank, folder in enumerate(folders):
        checkpoint = folder / "checkpoint-4"
        assert (checkpoint / "training_state.json").is_file() and (checkpoint / "model.safetensors").is_file()
        assert (checkpoint / f"random_states_{rank}.pkl").is_file()
    # The final model and results are the global main process's alone.
    assert (folders[0] / "all_results.json").is_file() and not (folders[1] / "all_results.json").exists()

    # With dropout on, 2 ranks draw their own masks: no 1-rank run equals them, but a rerun does, to the bit.
    a = load_file(two_rank_dropout_run["output_dir"] / "model.safetensors")
    b = load_file(folders[0] / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_launch_config_loads_in_accelerate(config):
    """Only that accelerate reads each file: the GPU configs stay untested until they run on a GPU (README)."""
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    assert loaded.num_processes >= 1 and loaded.compute_environment.value == "LOCAL_MACHINE"
    assert Path(config).read_text().startswith("#"), "every config explains itself"
