"""Causal-LM fine-tuning: continued pretraining on text, and supervised fine-tuning on prompt/completion pairs or chat
conversations.

Formats, found from the training rows as TRL's SFTTrainer and run_clm_no_trainer.py read them: `messages` (role and
content) or ShareGPT `conversations` (from and value): chat; `prompt` + `completion`; a `text` column without labels
(or a .txt file): text, concatenated and cut into blocks of --max_length tokens. Which tokens are learnt follows
TRL's defaults: a completion only (--completion_only_loss), every token of a chat unless --assistant_only_loss.
"""

import bisect
import copy
import hashlib
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate.logging import get_logger
from datasets import Dataset, Value

from src.args import Switch, local_or_hub
from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, PaddingColumnToo, padding_collator
from src.tasks.base import IGNORE, Step, Task, token_cross_entropy

logger = get_logger(__name__)
CHAT, PROMPT_COMPLETION, TEXT = "chat", "prompt-completion", "text"
# ShareGPT's role names (and other exports' "bot"), as chat templates and --assistant_only_loss know them.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant"}
# How a chat template marks what the assistant writes, for --assistant_only_loss (transformers' assistant mask).
GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class CausalLM(Task):
    format: str = TEXT
    completion_only_loss: bool = True  # prompt/completion rows: no loss on the prompt
    assistant_only_loss: bool = False  # chat rows: loss on the assistant's turns only (else on every token)
    packing: bool = False  # training rows packed from several examples each (--packing)
    text_column: str = "text"  # text rows: the column read (--text_column, TRL's dataset_text_field)
    # --chat_template_path's text, put into the tokenizer (and so saved with it); not part of the run record.
    chat_template: str | None = field(default=None, compare=False, repr=False)

    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    new_head = False  # the LM head is pretrained: adapted through the backbone, not retrained in full
    lower_is_better = ("loss", "perplexity")
    top_level_metrics = ("perplexity",)  # where run_clm_no_trainer.py writes it
    predicts_next_token = True
    name = "causal-lm"
    default_max_length = 1024  # most SFT rows are longer than a classifier's 128 tokens
    default_learning_rate = 2e-5  # TRL's SFTTrainer's: a pretrained LM's head is not new, as a classifier's is

    @staticmethod
    def add_arguments(parser):
        group = parser.add_argument_group("causal LM")
        group.add_argument(
            "--completion_only_loss",
            action=Switch,
            default=True,
            help="Prompt/completion rows: learn the completion (and its EOS) only, not the prompt (TRL's default).",
        )
        group.add_argument(
            "--assistant_only_loss",
            action=Switch,
            help="Chat rows: learn the assistant's turns only (else every token, TRL's default). Needs a chat "
            "template that marks them with {%% generation %%} (examples/chat_template.jinja does).",
        )
        group.add_argument(
            "--chat_template_path",
            type=local_or_hub,
            help="A Jinja chat template for chat rows, for a model whose tokenizer has none; saved with the "
            "tokenizer. E.g. examples/chat_template.jinja.",
        )
        group.add_argument(
            "--packing",
            action=Switch,
            help="Pack the training examples into rows of up to --max_length tokens (best-fit decreasing), each "
            "example apart from the others (its own positions and attention): fewer padded tokens, the same update. "
            "--per_device_train_batch_size then counts rows. Evaluation is not packed.",
        )

    @staticmethod
    def recognises(train: Dataset, label_column: str | None = None) -> str | None:
        fmt = _format_of(train.column_names)
        if fmt == TEXT and len(train.column_names) > 1:
            # `text` beside other columns is as likely a classifier's data whose label column has another name
            # (`text,score`): the classifier's error asks for --label_column, or --task causal-lm for this.
            return None
        return fmt and {CHAT: "a column of chat messages", PROMPT_COMPLETION: "prompt and completion columns",
                        TEXT: "a lone text column"}[fmt]  # fmt: skip

    @classmethod
    def from_data(cls, args, train: Dataset) -> "CausalLM":
        fmt = TEXT if args.text_column else _format_of(train.column_names)
        if fmt is None:
            raise UserError(
                f"causal-LM fine-tuning reads `messages` (or `conversations`), `prompt` + `completion`, or `text` "
                f"(or a .txt file, or the column --text_column names); the columns are {', '.join(train.column_names)}"
            )
        if args.assistant_only_loss and fmt != CHAT:
            raise UserError(f"--assistant_only_loss is for chat rows (`messages`), and this data is {fmt}: drop it")
        if not args.completion_only_loss and fmt != PROMPT_COMPLETION:
            raise UserError(f"--no-completion_only_loss is for prompt/completion rows, and this data is {fmt}: drop it "
                            "(chat rows learn every token unless --assistant_only_loss)")  # fmt: skip
        if args.chat_template_path and fmt != CHAT:
            raise UserError(f"--chat_template_path is for chat rows (`messages`), and this data is {fmt}: drop it")
        if fmt == PROMPT_COMPLETION and not isinstance(train.features["prompt"], Value):
            raise UserError(
                "the prompt and completion columns hold messages (TRL's conversational prompt-completion); write each "
                "row as one `messages` list, the prompt's turns then the completion's, and add --assistant_only_loss "
                "to learn the completion only"
            )
        if args.packing and fmt == TEXT:
            raise UserError(
                "--packing is for prompt/completion and chat rows; text is cut into blocks of --max_length tokens "
                "already (as run_clm_no_trainer.py does): drop --packing"
            )
        template = None
        if args.chat_template_path:
            try:
                template = Path(args.chat_template_path).read_text()
            except OSError as err:
                raise UserError(f"--chat_template_path {args.chat_template_path}: {err.strerror}; it takes a Jinja "
                                "template file (a tokenizer's is its chat_template.jinja)") from err  # fmt: skip
        return cls(format=fmt, completion_only_loss=args.completion_only_loss,
                   assistant_only_loss=args.assistant_only_loss, packing=args.packing,
                   text_column=args.text_column or "text", chat_template=template)  # fmt: skip

    @classmethod
    def from_record(cls, record: dict, args, model_dir, column_names: list[str]) -> "CausalLM":
        # The text column named, or the one the model was trained on, where the data has it; else as train.py finds.
        text_column = next((c for c in (args.text_column, record.get("text_column")) if c in column_names), None)
        fmt = TEXT if text_column else _format_of(column_names)
        if fmt is None and "prompt" in column_names and args.predict_with_generate:
            fmt = PROMPT_COMPLETION  # prompts to answer, with no answers to score
        if fmt is None:
            prompts = "; prompts alone are answered with --predict_with_generate" if "prompt" in column_names else ""
            raise UserError(
                f"the data has no columns a causal LM reads (its columns: {', '.join(column_names)}){prompts}"
            )
        if record.get("format") not in (None, fmt):  # perplexity on other text may be what is wanted: said, not refused
            logger.warning(f"the model was trained on {record['format']} rows and this data is {fmt}: it is scored as "
                           f"{fmt}, and its loss is not comparable with the training run's")  # fmt: skip
        # Runs recorded before these options existed learnt completions only, and every token of a chat.
        return cls(format=fmt, completion_only_loss=record.get("completion_only_loss", True),
                   assistant_only_loss=record.get("assistant_only_loss", False), packing=record.get("packing", False),
                   text_column=text_column or "text")  # fmt: skip

    def record(self) -> dict:
        # The template's text, by its hash: a resume must render the same tokens whatever path names the file.
        template = self.chat_template and hashlib.sha256(self.chat_template.encode()).hexdigest()
        return {"format": self.format, "completion_only_loss": self.completion_only_loss,
                "assistant_only_loss": self.assistant_only_loss, "packing": self.packing,
                "text_column": self.text_column if self.format == TEXT else None,
                "chat_template_sha256": template}  # fmt: skip

    def describe(self) -> str:
        answers_only = (self.format == PROMPT_COMPLETION and self.completion_only_loss) or self.assistant_only_loss
        return f"causal-LM fine-tuning on {self.format}" + (" (loss on the answers only)" if answers_only else "")

    def load_tokenizer(self, name_or_path: str, args):
        tokenizer = super().load_tokenizer(name_or_path, args)
        if tokenizer.eos_token is None:  # an encoder's (BERT's) tokenizer, for a model made a decoder: [SEP] ends
            tokenizer.eos_token = tokenizer.sep_token
        if "token_type_ids" in tokenizer.model_input_names:  # BERT's again: generate() refuses them for a decoder
            names = [name for name in tokenizer.model_input_names if name != "token_type_ids"]
            tokenizer.model_input_names = tokenizer.init_kwargs["model_input_names"] = names  # init_kwargs are saved
        if self.chat_template:
            tokenizer.chat_template = self.chat_template
        if self.format != CHAT:
            return tokenizer
        if not tokenizer.chat_template:
            raise UserError(
                f"{name_or_path}'s tokenizer has no chat template to render `messages` with: train with one "
                "(train.py --chat_template_path; examples/chat_template.jinja is one), or use a chat model; "
                "evaluate.py uses the template saved with the model"
            )
        if self.assistant_only_loss and not GENERATION_BLOCK.search(tokenizer.chat_template):
            raise UserError(
                "--assistant_only_loss needs a chat template that marks the assistant's text with "
                "{% generation %}...{% endgeneration %}, and this one does not: pass one with --chat_template_path "
                "(examples/chat_template.jinja), or drop --assistant_only_loss"
            )
        return tokenizer

    def build_model(self, args, tokenizer, mixed_precision: str):
        from src.generation import end_tokens, stop_tokens

        model = super().build_model(args, tokenizer, mixed_precision)
        # Saved with the model (generation_config.json): whatever generates with it (the model card's snippet, a
        # pipeline) stops where training taught it to, at the EOS appended to every answer, and at its own.
        settings = model.generation_config if model.can_generate() else None  # None: older remote code
        if settings is None:
            return model
        stops = stop_tokens(tokenizer, settings)
        if set(stops) == end_tokens(settings):  # the tokenizer's EOS is among them already
            return model
        # Changed, transformers checks the config strictly as it saves it, at the end of the run: checked now, so
        # that a published config it only warns about (do_sample off with a temperature) is kept as it came.
        changed = copy.deepcopy(settings)
        changed.eos_token_id = stops
        try:
            changed.validate(strict=True)
            model.generation_config = changed
        except ValueError:
            logger.warning("the saved generation_config.json keeps the model's own end tokens only (transformers "
                           "refuses to save it changed, as it is inconsistent): generate() with "
                           "eos_token_id=tokenizer.eos_token_id as well")  # fmt: skip
        return model

    # --- the data ---
    def features(self, dataset: Dataset, tokenizer, max_length: int, num_proc: int | None = None) -> Dataset:
        """input_ids and labels (-100 where nothing is to be learnt: prompts, user turns, padding)."""
        columns = dataset.column_names  # a validation file may be in another format than the training data's
        if not {TEXT: self.text_column in columns, CHAT: _format_of(columns) == CHAT,
                PROMPT_COMPLETION: "prompt" in columns}[self.format]:  # fmt: skip
            raise UserError(f"its columns ({', '.join(columns)}) are not {self.format} rows, which this model learns "
                            "from: give it the training data's format")  # fmt: skip
        if self.format == TEXT:
            return _text_blocks(dataset, self.text_column, tokenizer, max_length, num_proc)
        if self.format == CHAT:
            encode = partial(_chat_example, tokenizer, assistant_only=self.assistant_only_loss)
        else:
            encode = partial(_prompt_completion_example, tokenizer, completion_only=self.completion_only_loss)

        def rows(batch, indices):
            examples = [encode(dict(zip(batch, values)), max_length) for values in zip(*batch.values())]
            return {
                "input_ids": [ids for ids, _ in examples],
                "attention_mask": [[1] * len(ids) for ids, _ in examples],
                "labels": [labels for _, labels in examples],
                INDEX_COLUMN: indices,
                LENGTH_COLUMN: [len(ids) for ids, _ in examples],
            }

        features = dataset.map(rows, batched=True, with_indices=True, remove_columns=dataset.column_names,
                               num_proc=num_proc, desc="Tokenizing")  # fmt: skip
        # A prompt that fills --max_length leaves nothing to learn: such rows are dropped, and said so.
        kept = features.filter(lambda row: any(label != IGNORE for label in row["labels"][1:]), desc="Checking labels")
        if self.format == PROMPT_COMPLETION and "completion" not in dataset.column_names:
            return kept  # prompts alone, to answer (evaluate.py --predict_with_generate): none is to be scored
        if len(kept) < len(features):
            dropped = f"{len(features) - len(kept)} of {len(features)} examples"
            logger.warning(f"{dropped} have nothing to learn within --max_length {max_length} tokens (no answer, or "
                           "a prompt that fills them): not trained on or scored (evaluate.py --predict_with_generate "
                           "still answers them); raise --max_length for the latter")  # fmt: skip
        return kept  # each example keeps its data row's number: predictions.csv's index

    def training_rows(self, features: Dataset, max_length: int) -> Dataset:
        if not self.packing:
            return features
        packed = _packed_rows(features, max_length)
        logger.info(f"--packing: {len(features)} training examples packed into {len(packed)} rows of up to "
                    f"{max_length} tokens")  # fmt: skip
        return packed

    def collator(self, tokenizer, pad_to_multiple_of=None, pad_to_length=None):
        # Labels padded with -100 by position: with EOS as the padding token, masking by value would hide every EOS
        # the model must learn to write (transformers' language-modeling collator does; trl #1623).
        pad = padding_collator(tokenizer, pad_to_multiple_of, pad_to_length, per_token=True)
        # Packed rows' position ids are padded with 0 where the tokens are padded, so that each padding token is a
        # sequence of its own, which no example attends to.
        return PaddingColumnToo(pad, "position_ids", 0, tokenizer.padding_side)

    # --- one batch ---
    def units(self, batch: dict) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def step(self, model, batch: dict) -> Step:
        """Each predicted token's cross-entropy (token t predicts token t+1), summed; per example its summed loss, its
        predicted tokens and how many of them the model got right (for mean_token_accuracy, in evaluation only: an
        argmax over the vocabulary at every position is not for the training loop)."""
        labels = batch.pop("labels")
        logits = model(**_model_inputs(batch))["logits"][:, :-1].float()
        targets = labels[:, 1:]
        losses = token_cross_entropy(logits, targets)
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
        load = (["from peft import AutoPeftModelForCausalLM",
                 "from transformers import AutoTokenizer, GenerationConfig", "",
                 f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")'] if adapter else
                ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                 f'model = AutoModelForCausalLM.from_pretrained("{where}")'])  # fmt: skip
        chat = '[{"role": "user", "content": "Hello"}], add_generation_prompt=True, return_tensors="pt"'
        text = 'tokenizer("Hello", return_tensors="pt")'
        prompt = f"tokenizer.apply_chat_template({chat})" if self.format == CHAT else text
        # Up to the tokens that end an answer, which the saved generation config lists (see build_model); an adapter
        # loads its base's, so the folder's is passed.
        settings = f', generation_config=GenerationConfig.from_pretrained("{where}")' if adapter else ""
        generate = f"model.generate(**inputs, max_new_tokens=64{settings})"
        # A tokenizer that ends every text with EOS (BERT's [SEP]) ends the prompt too: a text to go on drops it.
        go_on = ['if inputs["input_ids"][0, -1] == tokenizer.eos_token_id:  # a text to go on, not an ended one',
                 "    inputs = {name: values[:, :-1] for name, values in inputs.items()}"]  # fmt: skip
        usage = [*load, f'tokenizer = AutoTokenizer.from_pretrained("{where}")', f"inputs = {prompt}",
                 *(go_on if self.format == TEXT else []), f"print(tokenizer.decode({generate}[0]))"]  # fmt: skip
        return {"kind": self.describe(), "pipeline_tag": "text-generation", "labels": [], "usage": usage}


