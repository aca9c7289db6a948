"""Interrupted runs, signalled the way schedulers and people really do it, resume to the same weights.

SLURM and systemd signal every process of a job at once (launcher and ranks); Ctrl-C and `docker stop`
reach only the launcher, which forwards the signal; torchrun starts each rank in a session of its own, so
`os.killpg` on the launcher reaches nobody else. Every test here therefore signals explicit process ids
(`signal_tree`) and checks that no process of the tree is left before it resumes in the same folder.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from conftest import (
    REPO,
    free_port,
    launch_command,
    load_script,
    run_process,
    sentiment_files,
    train_args,
)
from safetensors.torch import load_file

train = load_script("train")

# 3 epochs of 128 rows: 48 updates on 1 process (batch 8), 48 on 2 (4 rows each); no periodic checkpoints,
# so a checkpoint can only come from the signal. One thread per rank: the same arithmetic on every path.
RUN = ("--num_train_epochs", "3", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--cpu_threads", "1")
STEPS = 48
# What the shell sees: train.py's processes exit 128 + the signal number after saving; torchrun and a
# multi-process `accelerate launch` report 1 for that (a worker exited non-zero, or they were signalled too).
LAUNCHER_STATUS = 1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return sentiment_files(folder, 128, 20)


def run_args(model, data, output_dir, num_processes, *extra):
    batch = "8" if num_processes == 1 else "4"
    return train_args(model, *data, output_dir, *RUN, "--per_device_train_batch_size", batch, *extra)


def command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "python":
        return [sys.executable, str(REPO / "train.py"), *args]
    if launcher == "torchrun":
        port = free_port()
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                str(REPO / "train.py"), *args]  # fmt: skip
    return launch_command("train.py", args, 2)  # accelerate launch with accelerate_configs/cpu.yaml


def start(launcher: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(command(launcher, args), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def process_tree(process: subprocess.Popen, ranks: int) -> list[psutil.Process]:
    """The launcher, what its ranks started (collating workers and the fork server that forks them, once the first
    epoch has started them), then the ranks, once all `ranks` training processes have started."""
    launcher = psutil.Process(process.pid)
    deadline = time.monotonic() + 120

    def runs_train_py(process) -> bool:
        try:
            return "train.py" in " ".join(process.cmdline())
        except psutil.Error:  # gone, or a zombie: a launcher's short-lived helper process
            return False

    while True:
        trainers = [p for p in launcher.children(recursive=True) if runs_train_py(p)]
        if len(trainers) >= ranks or (ranks == 1 and runs_train_py(launcher)):
            theirs = [p for rank in trainers or [launcher] for p in rank.children(recursive=True)]
            return [launcher, *theirs, *trainers]
        assert process.poll() is None and time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)


def signal_tree(tree: list[psutil.Process], signum: int, who: str = "all"):
    """Send `signum` to every process of the tree at once ('all', as SLURM does), to the launcher only
    ('launcher', as Ctrl-C or `docker stop`), or to the last rank only ('one rank')."""
    targets = {"all": tree, "launcher": tree[:1], "one rank": tree[-1:]}[who]
    for process in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signum)


def wait_until_gone(tree: list[psutil.Process], timeout: float = 90):
    """Every process of the tree has exited (none is left to write into the folder a resume will use)."""
    gone, alive = psutil.wait_procs(tree, timeout=timeout)
    assert not alive, f"still running after {timeout}s: {[p.pid for p in alive]}"


# A hang detector, not a speed check: every process is gone 0.2-2 s after the signal (docs/checkpoints.md; collating
# workers up to 1 s after their rank), and 60 s only catches a run asked to stop that never exits (a rank left in a
# collective, a launcher waiting on a rank for ever).
HANG_LIMIT = 60


def exit_after_stop(process: subprocess.Popen, tree: list[psutil.Process], asked: float) -> str:
    """The launcher's output once every process of the tree has exited, at most HANG_LIMIT s after the stop signal
    was sent at `asked`; otherwise the tree is killed (nothing writes on into the next test) and the test fails."""
    try:
        output, _ = process.communicate(timeout=max(0.1, asked + HANG_LIMIT - time.monotonic()))
        _, alive = psutil.wait_procs(tree, timeout=max(0.1, asked + HANG_LIMIT - time.monotonic()))
    except subprocess.TimeoutExpired:  # the launcher itself is still there
        output, alive = "", tree
    if not alive:
        return output
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=30)
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError):  # ValueError: its output was read already
        output += process.communicate(timeout=30)[0] or ""
    pytest.fail(f"hang: still running {HANG_LIMIT} s after the stop signal: {[p.pid for p in alive]}\n{output[-3000:]}")


def logged_steps(folder) -> list[int]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_step(folder, process, step: int):
    deadline = time.monotonic() + 120
    while max(logged_steps(folder), default=0) < step:
        assert process.poll() is None, f"the run ended before step {step}:\n{process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.002)
    return max(logged_steps(folder))


def checkpoints(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("checkpoint-*"))


def weights(folder):
    return load_file(folder / "model.safetensors")


def assert_same_weights(a, b):
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    differing = [k for k in first if not first[k].equal(second[k])]
    assert not differing, f"weights differ from the uninterrupted run's in {differing[:3]}"


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, data, tmp_path_factory):
    """The reference run on 2 processes, made once and shared by the runs that resume."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_process(command("accelerate", run_args(tiny_model, data, folder, 2)), 300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder


