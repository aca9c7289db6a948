"""Evaluate a fine-tuned model on any number of processes, through the task it was trained for.

    accelerate launch evaluate.py --model_name_or_path outputs/run --validation_file dev.csv

The model folder may hold a whole model or a LoRA adapter and head (train.py --use_peft) on the base model it names.

Writes eval_results.json, predictions.csv (one row per example, in the data's order; multi-label
label sets as JSON lists) and a picture (confusion matrix, or predicted-vs-true scatter for regression).
With --predict_with_generate, a causal LM's answer to each row's prompt goes into predictions.csv too.
Every example counts once whether it runs on 1 or many processes; the metrics agree to the rounding of their
6 decimals, except where another padding moves a computation in its last bits (see write_results).
"""

import gc
import sys

# As in train.py (why: there): no garbage collection until the evaluation is set up, in a process that ends with it.
_ipython = sys.modules.get("IPython")
SCRIPT = __name__ == "__main__" and (_ipython is None or _ipython.get_ipython() is None)
if SCRIPT:
    gc.disable()
import csv
from pathlib import Path

from accelerate.logging import get_logger
from datasets import Dataset

from src.args import Flags, build_eval_parser, parse_args, recorded_task
from src.checkpoint import RESULTS_FILE, STATE_FILE, check_writable
from src.data import check_column_flags, load_file, load_hub_dataset, pick_split
from src.errors import UserError, errors_reach_every_rank, main_process_first, run_cli
from src.evaluation import evaluate, with_top_level_metrics
from src.generation import generate, prompt_room
from src.glue import glue_labels
from src.loaders import build_eval_dataloader, collating_workers, padding_options
from src.model import positions, prepare_for_evaluation, resolve_max_length
from src.record import DEFAULT_TASK, RECORD_FILE, read_record
from src.reporting import metrics_line, setup_logging, write_json
from src.runtime import accelerate_state_of_this_run, collection_resumes, make_accelerator, refuse_fsdp_without_gpus
from src.tasks import task_class, task_of_model

if SCRIPT:
    gc.freeze()

logger = get_logger(__name__)


def parse_eval_args(argv=None):
    task, parser_hint = recorded_task(argv)
    parser = build_eval_parser(task)  # a task of one's own may have flags for evaluation
    parser.unloaded_task = parser_hint
    args = parse_args(parser, argv)
    if not args.model_name_or_path:
        parser.error("--model_name_or_path is required: a train.py output folder")
    if bool(args.validation_file) == bool(args.dataset_name):
        trained_on = "" if args.validation_file else _data_of_the_run(args)
        parser.error(f"give exactly one of --validation_file or --dataset_name{trained_on}")
    generation = [f"--{name}" for name in ("generation_max_length", "generation_num_beams")
                  if getattr(args, name) != parser.get_default(name)]  # fmt: skip
    if generation and not args.predict_with_generate:  # they would be ignored without a word
        parser.error(f"{', '.join(generation)} shape(s) the answers of --predict_with_generate: add it, or drop "
                     f"{'it' if len(generation) == 1 else 'them'}")  # fmt: skip
    model = Path(args.model_name_or_path)
    if (model / STATE_FILE).is_file():  # accelerate's state, without the config that from_pretrained reads
        parser.error(f"--model_name_or_path {model} is a checkpoint, for train.py --resume_from_checkpoint; evaluate "
                     f"its run's output folder ({model.parent}) once the run has finished")  # fmt: skip
    if (model / RECORD_FILE).is_file() and not (model / RESULTS_FILE).is_file():  # started, stopped, or overwritten
        parser.error(f"--model_name_or_path {model} holds a train.py run that has not finished (no {RESULTS_FILE}; "
                     "any model there is an earlier run's): resume it with its train.py command and "
                     "--resume_from_checkpoint latest, then evaluate it")  # fmt: skip
    if args.output_dir is None and not model.is_dir():
        parser.error(f"--model_name_or_path {model} is no local folder (a Hub model needs --output_dir for results)")
    return Flags(vars(args))


