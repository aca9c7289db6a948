"""Token classification: a tag per word (NER in IOB2, POS tags), from a column of word lists and a column of tag lists
of the same lengths, as transformers' run_ner_no_trainer.py reads them."""

import json
from dataclasses import dataclass, replace

import torch
from accelerate.logging import get_logger
from datasets import ClassLabel, Dataset, LargeList, List, Sequence, Value

from src.args import Switch
from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, PaddingColumnToo, padding_collator
from src.tasks.base import IGNORE, Step, Task, label_finder, token_cross_entropy

logger = get_logger(__name__)
WORD_COLUMNS = ("tokens", "words")
CUT_COLUMN = "words_cut_off"  # per example, the words that --max_length leaves without a sub-token
EMPTY_COLUMN = "words_empty"  # per example, the words that give no sub-token at all ("", a zero-width space)
# Per sub-token, the number of its word (-100 for special tokens and padding): predictions.csv's tag of a word is
# its first sub-token's, with or without gold tags, and with --label_all_tokens too.
WORD_IDS = "word_ids"
TAG_COLUMNS = ("ner_tags", "tags", "upos", "pos_tags", "ner", "labels", "label")
ENTITY_SCORES = ("precision", "recall", "f1", "number")  # per entity type, as the token_scores metric reports them
OVERALL = ("precision", "recall", "f1", "accuracy")  # over every entity (accuracy: over every word)
FLAGS = {
    "--label_all_tokens": "Label every sub-token of a word (B-X becomes I-X after the first), not the first only; the "
    "metrics then count sub-tokens too, as run_ner_no_trainer.py's do.",
    "--return_entity_level_metrics": "IOB tags: also precision, recall, F1 and count per entity type "
    "(eval_<TYPE>_f1, ...; 0 for a type not in sight), which --metric_for_best_model can name.",
}


