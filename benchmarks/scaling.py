"""Scaling on CPU: train.py's throughput on 1 and 2 ranks, and what gather_for_metrics costs per evaluation.

    python benchmarks/scaling.py            # about 3 minutes on 2 cores

The workload of run_benchmark.py at 2,000 shuffled SST-2 rows (MiniLM, 1 epoch, global batch 32). The two-rank
run uses accelerate_configs/cpu.yaml with 16 rows per rank, so both runs take the same optimizer steps.
The gather cost is measured inside a 2-rank evaluation of the 872 validation rows: the same loop as
src/evaluation.py, timed with and without the model's forward pass.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCHMARKS))


def train_run(ranks: int, train_file: Path, validation_file: Path, output_dir: Path) -> dict:
    args = ["--train_file", str(train_file), "--validation_file", str(validation_file), "--output_dir", str(output_dir),
            "--num_train_epochs", "1", "--per_device_train_batch_size", str(32 // ranks), "--learning_rate", "5e-5",
            "--report_to", "none", "--overwrite_output_dir", "--seed", "42"]  # fmt: skip
    if ranks == 1:
        command = [sys.executable, str(REPO / "train.py"), *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "accelerate_configs" / "cpu.yaml"), "--num_processes", str(ranks),
                   str(REPO / "train.py"), *args]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    results = json.loads((output_dir / "all_results.json").read_text())
    return {"wall": time.perf_counter() - start, **results}


def gather_worker(validation_file: Path, repeats: int):
    """Runs on each rank: evaluation with the model, and the same loop with only the gathers."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification

    from src.data import load_file
    from src.evaluation import evaluate
    from src.loaders import INDEX_COLUMN, build_eval_dataloader, padding_collator
    from src.model import default_model_path, load_tokenizer
    from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification

    accelerator = Accelerator(cpu=True)
    tokenizer = load_tokenizer(default_model_path())
    task = SequenceClassification(SINGLE_LABEL, ("0", "1"), columns=("sentence", None, "label"))
    dataset = task.features(load_file(validation_file), tokenizer, 128)
    loader = accelerator.prepare(build_eval_dataloader(dataset, padding_collator(tokenizer), 64))
    model = AutoModelForSequenceClassification.from_pretrained(default_model_path(), **task.config_fields())
    model = accelerator.prepare_model(model, evaluation_mode=True)

    def gathers_only():
        for batch in loader:
            size = batch["labels"].shape[0]
            values = {"index": batch[INDEX_COLUMN], "prediction": torch.zeros(size, dtype=torch.long),
                      "label": batch["labels"], "loss": torch.zeros(size), "units": torch.ones(size)}  # fmt: skip
            accelerator.gather_for_metrics(values)

    timings = {"evaluation": [], "gathers": []}
    evaluate(model, loader, accelerator, task)  # warm-up: metric modules, allocator
    for _ in range(repeats):
        for name, work in (
            ("evaluation", lambda: evaluate(model, loader, accelerator, task)),
            ("gathers", gathers_only),
        ):
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            work()
            timings[name].append(time.perf_counter() - start)
    if accelerator.is_main_process:
        print(json.dumps({name: min(values) for name, values in timings.items()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gather_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--validation_file", type=Path, default=REPO.parent / "shared/data/sst2/validation.tsv")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.gather_worker:
        return gather_worker(args.validation_file, args.repeats)

    from run_benchmark import DEFAULT_DATA_DIR, write_sample

    results_dir = BENCHMARKS / "results"
    train_file = write_sample(DEFAULT_DATA_DIR / "train.tsv", 2000, results_dir / "data" / "sst2_train_2000.tsv")
    validation_file = DEFAULT_DATA_DIR / "validation.tsv"
    runs = {ranks: train_run(ranks, train_file, validation_file, results_dir / f"scaling-{ranks}") for ranks in (1, 2)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / "cpu.yaml"), str(Path(__file__).resolve()), "--gather_worker",
               "--validation_file", str(validation_file), "--repeats", str(args.repeats)]  # fmt: skip
    output = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout  # fmt: skip
    gather = json.loads(output.strip().splitlines()[-1])

    print(f"### CPU scaling, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores\n")
    print("| ranks | threads per rank | wall s | train loop s | samples/s | real tokens/s | accuracy |")
    print("|---|---|---|---|---|---|---|")
    for ranks, run in runs.items():
        threads = max(1, (os.cpu_count() or 1) // ranks)
        print(f"| {ranks} | {threads} | {run['wall']:.1f} | {run['train_runtime']:.1f} | "
              f"{run['train_samples_per_second']:.1f} | {run['train_tokens_per_second']:,.0f} | "
              f"{run['eval_accuracy']:.4f} |")  # fmt: skip
    share = gather["gathers"] / gather["evaluation"]
    print(f"\ngather_for_metrics on 2 ranks, 872 validation rows in batches of 64: {gather['gathers'] * 1000:.0f} ms "
          f"per evaluation ({share:.1%} of the {gather['evaluation']:.2f} s evaluation).")  # fmt: skip


if __name__ == "__main__":
    main()
