"""Causal-LM fine-tuning: continued pretraining on text, and supervised fine-tuning on prompt/completion pairs or chat
conversations, with the loss on what the model should write (the completion, the assistant's turns) only.

Formats, found from the training rows as TRL's SFTTrainer and run_clm_no_trainer.py read them: `messages` (role and
content) or ShareGPT `conversations` (from and value): chat; `prompt` + `completion`; a `text` column without labels
(or a .txt file): text, concatenated and cut into blocks of --max_length tokens.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from datasets import Dataset

from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN
from src.tasks.base import Step, Task

logger = get_logger(__name__)
IGNORE = -100
CHAT, PROMPT_COMPLETION, TEXT = "chat", "prompt-completion", "text"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# For tokenizers without a chat template (base models, the tests' tiny ones): each turn ends with EOS, so that the
# model learns to stop. Saved into the output's tokenizer, so evaluation and inference render turns the same way.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class CausalLM(Task):
    format: str = TEXT

    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    new_head = False  # the LM head is pretrained: adapted through the backbone, not retrained in full
    lower_is_better = ("loss", "perplexity")
    name = "causal-lm"
    main_metric = "loss"
    default_max_length = 1024  # most SFT rows are longer than a classifier's 128 tokens
    default_learning_rate = 2e-5  # TRL's SFTTrainer's: a pretrained LM's head is not new, as a classifier's is

    @staticmethod
    def recognises(train: Dataset) -> str | None:
        fmt = _format_of(train.column_names)
        return fmt and {CHAT: "a column of chat messages", PROMPT_COMPLETION: "prompt and completion columns",
                        TEXT: "a text column without labels"}[fmt]  # fmt: skip

    @classmethod
    def from_data(cls, args, train: Dataset) -> "CausalLM":
        fmt = _format_of(train.column_names)
        if fmt is None:
            raise UserError(
                f"causal-LM fine-tuning reads `messages` (or `conversations`), `prompt` + `completion`, or `text` "
                f"(or a .txt file); the columns are {', '.join(train.column_names)}"
            )
        return cls(fmt)

    @classmethod
    def from_record(cls, record: dict, args, model_dir, column_names: list[str]) -> "CausalLM":
        fmt = _format_of(column_names)
        if fmt is None:
            raise UserError(f"the data has no columns a causal LM reads (its columns: {', '.join(column_names)})")
        return cls(fmt)

    def record(self) -> dict:
        return {"format": self.format}

    def describe(self) -> str:
        return f"causal-LM fine-tuning on {self.format}" + (
            " (loss on the answers only)" if self.format != TEXT else ""
        )

    def load_tokenizer(self, name_or_path: str, args):
        tokenizer = super().load_tokenizer(name_or_path, args)
        if self.format == CHAT and not tokenizer.chat_template:
            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        return tokenizer

    # --- the data ---
    def features(self, dataset: Dataset, tokenizer, max_length: int) -> Dataset:
        """input_ids and labels (-100 where nothing is to be learnt: prompts, user turns, padding)."""
        if self.format == TEXT:
            return _text_blocks(dataset, tokenizer, max_length)
        encode = _chat_example if self.format == CHAT else _prompt_completion_example

        def rows(batch, indices):
            examples = [encode(tokenizer, dict(zip(batch, values)), max_length) for values in zip(*batch.values())]
            return {
                "input_ids": [ids for ids, _ in examples],
                "attention_mask": [[1] * len(ids) for ids, _ in examples],
                "labels": [labels for _, labels in examples],
                INDEX_COLUMN: indices,
                LENGTH_COLUMN: [len(ids) for ids, _ in examples],
            }

        features = dataset.map(rows, batched=True, with_indices=True, remove_columns=dataset.column_names,
                               desc="Tokenizing")  # fmt: skip
        # A prompt that fills --max_length leaves nothing to learn: such rows are dropped, and said so.
        kept = features.filter(lambda row: any(label != IGNORE for label in row["labels"][1:]), desc="Checking labels")
        if len(kept) < len(features):
            dropped = f"{len(features) - len(kept)} of {len(features)} examples"
            logger.warning(f"{dropped} have nothing to learn within --max_length {max_length} tokens (the prompt "
                           "fills them): dropped; raise --max_length")  # fmt: skip
            kept = kept.map(lambda row, i: {INDEX_COLUMN: i}, with_indices=True, desc="Numbering")  # row order anew
        return kept

    def collator(self, tokenizer, pad_to_multiple_of=None, pad_to_length=None):
        from transformers import DataCollatorForTokenClassification

        # Labels padded with -100 by position: with EOS as the padding token, masking by value would hide every EOS
        # the model must learn to write (transformers' language-modeling collator does; trl #1623).
        padding = {"padding": "max_length", "max_length": pad_to_length} if pad_to_length else {}
        return DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=pad_to_multiple_of, **padding)

    # --- one batch ---
    def units(self, batch: dict) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def step(self, model, batch: dict) -> Step:
        """Each predicted token's cross-entropy (token t predicts token t+1), summed; per example its summed loss, its
        predicted tokens and how many of them the model got right (for mean_token_accuracy, in evaluation only: an
        argmax over the vocabulary at every position is not for the training loop)."""
        labels = batch.pop("labels")
        logits = model(**batch)["logits"][:, :-1].float()
        targets = labels[:, 1:]
        losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        known = targets != IGNORE
        units = known.sum(-1)
        outputs = {"loss": losses.sum(-1), "units": units}
        if not model.training:
            outputs["correct"] = ((logits.argmax(-1) == targets) & known).sum(-1)
        return Step(losses.sum(), units.sum(), outputs)

    # --- evaluation ---
    def metric_names(self) -> list[str]:
        return ["loss", "perplexity", "mean_token_accuracy"]

    def metrics(self, columns: dict) -> dict:
        units = columns["units"].sum().item()
        loss = columns["loss"].double().sum().item() / max(1, units)
        return {
            "perplexity": math.exp(min(loss, 700)),
            "mean_token_accuracy": columns["correct"].sum().item() / max(1, units),
        }

    def prediction_rows(self, columns: dict, data) -> dict[str, list]:
        """Per example: its predicted tokens and their mean loss."""
        units = columns["units"].tolist()
        losses = [f"{loss / max(1, n):.6f}" for loss, n in zip(columns["loss"].tolist(), units)]
        return {"tokens": units, "loss": losses}

    def prompts(self, dataset: Dataset, tokenizer) -> list[list[int]] | None:
        """What the model is to answer: a row's prompt, tokenized as in training; a conversation without its last
        turn if the assistant wrote it (the reference answer), through the chat template with its generation prompt.
        Text rows hold none: they are cut into blocks across rows."""
        if self.format == TEXT:
            return None
        if self.format == PROMPT_COMPLETION:
            return tokenizer(list(dataset["prompt"]))["input_ids"]
        conversations = [_messages(row) for row in dataset]
        return [tokenizer.apply_chat_template(turns[:-1] if turns and turns[-1]["role"] == "assistant" else turns,
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
                for turns in conversations]  # fmt: skip

    # --- the model card ---
    def model_card(self, where: str, base_name: str, adapter: bool) -> dict:
        load = (["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                 f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")'] if adapter else
                ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                 f'model = AutoModelForCausalLM.from_pretrained("{where}")'])  # fmt: skip
        chat = '[{"role": "user", "content": "Hello"}], add_generation_prompt=True, return_tensors="pt"'
        text = 'tokenizer("Hello", return_tensors="pt").input_ids'
        prompt = f"tokenizer.apply_chat_template({chat})" if self.format == CHAT else text
        usage = [*load, f'tokenizer = AutoTokenizer.from_pretrained("{where}")', f"inputs = {prompt}",
                 "print(tokenizer.decode(model.generate(inputs, max_new_tokens=64)[0]))"]  # fmt: skip
        return {"kind": self.describe(), "pipeline_tag": "text-generation", "labels": [], "usage": usage}


def _format_of(columns: list[str]) -> str | None:
    if "messages" in columns or "conversations" in columns:
        return CHAT
    if "prompt" in columns and "completion" in columns:
        return PROMPT_COMPLETION
    if "text" in columns and not {"label", "labels"} & set(columns):
        return TEXT
    return None


def _prompt_completion_example(tokenizer, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """The prompt's tokens (labels -100), then the completion's and EOS (learnt), cut to max_length. Tokenized apart,
    so the boundary is exact whatever the tokenizer merges across it."""
    prompt = tokenizer(row["prompt"])["input_ids"]
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + completion)[:max_length]
    return ids, ([IGNORE] * len(prompt) + completion)[:max_length]


def _chat_example(tokenizer, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """The conversation through the chat template, learning the assistant's turns only: each turn is where the
    template's rendering of the conversation up to it goes beyond the rendering up to the turn's prompt."""
    messages = _messages(row)

    def rendered(until: int, **options) -> list[int]:
        return tokenizer.apply_chat_template(messages[:until], tokenize=True, return_dict=False, **options)

    ids = rendered(len(messages))
    labels = [IGNORE] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, through = rendered(turn, add_generation_prompt=True), rendered(turn + 1)
        # Labels by position hold only if the template renders a conversation as its turns one after another.
        if ids[: len(prompt)] != prompt or ids[: len(through)] != through:
            raise UserError(
                "the chat template does not render a conversation as the sum of its turns (it changes earlier turns "
                "when later ones follow), so the assistant's tokens cannot be found; use another template"
            )
        labels[len(prompt) : len(through)] = ids[len(prompt) : len(through)]
    return ids[:max_length], labels[:max_length]


def _messages(row: dict) -> list[dict]:
    """A chat row's turns with `role` and `content` (ShareGPT's `from` and `value` renamed)."""
    turns = row.get("messages") or row.get("conversations") or []
    if not all(isinstance(turn, dict) and ({"role", "content"} <= set(turn) or {"from", "value"} <= set(turn))
               for turn in turns):  # fmt: skip
        raise UserError(f"a chat row must list turns with 'role' and 'content' (or ShareGPT 'from' and 'value'); "
                        f"found {str(turns)[:200]}")  # fmt: skip
    return [turn if "role" in turn else {"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]),
                                         "content": turn["value"]} for turn in turns]  # fmt: skip


def _text_blocks(dataset: Dataset, tokenizer, block: int) -> Dataset:
    """Every text's tokens and EOS, concatenated over the whole split and cut into blocks of `block` tokens; the last,
    shorter block is kept (run_clm_no_trainer.py drops the end of every 1,000 rows)."""

    def blocks(batch, indices):
        ids = [t for text in batch["text"] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
        chunks = [ids[i : i + block] for i in range(0, len(ids), block)]
        return {"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks], "labels": chunks,
                INDEX_COLUMN: list(range(len(chunks))), LENGTH_COLUMN: [len(c) for c in chunks]}  # fmt: skip

    texts = dataset.filter(lambda row: bool(row["text"] and row["text"].strip()), desc="Dropping empty lines")
    return texts.map(blocks, batched=True, batch_size=None, with_indices=True, remove_columns=texts.column_names,
                     desc="Cutting into blocks")  # fmt: skip
