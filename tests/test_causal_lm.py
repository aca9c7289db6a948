"""Causal-LM fine-tuning through the task interface: which tokens are learnt in each format (text, prompt/completion,
chat) and with which options, EOS kept though it pads, the formats found from the data, a new model from a config, an
encoder made a decoder, and a LoRA run that evaluate.py reproduces."""

import hashlib
import json
import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import PartialState
from conftest import (
    REPO,
    SHARED_DATA,
    WEIGHTS_ATOL,
    launch,
    read_shared,
    run_in_process,
    run_model_card_snippet,
    train_args,
    write_rows,
)
from datasets import Dataset

from src.data import check_column_flags, detect_columns
from src.errors import UserError
from src.model import default_model_path, load_tokenizer
from src.plan import best_metric, learning_rate
from src.tasks import detect_task
from src.tasks.base import token_cross_entropy
from src.tasks.causal_lm import CHAT, IGNORE, PROMPT_COMPLETION, TEXT, CausalLM, _messages

SFT = SHARED_DATA / "alpaca_eval_sft"
CHAT_TEMPLATE = str(REPO / "examples" / "chat_template.jinja")
MESSAGES = [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "was good"},
            {"role": "user", "content": "and the acting"}, {"role": "assistant", "content": "was bad"}]  # fmt: skip


def options(**given):
    """The causal-LM flags as parsed, with their defaults."""
    flags = {
        "completion_only_loss": True,
        "assistant_only_loss": False,
        "packing": False,
        "chat_template_path": None,
        "text_column": None,
    }
    return types.SimpleNamespace(trust_remote_code=False, **(flags | given))


def chat_task(tokenizer, **given):
    task = CausalLM.from_data(options(**given), Dataset.from_list([{"messages": MESSAGES}]))
    return task, task.load_tokenizer(str(tokenizer.name_or_path), options(**given))


@pytest.fixture(scope="module")
def tokenizer(tiny_decoders):
    """The tiny Llama's: no padding token of its own, so it pads with EOS, as Llama's does."""
    loaded = load_tokenizer(str(tiny_decoders["llama"]))
    assert loaded.pad_token_id == loaded.eos_token_id
    return loaded


def learnt(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE])


def test_text_column_names_the_text_and_each_text_ends_with_one_eos(tokenizer, caplog):
    """TRL's dataset_text_field is --text_column here. A tokenizer that ends every text with its EOS already (BERT's
    [SEP], the docs' tokenizer for a new model) gets no second one."""
    data = Dataset.from_list(
        [{"body": "the plot was good", "id": 1}, {"body": "", "id": 2}, {"body": "the acting", "id": 3}]
    )
    task = CausalLM.from_data(options(text_column="body"), data)
    assert (task.format, task.text_column, task.record()["text_column"]) == (TEXT, "body", "body")
    blocks = task.features(data, tokenizer, 64)
    expected = [*tokenizer("the plot was good")["input_ids"], tokenizer.eos_token_id,
                *tokenizer("the acting")["input_ids"], tokenizer.eos_token_id]  # fmt: skip
    assert blocks["input_ids"] == [expected]
    assert CausalLM.from_record(task.record(), options(), None, ["body"]) == task, "evaluate.py reads the same column"
    PartialState(cpu=True)  # accelerate's logger, which says it on the main process only
    with caplog.at_level("WARNING"):  # data without it: found as train.py does, and said
        chat = CausalLM.from_record(task.record(), options(), None, ["messages"])
    assert (chat.format, chat.text_column) == (
        CHAT,
        "text",
    ) and "trained on text rows and this data is chat" in caplog.text
    with pytest.raises(UserError, match=r"text column 'id' holds Value\('int64'\), not text: name a column of str"):
        CausalLM.from_data(options(text_column="id"), data).features(data, tokenizer, 64)
    with pytest.raises(UserError, match=r"--text_column 'title' is not in the data; its columns are: body"):
        check_column_flags(options(text_column="title"), ["body"])

    bert = CausalLM(TEXT).load_tokenizer(default_model_path(), options())
    ids = task.features(data.select([0]), bert, 64)["input_ids"][0]
    assert ids[-1] == bert.eos_token_id and ids.count(bert.eos_token_id) == 1, bert.convert_ids_to_tokens(ids)


def test_prompt_completion_learns_the_completion_and_its_eos_only(tokenizer):
    data = Dataset.from_list([{"prompt": "the plot was good", "completion": "yes it was"},
                              {"prompt": "the acting", "completion": "no"}])  # fmt: skip
    features = CausalLM(PROMPT_COMPLETION).features(data, tokenizer, 64)
    row = features[0]
    prompt = len(tokenizer("the plot was good")["input_ids"])
    assert row["labels"][:prompt] == [IGNORE] * prompt
    assert row["labels"][prompt:] == row["input_ids"][prompt:] and row["input_ids"][-1] == tokenizer.eos_token_id
    collator = CausalLM(PROMPT_COMPLETION).collator(tokenizer)
    batch = collator([{k: r[k] for k in ("input_ids", "attention_mask", "labels")} for r in features])
    short = batch["labels"][1].tolist()
    # The short example's EOS is learnt, though the padding after it is the same token: labels are padded by place.
    assert short[len(features[1]["labels"]) - 1] == tokenizer.eos_token_id
    assert short[len(features[1]["labels"]) :] == [IGNORE] * (len(short) - len(features[1]["labels"]))


