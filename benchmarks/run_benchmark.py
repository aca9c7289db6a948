"""Time the project's train.py against transformers Trainer peers and a plain PyTorch peer on one workload.

    python benchmarks/run_benchmark.py                      # 5 peers x 3 seeds, ~25 minutes on 2 idle CPU cores
    python benchmarks/run_benchmark.py --seeds 42 --rows 300 --only project trainer_grouped   # a quick check
    python benchmarks/run_benchmark.py --only project launch  # `accelerate launch train.py` against `python train.py`

Every run is a separate process timed from the outside, so the wall time includes imports, model loading
and tokenisation. Each run also gets an empty `datasets` cache, so none reuses another's work.
The markdown table goes to stdout (and to --output); logs and run folders go to benchmarks/results/.
"""

import argparse
import datetime
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import accelerate
import torch
import transformers
from matmul_peak import PEAK_SIZES, peaks
from peer_common import REPO_ROOT, default_model_path
from transformers import AutoModelForSequenceClassification

BENCHMARKS = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "sst2"
PEERS = {
    "project": "python train.py",
    "launch": "accelerate launch train.py",
    "trainer_grouped": "Trainer tuned (group_by_length, train.py's precision)",
    "trainer": "Trainer as it comes",
    "plain": "plain PyTorch loop",
}
DEFAULT_PEERS = ["project", "launch", "trainer_grouped", "trainer", "plain"]
PROJECT_PEERS = ("project", "launch")  # train.py itself, started two ways
SAMPLE_SEED = 1234  # fixed: every session and every peer trains on the same rows
# The workload, passed identically to all three (train.py's defaults give warmup 0.1 and weight decay 0.01).
EPOCHS, BATCH_SIZE, LEARNING_RATE, MAX_LENGTH = 1, 32, 5e-5, 128
CONTENTION_LIMIT = 0.1  # cores kept busy by other processes during a run before the table warns
# Targets of issue 24 (and issue 10 for the launcher), checked in the printed summary: train.py's wall time against
# the tuned Trainer's at equal precision, and against the untuned peers'.
TARGET_WALL_RATIO, TARGET_UNTUNED_RATIO, TARGET_ACCURACY_POINTS, TARGET_PADDING, TARGET_OUTSIDE_SECONDS = (
    0.8, 0.5, 1.0, 0.05, 5.0,
)  # fmt: skip
TARGET_LAUNCH_RATIO = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6000, help="Shuffled training rows to sample from SST-2.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="One run per peer per seed.")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(PEERS),
        default=DEFAULT_PEERS,
        help=f"Peers to run (default: {DEFAULT_PEERS}).",
    )
    parser.add_argument("--output", type=Path, help="Also write the markdown table to this file.")
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA_DIR, help="SST-2 train.tsv, validation.tsv.")
    parser.add_argument("--results_dir", type=Path, default=BENCHMARKS / "results", help="Git-ignored work folder.")
    return parser.parse_args()


def write_sample(source: Path, rows: int, destination: Path) -> Path:
    """A deterministic shuffled sample of `rows` lines of an unquoted TSV, copied byte for byte."""
    header, *lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    if rows > len(lines):
        raise SystemExit(f"--rows {rows}: {source} has only {len(lines)} rows")
    random.Random(SAMPLE_SEED).shuffle(lines)
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text(header + "".join(lines[:rows]), encoding="utf-8")
    return destination


def count_rows(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines()[1:] if line.strip())


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    return f"{text}; {versions}, accelerate {accelerate.__version__}; Python {platform.python_version()}"


def count_parameters(model_path: str) -> tuple[int, int]:
    """(non-embedding, total) parameters of the classifier all three peers train."""
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    total = sum(p.numel() for p in model.parameters())
    # Embedding lookups cost no matmul FLOPs, so the 6N rule leaves them out (word, position and type tables).
    embeddings = sum(p.numel() for p in model.base_model.embeddings.parameters())
    return total - embeddings, total


def busy_cpu_seconds() -> float | None:
    """CPU seconds spent so far by everything on the machine (all cores), from /proc/stat; None elsewhere."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def common_arguments(train_file: Path, validation_file: Path, output_dir: Path, seed: int) -> list[str]:
    """The workload's flags, spelled as train.py spells them; every peer accepts the same ones."""
    return ["--train_file", str(train_file), "--validation_file", str(validation_file),
            "--num_train_epochs", str(EPOCHS), "--per_device_train_batch_size", str(BATCH_SIZE),
            "--learning_rate", str(LEARNING_RATE), "--max_length", str(MAX_LENGTH), "--seed", str(seed),
            "--output_dir", str(output_dir)]  # fmt: skip