def _data_of_the_run(args) -> str:
    """What the run of the model folder was evaluated on, as flags to copy. Not a default: a path in args.json may
    name another file here (or none), and the evaluation would then score other data without a word."""
    try:
        record = read_record(args.model_name_or_path) if args.model_name_or_path else {}
    except UserError:
        return ""
    if record.get("validation_file"):
        return f" (the model was evaluated in training on --validation_file {record['validation_file']})"
    if record.get("dataset_name"):
        config = f" --dataset_config_name {record['dataset_config_name']}" if record.get("dataset_config_name") else ""
        return f" (the model was evaluated in training on --dataset_name {record['dataset_name']}{config})"
    if record.get("train_file"):  # its validation rows were drawn from it: a file of other rows is the fair test
        return (
            f" (the model was evaluated in training on {record.get('validation_split_percentage')}% of --train_file "
            f"{record['train_file']}, held out at random: give a file of rows it did not train on)"
        )
    return ""


def load_split(args, keep_linebreaks: bool = True) -> Dataset:
    if args.validation_file:
        data = load_file(args.validation_file, keep_linebreaks)
    else:
        splits = load_hub_dataset(args.dataset_name, args.dataset_config_name, instead="--validation_file")
        name = pick_split(splits, args.split)
        if name is None:
            raise UserError(f"--split {args.split}: {args.dataset_name} has only {', '.join(splits)}")
        data = splits[name]
    return data.take(args.max_eval_samples) if args.max_eval_samples else data


def main(args) -> dict:
    """Evaluate as `args` say; returns the metrics. Accelerate's state that it sets up is dropped as it returns or
    fails, as in train.py."""
    with accelerate_state_of_this_run():
        return evaluate_model(args)


def evaluate_model(args) -> dict:
    refuse_fsdp_without_gpus()
    check_writable(args.output_dir or args.model_name_or_path)  # results go to the model folder by default
    # What the training run was (task, labels, columns, precision, max_length), or {} for a model from elsewhere.
    record = read_record(args.model_name_or_path)
    # The training run's precision, unless told otherwise, so that its final metrics are reproduced.
    setup_logging()
    accelerator, why, _ = make_accelerator(args, record.get("mixed_precision"))
    logger.info(f"Mixed precision = {accelerator.mixed_precision} ({why})")

    with main_process_first(accelerator, args.data_preparation_timeout):
        data = load_split(args, record.get("keep_linebreaks", True))  # a .txt file read as in training
        check_column_flags(args, data.column_names)
        if record.get("task_name"):  # GLUE ids in a local file, named as the model's labels are
            data = glue_labels(data, record["task_name"], args.label_column or record.get("label_column"))
        # The task the model was trained for, never detected again: its record says how to read the data. Folders of
        # earlier versions were all sequence classification; a model from elsewhere says what it is by its class.
        spec = record.get("task") or (
            DEFAULT_TASK if record else task_of_model(args.model_name_or_path, args.trust_remote_code)
        )
        try:
            cls = task_class(spec)
        except UserError as err:
            raise UserError(f"{args.model_name_or_path} was trained with {err}") from err
        task = cls.from_record(record, args, args.model_name_or_path, data.column_names)
        tokenizer = task.load_tokenizer(args.model_name_or_path, args)
        prompts = task.prompts(data, tokenizer) if args.predict_with_generate else None
        if args.predict_with_generate and prompts is None:
            raise UserError(f"--predict_with_generate answers prompts, and a model for {task.describe()} has none to "
                            "answer: give a causal LM prompt/completion or chat rows, or drop the flag")  # fmt: skip
    with errors_reach_every_rank(accelerator, args.data_preparation_timeout):  # every rank at once, as in train.py
        model = task.load_model(args.model_name_or_path, args, tokenizer, accelerator.mixed_precision)
        if prompts is not None:  # said now, not after the scoring
            prompt_room(positions(getattr(model, "config", None)), args.generation_max_length)
        # The training run's --max_length unless told otherwise: texts cut elsewhere get other predictions.
        max_length = resolve_max_length(args.max_length or record.get("max_length"), tokenizer,
                                        getattr(model, "config", None), default=task.default_max_length)  # fmt: skip
    with main_process_first(accelerator, args.data_preparation_timeout):
        dataset = task.features(data, tokenizer, max_length)
        if not len(dataset) and prompts is None:
            raise UserError(f"none of the {len(data)} rows has anything to evaluate within --max_length {max_length} "
                            "tokens")  # fmt: skip

    model = prepare_for_evaluation(model, accelerator)
    collection_resumes(SCRIPT)
    metrics, columns = {"eval_samples": 0}, None
    batch_size = args.per_device_eval_batch_size or record.get("per_device_eval_batch_size") or 64
    if len(dataset):  # prompts alone (no answers to score) are only answered, below
        collator = task.collator(tokenizer, **padding_options(accelerator.device))  # as train.py pads
        workers = collating_workers(args.dataloader_num_workers, accelerator.device)
        dataloader = accelerator.prepare(build_eval_dataloader(dataset, collator, batch_size, workers))
        logger.info(
            f"Evaluating {args.model_name_or_path} on {len(dataset)} examples with {accelerator.num_processes} "
            f"process(es), batch size {batch_size} per process"
        )
        metrics, columns = evaluate(model, dataloader, accelerator, task)
        metrics = with_top_level_metrics(metrics, task)  # a causal LM's perplexity where run_clm.py has it too
    label_column = args.label_column or record.get("label_column")
    if "eval_loss" not in metrics and prompts is None and label_column:
        fix = (
            f"its column {label_column!r} holds none: an unlabelled split"
            if label_column in data.column_names  # as GLUE's test splits (every label -1): nothing to fix
            else f"its columns: {', '.join(data.column_names)}; name the label column with --label_column"
        )
        logger.warning(f"the data has no labels for {task.describe()} ({fix}): predictions only, no metrics")
    generations = None
    if prompts is not None:
        logger.info(f"Generating up to {args.generation_max_length} tokens for each of {len(prompts)} prompts")
        generations = generate(model, prompts, tokenizer, accelerator, batch_size,
                               args.generation_max_length, args.generation_num_beams)  # fmt: skip
    if accelerator.is_main_process:
        write_results(args.output_dir or Path(args.model_name_or_path), metrics, columns, task, data, generations)
    accelerator.end_training()
    return metrics


