"""The run record, args.json: what a run was. evaluate.py, resume and the model card read it.

It holds the flags as given (never --hub_token), what the run settled on (src/plan.py: precision, batch sizes,
max_length, ...) and what its task needs to be rebuilt (its name or import path, and `Task.record()`: columns,
label weights, threshold). Folders of earlier versions hold the same keys, without `task`.
"""

import hashlib
import json
from pathlib import Path

RECORD_FILE = "args.json"
DEFAULT_TASK = "sequence-classification"  # what folders written before tasks were recorded hold


def run_record(args, plan, task, hub_target=None) -> dict:
    record = {key: value for key, value in vars(args).items() if key != "hub_token"}
    record |= plan.as_dict() | task.record() | {"task": task_spec(task)}
    # The data files by their contents, which a resume compares: a copy of them elsewhere (a job's scratch folder)
    # resumes; a changed file, or a validation file dropped (its rows would be held out of the training data), not.
    for flag in ("train_file", "validation_file"):
        record[f"{flag}_sha256"] = file_sha256(getattr(args, flag)) if getattr(args, flag, None) else None
    if hub_target is not None:
        record["hub_model_id"] = hub_target.repo_id  # resolved to owner/name
    return {key: str(value) if isinstance(value, Path) else value for key, value in record.items()}


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def task_spec(task) -> str:
    """The name `--task` takes for this task: its listed name, or its import path (also for a subclass of a listed
    task that keeps its name: the listed name would rebuild the base class, without the subclass's changes)."""
    from src.tasks import TASKS, task_class

    cls = type(task)
    return cls.name if cls.name in TASKS and task_class(cls.name) is cls else f"{cls.__module__}:{cls.__qualname__}"


def read_record(folder) -> dict:
    """A train.py output folder's record, or {} for other folders (a model from elsewhere) and unreadable files."""
    try:
        record = json.loads((Path(folder) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