def test_chat_learns_every_token_or_with_assistant_only_loss_the_assistant_turns_and_their_eos(tokenizer):
    task, chat_tokenizer = chat_task(tokenizer, chat_template_path=CHAT_TEMPLATE)
    row = task.features(Dataset.from_list([{"messages": MESSAGES}]), chat_tokenizer, 256)[0]
    assert row["labels"] == row["input_ids"]  # TRL's default for chat rows
    task, chat_tokenizer = chat_task(tokenizer, chat_template_path=CHAT_TEMPLATE, assistant_only_loss=True)
    row = task.features(Dataset.from_list([{"messages": MESSAGES}]), chat_tokenizer, 256)[0]
    eos = chat_tokenizer.eos_token
    assert learnt(chat_tokenizer, row["input_ids"], row["labels"]).split() == f"was good {eos} was bad {eos}".split()
    sharegpt = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in MESSAGES]
    again = task.features(Dataset.from_list([{"conversations": sharegpt}]), chat_tokenizer, 256)[0]
    assert again["labels"] == row["labels"]
    # OpenAI's lists of content parts, and ShareGPT's role names in `messages` rows, are the same conversation.
    parts = [{"role": {"user": "human", "assistant": "bot"}[m["role"]],
              "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]  # fmt: skip
    assert task.features(Dataset.from_list([{"messages": parts}]), chat_tokenizer, 256)[0]["labels"] == row["labels"]
    for rows, says in [([{"messages": []}], "must list turns"),
                       ([{"messages": [{"role": "user", "content": None}]}], "content is None, not text")]:  # fmt: skip
        with pytest.raises(UserError, match=says):
            task.features(Dataset.from_list(rows), chat_tokenizer, 256)
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert _messages({"messages": [{"role": "user", "content": "hi"}, call]})[1] == call  # a tool call has no text
    with pytest.raises(UserError, match="prompt is None, not text"):
        CausalLM(PROMPT_COMPLETION).features(Dataset.from_list([{"prompt": None, "completion": "yes"}]), tokenizer, 8)


def test_without_completion_only_loss_the_prompt_is_learnt_too(tokenizer):
    data = Dataset.from_list([{"prompt": "the plot was good", "completion": "yes it was"}])
    task = CausalLM.from_data(options(completion_only_loss=False), data)
    row = task.features(data, tokenizer, 64)[0]
    assert row["labels"] == row["input_ids"] and row["input_ids"][-1] == tokenizer.eos_token_id
    assert task.record()["completion_only_loss"] is False  # evaluate.py and resume learn the same tokens
    assert CausalLM.from_record(task.record(), options(), None, ["prompt", "completion"]) == task, "evaluate.py's"


def test_perplexity_token_accuracy_and_each_rows_loss_are_per_predicted_token():
    """Examples of 1 and 3 predicted tokens: perplexity is exp of the loss per token over the whole split (eval_loss),
    the token accuracy a ratio of token counts, and predictions.csv's loss each row's mean per token; means over
    examples would weigh a short example's tokens more."""
    columns = {"loss": torch.tensor([2.0, 1.5]), "units": torch.tensor([1, 3]), "correct": torch.tensor([0, 3])}
    task = CausalLM(PROMPT_COMPLETION)
    metrics = task.metrics(columns)
    assert metrics["perplexity"] == pytest.approx(math.exp(3.5 / 4))
    assert metrics["mean_token_accuracy"] == pytest.approx(3 / 4)
    assert task.prediction_rows(columns, None) == {"tokens": [1, 3], "loss": ["2.000000", "0.500000"]}


def test_text_is_cut_into_blocks_and_nothing_is_dropped(tokenizer):
    texts = ["the plot was good"] * 7 + ["", "the acting was bad"]
    rows = CausalLM(TEXT).features(Dataset.from_list([{"text": t} for t in texts]), tokenizer, 8)
    lengths = [len(r["input_ids"]) for r in rows]
    expected = sum(len(tokenizer(t)["input_ids"]) + 1 for t in texts if t)  # each text's tokens and its EOS
    assert sum(lengths) == expected and set(lengths[:-1]) == {8} and 0 < lengths[-1] <= 8
    assert all(r["labels"] == r["input_ids"] for r in rows)
    with pytest.raises(UserError, match="all 3 rows of text column 'text' are empty or blank: nothing to learn"):
        CausalLM(TEXT).features(Dataset.from_list([{"text": t} for t in ("", "  ", "\r")]), tokenizer, 8)


def test_the_task_has_its_own_defaults_where_a_classifiers_do_not_fit():
    assert (CausalLM.default_max_length, CausalLM.default_learning_rate) == (1024, 2e-5)
    assert learning_rate(types.SimpleNamespace(learning_rate=None), CausalLM(TEXT)) == 2e-5
    assert learning_rate(types.SimpleNamespace(learning_rate=3e-4), CausalLM(TEXT)) == 3e-4  # the flag wins
    choice = types.SimpleNamespace(metric_for_best_model="perplexity", greater_is_better=None)
    assert best_metric(choice, CausalLM(TEXT)) == ("perplexity", False)  # the lowest perplexity is the best


def test_the_format_is_found_from_the_columns():
    for row, fmt in [({"messages": [{"role": "user", "content": "hi"}]}, CHAT),
                     ({"conversations": [{"from": "human", "value": "hi"}]}, CHAT),
                     ({"prompt": "a", "completion": "b"}, PROMPT_COMPLETION), ({"text": "a"}, TEXT)]:  # fmt: skip
        cls, _ = detect_task(Dataset.from_list([row]))
        assert cls is CausalLM and CausalLM.from_data(options(), Dataset.from_list([row])).format == fmt
    assert detect_task(Dataset.from_list([{"text": "a", "label": 1}]))[0].name == "sequence-classification"
    # Beside other columns `text` may be a classifier's, with a label column of another name: the classifier's
    # error then asks for --label_column (or --task causal-lm), rather than a language model being trained.
    scored = Dataset.from_list([{"text": "a", "score": 0.5}])
    assert detect_task(scored)[0].name == "sequence-classification"
    with pytest.raises(UserError, match="no label column found .* --label_column .* --task causal-lm"):
        detect_columns(scored.column_names)  # what the classifier reads its columns with
    assert CausalLM.from_data(options(), scored).format == TEXT  # --task causal-lm: the text, as asked
    labelled = Dataset.from_list([{"text": "a", "label": 1}])  # as the docs say: any `text` with --task causal-lm
    assert CausalLM.from_data(options(), labelled).format == TEXT
    with pytest.raises(UserError, match="the columns are sentence, label"):
        CausalLM.from_data(options(), Dataset.from_list([{"sentence": "a", "label": 1}]))
    # TRL's conversational prompt-completion: prompt and completion as turns, to be written as one chat instead.
    turns = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}
    with pytest.raises(UserError, match="hold messages .* write each row as one `messages` list"):
        CausalLM.from_data(options(), Dataset.from_list([turns]))


@pytest.fixture(scope="module")
def chat_lora_run(tiny_decoders, tmp_path_factory) -> dict:
    """LoRA on the tiny Llama, learning the assistant's turns of 24 real conversations; 9 to validate."""
    folder = tmp_path_factory.mktemp("chat-lora")
    train, dev = folder / "train.jsonl", folder / "dev.jsonl"
    train.write_text("\n".join(read_shared(SFT / "train_messages.jsonl").splitlines()[:24]) + "\n")
    dev.write_text("\n".join(read_shared(SFT / "validation_messages.jsonl").splitlines()[:9]) + "\n")
    flags = ["--use_peft", "--num_train_epochs", "1", "--max_length", "64", "--assistant_only_loss",
             "--chat_template_path", CHAT_TEMPLATE]  # fmt: skip
    results = run_in_process("train", train_args(tiny_decoders["llama"], train, dev, folder / "out", *flags))
    return {"out": folder / "out", "dev": dev, "results": results, "base": tiny_decoders["llama"]}


def test_lora_sft_on_chat_rows_and_evaluate_py_reproduces_it(chat_lora_run, tmp_path):
    out, dev, results = chat_lora_run["out"], chat_lora_run["dev"], chat_lora_run["results"]
    record = json.loads((out / "args.json").read_text())
    assert record["task"] == "causal-lm" and record["format"] == CHAT and record["metric_for_best_model"] == "loss"
    assert record["assistant_only_loss"] is True
    assert record["chat_template_sha256"] == hashlib.sha256(Path(CHAT_TEMPLATE).read_bytes()).hexdigest()
    assert record["learning_rate"] == 1e-3 and record["max_length"] == 64  # as given (train_args), in the record
    assert {"eval_loss", "eval_perplexity", "eval_mean_token_accuracy", "train_loss"} <= set(results)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM" and not adapter["modules_to_save"]  # the LM head is not retrained
    assert "{% generation %}" in load_tokenizer(str(out)).chat_template  # --chat_template_path's, saved with it
    argv = ["--model_name_or_path", str(out), "--validation_file", str(dev), "--output_dir",
            str(tmp_path / "eval"), "--mixed_precision", "no", "--per_device_eval_batch_size", "8"]  # fmt: skip
    metrics = run_in_process("evaluate", argv)
    assert metrics["eval_samples"] == results["eval_samples"] == 9
    assert metrics["eval_mean_token_accuracy"] == results["eval_mean_token_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], rel=1e-6)
    assert metrics["perplexity"] == metrics["eval_perplexity"], "where run_clm.py's eval_results.json has it"
    assert json.loads((tmp_path / "eval" / "eval_results.json").read_text())["perplexity"] == pytest.approx(
        metrics["perplexity"], rel=1e-5
    )
    # The adapter on its base, prompted through the template saved with it: "<s><|user|>\nHello</s>\n<|assistant|>\n"
    # (the tokenizer's BOS first; the markers and "Hello" are <unk> to the tiny vocabulary), then an answer.
    words = run_model_card_snippet(out).split()
    assert words[:9] == ["<s>"] + ["<unk>"] * 4 + ["</s>"] + ["<unk>"] * 3 and len(words) > 9, words


def test_a_causal_lm_adapters_folder_is_no_model_to_start_a_run_from(chat_lora_run, tmp_path):
    """It has no config.json (see save_model): its config, not its weights, is what fails to load."""
    out, dev = chat_lora_run["out"], chat_lora_run["dev"]
    with pytest.raises(UserError, match=f"--model_name_or_path {out} holds a LoRA adapter, not a whole model"):
        run_in_process("train", train_args(out, dev, dev, tmp_path / "next"))


def test_a_lora_folder_loads_with_plain_auto_model_for_causal_lm_as_trls_do(chat_lora_run):
    """TRL users load an SFT adapter with `AutoModelForCausalLM.from_pretrained(folder)`: transformers then builds the
    base and puts the adapter on it, unless the folder holds a config.json, which it takes for a whole model."""
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = chat_lora_run["out"]
    assert not (out / "config.json").exists()
    plain, peft = AutoModelForCausalLM.from_pretrained(out), AutoPeftModelForCausalLM.from_pretrained(out)
    assert plain.active_adapters() == ["default"]
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, peft(ids).logits)


def test_a_resume_keeps_the_task_s_settings_and_compares_the_template_by_its_text(chat_lora_run, tmp_path):
    """What the task records (src/tasks/causal_lm.py: which tokens are learnt, the chat template's text) is compared
    on resume, as the shared settings are: the template by its text, so a copy elsewhere resumes."""
    train, dev = chat_lora_run["out"].parent / "train.jsonl", chat_lora_run["dev"]
    out, template = tmp_path / "out", tmp_path / "template.jinja"
    template.write_text(Path(CHAT_TEMPLATE).read_text())
    flags = ["--use_peft", "--max_train_steps", "2", "--checkpointing_steps", "2", "--max_length", "64",
             "--assistant_only_loss", "--chat_template_path", str(template)]  # fmt: skip
    first = run_in_process("train", train_args(chat_lora_run["base"], train, dev, out, *flags))
    copy = tmp_path / "copy.jinja"
    copy.write_text(template.read_text())
    flags[-1] = str(copy)
    resume = [*train_args(chat_lora_run["base"], train, dev, out, *flags), "--resume_from_checkpoint", "latest"]
    assert run_in_process("train", resume)["eval_loss"] == first["eval_loss"]  # the same text at another path
    with pytest.raises(UserError, match=r"other settings \(--assistant_only_loss True -> False\)"):
        run_in_process("train", [*resume, "--no-assistant_only_loss"])
    copy.write_text(Path(CHAT_TEMPLATE).read_text().replace("'<|' + message['role']", "'<' + message['role']"))
    with pytest.raises(UserError, match=r"other settings \(chat_template: other contents\)"):
        run_in_process("train", resume)


def test_three_ranks_count_every_token_once_as_one_rank_does(chat_lora_run, tmp_path):
    """9 conversations on 3 ranks in batches of 2: ranks with 4 and 2 rows, an uneven last batch, batches padded to
    other lengths than on 1 rank. Token counts (and so the token accuracy, a ratio of counts) are exact; the loss is
    a sum of the same per-token terms in another order and padding, equal to fp32 rounding (relative 1e-6)."""
    import csv

    argv = ["--model_name_or_path", str(chat_lora_run["out"]), "--validation_file", str(chat_lora_run["dev"]),
            "--mixed_precision", "no", "--per_device_eval_batch_size", "2"]  # fmt: skip
    one = run_in_process("evaluate", [*argv, "--output_dir", str(tmp_path / "one")])
    result = launch("evaluate.py", [*argv, "--output_dir", str(tmp_path / "three")], num_processes=3)
    assert result.returncode == 0, result.stderr[-3000:]
    three = json.loads((tmp_path / "three" / "eval_results.json").read_text())
    counts = {}
    for name in ("one", "three"):
        rows = csv.DictReader((tmp_path / name / "predictions.csv").read_text().splitlines())
        counts[name] = [(row["index"], row["tokens"]) for row in rows]
    assert counts["three"] == counts["one"]
    assert three["eval_samples"] == one["eval_samples"] == 9
    assert three["eval_mean_token_accuracy"] == round(one["eval_mean_token_accuracy"], 6)
    assert three["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)


def test_examples_with_nothing_to_learn_are_dropped_and_counted(tokenizer, caplog):
    data = Dataset.from_list([{"prompt": "the plot was good " * 10, "completion": "yes"},
                              {"prompt": "the acting", "completion": "was bad"}])  # fmt: skip
    PartialState(cpu=True)  # accelerate's logger
    with caplog.at_level("WARNING"):
        rows = CausalLM(PROMPT_COMPLETION).features(data, tokenizer, 16)
    assert "1 of 2 examples have nothing to learn within --max_length 16" in caplog.text
    assert len(rows) == 1 and rows[0]["example_index"] == 1  # its data row: predictions.csv's index


def test_a_chat_template_path_that_is_no_file_says_what_it_takes(tmp_path):
    """TRL's flag also takes a tokenizer's folder or Hub name; here it is the template's file."""
    chats = Dataset.from_list([{"messages": MESSAGES}])
    with pytest.raises(UserError, match="Is a directory; it takes a Jinja template file .*chat_template.jinja"):
        CausalLM.from_data(options(chat_template_path=str(tmp_path)), chats)


def test_validation_data_in_another_format_is_one_line(tiny_decoders, tmp_path):
    """AlpacaEval's prompt/completion and messages files sit side by side: one of each is an easy mix-up."""
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "the plot was", "completion": "good"}] * 4)
    chats = write_rows(tmp_path / "chats.jsonl", [{"messages": MESSAGES}] * 4)
    for train, dev, wanted in ((pairs, chats, "prompt-completion"), (chats, pairs, "chat")):
        argv = train_args(tiny_decoders["llama"], train, dev, tmp_path / "out", "--chat_template_path", CHAT_TEMPLATE)
        argv = argv if wanted == "chat" else argv[:-2]
        with pytest.raises(UserError, match=f"the validation data: its columns .* are not {wanted} rows, which"):
            run_in_process("train", argv)


