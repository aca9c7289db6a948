"""A task of your own, written outside src/ and named by import path: a bag-of-words sentence classifier whose model
is a plain `nn.Module` (no Transformers class). It reads the data, computes the loss and the metrics as sequence
classification does, and builds, saves and loads its own model; train.py and evaluate.py run it unchanged:

    accelerate launch --config_file accelerate_configs/cpu.yaml train.py \\
        --task examples.custom_task:BagOfWordsClassification --embedding_dim 64 --learning_rate 5e-3 \\
        --train_file train.csv --validation_file dev.csv --output_dir outputs/bow
    accelerate launch evaluate.py --model_name_or_path outputs/bow --validation_file dev.csv

Its own flag, --embedding_dim, exists when this task is chosen. The tokenizer is --model_name_or_path's (the packaged
MiniLM's by default); only its vocabulary is used. LoRA, gradient checkpointing and --push_to_hub need a Transformers
model and are refused with a one-line error.
"""

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from src.errors import UserError
from src.tasks.sequence_classification import SequenceClassification

WEIGHTS, SETTINGS = "model.safetensors", "bag_of_words.json"


class BagOfWords(nn.Module):
    """The mean of the text's token embeddings, then a linear layer."""

    def __init__(self, vocab_size: int, embedding_dim: int, num_labels: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.classifier = nn.Linear(embedding_dim, num_labels)

    def forward(self, input_ids, attention_mask, **unused):  # token_type_ids and the like are not needed
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        mean = (self.embedding(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return {"logits": self.classifier(mean)}  # read as model(**batch)["logits"], as a Transformers output is


class BagOfWordsClassification(SequenceClassification):
    name = "bag-of-words"

    @staticmethod
    def add_arguments(parser):
        SequenceClassification.add_arguments(parser)  # --class_weights
        parser.add_argument("--embedding_dim", type=_positive_int, default=64, help="Size of the word vectors.")

    def build_model(self, args, tokenizer, mixed_precision: str):
        return BagOfWords(len(tokenizer), args.embedding_dim, self.num_labels)

    def save_model(self, accelerator, model, output_dir, args):
        state_dict = accelerator.get_state_dict(model)  # every rank takes part: under FSDP it is a collective
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, Path(output_dir) / WEIGHTS)
            vocab_size, dim = state_dict["embedding.weight"].shape
            settings = {"vocab_size": vocab_size, "embedding_dim": dim, "problem_type": self.problem_type,
                        "label_names": list(self.label_names)}  # fmt: skip
            (Path(output_dir) / SETTINGS).write_text(json.dumps(settings, indent=2))

    @staticmethod
    def trained_labels(model_dir, args) -> tuple[str, list[str]]:
        settings = _settings(model_dir)
        return settings["problem_type"], settings["label_names"]

    def load_model(self, model_dir, args, tokenizer, mixed_precision: str):
        settings = _settings(model_dir)
        model = BagOfWords(settings["vocab_size"], settings["embedding_dim"], max(1, len(settings["label_names"])))
        model.load_state_dict(load_file(Path(model_dir) / WEIGHTS))
        return model

    def model_card(self, where: str, base_name: str, adapter: bool) -> dict:
        card = super().model_card(where, base_name, adapter)
        cls = type(self)  # this class, or a copy or subclass of it elsewhere
        usage = [
            f"from {cls.__module__} import {cls.__qualname__}",
            "",
            f"# or: python evaluate.py --model_name_or_path {where} --validation_file your.csv",
            f'model = {cls.__qualname__}().load_model("{where}", None, None, "no")',
        ]
        # Not a Transformers model, and built with random weights: only the tokenizer is --model_name_or_path's.
        return card | {"pipeline_tag": None, "usage": usage, "library_name": None, "new_model": True}


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _settings(model_dir) -> dict:
    try:
        return json.loads((Path(model_dir) / SETTINGS).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{model_dir} holds no bag-of-words model ({SETTINGS} is missing or damaged)") from err
