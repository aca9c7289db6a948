"""The precision a run computes in when nobody chose one: who decides, on what evidence, and that it sticks.

The CPU's own answer (AMX, avx512_bf16, a measurement) differs from machine to machine, so every test here tells
the code what the machine is rather than asking this one: the assertions are the same on every CPU and on a GPU.
"""

import json
import math

import pytest
import torch
from accelerate import PartialState, debug_launcher
from conftest import load_script, run_in_process, train_args
from safetensors.torch import load_file

import src.precision
from src.errors import UserError
from src.precision import MIN_SPEEDUP, choose_precision, cpu_bf16_decision

train = load_script("train")


def cpu(monkeypatch, amx: bool, avx512_bf16: bool, speedup: float | None = None) -> list[int]:
    """Pretend this CPU has these instructions and measures `speedup`; returns a list that counts measurements."""
    measured = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)

    def measure():
        measured.append(1)
        return speedup

    monkeypatch.setattr(src.precision, "measure_bf16_speedup", measure)
    return measured


def test_the_cpus_instructions_decide_and_only_avx512_bf16_alone_is_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path))
    measured = cpu(monkeypatch, amx=True, avx512_bf16=True)
    assert cpu_bf16_decision() == (True, "the CPU has AMX tiles") and not measured
    measured = cpu(monkeypatch, amx=False, avx512_bf16=False)
    assert cpu_bf16_decision()[0] is False and not measured, "bf16 without bf16 instructions is emulated: slow"

    measured = cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=1.61)  # the AMD Zen 4 of the speed issue
    assert cpu_bf16_decision() == (True, "avx512_bf16 without AMX: bf16 autocast measured at 1.61x fp32's speed")
    bf16, why = cpu_bf16_decision()
    assert bf16 and "measured earlier" in why and len(measured) == 1, "once per machine: the answer is cached"
    assert list(json.loads((tmp_path / "cpu_precision.json").read_text()).values()) == [1.61]

    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count is another measurement
    measured = cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=0.8)  # the Intel Xeon without AMX
    assert cpu_bf16_decision()[0] is False and len(measured) == 1
    measured = cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=MIN_SPEEDUP - 0.01)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 98)
    assert cpu_bf16_decision()[0] is False, "a gain within the timing's noise keeps fp32"


@pytest.mark.parametrize("damage", ["{not json", "[1.61]"], ids=["not JSON", "not a table"])
def test_an_unreadable_or_unwritable_cache_means_measuring_again(monkeypatch, tmp_path, damage):
    (tmp_path / "cpu_precision.json").write_text(damage)
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path))
    measured = cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=2.0)
    assert cpu_bf16_decision()[0] and len(measured) == 1
    assert list(json.loads((tmp_path / "cpu_precision.json").read_text()).values()) == [2.0], "written anew"
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "cpu_precision.json" / "not-a-folder"))
    assert cpu_bf16_decision()[0] and len(measured) == 2


