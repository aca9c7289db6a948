"""Loading, column detection, label mapping, tokenisation and the dataloaders.

Every function here runs identically on every rank; train.py calls the loading and tokenising ones under
`main_process_first()` so that rank 0 fills the datasets cache and the others read it.
"""

from pathlib import Path

import datasets.config
import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Value, load_dataset
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithPadding

from src.errors import UserError
from src.glue import GLUE_DATASET, GLUE_TASKS, MNLI_MISMATCHED
from src.task import Task, label_namer

# The `datasets` builder (and its options) for each local file type. GLUE-style TSVs are unquoted.
FILE_BUILDERS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t", "quoting": 3}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
}
SINGLE_TEXT_COLUMNS = ("sentence", "text")
TEXT_PAIR_COLUMNS = (
    ("sentence1", "sentence2"),
    ("premise", "hypothesis"),
    ("question1", "question2"),
    ("question", "sentence"),
)
LABEL_COLUMNS = ("label", "labels")
INDEX_COLUMN = "example_index"  # position in the evaluated data, so results can be put back in order
LENGTH_COLUMN = "length"  # tokens per example, for batching by length without reading every token id


def load_file(path: Path) -> Dataset:
    path = Path(path)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    name, options = builder
    try:
        dataset = load_dataset(name, data_files=str(path), split="train", **options)
    except Exception as err:  # the builders raise many types for unreadable input
        if "corresponds to no data" in str(err):  # a header and no rows
            raise UserError(f"{path}: the file has no rows") from err
        raise UserError(f"{path}: cannot be read as {path.suffix[1:]}: {' '.join(str(err).split())[:300]}") from err
    if len(dataset) == 0:
        raise UserError(f"{path}: the file has no rows")
    return dataset


def load_hub_dataset(
    dataset_name: str, config_name: str | None, flag: str = "", instead: str = "--train_file and --validation_file"
) -> DatasetDict:
    """A Hub dataset; errors name `flag` (default: --dataset_name) and say which local files to pass `instead`."""
    flag = flag or f"--dataset_name {dataset_name}"
    try:
        return load_dataset(dataset_name, config_name)
    except ConnectionError as err:  # how datasets says "offline": no network, a firewall, or HF_HUB_OFFLINE=1
        offline = " (HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise UserError(
            f"{flag}: cannot be loaded, the Hugging Face Hub is unreachable{offline}; pass local files instead: "
            f"{instead}"
        ) from err
    except Exception as err:
        raise UserError(
            f"{flag}: cannot be loaded ({' '.join(str(err).split())[:300]}); check the name, "
            "--dataset_config_name and network access, or use local files instead"
        ) from err


def pick_split(splits: DatasetDict, split: str) -> str | None:
    """The split called `split`, or the first that starts with it (GLUE MNLI has 'validation_matched')."""
    return next((name for name in splits if name == split), None) or next(
        (name for name in sorted(splits) if name.startswith(split)), None
    )