def test_validation_data_with_nothing_left_to_score_is_one_line(tiny_decoders, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", [{"prompt": "the plot was", "completion": "good"}] * 8)
    dev = write_rows(tmp_path / "dev.jsonl", [{"prompt": "the acting " * 20, "completion": "bad"}] * 2)
    with pytest.raises(UserError, match="the validation data has no example left within --max_length 16"):
        run_in_process("train", train_args(tiny_decoders["llama"], train, dev, tmp_path / "out", "--max_length", "16"))


def test_the_model_card_shows_how_to_generate_and_that_runs(tmp_path, tiny_decoders, tiny_model):
    rows = [{"prompt": "the plot was", "completion": "good"}] * 8
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_in_process("train", train_args(tiny_decoders["llama"], train, train, tmp_path / "out", "--max_length", "16"))
    printed = run_model_card_snippet(tmp_path / "out")  # the prompt ("Hello": <unk> to the tiny vocabulary) and more
    assert printed.startswith("<s> <unk>") and len(printed.split()) > 2, printed
    # A new Llama with a BERT tokenizer (as the docs build one offline): its saved tokenizer gives no token_type_ids,
    # which generate() refuses for a model that has none. The tokenizer's length limit (64) was its BERT's: the new
    # model's 256 positions replace it, here and in the saved tokenizer, which evaluate.py checks --max_length with.
    small = "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1"
    new = ["--model_type", "llama", "--config_overrides", f"{small},max_position_embeddings=256",
           "--tokenizer_name", str(tiny_model)]  # fmt: skip
    run_in_process("train", [*train_args(None, train, train, tmp_path / "new", "--max_length", "100")[2:], *new])
    assert load_tokenizer(str(tmp_path / "new")).model_max_length == 256
    printed = run_model_card_snippet(tmp_path / "new")  # "Hello" is [UNK] to the tiny vocabulary too
    assert printed.startswith("[CLS] [UNK] [SEP]") and len(printed.split()) > 3, printed


def test_the_saved_model_stops_at_the_eos_it_learnt_and_at_its_own(tmp_path, tiny_decoders, monkeypatch, caplog):
    """A chat model's generation config may end answers at its end of turn, another token than its tokenizer's EOS,
    which training appends to every answer. What generates with the saved model, whole, merged or an adapter, as the
    model card shows, stops at both."""
    import shutil

    from transformers import GenerationMixin

    base = tmp_path / "base"
    shutil.copytree(tiny_decoders["llama"], base)
    end_of_turn = 5  # a word of the tiny vocabulary; the tokenizer's EOS </s> is 2
    settings = json.loads((base / "generation_config.json").read_text())
    (base / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [end_of_turn]}))
    train = write_rows(tmp_path / "train.jsonl", [{"prompt": "the plot was", "completion": "good"}] * 8)
    generate, stops = GenerationMixin.generate, []

    def recorded(model, *args, generation_config=None, **kwargs):
        stops.append((generation_config or model.generation_config).eos_token_id)
        return generate(model, *args, generation_config=generation_config, **kwargs)

    for name, flags in (("whole", []), ("adapter", ["--use_peft"]), ("merged", ["--use_peft", "--merge_lora"])):
        out = tmp_path / name
        run_in_process("train", train_args(base, train, train, out, "--max_length", "16", "--max_train_steps", "1",
                                           *flags))  # fmt: skip
        with monkeypatch.context() as patch:
            patch.setattr(GenerationMixin, "generate", recorded)
            run_model_card_snippet(out)
        assert stops.pop() == [2, end_of_turn], name
    # A published config that transformers only warns about (greedy, with a temperature) would be refused, changed,
    # as the run saves it: kept as it came, and said so at the start.
    (base / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [end_of_turn],
                                                             "do_sample": False, "temperature": 0.7}))  # fmt: skip
    with caplog.at_level("WARNING"):
        run_in_process("train", train_args(base, train, train, tmp_path / "kept", "--max_length", "16",
                                           "--max_train_steps", "1"))  # fmt: skip
    assert json.loads((tmp_path / "kept" / "generation_config.json").read_text())["eos_token_id"] == [end_of_turn]
    assert "keeps the model's own end tokens only" in caplog.text


