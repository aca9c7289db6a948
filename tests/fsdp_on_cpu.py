"""FSDP's code paths on CPU ranks, for the tests only.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \
        tests/fsdp_on_cpu.py train.py <train.py flags>

accelerate turns an FSDP config on a machine without GPUs into plain gloo ranks (MULTI_CPU) and train.py refuses it
(src.runtime.refuse_fsdp_without_gpus), rightly for users: nothing would be sharded. Yet FSDP2 (`fully_shard`) works
on gloo CPU ranks, so each process here starts accelerate's state as FSDP with the config's plugin, lets the
refusal through and runs the script as __main__. Nothing in src/ or the scripts knows of this.

Each rank prints, at its first optimizer step, how many parameters its optimizer holds and how many of them are the
prepared model's trainable parameters: "fsdp_on_cpu rank R: optimizer slots S, distinct D, model's trainable held H
of T".
"""

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_fsdp_state():
    """accelerate's state as FSDP on gloo CPU ranks: MULTI_CPU, then switched to FSDP with the env's plugin."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch set
    state = AcceleratorState(mixed_precision="no", cpu=True, dynamo_plugin=TorchDynamoPlugin(), fsdp_plugin=plugin,
                             _from_accelerator=True)  # fmt: skip
    # Both: every AcceleratorState() (the script's Accelerator makes one) copies PartialState's over its own.
    state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


def report_optimizer_at_first_step():
    """Print what each rank's optimizer holds once the script has finished preparing it (its first step)."""
    import torch
    from accelerate import Accelerator

    prepare = Accelerator.prepare

    def prepare_and_watch(self, *objects):
        prepared = prepare(self, *objects)
        model = next((obj for obj in prepared if isinstance(obj, torch.nn.Module)), None)
        optimizer = next((obj for obj in prepared if isinstance(obj, torch.optim.Optimizer)), None)
        if model is not None and optimizer is not None:
            optimizer.optimizer.register_step_pre_hook(report_once(self, model))
        return prepared

    def report_once(accelerator, model):
        reported = []

        def report(optimizer, args, kwargs):
            if reported:
                return
            reported.append(True)
            held = [p for group in optimizer.param_groups for p in group["params"]]
            trainable = [p for p in model.parameters() if p.requires_grad]
            in_model = {id(p) for p in trainable} & {id(p) for p in held}
            print(f"fsdp_on_cpu rank {accelerator.process_index}: optimizer slots {len(held)}, "
                  f"distinct {len({id(p) for p in held})}, model's trainable held {len(in_model)} of {len(trainable)}",
                  flush=True)  # fmt: skip

        return report

    Accelerator.prepare = prepare_and_watch


if __name__ == "__main__":
    script = REPO / sys.argv[1]
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(REPO))
    if os.environ.get("ACCELERATE_USE_FSDP") != "true":
        sys.exit("tests/fsdp_on_cpu.py runs FSDP only: launch it with --config_file accelerate_configs/fsdp.yaml")
    import src.runtime

    start_fsdp_state()
    src.runtime.refuse_fsdp_without_gpus = lambda: None  # the scripts import it by name when they run
    report_optimizer_at_first_step()
    runpy.run_path(str(script), run_name="__main__")
