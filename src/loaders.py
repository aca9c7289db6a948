"""From tokenized rows to batches: the length-grouped sampler, the padding collator and the dataloaders, built the
same way for training, evaluation and the batch-size probe."""

import io
import os
import pickle
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorForTokenClassification, DataCollatorWithPadding

from src.errors import UserError
from src.runtime import local_world_size, usable_cpu_count
from src.signals import end_with_the_rank, workers_context

INDEX_COLUMN = "example_index"  # position in the evaluated data, so results can be put back in order
LENGTH_COLUMN = "length"  # tokens per example, for batching by length without reading every token id


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
    """The token counts as one array (indexing a `datasets` column row by row costs ~0.1 ms a row). Every loader
    starts here, so a task of one's own that left out a column the loaders need learns it here, before training."""
    missing = [column for column in (INDEX_COLUMN, LENGTH_COLUMN) if column not in dataset.column_names]
    if missing:
        raise UserError(f"the task's features (from its features(), and training_rows() for training) lack the "
                        f"column {' and '.join(map(repr, missing))}: the loaders batch rows by their token count "
                        f"({LENGTH_COLUMN!r}) and evaluation puts them back in order by their position "
                        f"({INDEX_COLUMN!r}); see Task.features in src/tasks/base.py")  # fmt: skip
    return dataset.with_format("numpy")[LENGTH_COLUMN][:]


def padding_options(device: torch.device, pad_to_length: int | None = None) -> dict:
    """The collator's options, the same in training and evaluation (train.py and evaluate.py): multiples of 8 on CUDA,
    which tensor cores want, or every batch to `pad_to_length` (--pad_to_max_length) for fixed shapes."""
    return {"pad_to_multiple_of": 8 if device.type == "cuda" else None, "pad_to_length": pad_to_length}


def padding_collator(tokenizer, pad_to_multiple_of=None, pad_to_length=None, per_token=False):
    """Pads each batch to its longest example, or to `pad_to_length` (--pad_to_max_length) for fixed shapes;
    `per_token`: labels too, with -100 (token classification, causal LM)."""
    kind = DataCollatorForTokenClassification if per_token else DataCollatorWithPadding
    if pad_to_length:
        return kind(tokenizer, padding="max_length", max_length=pad_to_length)
    return kind(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


@dataclass
class PaddingColumnToo:
    """The collator `pad`, with `column` (a list per row that the tokenizer does not pad) padded with `value` to each
    batch's width on the tokenizer's padding `side`; rows without the column go to `pad` as they are. A class, not a
    closure: DataLoader workers started by spawn (macOS, Windows) receive the collator pickled."""

    pad: Callable[[list[dict]], dict]
    column: str
    value: int
    side: str

    def __call__(self, rows: list[dict]) -> dict:
        if self.column not in rows[0]:
            return self.pad(rows)
        batch = self.pad([{key: row[key] for key in row if key != self.column} for row in rows])
        width = batch["input_ids"].shape[1]
        padded = []
        for row in rows:
            fill = [self.value] * (width - len(row[self.column]))
            padded.append(row[self.column] + fill if self.side == "right" else fill + row[self.column])
        batch[self.column] = torch.tensor(padded)
        return batch


def collating_workers(requested: int | None, device: torch.device) -> int:
    """--dataloader_num_workers, else the default: on a CUDA GPU, up to 4 per process from the CPUs the machine's
    processes share (their affinity, within a container's CPU limit), one of each process's left to the process.
    Collating in the process, the host builds each batch while the GPU waits: transformers' attention-mask check
    (`mask.all()`) makes the host wait for the GPU at every forward pass, so collation cannot overlap the step before
    (BERT-base, batch 128 x 128 tokens, one H200: 260k tokens/s collating in the process, 460k with 4 workers).
    Without a GPU the cores compute: 0."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    return max(0, min(4, usable_cpu_count() // local_world_size() - 1))


def _loader(dataset: Dataset, collator, batch_size: int, sampler, seed: int, num_workers: int,
            keep_workers: bool) -> DataLoader:  # fmt: skip
    """`num_workers` collating processes (--dataloader_num_workers), kept across epochs if `keep_workers` (training;
    an evaluation starts its own, as Trainer's do, so that no idle ones stay beside each validation split). The
    sampler stays in this process, so batches, their order and an exact resume do not depend on the workers."""
    if num_workers:
        _check_picklable(collator)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
        # The loader's own generator: starting an epoch must not draw from the global RNG that dropout uses,
        # or a resumed run would drop out different units than the uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(),  # lets the non-blocking copy to the GPU really overlap
        num_workers=num_workers, persistent_workers=keep_workers and num_workers > 0,
        worker_init_fn=partial(end_with_the_rank, os.getpid()) if num_workers else None,
        multiprocessing_context=workers_context() if num_workers else None,
    )  # fmt: skip


class _NamesFromMain(pickle.Pickler):
    """Pickles as the workers receive it, noting each function or class of __main__ that the pickle names."""

    def __init__(self, file):
        super().__init__(file)
        self.from_main = []

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.from_main.append(obj.__qualname__)
        return NotImplemented  # pickled as usual


def _check_picklable(collator):
    """Workers started by a fork server or spawn (src/signals.py) receive the collator pickled, and import what it
    names: a closure, or a function of a notebook's or `python -c`'s (a __main__ without a file), fails there as the
    workers start, in a traceback from torch. Said here, before any training, in one line."""
    pickler = _NamesFromMain(io.BytesIO())
    try:
        pickler.dump(collator)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        why = str(err)
    else:
        in_fileless_main = pickler.from_main and not hasattr(sys.modules["__main__"], "__file__")
        why = (f"it names {', '.join(dict.fromkeys(pickler.from_main))}, defined in a notebook or `python -c`, which "
               "the workers cannot import") if in_fileless_main else ""  # fmt: skip
    if why:
        name = getattr(collator, "__qualname__", type(collator).__qualname__)
        raise UserError(f"the task's collator ({name}) cannot be sent to the collating workers "
                        f"(--dataloader_num_workers), which receive it pickled: {why}. Make it a function or class "
                        "at module level of a file (as PaddingColumnToo in src/loaders.py), or pass "
                        "--dataloader_num_workers 0")  # fmt: skip


def build_train_dataloader(dataset: Dataset, collator, batch_size: int, num_processes: int, seed: int,
                           group_by_length=True, accumulation=1, num_workers=0) -> DataLoader:  # fmt: skip
    update = batch_size * num_processes * accumulation  # the examples of one optimizer step
    sampler = LengthGroupedSampler(lengths_of(dataset), update, seed, group_by_length)
    return _loader(dataset.remove_columns([INDEX_COLUMN, LENGTH_COLUMN]), collator, batch_size, sampler, seed,
                   num_workers, keep_workers=True)  # fmt: skip


def build_eval_dataloader(dataset: Dataset, collator, batch_size: int, num_workers: int = 0) -> DataLoader:
    """Longest examples first, so batches hold similar lengths; `evaluate` puts results back in row order."""
    by_length = np.argsort(-lengths_of(dataset), kind="stable").tolist()
    return _loader(
        dataset.remove_columns(LENGTH_COLUMN), collator, batch_size, by_length, 0, num_workers, keep_workers=False
    )
