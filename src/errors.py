"""The one exception type for user mistakes, how the scripts report it, and how it reaches every rank."""

import gc
import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist


class UserError(Exception):
    """A mistake in the command line, a config file or the data: reported in one line, without a traceback."""


@contextmanager
def about(what: str):
    """A UserError raised within names `what` first: "the validation data: label column 'label' has empty values"."""
    try:
        yield
    except UserError as err:
        raise UserError(f"{what}: {err}") from err


@contextmanager
def main_process_first(accelerator, timeout: float | None = None):
    """`accelerator.main_process_first()`, except that a failure on the main process (a mistake in the data, a
    download that fails) stops every rank with its message, instead of leaving the others in a barrier that fails
    with a traceback.

    `timeout` (seconds, --data_preparation_timeout): how long the other ranks may wait for the main process, which
    may download and tokenise a large dataset for hours. They wait on a gloo group of their own with that timeout,
    so that the run's process group keeps its short one (--ddp_timeout) for the training collectives, where a long
    wait means a dead or hung rank. Without it they wait on the run's group.
    """
    if accelerator.is_main_process:
        with errors_reach_every_rank(accelerator, timeout):
            yield
    else:
        with errors_reach_every_rank(accelerator, timeout):
            pass  # waits for the main process: its failure is raised here
        yield


@contextmanager
def errors_reach_every_rank(accelerator, timeout: float | None = None):
    """For work that every rank does at once but whose failures some ranks may meet alone (under FSDP rank 0 alone
    downloads and reads a model's weights while the others build it empty in seconds): a failure on any rank stops
    every rank, the others with a one-line UserError that says what it was, instead of leaving them waiting for it in
    the next collective. `timeout`: how long they may wait for each other, on a gloo group as in main_process_first.
    """
    failure = None
    try:
        yield
    except Exception as err:  # every failure is shared, then raised again as it was
        failure = err
    if accelerator.num_processes > 1:
        mine = None
        if failure is not None:
            mine = str(failure) if isinstance(failure, UserError) else f"{type(failure).__name__}: {failure}"
            mine = f"rank {accelerator.process_index}: {mine}"
        messages = [None] * accelerator.num_processes
        # Ranks that wait on another's preparation wait on a gloo group with `timeout`; without one, on the run's group.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if timeout else None
        dist.all_gather_object(messages, mine, group=group)
        first = next((message for message in messages if message is not None), None)
        if failure is None and first is not None:
            raise UserError(first)
    if failure is not None:
        raise failure


@contextmanager
def unused_parameters_explained():
    """DDP's error for parameters that got no gradient in a step, while it was not looking for them, names DDP's own
    keyword: here, the flag that sets it. It comes at the next step's forward pass, on every rank alike. The same error
    with the search on ("Since `find_unused_parameters=True` is enabled") has another cause and stays as it is."""
    try:
        yield
    except RuntimeError as err:
        if "You can enable unused parameter detection" not in str(err):
            raise
        raise UserError(
            "some of the model's parameters got no gradient in a training step (a layer that the forward pass does "
            "not use, such as the pooler of a BERT AutoModel in a task of your own), which DDP refuses unless it "
            "looks for them (on by default from 3 processes): pass --ddp_find_unused_parameters, or leave the layer "
            "out (AutoModel.from_pretrained(..., add_pooling_layer=False))"
        ) from err


# True while run_cli runs main() as a script: the process ends with it, so a failed run's variables need not be let go
# (see src/runtime.accelerate_state_of_this_run), and `python -m pdb train.py`'s post-mortem still shows them. Not
# under IPython's `%run train.py`, whose kernel goes on.
process_ends_with_main = False


def run_cli(main, parse_args):
    """Run `main(parse_args())`; a UserError becomes one line on stderr and exit status 2, Ctrl-C one line and 130.

    What is alive at the end (model, data) is freed by the process's exit, not by Python: frozen, the exit's garbage
    collection does not scan it (0.1-1 s less); the scripts froze what their setup made likewise. Not under `%run`:
    frozen, what the run left in a cycle would stay in the kernel's memory for good.
    """
    global process_ends_with_main
    ipython = sys.modules.get("IPython")  # imported by some libraries outside IPython too: running is what counts
    ends_with_main = process_ends_with_main = ipython is None or ipython.get_ipython() is None
    try:
        return main(parse_args())
    except UserError as err:
        # Every rank that hits the error says so: a rank-local problem must not go unreported.
        _say(f"{_rank()}error: {err}")
        # Not chained to the error: IPython's %run shows a chained SystemExit as a crash of its own (100 lines).
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, which turns it into a checkpoint (src/signals.py)
        _say(f"{_rank()}interrupted")
        raise SystemExit(130) from None  # as a shell reports a process ended by SIGINT
    finally:
        process_ends_with_main = False
        if ends_with_main:
            gc.freeze()


def _say(line: str):
    """One line on stderr in one write: print() writes the text and its newline apart, between which another rank's
    line could come (two ranks' errors on one line)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _rank() -> str:
    return f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
