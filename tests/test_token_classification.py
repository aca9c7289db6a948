"""Token classification through the task interface: detection, label alignment, truncation, IOB and plain-tag metrics,
evaluate.py, and the gathered predictions on 3 ranks equal to 1 rank's."""

import csv
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from accelerate import PartialState
from conftest import (
    SHARED_DATA,
    WEIGHTS_ATOL,
    launch,
    load_script,
    read_shared,
    run_in_process,
    run_model_card_snippet,
    train_args,
)
from datasets import Dataset
from safetensors.torch import load_file

from src.errors import UserError
from src.model import default_model_path, load_tokenizer
from src.reporting import metrics_line
from src.tasks import detect_task
from src.tasks.token_classification import IGNORE, TokenClassification

UNER, UD = SHARED_DATA / "uner_en_ewt", SHARED_DATA / "ud_en_ewt"


def jsonl_rows(path: Path, count: int, folder: Path, rename: dict | None = None) -> Path:
    """The first `count` rows of a shared data file, in the test's folder (columns renamed as asked)."""
    rows = [json.loads(line) for line in read_shared(path).splitlines()[:count]]
    rows = [{(rename or {}).get(k, k): v for k, v in row.items()} for row in rows]
    out = folder / f"{path.parent.name}_{path.stem}_{count}.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def flags(**values):
    defaults = {"text_column": None, "label_column": None, "label_all_tokens": False,
                "return_entity_level_metrics": False, "model_name_or_path": None}  # fmt: skip
    return types.SimpleNamespace(**(defaults | values))


def test_a_tagger_trained_on_these_tags_keeps_its_order(tmp_path):
    """Fine-tuning a tagger on its own tags (a CoNLL model on IOB data) keeps its head: the tag ids follow its rows."""
    from transformers import BertConfig

    BertConfig(id2label={0: "I-LOC", 1: "O", 2: "B-LOC"}).save_pretrained(tmp_path)
    data = Dataset.from_list([{"tokens": ["in", "New", "York"], "ner_tags": ["O", "B-LOC", "I-LOC"]}])
    assert TokenClassification.from_data(flags(), data).label_names == ("B-LOC", "I-LOC", "O")
    tagger = TokenClassification.from_data(flags(model_name_or_path=str(tmp_path), trust_remote_code=False), data)
    assert tagger.label_names == ("I-LOC", "O", "B-LOC")


def test_auto_finds_word_and_tag_lists_by_any_name(tiny_model):
    data = Dataset.from_list([{"id": 1, "words": ["New", "York"], "ner": ["B-LOC", "I-LOC"]}])
    cls, why = detect_task(data)
    assert cls is TokenClassification and "'words'" in why and "'ner'" in why
    assert TokenClassification.from_data(flags(), data).columns == ("words", "ner")
    # IOB types come in pairs: PER, seen only as B-PER in a small sample, can be tagged I-PER too.
    one_word_names = Dataset.from_list([{"tokens": ["Ana", "ran"], "ner_tags": ["B-PER", "O"]}])
    assert TokenClassification.from_data(flags(), one_word_names).label_names == ("B-PER", "I-PER", "O")
    # A type's score picks the best model only with the flag that reports it: said before any training.
    with pytest.raises(UserError, match="--metric_for_best_model PER_f1 is reported with --return_entity_level_metri"):
        TokenClassification.from_data(flags(metric_for_best_model="eval_PER_f1"), one_word_names)
    assert TokenClassification.from_data(flags(metric_for_best_model="PER_f1", return_entity_level_metrics=True),
                                         one_word_names).return_entity_level_metrics  # fmt: skip
    sentences = Dataset.from_list([{"text": "New York", "labels": ["B-LOC", "I-LOC"]}])  # multi-label, not words
    assert detect_task(sentences)[0].name == "sequence-classification"
    # A row whose tags do not match its words is a mistake in tagged data, named by its row, not other data.
    uneven = Dataset.from_list([{"tokens": ["in", "Paris"], "ner_tags": ["O", "B-LOC"]}] * 3 +
                               [{"tokens": ["New", "York"], "ner_tags": ["B-LOC"]}])  # fmt: skip
    assert detect_task(uneven)[0] is TokenClassification
    with pytest.raises(UserError, match="row 3 has 2 words in 'tokens' and 1 tags in 'ner_tags': give every word one"):
        TokenClassification.from_data(flags(), uneven).features(uneven, load_tokenizer(str(tiny_model)), 16)


