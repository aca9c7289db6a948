"""The one exception type for user mistakes, how the scripts report it, and how it reaches every rank."""

import os
import sys
from contextlib import contextmanager

from accelerate.utils import broadcast_object_list


class UserError(Exception):
    """A mistake in the command line, a config file or the data: reported in one line, without a traceback."""


@contextmanager
def main_process_first(accelerator):
    """`accelerator.main_process_first()`, except that a UserError on the main process stops every rank with
    the same message, instead of leaving the others in a barrier that fails with a traceback."""
    if accelerator.num_processes == 1:
        yield
        return
    if accelerator.is_main_process:
        try:
            yield
        except UserError as err:
            broadcast_object_list([str(err)], from_process=0)
            raise
        broadcast_object_list([None], from_process=0)
    else:
        message = broadcast_object_list([None], from_process=0)[0]  # waits for the main process
        if message is not None:
            raise UserError(message)
        yield


def run_cli(main, parse_args):
    """Run `main(parse_args())`; a UserError becomes one line on stderr and exit status 2."""
    try:
        return main(parse_args())
    except UserError as err:
        # Every rank that hits the error says so: a rank-local problem must not go unreported.
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{rank}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
