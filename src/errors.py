"""The one exception type for user mistakes, and how the scripts report it."""

import os
import sys


class UserError(Exception):
    """A mistake in the command line, a config file or the data: reported in one line, without a traceback."""


def run_cli(main, parse_args):
    """Run `main(parse_args())`; a UserError becomes one line on stderr and exit status 2."""
    try:
        return main(parse_args())
    except UserError as err:
        # Every rank that hits the error says so: a rank-local problem must not go unreported.
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{rank}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
