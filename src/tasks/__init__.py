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


def task_class(spec: str):
    """The Task subclass that `--task` names: a listed name or `module:Class` (the module importable from here)."""
    path = TASKS.get(spec, spec)
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise UserError(f"--task {spec}: use one of {', '.join(TASKS)}, or module.path:ClassName for your own task")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except ImportError as err:
        raise UserError(f"--task {spec}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from err
    except AttributeError as err:
        raise UserError(f"--task {spec}: {module_name} has no {class_name}") from err
    from src.tasks.base import Task

    if not (isinstance(found, type) and issubclass(found, Task)):
        raise UserError(f"--task {spec}: {class_name} is not a subclass of src.tasks.base.Task")
    return found


def detect_task(train, label_column: str | None = None):
    """--task auto: (the first listed task that recognises the training rows, why), asking sequence classification,
    which takes any text with a label, after every other task wherever it is listed.
    `label_column`: --label_column, which makes a column labels (a `text` column beside it is not text to learn)."""
    in_order = sorted(TASKS, key=lambda name: name == "sequence-classification")
    return next((cls, why) for cls in map(task_class, in_order) if (why := cls.recognises(train, label_column)))


def task_of_model(model_dir, trust_remote_code: bool = False) -> str:
    """The listed task of a model trained elsewhere (a folder without args.json), from its architecture: a tagger
    (BertForTokenClassification), a causal LM (LlamaForCausalLM, GPT2LMHeadModel), or else a classifier."""
    from src.model import load_trained_config

    adapter = Path(model_dir) / "adapter_config.json"  # a LoRA folder (peft's, TRL's) names its task type
    if adapter.is_file() and not (Path(model_dir) / "config.json").is_file():
        kind = json.loads(adapter.read_text()).get("task_type")
        return {"CAUSAL_LM": "causal-lm", "TOKEN_CLS": "token-classification"}.get(kind, "sequence-classification")
    try:
        architecture = (load_trained_config(model_dir, trust_remote_code).architectures or [""])[0]
    except UserError:  # no config: the classifier's loader says what is missing
        return "sequence-classification"
    if architecture.endswith("ForTokenClassification"):
        return "token-classification"
    return "causal-lm" if architecture.endswith(("ForCausalLM", "LMHeadModel")) else "sequence-classification"
