"""CPU threads under every launch path: one process gets every physical core, k processes on one machine
share them, and a value the user exported is kept (launchers' own OMP_NUM_THREADS=1 is not a choice)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from accelerate import debug_launcher, notebook_launcher
from conftest import CPU_CONFIG, REPO, free_port, run_process, sentiment_rows, train_args, write_rows

import src.runtime
from src.loaders import collating_workers
from src.runtime import make_accelerator, set_cpu_threads

# Each process is told the machine has 8 physical cores: on a 2-core machine a share of 1 thread could not
# be told apart from the launchers' own OMP_NUM_THREADS=1.
CORES = 8
SHARE = CORES // 2
PROBE = f"""
import json, os, sys
sys.path.insert(0, {str(REPO)!r})
import src.runtime
src.runtime.physical_cores = lambda: {CORES}
with open("rank-" + os.environ.get("RANK", "0") + ".json", "w") as report:  # in the test's folder, one per process
    processes = int(os.environ.get("WORLD_SIZE", 1))
    json.dump([src.runtime.set_cpu_threads(None), src.runtime.launched_fewer_than_asked(processes)], report)
"""


def launcher(kind: str) -> list[str]:
    port = free_port()
    return {
        "python": [sys.executable],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch"],
        "accelerate --cpu": [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"],
        "accelerate cpu.yaml": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
                                "--num_processes", "2", "--main_process_port", port],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port],
    }[kind]  # fmt: skip


# launcher, OMP_NUM_THREADS exported before it (None: none), the threads each process takes.
THREAD_CASES = [
    ("python", None, [CORES]),
    ("accelerate", None, [CORES]),  # the launcher wrote OMP_NUM_THREADS=1
    # One process whatever --num_processes says: a warning (below). Exported 1: unset, accelerate would export the
    # machine's physical cores / 2 for it (1 on 2 cores, 8 on 16), which no fixed expectation fits.
    ("accelerate --cpu", "1", [1]),
    ("accelerate cpu.yaml", None, [SHARE, SHARE]),
    ("torchrun", None, [SHARE, SHARE]),
    ("accelerate", "1", [1]),  # the user's 1, exported before launching
    ("torchrun", "1", [1, 1]),
    ("accelerate cpu.yaml", "3", [3, 3]),
]


def probe_threads(folder, kind, exported):
    """[threads, warning of launched_fewer_than_asked] of each process of a launch under `kind`, or the launch's
    error output."""
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if exported:
        env["OMP_NUM_THREADS"] = exported
    result = run_process([*launcher(kind), str(folder / "probe.py")], 120, cwd=folder, env=env)
    if result.returncode != 0:
        return result.stderr[-2000:]
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank-*.json"))]


@pytest.fixture(scope="module")
def launched_threads(tmp_path_factory):
    """Every case's launch, two at a time: a launch is mostly a single-threaded import of torch, so two share the
    2 cores of a CI machine, in little more than half the time of one at a time."""
    root = tmp_path_factory.mktemp("threads")
    folders = [root / str(index) for index in range(len(THREAD_CASES))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = pool.map(lambda case, folder: probe_threads(folder, *case[:2]), THREAD_CASES, folders)
        return {(kind, exported): report for (kind, exported, _), report in zip(THREAD_CASES, reports)}


@pytest.mark.parametrize("kind,exported,expected", THREAD_CASES)
def test_threads_per_process_under_each_launcher(launched_threads, kind, exported, expected):
    assert [threads for threads, _ in launched_threads[kind, exported]] == expected


def test_a_launch_of_fewer_processes_than_asked_is_said(launched_threads):
    """`accelerate launch --cpu --num_processes 2` runs one process (accelerate's one-process launcher), silently;
    the run says so, and how to get two. The other launches start what they were asked for: no warning."""
    warnings = {case: [warning for _, warning in report] for case, report in launched_threads.items()}
    [warning] = warnings.pop(("accelerate --cpu", "1"))
    assert "--num_processes 2` started 1 process" in warning and "accelerate_configs/cpu.yaml" in warning
    assert all(warning is None for report in warnings.values() for warning in report)


def record_threads(folder):
    (folder / f"process-{os.getpid()}").write_text(str(set_cpu_threads(None)))


@pytest.mark.parametrize("start", [debug_launcher, notebook_launcher], ids=["debug_launcher", "notebook_launcher"])
def test_threads_under_accelerates_in_process_launchers(tmp_path, start, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # The processes are forked: they see these. A forked child must not grow the OpenMP pool it inherited
    # (libgomp may crash), so the threads are computed and recorded, not started.
    monkeypatch.setattr(src.runtime, "physical_cores", lambda: CORES)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    start(record_threads, (tmp_path,), num_processes=2)
    assert [int(path.read_text()) for path in tmp_path.glob("process-*")] == [SHARE, SHARE]


def test_the_cpu_threads_flag_wins_over_everything(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(3) == 3 == torch.get_num_threads()
        assert set_cpu_threads(None) == 5, "an exported value without a launcher is the user's"
    finally:
        torch.set_num_threads(before)


def test_processes_share_the_cores_of_their_own_machine_not_of_the_whole_run(monkeypatch):
    """2 machines of 2 ranks each (torchrun --nnodes 2): a rank shares its machine's cores with 1 other, not 3."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(src.runtime, "physical_cores", lambda: CORES)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert set_cpu_threads(None) == CORES // 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")  # mpirun
    assert set_cpu_threads(None) == CORES // 2


@pytest.mark.parametrize("flags", [["--num_processes=2"], ["--num-processes", "2"]])
def test_fewer_processes_than_asked_is_said_for_each_spelling_of_the_flag(monkeypatch, flags):
    """The launcher's command line as /proc shows it: a stand-in launcher process with these flags."""
    waiting = "import time; print('ready', flush=True); time.sleep(60)"
    launcher = subprocess.Popen([sys.executable, "-c", waiting, "--cpu", *flags], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline() == "ready\n"  # started: /proc shows its command line
        monkeypatch.setattr(os, "getppid", lambda: launcher.pid)
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert "--num_processes 2` started 1 process" in src.runtime.launched_fewer_than_asked(1)
        assert src.runtime.launched_fewer_than_asked(2) is None
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize(
    "files, limit",
    [
        ({"cpu.max": "400000 100000\n"}, 4),  # cgroup v2: docker run --cpus 4, Kubernetes limits.cpu: 4
        ({"cpu.max": "250000 100000\n"}, 2),  # 2.5 CPUs' time: 2 threads are never throttled
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files (macOS)
        ({"cpu.max": "a b\n"}, None),  # a file it cannot read: no limit, rather than a failed start
        ({"cpu.max": "100000 0\n"}, None),
    ],
)
def test_a_containers_cpu_limit_caps_the_threads_and_workers(tmp_path, monkeypatch, files, limit):
    """A container limited to a few CPUs' time on a large host sees all the host's CPUs in its affinity: its threads
    and collating workers are counted from the limit, or they would be throttled to it, each waiting for the others."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(src.runtime, "CGROUP_V2_CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(src.runtime, "CGROUP_V1_CPU", tmp_path / "cpu")
    monkeypatch.setattr(src.runtime, "usable_cpus", lambda: list(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert src.runtime.cpu_limit() == limit
    assert src.runtime.usable_cpu_count() == (limit or 64)
    assert src.runtime.physical_cores() <= (limit or 64)
    assert collating_workers(None, torch.device("cuda", 0)) == min(4, (limit or 64) - 1)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the processes of a machine with a GPU use the GPU")
def test_more_processes_than_cores_on_a_machine_without_gpus_are_told_to_use_fewer(monkeypatch, caplog):
    # multi_gpu.yaml's 8 processes on a machine of 2 cores and no GPU: accelerate starts 8 CPU processes without a word.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(src.runtime, "physical_cores", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    args = SimpleNamespace(ddp_timeout=60, cpu_threads=None, mixed_precision="no")
    with caplog.at_level("WARNING"):
        make_accelerator(args, None)
    assert "8 processes share this machine's 2 CPU cores (it has no GPU): they wait for each other" in caplog.text
    caplog.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as many as the cores: nothing to say
    with caplog.at_level("WARNING"):
        make_accelerator(args, None)
    assert "share this machine's" not in caplog.text


def test_accelerates_state_made_before_the_accelerator_in_a_launched_process_is_one_line(monkeypatch):
    """A tracker of one's own whose __init__ asks accelerate's state (its guide's @on_main_process does) makes it
    without make_accelerator's cpu=True: on a CPU each launched process would train alone."""
    from accelerate import PartialState

    from src.errors import UserError

    PartialState()  # as that __init__ would, in one of the 2 processes a launcher started
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(ddp_timeout=60, cpu_threads=None, mixed_precision="no")
    with pytest.raises(UserError, match="2 processes were launched, and accelerate's state, set up before the run's"):
        make_accelerator(args, None)


def test_a_callers_own_ddp_settings_are_kept():
    """build_accelerator is where a user adds Accelerate handlers: theirs stand beside (or instead of) ours."""
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    args = SimpleNamespace(ddp_timeout=60, cpu_threads=None, mixed_precision="no")
    own = [DistributedDataParallelKwargs(bucket_cap_mb=10), InitProcessGroupKwargs()]
    accelerator, _, _ = make_accelerator(args, None, kwargs_handlers=own)
    assert accelerator.ddp_handler.bucket_cap_mb == 10


def test_the_banner_and_results_report_the_threads(tiny_model, tmp_path):
    """`accelerate launch train.py`, the README's command, with no config: every core, said in two places."""
    train_file = write_rows(tmp_path / "train.csv", sentiment_rows(16, seed=1))
    args = train_args(tiny_model, train_file, train_file, tmp_path / "out", "--num_train_epochs", "1")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # no default accelerate config file: the launcher's own defaults
    result = run_process([*launcher("accelerate"), str(REPO / "train.py"), *args], 300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    cores = src.runtime.physical_cores()
    assert f"{cores} CPU threads and 0 collating workers per process" in result.stderr  # no GPU: no workers
    assert json.loads((tmp_path / "out" / "all_results.json").read_text())["cpu_threads_per_process"] == cores


def test_a_launch_that_times_out_leaves_no_process_behind(tmp_path):
    """The tests' run_process (and so launch) kills every process it started on a timeout, also one in a session
    of its own, as torchrun starts its ranks: none may write on into the next test."""
    import psutil

    pid_file = tmp_path / "rank.pid"
    rank = "import time; time.sleep(600)"
    # The pretend rank's output goes elsewhere, so that a helper that left it running would fail here, not hang.
    launcher = (
        f"import pathlib, subprocess, sys, time; rank = subprocess.Popen([sys.executable, '-c', {rank!r}], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(rank.pid)); time.sleep(600)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_process([sys.executable, "-c", launcher], timeout=5)
    assert not psutil.pid_exists(int(pid_file.read_text())), "the rank in its own session was left running"