def load_raw_splits(args) -> DatasetDict:
    """The 'train' and 'validation' splits that train.py asks for (the demo task when no data is named), and
    any further validation split evaluated at the end ('validation_mm': MNLI's mismatched one)."""
    if args.task_name and not args.train_file:
        text, pair, _, _ = GLUE_TASKS[args.task_name]
        columns = ", ".join(c for c in (text, pair, "label") if c)
        instead = f"--train_file and --validation_file with GLUE's columns ({columns})"
        hub = load_hub_dataset(GLUE_DATASET, args.task_name, f"--task_name {args.task_name} ({GLUE_DATASET})", instead)
        splits = DatasetDict(train=hub["train"], validation=hub[pick_split(hub, "validation")])
        if MNLI_MISMATCHED[0] in hub:
            splits[f"validation_{MNLI_MISMATCHED[1]}"] = hub[MNLI_MISMATCHED[0]]
    elif args.dataset_name:
        hub = load_hub_dataset(args.dataset_name, args.dataset_config_name)
        if "train" not in hub:
            raise UserError(f"--dataset_name {args.dataset_name} has no 'train' split; it has {', '.join(hub)}")
        validation = pick_split(hub, "validation")
        splits = DatasetDict(train=hub["train"], **({"validation": hub[validation]} if validation else {}))
    elif args.train_file:
        splits = DatasetDict(train=load_file(args.train_file))
        if args.validation_file:
            splits["validation"] = load_file(args.validation_file)
    else:
        from src.demo_data import make_demo_splits

        splits = make_demo_splits()
    if "validation" not in splits:
        held_out = splits["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
        splits = DatasetDict(train=held_out["train"], validation=held_out["test"])
    if args.max_train_samples:
        splits["train"] = splits["train"].select(range(min(args.max_train_samples, len(splits["train"]))))
    for name in splits:
        if name.startswith("validation") and args.max_eval_samples:
            splits[name] = splits[name].select(range(min(args.max_eval_samples, len(splits[name]))))
    if args.task_name and args.train_file:
        text, pair, _, _ = GLUE_TASKS[args.task_name]
        found = splits["train"].column_names
        missing = [c for c in (text, pair) if c and c not in found]
        if missing and (args.text_column, args.text_pair_column) == (text, pair):  # GLUE's names, not the user's
            raise UserError(
                f"--task_name {args.task_name} reads the column(s) {', '.join(c for c in (text, pair) if c)}, and "
                f"{args.train_file} has no {', '.join(missing)} (its columns: {', '.join(found)}); rename them, or "
                "name yours with --text_column and --text_pair_column"
            )
        for name in splits:
            splits[name] = glue_labels(splits[name], args.task_name, args.label_column)
    return splits


def glue_labels(dataset: Dataset, task_name: str, label_column: str | None) -> Dataset:
    """A local file in GLUE's columns, labelled as the Hub's copy is: the task's label names for ids 0, 1, ...
    (or the names themselves), and STS-B's scores as floats, so that integer scores still mean regression."""
    label_column = label_column or "label"
    if label_column not in dataset.column_names or isinstance(dataset.features[label_column], ClassLabel):
        return dataset  # unlabelled, or labelled already
    names = GLUE_TASKS[task_name][2]
    if names is None:
        return dataset.cast_column(label_column, Value("float32"))
    allowed = set(names) | set(range(-1, len(names)))  # -1: GLUE's unlabelled test rows
    wrong = [v for v in dataset.unique(label_column) if v not in allowed]
    if wrong:
        raise UserError(
            f"--task_name {task_name}: label column {label_column!r} holds {', '.join(map(str, wrong[:5]))}; "
            f"GLUE's {task_name} labels are {', '.join(names)} or their ids 0-{len(names) - 1}"
        )
    return dataset.cast_column(label_column, ClassLabel(names=list(names)))


def detect_columns(
    column_names: list[str],
    text_column: str | None = None,
    text_pair_column: str | None = None,
    label_column: str | None = None,
    need_label: bool = True,
) -> tuple[str, str | None, str | None]:
    """(text, text pair or None, label or None): the given names, checked, or the conventional ones found."""
    available = ", ".join(column_names)
    for flag, name in (
        ("--text_column", text_column),
        ("--text_pair_column", text_pair_column),
        ("--label_column", label_column),
    ):
        if name is not None and name not in column_names:
            raise UserError(f"{flag} {name!r} is not in the data; its columns are: {available}")
    if text_column is None:
        pair = next((p for p in TEXT_PAIR_COLUMNS if p[0] in column_names and p[1] in column_names), None)
        single = next((c for c in SINGLE_TEXT_COLUMNS if c in column_names), None)
        if pair and text_pair_column is None:
            text_column, text_pair_column = pair
        elif single:
            text_column = single
        else:
            raise UserError(f"no text column found among: {available}; name it with --text_column")
    if label_column is None:
        label_column = next((c for c in LABEL_COLUMNS if c in column_names), None)
        if label_column is None and need_label:
            raise UserError(f"no label column found among: {available}; name it with --label_column")
    return text_column, text_pair_column, label_column


def tokenize(dataset: Dataset, tokenizer, columns: tuple, max_length: int, task: Task) -> Dataset:
    """Token ids, `labels` (in the form `task` trains on) and the row's position.

    `columns` is (text, text pair or None, label or None). Raises UserError for a label the task does not
    know, e.g. evaluating on a class the model never saw.
    """
    text_column, text_pair_column, label_column = columns
    if label_column and isinstance(dataset.features[label_column], ClassLabel) and -1 in dataset.unique(label_column):
        if set(dataset.unique(label_column)) != {-1}:
            raise UserError(f"label column {label_column!r} marks some rows as unlabelled (-1); drop those rows")
        label_column = None  # an unlabelled split, e.g. GLUE's test sets
    name_of, multi_label = label_namer(dataset, label_column) if label_column else (None, task.is_multi_label)
    if multi_label != task.is_multi_label:
        rows = "lists of labels" if multi_label else "one label per row"
        raise UserError(f"label column {label_column!r} holds {rows}, but the model does {task.describe()}")
    label2id = task.label2id

    def encode(rows, indices):
        texts = [str(t) if t is not None else "" for t in rows[text_column]]
        pairs = [str(t) if t is not None else "" for t in rows[text_pair_column]] if text_pair_column else None
        encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        encoded[INDEX_COLUMN] = indices
        encoded[LENGTH_COLUMN] = [len(ids) for ids in encoded["input_ids"]]
        if label_column is None:
            return encoded
        raw = rows[label_column]
        if task.is_regression:
            encoded["labels"] = [float(v) for v in raw]
            return encoded
        names = [name_of(v) for v in raw]
        unknown = sorted({n for row in names for n in (row if multi_label else [row]) if n not in label2id})
        if unknown:
            raise UserError(
                f"label(s) {', '.join(unknown[:10])} in column {label_column!r} are not among the model's labels "
                f"({', '.join(label2id)})"
            )
        if multi_label:  # multi-hot floats, the targets of BCE-with-logits
            encoded["labels"] = [[float(name in chosen) for name in label2id] for chosen in map(set, names)]
        else:
            encoded["labels"] = [label2id[n] for n in names]
        return encoded

    return dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc="Tokenizing")


