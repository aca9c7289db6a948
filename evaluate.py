"""Evaluate a fine-tuned classifier or regressor on any number of processes.

    accelerate launch evaluate.py --model_name_or_path outputs/run --validation_file dev.csv

The model folder may hold a whole model or a LoRA adapter and head (train.py --use_peft) on the base model it names.

Writes eval_results.json, predictions.csv (one row per example, in the data's order; multi-label
label sets as JSON lists) and a picture (confusion matrix, or predicted-vs-true scatter for regression).
The files are the same whether it runs on 1 or many processes.
"""

import csv
import gc
import json
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from datasets import Dataset

from src.args import build_eval_parser, parse_args
from src.data import (
    build_eval_dataloader,
    detect_columns,
    glue_labels,
    load_file,
    load_hub_dataset,
    padding_options,
    pick_split,
    tokenize,
)
from src.errors import UserError, main_process_first, run_cli
from src.evaluation import evaluate
from src.model import load_model, load_tokenizer, resolve_max_length
from src.precision import choose_precision
from src.reporting import plot_confusion_matrix, plot_regression, setup_logging, write_json
from src.runtime import refuse_fsdp_without_gpus, set_cpu_threads
from src.task import task_of_config

logger = get_logger(__name__)


def parse_eval_args(argv=None):
    parser = build_eval_parser()
    args = parse_args(parser, argv)
    if not args.model_name_or_path:
        parser.error("--model_name_or_path is required: a train.py output folder")
    if bool(args.validation_file) == bool(args.dataset_name):
        parser.error("give exactly one of --validation_file or --dataset_name")
    if args.output_dir is None:
        if not Path(args.model_name_or_path).is_dir():
            parser.error("--output_dir is needed when --model_name_or_path is not a local folder")
        args.output_dir = Path(args.model_name_or_path)
    return args


def training_settings(model_dir: str) -> dict:
    """The resolved flags of the train.py run that wrote `model_dir` (its args.json), or {} for other folders."""
    try:
        return json.loads((Path(model_dir) / "args.json").read_text())
    except (OSError, ValueError):  # not a train.py folder, or an unreadable file: detect everything instead
        return {}


def load_split(args) -> Dataset:
    if args.validation_file:
        return load_file(args.validation_file)
    splits = load_hub_dataset(args.dataset_name, args.dataset_config_name, instead="--validation_file")
    name = pick_split(splits, args.split)
    if name is None:
        raise UserError(f"--split {args.split}: {args.dataset_name} has only {', '.join(splits)}")
    return splits[name]


def main(args):
    refuse_fsdp_without_gpus()
    trained = training_settings(args.model_name_or_path)
    on_cpu = not torch.accelerator.is_available()
    PartialState(cpu=on_cpu, timeout=timedelta(seconds=args.ddp_timeout))
    if on_cpu:
        set_cpu_threads(args.cpu_threads)
    # The training run's precision, unless told otherwise, so that its final metrics are reproduced.
    precision, why = choose_precision(args.mixed_precision, on_cpu, trained.get("mixed_precision"))
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=precision)
    setup_logging()
    logger.info(f"Mixed precision = {precision} ({why})")

    with main_process_first(accelerator, args.data_preparation_timeout):
        data = load_split(args)
        if args.max_eval_samples:
            data = data.select(range(min(args.max_eval_samples, len(data))))
        # Unless told otherwise, evaluate the columns the model was trained on, where this data has them.
        remembered = {k: v for k, v in trained.items() if k.endswith("_column") and v in data.column_names}
        text_column, pair_column, label_column = detect_columns(
            data.column_names,
            args.text_column or remembered.get("text_column"),
            args.text_pair_column or remembered.get("text_pair_column"),
            args.label_column or remembered.get("label_column"),
            need_label=False,
        )
        if trained.get("task_name"):  # GLUE ids in a local file, named as the model's labels are
            data = glue_labels(data, trained["task_name"], label_column)
        tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        # A whole model, or a LoRA output's adapter and head on its base model (in the dtypes training used).
        model = load_model(
            args.model_name_or_path, pad_token_id=tokenizer.pad_token_id, mixed_precision=accelerator.mixed_precision,
            trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
        # The training run's class weights (its evaluation loss used them too) and threshold, unless told otherwise.
        threshold = args.multi_label_threshold or trained.get("multi_label_threshold", 0.5)
        task = task_of_config(model.config, trained.get("class_weight_values"), threshold)
        # The training run's --max_length unless told otherwise: texts cut elsewhere get other predictions.
        args.max_length = resolve_max_length(args.max_length or trained.get("max_length"), tokenizer, model.config)
        dataset = tokenize(data, tokenizer, (text_column, pair_column, label_column), args.max_length, task)

    padding = padding_options(accelerator.device)  # as train.py pads
    dataloader = accelerator.prepare(
        build_eval_dataloader(dataset, tokenizer, args.per_device_eval_batch_size, **padding)
    )
    model = accelerator.prepare_model(model, evaluation_mode=True)  # no DDP wrapper: nothing to synchronise
    logger.info(
        f"Evaluating {args.model_name_or_path} on {len(dataset)} examples with {accelerator.num_processes} "
        f"process(es), batch size {args.per_device_eval_batch_size} per process"
    )
    metrics, columns = evaluate(model, dataloader, accelerator, task)

    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        # Rounded so that the number of processes (the summation order) cannot change the file. Another batch size
        # pads differently, which under bf16 autocast can move eval_loss in the 6th decimal.
        write_json(args.output_dir / "eval_results.json", {k: round(v, 6) for k, v in metrics.items()})

        def show(value):
            if task.is_regression:
                return f"{value:.4f}"
            if task.is_multi_label:  # a JSON list of names: unambiguous whatever the names hold, [] for none
                return json.dumps(task.names_of(value), ensure_ascii=False)
            return task.label_names[value]

        with open(args.output_dir / "predictions.csv", "w", newline="") as file:
            writer = csv.writer(file)
            has_labels = "label" in columns
            writer.writerow(["index", "label", "prediction"] if has_labels else ["index", "prediction"])
            for row in range(len(columns["index"])):
                values = [columns["index"][row]] + ([show(columns["label"][row])] if has_labels else [])
                writer.writerow(values + [show(columns["prediction"][row])])
        written = ["eval_results.json", "predictions.csv"]
        if "label" in columns and not task.is_multi_label:  # multi-label: per-label F1 in eval_results.json
            picture = args.output_dir / ("predictions_vs_labels.png" if task.is_regression else "confusion_matrix.png")
            if task.is_regression:
                plot_regression(columns["label"], columns["prediction"], picture)
            else:
                plot_confusion_matrix(columns["label"], columns["prediction"], task.label_names, picture)
            written.append(picture.name)
        summary = ", ".join(f"{k} = {v:.4f}" for k, v in metrics.items() if k != "eval_samples")
        logger.info(f"{summary}\nWrote {', '.join(written)} to {args.output_dir.resolve()}")
    accelerator.end_training()
    return metrics


if __name__ == "__main__":
    # What is alive after the imports (the libraries' objects) and at the end (model, data) is freed by the
    # process's exit, not by Python: frozen, no garbage collection scans it again, the exit's included
    # (~1.5 s less CPU during a run with torch and transformers loaded, ~1 s less at exit).
    gc.freeze()
    try:
        run_cli(main, parse_eval_args)
    finally:
        gc.freeze()