def test_entity_level_metrics_name_every_type_of_the_labels():
    """An entity type that neither the evaluated rows nor the predictions hold is reported as 0, so every evaluation
    has the same keys: --metric_for_best_model PER_f1 must find its value also when no PER is in sight."""
    names = ("B-LOC", "B-PER", "I-LOC", "I-PER", "O")
    task = TokenClassification(names, ("tokens", "ner_tags"), return_entity_level_metrics=True)
    assert "PER_f1" in task.metric_names() and "LOC_number" not in task.metric_names(), "a count ranks nothing"
    labels = torch.tensor([[0, 2, 4, -100]])  # B-LOC I-LOC O, then an ignored position
    scores = task.metrics({"label": labels, "prediction": torch.tensor([[0, 2, 4, 1]])})
    assert scores["LOC_f1"] == 1.0 and scores["LOC_number"] == 1
    assert {key: scores[key] for key in scores if key.startswith("PER_")} == {
        "PER_precision": 0.0, "PER_recall": 0.0, "PER_f1": 0.0, "PER_number": 0}  # fmt: skip
    # Counts of entities are whole numbers, as run_ner_no_trainer.py reports them (`eval_LOC_number = 8`, not 8.0000).
    assert type(scores["LOC_number"]) is type(scores["PER_number"]) is int
    assert metrics_line({"eval_samples": 1, "eval_LOC_f1": 1.0, "eval_LOC_number": 1}) == (
        "eval_LOC_f1 = 1.0000, eval_LOC_number = 1"
    )


def test_entity_scores_are_seqevals_over_all_entities_and_plain_tags_get_macro_f1():
    """IOB tags: precision, recall and F1 over every entity together (seqeval's micro average, run_ner's overall_*),
    not a mean over the types; other tags: macro F1 over the tags, which a rare tag moves, unlike accuracy."""
    from seqeval.metrics import f1_score as entity_f1
    from seqeval.metrics import precision_score, recall_score
    from sklearn.metrics import f1_score

    names = ("B-LOC", "B-PER", "I-LOC", "I-PER", "O")
    labels = torch.tensor([[0, 2, 4, 1, 4, 1, IGNORE]])  # LOC (2 words) O PER O PER, then an ignored position
    predicted = torch.tensor([[0, 2, 4, 1, 4, 4, 3]])  # the LOC and the first PER found, the second PER missed
    scores = TokenClassification(names, ("tokens", "ner_tags")).metrics({"label": labels, "prediction": predicted})
    true = [["B-LOC", "I-LOC", "O", "B-PER", "O", "B-PER"]]
    found = [["B-LOC", "I-LOC", "O", "B-PER", "O", "O"]]
    assert scores["precision"] == pytest.approx(precision_score(true, found)) == 1.0
    assert scores["recall"] == pytest.approx(recall_score(true, found)) == pytest.approx(2 / 3)  # types' mean: 3/4
    assert scores["f1"] == pytest.approx(entity_f1(true, found)) == pytest.approx(0.8)
    assert scores["accuracy"] == pytest.approx(5 / 6)

    plain = TokenClassification(("DET", "NOUN", "VERB"), ("tokens", "upos"))
    labels, predicted = torch.tensor([[0, 1, 2, 1, IGNORE]]), torch.tensor([[0, 1, 1, 1, 2]])
    scores = plain.metrics({"label": labels, "prediction": predicted})
    true, found = ["DET", "NOUN", "VERB", "NOUN"], ["DET", "NOUN", "NOUN", "NOUN"]
    assert scores["accuracy"] == pytest.approx(3 / 4)
    assert scores["f1"] == pytest.approx(f1_score(true, found, average="macro")) == pytest.approx(0.6)


def test_evaluate_py_scores_the_sub_tokens_the_run_labelled(tmp_path):
    """evaluate.py rebuilds the task from the run's record: a tagger trained with --label_all_tokens is scored on
    every sub-token, as its training run's evaluation was, and one trained without it on first sub-tokens only."""
    from transformers import BertConfig

    names = ("B-LOC", "I-LOC", "O")
    BertConfig(id2label=dict(enumerate(names))).save_pretrained(tmp_path)
    for every in (False, True):
        task = TokenClassification(names, ("tokens", "ner_tags"), label_all_tokens=every)
        args = flags(trust_remote_code=False, return_entity_level_metrics=None)  # evaluate.py's flags, none given
        assert TokenClassification.from_record(task.record(), args, tmp_path, ["tokens", "ner_tags"]) == task


def test_the_model_cards_pipeline_tags_an_entity_word_by_its_first_sub_token():
    """Trained on first sub-tokens, a word's later ones are untrained: the card's pipeline takes each word's tag from
    its first sub-token ("first"), where "simple" would group the later ones' guesses into entities of their own."""
    usage = TokenClassification(("B-LOC", "I-LOC", "O")).model_card("out", "base", adapter=False)["usage"]
    assert any('aggregation_strategy="first"' in line for line in usage), usage


