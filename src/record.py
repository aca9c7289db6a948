"""The run record, args.json: what a run was. evaluate.py, resume and the model card read it.

It holds the flags as given (never --hub_token), what the run settled on (src/plan.py: precision, batch sizes,
max_length, ...) and what its task needs to be rebuilt (its name or import path, and `Task.record()`: columns,
label weights, threshold). Folders of earlier versions hold the same keys, without `task`.
"""

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from src.errors import UserError

RECORD_FILE = "args.json"
DEFAULT_TASK = "sequence-classification"  # what folders written before tasks were recorded hold


def run_record(args, plan, task, hub_target=None) -> dict:
    record = {key: value for key, value in vars(args).items() if key != "hub_token"}
    record |= asdict(plan) | task.record() | {"task": task_spec(task)}
    # What a resume compares of the data (src/checkpoint.py): the training file by its contents, so that a copy of it
    # elsewhere (a job's scratch folder) resumes, and whether validation rows are held out of it (no validation file).
    record["train_file_sha256"] = file_sha256(args.train_file) if args.train_file else None
    record["validation_held_out"] = bool(args.train_file and not args.validation_file)
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
    """A train.py output folder's record, or {} for other folders (a model from elsewhere, a Hub name)."""
    path = Path(folder) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except OSError:  # none there
        return {}
    except ValueError as err:
        record = err
    if not isinstance(record, dict):  # read past, the model would be evaluated with other settings than it was trained
        raise UserError(f"{path} is damaged ({record if isinstance(record, ValueError) else 'not a JSON object'}): "
                        "it records how the model was trained; restore it, e.g. from a checkpoint's "
                        "training_state.json, whose 'args' hold the same values")  # fmt: skip
    return record
