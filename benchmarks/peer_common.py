"""What the two peer scripts share: their flags, data loading and tokenisation, a token-counting collator.

Both peers load and tokenise exactly as a typical user of `datasets` would, so the comparison with train.py
is about the training code, not about one side reading the data in a cleverer way.
"""

import argparse
import json
import sys
from pathlib import Path

from datasets import load_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_model_path() -> str:
    """The same packaged all-MiniLM-L6-v2 folder that train.py uses by default."""
    # Run as `python benchmarks/peer_x.py`, only benchmarks/ is on sys.path; the project's src/ sits one level up.
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    from src.model import default_model_path as project_default

    return project_default()


def build_peer_parser(description: str) -> argparse.ArgumentParser:
    """Flags named like train.py's, with its defaults, so the runner can pass the same values to every peer."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--train_file", type=Path, required=True, help="Training rows (classifiers: SST-2 TSV).")
    parser.add_argument("--validation_file", type=Path, required=True, help="Evaluated at the end of training.")
    parser.add_argument("--results", type=Path, required=True, help="JSON file the measurements are written to.")
    parser.add_argument("--output_dir", type=Path, help="Where the fine-tuned model is saved (not saved if absent).")
    parser.add_argument("--model_name_or_path", help="Default: the packaged all-MiniLM-L6-v2, as in train.py.")
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    return parser


def load_tokenized(train_file: Path, validation_file: Path, tokenizer, max_length: int):
    """A DatasetDict with input_ids, attention_mask, token_type_ids and labels for 'train' and 'validation'."""
    # GLUE TSVs are unquoted: a stray '"' in a sentence must not start a quoted field (quoting=3 is QUOTE_NONE).
    raw = load_dataset(
        "csv",
        data_files={"train": str(train_file), "validation": str(validation_file)},
        delimiter="\t",
        quoting=3,
    )

    def encode(rows):
        return tokenizer(rows["sentence"], truncation=True, max_length=max_length)

    tokenized = raw.map(encode, batched=True, remove_columns=["sentence"])
    return tokenized.rename_column("label", "labels")


class TokenCountingCollator:
    """Wraps a collator and counts samples, real tokens and padded tokens of the batches it builds.

    The real tokens come from the unpadded feature lengths and the padded ones from the batch shape, so the
    counting costs a few integer additions per batch and does not disturb the timing.
    """

    def __init__(self, collator):
        self.collator = collator
        self.samples = self.tokens = self.padded_tokens = 0

    def __call__(self, features):
        batch = self.collator(features)
        self.samples += len(features)
        self.tokens += sum(len(feature["input_ids"]) for feature in features)
        self.padded_tokens += batch["input_ids"].numel()
        return batch

    def counts(self) -> dict:
        return {"train_samples": self.samples, "train_tokens": self.tokens, "train_padded_tokens": self.padded_tokens}


def trainer_settings(args, output_dir: str) -> dict:
    """The TrainingArguments (or SFTConfig) fields both Trainer peers set alike from the shared flags."""
    import torch

    return {
        "output_dir": output_dir,
        "num_train_epochs": args.num_train_epochs,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "per_device_eval_batch_size": args.per_device_eval_batch_size,
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": "linear",
        "warmup_steps": args.warmup_ratio,  # transformers 5: a float below 1 is a fraction of the total steps
        "max_grad_norm": args.max_grad_norm,
        "seed": args.seed,
        "train_sampling_strategy": "group_by_length" if args.group_by_length else "random",
        "bf16": args.bf16,
        "use_cpu": not torch.cuda.is_available(),  # Trainer refuses bf16 on a machine without GPUs otherwise
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def write_results(path: Path, values: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=2) + "\n")