def test_the_text_model_cards_prompt_goes_on_without_the_eos_that_ends_a_text(tmp_path, tiny_model, monkeypatch):
    """A BERT tokenizer (as the docs build a model offline) ends every text with [SEP], its EOS: the card's prompt,
    a text to continue, must not end with it, or the model starts a new text."""
    from transformers import AutoTokenizer, GenerationMixin

    text = tmp_path / "train.txt"
    text.write_text("the plot was good\n" * 8)
    small = "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1"
    new = ["--model_type", "llama", "--config_overrides", small, "--tokenizer_name", str(tiny_model)]
    run_in_process("train", [*train_args(None, text, text, tmp_path / "out", "--max_length", "16")[2:], *new])
    generate, prompts = GenerationMixin.generate, []

    def recorded(model, *args, **kwargs):
        prompts.append(kwargs["input_ids"][0].tolist())
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recorded)
    run_model_card_snippet(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert prompts == [tokenizer("Hello")["input_ids"][:-1]] and tokenizer.eos_token == "[SEP]"


def test_a_merged_lora_causal_lm_keeps_the_pad_token_of_its_training(tmp_path, tiny_decoders):
    """The adapter folder of a causal LM holds no config, and the base's has no pad token (Llama's has none): the
    merged model's config takes the one training used, as the merged classifiers' do."""
    from transformers import AutoConfig

    rows = [{"prompt": "the plot was", "completion": "good"}] * 8
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--max_length", "16", "--use_peft", "--merge_lora", "--max_train_steps", "1"]
    run_in_process("train", train_args(tiny_decoders["llama"], train, train, tmp_path / "out", *flags))
    assert AutoConfig.from_pretrained(tiny_decoders["llama"]).pad_token_id is None
    merged = AutoConfig.from_pretrained(tmp_path / "out")
    assert merged.pad_token_id is not None and merged.pad_token_id == load_tokenizer(str(tmp_path / "out")).pad_token_id


def test_a_global_batch_gives_the_same_update_however_it_is_split(tiny_decoders, tmp_path):
    """Completions of very different lengths: 1 batch of 8, 2 accumulated batches of 4, and batches of 4 on 2 ranks
    (with gradient checkpointing and the batch-size probe, which must not change the update) give the same weights
    only when each batch's summed token loss is divided by the whole step's tokens on all ranks (not averaged per
    batch or per rank). The 2 ranks build the model and step as under ZeRO-3 (tests/sharded_steps.py): every model
    creation and forward pass is a collective of both, so none may happen on one rank alone."""
    from safetensors.torch import load_file

    rows = [{"prompt": "the plot was", "completion": " ".join(["good"] * (1 + 5 * (i % 4)))} for i in range(16)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    weights = {}
    ways = {"one": ("8", "1", []), "accumulated": ("4", "2", []),
            "ranks": ("4", "1", ["--gradient_checkpointing", "--auto_find_batch_size"])}  # fmt: skip
    for name, (size, steps, extra) in ways.items():
        batches = ["--per_device_train_batch_size", size, "--gradient_accumulation_steps", steps, *extra]
        argv = train_args(tiny_decoders["llama"], data, data, tmp_path / name, *batches)
        if name == "ranks":
            result = launch("tests/sharded_steps.py", ["train.py", *argv, "--ddp_timeout", "60"], num_processes=2)
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            run_in_process("train", argv)
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    for name in ("accumulated", "ranks"):
        worst = max((weights["one"][k] - weights[name][k]).abs().max().item() for k in weights["one"])
        assert worst < WEIGHTS_ATOL, f"{name}: weights differ by up to {worst}"


def test_chat_rows_and_templates_that_cannot_be_learnt_are_one_line(tokenizer, tmp_path):
    with pytest.raises(
        UserError, match=r"has no chat template to render `messages` with: train with one \(train.py --chat"
    ):
        chat_task(tokenizer)  # the tiny Llama's tokenizer has none, as base models' have none
    template = tmp_path / "plain.jinja"  # no {% generation %} markers
    template.write_text("{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}")
    with pytest.raises(UserError, match="--assistant_only_loss needs a chat template that marks the assistant's"):
        chat_task(tokenizer, chat_template_path=template, assistant_only_loss=True)
    with pytest.raises(UserError, match="--assistant_only_loss is for chat rows"):
        CausalLM.from_data(options(assistant_only_loss=True), Dataset.from_list([{"text": "the plot"}]))
    with pytest.raises(UserError, match="--packing is for prompt/completion and chat rows; text is cut into blocks"):
        CausalLM.from_data(options(packing=True), Dataset.from_list([{"text": "the plot"}]))
    with pytest.raises(
        UserError, match="--no-completion_only_loss is for prompt/completion rows, and this data is chat"
    ):
        CausalLM.from_data(options(completion_only_loss=False), Dataset.from_list([{"messages": MESSAGES}]))
    with pytest.raises(UserError, match="--chat_template_path is for chat rows .*, and this data is prompt-completion"):
        CausalLM.from_data(
            options(chat_template_path=CHAT_TEMPLATE), Dataset.from_list([{"prompt": "a", "completion": "b"}])
        )
    task, chat_tokenizer = chat_task(tokenizer, chat_template_path=CHAT_TEMPLATE)
    with pytest.raises(UserError, match="a chat row must list turns with 'role' and 'content'"):
        task.features(Dataset.from_list([{"messages": [{"speaker": "user", "text": "hi"}]}]), chat_tokenizer, 64)


def test_a_new_model_from_a_config_trains_on_a_text_file_and_loads_with_from_pretrained(tiny_decoders, tmp_path):
    """run_clm_no_trainer.py's way to train from scratch: --model_type, --config_overrides and --tokenizer_name; the
    model's vocabulary and special tokens are the tokenizer's."""
    from transformers import AutoModelForCausalLM

    text = tmp_path / "train.txt"
    text.write_text("".join(f"the plot was {'good' if i % 2 else 'bad'}\n" for i in range(40)))
    small = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2"
    argv = train_args(tiny_decoders["llama"], text, text, tmp_path / "out", "--max_length", "16",
                      "--preprocessing_num_workers", "2")[2:]  # fmt: skip
    argv += ["--model_type", "llama", "--config_overrides", small, "--tokenizer_name", str(tiny_decoders["llama"]),
             "--checkpointing_steps", "epoch"]  # fmt: skip
    results = run_in_process("train", argv)
    # The model's definition is kept on resume: its checkpoint's weights would load into another config.
    resume = [*argv, "--resume_from_checkpoint", "latest"]
    resume[resume.index(small)] = small + ",rms_norm_eps=0.5"
    with pytest.raises(UserError, match=r"other settings \(--config_overrides hidden_size=32,.* -> .*rms_norm_eps"):
        run_in_process("train", resume)
    assert results["perplexity"] == results["eval_perplexity"]  # top level too, as run_clm_no_trainer.py writes it
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = load_tokenizer(str(tiny_decoders["llama"]))
    assert (model.config.hidden_size, model.config.vocab_size) == (32, len(tokenizer))
    assert model.config.eos_token_id == tokenizer.eos_token_id
    card = (tmp_path / "out" / "README.md").read_text()
    assert "A new `llama` model with random weights (built from its config), trained on `train.txt`" in card


def test_text_is_tokenized_in_parallel_into_the_same_blocks(tokenizer):
    texts = Dataset.from_list([{"text": f"the plot was {'good ' * (i % 5)}"} for i in range(30)])
    alone = CausalLM(TEXT).features(texts, tokenizer, 8)
    assert CausalLM(TEXT).features(texts, tokenizer, 8, num_proc=2)["input_ids"] == alone["input_ids"]


def test_an_encoder_is_switched_to_a_decoder_and_never_sees_the_tokens_it_predicts(tiny_model, caplog):
    """The tiny BERT loaded as a causal LM: each position's logits must not change when later tokens do."""
    import torch

    from src.model import load_tokenizer as load

    args = types.SimpleNamespace(model_name_or_path=str(tiny_model), trust_remote_code=False, use_peft=False,
                                 ignore_mismatched_sizes=True)  # fmt: skip
    PartialState(cpu=True)  # accelerate's logger
    with caplog.at_level("WARNING"):
        model = CausalLM(TEXT).build_model(args, load(str(tiny_model)), "no").eval()
    assert "BertConfig is an encoder: switched to a decoder" in caplog.text and model.config.is_decoder
    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 15, 3]])
    later = ids.clone()
    later[0, 5:] = torch.tensor([20, 21, 22])
    with torch.no_grad():
        first, second = model(input_ids=ids).logits[0, :5], model(input_ids=later).logits[0, :5]
    assert torch.equal(first, second)


