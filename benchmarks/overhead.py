"""Where train.py's time goes outside the training steps: imports, data, model, evaluation, saving, plotting.

    python benchmarks/overhead.py                        # 6,000 SST-2 rows, as run_benchmark.py
    python benchmarks/overhead.py --rows 300 -- --mixed_precision no

Runs train.py once, in a fresh process and as `python train.py` would, with timers around its named steps (the
functions train.py calls, wrapped where train.py looks them up), and prints one table: seconds of wall time and
of CPU time per phase.
"Training steps" is the loop without the evaluation and checkpoints inside it; everything else is overhead.
Arguments after `--` go to train.py.
"""

import time

STARTED_AT = time.time()  # before any other import: the child's start-up is measured from its parent's clock

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))

# Functions that train.py calls by these names (module globals of train.py, src.metrics or src.plots).
TIMED = {
    "train": [
        "build_accelerator",
        "load_raw_splits",
        "load_data_and_model",
        "build_dataloaders",
        "start_or_resume",
        "train_loop",
        "evaluate",
        "save_checkpoint",
        "save_final",
    ],
    "src.metrics": ["load_metric"],
    "src.plots": ["plot_training_curves"],
}


def timed(name, function, totals):
    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent = totals.setdefault(name, [0.0, 0.0])
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu

    return wrapper


def child(report: Path, argv: list[str]):
    """Run train.py as `python train.py` would, with its steps wrapped in timers; write the totals to `report`.

    train.py ends with `run_cli(main, ...)`: the stand-in installed here times the imports up to that call, wraps
    the functions main() looks up in train.py's globals, and runs it.
    """
    import runpy

    totals = {"started_at": STARTED_AT}
    wall, cpu = time.perf_counter(), time.process_time()
    sys.path.insert(0, str(REPO))
    import src.errors  # part of train.py's imports, timed with them

    def timed_run_cli(main, parse_args):
        totals["imports"] = [time.perf_counter() - wall, time.process_time() - cpu]
        from accelerate import Accelerator

        import src.metrics
        import src.plots

        modules = {"train": main.__globals__, "src.metrics": vars(src.metrics), "src.plots": vars(src.plots)}
        for module_name, names in TIMED.items():
            for name in names:
                modules[module_name][name] = timed(name, modules[module_name][name], totals)
        Accelerator.prepare = timed("prepare", Accelerator.prepare, totals)
        results = main(parse_args())
        totals["end"] = [time.perf_counter() - wall, time.process_time() - cpu]
        totals["ended_at"] = time.time()
        report.write_text(json.dumps({"totals": totals, "results": results}, default=str))

    src.errors.run_cli = timed_run_cli
    sys.argv = [str(REPO / "train.py"), *argv]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


def phases(
    totals: dict, process_wall: float, launched_at: float, exited_at: float, process_cpu: float | None = None
) -> list[tuple[str, float, float]]:
    """(phase, wall s, cpu s) rows that add up to the process's wall time."""

    def get(name):
        return totals.get(name, [0.0, 0.0])

    def minus(a, *others):
        return [a[0] - sum(o[0] for o in others), a[1] - sum(o[1] for o in others)]

    evaluation = minus(get("evaluate"), get("load_metric"))
    steps = minus(get("train_loop"), get("evaluate"), get("save_checkpoint"))
    saving = minus(get("save_final"), get("plot_training_curves"))
    data_and_model = minus(get("load_data_and_model"), get("load_raw_splits"))
    named = {
        "Python start-up": [totals["started_at"] - launched_at, 0.0],
        "imports of train.py": get("imports"),
        "Accelerator, threads, precision": get("build_accelerator"),
        "reading the data": get("load_raw_splits"),
        "loading the model, tokenising": data_and_model,
        "dataloaders": get("build_dataloaders"),
        "accelerator.prepare": get("prepare"),
        "args.json, trackers": get("start_or_resume"),
        "training steps": steps,
        "evaluation (forward passes, gathering)": evaluation,
        "loading the metric modules (first evaluation)": get("load_metric"),
        "checkpoints": get("save_checkpoint"),
        "saving the model and results": saving,
        "plotting training_curves.png": get("plot_training_curves"),
    }
    accounted = [sum(v[i] for v in named.values()) for i in (0, 1)]
    exit_wall = exited_at - totals["ended_at"]
    exit_cpu = process_cpu - get("end")[1] if process_cpu is not None else 0.0  # the child's CPU after main()
    named["other (optimizer, scheduler, logging)"] = [
        process_wall - accounted[0] - exit_wall,
        get("end")[1] - accounted[1],
    ]
    named["Python exit (after main() returned)"] = [exit_wall, exit_cpu]
    return [(name, wall, cpu) for name, (wall, cpu) in named.items()]


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
    measured = json.loads(report.read_text())
    rows = phases(measured["totals"], wall, launched_at, exited_at, process_cpu)
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
