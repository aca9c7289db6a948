"""Reading the data: local files, Hub datasets, GLUE or the demo task, split into train and validation; and which
columns hold the text and the labels.

Every function here runs identically on every rank; train.py calls them under `main_process_first()` so that rank 0
fills the datasets cache and the others read it.
"""

import ast
from pathlib import Path

import datasets.config
from accelerate.logging import get_logger
from datasets import Dataset, DatasetDict, load_dataset

from src.errors import UserError
from src.glue import GLUE_DATASET, GLUE_TASKS, MNLI_MISMATCHED, glue_labels

# The `datasets` builder (and its options) for each local file type. GLUE-style TSVs are unquoted.
FILE_BUILDERS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t", "quoting": 3}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
    ".txt": ("text", {}),  # a `text` column, a row per line: causal-LM text
}
SINGLE_TEXT_COLUMNS = ("sentence", "text")
TEXT_PAIR_COLUMNS = (
    ("sentence1", "sentence2"),
    ("premise", "hypothesis"),
    ("question1", "question2"),
    ("question", "sentence"),
)
LABEL_COLUMNS = ("label", "labels")

logger = get_logger(__name__)


def load_file(path: Path, keep_linebreaks: bool = True) -> Dataset:
    """A local file's rows; a .txt file's lines keep their line breaks if `keep_linebreaks`."""
    path = Path(path)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: the file is empty")
    name, options = builder
    if name == "text":
        options = {"keep_linebreaks": keep_linebreaks}
    try:
        dataset = load_dataset(name, data_files=str(path), split="train", **options)
    except Exception as err:  # the builders raise many types for unreadable input
        if "corresponds to no data" in str(err):  # a header and no rows
            raise UserError(f"{path}: the file has no rows") from err
        # The builders' own message may say only that generating failed; what went wrong is in its causes.
        chain = [err]
        while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
            chain.append(cause)
        if cause := next((c for c in chain if isinstance(c, UnicodeDecodeError)), None):  # another encoding
            raise UserError(f"{path}: not UTF-8 text (it holds the byte {cause.object[cause.start]:#04x}); save it as "
                            "UTF-8") from err  # fmt: skip
        why = "; ".join(dict.fromkeys(" ".join(str(c).split()) for c in chain if str(c)))
        raise UserError(f"{path}: cannot be read as {path.suffix[1:]}: {why[:300]}") from err
    if len(dataset) == 0:
        raise UserError(f"{path}: the file has no rows")
    if name == "csv":
        _warn_of_lists_written_as_text(path, dataset[0])
    return dataset


def _warn_of_lists_written_as_text(path: Path, row: dict):
    """A list saved in a CSV cell (pandas' to_csv of word and tag lists) is its text, "['EU', 'rejects']": one string,
    which the tasks would take for a sentence and a class, and whose errors would then point elsewhere. A text that
    reads as no list ("[Music]") is a text."""
    listed = [column for column, value in row.items() if isinstance(value, str) and _is_a_list(value)]
    if listed:
        shown = ", ".join(map(repr, listed))
        logger.warning(  # on the main process: every rank reads the data
            f"{path}: column(s) {shown} hold lists written as text ({row[listed[0]][:40]!r}): a CSV cell holds one "
            "string; write lists of words, tags or labels in a .jsonl or .parquet file"
        )


def _is_a_list(text: str) -> bool:
    if text[:1] + text[-1:] != "[]":
        return False
    try:
        return isinstance(ast.literal_eval(text), list)  # Python's repr of a list, or JSON's of strings and numbers
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False


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
    any further validation split evaluated at the end ('validation_mm': MNLI's mismatched one). The training split
    is whole: the task takes its labels from all of it, and train.py keeps --max_train_samples rows after."""
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
        splits = DatasetDict(train=load_file(args.train_file, args.keep_linebreaks))
        if args.validation_file:
            splits["validation"] = load_file(args.validation_file, args.keep_linebreaks)
    else:
        from src.demo_data import make_demo_splits

        splits = make_demo_splits()
    if "validation" not in splits:
        percent = args.validation_split_percentage
        try:
            held_out = splits["train"].train_test_split(test_size=percent / 100, seed=args.seed)
        except ValueError as err:  # too few rows to hold some out and keep some
            instead = "--validation_file, " if args.train_file else ""
            raise UserError(
                f"{percent}% of {len(splits['train'])} training row(s) held out for validation (at least one) leaves "
                f"none to train on: give {instead}more rows, or a lower --validation_split_percentage"
            ) from err
        splits = DatasetDict(train=held_out["train"], validation=held_out["test"])
        others = [name for name in (hub if args.dataset_name else []) if name != "train"]  # a 'test' split, say
        logger.info(
            f"No validation data: {percent}% of the training rows ({len(held_out['test'])}) held out for it"
            + (f"; the dataset's {', '.join(others)} is left for evaluate.py --split" if others else "")
        )
    for name in splits:
        if name.startswith("validation") and args.max_eval_samples:
            splits[name] = splits[name].take(args.max_eval_samples)
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
    check_column_flags(args, splits["train"].column_names)
    return splits


def check_column_flags(args, column_names: list[str]):
    """The columns that --text_column, --text_pair_column and --label_column name are in the data, whatever task
    reads it (train.py: the training split; evaluate.py: the evaluated data)."""
    for flag in ("text_column", "text_pair_column", "label_column"):
        if getattr(args, flag) not in (None, *column_names):
            raise UserError(f"--{flag} {getattr(args, flag)!r} is not in the data; its columns are: "
                            f"{', '.join(column_names)}")  # fmt: skip


def check_columns(splits: DatasetDict, record: dict):
    """The validation splits hold the columns that the task found in the training data and reads (the `*_column`
    keys of its record): without its labels, say, a run would train until its first evaluation and fail there."""
    wanted = [column for key, column in record.items() if key.endswith("_column") and column]
    for name, split in splits.items():
        if missing := [column for column in wanted if column not in split.column_names]:
            raise UserError(
                f"the {name} data has no column {', '.join(map(repr, missing))}, which the training data has and "
                f"the task reads; its columns are {', '.join(split.column_names)}: give it the training data's names"
            )


def detect_columns(
    column_names: list[str],
    text_column: str | None = None,
    text_pair_column: str | None = None,
    label_column: str | None = None,
    need_label: bool = True,
) -> tuple[str, str | None, str | None]:
    """(text, text pair or None, label or None): the given names (checked by check_column_flags), or the conventional
    ones found."""
    available = ", ".join(column_names)
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
            raise UserError(
                f"no label column found among: {available}; name it with --label_column (or, to fine-tune a causal LM "
                "on the text, pass --task causal-lm)"
            )
    return text_column, text_pair_column, label_column