class LengthGroupedSampler(Sampler[int]):
    """A shuffle in which consecutive batches hold examples of similar length, fresh for each epoch.

    The order depends only on (seed, epoch): a resumed run gets the same batches, and every rank computes
    the same order (accelerate then deals the batches out). `batch_size` is one optimizer update's examples
    (per device x processes x accumulation) so that 2 ranks x 4, 1 rank x 4 accumulated twice and 1 rank x 8
    see the same examples in each optimizer step (up to the short batch that ends an uneven epoch).

    The shuffled examples are sorted by length within windows of `groups` updates. Wider windows waste less
    compute on padding: on 6,000 SST-2 rows with batch 32, 16 batches leave 12% of the computed tokens as
    padding and 64 batches 3.5%, with no loss of accuracy over 3 seeds (benchmarks/README.md).
    """

    def __init__(self, lengths, batch_size: int, seed: int, group_by_length: bool = True, groups: int = 64):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self.window = batch_size * groups
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])  # (seed 42, epoch 1) != (seed 43, epoch 0)
        order = rng.permutation(len(self.lengths))
        if not self.group_by_length:
            yield from order.tolist()
            return
        # Sort within windows of a few batches: lengths line up, batches still change every epoch.
        for start in range(0, len(order), self.window):
            window = order[start : start + self.window]
            order[start : start + self.window] = window[np.argsort(self.lengths[window], kind="stable")]
        order = order.tolist()
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        # Shuffle the batches (the short last one stays last) so lengths do not rise steadily within a window.
        full = len(order) // self.batch_size
        for position in rng.permutation(full).tolist():
            yield from batches[position]
        if full < len(batches):
            yield from batches[-1]


def lengths_of(dataset: Dataset) -> np.ndarray:
    """The token counts as one array (indexing a `datasets` column row by row costs ~0.1 ms a row)."""
    return dataset.with_format("numpy")[LENGTH_COLUMN][:]


def padding_options(device: torch.device, pad_to_length: int | None = None) -> dict:
    """The collator's options, the same in training and evaluation (train.py and evaluate.py): multiples of 8 on CUDA,
    which tensor cores want, or every batch to `pad_to_length` (--pad_to_max_length) for fixed shapes."""
    return {"pad_to_multiple_of": 8 if device.type == "cuda" else None, "pad_to_length": pad_to_length}


def build_collator(tokenizer, pad_to_multiple_of=None, pad_to_length=None) -> DataCollatorWithPadding:
    """Pads each batch to its longest example, or to `pad_to_length` (--pad_to_max_length) for fixed shapes."""
    if pad_to_length:
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=pad_to_length)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


def build_train_dataloader(
    dataset: Dataset, tokenizer, batch_size, num_processes, seed, group_by_length=True, *, accumulation=1,
    pad_to_multiple_of=None, pad_to_length=None,
) -> DataLoader:  # fmt: skip
    update = batch_size * num_processes * accumulation  # the examples of one optimizer step
    sampler = LengthGroupedSampler(lengths_of(dataset), update, seed, group_by_length)
    return DataLoader(
        dataset.remove_columns([INDEX_COLUMN, LENGTH_COLUMN]),
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=build_collator(tokenizer, pad_to_multiple_of, pad_to_length),
        # The loader's own generator: starting an epoch must not draw from the global RNG that dropout uses,
        # or a resumed run would drop out different units than the uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(),  # lets the non-blocking copy to the GPU really overlap
    )


def build_eval_dataloader(
    dataset: Dataset, tokenizer, batch_size, pad_to_multiple_of=None, pad_to_length=None
) -> DataLoader:
    """Longest examples first, so batches hold similar lengths; `evaluate` puts results back in row order."""
    by_length = np.argsort(-lengths_of(dataset), kind="stable").tolist()
    return DataLoader(
        dataset.remove_columns(LENGTH_COLUMN),
        batch_size=batch_size,
        sampler=by_length,
        collate_fn=build_collator(tokenizer, pad_to_multiple_of, pad_to_length),
        generator=torch.Generator().manual_seed(0),
        pin_memory=torch.cuda.is_available(),
    )