def test_labels_go_on_the_first_sub_token_of_each_word():
    tokenizer = load_tokenizer(default_model_path())
    data = Dataset.from_list(
        [{"tokens": ["Kowalczyk", "visited", "Antananarivo"], "ner_tags": ["B-PER", "O", "B-LOC"]}]
    )
    names = ("B-LOC", "B-PER", "I-LOC", "I-PER", "O")
    first, every = (TokenClassification(names, ("tokens", "ner_tags"), label_all_tokens=flag) for flag in (0, 1))
    row = first.features(data, tokenizer, 128)[0]
    word_ids = tokenizer(data[0]["tokens"], is_split_into_words=True).word_ids()
    assert len(set(word_ids) - {None}) == 3 and len(word_ids) > 5  # the names split into several sub-tokens
    expected, previous = [], None
    for word in word_ids:
        expected.append(IGNORE if word is None or word == previous else names.index(data[0]["ner_tags"][word]))
        previous = word
    assert row["labels"] == expected
    lower = TokenClassification(tuple(name.lower() for name in names), ("tokens", "ner_tags"))  # a tagger elsewhere
    assert lower.features(data, tokenizer, 128)[0]["labels"] == expected
    # The word numbers (for predictions.csv) stay out of training batches: nothing to collate and copy each step.
    training = first.training_rows(first.features(data, tokenizer, 128), 128).remove_columns(
        ["example_index", "length"]
    )
    batch = first.collator(tokenizer)(list(training))
    assert "word_ids" in row and set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    inside = every.features(data, tokenizer, 128)[0]["labels"]  # later sub-tokens of B-PER become I-PER
    assert [names[i] for i in inside if i != IGNORE] == ["B-PER"] + ["I-PER"] * (word_ids.count(0) - 1) + ["O"] + [
        "B-LOC"] + ["I-LOC"] * (word_ids.count(2) - 1)  # fmt: skip


def test_predictions_csv_has_a_tag_per_word_with_or_without_gold_tags_and_label_all_tokens():
    """Rows hold each word's tag at its first sub-token; --label_all_tokens labels the later ones too (scored, as in
    run_ner), yet a word still gets one tag in predictions.csv."""
    task = TokenClassification(("B-LOC", "I-LOC", "O"), ("tokens", "ner_tags"), label_all_tokens=True)
    data = Dataset.from_list([{"tokens": ["in", "Antananarivo", "now"]}, {"tokens": ["Oslo"]}])
    ignore = IGNORE
    word_ids = torch.tensor([[ignore, 0, 1, 1, 1, 2, ignore], [ignore, 0, ignore, ignore, ignore, ignore, ignore]])
    labels = torch.tensor([[ignore, 2, 0, 1, 1, 2, ignore], [ignore, 0, ignore, ignore, ignore, ignore, ignore]])
    predicted = torch.tensor([[2, 2, 0, 1, 2, 2, 0], [1, 0, 2, 2, 2, 2, 2]])
    columns = {"word_ids": word_ids, "prediction": predicted}
    per_word = ['["O", "B-LOC", "O"]', '["B-LOC"]']
    assert task.prediction_rows(columns, data) == {"words": ['["in", "Antananarivo", "now"]', '["Oslo"]'],
                                                   "prediction": per_word}  # fmt: skip
    rows = task.prediction_rows(columns | {"label": labels}, data)
    assert list(rows) == ["words", "label", "prediction"] and rows["label"] == rows["prediction"] == per_word


def test_a_word_without_a_sub_token_gets_null_in_place_and_tags_keep_their_letters():
    """An empty or invisible word (a zero-width space) has no sub-token: its place holds null, so the later words'
    tags stay beside their words."""
    task = TokenClassification(("NÖUN", "O"), ("tokens", "tags"))
    data = Dataset.from_list([{"tokens": ["Bäume", "\u200b", "wachsen"]}])
    columns = {"word_ids": torch.tensor([[IGNORE, 0, 2, IGNORE]]), "prediction": torch.tensor([[1, 0, 1, 1]])}
    assert task.prediction_rows(columns, data)["prediction"] == ['["NÖUN", null, "O"]']


def test_tags_by_number_a_label_column_and_null_words_or_tags():
    """Tag numbers without names (a Hub dataset saved as JSON) are tags named by their numbers; a `text` column beside
    the one --label_column names is classified, not learnt as text; a null word or tag is one line."""
    numbered = Dataset.from_list([{"tokens": ["New", "York", "is"], "ner_tags": [5, 6, 0]}])
    assert detect_task(numbered)[0] is TokenClassification
    assert TokenClassification.from_data(flags(), numbered).label_names == ("0", "5", "6")
    categorised = Dataset.from_list([{"text": "a film", "category": "film"}])
    assert detect_task(categorised)[0].name == "sequence-classification"  # not text to learn: `text` is not alone
    assert detect_task(categorised, "category")[0].name == "sequence-classification"
    # Word and tag lists beside a sentence's label (ATIS, SNIPS): --label_column intent asks for the sentence's class.
    joint = Dataset.from_list([{"text": "fly to Boston", "tokens": ["fly", "to", "Boston"],
                                "ner_tags": ["O", "O", "B-LOC"], "intent": "flight"}])  # fmt: skip
    assert detect_task(joint)[0] is TokenClassification
    assert detect_task(joint, "intent")[0].name == "sequence-classification"
    tokenizer = load_tokenizer(default_model_path())
    encoded = TokenClassification.from_data(flags(), numbered).features(numbered, tokenizer, 16)[0]
    assert [label for label in encoded["labels"] if label != IGNORE] == [1, 2, 0]  # 5, 6, 0 by their names
    null_tag = [{"tokens": ["a", "b"], "ner_tags": ["O", None]}]
    with pytest.raises(UserError, match=r"row 0 has a null in 'ner_tags' \(its tags\): fill or drop that row"):
        TokenClassification.from_data(flags(), Dataset.from_list(null_tag))
    task = TokenClassification(("O",), ("tokens", "ner_tags"))
    for rows, column in ((null_tag, "ner_tags"), ([{"tokens": None, "ner_tags": ["O"]}], "tokens"),
                         ([{"tokens": ["a", None], "ner_tags": ["O", "O"]}], "tokens")):  # fmt: skip
        with pytest.raises(UserError, match=f"row 0 has a null in '{column}'"):
            task.features(Dataset.from_list(rows), tokenizer, 16)


