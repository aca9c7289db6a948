"""The machine's practical limit: float32 and bfloat16 matrix-product throughput, on the CPU and on CUDA if present.

    python benchmarks/matmul_peak.py                # a table of GFLOP/s per device, dtype and size
    python benchmarks/matmul_peak.py --threads 1    # one CPU thread

The benchmarks divide model FLOP/s by the best rate measured here (for the dtype a run computes in) to get MFU.
Inputs are random (zeros run faster than real data on some hardware); each rate is the best of several timed
repeats after a warm-up, with the device synchronised before the clock is read.
"""

import argparse
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The peak is the best rate over these sizes: on a CPU the smaller products can run faster (they stay in the
# caches; AMX bf16 on 2 cores was ~3x faster at 512 than at 2048), on a GPU only large ones fill the chip.
PEAK_SIZES = {"cpu": (512, 1024, 2048), "cuda": (8192,)}


def measure(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5, per_repeat: int = 3) -> float:
    """Best rate of a size x size x size matrix product, in FLOP/s."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)  # warm-up: thread pool, oneDNN/cuBLAS handles and kernels, caches
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_repeat):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - start) / per_repeat)
    return 2 * size**3 / best


def peaks(device: torch.device) -> dict[str, float]:
    """{'float32': FLOP/s, 'bfloat16': FLOP/s}: the best rate over the device's PEAK_SIZES."""
    return {
        name: max(measure(device, dtype, size) for size in PEAK_SIZES[device.type]) for name, dtype in DTYPES.items()
    }


def devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", help="Matrix sizes (default: 512 1024 2048 on CPU, 8192 on CUDA)."
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's choice).")
    parser.add_argument("--no_cpu", action="store_true", help="Skip the CPU (on a GPU machine, to save time).")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    amx = torch.cpu._is_amx_tile_supported()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, AMX tiles: {amx}")
    print("\n| device | dtype | size | GFLOP/s |\n|---|---|---|---|")
    for device in devices():
        if device.type == "cpu" and args.no_cpu:
            continue
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        sizes = args.sizes or PEAK_SIZES[device.type]
        for dtype_name, dtype in DTYPES.items():
            for size in sizes:
                print(f"| {name} | {dtype_name} | {size} | {measure(device, dtype, size) / 1e9:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