def project_arguments(train_file: Path, validation_file: Path, output_dir: Path, seed: int) -> list[str]:
    """train.py's flags: the workload, and otherwise its defaults (precision, sampler, warmup, weight decay).

    `--report_to none`: the peers keep no TensorBoard logs either.
    """
    return [*common_arguments(train_file, validation_file, output_dir, seed), "--report_to", "none",
            "--overwrite_output_dir"]  # fmt: skip


def project_precision() -> tuple[bool, str]:
    """What `python train.py` will compute in on this machine (bf16 or not, and why), decided as it decides, with
    its threads: the tuned Trainer gets the same, so that the ratio measures the code, not the precision. Deciding
    here also fills the per-machine cache, so no run of train.py pays for the measurement."""
    from src.precision import default_precision
    from src.runtime import set_cpu_threads

    threads = torch.get_num_threads()
    set_cpu_threads(None)
    try:
        precision, why = default_precision(on_cpu=True)
    finally:
        torch.set_num_threads(threads)
    return precision == "bf16", why


def peer_command(peer: str, train_file: Path, validation_file: Path, run_dir: Path, seed: int, bf16: bool) -> list[str]:
    if peer in PROJECT_PEERS:
        # `accelerate launch` with no config file: what a user types first (issue 10).
        launcher = [sys.executable] if peer == "project" else [sys.executable, "-m", "accelerate.commands.launch"]
        return [*launcher, "train.py", *project_arguments(train_file, validation_file, run_dir / "model", seed)]
    script = BENCHMARKS / f"peer_{peer.split('_')[0]}.py"
    options = {"trainer_grouped": ["--group_by_length"] + (["--bf16"] if bf16 else [])}
    common = common_arguments(train_file, validation_file, run_dir / "model", seed)
    return [sys.executable, str(script), *common, *options.get(peer, []), "--results", str(run_dir / "results.json")]


def project_training_seconds(run_dir: Path, results: dict) -> float | None:
    """train.py's time in the training steps alone, from the throughput windows in its metrics.jsonl.

    train.py's train_runtime also covers the evaluation it runs at the end of the epoch, while the peers time
    training and evaluation separately. Each logged window reports samples_per_second with samples counted
    as batches x per-device batch size, so its seconds are (steps in the window) x batch / samples_per_second
    (one process, no gradient accumulation, as here). None if the file does not allow that.
    """
    try:
        records = [json.loads(line) for line in (run_dir / "model" / "metrics.jsonl").read_text().splitlines() if line]
    except (OSError, json.JSONDecodeError):
        return None
    if results.get("num_processes") != 1 or results.get("total_train_batch_size") != BATCH_SIZE:
        return None
    seconds, previous_step = 0.0, 0
    for record in records:
        if "samples_per_second" in record:
            seconds += (record["step"] - previous_step) * BATCH_SIZE / record["samples_per_second"]
            previous_step = record["step"]
    return seconds if 0 < seconds <= results["train_runtime"] else None


def read_run(peer: str, run_dir: Path, train_rows: int) -> dict:
    """The measurements of one run in a common form: accuracy, seconds, samples and token counts."""
    if peer not in PROJECT_PEERS:
        results = json.loads((run_dir / "results.json").read_text())
        return {
            "precision": "bf16" if results.get("bf16") else "fp32",
            "threads": results.get("threads"),
            "accuracy": results["eval_accuracy"],
            "train_seconds": results["train_runtime"],
            "eval_seconds": results["eval_runtime"],
            "samples": results["train_samples"],
            "tokens": results["train_tokens"],
            "padded_tokens": results["train_padded_tokens"],
        }
    results = json.loads((run_dir / "model" / "all_results.json").read_text())
    run_args = json.loads((run_dir / "model" / "args.json").read_text())
    runtime = results["train_runtime"]
    tokens = results["train_tokens_per_second"] * runtime
    train_seconds = project_training_seconds(run_dir, results)
    return {
        "precision": "bf16" if run_args.get("mixed_precision") == "bf16" else "fp32",
        "threads": results.get("cpu_threads_per_process"),
        "accuracy": results["eval_accuracy"],
        "train_seconds": train_seconds if train_seconds is not None else runtime,
        "eval_seconds": runtime - train_seconds if train_seconds is not None else None,
        # train.py counts every batch as full (its last one holds fewer rows); the rows trained on are known.
        "samples": EPOCHS * train_rows,
        "reported_samples": round(results["train_samples_per_second"] * runtime),
        "tokens": tokens,
        "padded_tokens": tokens / (1 - results["train_padding_fraction"]),
    }