# What examples/slurm_multi_node.sbatch exports so that launchers pass SIGUSR1 on instead of dying of it.
SLURM_LAUNCHER_ENV = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
# launcher, who is signalled, signal, the launcher's exit status, extra environment, whether the run is resumed to the
# end and compared with the uninterrupted one, and extra flags. A checkpoint is the same whichever way the signal came,
# so two multi-process paths resume (a resume is a launch: ~10 s): accelerate's where one rank alone learnt of the
# stop, and torchrun's whose launcher was killed; every path checks the step its checkpoint holds. A single process
# resumes exactly in test_max_time_checkpoints_and_resumes_exactly_in_process. Two runs collate in workers, as runs
# on GPUs do by default, and the signal reaches them too: scancel's SIGTERM, and a SIGINT under torchrun, whose ranks
# (and so their workers) are each in a session of their own.
WORKERS = ("--dataloader_num_workers", "1")
CASES = [
    pytest.param("accelerate", "all", signal.SIGTERM, LAUNCHER_STATUS, {}, False, WORKERS,
                 id="scancel: SIGTERM to every process, collating workers too"),
    pytest.param("torchrun", "all", signal.SIGINT, LAUNCHER_STATUS, {}, False, WORKERS,
                 id="torchrun, SIGINT to every process, collating workers too"),
    pytest.param("accelerate", "launcher", signal.SIGINT, LAUNCHER_STATUS, {}, False, (), id="Ctrl-C at the launcher"),
    pytest.param("torchrun", "launcher", signal.SIGTERM, LAUNCHER_STATUS, {}, False, (),
                 id="docker stop: SIGTERM to torchrun"),
    pytest.param("accelerate", "all", signal.SIGUSR1, LAUNCHER_STATUS, SLURM_LAUNCHER_ENV, False, (),
                 id="SLURM's USR1 warning"),
    pytest.param("accelerate", "one rank", signal.SIGTERM, LAUNCHER_STATUS, {}, True, (),
                 id="SIGTERM to one rank only"),
    # 2 threads: the rank has run torch's thread pool when its workers start.
    pytest.param("python", "all", signal.SIGTERM, 128 + signal.SIGTERM, {}, False, (*WORKERS, "--cpu_threads", "2"),
                 id="python train.py, SIGTERM to it and its collating workers"),
    pytest.param("torchrun", "launcher", signal.SIGKILL, None, {}, True, (), id="launcher killed: its ranks stop"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("launcher,who,signum,status,env,resumed,flags", CASES)
def test_a_signal_saves_the_current_step_and_the_run_resumes_exactly(
    tiny_model, data, uninterrupted, tmp_path, launcher, who, signum, status, env, resumed, flags
):
    ranks = 1 if launcher == "python" else 2
    folder = tmp_path / "interrupted"
    args = run_args(tiny_model, data, folder, ranks, *flags)
    process = start(launcher, args, env)
    process_tree(process, ranks)
    wait_for_step(folder, process, 8)
    tree = process_tree(process, ranks)  # now with the collating workers, started with the first epoch
    # Freeze the run to know where the signal lands: the main rank has logged step `at_step`, so it is in
    # step at_step + 1, at most past that step's stop vote (the vote comes before the log).
    signal_tree(tree, signal.SIGSTOP)
    at_step = max(logged_steps(folder))
    signal_tree(tree, signum, who)
    asked = time.monotonic()
    signal_tree(tree, signal.SIGCONT)
    if who == "all" and launcher == "accelerate":
        # More copies to the ranks while they write the checkpoint (an impatient scheduler) change nothing.
        # (A launcher signalled again while it waits for its ranks gives up waiting: that is torch's choice.)
        for _ in range(10):
            time.sleep(0.02)
            signal_tree(tree[1:], signum)
    output = exit_after_stop(process, tree, asked)
    gone_after = time.monotonic() - asked

    if status is not None:
        assert process.returncode == status, output[-3000:]
    (saved,) = checkpoints(folder)  # the signal's checkpoint, complete, and nothing half-written
    step = int(saved.removeprefix("checkpoint-"))
    print(f"{launcher}, {signal.Signals(signum).name} to {who} in step {at_step + 1}: checkpoint-{step}, "
          f"every process gone {gone_after:.1f} s later")  # fmt: skip
    # A signal that reaches the ranks stops them after the step in flight, or after the next one when it
    # came just after that step's vote. One that only the launcher receives reaches the ranks when the
    # launcher next looks (it polls every 0.1 s, a few of these 30 ms steps).
    last = at_step + 2 if who != "launcher" else at_step + 12
    assert at_step < step <= last < STEPS, f"signal in step {at_step + 1}, checkpoint at {step}"
    assert f"Stopped at step {step}" in output and "--resume_from_checkpoint latest" in output
    reason = "its launcher exited" if signum == signal.SIGKILL else f"received {signal.Signals(signum).name}"
    assert reason in output
    assert not (folder / "all_results.json").exists()
    assert json.loads((folder / saved / "training_state.json").read_text())["global_step"] == step
    if not resumed:
        return
    resume = command(launcher, [*args, "--resume_from_checkpoint", "latest"])
    result = run_process(resume, 300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resuming from {folder / saved} at step {step}" in result.stderr
    assert ranks == 2, "the reference run is on 2 processes"
    reference = uninterrupted
    assert_same_weights(reference, folder)
    assert logged_steps(folder) == logged_steps(reference), "no record lost or doubled by the resume"
    assert json.loads((folder / "all_results.json").read_text())["global_step"] == STEPS


def test_a_collating_worker_outlives_stop_signals_from_others_than_its_rank():
    """A scheduler's SIGTERM reaches every process of the job, collating workers and the fork server they come from
    too, and SLURM's USR1 warning, a closed terminal's SIGHUP and Ctrl-C's SIGINT reach them as well. A worker killed,
    or ended because its server died (torch's workers stop when their parent does), would fail its rank without the
    checkpoint that the rank's own handler saves. Each stop signal sent 5 times to each of the rank's processes from
    another process (`kill`): none may reach the worker's collating, however many threads the rank has run. The
    worker is forked by the server, never by the rank: a child forked from a process with threads can hang."""
    from datasets import Dataset
    from torch.utils.data import default_collate

    from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, build_eval_dataloader
    from src.signals import STOP_SIGNALS

    torch.set_num_threads(2)  # the autouse fixture gives back the threads of before the test
    torch.randn(512, 512) @ torch.randn(512, 512)  # the pool's threads, in this process
    rows = Dataset.from_dict({"x": list(range(40)), LENGTH_COLUMN: [1] * 40, INDEX_COLUMN: list(range(40))})
    batches = (batch["x"].tolist() for batch in build_eval_dataloader(rows, default_collate, 2, 1))
    assert next(batches) == [0, 1]
    started = psutil.Process().children(recursive=True)  # the fork server, its worker, their resource tracker
    workers = [p for p in started if p.ppid() != os.getpid()]
    assert workers, "a worker forked from this process, which has threads"
    for _ in range(5):
        for name in ("TERM", "USR1", "HUP", "INT"):
            subprocess.run(["kill", f"-{name}", *(str(process.pid) for process in started)], check=True)
            time.sleep(0.01)  # delivered one by one: a pending signal would absorb the next
    assert list(batches) == [[i, i + 1] for i in range(2, 40, 2)]
    assert all(p.is_running() for p in started if p not in workers), "the fork server and the resource tracker live on"
    # The rank blocked them only while starting the server: its own handler (the checkpoint) must still receive them.
    assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, set())


# A rank that collates in a worker, then waits to be killed.
COLLATING_RANK = """
import time
from datasets import Dataset
from torch.utils.data import default_collate
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, build_eval_dataloader
rows = Dataset.from_dict({"x": list(range(40)), LENGTH_COLUMN: [1] * 40, INDEX_COLUMN: list(range(40))})
batches = iter(build_eval_dataloader(rows, default_collate, 2, 1))
print(next(batches)["x"].tolist(), flush=True)
time.sleep(300)
"""


def test_a_rank_killed_outright_leaves_no_collating_worker_behind():
    """The OOM killer's SIGKILL leaves a rank no time to stop its workers, and they are not its children but its fork
    server's, which they keep alive (torch's workers watch their parent): they must see for themselves, even before
    the launcher reaps the rank, and the server ends with them."""
    rank = subprocess.Popen([sys.executable, "-c", COLLATING_RANK], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "[0, 1]\n"
        started = psutil.Process(rank.pid).children(recursive=True)  # the fork server, its worker, their tracker
        rank.kill()  # not reaped yet: a zombie until the end of the test
        _, alive = psutil.wait_procs(started, timeout=15)
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()  # not read to its end: the server and the worker hold it too
    left = [" ".join(process.cmdline())[:80] for process in alive]
    for process in alive:
        process.kill()  # not into the next tests
    assert len(started) >= 2 and not left, left


@pytest.mark.slow
def test_kill_9_of_every_process_resumes_from_the_last_checkpoint(tiny_model, data, uninterrupted, tmp_path):
    """On 2 ranks: a kill cuts a rank short wherever it is, a save of either rank included."""
    launcher, ranks = "accelerate", 2
    reference, folder = uninterrupted, tmp_path / "killed"
    args = run_args(tiny_model, data, folder, ranks, "--checkpointing_steps", "5")
    process = start(launcher, args)
    tree = process_tree(process, ranks)
    wait_for_step(folder, process, 12)
    signal_tree(tree, signal.SIGKILL)
    process.wait(timeout=60)
    wait_until_gone(tree)
    complete = [int(name.removeprefix("checkpoint-")) for name in checkpoints(folder) if name[11:].isdigit()]
    assert max(complete) >= 10, checkpoints(folder)

    resume = [*args, "--resume_from_checkpoint", "latest"]
    result = run_process(command(launcher, resume), 300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, folder)
    assert logged_steps(folder) == logged_steps(reference)
    assert not list(folder.glob("*.incomplete")), "a save cut short by the kill is cleaned up"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_each_stop_signal_gives_its_documented_exit_status(tiny_model, data, tmp_path, signum):
    """What every rank exits with after saving: 128 + the signal number (130, 129, 138)."""
    folder = tmp_path / "run"
    args = run_args(tiny_model, data, folder, 1, "--num_train_epochs", "100")  # far longer than this test

    def keep_signalling(stop: threading.Event):  # from the first step on, until the run has stopped
        while not stop.wait(0.05):
            if logged_steps(folder):
                os.kill(os.getpid(), signum)

    stop = threading.Event()
    sender = threading.Thread(target=keep_signalling, args=(stop,))
    # What main() gives back when it ends: a copy sent after that must not end pytest instead.
    previous = signal.signal(signum, lambda *_: None)
    sender.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            train.main(train.parse_train_args(args))
    finally:
        stop.set()
        sender.join()
        signal.signal(signum, previous)
    assert stopped.value.code == 128 + signum
    (saved,) = checkpoints(folder)
    assert json.loads((folder / saved / "training_state.json").read_text())["global_step"] < 1600


def test_max_time_checkpoints_and_resumes_exactly_in_process(tiny_model, data, tmp_path):
    """The resumed half collates in 2 worker processes (--dataloader_num_workers): the same batches, in the same order,
    from the same place in the epoch as the reference run's collated in the process itself."""
    reference, folder = tmp_path / "reference", tmp_path / "timed"
    one_epoch = ("--num_train_epochs", "1")  # train_loss is the last epoch's: the one the checkpoint falls in
    train.main(train.parse_train_args(run_args(tiny_model, data, reference, 1, *one_epoch)))
    with pytest.raises(SystemExit) as stopped:
        train.main(train.parse_train_args(run_args(tiny_model, data, folder, 1, *one_epoch, "--max_time", "1e-9")))
    assert stopped.value.code == 0, "--max_time is a planned stop, not a failure"
    (saved,) = checkpoints(folder)
    assert saved == "checkpoint-1", "the first step takes longer than 60 ns on any machine"
    # A checkpoint of an earlier version, which added the ranks' loss sums up into epoch_loss_sum, resumes too.
    earlier = tmp_path / "earlier"
    shutil.copytree(folder, earlier)
    state_file = earlier / saved / "training_state.json"
    state = json.loads(state_file.read_text())
    state["epoch_loss_sum"] = sum(state.pop("epoch_loss_by_rank"))
    state_file.write_text(json.dumps(state))
    resume = ("--resume_from_checkpoint", "latest", "--dataloader_num_workers", "2")
    train.main(train.parse_train_args(run_args(tiny_model, data, folder, 1, *one_epoch, *resume)))
    assert_same_weights(reference, folder)
    assert logged_steps(folder) == logged_steps(reference), "no record lost or doubled by the resume"
    # The step losses summed so far are carried over as they were, so train_loss is the same to the last bit.
    losses = [json.loads((run / "all_results.json").read_text())["train_loss"] for run in (reference, folder)]
    assert losses[0] == losses[1]
    train.main(train.parse_train_args(run_args(tiny_model, data, earlier, 1, *one_epoch, "--resume_from_checkpoint",
                                               "latest")))  # fmt: skip
    assert json.loads((earlier / "all_results.json").read_text())["train_loss"] == pytest.approx(losses[0], rel=1e-6)


def test_main_gives_back_the_signal_handlers_it_found(tiny_model, data, tmp_path):
    def mine(signum, frame):
        pass

    previous = {signum: signal.signal(signum, mine) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        train.main(train.parse_train_args(run_args(tiny_model, data, tmp_path / "out", 1, "--max_train_steps", "2",
                                                   "--mixed_precision", "no")))  # fmt: skip
        assert all(signal.getsignal(signum) is mine for signum in previous)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    # And Accelerate's state: a later run in this process (or notebook_launcher) may choose another precision.
    from accelerate import Accelerator

    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"


def test_a_signal_during_the_final_save_stops_the_run_once_it_is_saved(tiny_model, data, tmp_path, monkeypatch):
    """Ctrl-C while the model is saved: the save ends, then the run stops as a signal in the loop would (a loop over
    seeds in a notebook or script ends there), not as if it had not been pressed."""
    save_final = train.save_final

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        save_final(*args)

    monkeypatch.setattr(train, "save_final", interrupted)
    from accelerate import PartialState

    PartialState(cpu=True)  # the caller's own Accelerate state (a notebook_launcher function's, say)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        train.main(train.parse_train_args(run_args(tiny_model, data, out, 1, "--max_train_steps", "2",
                                                   "--mixed_precision", "no")))  # fmt: skip
    assert stopped.value.code == 128 + signal.SIGINT
    assert (out / "all_results.json").is_file() and (out / "model.safetensors").is_file()
    assert PartialState._shared_state, "main() leaves a state it did not set up"
    # The run's precision went with it: the caller's next Accelerator may choose another.
    from accelerate import Accelerator

    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"


# train.py whose rank 1, in its final save, signals itself (SIGNAL=USR1: one rank of the job signalled, as a kill of
# one process or one node preempted), or (SIGNAL=wait) says so in a file and saves once the test has signalled.
SIGNALLED_WHILE_SAVING = f"""
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
import train

save_final = train.save_final

def save_final_signalled(run, *args):
    if os.environ["RANK"] == "1" and os.environ["SIGNAL"] == "USR1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif os.environ["RANK"] == "1":
        Path(os.environ["SAVING"]).touch()
        while not run.stop_signals.received:
            time.sleep(0.01)
    save_final(run, *args)

train.save_final = save_final_signalled
train.run_cli(train.main, train.parse_train_args)
"""


def signalled_run(tiny_model, data, folder, signal_name: str) -> tuple[list[str], dict]:
    """The launch command of SIGNALLED_WHILE_SAVING on 2 ranks, and its environment."""
    script = folder / "signalled_train.py"  # "train.py" in its name: process_tree finds its ranks
    script.write_text(SIGNALLED_WHILE_SAVING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SIGNAL": signal_name,
           "SAVING": str(folder / "saving")}  # fmt: skip
    return launch_command(str(script), run_args(tiny_model, data, folder / "out", 2, "--max_train_steps", "2")), env


def test_a_signal_to_one_rank_during_the_final_save_stops_every_rank_once_saved(tiny_model, data, tmp_path):
    """The ranks agree: rank 0, not signalled, stops too (and would not upload), after the save has ended. Rank 1 gets
    SIGUSR1: a launcher whose rank exits early sends SIGTERM to the others, which must not be what stops rank 0."""
    command, env = signalled_run(tiny_model, data, tmp_path, "USR1")
    result = run_process(command, 300, cwd=REPO, env=env)
    assert result.returncode == LAUNCHER_STATUS, result.stderr[-3000:]
    assert "The run finished and is saved, and stops here (received SIGUSR1)" in result.stderr  # rank 0's log
    assert (tmp_path / "out" / "all_results.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


def test_scancel_during_the_final_save_lets_it_finish(tiny_model, data, tmp_path):
    """SLURM's SIGTERM to every process of the job (launcher and ranks) while rank 1 saves: the save ends, every
    process exits, and the folder holds the finished run."""
    command, env = signalled_run(tiny_model, data, tmp_path, "wait")
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    tree = process_tree(process, 2)
    deadline = time.monotonic() + 120
    while not (tmp_path / "saving").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.01)
    asked = time.monotonic()
    signal_tree(tree, signal.SIGTERM, "all")
    output = exit_after_stop(process, tree, asked)
    assert process.returncode != 0, output[-3000:]
    assert "The run finished and is saved, and stops here (received SIGTERM)" in output
    assert (tmp_path / "out" / "all_results.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


def test_outside_the_main_thread_stop_signals_are_not_caught_and_say_so(caplog):
    """main() in a thread (a web app's, a notebook's): Python installs signal handlers in the main thread only."""
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's logger
    requested = []

    def enter():
        with train.StopSignals() as stop_signals:
            requested.append(stop_signals.requested())

    with caplog.at_level("WARNING"):
        thread = threading.Thread(target=enter)
        thread.start()
        thread.join()
    assert requested == [0] and "outside the main thread, where Python cannot catch signals" in caplog.text


def test_nohup_keeps_the_run_going_when_its_terminal_closes(tiny_model, data, tmp_path):
    """`nohup python train.py &`: the SIGHUP of a closed terminal, which nohup ignores, must not stop the run."""
    folder = tmp_path / "run"
    args = run_args(tiny_model, data, folder, 1)
    process = subprocess.Popen(["nohup", *command("python", args)], cwd=tmp_path, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wait_for_step(folder, process, 8)
    signal_tree(process_tree(process, 1), signal.SIGHUP)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert json.loads((folder / "all_results.json").read_text())["global_step"] == STEPS
    assert not checkpoints(folder), "no stop, so no checkpoint"


FAKE_SLURM = {
    # srun: records its command, then plays a training step that saves a checkpoint when signalled.
    "srun": """#!/bin/bash
echo "$*" >> "$FAKE_LOG/srun"
echo $$ > "$FAKE_LOG/srun.pid"
case "$FAKE_OUTCOME" in
  finish) mkdir -p "$OUTPUT_DIR" && echo {} > "$OUTPUT_DIR/all_results.json"; exit 0 ;;
  crash) exit 3 ;;
esac
trap 'mkdir -p "$OUTPUT_DIR/checkpoint-7" && echo {} > "$OUTPUT_DIR/checkpoint-7/training_state.json"; exit 1' USR1
while true; do sleep 0.05; done
""",
    # scancel --signal=USR1 JOB: the signal goes to the job step's processes (here: the fake srun).
    "scancel": """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scancel"
kill -USR1 "$(cat "$FAKE_LOG/srun.pid")"
""",
    "scontrol": """#!/bin/bash
case "$1" in
  show) echo node0 ;;
  *) echo "$*" >> "$FAKE_LOG/scontrol" ;;
esac
""",
}


def test_the_slurm_script_checkpoints_and_requeues_itself_before_the_time_limit(tmp_path):
    """examples/slurm_multi_node.sbatch's own logic, with stand-ins for srun, scancel and scontrol."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "OUTPUT_DIR": str(tmp_path / "run")}  # fmt: skip

    def attempt(outcome: str, warn: bool = False) -> subprocess.CompletedProcess:
        (log / "srun.pid").unlink(missing_ok=True)
        job = subprocess.Popen(["bash", str(REPO / "examples" / "slurm_multi_node.sbatch")], cwd=tmp_path,
                               env={**env, "FAKE_OUTCOME": outcome}, stdout=subprocess.PIPE, text=True)  # fmt: skip
        if warn:  # SLURM's `--signal=B:USR1@300`: SIGUSR1 to the batch shell alone
            while not (log / "srun.pid").exists():
                time.sleep(0.01)
            job.send_signal(signal.SIGUSR1)
        output, _ = job.communicate(timeout=60)
        return subprocess.CompletedProcess(job.args, job.returncode, output)

    def lines(name):
        return (log / name).read_text().splitlines() if (log / name).exists() else []

    # A save cut short by an earlier attempt is no checkpoint to resume from.
    (tmp_path / "run" / "checkpoint-3.incomplete").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-3.incomplete" / "training_state.json").write_text("{}")
    first = attempt("run", warn=True)
    assert first.returncode == 0, first.stdout
    assert lines("scancel") == ["--signal=USR1 42"] and lines("scontrol") == ["requeue 42"]
    assert "--resume_from_checkpoint" not in lines("srun")[0]

    second = attempt("finish")  # the requeued job: it resumes and this time finishes
    assert second.returncode == 0 and "--resume_from_checkpoint latest" in lines("srun")[1]
    assert lines("scontrol") == ["requeue 42"], "a finished run is not requeued"

    (tmp_path / "run" / "all_results.json").unlink()
    crashed = attempt("crash")
    assert crashed.returncode == 3 and lines("scontrol") == ["requeue 42"], "a crash is not requeued"

    # A job's first submission, into a folder that does not exist yet: nothing to resume (an unmatched pattern is
    # left as text by bash, and must not count as a checkpoint).
    env["OUTPUT_DIR"] = str(tmp_path / "new")
    fresh = attempt("finish")
    assert fresh.returncode == 0 and "--resume_from_checkpoint" not in lines("srun")[-1]


def test_the_first_stop_signal_is_the_one_kept(monkeypatch):
    """SLURM's USR1 warning, then the SIGTERM of the time limit: the run stops for the first, and later signals change
    neither why (the log) nor its exit status. A rank whose launcher is gone stops as if sent SIGHUP, and says why."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    previous = {signum: signal.signal(signum, lambda *_: None) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        with train.StopSignals() as stop_signals:
            assert stop_signals.requested() == 0
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_signals.requested() == signal.SIGUSR1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    monkeypatch.setenv("LOCAL_RANK", "0")  # under a launcher, which then exits: the rank is reparented
    stop_signals = train.StopSignals()
    assert stop_signals.requested() == 0, "its launcher is still there"
    monkeypatch.setattr(os, "getppid", lambda: stop_signals.launcher + 1)
    assert stop_signals.requested() == signal.SIGHUP and stop_signals.describe(signal.SIGHUP) == "its launcher exited"


def test_a_signal_in_the_last_step_stops_with_a_checkpoint_not_the_final_save(tiny_model, data, tmp_path, monkeypatch):
    """The job's grace time may not hold the final evaluation and save: a signal in the run's last step saves a
    checkpoint and stops, as in any other step (its resume then finishes the run)."""
    train_step = train.train_step

    def signalled_step(run, batches):
        train_step(run, batches)
        os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(train, "train_step", signalled_step)
    folder = tmp_path / "run"
    args = run_args(tiny_model, data, folder, 1, "--max_train_steps", "1", "--mixed_precision", "no")
    with pytest.raises(SystemExit) as stopped:
        train.main(train.parse_train_args(args))
    assert stopped.value.code == 128 + signal.SIGUSR1
    assert checkpoints(folder) == ["checkpoint-1"] and not (folder / "all_results.json").exists()