def test_tags_in_a_csv_in_arrow_large_types_and_a_few_tags_that_are_not_iob(tmp_path, caplog):
    """Validation or evaluation data from a CSV is one line, as training data is; a parquet file's large types in a
    column called `labels` keep the tag ids numbers; a few rows' slips out of IOB are said (entity F1 is lost)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from src.data import load_file

    tokenizer = load_tokenizer(default_model_path())
    task = TokenClassification(("B-LOC", "O"), ("tokens", "labels"))
    (tmp_path / "dev.csv").write_text('tokens,labels\n"in York","O B-LOC"\n')
    with pytest.raises(
        UserError, match=r"column 'tokens' holds Value\('(large_)?string'\), not a list of words per row"
    ):
        task.features(load_file(tmp_path / "dev.csv"), tokenizer, 16)
    large = pa.large_list(pa.large_string())
    table = pa.table({"tokens": pa.array([["in", "York"]], large), "labels": pa.array([["O", "B-LOC"]], large)})
    pq.write_table(table, tmp_path / "dev.parquet")
    assert [
        t for t in task.features(load_file(tmp_path / "dev.parquet"), tokenizer, 16)[0]["labels"] if t != IGNORE
    ] == [1, 0]
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    rows = [{"tokens": ["a", "b", "c"], "ner_tags": ["B-LOC", "I-LOC", "O"]}, {"tokens": ["d"], "ner_tags": ["b-loc"]}]
    with caplog.at_level("WARNING"):
        TokenClassification.from_data(flags(), Dataset.from_list(rows))
    assert "'ner_tags' holds IOB entity tags and 'b-loc', which are not: scored per word" in caplog.text
    caplog.clear()
    bioes = [{"tokens": ["a", "b", "c", "d"], "ner_tags": ["B-LOC", "I-LOC", "E-LOC", "O"]},
             {"tokens": ["e"], "ner_tags": ["S-LOC"]}]  # fmt: skip
    with caplog.at_level("WARNING"):
        TokenClassification.from_data(flags(), Dataset.from_list(bioes))  # another scheme, not a slip
    assert "which are not" not in caplog.text
    # An unlabelled file written with null tags: predictions only, as without the column.
    unlabelled = Dataset.from_dict({"tokens": [["in", "York"]], "labels": [None]})
    assert "labels" not in task.features(unlabelled, tokenizer, 16).column_names


def test_entity_level_metrics_of_tags_that_are_not_iob_are_refused():
    data = Dataset.from_list([{"tokens": ["I", "ran"], "upos": ["PRON", "VERB"]}])
    with pytest.raises(UserError, match=r"--return_entity_level_metrics scores entities of IOB tags .* \(PRON, VERB"):
        TokenClassification.from_data(flags(return_entity_level_metrics=True), data)
    plain = TokenClassification(("PRON", "VERB"), ("tokens", "upos"), return_entity_level_metrics=True)
    scores = plain.metrics({"label": torch.tensor([[IGNORE, 0, 1]]), "prediction": torch.tensor([[0, 0, 0]])})
    assert set(scores) == {"accuracy", "f1"}, "a record from before the refusal gets the plain tags' metrics"


def test_words_cut_off_by_max_length_or_empty_are_counted_apart(caplog, tiny_decoders):
    tokenizer = load_tokenizer(default_model_path())
    data = Dataset.from_list([{"tokens": ["a"] * 20, "ner_tags": ["O"] * 20}, {"tokens": ["b"], "ner_tags": ["O"]},
                              {"tokens": ["c", "", "d"], "ner_tags": ["O", "B-X", "B-X"]}])  # fmt: skip
    task = TokenClassification(("B-X", "O"), ("tokens", "ner_tags"))
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("WARNING"):
        rows = task.features(data, tokenizer, 8)  # [CLS] + 6 words + [SEP]
    assert "14 word(s) in 1 of 3 examples do not fit in --max_length 8 sub-tokens" in caplog.text
    assert "1 word(s) in 1 of 3 examples give no sub-token (empty or invisible text)" in caplog.text
    assert rows[2]["word_ids"] == [IGNORE, 0, 2, IGNORE] and rows[2]["labels"] == [IGNORE, 1, 0, IGNORE]
    # So with a byte-level tokenizer whose words get a space before them: the empty word gets none (" " is a token).
    caplog.clear()
    with caplog.at_level("WARNING"):
        rows = task.features(data, load_tokenizer(str(tiny_decoders["qwen2"])), 8)
    assert "1 word(s) in 1 of 3 examples give no sub-token (empty or invisible text)" in caplog.text
    assert 1 not in rows[2]["word_ids"]


def test_a_task_that_does_not_fit_the_data_is_one_line(tmp_path, tiny_model):
    train = jsonl_rows(UNER / "train.jsonl", 20, tmp_path)
    with pytest.raises(UserError, match="text column 'tokens' holds lists of words: that is token classification"):
        forced = ["--task", "sequence-classification", "--text_column", "tokens", "--label_column", "ner_tags"]
        run_in_process("train", [*train_args(tiny_model, train, train, tmp_path / "o"), *forced])
    sentences = tmp_path / "s.csv"
    sentences.write_text("text,label\nhello,a\nbye,b\n")
    with pytest.raises(UserError, match="token classification needs a column of word lists .* text \\(Value"):
        run_in_process("train", [*train_args(tiny_model, sentences, sentences, tmp_path / "p"), "--task",
                                 "token-classification"])  # fmt: skip
    # A column name that the data does not have is named, whichever task the other columns suggest.
    with pytest.raises(UserError, match="--text_column 'words' is not in the data; its columns are: tokens, ner_tags"):
        run_in_process("train", [*train_args(tiny_model, train, train, tmp_path / "q"), "--text_column", "words"])
    apart = types.SimpleNamespace(model_name_or_path=str(tiny_model), trust_remote_code=False)
    with pytest.raises(UserError, match=f"--tokenizer_name {tmp_path / 'none'}: cannot load a tokenizer"):
        TokenClassification(("O",), ("tokens", "ner_tags")).load_tokenizer(str(tmp_path / "none"), apart)


def test_a_flag_of_another_task_than_the_one_found_is_refused(tmp_path, tiny_model):
    """--task auto accepts every listed task's flags; the one the data picks must not silently ignore another's."""
    train = jsonl_rows(UNER / "train.jsonl", 20, tmp_path)
    sentences = tmp_path / "s.csv"
    sentences.write_text("text,label\nhello,a\nbye,b\n")
    for data, flag, owner, found in [(train, ["--class_weights", "balanced"], "sequence-classification",
                                      "token-classification"),
                                     (sentences, ["--packing"], "causal-lm", "sequence-classification")]:  # fmt: skip
        with pytest.raises(UserError, match=f"{flag[0]} is a flag of the {owner} task, and --task auto found {found}"):
            run_in_process("train", [*train_args(tiny_model, data, data, tmp_path / "o"), *flag])
        assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("ner")
    train, dev = jsonl_rows(UNER / "train.jsonl", 64, folder), jsonl_rows(UNER / "validation.jsonl", 29, folder)
    results = run_in_process("train", train_args(tiny_model, train, dev, folder / "out", "--num_train_epochs", "1",
                                                 "--return_entity_level_metrics", "--max_length", "24",
                                                 "--metric_for_best_model", "eval_LOC_f1"))  # fmt: skip
    return {"results": results, "dev": dev, "out": folder / "out"}


def test_ner_reports_entity_level_metrics_and_evaluate_py_reproduces_them(ner_run, tmp_path):
    results, record = ner_run["results"], json.loads((ner_run["out"] / "args.json").read_text())
    assert record["task"] == "token-classification" and record["text_column"] == "tokens"
    for key in ("eval_precision", "eval_recall", "eval_f1", "eval_accuracy", "eval_loss", "eval_LOC_f1"):
        assert key in results, key
    for key in ("precision", "recall", "f1", "accuracy"):  # run_ner_no_trainer.py's names for them, with this flag
        assert results[f"eval_overall_{key}"] == results[f"eval_{key}"], key
    types = {name[2:] for name in json.loads((ner_run["out"] / "config.json").read_text())["label2id"] if name != "O"}
    assert {key for key in results if key.endswith("_number")} == {f"eval_{kind}_number" for kind in types}, (
        "every entity type of the labels is reported, also one that the validation rows lack"
    )
    assert record["metric_for_best_model"] == "LOC_f1", "a per-entity metric can pick the best model"
    assert results["eval_samples"] == 29
    evaluate = load_script("evaluate")
    argv = ["--model_name_or_path", str(ner_run["out"]), "--validation_file", str(ner_run["dev"]), "--output_dir",
            str(tmp_path), "--mixed_precision", "no", "--per_device_eval_batch_size", "8"]  # fmt: skip
    metrics = evaluate.main(evaluate.parse_eval_args(argv))
    for key in ("eval_precision", "eval_recall", "eval_f1", "eval_accuracy", "eval_samples", "eval_LOC_f1"):
        assert metrics[key] == results[key], key
    plain = [*argv[:5], str(tmp_path / "plain"), *argv[6:], "--no-return_entity_level_metrics"]  # evaluate.py's flag
    assert "eval_LOC_f1" not in evaluate.main(evaluate.parse_eval_args(plain)), "the flag wins over the run's record"
    rows = list(csv.DictReader((tmp_path / "predictions.csv").open()))
    sentences = [json.loads(line) for line in ner_run["dev"].read_text().splitlines()]
    assert list(rows[0]) == ["index", "words", "label", "prediction"] and len(rows) == 29
    for row, sentence in zip(rows, sentences):  # in data order; a tag per word (null past --max_length)
        assert json.loads(row["words"]) == sentence["tokens"]
        tags, predicted = json.loads(row["label"]), json.loads(row["prediction"])
        within = len(tags) - tags.count(None)
        assert len(tags) == len(predicted) == len(sentence["tokens"]) and within > 0
        assert tags[:within] == sentence["ner_tags"][:within]
        assert tags[within:] == predicted[within:] == [None] * (len(tags) - within)  # the words cut off
    # New text, words alone: the same tag per word as above, and no label column.
    words_only = tmp_path / "words.jsonl"
    words_only.write_text("".join(json.dumps({"tokens": sentence["tokens"]}) + "\n" for sentence in sentences))
    argv[argv.index("--validation_file") + 1], argv[argv.index("--output_dir") + 1] = (
        str(words_only),
        str(tmp_path / "new"),
    )
    assert evaluate.main(evaluate.parse_eval_args(argv)) == {"eval_samples": 29}
    tagged = list(csv.DictReader((tmp_path / "new" / "predictions.csv").open()))
    assert list(tagged[0]) == ["index", "words", "prediction"]
    assert [row["prediction"] for row in tagged] == [row["prediction"] for row in rows]
    printed = run_model_card_snippet(ner_run["out"])  # the pipeline on "Your text here": entities found, or none
    assert printed.startswith("[") and ("entity_group" in printed or printed.strip() == "[]"), printed


def test_a_loss_of_your_own_is_one_method():
    """The tagger's step() takes each sub-token's loss from losses(): another loss (label smoothing, say) overrides
    that alone, and training and evaluation both use it."""

    class Smoothed(TokenClassification):
        def losses(self, logits, labels):
            return torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, ignore_index=IGNORE, label_smoothing=0.1, reduction="none"
            )

    logits, labels = torch.randn(2, 4, 3), torch.tensor([[IGNORE, 0, 2, IGNORE], [IGNORE, 1, IGNORE, IGNORE]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    step = Smoothed(("B-X", "I-X", "O")).step(lambda **_: {"logits": logits}, dict(batch))
    smoothed = torch.nn.functional.cross_entropy(
        logits[labels != IGNORE], labels[labels != IGNORE], label_smoothing=0.1
    )
    assert step.units == 3 and step.loss == pytest.approx(3 * smoothed.item(), rel=1e-6)


def test_the_units_counted_before_a_step_are_the_label_tokens_it_sums_over():
    """The loop divides each batch's summed loss by the whole step's units on all ranks, counted by units() before the
    forward pass: the labelled sub-tokens, as step() counts them, not the padding or the ignored positions."""
    logits, labels = torch.randn(2, 4, 3), torch.tensor([[IGNORE, 0, 2, IGNORE], [IGNORE, 1, IGNORE, IGNORE]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    task = TokenClassification(("B-X", "I-X", "O"))
    units = task.units(batch)
    assert units == task.step(lambda **_: {"logits": logits}, dict(batch)).units == 3


def test_a_tagger_of_your_own_reads_its_tags_from_its_own_files(tmp_path):
    """A task built on TokenClassification whose model is not a Transformers model (no config.json) says where its
    tags are saved: evaluate.py's from_record reads them through trained_labels(), as for sequence classification."""

    class OwnTagger(TokenClassification):
        @staticmethod
        def trained_labels(model_dir, args):
            return json.loads((model_dir / "tags.json").read_text())

    (tmp_path / "tags.json").write_text(json.dumps(["B-X", "I-X", "O"]))
    record = {"text_column": "tokens", "label_column": "ner_tags"}
    task = OwnTagger.from_record(record, flags(trust_remote_code=False), tmp_path, ["tokens", "ner_tags"])
    assert task.label_names == ("B-X", "I-X", "O") and task.columns == ("tokens", "ner_tags")