def _format_of(columns: list[str]) -> str | None:
    if "messages" in columns or "conversations" in columns:
        return CHAT
    if "prompt" in columns and "completion" in columns:
        return PROMPT_COMPLETION
    if "text" in columns:  # beside a label column too, for --task causal-lm (--task auto asks for it: recognises)
        return TEXT
    return None


def _prompt_completion_example(tokenizer, row: dict, max_length: int, completion_only: bool):
    """The prompt's tokens, then the completion's and EOS (always learnt), cut to max_length; the prompt's labels are
    -100 when `completion_only`. Tokenized apart, so the boundary is exact whatever the tokenizer merges across it."""
    if not isinstance(row["prompt"], str):
        raise UserError(f"a prompt/completion row's prompt is {row['prompt']!r}, not text: fill or drop that row")
    prompt = tokenizer(row["prompt"])["input_ids"]
    if row.get("completion") is None:  # a prompt to answer (evaluate.py --predict_with_generate): nothing to score
        return prompt[:max_length], [IGNORE] * len(prompt[:max_length])
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + completion)[:max_length]
    return ids, ([IGNORE] * len(prompt) + completion)[:max_length] if completion_only else list(ids)


def _chat_example(tokenizer, row: dict, max_length: int, assistant_only: bool):
    """The conversation through the chat template, cut to max_length; with `assistant_only`, labels only where the
    template's {% generation %} blocks put the assistant's text (and the token that ends its turn, if inside)."""
    rendered = tokenizer.apply_chat_template(_messages(row), tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=assistant_only)  # fmt: skip
    ids = list(rendered["input_ids"])
    if not assistant_only:
        return ids[:max_length], ids[:max_length]
    labels = [token if learnt else IGNORE for token, learnt in zip(ids, rendered["assistant_masks"])]
    return ids[:max_length], labels[:max_length]


