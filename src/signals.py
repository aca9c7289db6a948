"""Stop signals turned into a checkpoint, a vote so that every rank stops at the same step, and collating workers that
outlive a scheduler's SIGTERM.

SLURM and systemd signal every process of a job at once (and the launcher forwards the signal again), and Ctrl-C
or a container's stop reaches only the launcher.
"""

import multiprocessing
import os
import signal
import threading

import torch
from accelerate.logging import get_logger

from src.runtime import under_launcher

# SIGTERM: SLURM, Kubernetes, systemd and `docker stop`; SIGINT: Ctrl-C; SIGHUP: a closed terminal;
# SIGUSR1: SLURM's warning before the time limit (`#SBATCH --signal=USR1@120`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

logger = get_logger(__name__)


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
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():  # main() in a thread (a web app, a notebook's)
            logger.warning("train.py runs outside the main thread, where Python cannot catch signals: a stop signal "
                           "ends it without a checkpoint (--max_time still stops with one)")  # fmt: skip
            return self
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


def workers_context():
    """The multiprocessing context of the collating workers (src/loaders.py): under fork (Linux's default before
    Python 3.14), workers born with SIGTERM blocked, else None (the default). A worker forked from a rank that has
    run torch's thread pool gets threads of its own before its worker_init_fn runs; blocking SIGTERM there left them
    to catch the scheduler's, of which the worker died (4 tries in 4 with --dataloader_num_workers 2). Blocked in
    the rank's thread across the fork, the signal is blocked in every thread the worker will have; the rank's mask
    comes back at once (a SIGTERM sent meanwhile is delivered then). Spawned workers start with one thread."""
    # The method set, else the platform's default (the first listed), without setting it as get_start_method() would.
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if method != "fork":
        return None
    from multiprocessing.context import ForkContext, ForkProcess

    class WorkerProcess(ForkProcess):
        def start(self):
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                super().start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    class WorkerContext(ForkContext):
        Process = WorkerProcess

    return WorkerContext()


def take_sigterm_from_the_rank_only(rank: int, worker_id: int):
    """A collating worker's `worker_init_fn` (src/loaders.py), for process `rank`. SLURM and systemd send SIGTERM to
    every process of a job, collating workers too. torch's workers die of a SIGTERM that their rank did not send,
    and the rank then fails where its own handler would have saved a checkpoint. So the signal is blocked (under
    fork, from the start and in every thread: workers_context), and a thread waits for it and ends the worker when
    the rank sent it (multiprocessing stops a rank's workers so as it exits, and waits for them). The rank's process
    id is given, not read as the parent's: under forkserver (Python 3.14's default) the parent is the server.
    Without sigwaitinfo (macOS), torch's handling stays."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for this thread and the threads it starts

    def end_on_the_ranks_sigterm():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
            pass  # the scheduler's: the rank saves a checkpoint, then stops its workers
        os._exit(0)

    threading.Thread(target=end_on_the_ranks_sigterm, daemon=True).start()
