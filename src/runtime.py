"""What a run takes from its machine and its launcher: CPU threads and stop signals.

Launchers and schedulers meddle with both: `accelerate launch` and torchrun set OMP_NUM_THREADS=1,
SLURM and systemd signal every process of a job at once (and the launcher forwards the signal again),
and Ctrl-C or a container's stop reaches only the launcher.
"""

import os
import signal
from pathlib import Path

import torch

from src.errors import UserError

# The variables by which launchers tell a rank how many ranks share its machine: torchrun and accelerate,
# MPI, accelerate's notebook_launcher. WORLD_SIZE comes last (debug_launcher sets nothing else): it assumes
# every rank is on this machine, which at worst gives each fewer threads.
LOCAL_WORLD_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "NPROC",
    "WORLD_SIZE",
)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads share a core's matmul units)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no sysfs (macOS, some containers): count logical CPUs
            return len(cpus)
    return max(1, len(cores))


def under_launcher() -> bool:
    """Started by torchrun or `accelerate launch` (which sets LOCAL_RANK or, for one process, its own variables)."""
    return "LOCAL_RANK" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ


def local_world_size() -> int:
    return next((int(os.environ[name]) for name in LOCAL_WORLD_SIZE_VARIABLES if name in os.environ), 1)


def launcher_environment() -> dict[str, str] | None:
    """The environment the launcher itself was started with (what the user exported), or None if unknown."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def threads_chosen_by_user() -> int | None:
    """OMP_NUM_THREADS if a person chose it, None if it is unset or a launcher's default.

    `accelerate launch` (any number of processes) and torchrun (2 or more) write OMP_NUM_THREADS=1 when it
    is unset, which leaves all but one core idle on a CPU run. A value other than 1 is always someone's
    choice. A 1 is the user's only if the launcher was itself started with OMP_NUM_THREADS in its
    environment, which /proc/<launcher>/environ still shows (on Linux); without a launcher it is the user's.
    """
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value.isdigit() or int(value) < 1:
        return None
    if int(value) == 1 and under_launcher():
        inherited = launcher_environment()
        if inherited is None or "OMP_NUM_THREADS" not in inherited:
            return None
    return int(value)


def set_cpu_threads(requested: int | None) -> int:
    """Give this process its share of the machine's cores, or what the user chose (`requested` is --cpu_threads)."""
    threads = requested or threads_chosen_by_user() or max(1, physical_cores() // local_world_size())
    torch.set_num_threads(threads)
    return threads


def refuse_fsdp_without_gpus():
    """accelerate shards with FSDP only on GPUs (and other accelerators): launched with an FSDP config on CPUs, it
    runs plain DDP and says nothing. `accelerate launch` tells each rank of an FSDP config by ACCELERATE_USE_FSDP,
    which Accelerator reads as below. A named function, for tests that mean to run FSDP's code paths on CPUs."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.accelerator.is_available():
        raise UserError(
            "accelerate_configs/fsdp.yaml (FSDP) needs GPUs and this machine has none (accelerate would quietly run "
            "without sharding): launch with --config_file accelerate_configs/cpu.yaml instead"
        )


# SIGTERM: SLURM, Kubernetes, systemd and `docker stop`; SIGINT: Ctrl-C; SIGHUP: a closed terminal;
# SIGUSR1: SLURM's warning before the time limit (`#SBATCH --signal=USR1@120`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


class StopSignals:
    """Turns the stop signals into a request to save a checkpoint after the current step and exit.

    A scheduler that signals every process of a job makes each rank receive the signal twice: once
    directly and once forwarded by its launcher. Every later signal is therefore ignored: it must not
    interrupt the checkpoint the first one asked for. To stop at once, send every process SIGKILL: the
    checkpoint being written then stays `checkpoint-N.incomplete`, is never resumed from, and is removed by
    the next run.

    A rank whose launcher has died (killed with SIGKILL, say) is an orphan that nobody will stop; it stops
    as if it had received SIGHUP. Use as a context manager: the previous handlers come back on exit.
    """

    def __init__(self):
        self.received = 0
        self.orphaned = False
        # Only under a launcher: a plain `python train.py` whose shell exits (nohup, tmux) must keep running.
        self.launcher = os.getppid() if under_launcher() else None

    def __enter__(self):
        # A signal ignored by whoever started us stays ignored: `nohup python train.py &` must outlive its
        # terminal's SIGHUP, as a shell's background job ignores Ctrl-C.
        self.previous = {
            signum: signal.signal(signum, self.handle)
            for signum in STOP_SIGNALS
            if signal.getsignal(signum) != signal.SIG_IGN
        }
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum, frame):
        self.received = self.received or signum

    def requested(self) -> int:
        """The number of the first stop signal received, or 0."""
        if not self.received and self.launcher is not None and os.getppid() != self.launcher:
            self.received, self.orphaned = signal.SIGHUP, True
        return self.received

    def describe(self, signum: int) -> str:
        """Why the run stops, for the log (`signum` may have come from another rank)."""
        self.requested()  # this rank may learn only now that its launcher is gone too
        if signum == signal.SIGHUP and self.orphaned:
            return "its launcher exited"
        return f"received {signal.Signals(signum).name}"


class StopVote:
    """One vote per optimizer step in which every rank learns whether any rank must stop, so that all stop at
    the same step.

    The vote is a collective but need not make the host wait for the GPU: on CUDA the vote cast at one step
    is read at the next, by which time it is done, so the host keeps queueing work ahead of the GPU. On the
    CPU (gloo, or one process) it is read at once.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.lagged = accelerator.device.type == "cuda"
        self.pending = None

    def agree(self, flags: list[int]) -> list[int]:
        """The maximum of each flag over all ranks (of the previous step's vote on CUDA)."""
        votes = torch.tensor([int(f) for f in flags], pin_memory=self.lagged)
        agreed = self.accelerator.reduce(votes.to(self.accelerator.device, non_blocking=True), reduction="max")
        if not self.lagged:
            return agreed.tolist()
        result = torch.empty_like(votes, pin_memory=True).copy_(agreed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, self.pending = self.pending, (result, done)
        if previous is None:
            return [0] * len(flags)
        previous[1].synchronize()
        return previous[0].tolist()
