"""Out-of-memory errors without a GPU, for --auto_find_batch_size tests.

    FAKE_OOM=<rank>:<rows>[:<eval rows>] python tests/fake_oom.py <train.py flags>     (or under `accelerate launch`)

runs train.py, except that on rank <rank> a forward pass with gradients on more than <rows> examples (or one
without gradients on more than <eval rows>) raises the error CUDA raises. Tests running train.py in-process use
`out_of_memory_above` with monkeypatch instead.
"""

import os
import runpy
import sys
from pathlib import Path

import torch
from transformers import PreTrainedModel


def out_of_memory_above(max_rows: int, max_eval_rows: int | None = None):
    """A `__call__` for transformers models that runs out of "memory" on a training batch of more than `max_rows`
    (and, if given, on an evaluation batch, without gradients, of more than `max_eval_rows`)."""
    call = torch.nn.Module.__call__

    def call_or_run_out(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        limit = max_rows if torch.is_grad_enabled() else max_eval_rows
        if limit is not None and input_ids is not None and input_ids.shape[0] > limit:
            print(f"rank {os.environ.get('RANK', 0)}: simulated out of memory", file=sys.stderr, flush=True)
            raise torch.OutOfMemoryError(f"CUDA out of memory. (simulated for more than {limit} rows)")
        return call(self, *args, **kwargs)

    return call_or_run_out


if __name__ == "__main__":
    rank, rows, *eval_rows = os.environ["FAKE_OOM"].split(":")
    if os.environ.get("RANK", "0") == rank:
        PreTrainedModel.__call__ = out_of_memory_above(int(rows), *map(int, eval_rows))
    script = Path(__file__).resolve().parents[1] / "train.py"
    sys.argv[0] = str(script)
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