def run_one(
    peer: str, seed: int, train_file: Path, validation_file: Path, results_dir: Path, bf16: bool
) -> dict | None:
    run_dir = results_dir / "runs" / f"{peer}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # An empty datasets cache per run: the runs read the same TSV, and a warm cache would favour the later ones.
    env["HF_DATASETS_CACHE"] = str(run_dir / "datasets_cache")
    command = peer_command(peer, train_file, validation_file, run_dir, seed, bf16)
    log_path = run_dir / "log.txt"
    print(f"[{time.strftime('%H:%M:%S')}] {PEERS[peer]}, seed {seed} ...", file=sys.stderr, flush=True)
    # CPU used on the machine minus CPU used by the run: other work that slowed the run down.
    busy_before, children_before = busy_cpu_seconds(), children_cpu_seconds()
    with open(log_path, "w") as log:
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
    busy_after, children_after = busy_cpu_seconds(), children_cpu_seconds()
    other_cores = None
    if busy_before is not None and busy_after is not None:
        other = (busy_after - busy_before) - (children_after - children_before)
        other_cores = max(0.0, other) / wall
    if completed.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        print(f"  FAILED (exit {completed.returncode}); end of {log_path}:\n{tail}", file=sys.stderr)
        return None
    measured = read_run(peer, run_dir, count_rows(train_file))
    shutil.rmtree(run_dir / "datasets_cache", ignore_errors=True)
    busy = f", other processes busy on {other_cores:.2f} cores" if other_cores is not None else ""
    print(f"  wall {wall:.1f}s, accuracy {measured['accuracy']:.4f}{busy}", file=sys.stderr, flush=True)
    return {"wall_seconds": wall, "other_cores": other_cores, **measured}


def summarize(runs: list[dict], non_embedding_params: int, peak_by_precision: dict) -> dict:
    """Means over seeds, and the throughput figures derived from them."""
    mean = {key: statistics.fmean(run[key] for run in runs) for key in ("wall_seconds", "train_seconds", "samples")}
    mean["tokens"] = statistics.fmean(run["tokens"] for run in runs)
    mean["padded_tokens"] = statistics.fmean(run["padded_tokens"] for run in runs)
    evals = [run["eval_seconds"] for run in runs if run["eval_seconds"] is not None]
    accuracies = [run["accuracy"] for run in runs]
    train = mean["train_seconds"]
    flops_per_second = 6 * non_embedding_params * mean["tokens"] / train
    precision = runs[0]["precision"]
    return {
        **mean,
        "precision": precision,
        "threads": runs[0]["threads"],
        "eval_seconds": statistics.fmean(evals) if evals else None,
        "outside_seconds": mean["wall_seconds"] - train,
        "accuracy": statistics.fmean(accuracies),
        "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
        "samples_per_second": mean["samples"] / train,
        "tokens_per_second": mean["tokens"] / train,
        "padded_tokens_per_second": mean["padded_tokens"] / train,
        "padding_fraction": 1 - mean["tokens"] / mean["padded_tokens"],
        "flops_per_second": flops_per_second,
        "mfu": flops_per_second / peak_by_precision["bfloat16" if precision == "bf16" else "float32"],
        "reported_samples": runs[0].get("reported_samples"),
    }