def write_results(output_dir: Path, metrics: dict, columns: dict, task, data, generations: list[str] | None = None):
    """eval_results.json, predictions.csv (in the data's order, with the generations if any) and the task's
    pictures."""
    output_dir.mkdir(parents=True, exist_ok=True)
    # Rounded to 6 decimals, which hides most of what the number of processes changes (the summation order). Not all:
    # another batch size or number of processes pads differently, which moves fp32 outputs by ~1e-7 (bf16 autocast:
    # eval_loss in the 6th decimal), and a metric of nearly constant predictions (a correlation) magnifies that.
    write_json(output_dir / "eval_results.json", {k: round(v, 6) for k, v in metrics.items()})
    rows = (
        {"index": []}
        if columns is None
        else {"index": columns["index"].tolist(), **task.prediction_rows(columns, data)}
    )
    if generations is not None:
        rows = _with_answers(rows, generations)
    with open(output_dir / "predictions.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(rows)
        writer.writerows(zip(*rows.values()))
    pictures = [] if columns is None else task.write_pictures(columns, output_dir)
    written = ["eval_results.json", "predictions.csv", *pictures]
    logger.info(f"{metrics_line(metrics) or 'No metrics'}\nWrote {', '.join(written)} to {output_dir.resolve()}")


def _with_answers(rows: dict, generations: list[str]) -> dict:
    """A row per data row, each with its answer; a row that had nothing to score (a prompt without an answer, or one
    that fills --max_length) has its answer only."""
    scored = {index: position for position, index in enumerate(rows.pop("index"))}
    table = {name: [values[scored[row]] if row in scored else "" for row in range(len(generations))]
             for name, values in rows.items()}  # fmt: skip
    return {"index": list(range(len(generations))), **table, "generation": generations}


if __name__ == "__main__":
    run_cli(main, parse_eval_args)