@dataclass(frozen=True)
class TokenClassification(Task):
    label_names: tuple[str, ...] = ()
    columns: tuple[str, str | None] = ("tokens", "ner_tags")  # words, tags
    label_all_tokens: bool = False
    return_entity_level_metrics: bool = False

    name = "token-classification"
    auto_class = "AutoModelForTokenClassification"
    peft_task_type = "TOKEN_CLS"

    @staticmethod
    def add_arguments(parser):
        group = parser.add_argument_group("token classification")
        for flag, explanation in FLAGS.items():
            group.add_argument(flag, action=Switch, help=explanation)

    @staticmethod
    def recognises(train: Dataset, label_column: str | None = None) -> str | None:
        found = _word_and_tag_columns(train, None, label_column)
        return found and f"a column of word lists ({found[0]!r}) and one of tag lists ({found[1]!r})"

    @classmethod
    def from_data(cls, args, train: Dataset) -> "TokenClassification":
        from src.model import in_checkpoint_order

        found = _word_and_tag_columns(train, args.text_column, args.label_column)
        if found is None:
            raise UserError(
                f"token classification needs a column of word lists and one of tag lists (a tag per word); the "
                f"columns are {', '.join(f'{n} ({t})' for n, t in train.features.items())}: name them with "
                "--text_column and --label_column, or choose another --task"
            )
        words, tags = found
        feature = train.features[tags].feature
        if isinstance(feature, ClassLabel):
            names = feature.names
        else:
            values = set()
            for row, tags_of_row in enumerate(train[tags]):
                _refuse_nulls(tags_of_row, row, tags, "tags")
                values.update(tags_of_row)
            if values and all(isinstance(value, str) and _is_iob(value) for value in values):
                # IOB2 types come in pairs: one seen only as B-PER (one-word names, in a small sample) gets I-PER too,
                # which --label_all_tokens gives a name's later sub-tokens, and validation data may hold.
                values |= {f"{edge}-{tag[2:]}" for tag in values if tag != "O" for edge in "BI"}
            # Tag numbers without ClassLabel names (a Hub dataset saved as JSON) are named by their numbers.
            names = [str(value) for value in sorted(values)]
        task = cls(label_names=in_checkpoint_order(args, tuple(names)), columns=found,
                   label_all_tokens=args.label_all_tokens,
                   return_entity_level_metrics=args.return_entity_level_metrics)  # fmt: skip
        odd = [name for name in names if not _is_entity_tag(name)]
        if 0 < len(odd) < len(names) / 2:  # a few rows' slips turn entity F1 into per-word accuracy
            logger.warning(f"{tags!r} holds IOB entity tags and {', '.join(map(repr, odd[:5]))}, which are not: "
                           "scored per word, not by entity; fix those rows for entity-level F1")  # fmt: skip
        wanted = (getattr(args, "metric_for_best_model", None) or "").removeprefix("eval_")
        with_flag = replace(task, return_entity_level_metrics=True).metric_names()
        if wanted not in task.metric_names() and wanted in with_flag:  # LOC_f1, without the flag that reports it
            raise UserError(f"--metric_for_best_model {wanted} is reported with --return_entity_level_metrics: add it")
        return task.entity_scores_possible()

    @classmethod
    def from_record(cls, record: dict, args, model_dir, column_names: list[str]) -> "TokenClassification":
        names = tuple(cls.trained_labels(model_dir, args))
        # The columns named, else the training run's, else (a model from elsewhere) the usual names.
        words = (
            args.text_column or record.get("text_column") or next((c for c in WORD_COLUMNS if c in column_names), None)
        )
        tags = (
            args.label_column or record.get("label_column") or next((c for c in TAG_COLUMNS if c in column_names), None)
        )
        columns = (words, tags if tags in column_names else None)
        if words not in column_names:
            raise UserError(f"the data has no column {words!r} of words (its columns: {', '.join(column_names)}): name "
                            "it with --text_column (and the tags' with --label_column)")  # fmt: skip
        asked = getattr(args, "return_entity_level_metrics", None)  # evaluate.py's flag, else the run's
        entity_level = record.get("return_entity_level_metrics", False) if asked is None else asked
        task = cls(label_names=names, columns=columns, label_all_tokens=record.get("label_all_tokens", False),
                   return_entity_level_metrics=entity_level)  # fmt: skip
        # A run's record from before the refusal may hold the flag with other tags: those get per-word scores.
        return task.entity_scores_possible() if asked else task

    @staticmethod
    def trained_labels(model_dir, args) -> list[str]:
        """The tags of a trained model, from its config (a task of your own whose model has none: from its files)."""
        from src.model import load_trained_config

        config = load_trained_config(model_dir, args.trust_remote_code)
        return [config.id2label[i] for i in range(config.num_labels)]

    @staticmethod
    def add_evaluation_arguments(parser):
        flag = "--return_entity_level_metrics"
        parser.add_argument(flag, action=Switch, default=None, help=f"{FLAGS[flag]} Default: the training run's.")

    def entity_scores_possible(self) -> "TokenClassification":
        if self.return_entity_level_metrics and not self.iob:
            raise UserError(
                f"--return_entity_level_metrics scores entities of IOB tags (B-X, I-X, O), and the tags are others "
                f"({', '.join(self.label_names[:5])}, ...), scored by accuracy and F1 per word: drop the flag"
            )
        return self

    def record(self) -> dict:
        return {"text_column": self.columns[0], "label_column": self.columns[1],
                "label_all_tokens": self.label_all_tokens}  # fmt: skip

    @property
    def iob(self) -> bool:
        """Entity tags (O, B-X, I-X), scored by entity with seqeval; other tags (NOUN, VERB) are scored per word."""
        return all(map(_is_iob, self.label_names))

    @property
    def main_metric(self) -> str:
        return "f1" if self.iob else "accuracy"

    def describe(self) -> str:
        kind = "IOB entity tags" if self.iob else "tags"
        return f"token classification into {len(self.label_names)} {kind}"

    # --- the model ---
    def load_tokenizer(self, name_or_path: str, args):
        tokenizer = super().load_tokenizer(name_or_path, args)
        if getattr(tokenizer, "add_prefix_space", None) is False:
            # Byte-level BPE (GPT-2, RoBERTa) reads a word differently at the start of a text and after a space; words
            # given one by one need the space (transformers #9607).
            tokenizer = super().load_tokenizer(name_or_path, args, add_prefix_space=True)
        return tokenizer

    def config_fields(self) -> dict:
        return {"num_labels": len(self.label_names), "id2label": dict(enumerate(self.label_names)),
                "label2id": {name: i for i, name in enumerate(self.label_names)}}  # fmt: skip

    # --- the data ---
    def features(self, dataset: Dataset, tokenizer, max_length: int, num_proc: int | None = None) -> Dataset:
        """Sub-token ids and, per sub-token, the tag of its word on its first sub-token (every sub-token with
        --label_all_tokens, B- turned I- after the first) and -100 elsewhere. Words cut off by --max_length are
        counted and reported: they have no prediction, so the metrics leave them out."""
        words_column, tags_column = self.columns
        if tags_column not in dataset.column_names or dataset.features[tags_column] == Value("null"):
            tags_column = None  # no tags (an unlabelled file, or one of null tags): predictions only
        for column, what in ((words_column, "words"), (tags_column, "tags")):  # checked in training data by from_data
            feature = dataset.features.get(column)  # all nulls (Value('null')): the rows' nulls are named below
            if column and not isinstance(feature, (List, LargeList, Sequence)) and feature != Value("null"):
                raise UserError(
                    f"column {column!r} holds {feature}, not a list of {what} per row (a CSV cell "
                    "holds one string): give word and tag lists in a .jsonl or .parquet file"
                )
        tag_id, id_of = {name: i for i, name in enumerate(self.label_names)}, label_finder(self.label_names)
        names = dataset.features[tags_column].feature.names if tags_column and isinstance(
            dataset.features[tags_column].feature, ClassLabel) else None  # fmt: skip
        inside = [tag_id.get("I-" + name[2:], tag_id[name]) if name.startswith("B-") else tag_id[name]
                  for name in self.label_names]  # fmt: skip

        spaced = _words_need_a_space(tokenizer)

        def encode(rows, indices):
            for row, words in enumerate(rows[words_column]):
                _refuse_nulls(words, indices[row], words_column, "words")
            # An empty word stays empty: " " would be a token of its own.
            texts = [[" " + w if i and w else w for i, w in enumerate(words)] for words in rows[words_column]] if (
                spaced) else rows[words_column]  # fmt: skip
            encoded = tokenizer(texts, is_split_into_words=True, truncation=True, max_length=max_length)
            encoded[INDEX_COLUMN] = indices
            encoded[LENGTH_COLUMN] = [len(ids) for ids in encoded["input_ids"]]
            encoded[CUT_COLUMN], encoded[EMPTY_COLUMN], encoded[WORD_IDS], all_labels = [], [], [], []
            for row, words in enumerate(rows[words_column]):
                word_ids = encoded.word_ids(row)
                encoded[WORD_IDS].append([IGNORE if word is None else word for word in word_ids])
                seen = set(word_ids) - {None}
                cut = len(words) - max(seen, default=-1) - 1
                encoded[CUT_COLUMN].append(cut)
                encoded[EMPTY_COLUMN].append(len(words) - len(seen) - cut)
                if tags_column is None:
                    continue
                tags = rows[tags_column][row]
                _refuse_nulls(tags, indices[row], tags_column, "tags")
                if len(tags) != len(words):
                    raise UserError(f"row {indices[row]} has {len(words)} words in {words_column!r} and {len(tags)} "
                                    f"tags in {tags_column!r}: give every word one tag")  # fmt: skip
                tag_names = [names[t] if names else str(t) for t in tags]
                if unknown := {name for name in tag_names if id_of(name) is None}:
                    known = ", ".join(self.label_names[:30]) + (", ..." if len(self.label_names) > 30 else "")
                    raise UserError(f"tag(s) {', '.join(sorted(unknown)[:10])} in column {tags_column!r} "
                                    f"are not among the model's {len(self.label_names)} tags, those of its training "
                                    f"data ({known}): drop those rows, or train on data that has them")  # fmt: skip
                ids = [id_of(name) for name in tag_names]
                labels, previous = [], None
                for word in word_ids:
                    if word is None:
                        labels.append(IGNORE)
                    elif word != previous:
                        labels.append(ids[word])
                    else:
                        labels.append(inside[ids[word]] if self.label_all_tokens else IGNORE)
                    previous = word
                all_labels.append(labels)
            if tags_column is not None:
                encoded["labels"] = all_labels
            return encoded

        features = dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names,
                               num_proc=num_proc, desc="Tokenizing")  # fmt: skip
        if features.features.get("labels") not in (None, List(Value("int64"))):  # typed as a tag column named labels
            features = features.cast_column("labels", List(Value("int64")))
        # Counted from columns, not while mapping: a cached map (every rank but the first) runs no code.
        counts = features.select_columns([CUT_COLUMN, EMPTY_COLUMN]).with_format("numpy")[:]
        features = features.remove_columns([CUT_COLUMN, EMPTY_COLUMN])
        unscored = {  # column: (what befell its words, how to score them)
            CUT_COLUMN: (f"do not fit in --max_length {max_length} sub-tokens", "raise --max_length to score them"),
            EMPTY_COLUMN: (
                "give no sub-token (empty or invisible text)",
                "give them text, or drop them with their tags",
            ),
        }
        for column, (what, fix) in unscored.items():
            if words := counts[column].sum():
                where = f"{words} word(s) in {(counts[column] > 0).sum()} of {len(dataset)} examples"
                logger.warning(
                    f"{where} {what}: they get no tag (null in predictions.csv) and are left out of the metrics; {fix}"
                )
        return features

    def training_rows(self, features: Dataset, max_length: int) -> Dataset:
        # The word numbers serve predictions.csv only: training batches go without them (nothing to collate and copy
        # to the device in every step).
        return features.remove_columns(WORD_IDS)

    def collator(self, tokenizer, pad_to_multiple_of=None, pad_to_length=None):
        pad = padding_collator(tokenizer, pad_to_multiple_of, pad_to_length, per_token=True)
        return PaddingColumnToo(pad, WORD_IDS, IGNORE, tokenizer.padding_side)

    # --- one batch ---
    def units(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORE).sum()

    def step(self, model, batch: dict) -> Step:
        """The cross-entropy of every labelled sub-token, summed; per example its tags, predictions, sub-tokens'
        word numbers (predictions.csv's tag per word), summed loss and labelled sub-tokens."""
        labels, word_ids = batch.pop("labels", None), batch.pop(WORD_IDS, None)
        logits = model(**batch)["logits"].float()
        outputs = {"prediction": logits.argmax(-1)} | ({} if word_ids is None else {WORD_IDS: word_ids})
        if labels is None:
            return Step(logits.new_zeros(()), logits.new_zeros(()), outputs)
        losses = self.losses(logits, labels)
        units = (labels != IGNORE).sum(-1)
        outputs |= {"label": labels, "loss": losses.sum(-1), "units": units}
        return Step(losses.sum(), units.sum(), outputs)

    def losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sub-token's loss, (batch, length), 0 where its label is IGNORE."""
        return token_cross_entropy(logits, labels)

    # --- evaluation ---
    def tag_rows(self, columns: dict) -> tuple[list[list[str]], list[list[str]]]:
        """(true tags, predicted tags) per example, at the labelled positions."""
        names, true, predicted = self.label_names, [], []
        for labels, predictions in zip(columns["label"].tolist(), columns["prediction"].tolist()):
            kept = [(label, prediction) for label, prediction in zip(labels, predictions) if label != IGNORE]
            true.append([names[label] for label, _ in kept])
            predicted.append([names[prediction] for _, prediction in kept])
        return true, predicted

    def entity_types(self) -> list[str]:
        return sorted({name[2:] for name in self.label_names if name != "O"})

    def metric_names(self) -> list[str]:
        if not self.iob:
            return ["accuracy", "f1", "loss"]
        names = ["precision", "recall", "f1", "accuracy", "loss"]
        if self.return_entity_level_metrics:  # LOC_f1 and the like can pick the best model too
            # Not LOC_number: a count of the data's entities, the same at every evaluation, would rank nothing.
            scores = [key for key in ENTITY_SCORES if key != "number"]
            names += [f"overall_{key}" for key in OVERALL]
            names += [f"{entity}_{key}" for entity in self.entity_types() for key in scores]
        return names

    def metrics(self, columns: dict) -> dict:
        from src.metrics import load_metric

        true, predicted = self.tag_rows(columns)
        metric = load_metric("token_scores", "iob" if self.iob else "tags")
        scores = metric.compute(predictions=predicted, references=true)
        by_entity = scores.pop("by_entity", {})
        if self.iob and self.return_entity_level_metrics:
            # Every type of the labels, 0 where neither the data nor the predictions hold one: the same keys at every
            # evaluation, for --metric_for_best_model and the trackers' curves.
            none = {key: 0 if key == "number" else 0.0 for key in ENTITY_SCORES}
            scores |= {f"{entity}_{key}": value for entity in self.entity_types()
                       for key, value in by_entity.get(entity, none).items()}  # fmt: skip
            # The same scores under run_ner_no_trainer.py's names with this flag, for what reads eval_overall_f1.
            scores |= {f"overall_{key}": scores[key] for key in OVERALL}
        return scores

    def prediction_rows(self, columns: dict, data) -> dict[str, list]:
        """Per sentence, as JSON lists: its words, their gold tags (if the data has them) and the predicted tags, one
        per word: its first sub-token's, or null for a word without one (cut off by --max_length, or empty)."""
        rows = {"words": [json.dumps(words, ensure_ascii=False) for words in data[self.columns[0]]]}
        for key in ("label", "prediction") if "label" in columns else ("prediction",):
            rows[key] = []
            for words, word_ids, tags in zip(data[self.columns[0]], columns[WORD_IDS].tolist(), columns[key].tolist()):
                first = {}  # word number: the position of its first sub-token
                for position, word in enumerate(word_ids):
                    if word != IGNORE:
                        first.setdefault(word, position)
                tagged = [self.label_names[tags[first[w]]] if w in first else None for w in range(len(words))]
                rows[key].append(json.dumps(tagged, ensure_ascii=False))
        return rows

    # --- the model card ---
    def model_card(self, where: str, base_name: str, adapter: bool) -> dict:
        # Entities: words grouped by their B-/I- tags. Other tags (NOUN, VERB): the pipeline would group neighbouring
        # words of one tag as if they were an entity, so it gives every sub-token's.
        strategy, note = "first", []
        if not self.iob:
            untrained = "" if self.label_all_tokens else " (the others are not trained)"
            strategy, note = "none", [f"# a word's tag is its first sub-token's{untrained}"]
        usage = self.adapter_usage(where, base_name) if adapter else [
            "from transformers import pipeline", "",
            f'tagger = pipeline("token-classification", model="{where}", aggregation_strategy="{strategy}")', *note,
            'print(tagger("Your text here"))']  # fmt: skip
        return {"kind": self.describe(), "pipeline_tag": "token-classification", "labels": list(self.label_names),
                "usage": usage}  # fmt: skip


