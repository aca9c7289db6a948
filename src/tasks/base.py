"""The task interface: everything train.py, evaluate.py, the batch-size probe, evaluation and the model card need to
know about what is learnt. A task family is one subclass in one file; src/tasks/__init__.py lists them.

The defaults here serve Transformers models (`from_pretrained` / `save_pretrained`); a task whose model is a plain
`nn.Module` overrides `build_model`, `save_model` and `load_model` (examples/custom_task.py).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of positions that no loss is computed for (padding, prompts, later sub-tokens of a word)


class Step(NamedTuple):
    """One batch through the model: the loss summed over its units (examples, or label tokens), how many units that
    is, and per-example tensors (first dimension: the batch's rows) that evaluation gathers across ranks. On labelled
    data (a batch with `labels`) the outputs hold each example's summed `loss` and its `units`: eval_loss is the ratio
    of their sums over the whole set, and `metrics()` is called only then."""

    loss: torch.Tensor
    units: torch.Tensor
    outputs: dict


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy at every position, (batch, length), 0 where the label is IGNORE. Computed over the flattened
    positions, so that the softmax runs along contiguous memory: `F.cross_entropy(logits.transpose(1, 2), labels)`,
    the layout it documents for sequences, took 2.1-2.8x as long forward and backward for a 30k vocabulary on a CPU."""
    flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return flat.view_as(labels)


def label_finder(names):
    """A function from a label's name in the data to its id among a model's label `names` (None if absent). Names that
    differ only in case match (GLUE's entailment, roberta-large-mnli's ENTAILMENT), as in run_glue_no_trainer.py,
    unless the model has two such names."""
    exact = {name: i for i, name in enumerate(names)}
    folded = {name.lower(): i for name, i in exact.items()}
    folded = folded if len(folded) == len(exact) else {}
    return lambda name: exact.get(name, folded.get(name.lower()))


class Task:
    # The name `--task` uses and args.json records; a task outside src/tasks/ is recorded by its import path.
    name = ""
    # The metric that decides the best model when --metric_for_best_model is not given.
    main_metric = "loss"
    # The Transformers Auto class of the task's models (the default build_model and load_model use it).
    auto_class = ""
    default_max_length = 128  # --max_length when not given (or the model's limit if less)
    default_learning_rate = 5e-5  # --learning_rate when not given
    lower_is_better = ("loss",)  # metrics for which the best model has the lowest value
    top_level_metrics = ()  # evaluation metrics that all_results.json also holds without their eval_ prefix
    pictures = ()  # the files that write_pictures may write
    # The model predicts each next token: an encoder checkpoint is switched to causal attention (src/model.py), and
    # the KV cache stays on in its config, for generation (the task's step turns it off in training and scoring).
    predicts_next_token = False
    # LoRA: peft's task type, and whether the head is new (trained in full and saved with the adapter) rather than
    # a pretrained one adapted through the backbone (a causal LM's).
    peft_task_type = ""
    new_head = True

    # --- choosing the task ---
    @staticmethod
    def add_arguments(parser):
        """The task's own flags, on train.py's parser."""

    @staticmethod
    def add_evaluation_arguments(parser):
        """The task's own flags on evaluate.py's parser, for a model its run trained (a threshold to try, say);
        `from_record` reads them from its `args`."""

    @staticmethod
    def recognises(train, label_column: str | None = None) -> str | None:
        """For --task auto: why the training rows are this task's data (logged), or None if they are not;
        `label_column`: the one --label_column names, if given."""
        return None

    @classmethod
    def from_data(cls, args, train) -> "Task":
        """The task as the training rows define it (labels, columns, lengths), before any model is built."""
        raise NotImplementedError

    @classmethod
    def from_record(cls, record: dict, args, model_dir, column_names: list[str]) -> "Task":
        """The task of a trained model, from its run's saved record (args.json, with `record()`'s keys; {} for a
        model from elsewhere), for evaluate.py on data with these columns. `args` are evaluate.py's flags, not
        train.py's: the task's own settings come from `record`."""
        raise NotImplementedError

    def record(self) -> dict:
        """What evaluate.py and resume need to rebuild this task. Its keys are saved at args.json's top level, over
        the flags of the same name; a resume refuses a run whose task records other values (a changed flag of the
        task's own, say)."""
        return {}

    def describe(self) -> str:
        return self.name

    # --- the model ---
    def load_tokenizer(self, name_or_path: str, args, **options):
        from src.model import load_tokenizer

        # train.py passes --tokenizer_name, which is --model_name_or_path unless given apart (or for a new model).
        given_apart = name_or_path != getattr(args, "model_name_or_path", None)
        flag = "--tokenizer_name" if given_apart else "--model_name_or_path"
        return load_tokenizer(name_or_path, trust_remote_code=args.trust_remote_code, flag=flag, **options)

    def config_fields(self) -> dict:
        """What the model's config must carry for this task (number of labels, their names)."""
        return {}

    def build_model(self, args, tokenizer, mixed_precision: str):
        """The model to train, weights in fp32 (or, frozen under LoRA, as stored)."""
        import transformers

        from src.model import load_config, load_model

        config = load_config(args, self.config_fields(), tokenizer, decoder=self.predicts_next_token)
        return load_model(
            getattr(transformers, self.auto_class), args.model_name_or_path, config, lora=args.use_peft,
            new_head=self.new_head, mixed_precision=mixed_precision, trust_remote_code=args.trust_remote_code,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes, kv_cache=self.predicts_next_token,
        )  # fmt: skip

    def save_model(self, accelerator, model, output_dir, args):
        import transformers

        from src.model import save_model

        save_model(accelerator, model, output_dir, getattr(transformers, self.auto_class), args.merge_lora,
                   args.trust_remote_code, self.new_head)  # fmt: skip

    def load_model(self, model_dir, args, tokenizer, mixed_precision: str):
        """The trained model that `save_model` wrote, for evaluate.py."""
        import transformers

        from src.model import load_trained_model

        return load_trained_model(getattr(transformers, self.auto_class), model_dir, tokenizer.pad_token_id,
                                  mixed_precision, args.trust_remote_code, self.new_head,
                                  kv_cache=self.predicts_next_token)  # fmt: skip

    # --- the data ---
    def features(self, dataset, tokenizer, max_length: int, num_proc: int | None = None):
        """Rows to model inputs, with the row's position (`INDEX_COLUMN`) and token count (`LENGTH_COLUMN`);
        tokenized in `num_proc` processes (--preprocessing_num_workers) if given."""
        raise NotImplementedError

    def training_rows(self, features, max_length: int):
        """The training split's `features` as the training loader takes them (a causal LM's packed into rows of up to
        `max_length` tokens, say), with `INDEX_COLUMN` and `LENGTH_COLUMN`; evaluation keeps one example per row."""
        return features

    def collator(self, tokenizer, pad_to_multiple_of=None, pad_to_length=None):
        """A function from a list of feature rows to a batch of tensors, padded to `pad_to_length` (--pad_to_max_length)
        if given, else to the batch's longest row (rounded up to `pad_to_multiple_of`). Rows being evaluated carry
        their number, `example_index`, which the batch must keep as a tensor (evaluation puts results back in order
        with it). It may run in worker processes (--dataloader_num_workers, on by default on GPUs), which receive it
        pickled (a function or class at module level, not a closure): random choices (masking, say) belong in `step`,
        whose random state a checkpoint keeps, not here."""
        from src.loaders import padding_collator

        return padding_collator(tokenizer, pad_to_multiple_of, pad_to_length)

    # --- one batch: training, evaluation and the batch-size probe all call `step` ---
    def step(self, model, batch: dict) -> Step:
        raise NotImplementedError

    def units(self, batch: dict) -> torch.Tensor:
        """How many units `step` will sum the batch's loss over, known before the forward pass so that the loop can
        normalise every batch of an optimizer step by the step's units on all ranks: one per example here."""
        # torch.full, not torch.tensor: copying a number from the host to a GPU makes the host wait for the GPU.
        return torch.full((), len(batch["labels"]), device=batch["labels"].device)

    def counts(self, batch: dict) -> tuple[int, torch.Tensor | int, int]:
        """(examples, real tokens, padded tokens) of a batch, for the logged samples/s and tokens/s: from a tokenizer's
        `input_ids` and `attention_mask` here. A batch without them counts its examples only (its tokens as 0), unless
        the task says otherwise here. Called before `step`, which may take keys out of the batch."""
        ids = batch.get("input_ids")
        if ids is None:
            rows = next((value for value in batch.values() if torch.is_tensor(value) and value.dim()), ())
            return len(rows), 0, 0
        real = batch["attention_mask"].sum() if "attention_mask" in batch else ids.numel()
        return ids.shape[0], real, ids.numel()

    # --- evaluation ---
    def metrics(self, columns: dict) -> dict:
        """Unprefixed metrics from the gathered, row-ordered `Step.outputs` of a whole split."""
        return {}

    def metric_names(self) -> list[str]:
        """What `metrics` reports, for --metric_for_best_model (loss is always there)."""
        return ["loss"]

    def prediction_rows(self, columns: dict, data) -> dict[str, list]:
        """predictions.csv's columns after `index`, from the gathered outputs and the evaluated rows (`data`)."""
        return {}

    def write_pictures(self, columns: dict, output_dir) -> list[str]:
        """Pictures of the predictions that evaluate.py writes; returns their file names."""
        return []

    def prompts(self, dataset, tokenizer) -> list[list[int]] | None:
        """For evaluate.py --predict_with_generate: each row's prompt as token ids, in row order; None if the task's
        rows hold nothing to generate from."""
        return None

    # --- the model card ---
    def model_card(self, where: str, base_name: str, adapter: bool) -> dict:
        """{'kind': what the model does, 'pipeline_tag', 'labels': names or [], 'usage': lines of Python}, and
        'library_name': None for a model that is not a Transformers (or peft) one, which the Hub would offer to load
        with transformers; 'new_model': True for a model built with random weights, of which --model_name_or_path
        gave only the tokenizer (the card then says so, not "fine-tuned from" it)."""
        return {"kind": self.describe(), "pipeline_tag": None, "labels": [], "usage": []}

    def adapter_usage(self, where: str, base_name: str) -> list[str]:
        """How to load a LoRA output folder of a task with a new head: the base model takes the folder's config
        (labels, pad token, head size); peft's AutoPeft* classes would rebuild it from the base model's own config
        and fail on the head, or lose the labels."""
        return [
            "from peft import PeftModel",
            f"from transformers import AutoConfig, {self.auto_class}, AutoTokenizer",
            "",
            f'config = AutoConfig.from_pretrained("{where}")',
            # The base's own head, if it has one, may be of another size: the folder's trained head replaces it.
            f'base = {self.auto_class}.from_pretrained("{base_name}", config=config, ignore_mismatched_sizes=True)',
            f'model = PeftModel.from_pretrained(base, "{where}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        ]