def format_table(summaries: dict, header: list[str], footnotes: list[str]) -> str:
    project_wall = summaries["project"]["wall_seconds"] if "project" in summaries else None
    columns = ["peer", "precision", "wall s", "train.py wall / this", "train loop s", "outside loop s", "eval s"]
    columns += ["samples/s", "real tok/s", "padded tok/s", "padding", "model GFLOP/s ¹", "MFU ²", "accuracy"]
    lines = [*header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for peer, s in summaries.items():
        accuracy = f"{s['accuracy']:.4f}" + (f" ± {s['accuracy_std']:.4f}" if s["accuracy_std"] is not None else "")
        cells = [
            PEERS[peer],
            s["precision"],
            f"{s['wall_seconds']:.1f}",
            f"{project_wall / s['wall_seconds']:.2f}" if project_wall else "n/a",
            f"{s['train_seconds']:.1f}",
            f"{s['outside_seconds']:.1f}",
            f"{s['eval_seconds']:.1f}" if s["eval_seconds"] is not None else "n/a",
            f"{s['samples_per_second']:.1f}",
            f"{s['tokens_per_second']:,.0f}",
            f"{s['padded_tokens_per_second']:,.0f}",
            f"{s['padding_fraction']:.1%}",
            f"{s['flops_per_second'] / 1e9:,.1f}",
            f"{s['mfu']:.1%}",
            accuracy,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *footnotes]) + "\n"


def target_lines(summaries: dict) -> list[str]:
    """Each target of issues 24 and 10 that these runs can check, with the measured value and MET or MISSED."""
    project, checks = summaries.get("project"), []
    if project is None:
        return []
    if "trainer_grouped" in summaries:
        ratio = project["wall_seconds"] / summaries["trainer_grouped"]["wall_seconds"]
        checks.append(
            (f"train.py wall / tuned Trainer wall = {ratio:.2f} (<= {TARGET_WALL_RATIO})", ratio <= TARGET_WALL_RATIO)
        )
    for peer in ("trainer", "plain"):
        if peer in summaries:
            ratio = project["wall_seconds"] / summaries[peer]["wall_seconds"]
            text = f"train.py wall / {PEERS[peer]} wall = {ratio:.2f} (<= {TARGET_UNTUNED_RATIO})"
            checks.append((text, ratio <= TARGET_UNTUNED_RATIO))
    others = {peer: s for peer, s in summaries.items() if peer not in PROJECT_PEERS}
    if others:
        best = max(others, key=lambda peer: others[peer]["accuracy"])
        points = 100 * (project["accuracy"] - others[best]["accuracy"])
        text = f"accuracy, train.py {project['accuracy']:.4f} vs the best peer ({PEERS[best]}) "
        text += f"{others[best]['accuracy']:.4f}: {points:+.1f} points (>= -{TARGET_ACCURACY_POINTS:g})"
        checks.append((text, points >= -TARGET_ACCURACY_POINTS))
    padding = project["padding_fraction"]
    checks.append(
        (f"padding in train.py's batches = {padding:.1%} (<= {TARGET_PADDING:.0%})", padding <= TARGET_PADDING)
    )
    outside = project["outside_seconds"]
    text = f"train.py outside its training steps = {outside:.1f} s"
    if project["eval_seconds"] is not None:
        text += f", of which evaluation {project['eval_seconds']:.1f} s"
    checks.append((f"{text} (<= {TARGET_OUTSIDE_SECONDS:g} s)", outside <= TARGET_OUTSIDE_SECONDS))
    if "launch" in summaries:
        ratio = summaries["launch"]["tokens_per_second"] / project["tokens_per_second"]
        text = f"training tokens/s, accelerate launch / python = {ratio:.2f} "
        text += f"({summaries['launch']['threads']} vs {project['threads']} threads; >= {TARGET_LAUNCH_RATIO})"
        checks.append((text, ratio >= TARGET_LAUNCH_RATIO))
    return [f"- {text}: {'MET' if met else 'MISSED'}" for text, met in checks]