def test_a_lora_base_without_an_lm_head_is_refused_on_every_rank(tiny_model, tmp_path):
    """Real ranks (each loads the weights and finds the head missing): every rank says why and none waits for the
    others in a collective; nothing is saved."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "the plot was", "completion": "good"}) + "\n" for _ in range(8)))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model), "--train_file", str(data), "--output_dir", str(out),
            "--task", "causal-lm", "--use_peft", "--max_length", "16"]  # fmt: skip
    result = launch("train.py", argv, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: --use_peft trains adapters on pretrained weights" in result.stderr
    assert not list(out.glob("**/*.safetensors"))


def test_a_lora_adapter_on_an_encoder_keeps_it_a_decoder_in_evaluate_py(tiny_model, tmp_path):
    """The adapter folder of an encoder switched to a decoder holds the switched config: on the base's own config,
    evaluate.py would let each position see the tokens it predicts, and score another model than the run did.
    A base without a language-modelling head is refused: LoRA would leave a random one frozen and unsaved."""
    from transformers import AutoTokenizer, BertForMaskedLM

    rows = [{"prompt": "the plot was", "completion": "good"}, {"prompt": "the acting was", "completion": "bad"}] * 4
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    flags = ["--task", "causal-lm", "--use_peft", "--max_train_steps", "1", "--max_length", "16"]
    headless = "--use_peft trains adapters on pretrained weights, and .* has none for cls.predictions.bias, .* more"
    with pytest.raises(UserError, match=headless):  # the tiny classifier's checkpoint: no LM head
        run_in_process("train", train_args(tiny_model, data, data, out, *flags))
    base = tmp_path / "bert-lm"  # with a language-modelling head of its own, which LoRA leaves frozen and unsaved
    BertForMaskedLM.from_pretrained(tiny_model).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(base)
    results = run_in_process("train", train_args(base, data, data, out, *flags))
    assert json.loads((out / "config.json").read_text())["is_decoder"] is True
    argv = ["--model_name_or_path", str(out), "--validation_file", str(data), "--output_dir", str(tmp_path / "eval"),
            "--per_device_eval_batch_size", "8"]  # fmt: skip
    # The run's evaluation batches (8 rows): the same computation, so the same loss to the last bit.
    assert run_in_process("evaluate", argv)["eval_loss"] == results["eval_loss"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--config_name", "x", "--model_type", "llama"], "--config_name and --model_type both describe"),
        (["--model_type", "llama", "--model_name_or_path", "x"], "--model_type builds a new model with random"),
        (["--config_overrides", "n_layer=2"], "--config_overrides changes the config of a new model"),
        (["--model_type", "lama"], "'lama' is not an architecture transformers knows; did you mean"),
        (["--model_type", "llama", "--use_peft"], "--use_peft adapts a trained model"),
    ],
)
def test_new_model_flags_that_contradict_each_other_are_one_line(flags, message, capsys):
    from src.args import parse_train_args

    with pytest.raises(SystemExit):
        parse_train_args(["--train_file", "t.txt", *flags])
    assert message in capsys.readouterr().err


def test_evaluate_py_reads_a_text_file_as_its_run_did(tiny_decoders, tmp_path):
    """A run with --no_keep_linebreaks: evaluate.py reads a .txt file's lines without their line breaks too (a
    byte-level tokenizer makes each one a token), and scores what the run scored."""
    text = tmp_path / "train.txt"
    text.write_text("".join(f"the plot was {'good' if i % 2 else 'bad'}\n" for i in range(16)))
    out = tmp_path / "out"
    flags = ["--no_keep_linebreaks", "--max_train_steps", "1", "--max_length", "16"]
    results = run_in_process("train", train_args(tiny_decoders["gpt2"], text, text, out, *flags))
    argv = ["--model_name_or_path", str(out), "--validation_file", str(text), "--output_dir", str(tmp_path / "eval"),
            "--per_device_eval_batch_size", "8"]  # fmt: skip
    assert run_in_process("evaluate", argv)["eval_loss"] == results["eval_loss"]


def test_keep_linebreaks_in_both_spellings(tmp_path):
    from src.args import parse_train_args

    assert parse_train_args([]).keep_linebreaks
    assert not parse_train_args(["--no_keep_linebreaks"]).keep_linebreaks  # run_clm_no_trainer.py's
    assert not parse_train_args(["--no-keep_linebreaks"]).keep_linebreaks
    config = tmp_path / "run.yaml"
    config.write_text("keep_linebreaks: false\n")
    assert not parse_train_args(["--config", str(config)]).keep_linebreaks
    config.write_text("no_keep_linebreaks: true\n")  # run_clm_no_trainer.py's spelling as a key too
    assert not parse_train_args(["--config", str(config)]).keep_linebreaks
    config.write_text("no_keep_linebreaks: false\n")
    assert parse_train_args(["--config", str(config)]).keep_linebreaks


def test_a_new_models_config_and_tokenizer_errors_name_their_flags(tiny_decoders, tmp_path):
    from src.model import load_config

    tokenizer = load_tokenizer(str(tiny_decoders["llama"]))
    new = dict(model_name_or_path=None, trust_remote_code=False, config_name=None, model_type="llama")
    with pytest.raises(UserError, match=r"--config_overrides 'layers': .* give name=value pairs separated by commas"):
        load_config(types.SimpleNamespace(**new, config_overrides="layers"), {}, tokenizer)

    def new_config(model_type, overrides):
        return load_config(types.SimpleNamespace(**(new | {"model_type": model_type}), config_overrides=overrides),
                           {}, tokenizer)  # fmt: skip

    # Sizes that do not divide are named; GPT-2 spells its sizes n_embd, n_head.
    with pytest.raises(UserError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3; set"):
        new_config("llama", "hidden_size=64,num_attention_heads=4,num_key_value_heads=3")
    with pytest.raises(UserError, match="'n_embd=60,n_head=8': hidden_size 60 is not a multiple of num_attention_he"):
        new_config("gpt2", "n_embd=60,n_head=8")
    new_config("seed_oss", "num_hidden_layers=2")  # 4096 / 80 heads of its own head_dim: untouched, not refused
    # What the config class checks itself (Llama's 4096 wide default, 5 heads) is one line too.
    with pytest.raises(UserError, match=r"--config_overrides 'num_attention_heads=5': .*not a multiple"):
        new_config("llama", "num_attention_heads=5")
    from src.args import parse_train_args

    spaced = parse_train_args(["--model_type", "llama", "--config_overrides", "hidden_size=64, num_hidden_layers=2"])
    assert spaced.config_overrides == "hidden_size=64,num_hidden_layers=2"  # as a shell may pass it; recorded alike
    config = new_config("llama", "hidden_size=64,num_attention_heads=4,num_key_value_heads=2")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    # What the architecture derives follows, as in LlamaConfig(hidden_size=64, num_attention_heads=4): head_dim 16
    # (the default's is 128), and as many key/value heads as heads (the default's 32 would not divide 4).
    config = new_config("llama", "hidden_size=64,num_attention_heads=4")
    assert (config.head_dim, config.num_key_value_heads) == (16, 4)
    assert new_config("llama", "hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=8").head_dim == 8
    missing = str(tmp_path / "missing")
    with pytest.raises(UserError, match=f"--config_name {missing}: cannot load a model config"):
        load_config(types.SimpleNamespace(**(new | {"config_name": missing}), config_overrides=None), {}, tokenizer)
    with pytest.raises(UserError, match=f"--tokenizer_name {missing}: cannot load a tokenizer"):
        CausalLM(TEXT).load_tokenizer(missing, types.SimpleNamespace(**new))


def test_the_step_runs_the_model_without_its_kv_cache(tiny_decoders, tokenizer):
    """The saved config keeps the cache on (for generation); a training or scoring step keeps no keys and values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_decoders["llama"])
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    batch = dict(tokenizer(["the plot was good"], return_tensors="pt"))
    CausalLM(TEXT).step(model, batch | {"labels": batch["input_ids"].clone()})
    assert model.config.use_cache and seen == [False]


def test_token_cross_entropy_is_each_positions_loss_and_zero_where_ignored():
    """The token tasks' loss, computed over flattened positions for speed, is what F.cross_entropy gives in the
    (batch, classes, length) layout it documents, for a slice of the logits as CausalLM.step passes it."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=generator)[:, :-1]
    labels = torch.randint(0, 11, (3, 7), generator=generator)[:, 1:]
    labels[0, :2] = IGNORE
    losses = token_cross_entropy(logits, labels)
    assert losses.shape == labels.shape and (losses[0, :2] == 0).all() and (losses[0, 2:] > 0).all()
    # The same sums in float32, added in another order: float32's default tolerance.
    torch.testing.assert_close(
        losses, F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    )
