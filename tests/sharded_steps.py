"""Sharded weights without GPUs: what FSDP and DeepSpeed ZeRO-3 ask of the ranks, for the multi-process tests.

    accelerate launch tests/sharded_steps.py train.py|evaluate.py <its flags>

runs the script, except that creating a transformers model and every forward pass of one first join a collective of
all ranks, as ZeRO-3's `zero.Init` partitions the weights while they are created and a forward pass under FSDP or
ZeRO-3 all-gathers their shards. A rank that builds the model alone (the others waiting for it), or that stops
generating while another still steps (its prompts ended sooner), then leaves the ranks' collectives out of step: the
run hangs or fails instead of finishing, as it would on sharded GPUs.
"""

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel


def with_every_rank(method):
    def joined(self, *args, **kwargs):
        # A CPU tensor: transformers creates models under a meta-device context, where an all_reduce does nothing.
        dist.all_reduce(torch.ones(1, device="cpu"))
        return method(self, *args, **kwargs)

    return joined


if __name__ == "__main__":
    PreTrainedModel.post_init = with_every_rank(PreTrainedModel.post_init)
    PreTrainedModel.__call__ = with_every_rank(torch.nn.Module.__call__)
    script = Path(__file__).resolve().parents[1] / sys.argv.pop(1)
    sys.argv[0] = str(script)
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