def _messages(row: dict) -> list[dict]:
    """A chat row's turns with `role` and text `content` (ShareGPT's `from`, `value` and role names renamed; OpenAI's
    lists of content parts joined into their text)."""
    turns = row.get("messages") or row.get("conversations") or []
    if not turns or not all(isinstance(turn, dict) and ({"role", "content"} <= set(turn) or {"from", "value"} <=
                                                        set(turn)) for turn in turns):  # fmt: skip
        raise UserError(f"a chat row must list turns with 'role' and 'content' (or ShareGPT 'from' and 'value'); "
                        f"found {str(turns)[:200]}")  # fmt: skip
    messages = []
    for turn in turns:
        role, content = (turn["role"], turn["content"]) if "role" in turn else (turn["from"], turn["value"])
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: a text-only template takes the text
            content = "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("text"))
        if not isinstance(content, str) and not (content is None and turn.get("tool_calls")):  # a call has no text
            raise UserError(
                f"a chat turn's content is {content!r}, not text: fill or drop that row ({str(turns)[:200]})"
            )
        messages.append(
            {**(turn if "role" in turn else {}), "role": SHAREGPT_ROLES.get(role, role), "content": content}
        )
    return messages


def _text_blocks(dataset: Dataset, column: str, tokenizer, block: int, num_proc: int | None) -> Dataset:
    """Every text's tokens and EOS (unless the tokenizer ends it with EOS itself), concatenated over the whole split
    and cut into blocks of `block` tokens; the last, shorter block is kept (run_clm_no_trainer.py drops the end of
    every 1,000 rows). Texts are tokenized in `num_proc` processes; the cutting is one pass over the whole split, so
    the blocks do not depend on it."""

    def tokens(batch):
        eos = [tokenizer.eos_token_id]
        return {"ids": [ids if ids[-1:] == eos else ids + eos for ids in tokenizer(batch[column])["input_ids"]]}

    def blocks(batch):
        ids = [t for text in batch["ids"] for t in text]
        chunks = [ids[i : i + block] for i in range(0, len(ids), block)]
        return {"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks], "labels": chunks,
                INDEX_COLUMN: list(range(len(chunks))), LENGTH_COLUMN: [len(c) for c in chunks]}  # fmt: skip

    feature = dataset.features[column]
    if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
        raise UserError(
            f"text column {column!r} holds {feature}, not text: name a column of strings with --text_column"
        )
    texts = dataset.filter(lambda row: bool(row[column] and row[column].strip()), desc="Dropping empty lines")
    if not len(texts):
        raise UserError(f"all {len(dataset)} rows of text column {column!r} are empty or blank: nothing to learn")
    tokenized = texts.map(tokens, batched=True, remove_columns=texts.column_names, num_proc=num_proc,
                          desc="Tokenizing")  # fmt: skip
    return tokenized.map(blocks, batched=True, batch_size=None, remove_columns=["ids"], desc="Cutting into blocks")


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of positions in `lengths` whose lengths add up to at most `capacity`: the longest first, each into the bin
    it leaves the least room in (best-fit decreasing, TRL's `bfd` packing)."""
    bins = []
    rooms = []  # the distinct free spaces of the bins, sorted: the best fit is the first one the length fits
    bins_with_room = defaultdict(list)
    for position in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[position]
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):
            room, chosen = capacity, len(bins)
            bins.append([])
        else:
            room, chosen = rooms[at], bins_with_room[rooms[at]].pop()
            if not bins_with_room[room]:
                del bins_with_room[room], rooms[at]
        bins[chosen].append(position)
        if not bins_with_room[room - length]:
            bisect.insort(rooms, room - length)
        bins_with_room[room - length].append(chosen)
    return bins


