"""What a run takes from its machine and its launcher: CPU threads, the Accelerator (whose process-wide state main()
drops at its end), a refusal of FSDP where it cannot shard, and when the scripts collect garbage.

`accelerate launch` and torchrun set OMP_NUM_THREADS=1, which would leave a CPU run on one core per process.
"""

import gc
import os
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs

from src import errors
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


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity: a SLURM job's or taskset's share), or all of them."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


# A container's CPU limit (Kubernetes' `limits.cpu`, `docker run --cpus`) as its cgroup shows it: version 2 in one
# file ("400000 100000": 4 CPUs' time per period; "max ...": none), version 1 in two (a quota of -1: none).
CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")


def cpu_limit() -> int | None:
    """How many CPUs' time a container's CPU limit allows (rounded down, at least 1), None without a limit. Affinity
    does not show it: a pod limited to 4 CPUs on a 64-core host sees 64 CPUs, and 64 threads there are throttled to
    4 CPUs' time, each waiting for the others at every operation."""
    try:
        quota, period = CGROUP_V2_CPU_MAX.read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = ((CGROUP_V1_CPU / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period"))
        except OSError:
            return None
    try:
        return max(1, int(quota) // int(period)) if quota not in ("max", "-1") else None
    except (ValueError, ZeroDivisionError):  # a file this does not know how to read: no limit, as before it was read
        return None


def usable_cpu_count() -> int:
    """The logical CPUs this process may keep busy: its affinity's, no more than a container's CPU limit."""
    cpus, limit = len(usable_cpus()), cpu_limit()
    return min(cpus, limit) if limit else cpus


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads share a core's matmul units), no more
    than a container's CPU limit."""
    cpus = usable_cpus()
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no sysfs (macOS, some containers): count logical CPUs
            cores = cpus
            break
    return max(1, min(len(cores), cpu_limit() or len(cores)))


def under_launcher() -> bool:
    """Started by torchrun or `accelerate launch` (which sets LOCAL_RANK or, for one process, its own variables)."""
    return "LOCAL_RANK" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ


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
        try:  # the environment the launcher was started with (what the user exported)
            inherited = Path(f"/proc/{os.getppid()}/environ").read_bytes()
        except OSError:
            return None
        if b"\0OMP_NUM_THREADS=" not in b"\0" + inherited:
            return None
    return int(value)


def launched_fewer_than_asked(num_processes: int) -> str | None:
    """A warning if the `accelerate launch` that started this process (its command line in /proc, on Linux) was asked
    for more than the run's `num_processes`: its one-process launcher, which `--cpu`, or no saved `accelerate config`
    and no --multi_gpu, selects, starts one process whatever --num_processes says, and says nothing."""
    if not under_launcher():
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for flag, following in zip(argv, argv[1:]):
        name, _, value = flag.partition("=")
        if name in ("--num_processes", "--num-processes"):
            asked = value or following
            if asked.isdigit() and int(asked) > num_processes:
                return (f"`accelerate launch --num_processes {asked}` started {num_processes} process: with --cpu, "
                        "or without a saved `accelerate config`, it starts one whatever the number; for "
                        f"{asked} CPU processes add --config_file accelerate_configs/cpu.yaml "
                        "(or --multi_gpu)")  # fmt: skip
            return None
    return None


def local_world_size() -> int:
    return next((int(os.environ[name]) for name in LOCAL_WORLD_SIZE_VARIABLES if name in os.environ), 1)


def set_cpu_threads(requested: int | None) -> int:
    """Give this process its share of the machine's cores, or what the user chose (`requested` is --cpu_threads)."""
    threads = requested or threads_chosen_by_user() or max(1, physical_cores() // local_world_size())
    torch.set_num_threads(threads)
    return threads


def collection_resumes(script: bool):
    """Garbage collection back on once a script is set up, and what the setup made frozen (never scanned again).

    Run as scripts, train.py and evaluate.py switch collection off before their imports and freeze what the imports
    made. The setup (the imports, then the model's code, the data and the model) makes millions of objects that live
    as long as the run, and hardly any garbage; collecting over and over during it took ~1.3 s of the ~5 s it costs
    on a small CPU. Imported, or under IPython's `%run`, `script` is False and collection stays as the caller had it.
    """
    if script:
        # The setup's garbage, once: a few thousand small objects (the argument parser's cycles; frames that torch.fx
        # keeps in a cycle while transformers imports the model's code, which hold the setup functions' locals until
        # now). Frozen uncollected, they would stay for the whole run.
        gc.collect()
        gc.freeze()
        gc.enable()


def refuse_fsdp_without_gpus():
    """accelerate shards with FSDP only on GPUs (and other accelerators): launched with an FSDP config on CPUs, it
    runs plain DDP and says nothing. `accelerate launch` tells each rank of an FSDP config by ACCELERATE_USE_FSDP,
    which Accelerator reads as below. A named function, for tests that mean to run FSDP's code paths on CPUs."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.accelerator.is_available():
        raise UserError(
            "accelerate_configs/fsdp.yaml (FSDP) needs GPUs and this machine has none (accelerate would quietly run "
            "without sharding): launch with --config_file accelerate_configs/cpu.yaml instead"
        )


def make_accelerator(args, saved_precision: str | None, find_unused_parameters: bool | None = None, **options):
    """The Accelerator (with `options`), why it has its precision (--mixed_precision, else `saved_precision`: the
    run's, else as src/precision.py chooses), and the CPU threads each process uses. `find_unused_parameters`: DDP's
    (--ddp_find_unused_parameters), None for on with 3 or more processes."""
    from src.precision import choose_precision

    on_cpu = not torch.accelerator.is_available()
    # Without cpu=True, torchrun or `--multi_gpu` on a machine without GPUs would start N unrelated
    # single-process runs instead of N ranks of one. The process group comes first: rank 0 may time both
    # precisions on this machine's threads, and every rank takes its answer.
    state = PartialState(cpu=on_cpu, timeout=timedelta(seconds=args.ddp_timeout))
    if state.num_processes < int(os.environ.get("WORLD_SIZE", "1")):  # made before this, without cpu=True
        raise UserError(
            f"{os.environ['WORLD_SIZE']} processes were launched, and accelerate's state, set up before the run's "
            f"Accelerator (by a tracker's __init__, say), has {state.num_processes}: each would run alone; create "
            "nothing of accelerate's before build_accelerator (a tracker: in its start())"
        )
    if not on_cpu:  # TF32: what stays fp32 runs on tensor cores too, in evaluate.py as in training's evaluations
        torch.set_float32_matmul_precision("high")
    threads = set_cpu_threads(args.cpu_threads) if on_cpu else torch.get_num_threads()
    cores = physical_cores() if on_cpu else None  # reads sysfs for every CPU: once
    if on_cpu and local_world_size() > cores:  # a GPU config (multi_gpu.yaml's 8) on a machine without GPUs
        get_logger(__name__).warning(
            f"{local_world_size()} processes share this machine's {cores} CPU cores (it has no GPU): they "
            f"wait for each other; launch at most --num_processes {cores} (with --config_file "
            "accelerate_configs/cpu.yaml, whose threads are set for CPUs)"
        )
    if warning := launched_fewer_than_asked(state.num_processes):
        get_logger(__name__).warning(warning)
    precision, reason = choose_precision(args.mixed_precision, on_cpu, saved_precision)
    # DDP reorders its gradient buckets after a process's first step, so the first step after a resume would sum 3 or
    # more ranks' gradients in another order than the uninterrupted run (2 sum alike in any order). Looking for unused
    # parameters keeps the order, and resume exact, for a walk of the autograd graph per step (and torch's warning).
    if find_unused_parameters is None:
        find_unused_parameters = state.num_processes > 2
    handlers = list(options.pop("kwargs_handlers", []))
    if not any(isinstance(handler, DistributedDataParallelKwargs) for handler in handlers):  # a caller's own wins
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters))
    with one_precision_per_process(precision):
        accelerator = Accelerator(cpu=on_cpu, mixed_precision=precision, kwargs_handlers=handlers, **options)
        return accelerator, reason, threads


def let_go_of_the_variables(err: BaseException):
    """A notebook (or a loop over runs) keeps the traceback of a failed run, and with it the variables of its frames:
    the model and optimizer (GPU memory the next try needs) and persistent collating workers. The lines stay; the
    variables go, those of the exceptions it was raised from or during too, and at once: they hold reference cycles,
    and GPU memory running short triggers no garbage collection. (`%debug` then shows no variables.)"""
    seen, pending = set(), [err]
    while pending:
        exception = pending.pop()
        if exception is None or id(exception) in seen:
            continue
        seen.add(id(exception))
        traceback.clear_frames(exception.__traceback__)
        pending += [exception.__cause__, exception.__context__, *getattr(exception, "exceptions", ())]
    gc.collect()


def _called_by_a_reimported_script() -> bool:
    """Whether the module-level code of a script that multiprocessing imports again, as `__mp_main__`, to start a
    spawned worker or fork server, is what calls: a target function of torch.multiprocessing.spawn is not."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


@contextmanager
def accelerate_state_of_this_run():
    """Around main(): Accelerate's state of the process that main() sets up (precision, devices, the ended process
    group) is dropped when main() returns, stops or fails, so that a later run in the same notebook kernel or script,
    in any precision, starts as in a new process. A caller's own state stays: its Accelerator's whole, or the
    PartialState of a notebook_launcher function (the run's precision is dropped from it all the same). So does the
    caller's float32 matmul precision, which a run on a GPU sets to TF32. What a failed run held is let go with it."""
    from accelerate.state import AcceleratorState, GradientState

    if _called_by_a_reimported_script():
        raise UserError(
            "main() called as a collating worker (or its fork server) imported your script, which calls it outside "
            '`if __name__ == "__main__":`; a second run would start in the worker: put the calls under that guard'
        )
    callers_partial_state, callers_accelerator = bool(PartialState._shared_state), bool(AcceleratorState._shared_state)
    try:
        matmul_precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through torch's newer fp32_precision switches, which this getter refuses to read
        matmul_precision = None
    try:
        yield
    except BaseException as err:
        # A failed run's process group, left to the interpreter's exit, has gloo's threads torn down in no set order,
        # and a rank may abort (SIGABRT) instead of exiting with its status; end_training() ends it when a run ends.
        if not callers_partial_state and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if not errors.process_ends_with_main:
            let_go_of_the_variables(err)
        raise
    finally:
        if matmul_precision is not None:
            torch.set_float32_matmul_precision(matmul_precision)
        if not callers_accelerator:
            AcceleratorState._reset_state(reset_partial_state=not callers_partial_state)
            GradientState._reset_state()


@contextmanager
def one_precision_per_process(precision: str):
    """Around creating the Accelerator: Accelerate fixes the precision for the life of the process, so a second run
    in one notebook kernel or script (train.py's or evaluate.py's main()) that chose another is one line, not a
    ValueError about its internal state."""
    try:
        yield
    except ValueError as err:
        if "already been initialized" not in str(err) or "mixed_precision=" not in str(err):
            raise  # another setting (cpu=True after a GPU run) keeps Accelerate's own message
        from accelerate.state import AcceleratorState

        earlier = AcceleratorState().mixed_precision
        raise UserError(
            f"an earlier run in this process set up Accelerate with mixed precision {earlier!r}, and this one chose "
            f"{precision!r}, which Accelerate cannot change within a process: pass --mixed_precision {earlier}, or "
            "restart the kernel (or start a new process) for this run"
        ) from err