def main():
    args = parse_args()
    for name in ("train.tsv", "validation.tsv"):
        if not (args.data_dir / name).is_file():
            raise SystemExit(f"{args.data_dir / name} not found; point --data_dir at a folder with SST-2 TSVs")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    train_file = write_sample(
        args.data_dir / "train.tsv", args.rows, args.results_dir / "data" / f"sst2_train_{args.rows}.tsv"
    )
    validation_file = args.data_dir / "validation.tsv"

    # Done before the runs, this also brings torch, transformers and the weights into the page cache, so the
    # first run does not pay for cold disk reads that the later ones would be spared.
    model_path = default_model_path()
    non_embedding, total = count_parameters(model_path)
    device = torch.device("cpu")  # these peers train on the CPU; benchmarks/gpu_benchmark.py is for GPUs
    peak_by_precision = peaks(device)
    bf16, why = project_precision()
    print(f"train.py and the tuned Trainer compute in {'bf16' if bf16 else 'fp32'}: {why}", file=sys.stderr)

    runs = {peer: [] for peer in args.only}
    for index, seed in enumerate(args.seeds):
        # Rotate the order from seed to seed so that no peer always runs first on a freshly idle machine.
        order = args.only[index % len(args.only) :] + args.only[: index % len(args.only)]
        for peer in order:
            result = run_one(peer, seed, train_file, validation_file, args.results_dir, bf16)
            if result is not None:
                runs[peer].append(result)
    summaries = {peer: summarize(r, non_embedding, peak_by_precision) for peer, r in runs.items() if r}
    if not summaries:
        raise SystemExit("every run failed; see the logs under " + str(args.results_dir / "runs"))

    validation_rows = count_rows(validation_file)
    sizes = " / ".join(str(size) for size in PEAK_SIZES[device.type])
    peak_text = ", ".join(f"{name} {value / 1e9:,.0f}" for name, value in peak_by_precision.items())
    header = [
        f"### Fine-tuning benchmark, {datetime.date.today().isoformat()}",
        "",
        f"- Machine: {machine_description()}",
        f"- Workload: all-MiniLM-L6-v2 ({non_embedding / 1e6:.1f}M non-embedding of {total / 1e6:.1f}M parameters), "
        f"{args.rows:,} shuffled SST-2 training rows (sample seed {SAMPLE_SEED}), {EPOCHS} epoch, batch {BATCH_SIZE}, "
        f"lr {LEARNING_RATE:g}, 10% warmup, weight decay 0.01, max length {MAX_LENGTH}; "
        f"accuracy on all {validation_rows} validation rows",
        f"- Seeds: {', '.join(map(str, args.seeds))} (figures are means over seeds; accuracy ± standard deviation)",
        f"- Precision of train.py and the tuned Trainer: {'bf16 autocast' if bf16 else 'fp32'} ({why})",
        f"- Peak for MFU: best square matmul ({sizes}) measured by matmul_peak.py, GFLOP/s: {peak_text}",
    ]
    footnotes = [
        "Wall s: the whole process timed from outside (imports, model load, tokenisation, training, evaluation, "
        "saving the model). Train loop s: the training steps only; outside loop s: wall minus train loop "
        "(start-up, data, evaluation, saving); eval s: the final evaluation. Throughputs are per train-loop second.",
        "¹ 6 x N x real tokens per train-loop second, N = non-embedding parameters. With padding the hardware "
        "does more work than this count (the padded tokens are computed too), and attention's own FLOPs are left "
        "out, so this understates the arithmetic done.",
        "² Model FLOP/s divided by the measured matmul rate of the precision the peer computes in.",
    ]
    if "launch" in summaries:
        from accelerate.commands.config import default_config_file

        if Path(default_config_file).exists():
            footnotes.append(
                f"`accelerate launch` read the default config {default_config_file}, not the launcher's defaults."
            )
    threads = {PEERS[peer]: s["threads"] for peer, s in summaries.items() if s["threads"]}
    if threads:
        footnotes.append("CPU threads per process: " + ", ".join(f"{k} {v}" for k, v in threads.items()) + ".")
    others = [run["other_cores"] for peer_runs in runs.values() for run in peer_runs if run["other_cores"] is not None]
    if others:
        warning = " TIMINGS DISTURBED: rerun on an idle machine." if max(others) > CONTENTION_LIMIT else ""
        footnotes.append(
            f"Other processes kept on average {statistics.fmean(others):.2f} cores busy during the runs "
            f"(at most {max(others):.2f} in one run).{warning}"
        )
    project = summaries.get("project")
    if project and project["reported_samples"] not in (None, round(project["samples"])):
        footnotes.append(
            f"train.py's own samples/s counts every batch as full ({project['reported_samples']:,} samples for "
            f"{project['samples']:,.0f} rows); the table uses the rows actually trained on."
        )
    if project and project["eval_seconds"] is None:
        footnotes.append("train.py's train loop s includes its end-of-epoch evaluation (metrics.jsonl unreadable).")
    targets = target_lines(summaries)
    table = format_table(summaries, header, footnotes) + ("\nTargets:\n" + "\n".join(targets) + "\n" if targets else "")
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table)
    if any(len(r) < len(args.seeds) for r in runs.values()):
        raise SystemExit("some runs failed; see the logs above")


if __name__ == "__main__":
    main()
