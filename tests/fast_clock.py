"""One rank whose clock runs fast, for the --max_time vote test.

    FAST_CLOCK=<rank> accelerate launch tests/fast_clock.py <train.py flags>

runs train.py, except that on rank <rank>, from the moment the training loop sets up its stop vote, time.perf_counter
runs a million times faster: that rank is past any --max_time at its first optimizer step, the others are not.
Only from then on, so that nothing before training (imports, locks, process-group set-up) sees the fast clock.
"""

import os
import runpy
import sys
import time
from pathlib import Path

SPEED = 1e6

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "train.py"
    sys.argv[0] = str(script)
    sys.path.insert(0, str(script.parent))
    rank = os.environ.get("RANK", "0")
    if rank == os.environ["FAST_CLOCK"]:
        import src.signals

        real_clock, set_up_vote = time.perf_counter, src.signals.StopVote.__init__

        def set_up_vote_and_speed_up_the_clock(self, accelerator):
            set_up_vote(self, accelerator)
            start = real_clock()
            time.perf_counter = lambda: start + (real_clock() - start) * SPEED
            print(f"rank {rank}: the clock runs {SPEED:.0e} times fast", file=sys.stderr, flush=True)

        src.signals.StopVote.__init__ = set_up_vote_and_speed_up_the_clock
    runpy.run_path(str(script), run_name="__main__")
