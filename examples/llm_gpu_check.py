"""The pass/fail checks of examples/llm_gpu_check.sh: each compares a run's numbers with what they must be and exits
with status 1 and one line saying what was off. Tolerances allow for GPU kernels that add in another order from run
to run (bf16 autocast, atomics in attention's backward pass): a lost or repeated step is far outside them.

    python examples/llm_gpu_check.py resume UNINTERRUPTED RESUMED       # the same final weights and losses
    python examples/llm_gpu_check.py evaluate RUN EVALUATED             # evaluate.py reproduces train.py's metrics
    python examples/llm_gpu_check.py batch RUN TOTAL                    # --auto_find_batch_size kept the total batch
    python examples/llm_gpu_check.py less-memory LOWER.mem HIGHER.mem   # the first run peaked lower on the GPU
"""

import argparse
import json
import sys
from pathlib import Path

RESUME_WEIGHTS_ATOL = 1e-5  # an AdamW step at the check's learning rates moves a weight by ~1e-4 or more
RESUME_LOSS_RTOL = 1e-3
EVAL_LOSS_RTOL = 5e-3  # bf16 logits, and other batches' padding when train.py evaluated on several ranks
EVAL_ACCURACY_ATOL = 0.02  # a few near-ties of the random model that bf16 may turn either way


class CheckFailed(Exception):
    pass


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def final_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def logged_losses(folder: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def check_resume(uninterrupted: Path, resumed: Path) -> str:
    first, second = final_weights(uninterrupted), final_weights(resumed)
    if first.keys() != second.keys():
        raise CheckFailed(f"resume: {resumed} saved other weights than {uninterrupted}")
    worst = max((first[k].float() - second[k].float()).abs().max().item() for k in first)
    if worst > RESUME_WEIGHTS_ATOL:
        raise CheckFailed(f"resume: final weights differ from the uninterrupted run's by up to {worst:.3g} "
                          f"(allowed {RESUME_WEIGHTS_ATOL:g})")  # fmt: skip
    expected, losses = logged_losses(uninterrupted), logged_losses(resumed)
    if not losses:
        raise CheckFailed(f"resume: {resumed}/metrics.jsonl logged no loss after the checkpoint")
    for step, loss in sorted(losses.items()):
        if step not in expected or abs(loss - expected[step]) > RESUME_LOSS_RTOL * abs(expected[step]):
            raise CheckFailed(f"resume: loss at step {step} is {loss:.6g}, the uninterrupted run's "
                              f"{expected.get(step, float('nan')):.6g}")  # fmt: skip
    return f"resume: final weights within {worst:.3g} of the uninterrupted run's, {len(losses)} losses the same"


def check_evaluate(run: Path, evaluated: Path) -> str:
    trained, again = read_json(run / "all_results.json"), read_json(evaluated / "eval_results.json")
    if again["eval_samples"] != trained["eval_samples"]:
        raise CheckFailed(f"evaluate: evaluate.py scored {again['eval_samples']} examples, train.py "
                          f"{trained['eval_samples']}")  # fmt: skip
    loss_off = abs(again["eval_loss"] - trained["eval_loss"]) / abs(trained["eval_loss"])
    accuracy_off = abs(again["eval_accuracy"] - trained["eval_accuracy"])
    if loss_off > EVAL_LOSS_RTOL or accuracy_off > EVAL_ACCURACY_ATOL:
        raise CheckFailed(f"evaluate: evaluate.py gives loss {again['eval_loss']:.6g} and accuracy "
                          f"{again['eval_accuracy']:.4f}, train.py gave {trained['eval_loss']:.6g} and "
                          f"{trained['eval_accuracy']:.4f}")  # fmt: skip
    return f"evaluate: evaluate.py reproduces train.py's loss (relative difference {loss_off:.1e}) and accuracy"


def check_batch(run: Path, total: int) -> str:
    found = read_json(run / "all_results.json")["total_train_batch_size"]
    if found != total:
        raise CheckFailed(f"batch: --auto_find_batch_size trained with a total batch of {found}, not {total}")
    args = read_json(run / "args.json")
    size, accumulation = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
    return f"batch: {size} per device x {accumulation} accumulation steps, the total of {total} kept"


def check_less_memory(lower: Path, higher: Path) -> str:
    def peak(samples: Path) -> int:
        return max(int(line) for line in samples.read_text().split())

    low, high = peak(lower), peak(higher)
    if low >= high:
        raise CheckFailed(f"memory: {lower.stem} peaked at {low} MiB of GPU memory, not under {higher.stem}'s {high}")
    return f"memory: {lower.stem} peaked at {low} MiB, {higher.stem} at {high} MiB"


CHECKS = {"resume": check_resume, "evaluate": check_evaluate, "batch": check_batch, "less-memory": check_less_memory}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=CHECKS)
    parser.add_argument("first", type=Path)
    parser.add_argument("second")
    args = parser.parse_args(argv)
    second = int(args.second) if args.check == "batch" else Path(args.second)
    try:
        print(f"  ok {CHECKS[args.check](args.first, second)}")
    except CheckFailed as failure:
        print(f"llm_gpu_check: FAILED {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
