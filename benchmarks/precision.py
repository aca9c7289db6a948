"""bf16 autocast and torch.compile on this machine's CPU: training steps and evaluation timed separately.

    python benchmarks/precision.py                        # 40 training steps per mode, evaluation on 872 rows
    python benchmarks/precision.py --steps 20 --compile   # also torch.compile (its compile time counted)

Same model, data and batches as run_benchmark.py (all-MiniLM-L6-v2, shuffled SST-2 rows, batch 32, max length
128, train.py's sampler and fused AdamW). The modes run interleaved in one process, batch by batch (each mode
keeps its own copy of the model and optimizer and gets the same batch in turn), so a machine that gets busier
or quieter during the run slows every mode alike. Accuracy is not measured here: it needs whole runs over
several seeds (run_benchmark.py with --only project and train.py's --mixed_precision).
"""

import argparse
import copy
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO))

from run_benchmark import DEFAULT_DATA_DIR, write_sample  # noqa: E402

from src.data import load_file  # noqa: E402
from src.loaders import build_eval_dataloader, build_train_dataloader, padding_collator  # noqa: E402
from src.model import default_model_path, load_tokenizer  # noqa: E402
from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification  # noqa: E402


def autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


def train_step(model, optimizer, batch, bf16: bool):
    batch = dict(batch)
    labels = batch.pop("labels")
    with autocast(bf16):
        logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits.float(), labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def evaluate(model, loader, bf16: bool):
    """The forward passes of an evaluation (what src/evaluation.py adds on top is the same for every mode)."""
    model.eval()
    with torch.no_grad(), autocast(bf16):
        for batch in loader:
            model(**{k: v for k, v in batch.items() if k not in ("labels", "example_index")}).logits.argmax(-1)
    model.train()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6000, help="Shuffled SST-2 rows the batches come from.")
    parser.add_argument("--steps", type=int, default=40, help="Training steps timed per mode (after 3 warm-up steps).")
    parser.add_argument("--eval_repeats", type=int, default=3, help="Evaluations of the validation rows per mode.")
    parser.add_argument("--eval_batch_size", type=int, nargs="+", default=[64], help="Evaluation batch sizes.")
    parser.add_argument("--compile", action="store_true", help="Also time torch.compile'd models (compile counted).")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice).")
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--results_dir", type=Path, default=BENCHMARKS / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    task = SequenceClassification(SINGLE_LABEL, ("0", "1"), columns=("sentence", None, "label"))
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    train_file = write_sample(
        args.data_dir / "train.tsv", args.rows, args.results_dir / "data" / f"sst2_train_{args.rows}.tsv"
    )
    train = task.features(load_file(train_file), tokenizer, 128)
    validation = task.features(load_file(args.data_dir / "validation.tsv"), tokenizer, 128)
    collator = padding_collator(tokenizer)
    loader = build_train_dataloader(train, collator, 32, 1, seed=0)
    batches = [batch for _, batch in zip(range(args.steps + 3), loader)]

    torch.manual_seed(0)
    base = task.build_model(argparse.Namespace(model_name_or_path=path, use_peft=False, trust_remote_code=False,
                                               ignore_mismatched_sizes=True), tokenizer, "no")  # fmt: skip
    modes = {"fp32": False, "bf16 autocast": True}
    models = {}
    for name, bf16 in modes.items():
        model = copy.deepcopy(base).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
        models[name] = (model, optimizer, bf16)

    print(f"# {torch.__version__}, {torch.get_num_threads()} threads, AMX: {torch.cpu._is_amx_tile_supported()}")
    width = statistics.fmean(b["input_ids"].shape[1] for b in batches)
    print(f"# {len(batches) - 3} training steps per mode (batch 32, {width:.1f} tokens wide on average), interleaved")
    seconds = {name: [] for name in models}
    for index, batch in enumerate(batches):
        for name, (model, optimizer, bf16) in models.items():
            start = time.perf_counter()
            train_step(model, optimizer, batch, bf16)
            if index >= 3:
                seconds[name].append(time.perf_counter() - start)
    fp32_total = sum(seconds["fp32"])
    for name, times in seconds.items():
        print(f"train {name:14s}: {sum(times):6.2f} s total, median step {statistics.median(times) * 1e3:6.1f} ms, "
              f"speed-up vs fp32 {fp32_total / sum(times):.2f}x")  # fmt: skip

    for batch_size in args.eval_batch_size:
        eval_loader = build_eval_dataloader(validation, collator, batch_size)
        eval_seconds = {name: [] for name in models}
        for _ in range(args.eval_repeats + 1):  # the first round warms up
            for name, (model, _, bf16) in models.items():
                start = time.perf_counter()
                evaluate(model, eval_loader, bf16)
                eval_seconds[name].append(time.perf_counter() - start)
        best = {name: min(times[1:]) for name, times in eval_seconds.items()}
        for name, value in best.items():
            print(f"eval  {name:14s} batch {batch_size:3d}: {value:5.2f} s (best of {args.eval_repeats}; first "
                  f"{eval_seconds[name][0]:.2f} s), speed-up vs fp32 {best['fp32'] / value:.2f}x")  # fmt: skip

    if args.compile:
        for name, bf16 in modes.items():
            for compiled in (False, True):
                model = copy.deepcopy(base).train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
                runner = torch.compile(model) if compiled else model
                start = time.perf_counter()
                first = None
                for index, batch in enumerate(batches):
                    train_step(runner, optimizer, batch, bf16)
                    if index == 0:
                        first = time.perf_counter() - start
                total = time.perf_counter() - start
                label = f"{name}{' + compile' if compiled else ''}"
                print(f"short run {label:24s}: {len(batches)} steps in {total:6.2f} s (first step {first:5.2f} s)")


if __name__ == "__main__":
    main()