def _words_need_a_space(tokenizer) -> bool:
    """Whether words given one by one are read as in running text only with a space before each but the first:
    byte-level BPE (GPT-2, Qwen, Llama 3) reads " movie" otherwise than "movie", and the model card's pipeline gives
    it running text. add_prefix_space (load_tokenizer) does not reach every such tokenizer; those that split at spaces
    themselves (WordPiece, SentencePiece) need nothing."""
    words = ["The", "movie", "was", "good"]
    as_text = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    if tokenizer(words, is_split_into_words=True, add_special_tokens=False)["input_ids"] == as_text:
        return False
    spaced = [words[0], *(" " + word for word in words[1:])]
    return tokenizer(spaced, is_split_into_words=True, add_special_tokens=False)["input_ids"] == as_text


def _refuse_nulls(values: list | None, row: int, column: str, what: str):
    """A null row or item of words or tags is one line (the tokenizer and sorting would raise a TypeError)."""
    if values is None or None in values:
        raise UserError(f"row {row} has a null in {column!r} (its {what}): fill or drop that row")


def _is_iob(name: str) -> bool:
    return name == "O" or name[:2] in ("B-", "I-")


def _is_entity_tag(name: str) -> bool:
    """A tag of IOB or of another entity scheme (BIOES, BILOU: E-, S-, L-, U-), which are scored per word."""
    return name == "O" or name[:2] in ("B-", "I-", "E-", "S-", "L-", "U-")


