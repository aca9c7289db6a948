"""The precision a run computes in when nobody chose one: bf16 autocast where it is faster, else fp32.

GPUs: bf16 where the GPU has it (TF32 for what stays fp32). CPUs differ more than their flags say: with AMX tiles
(Intel Xeon since Sapphire Rapids) bf16 matmuls are several times faster; with `avx512_bf16` alone they were 1.6x
faster on an AMD Zen 4 and 0.8x as fast on an Intel Xeon (benchmarks/README.md); without either, bf16 is emulated.
So a CPU with `avx512_bf16` but no AMX times a small training step both ways (~0.5 s), once per machine, torch
version and thread count: the answer is cached in FINETUNE_CACHE_DIR (default ~/.cache/accelerate-finetune-template).

Rank 0 decides and every rank follows, so that no two ranks of one run compute differently. train.py saves the
decision in args.json; resume and evaluate.py reuse it rather than deciding again on another machine.
"""

import json
import os
import platform
import timeit
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from src.args import PRECISIONS
from src.errors import UserError

# bf16 must be at least this much faster: near 1.0 the timing's noise would make the choice flip between runs.
MIN_SPEEDUP = 1.15


def cache_file() -> Path:
    folder = os.environ.get("FINETUNE_CACHE_DIR") or Path.home() / ".cache" / "accelerate-finetune-template"
    return Path(folder) / "cpu_precision.json"


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def training_step_seconds(bf16: bool, repeats: int = 4) -> float:
    """The fastest of `repeats` forward and backward passes through a transformer-sized MLP block (256 tokens,
    384 -> 1536 -> 384, MiniLM's shapes), computed as autocast would compute it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(256, 384, generator=generator)
    up = torch.randn(1536, 384, generator=generator, requires_grad=True)
    down = torch.randn(384, 1536, generator=generator, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(tokens, up)), down)
        out.float().sum().backward()

    step()  # the first call pays for kernel selection and allocation
    return min(timeit.repeat(step, number=1, repeat=repeats))


def measure_bf16_speedup() -> float:
    """How many times faster bf16 autocast runs the training step than fp32, on this process's threads."""
    fp32, bf16 = training_step_seconds(False), training_step_seconds(True)
    fp32, bf16 = min(fp32, training_step_seconds(False)), min(bf16, training_step_seconds(True))  # interleaved
    return fp32 / bf16


def cpu_bf16_decision() -> tuple[bool, str]:
    """Whether bf16 autocast pays on this CPU, and why (for the log and args.json)."""
    if torch.cpu._is_amx_tile_supported():
        return True, "the CPU has AMX tiles"
    if not torch.cpu._is_avx512_bf16_supported():
        return False, "the CPU has no bf16 instructions (AMX, avx512_bf16)"
    key = f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    try:
        cached = dict(json.loads(cache_file().read_text()))
    except (OSError, ValueError, TypeError):  # TypeError: edited by hand, or another program's file: measure anew
        cached = {}
    if not isinstance(cached.get(key), (int, float)):
        cached[key] = round(measure_bf16_speedup(), 3)
        try:
            cache_file().parent.mkdir(parents=True, exist_ok=True)
            partial = cache_file().with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(cached, indent=2))
            os.replace(partial, cache_file())  # another run reading it sees the old file or the new, never half
        except OSError:
            pass  # a read-only home: measure again next time
        how = "measured"
    else:
        how = f"measured earlier ({cache_file()})"
    speedup = cached[key]
    return speedup >= MIN_SPEEDUP, f"avx512_bf16 without AMX: bf16 autocast {how} at {speedup:.2f}x fp32's speed"


def default_precision(on_cpu: bool) -> tuple[str, str]:
    """bf16 where it is faster, else 'no' (fp32), with the reason."""
    if not on_cpu:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16", "the GPU supports bf16"
        return "no", "the accelerator has no bf16"
    bf16, why = cpu_bf16_decision()
    return ("bf16" if bf16 else "no"), why


def choose_precision(requested: str | None, on_cpu: bool, saved: str | None = None) -> tuple[str, str]:
    """The run's precision and why: --mixed_precision, else the one a resumed run or a trained model was made with,
    else the launcher's `accelerate config` choice, else the faster one on this machine.

    Launchers always pass a precision (ACCELERATE_MIXED_PRECISION, 'no' when nothing was configured), so 'no'
    from the environment counts as no choice. Call it on every rank once the process group exists: rank 0 decides
    (and may measure) and the others take its answer.
    """
    if requested:
        return requested, "--mixed_precision"
    if saved:
        if saved not in PRECISIONS:
            raise UserError(
                f"the run's saved mixed_precision is {saved!r}, not one of {', '.join(PRECISIONS)}: its args.json "
                "(or checkpoint) was edited or damaged; pass --mixed_precision"
            )
        return saved, "the precision the run was trained with (args.json)"
    configured = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if configured not in PRECISIONS:  # fp8 from an accelerate config, BF16 set by hand: a traceback in accelerate
        raise UserError(f"ACCELERATE_MIXED_PRECISION={configured} (from `accelerate config`, the launcher or your "
                        f"environment) is not one of {', '.join(PRECISIONS)}, the precisions train.py runs in: "
                        "change it, or pass --mixed_precision")  # fmt: skip
    if configured != "no":
        return configured, "accelerate config or accelerate launch --mixed_precision"
    state = PartialState(cpu=on_cpu)
    decision = [default_precision(on_cpu) if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(decision)
    precision, why = decision[0]
    if precision != "no" and "ACCELERATE_MIXED_PRECISION" in os.environ:
        why += (
            "; a launcher's mixed_precision 'no' is its default too, so no choice: for fp32, pass "
            "--mixed_precision no to the script"
        )
    return precision, why
