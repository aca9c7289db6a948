"""FSDP's code paths on CPU ranks, for the tests only.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \
        tests/fsdp_on_cpu.py train.py <train.py flags>

accelerate turns an FSDP config on a machine without GPUs into plain gloo ranks (MULTI_CPU) and train.py refuses it
(src.runtime.refuse_fsdp_without_gpus), rightly for users: nothing would be sharded. Yet FSDP2 (`fully_shard`) works
on gloo CPU ranks, so each process here starts accelerate's state as FSDP with the config's plugin, lets the
refusal through and runs the script as __main__. Nothing in src/ or the scripts knows of this.

Each rank prints what the tests check and the docs' memory table reads:
- in prepare(), how many of the model's parameters were still empty (meta device) and a digest of its buffers once
  prepared, and its peak resident memory so far (loading and sharding): "fsdp_on_cpu rank R: parameters on meta
  before prepare M of N, buffers after prepare DIGEST, peak RSS P MiB";
- at its first optimizer step, how many parameters its optimizer holds and how many of them are the prepared model's
  trainable parameters: "fsdp_on_cpu rank R: optimizer slots S, distinct D, model's trainable held H of T";
- at exit, its peak resident memory: "fsdp_on_cpu rank R: peak RSS M MiB".

With FSDP_ON_CPU_KILL_AFTER_CHECKPOINT=N in the environment, every rank kills itself with SIGKILL as soon as
checkpoint-N is complete, as a `kill -9` of the whole job right after that save would.
"""

import atexit
import hashlib
import os
import resource
import runpy
import signal
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


def report_prepare_and_first_step():
    """Print what each rank's model was before prepare() and its buffers after, and what its optimizer holds once the
    script has finished preparing it (its first step)."""
    import torch
    from accelerate import Accelerator

    prepare = Accelerator.prepare

    def prepare_and_watch(self, *objects):
        model = next((obj for obj in objects if isinstance(obj, torch.nn.Module)), None)
        on_meta = [p.device.type == "meta" for p in model.parameters()] if model is not None else []
        prepared = prepare(self, *objects)
        model = next((obj for obj in prepared if isinstance(obj, torch.nn.Module)), None)
        optimizer = next((obj for obj in prepared if isinstance(obj, torch.optim.Optimizer)), None)
        if model is not None:
            print(f"fsdp_on_cpu rank {self.process_index}: parameters on meta before prepare {sum(on_meta)} of "
                  f"{len(on_meta)}, buffers after prepare {digest(model.buffers())}, peak RSS {peak_rss():.0f} MiB",
                  flush=True)  # fmt: skip
        if model is not None and optimizer is not None:
            optimizer.optimizer.register_step_pre_hook(report_once(self, model))
        return prepared

    def digest(buffers) -> str:
        values = hashlib.sha256()
        for buffer in buffers:
            values.update(buffer.detach().cpu().double().numpy().tobytes())
        return values.hexdigest()[:12]

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


def peak_rss() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def kill_after_checkpoint(step: int):
    """Each rank dies (no handler, no clean-up) once checkpoint-`step` is complete: save_checkpoint returns on no rank
    before the checkpoint is renamed into place."""
    import src.checkpoint

    save = src.checkpoint.save_checkpoint

    def save_then_die(accelerator, output_dir, state, *args, **kwargs):
        saved = save(accelerator, output_dir, state, *args, **kwargs)
        if state["global_step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    src.checkpoint.save_checkpoint = save_then_die  # before the script imports it by name


def report_peak_memory_at_exit():
    atexit.register(lambda: print(f"fsdp_on_cpu rank {os.environ.get('RANK', 0)}: peak RSS {peak_rss():.0f} MiB",
                                  flush=True))  # fmt: skip


if __name__ == "__main__":
    script = REPO / sys.argv[1]
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(REPO))
    if os.environ.get("ACCELERATE_USE_FSDP") != "true":
        sys.exit("tests/fsdp_on_cpu.py runs FSDP only: launch it with --config_file accelerate_configs/fsdp.yaml")
    # On a GPU machine too, the script must see the CPU-only machine this switch is for (before torch is imported):
    # it would otherwise ask accelerate for GPUs in a state already started on gloo CPU ranks, and fail.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import src.runtime

    start_fsdp_state()
    src.runtime.refuse_fsdp_without_gpus = lambda: None  # the scripts import it by name when they run
    report_prepare_and_first_step()
    report_peak_memory_at_exit()
    if os.environ.get("FSDP_ON_CPU_KILL_AFTER_CHECKPOINT"):
        kill_after_checkpoint(int(os.environ["FSDP_ON_CPU_KILL_AFTER_CHECKPOINT"]))
    runpy.run_path(str(script), run_name="__main__")