def test_evaluating_data_without_the_word_column_names_the_flags(ner_run):
    record = json.loads((ner_run["out"] / "args.json").read_text())
    with pytest.raises(
        UserError, match=r"no column 'tokens' of words \(its columns: words, ner\): name it with --text"
    ):
        TokenClassification.from_record(record, flags(trust_remote_code=False), ner_run["out"], ["words", "ner"])


def test_three_ranks_gather_every_example_once_as_one_rank_does(ner_run, tmp_path):
    """29 examples on 3 ranks with batches of 4: an uneven last batch, and ranks whose outputs have other lengths."""
    argv = ["--model_name_or_path", str(ner_run["out"]), "--validation_file", str(ner_run["dev"]),
            "--mixed_precision", "no", "--per_device_eval_batch_size", "4"]  # fmt: skip
    run_in_process("evaluate", [*argv, "--output_dir", str(tmp_path / "one")])
    result = launch("evaluate.py", [*argv, "--output_dir", str(tmp_path / "three")], num_processes=3)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("eval_results.json", "predictions.csv"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "three" / name).read_text(), name


def test_plain_tags_are_scored_per_word(tmp_path, tiny_model):
    """Also: the tags are those of the whole training file, as in transformers' run_ner.py, not only of the rows
    that --max_train_samples keeps (UD's INTJ first appears after the 48th row)."""
    train = jsonl_rows(UD / "train.jsonl", 200, tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    interjection = next(row for row in rows[48:] if "INTJ" in row["upos"])
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps(row) + "\n" for row in [*rows[:16], interjection]))
    argv = train_args(tiny_model, train, dev, tmp_path / "out", "--num_train_epochs", "1", "--max_train_samples", "48")
    results = run_in_process("train", argv)
    assert {"eval_accuracy", "eval_f1"} <= set(results) and "eval_precision" not in results
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert sorted(config["label2id"]) == sorted({tag for row in rows for tag in row["upos"]})
    assert results["eval_samples"] == 17
    record = json.loads((tmp_path / "out" / "args.json").read_text())
    assert record["metric_for_best_model"] == "accuracy" and record["label_column"] == "upos"
    assert record["max_length"] == 64  # the task's default of 128, capped by the tiny model's 64 positions
    # The card's pipeline tags each sub-token: neighbouring words of one tag are not grouped as an entity would be.
    printed = run_model_card_snippet(tmp_path / "out")
    assert "'entity': " in printed and "entity_group" not in printed, printed


