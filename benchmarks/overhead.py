"""Where train.py's time goes outside its training steps: imports, data, model, evaluation, saving, plotting.

    python benchmarks/overhead.py                        # 6,000 SST-2 rows, as run_benchmark.py
    python benchmarks/overhead.py --rows 300 -- --mixed_precision no

Runs train.py once, in a fresh process and exactly as `python train.py` runs it, while a sampling thread looks every
few milliseconds at which of its named steps (the functions in PHASES) the main thread is in, and prints one table:
seconds of wall time and of the process's CPU time per phase. Nothing in train.py is replaced or wrapped.
"Training steps" is the loop without the evaluation and checkpoints inside it; everything else is overhead.
Arguments after `--` go to train.py.
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))

# (the end of a function's file name, its name): the phase its time counts for. The innermost named function on the
# stack wins, so the evaluation inside the training loop counts as evaluation. Before train.py's main() is called:
# its imports; in main() outside any of these: other.
PHASES = {
    ("src/args.py", "parse_train_args"): "parsing the flags",
    ("train.py", "build_accelerator"): "Accelerator, threads, precision",
    ("src/data.py", "load_raw_splits"): "reading the data",
    ("train.py", "load_data_and_model"): "loading the model, tokenising",
    ("train.py", "build_dataloaders"): "dataloaders",
    ("accelerate/accelerator.py", "prepare"): "accelerator.prepare",
    ("train.py", "start_or_resume"): "args.json, trackers",
    ("train.py", "train_loop"): "training steps",
    ("src/evaluation.py", "evaluate"): "evaluation (forward passes, gathering)",
    ("src/metrics.py", "load_metric"): "loading the metric modules (first evaluation)",
    ("src/checkpoint.py", "save_checkpoint"): "checkpoints",
    ("train.py", "save_final"): "saving the model and results",
    ("src/plots.py", "plot_training_curves"): "plotting training_curves.png",
}
IMPORTS, OTHER = "imports of train.py", "other (optimizer, scheduler, logging)"
STARTUP, EXIT = "Python start-up", "Python exit (after main() returned)"


def phase_of(stack: list[tuple[str, str]], in_main: bool) -> str:
    """The phase of a stack of (file name, function name), innermost first; `in_main`: main() has been entered."""
    for filename, function in stack:
        for (suffix, name), phase in PHASES.items():
            if function == name and filename.endswith(suffix):
                return phase
    return OTHER if in_main else IMPORTS


class PhaseSampler(threading.Thread):
    """A sampling profiler of train.py's named steps: every `interval` seconds, the wall and process CPU time since
    the last look go to the phase the main thread is in now."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.main_thread = interval, threading.main_thread().ident
        self.totals: dict[str, list[float]] = {}
        self.in_main = False
        self.finished = threading.Event()

    def run(self):
        wall, cpu = time.perf_counter(), time.process_time()
        while not self.finished.wait(self.interval):
            frame, stack = sys._current_frames().get(self.main_thread), []
            while frame is not None:
                stack.append((frame.f_code.co_filename, frame.f_code.co_name))
                frame = frame.f_back
            self.in_main = self.in_main or any(f.endswith("train.py") and name == "main" for f, name in stack)
            now_wall, now_cpu = time.perf_counter(), time.process_time()
            spent = self.totals.setdefault(phase_of(stack, self.in_main), [0.0, 0.0])
            spent[0] += now_wall - wall
            spent[1] += now_cpu - cpu
            wall, cpu = now_wall, now_cpu

    def stop(self) -> dict[str, list[float]]:
        self.finished.set()
        self.join()
        return self.totals


def child(report: Path, argv: list[str]):
    """Run train.py as `python train.py` would, sampled; write the phases' totals and the clock times to `report`."""
    sampler = PhaseSampler()
    sampled_from, cpu_before = time.time(), time.process_time()  # Python's start-up: this process until here
    sampler.start()
    sys.argv = [str(REPO / "train.py"), *argv]
    sys.path.insert(0, str(REPO))
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    finally:
        totals = sampler.stop()
        clock = {"sampled_from": sampled_from, "startup_cpu": cpu_before, "ended_at": time.time()}
        report.write_text(json.dumps({"totals": totals, **clock}))


def phases(measured: dict, launched_at: float, exited_at: float, process_cpu: float) -> list[tuple[str, float, float]]:
    """(phase, wall s, cpu s) rows, in the order train.py goes through them, that add up to the process's wall time:
    the start-up before sampling began, the sampled phases, and the exit after it ended."""
    totals = measured["totals"]
    order = [IMPORTS, *PHASES.values(), OTHER]
    sampled_cpu = sum(cpu for _, cpu in totals.values())
    rows = [(STARTUP, measured["sampled_from"] - launched_at, measured["startup_cpu"])]
    rows += [(name, *totals[name]) for name in order if name in totals]
    # The CPU the process spent that no sample saw after its start-up: Python's exit.
    exit_cpu = max(process_cpu - measured["startup_cpu"] - sampled_cpu, 0.0)
    rows.append((EXIT, exited_at - measured["ended_at"], exit_cpu))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6000, help="Shuffled SST-2 training rows (as run_benchmark.py).")
    parser.add_argument("--data_dir", type=Path, help="SST-2 folder; default: as run_benchmark.py.")
    parser.add_argument("--results_dir", type=Path, default=BENCHMARKS / "results", help="Git-ignored work folder.")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    if args.child:
        return child(args.child, train_args)

    from run_benchmark import DEFAULT_DATA_DIR, children_cpu_seconds, project_arguments, write_sample

    data_dir = args.data_dir or DEFAULT_DATA_DIR
    train_file = write_sample(
        data_dir / "train.tsv", args.rows, args.results_dir / "data" / f"sst2_train_{args.rows}.tsv"
    )
    run_dir = args.results_dir / "runs" / "overhead"
    report = run_dir / "overhead.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = project_arguments(train_file, data_dir / "validation.tsv", run_dir / "model", seed=42) + train_args
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(run_dir / "cache"))
    launched_at, start, cpu = time.time(), time.perf_counter(), children_cpu_seconds()
    subprocess.run([sys.executable, __file__, "--child", str(report), "--", *argv], cwd=REPO, env=env, check=True)
    wall, exited_at, process_cpu = time.perf_counter() - start, time.time(), children_cpu_seconds() - cpu
    rows = phases(json.loads(report.read_text()), launched_at, exited_at, process_cpu)
    steps = next(w for name, w, _ in rows if name == "training steps")
    evaluation = sum(w for name, w, _ in rows if name.startswith(("evaluation", "loading the metric")))
    print(f"\n### train.py outside its training steps ({args.rows:,} rows, {' '.join(train_args) or 'defaults'})\n")
    print("| phase | wall s | CPU s (all threads) |\n|---|---|---|")
    for name, phase_wall, cpu in rows:
        print(f"| {name} | {phase_wall:.2f} | {cpu:.2f} |")
    print(f"| **whole process** | **{wall:.2f}** | |")
    print(
        f"\nOutside the training steps: {wall - steps:.1f} s, of which evaluation {evaluation:.1f} s "
        f"(outside steps and evaluation: {wall - steps - evaluation:.1f} s)."
    )


if __name__ == "__main__":
    main()
