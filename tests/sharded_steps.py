"""Sharded weights without GPUs, for the generation test.

    accelerate launch tests/sharded_steps.py <evaluate.py flags>

runs evaluate.py, except that every forward pass of a transformers model first joins a collective of all ranks, as
a forward pass under FSDP or ZeRO-3 all-gathers the weights' shards. A rank that stops generating while another
still steps (its prompts ended sooner) then leaves the ranks' collectives out of step: the run hangs or fails instead
of finishing, as it would on sharded GPUs.
"""

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel


def call_with_every_rank(self, *args, **kwargs):
    dist.all_reduce(torch.ones(1))
    return torch.nn.Module.__call__(self, *args, **kwargs)


if __name__ == "__main__":
    PreTrainedModel.__call__ = call_with_every_rank
    script = Path(__file__).resolve().parents[1] / "evaluate.py"
    sys.argv[0] = str(script)
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