def _is_word_lists(feature) -> bool:
    return isinstance(feature, (List, LargeList, Sequence)) and isinstance(feature.feature, Value) and (
        feature.feature.dtype in ("string", "large_string"))  # fmt: skip


def _is_tag_lists(feature) -> bool:
    """Lists of named tags (ClassLabel), of tag names, or of tag numbers (a Hub dataset saved as JSON)."""
    return isinstance(feature, (List, LargeList, Sequence)) and (
        isinstance(feature.feature, ClassLabel) or _is_word_lists(feature)
        or isinstance(feature.feature, Value) and feature.feature.dtype.startswith(("int", "uint")))  # fmt: skip


def _word_and_tag_columns(train: Dataset, words: str | None, tags: str | None) -> tuple[str, str] | None:
    """The column of word lists and the column of tag lists (the given ones, else the usual names, else the first
    such columns, as run_ner_no_trainer.py falls back to)."""
    features = train.features
    if words is None:
        candidates = [name for name, feature in features.items() if _is_word_lists(feature)]
        words = next((name for name in WORD_COLUMNS if name in candidates), candidates[0] if candidates else None)
    if words is None or words not in features or not _is_word_lists(features[words]):
        return None
    if tags is None:
        candidates = [name for name, feature in features.items() if name != words and _is_tag_lists(feature)]
        tags = next((name for name in TAG_COLUMNS if name in candidates), candidates[0] if candidates else None)
    if tags is None or tags not in features or not _is_tag_lists(features[tags]):
        return None
    return words, tags  # a row with more or fewer tags than words is named by features()