def _packed_rows(features: Dataset, max_length: int) -> Dataset:
    """Rows of several examples each, with position ids that restart at 0 for each example and each example's first
    label ignored: unpacked, nothing predicts an example's first token, and packed, its previous token is another
    example's. The label tokens, and so the loss and its normalisation, are those of the unpacked examples.

    Packed 1,000 examples at a time (a map batch), so that memory stays bounded; only each batch's last rows are
    less full."""

    def rows(batch):
        packed = _best_fit_decreasing(batch[LENGTH_COLUMN], max_length)

        def joined(column, per_example=lambda values: values) -> list[list[int]]:
            return [[v for i in members for v in per_example(batch[column][i])] for members in packed]

        return {
            "input_ids": joined("input_ids"),
            "attention_mask": joined("attention_mask"),  # the real tokens, for the throughput; not for the model
            "labels": joined("labels", lambda labels: [IGNORE, *labels[1:]]),
            "position_ids": joined("input_ids", lambda ids: range(len(ids))),
            INDEX_COLUMN: [batch[INDEX_COLUMN][members[0]] for members in packed],  # known by its first example
            LENGTH_COLUMN: [sum(batch[LENGTH_COLUMN][i] for i in members) for members in packed],
        }

    return features.map(rows, batched=True, batch_size=1000, remove_columns=features.column_names,
                        desc="Packing")  # fmt: skip


def _model_inputs(batch: dict) -> dict:
    """The batch as the model takes it, with the KV cache off: training and scoring generate nothing (the saved
    config keeps it on for what does). Packed rows (with position ids) also go without their attention mask:
    transformers keeps packed examples apart, from where their position ids restart, only when neither mask nor
    cache is there (masking_utils.find_packed_sequence_indices); otherwise every token attends to the ones before."""
    inputs = batch | {"use_cache": False}
    if "position_ids" in batch:
        del inputs["attention_mask"]
    return inputs
