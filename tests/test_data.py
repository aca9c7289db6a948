"""Loading local files, column detection, labels, tokenisation and the training sampler."""

import pytest
from conftest import sentiment_rows, write_rows
from transformers import AutoTokenizer

from src.data import (
    INDEX_COLUMN,
    LengthGroupedSampler,
    detect_columns,
    load_file,
    tokenize,  # fmt: skip
)
from src.demo_data import make_demo_splits
from src.errors import UserError
from src.task import SINGLE_LABEL, Task, detect_task


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_every_file_type_loads(tmp_path, suffix):
    rows = sentiment_rows(5)
    dataset = load_file(write_rows(tmp_path / f"data{suffix}", rows))
    assert dataset["sentence"] == [r["sentence"] for r in rows]


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
        detect_columns(["review", "stars"], text_column="review", label_column="score")
    assert detect_columns(["review"], text_column="review", need_label=False) == ("review", None, None)


def test_label_kinds(tmp_path):
    def names(values):
        rows = [{"sentence": "x", "label": v} for v in values]
        return detect_task(load_file(write_rows(tmp_path / "d.jsonl", rows)), "label")

    assert names(["pos", "neg", "pos"]) == Task(SINGLE_LABEL, ("neg", "pos"))
    assert names([10, 2, 2]) == Task(SINGLE_LABEL, ("2", "10"))
    assert names([0.5, 1.25]).is_regression
    assert detect_task(make_demo_splits(10, 10)["train"], "label").label_names == ("negative", "positive")
    with pytest.raises(UserError, match="empty values"):
        names(["pos", None])


def test_tokenize_maps_labels_and_refuses_unknown_ones(tmp_path, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = load_file(write_rows(tmp_path / "d.csv", sentiment_rows(6)))
    columns = ("sentence", None, "label")
    encoded = tokenize(data, tokenizer, columns, 16, Task(SINGLE_LABEL, ("negative", "positive")))
    assert encoded[INDEX_COLUMN] == list(range(6))
    assert encoded["labels"] == [{"negative": 0, "positive": 1}[r["label"]] for r in sentiment_rows(6)]
    with pytest.raises(UserError, match=r"label\(s\) positive in column 'label' are not among the model's labels"):
        tokenize(data, tokenizer, columns, 16, Task(SINGLE_LABEL, ("negative", "neutral")))


@pytest.mark.parametrize("group_by_length", [True, False])
def test_sampler_gives_every_example_once_per_epoch_on_any_number_of_ranks(group_by_length):
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
    assert orders[0] != orders[1] != orders[2], "re-shuffled every epoch"
    # Two ranks: accelerate deals consecutive batches of 4 out in turn, so together they cover one global order.
    batches = [orders[0][i : i + 4] for i in range(0, 203, 4)]
    rank0 = [i for b in batches[0::2] for i in b]
    rank1 = [i for b in batches[1::2] for i in b]
    assert sorted(rank0 + rank1) == list(range(203)) and not set(rank0) & set(rank1)


def test_length_grouping_cuts_padding():
    lengths = [(i * 7919) % 120 + 5 for i in range(2000)]

    def padding(order):
        batches = [order[i : i + 32] for i in range(0, len(order), 32)]
        real = sum(lengths)
        return 1 - real / sum(max(lengths[i] for i in b) * len(b) for b in batches)

    grouped = LengthGroupedSampler(lengths, 32, seed=0)
    plain = LengthGroupedSampler(lengths, 32, seed=0, group_by_length=False)
    assert padding(list(grouped)) < 0.1 < 0.3 < padding(list(plain))
