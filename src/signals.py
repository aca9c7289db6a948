"""Stop signals turned into a checkpoint, a vote so that every rank stops at the same step, and collating workers that
outlive a scheduler's SIGTERM.

SLURM and systemd signal every process of a job at once (and the launcher forwards the signal again), and Ctrl-C
or a container's stop reaches only the launcher.
"""

import multiprocessing
import os
import select
import signal
import sys
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
    """The multiprocessing context of the collating workers (src/loaders.py): a fork server where the platform would
    fork (Linux before Python 3.14), else the platform's own (spawn on macOS and Windows, forkserver from 3.14).

    Not fork: a rank has threads (gloo's, torch's, the training loader's), and a child forked while another thread
    holds the interpreter's thread-state lock waits for it forever (CPython gh-112275, in 3.11.7 here, seen with gdb;
    Python 3.12 warns of any fork with threads). 2-rank runs evaluating every step, one worker each, hung 3 times in
    190, the other rank waiting in its next collective. The fork server is one process per rank, started by fork and
    exec, that imports what the workers need once and forks each of them. It blocks the stop signals: a scheduler
    sends them to every process of a job, and torch's workers end when their parent does (end_with_the_rank ends
    them with their rank instead); the server ends when its rank and workers have. Workers receive the collator
    pickled, and run the main script again (without its `if __name__ == "__main__":` part), as under spawn."""
    # The method set, else the platform's default (the first listed), without setting it as get_start_method() would.
    # A method set to fork is replaced too: the workers are the loaders' own.
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if method not in ("fork", "forkserver"):
        return None
    from multiprocessing import forkserver, resource_tracker

    context = multiprocessing.get_context("forkserver")
    # The project's modules imported here, and with them torch, datasets and transformers. A worker also runs the main
    # script again (train.py: multiprocessing's rule for __main__), which then costs nothing. ("__main__" in this list
    # would do nothing: Python 3.11 does not pass the server its path.)
    project = __name__.split(".")[0]
    context.set_forkserver_preload(sorted(name for name in sys.modules if name.split(".")[0] == project))
    # Started with the stop signals blocked, which the server, its workers and the resource tracker inherit (a worker
    # would die of SIGUSR1 or SIGHUP, and end at a SIGINT): the rank alone decides when they stop. Blocked in this
    # thread only, so that a signal meanwhile still reaches the rank's handler.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # it unblocks SIGINT and SIGTERM as it starts: blocked again below
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()  # now, as the loaders are made, not at their first batch
    except ChildProcessError:
        # This process was forked from one that had started its fork server (notebook_launcher's ranks, after a run
        # with workers in the kernel): multiprocessing keeps one server per process, and checks on the inherited one
        # as its parent, which this process is not. Spawned workers: slower to start, and never forked either.
        return multiprocessing.get_context("spawn")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return context


def end_with_the_rank(rank: int, worker_id: int):
    """A collating worker's `worker_init_fn` (src/loaders.py), for process `rank`: the worker ends when its rank sends
    SIGTERM or has ended, and outlives anyone else's SIGTERM and the other stop signals. SLURM and systemd signal
    every process of a job; a worker that died of it would fail its rank where the rank's own handler saves a
    checkpoint. A rank killed outright (the OOM killer) leaves its workers to the fork server, which they keep alive
    and torch's workers watch (their parent): they end here instead. Without sigtimedwait (macOS), torch's handling
    stays."""
    if not hasattr(signal, "sigtimedwait"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # for this thread and the threads it starts
    try:
        ended = os.pidfd_open(rank)  # readable once the rank has ended, reaped by its launcher or not (Linux 5.3)
    except (AttributeError, OSError):
        ended = None

    def rank_ended() -> bool:
        if ended is not None:
            return bool(select.select([ended], [], [], 0)[0])
        try:
            os.kill(rank, 0)
        except OSError:
            return True
        return False

    def wait_for_the_rank():
        while True:
            sent = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if sent is not None and sent.si_pid == rank or rank_ended():
                os._exit(0)  # multiprocessing stops a rank's workers so as it exits, and waits for them

    threading.Thread(target=wait_for_the_rank, daemon=True).start()
