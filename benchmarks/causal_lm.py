"""A causal-LM fine-tune's validation loss before and after, offline (no pretrained causal LM ships offline).

    python benchmarks/causal_lm.py            # about 10 minutes on 2 cores

1. A small Llama built from its config (--model_type llama, MiniLM's tokenizer) learns the 725 training responses of
   ../shared/data/alpaca_eval_sft as plain text (continued-pretraining style): the model to fine-tune.
2. Before: evaluate.py scores it on the 80 held-out prompt/completion pairs (the loss on the completions only).
3. train.py fine-tunes it on the 725 training pairs (prompt/completion, completion-only loss); after: the same score.
Nothing of the validation rows is seen before the scores (text.txt holds them, so it is not used).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "alpaca_eval_sft"
SMALL_LLAMA = "hidden_size=256,intermediate_size=1024,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4"
# 256 tokens (a median row is about 400 with MiniLM's tokenizer, so most completions are cut) and batches of 8: the
# LM head over MiniLM's 30,522-word vocabulary is most of the compute on a CPU.
COMMON = ["--report_to", "none", "--overwrite_output_dir", "--seed", "42", "--max_length", "256",
          "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16"]  # fmt: skip


def run(script: str, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    return time.perf_counter() - start


def as_text(source: Path, target: Path):
    """The completions of a prompt/completion file as a `text` column (a causal LM's continued-pretraining data)."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    target.write_text("".join(json.dumps({"text": row["completion"]}) + "\n" for row in rows))


def scores(path: Path) -> dict:
    results = json.loads(path.read_text())
    return {k: results[k] for k in ("eval_loss", "eval_perplexity", "eval_mean_token_accuracy")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", type=Path, default=REPO / "outputs" / "bench-causal-lm")
    parser.add_argument("--pretrain_epochs", type=int, default=1)
    parser.add_argument("--finetune_epochs", type=int, default=1)
    args = parser.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    as_text(DATA / "train_prompt_completion.jsonl", work / "pretrain.jsonl")
    as_text(DATA / "validation_prompt_completion.jsonl", work / "pretrain_validation.jsonl")
    validation = str(DATA / "validation_prompt_completion.jsonl")

    walls = {"pretrain": run(
        "train.py", "--model_type", "llama", "--config_overrides", SMALL_LLAMA, "--learning_rate", "1e-3",
        "--train_file", str(work / "pretrain.jsonl"), "--validation_file", str(work / "pretrain_validation.jsonl"),
        "--num_train_epochs", str(args.pretrain_epochs), "--output_dir", str(work / "base"), *COMMON,
    )}  # fmt: skip
    walls["before"] = run("evaluate.py", "--model_name_or_path", str(work / "base"), "--validation_file", validation,
                          "--output_dir", str(work / "before"))  # fmt: skip
    walls["finetune"] = run(
        "train.py", "--model_name_or_path", str(work / "base"), "--learning_rate", "5e-4",
        "--train_file", str(DATA / "train_prompt_completion.jsonl"), "--validation_file", validation,
        "--num_train_epochs", str(args.finetune_epochs), "--output_dir", str(work / "sft"), *COMMON,
    )  # fmt: skip
    before, after = scores(work / "before" / "eval_results.json"), scores(work / "sft" / "all_results.json")
    print("| model | wall | eval_loss | perplexity | mean token accuracy |\n| --- | --- | --- | --- | --- |")
    for name, wall, score in (("before fine-tuning", walls["pretrain"], before), ("after", walls["finetune"], after)):
        print(f"| {name} | {wall:.0f} s | {score['eval_loss']:.3f} | {score['eval_perplexity']:.1f} | "
              f"{score['eval_mean_token_accuracy']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
