"""The model card (README.md) every run writes into its output folder: what was trained on what, the results, the
settings and how to load the model; the task says what the model does and how to use it."""

import shlex
from pathlib import Path

from src.glue import GLUE_DATASET
from src.model import PACKAGED_MODEL

PACKAGED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the default model folder holds


def write_model_card(output_dir: Path, settings: dict, results: dict, task):
    """README.md: base model, data, task and labels, final metrics, hyperparameters and how to load the model.

    `settings` is the run's record (args.json); keys it does not know are ignored, missing ones skipped. What the
    model does, its labels and how to use it come from the task.
    """
    output_dir = Path(output_dir)
    base = _base_model_id(settings.get("model_name_or_path"))
    base_name = base or settings.get("model_name_or_path")  # a local folder we cannot name is shown as its path
    data = _describe_data(settings)
    adapter = (output_dir / "adapter_config.json").is_file()  # a LoRA/PEFT run saved its adapter only
    # The code loads the model from the Hub once pushed, else from this folder by its absolute path (a relative one
    # would mean something else, or a Hub name, from another folder); an adapter's base likewise, from where this
    # run loaded it (a local folder runs offline).
    pushed, loaded_from = settings.get("push_to_hub"), settings.get("model_name_or_path")
    where = settings.get("hub_model_id") if pushed else str(output_dir.resolve())
    local = not pushed and loaded_from and Path(loaded_from).is_dir()
    card = task.model_card(where, str(Path(loaded_from).resolve()) if local else base_name, adapter)
    if card.get("new_model"):  # the task's own model, built with random weights: base_name gave its tokenizer only
        base = None

    library = card.get("library_name", "peft" if adapter else "transformers")  # None: a model of the task's own
    metadata = ["---", *([f"library_name: {library}"] if library else [])]
    metadata += [f"pipeline_tag: {card['pipeline_tag']}"] if card["pipeline_tag"] else []
    if base:
        metadata.append(f"base_model: {base}")
    if settings.get("dataset_name") or settings.get("task_name"):
        metadata.append(f"datasets: [{settings.get('dataset_name') or GLUE_DATASET}]")
    metadata += [f"tags: [{card['pipeline_tag'] or task.name}, accelerate]", "---", ""]

    lines = [
        f"# {settings.get('hub_model_id') if settings.get('push_to_hub') else output_dir.name}",
        "",
        f"{_origin(settings, base_name, card.get('new_model'))} on {data} for {card['kind']}, with an Accelerate "
        "training script (train.py).",
        "",
    ]
    if card["labels"]:
        lines += _table("Labels", ("id", "label"), enumerate(card["labels"]))
    metrics = {k.removeprefix("eval_"): f"{v:.4g}" for k, v in results.items()
               if k.startswith("eval_") and "samples" not in k}  # fmt: skip
    if metrics:
        examples = f" ({results['eval_samples']} examples)" if "eval_samples" in results else ""
        best = settings.get("load_best_model_at_end") and settings.get("metric_for_best_model")
        when = f"of the best model by {best}" if best else "at the end of training"
        intro = f"On the validation data{examples}, {when}:"
        lines += _table("Results", ("metric", "value"), metrics.items(), intro)
    lines += _table("Training", ("setting", "value"), _hyperparameters(settings, results))
    lines += ["Every flag of the run is in `args.json`; the curves are in `training_curves.png`.", ""]
    usage = ["```python", *card["usage"]] if card["usage"] else _evaluate_usage(settings, where, output_dir)
    lines += ["## How to use", "", *usage, "```", ""]
    (output_dir / "README.md").write_text("\n".join(metadata + lines))


def _evaluate_usage(settings: dict, where: str, output_dir: Path) -> list[str]:
    """For a task that says nothing of its model's use: evaluate.py, which reads a local folder (pushed: fetch it)."""
    folder = shlex.quote(output_dir.name if settings.get("push_to_hub") else str(output_dir))
    fetch = [f"hf download {where} --local-dir {folder}"] if settings.get("push_to_hub") else []
    return ["```bash", *fetch, f"python evaluate.py --model_name_or_path {folder} --validation_file your_data.csv"]


def _table(title: str, header: tuple[str, str], rows, intro: str | None = None) -> list[str]:
    """A Markdown section with a two-column table."""
    return [f"## {title}", "", *([intro, ""] if intro else []), f"| {header[0]} | {header[1]} |", "| --- | --- |",
            *(f"| {a} | {b} |" for a, b in rows), ""]  # fmt: skip


def _origin(settings: dict, base_name: str | None, new_model: bool) -> str:
    if new_model:
        tokenizer = settings.get("tokenizer_name")  # the packaged model's is named by its Hub id, as a base model is
        return f"A new model with random weights (the tokenizer of `{_base_model_id(tokenizer) or tokenizer}`), trained"
    if base_name:
        return f"Fine-tuned from `{base_name}`"
    new = settings.get("config_name") or settings.get("model_type")
    return f"A new `{new}` model with random weights (built from its config), trained"


def _base_model_id(name: str | None) -> str | None:
    """The Hub id of the base model, for the card's metadata; None for a local folder we cannot name."""
    if not name:
        return None
    if Path(name, "config.json").is_file():
        return PACKAGED_MODEL_ID if PACKAGED_MODEL in Path(name).parts else None
    return name


def _describe_data(settings: dict) -> str:
    if settings.get("task_name"):
        source = "the Hub" if not settings.get("train_file") else f"local files ({Path(settings['train_file']).name})"
        return f"GLUE {settings['task_name'].upper()} ({source})"
    if settings.get("dataset_name"):
        config = settings.get("dataset_config_name")
        return f"`{settings['dataset_name']}`" + (f" ({config})" if config else "")
    if settings.get("train_file"):
        validation = settings.get("validation_file")
        return f"`{Path(settings['train_file']).name}`" + (
            f" (validation: `{Path(validation).name}`)" if validation else ""
        )
    return "the built-in synthetic demo task"


def _hyperparameters(settings: dict, results: dict) -> list[tuple[str, object]]:
    rows = [
        ("learning rate", settings.get("learning_rate")),
        ("optimizer steps", results.get("global_step")),
        ("epochs", results.get("epoch")),  # trained: with --max_train_steps or an early stop, perhaps a fraction
        ("total train batch size", results.get("total_train_batch_size")),
        ("per-device batch size", settings.get("per_device_train_batch_size")),
        ("processes", results.get("num_processes")),
        ("gradient accumulation steps", settings.get("gradient_accumulation_steps")),
        ("scheduler", settings.get("lr_scheduler_type")),
        ("warmup", _warmup(settings)),
        ("weight decay", settings.get("weight_decay")),
        ("max length", settings.get("max_length")),
        ("mixed precision", settings.get("mixed_precision")),
        ("seed", settings.get("seed")),
    ]
    if settings.get("class_weights") not in (None, "none"):
        values = settings.get("class_weight_values") or {}
        shown = ", ".join(f"{k}: {v:.3g}" for k, v in list(values.items())[:20])
        rows.append(("class weights", f"{settings['class_weights']} ({shown})" if shown else settings["class_weights"]))
    if settings.get("use_peft"):
        rows.append(("PEFT", ", ".join(f"{k}={v}" for k, v in settings.items() if k.startswith("lora_")) or "yes"))
    return [(key, value) for key, value in rows if value is not None]


def _warmup(settings: dict):
    if settings.get("num_warmup_steps") is not None:
        return f"{settings['num_warmup_steps']} steps"
    return f"{settings['warmup_ratio']:.0%} of the steps" if settings.get("warmup_ratio") is not None else None
