"""Loading local files, column detection, labels, tokenisation and the training sampler."""

from types import SimpleNamespace

import pytest
from accelerate import PartialState
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from conftest import sentiment_rows, write_rows
from datasets import Dataset
from transformers import AutoTokenizer

from src.args import parse_train_args
from src.data import check_column_flags, detect_columns, load_file, load_raw_splits
from src.demo_data import make_demo_splits
from src.errors import UserError
from src.loaders import (
    INDEX_COLUMN,
    LENGTH_COLUMN,
    LengthGroupedSampler,
    build_eval_dataloader,
    build_train_dataloader,
    padding_collator,
)
from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification


def detect_task(dataset, label_column):
    args = SimpleNamespace(text_column=None, text_pair_column=None, label_column=label_column, class_weights="none",
                           multi_label_threshold=0.5, model_name_or_path=None)  # fmt: skip
    return SequenceClassification.from_data(args, dataset)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_every_file_type_loads(tmp_path, suffix):
    rows = sentiment_rows(5)
    dataset = load_file(write_rows(tmp_path / f"data{suffix}", rows))
    assert dataset["sentence"] == [r["sentence"] for r in rows]


def test_lists_written_into_a_csv_are_named_with_the_fix(tmp_path, caplog):
    """pandas' to_csv of word and tag lists writes their text: read back, they would pass for a sentence and a class."""
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    rows = [{"tokens": "['EU', 'rejects']", "ner_tags": '["B-ORG", "O"]', "note": "[Music]", "other": "[1, 2"}]
    with caplog.at_level("WARNING"):
        load_file(write_rows(tmp_path / "words.csv", rows))
    assert "column(s) 'tokens', 'ner_tags' hold lists written as text (\"['EU', 'rejects']\")" in caplog.text
    assert "write lists of words, tags or labels in a .jsonl or .parquet file" in caplog.text


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match=r"data\.xlsx: unsupported file type '\.xlsx'; use one of"):
        load_file(tmp_path / "data.xlsx")
    with pytest.raises(UserError, match="missing.csv: no such file"):
        load_file(tmp_path / "missing.csv")
    (tmp_path / "empty.csv").write_text("sentence,label\n")
    with pytest.raises(UserError, match="empty.csv: the file has no rows"):
        load_file(tmp_path / "empty.csv")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UserError, match="broken.json: cannot be read as json"):
        load_file(tmp_path / "broken.json")
    # A bad line among good ones: which row, from the parser's own error under datasets' generic one.
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 1}\n{"text": "b", "label": \n{"text": "c"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl: cannot be read as jsonl: .*JSON parse error: .* in row 1"):
        load_file(tmp_path / "bad.jsonl")
    (tmp_path / "nothing.csv").write_text("")
    with pytest.raises(UserError, match="nothing.csv: the file is empty"):  # datasets: "error generating the dataset"
        load_file(tmp_path / "nothing.csv")
    (tmp_path / "latin1.csv").write_bytes("sentence,label\ncaf\u00e9,1\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.csv: not UTF-8 text \(it holds the byte 0xe9\); save it as UTF-8"):
        load_file(tmp_path / "latin1.csv")


def test_a_text_files_lines_keep_their_line_breaks_unless_told(tmp_path):
    (tmp_path / "lines.txt").write_text("the plot was good\nthe plot was bad\n")
    assert load_file(tmp_path / "lines.txt")["text"] == ["the plot was good\n", "the plot was bad\n"]
    assert load_file(tmp_path / "lines.txt", keep_linebreaks=False)["text"] == ["the plot was good", "the plot was bad"]


def test_the_validation_split_is_held_out_of_the_training_rows(tmp_path):
    """Without a validation file, --validation_split_percentage of the rows validate and only the others train: the
    two are disjoint and together the file. The same seed holds out the same rows, another seed others."""
    rows = [{"sentence": f"row {i}", "label": i % 2} for i in range(50)]
    data = write_rows(tmp_path / "all.jsonl", rows)
    PartialState(cpu=True)  # accelerate's logger, which says how many rows are held out

    def split(*flags):
        args = parse_train_args(["--train_file", str(data), "--validation_split_percentage", "20", *flags])
        splits = load_raw_splits(args)
        return list(splits["train"]["sentence"]), list(splits["validation"]["sentence"])

    train, validation = split()
    assert (len(train), len(validation)) == (40, 10)
    assert sorted(train + validation) == sorted(row["sentence"] for row in rows), "every row once, in one split"
    assert split() == (train, validation)
    assert split("--seed", "8") != (train, validation)


def test_a_datasets_test_split_is_not_taken_for_validation_and_the_log_says_so(tmp_path, caplog):
    """As in the transformers examples, 'validation' or rows held out of 'train'; TRL would take 'test'."""
    for name, count in (("train", 30), ("test", 7)):
        (tmp_path / "data").mkdir(exist_ok=True)
        write_rows(tmp_path / "data" / f"{name}-00000-of-00001.parquet",
                   [{"sentence": f"row {i}", "label": i % 2} for i in range(count)])  # fmt: skip
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("INFO"):
        splits = load_raw_splits(parse_train_args(["--dataset_name", str(tmp_path)]))
    assert (len(splits["train"]), len(splits["validation"])) == (27, 3)
    assert "10% of the training rows (3) held out for it; the dataset's test is left for evaluate.py --split" in (
        caplog.text
    )


@pytest.mark.parametrize(
    "columns,expected",
    [
        (["sentence", "label"], ("sentence", None, "label")),
        (["text", "labels", "id"], ("text", None, "labels")),
        (["idx", "sentence1", "sentence2", "label"], ("sentence1", "sentence2", "label")),
        (["premise", "hypothesis", "label"], ("premise", "hypothesis", "label")),
        (["question", "sentence", "label"], ("question", "sentence", "label")),
    ],
)
def test_columns_are_detected(columns, expected):
    assert detect_columns(columns) == expected


def test_missing_columns_list_what_exists():
    with pytest.raises(UserError, match="no text column found among: review, stars; name it with --text_column"):
        detect_columns(["review", "stars"])
    with pytest.raises(UserError, match="no label column found among: review, stars; name it with --label_column"):
        detect_columns(["review", "stars"], text_column="review")
    with pytest.raises(UserError, match="--label_column 'score' is not in the data; its columns are: review, stars"):
        check_column_flags(
            SimpleNamespace(text_column="review", text_pair_column=None, label_column="score"), ["review", "stars"]
        )
    assert detect_columns(["review"], text_column="review", need_label=False) == ("review", None, None)


def test_label_kinds(tmp_path, tiny_model):
    def names(values):
        rows = [{"sentence": "x", "label": v} for v in values]
        return detect_task(load_file(write_rows(tmp_path / "d.jsonl", rows)), "label")

    columns = ("sentence", None, "label")
    assert names(["pos", "neg", "pos"]) == SequenceClassification(SINGLE_LABEL, ("neg", "pos"), columns=columns)
    assert names([10, 2, 2]) == SequenceClassification(SINGLE_LABEL, ("2", "10"), columns=columns)
    assert names([0.5, 1.25]).is_regression
    # True/False (pandas' to_csv of a flag): two classes, by those names.
    flags = load_file(write_rows(tmp_path / "b.csv", [{"sentence": "x", "label": v} for v in (True, False, True)]))
    task = detect_task(flags, "label")
    assert task == SequenceClassification(SINGLE_LABEL, ("False", "True"), columns=columns)
    assert task.features(flags, AutoTokenizer.from_pretrained(tiny_model), 16)["labels"] == [1, 0, 1]
    assert detect_task(make_demo_splits(10, 10)["train"], "label").label_names == ("negative", "positive")
    with pytest.raises(UserError, match="empty values"):
        names(["pos", None])


def test_tokenize_maps_labels_and_refuses_unknown_ones(tmp_path, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = load_file(write_rows(tmp_path / "d.csv", sentiment_rows(6)))
    columns = ("sentence", None, "label")
    task = SequenceClassification(SINGLE_LABEL, ("negative", "positive"), columns=columns)
    encoded = task.features(data, tokenizer, 16)
    assert encoded[INDEX_COLUMN] == list(range(6))
    assert encoded["labels"] == [{"negative": 0, "positive": 1}[r["label"]] for r in sentiment_rows(6)]
    with pytest.raises(UserError, match=r"label\(s\) positive in column 'label' are not among the model's labels"):
        SequenceClassification(SINGLE_LABEL, ("negative", "neutral"), columns=columns).features(data, tokenizer, 16)
    # A classifier from elsewhere whose names differ only in case (roberta-large-mnli's ENTAILMENT on GLUE's data).
    shouting = SequenceClassification(SINGLE_LABEL, ("NEGATIVE", "Positive"), columns=columns)
    assert shouting.features(data, tokenizer, 16)["labels"] == encoded["labels"]
    with pytest.raises(UserError, match=r"label\(s\) positive in column 'label' are not among"):  # which one?
        SequenceClassification(SINGLE_LABEL, ("negative", "POSITIVE", "Positive"), columns=columns).features(
            data, tokenizer, 16
        )


@pytest.mark.parametrize("group_by_length", [True, False])
def test_sampler_gives_every_example_once_per_epoch(group_by_length):
    lengths = [(i * 7919) % 50 + 1 for i in range(203)]
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3, group_by_length=group_by_length)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(203))
        orders.append(order)
        sampler.set_epoch(epoch)
        assert list(sampler) == order, "the same (seed, epoch) gives the same order: resume is exact"
    assert len({tuple(order) for order in orders}) == 3, "re-shuffled every epoch: no two epochs alike"


def test_the_order_of_one_seeds_next_epoch_is_not_another_seeds_first():
    """Runs repeated with seeds 42, 43, ... (to see the spread of a result) must not see the same orders an epoch
    apart: the shuffle is drawn from (seed, epoch), not from their sum."""
    lengths = [(i * 7919) % 50 + 1 for i in range(203)]
    for group_by_length in (True, False):
        later = LengthGroupedSampler(lengths, batch_size=8, seed=42, group_by_length=group_by_length)
        later.set_epoch(1)
        first = LengthGroupedSampler(lengths, batch_size=8, seed=43, group_by_length=group_by_length)
        assert list(later) != list(first)


def indexed_dataset(count: int) -> Dataset:
    """Tokenised-looking rows whose label is the row's number, so a batch tells which rows it holds."""
    lengths = [(i * 7) % 11 + 2 for i in range(count)]
    return Dataset.from_dict(
        {
            "input_ids": [[5] * n for n in lengths],
            "attention_mask": [[1] * n for n in lengths],
            "labels": list(range(count)),
            LENGTH_COLUMN: lengths,
            INDEX_COLUMN: list(range(count)),
        }
    )


def rank_batches(dataset, tokenizer, per_device, num_processes, rank, epoch, skip=0) -> list[list[int]]:
    """The rows of each batch that rank `rank` of `num_processes` trains on, sharded by accelerate itself with the
    settings train.py's Accelerator uses (batches dealt out in turn, the last ones evened out)."""
    loader = build_train_dataloader(dataset, padding_collator(tokenizer), per_device, num_processes, seed=7)
    loader = prepare_data_loader(loader, num_processes=num_processes, process_index=rank, put_on_device=False)
    loader.set_epoch(epoch)
    return [batch["labels"].tolist() for batch in (skip_first_batches(loader, skip) if skip else loader)]


@pytest.mark.parametrize("num_processes", [2, 3])
def test_accelerate_shards_the_training_batches_like_one_large_batch(tiny_model, num_processes):
    """45 rows, 4 per rank: each step's rows over all ranks are the 1-rank batch of 4 x N, except the short last one,
    which accelerate fills up with the epoch's first rows so that every rank gets a full batch (even_batches)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    dataset, epochs = indexed_dataset(45), []
    for epoch in (0, 1):
        single = rank_batches(dataset, tokenizer, 4 * num_processes, 1, 0, epoch)
        ranks = [rank_batches(dataset, tokenizer, 4, num_processes, r, epoch) for r in range(num_processes)]
        assert len({len(batches) for batches in ranks}) == 1, "every rank takes the same number of steps"
        steps = [sum((batches[step] for batches in ranks), []) for step in range(len(ranks[0]))]
        assert len(steps) == len(single) == -(-45 // (4 * num_processes))
        assert steps[:-1] == single[:-1]
        short = single[-1]
        assert len(short) < 4 * num_processes and steps[-1] == short + single[0][: 4 * num_processes - len(short)]
        assert sorted({row for step in steps for row in step}) == list(range(45)), "no row left out"
        # Resuming mid-epoch: the remaining batches of each rank, as train.py skips them.
        assert rank_batches(dataset, tokenizer, 4, num_processes, 1, epoch, skip=2) == ranks[1][2:]
        epochs.append(steps)
    assert epochs[0] != epochs[1], "set_epoch on the prepared loader reaches the sampler"


def test_length_grouping_cuts_padding():
    lengths = [(i * 7919) % 120 + 5 for i in range(2000)]

    def padding(order):
        batches = [order[i : i + 32] for i in range(0, len(order), 32)]
        real = sum(lengths)
        return 1 - real / sum(max(lengths[i] for i in b) * len(b) for b in batches)

    grouped = LengthGroupedSampler(lengths, 32, seed=0)
    plain = LengthGroupedSampler(lengths, 32, seed=0, group_by_length=False)
    assert padding(list(grouped)) < 0.1 < 0.3 < padding(list(plain))


def test_evaluation_batches_run_longest_first(tiny_model):
    """Rows of similar lengths together, the longest first: the least padding, and a batch too large for memory fails
    at the first evaluation step rather than at the end (evaluate() puts the results back in row order)."""
    dataset = indexed_dataset(45)
    loader = build_eval_dataloader(dataset, padding_collator(AutoTokenizer.from_pretrained(tiny_model)), 4)
    widths = [batch["input_ids"].shape[1] for batch in loader]
    assert widths == sorted(widths, reverse=True) and widths[0] == max(dataset[LENGTH_COLUMN])


def test_evaluation_averages_the_loss_over_units_and_pads_outputs_with_the_ignore_index(tiny_model):
    """A task with a unit per token (token classification, causal LM): eval_loss is the summed loss over the summed
    units of the whole set (not a mean per example), and outputs of batches of other widths are padded with the
    ignore index (-100), which the task's metrics skip, never with a label id such as 0."""
    import torch
    from accelerate import Accelerator

    from src.evaluation import evaluate
    from src.loaders import build_eval_dataloader
    from src.tasks.base import Step, Task

    class PerToken(Task):
        def step(self, model, batch):
            known = batch["attention_mask"].bool()
            rows = batch["labels"]  # the row's number
            units = known.sum(-1)
            label = torch.where(known, rows[:, None], torch.full_like(known, -100, dtype=torch.long))
            loss = rows.double() * units  # each of the row's tokens costs the row's number
            return Step(loss.sum(), units.sum(), {"loss": loss, "units": units, "label": label})

    dataset = indexed_dataset(11)  # 2 to 12 tokens a row: batches of 3 have other widths
    lengths = torch.tensor(dataset[LENGTH_COLUMN])
    loader = build_eval_dataloader(dataset, padding_collator(AutoTokenizer.from_pretrained(tiny_model)), 3)
    accelerator = Accelerator(cpu=True)
    metrics, columns = evaluate(torch.nn.Module(), accelerator.prepare(loader), accelerator, PerToken())
    assert metrics["eval_samples"] == 11 and columns["index"].tolist() == list(range(11))
    expected = (torch.arange(11) * lengths).sum().item() / lengths.sum().item()
    assert metrics["eval_loss"] == pytest.approx(expected)
    assert columns["label"].shape == (11, lengths.max().item())
    assert ((columns["label"] != -100).sum(-1) == lengths).all(), "padding counted as labels"
    assert all((row[row != -100] == i).all() for i, row in enumerate(columns["label"]))
