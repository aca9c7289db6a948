"""What a run reports as it goes: the console, metrics.jsonl and the trackers' run name.

The writing and plotting functions are called on the main process only.
"""

import json
import logging
import os
from pathlib import Path

import datasets
import transformers


def tracker_project(report_to: str, output_dir: Path) -> str:
    """The project name Accelerate gives every tracker. TensorBoard writes into output_dir/<this name>: `tensorboard/`
    when it is the only tracker. Otherwise the project that WANDB_PROJECT names, where W&B users set it (Accelerate
    hands W&B this name, which would override the variable), or the output folder's name."""
    return "tensorboard" if report_to == "tensorboard" else os.environ.get("WANDB_PROJECT") or Path(output_dir).name


def setup_logging():
    """Our INFO lines on the main process; the libraries' warnings, load reports and progress bars kept out."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    # Accelerate's own INFO lines name each file of every checkpoint (7 a save): "Saved checkpoint ..." says it once.
    # A level set for it already (by the notebook's user, or ACCELERATE_LOG_LEVEL) stays.
    accelerate_logger = logging.getLogger("accelerate")
    if accelerate_logger.level == logging.NOTSET:
        accelerate_logger.setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def metrics_line(metrics: dict, leave_out=("eval_samples",)) -> str:
    """`name = value, ...` for the log: scores to 4 decimals, counts (examples, entities) as whole numbers."""
    shown = (
        f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}" for k, v in metrics.items() if k not in leave_out
    )
    return ", ".join(shown)


def write_json(path: Path, values: dict):
    Path(path).write_text(json.dumps(values, indent=2, default=str) + "\n")


def append_jsonl(path: Path, record: dict):
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")


def keep_records_up_to(path: Path, step: int):
    if Path(path).exists():
        kept = [record for record in read_jsonl(path) if record["step"] <= step]
        Path(path).write_text("".join(json.dumps(record) + "\n" for record in kept))


def read_jsonl(path: Path) -> list[dict]:
    """The records, without a last line cut short by a run killed while writing it."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