def test_lora_trains_the_tagging_head_in_full_and_evaluate_py_reproduces_it(tiny_decoders, tmp_path):
    train, dev = jsonl_rows(UNER / "train.jsonl", 32, tmp_path), jsonl_rows(UNER / "validation.jsonl", 13, tmp_path)
    lora = ["--use_peft", "--lora_target_modules", "q_proj,v_proj", "--num_train_epochs", "1"]
    results = run_in_process("train", train_args(tiny_decoders["llama"], train, dev, tmp_path / "out", *lora))
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["task_type"] == "TOKEN_CLS" and "score" in saved["modules_to_save"]  # the head, in full
    argv = ["--model_name_or_path", str(tmp_path / "out"), "--validation_file", str(dev), "--output_dir",
            str(tmp_path / "eval"), "--mixed_precision", "no", "--per_device_eval_batch_size", "8"]  # fmt: skip
    metrics = run_in_process("evaluate", argv)
    for key in ("eval_f1", "eval_accuracy", "eval_samples"):
        assert metrics[key] == results[key], key
    assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], rel=1e-6)


def test_byte_level_tokenizers_read_words_with_a_leading_space(tiny_decoders, tmp_path):
    """GPT-2 and RoBERTa read a word after a space otherwise than at the start of a text: words given one by one need
    add_prefix_space (transformers #9607), which the task turns on when the tokenizer has it off."""
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_decoders["gpt2"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    plain = load_tokenizer(str(folder))
    task = TokenClassification(("O",), ("tokens", "ner_tags"))
    tokenizer = task.load_tokenizer(str(folder), types.SimpleNamespace(trust_remote_code=False))
    for loaded, spaces in ((plain, 0), (tokenizer, 2)):  # "Ġ": the space before a word
        tokens = loaded.convert_ids_to_tokens(loaded(["York", "York"], is_split_into_words=True)["input_ids"])
        assert tokens.count("Ġ") == spaces, tokens
    # As they load here (a TokenizersBackend, Qwen2's class), add_prefix_space changes nothing: the words get their
    # spaces in the text. Either way a row's words are the sub-tokens of the same running text, as a pipeline sees it.
    words = Dataset.from_list([{"tokens": ["the", "movie", "was", "good"], "ner_tags": ["O"] * 4}])
    for source in (folder, tiny_decoders["gpt2"], tiny_decoders["qwen2"], tiny_decoders["llama"]):
        loaded = task.load_tokenizer(str(source), types.SimpleNamespace(trust_remote_code=False))
        assert task.features(words, loaded, 32)["input_ids"][0] == loaded("the movie was good")["input_ids"], source


def test_a_step_weighs_every_label_token_alike_however_it_is_split(tiny_model_no_dropout, tmp_path):
    """Sentences have different numbers of tagged sub-tokens, so 1 batch of 8, 2 batches of 4 accumulated and batches
    of 4 on 2 real ranks give the same update only when each batch's summed loss is divided by the whole step's tokens
    on all ranks (a mean per batch, or per rank, weighs the tokens of a short batch more). The same 8 sentences make
    each step every way (the sampler deals by optimizer step)."""
    train, dev = jsonl_rows(UNER / "train.jsonl", 32, tmp_path), jsonl_rows(UNER / "validation.jsonl", 8, tmp_path)
    weights = {}
    for name, (size, steps, ranks) in {
        "one": ("8", "1", 1),
        "accumulated": ("4", "2", 1),
        "ranks": ("4", "1", 2),
    }.items():
        batches = ["--per_device_train_batch_size", size, "--gradient_accumulation_steps", steps]
        argv = train_args(tiny_model_no_dropout, train, dev, tmp_path / name, *batches, "--num_train_epochs", "1")
        if ranks == 1:
            run_in_process("train", argv)
        else:
            result = launch("train.py", argv, num_processes=ranks)
            assert result.returncode == 0, result.stderr[-3000:]
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    for name in ("accumulated", "ranks"):
        worst = max((weights["one"][k] - weights[name][k]).abs().max().item() for k in weights["one"])
        assert worst < WEIGHTS_ATOL, f"{name}: weights differ by up to {worst}"


def test_a_row_with_more_words_than_tags_is_one_line(tmp_path):
    tokenizer = load_tokenizer(default_model_path())
    data = Dataset.from_list([{"tokens": ["New", "York"], "ner_tags": ["B-LOC", "I-LOC"]},
                              {"tokens": ["in", "Paris"], "ner_tags": ["O"]}])  # fmt: skip
    task = TokenClassification(("B-LOC", "I-LOC", "O"), ("tokens", "ner_tags"))
    with pytest.raises(UserError, match="row 1 has 2 words in 'tokens' and 1 tags in 'ner_tags'"):
        task.features(data, tokenizer, 32)


def test_a_lora_tagger_loads_as_its_model_card_says(tiny_model, tmp_path):
    """The card of a LoRA output folder (adapter and head, no whole model) loads it on its base, with its tags."""
    train_file, dev = jsonl_rows(UNER / "train.jsonl", 16, tmp_path), jsonl_rows(UNER / "validation.jsonl", 4, tmp_path)
    out = tmp_path / "out"
    run_in_process("train", train_args(tiny_model, train_file, dev, out, "--use_peft", "--max_train_steps", "1"))
    code = (out / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    loaded = {}
    exec(code, loaded)
    model, tokenizer = loaded["model"], loaded["tokenizer"]
    assert type(model).__name__ == "PeftModelForTokenClassification"
    tags = json.loads((out / "config.json").read_text())["id2label"]
    logits = model(**tokenizer(["in", "New", "York"], is_split_into_words=True, return_tensors="pt")).logits
    assert logits.shape[-1] == len(tags) > 2


def test_evaluate_py_reads_a_tagger_or_a_causal_lm_trained_elsewhere_by_its_class(tiny_model, tiny_decoders, tmp_path):
    """Without args.json the model's class says its task: a tagger was read as a classifier ('no text column')."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    names = ("B-LOC", "I-LOC", "O")
    tagger = AutoModelForTokenClassification.from_pretrained(
        tiny_model, id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
        ignore_mismatched_sizes=True,
    )  # fmt: skip
    tagger.save_pretrained(tmp_path / "tagger")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "tagger")
    tagged = tmp_path / "tagged.jsonl"
    tagged.write_text(json.dumps({"tokens": ["in", "New", "York"], "ner_tags": ["O", "B-LOC", "I-LOC"]}) + "\n")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"prompt": "a film", "completion": "was good"}) + "\n")
    # A LoRA folder of peft's (or TRL's) names its task type: it has no config of its own to say it.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(tiny_decoders["llama"])
    get_peft_model(llama, LoraConfig(task_type="CAUSAL_LM")).save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_decoders["llama"]).save_pretrained(tmp_path / "adapter")
    for model, data, metric in [
        (tmp_path / "tagger", tagged, "eval_f1"),
        (tiny_decoders["llama"], texts, "eval_perplexity"),
        (tmp_path / "adapter", texts, "eval_perplexity"),
    ]:
        argv = ["--model_name_or_path", str(model), "--validation_file", str(data), "--output_dir",
                str(tmp_path / "out"), "--mixed_precision", "no"]  # fmt: skip
        assert metric in run_in_process("evaluate", argv)
