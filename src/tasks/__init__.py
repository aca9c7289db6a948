"""The task families, by the name `--task` takes. A task of your own needs no line here:
`--task my_package.module:MyTask` names it by import path (examples/custom_task.py)."""

import importlib
import json
from pathlib import Path

from src.errors import UserError

TASKS = {
    "token-classification": "src.tasks.token_classification:TokenClassification",
    "causal-lm": "src.tasks.causal_lm:CausalLM",
    "sequence-classification": "src.tasks.sequence_classification:SequenceClassification",
}
FALLBACK = "sequence-classification"  # asked last: it takes any text with a label, and any model with a head


def task_class(spec: str):
    """The Task subclass that `--task` names: a listed name or `module:Class` (the module importable from here)."""
    path = TASKS.get(spec, spec)
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise UserError(f"--task {spec}: use one of {', '.join(TASKS)}, or module.path:ClassName for your own task")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except ImportError as err:
        raise UserError(f"--task {spec}: cannot import {module_name} ({err}): is its folder on PYTHONPATH?") from err
    except AttributeError as err:
        raise UserError(f"--task {spec}: {module_name} has no {class_name}") from err
    from src.tasks.base import Task

    if not (isinstance(found, type) and issubclass(found, Task)):
        raise UserError(f"--task {spec}: {class_name} is not a subclass of src.tasks.base.Task")
    return found


def _asked_in_order() -> list[str]:
    """The listed tasks, FALLBACK last wherever it is listed."""
    return sorted(TASKS, key=lambda name: name == FALLBACK)


def detect_task(train, label_column: str | None = None):
    """--task auto: (the first listed task that recognises the training rows, why).
    `label_column`: --label_column, which makes a column labels (a `text` column beside it is not text to learn)."""
    return next(
        (cls, why) for cls in map(task_class, _asked_in_order()) if (why := cls.recognises(train, label_column))
    )


def task_of_model(model_dir, trust_remote_code: bool = False) -> str:
    """The listed task of a model trained elsewhere (a folder without args.json): the one whose Auto class builds the
    model's architecture for its config (BertForTokenClassification: a tagger; GPT2LMHeadModel: a causal LM), or for
    a LoRA folder of peft's or TRL's, whose peft task type its adapter names; else sequence classification."""
    import transformers

    from src.model import load_trained_config

    adapter = Path(model_dir) / "adapter_config.json"
    if adapter.is_file() and not (Path(model_dir) / "config.json").is_file():
        kind = json.loads(adapter.read_text()).get("task_type")
        return next((name for name in _asked_in_order() if task_class(name).peft_task_type == kind), FALLBACK)
    try:
        config = load_trained_config(model_dir, trust_remote_code)
    except UserError:  # no config: the classifier's loader says what is missing
        return FALLBACK
    for name in _asked_in_order():
        auto_class = getattr(transformers, task_class(name).auto_class, None)
        try:  # the Auto class's own mapping of config classes to model classes
            if auto_class._model_mapping[type(config)].__name__ in (config.architectures or []):
                return name
        except (AttributeError, KeyError):  # a task without an Auto class, or a config it does not know
            continue
    return FALLBACK