def test_a_gpu_without_bf16_computes_in_fp32(monkeypatch):
    """A T4 or V100 has no bf16 (autocast would emulate it, slowly): fp32 there, bf16 on a GPU that has it; the CPU's
    instructions are not asked."""
    measured = cpu(monkeypatch, amx=True, avx512_bf16=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert src.precision.default_precision(on_cpu=False) == ("no", "the accelerator has no bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert src.precision.default_precision(on_cpu=False) == ("bf16", "the GPU supports bf16") and not measured


def test_the_measurement_compares_the_same_work_in_both_precisions():
    """Each side is the fastest of several runs of one forward and backward pass; the ratio is a finite positive
    number on any CPU (its value is this machine's business, and the benchmarks')."""
    speedup = src.precision.measure_bf16_speedup()
    assert math.isfinite(speedup) and speedup > 0


def test_who_decides_the_precision(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(src.precision, "default_precision", lambda on_cpu: ("bf16", "faster here"))
    assert choose_precision(None, on_cpu=True) == ("bf16", "faster here")
    assert choose_precision("no", on_cpu=True, saved="bf16") == ("no", "--mixed_precision"), "the flag wins"
    assert choose_precision(None, on_cpu=True, saved="no")[0] == "no", "then the run's own (resume, evaluate.py)"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate config` chose, passed by the launcher
    assert choose_precision(None, on_cpu=True) == (
        "fp16",
        "accelerate config or accelerate launch --mixed_precision",
    )
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # launchers always pass one: 'no' is no choice
    precision, why = choose_precision(None, on_cpu=True)
    assert precision == "bf16" and why.endswith("mixed_precision 'no' is its default too, so no choice: for fp32, "
                                                 "pass --mixed_precision no to the script")  # fmt: skip
    monkeypatch.setattr(src.precision, "default_precision", lambda on_cpu: ("no", "slower here"))
    assert choose_precision(None, on_cpu=True) == ("no", "slower here"), "fp32 already: no hint to pass 'no'"
    monkeypatch.setattr(src.precision, "default_precision", lambda on_cpu: ("bf16", "faster here"))
    with pytest.raises(UserError, match="saved mixed_precision is 'fp8', not one of no, fp16, bf16.*--mixed_precision"):
        choose_precision(None, on_cpu=True, saved="fp8")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")  # set by hand: accelerate fails with a traceback
    with pytest.raises(UserError, match=r"ACCELERATE_MIXED_PRECISION=BF16 \(from .*\) is not one of no, fp16, bf16,"):
        choose_precision(None, on_cpu=True)


def decide_on_each_rank(folder):
    rank = PartialState(cpu=True).process_index
    # Rank 1's machine would choose otherwise: it must follow rank 0, or the ranks would compute differently.
    src.precision.default_precision = lambda on_cpu: ("bf16", "rank 0 timed it") if rank == 0 else ("no", "rank 1")
    (folder / f"rank-{rank}.json").write_text(json.dumps(choose_precision(None, on_cpu=True)))


def test_rank_0_decides_for_every_rank(tmp_path, monkeypatch):
    """Two real gloo processes (forked by accelerate's debug_launcher: a broadcast needs a process group)."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    debug_launcher(decide_on_each_rank, (tmp_path,), num_processes=2)
    decisions = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert decisions[0] == decisions[1] and decisions[0][0] == "bf16" and decisions[0][1].startswith("rank 0 timed it")


def without_precision(argv: list[str]) -> list[str]:
    """train_args without its `--mixed_precision no`, so that train.py chooses."""
    i = argv.index("--mixed_precision")
    return argv[:i] + argv[i + 2 :]


def weights(folder) -> dict:
    return load_file(folder / "model.safetensors")


def test_the_decision_is_saved_and_kept_on_resume_and_by_evaluate(
    tiny_model_no_dropout, tiny_data, tmp_path, monkeypatch
):
    """A run that chose bf16 and is resumed (or evaluated) on a machine that would choose fp32 keeps bf16, so the
    resume is exact and evaluate.py reproduces its metrics."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(src.precision, "default_precision", lambda on_cpu: ("bf16", "faster here"))
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, fp32))
    flags = ["--checkpointing_steps", "8"]  # the end of epoch 1 of 2
    run_in_process("train", without_precision(train_args(tiny_model_no_dropout, *tiny_data, bf16, *flags)))
    saved = json.loads((bf16 / "args.json").read_text())
    assert (saved["mixed_precision"], saved["mixed_precision_reason"]) == ("bf16", "faster here")

    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%): 16 small steps of lr 1e-3 move the weights
    # by ~1e-2, so bf16's gradients put them a few 1e-5 apart; 0.01 is far above that and far below a wrong run.
    difference = max((weights(bf16)[k] - weights(fp32)[k]).abs().max().item() for k in weights(fp32))
    assert 0 < difference < 0.01, "bf16 rounding shows, but the run stays close"

    monkeypatch.setattr(src.precision, "default_precision", lambda on_cpu: ("no", "slower here"))
    resumed = tmp_path / "resumed"
    run_in_process("train", without_precision(train_args(tiny_model_no_dropout, *tiny_data, resumed,
                   "--resume_from_checkpoint", str(bf16 / "checkpoint-8"), *flags)))  # fmt: skip
    assert json.loads((resumed / "args.json").read_text())["mixed_precision"] == "bf16"
    assert all(torch.equal(weights(bf16)[k], weights(resumed)[k]) for k in weights(bf16)), "the same computation"
    with pytest.raises(UserError, match=r"other settings \(--mixed_precision bf16 -> no\)"):  # asked for: refused
        run_in_process("train", train_args(tiny_model_no_dropout, *tiny_data, tmp_path / "fp32-resumed",
                                           "--resume_from_checkpoint", str(bf16 / "checkpoint-8"), *flags))  # fmt: skip

    evaluated = tmp_path / "evaluated"
    # The training run's evaluation batches (8 rows), so the same computation: only the precision could differ.
    run_in_process("evaluate", ["--model_name_or_path", str(bf16), "--validation_file", str(tiny_data[1]),
                                "--output_dir", str(evaluated), "--per_device_eval_batch_size", "8"])  # fmt: skip
    trained = json.loads((bf16 / "all_results.json").read_text())
    again = json.loads((evaluated / "eval_results.json").read_text())
    for key in ("eval_accuracy", "eval_loss"):  # eval_results.json rounds to 6 decimals; fp32 moves the loss by ~1e-4
        assert again[key] == round(trained[key], 6), key


def test_a_second_run_in_one_process_with_another_precision_is_one_line():
    """A notebook kernel that trained in fp32 and now evaluates or trains in bf16: Accelerate cannot change it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from src.runtime import one_precision_per_process

    try:
        Accelerator(cpu=True, mixed_precision="no")
        refused = pytest.raises(UserError, match="earlier run in this process .* 'no', and this one chose 'bf16'")
        with refused, one_precision_per_process("bf16"):
            Accelerator(cpu=True, mixed_precision="bf16")
        device = "AcceleratorState has already been initialized and cannot be changed, ... pass `cpu=True`"
        with pytest.raises(ValueError, match="cpu=True"), one_precision_per_process("no"):
            raise ValueError(device)  # another setting than the precision: Accelerate's own message stands
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
