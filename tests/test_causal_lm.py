"""Causal-LM fine-tuning through the task interface: which tokens are learnt in each format (text, prompt/completion,
chat), EOS kept though it pads, the formats found from the data, and a LoRA run that evaluate.py reproduces."""

import json
import types

import pytest
from accelerate import PartialState
from conftest import REPO, WEIGHTS_ATOL, run_in_process, run_model_card_snippet, train_args
from datasets import Dataset

from src.errors import UserError
from src.model import load_tokenizer
from src.plan import best_metric, learning_rate
from src.tasks import detect_task
from src.tasks.causal_lm import CHAT, IGNORE, PROMPT_COMPLETION, TEXT, CausalLM

SFT = REPO.parent / "shared" / "data" / "alpaca_eval_sft"


@pytest.fixture(scope="module")
def tokenizer(tiny_decoders):
    """The tiny Llama's: no padding token of its own, so it pads with EOS, as Llama's does."""
    loaded = load_tokenizer(str(tiny_decoders["llama"]))
    assert loaded.pad_token_id == loaded.eos_token_id
    return loaded


def learnt(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE])


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


def test_chat_learns_the_assistant_turns_only(tokenizer):
    messages = [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "was good"},
                {"role": "user", "content": "and the acting"}, {"role": "assistant", "content": "was bad"}]  # fmt: skip
    task = CausalLM(CHAT)
    chat_tokenizer = task.load_tokenizer(str(tokenizer.name_or_path), types.SimpleNamespace(trust_remote_code=False))
    row = task.features(Dataset.from_list([{"messages": messages}]), chat_tokenizer, 256)[0]
    eos = chat_tokenizer.eos_token
    assert learnt(chat_tokenizer, row["input_ids"], row["labels"]).split() == f"was good {eos} was bad {eos}".split()
    sharegpt = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in messages]
    again = task.features(Dataset.from_list([{"conversations": sharegpt}]), chat_tokenizer, 256)[0]
    assert again["labels"] == row["labels"]


def test_text_is_cut_into_blocks_and_nothing_is_dropped(tokenizer):
    texts = ["the plot was good"] * 7 + ["", "the acting was bad"]
    rows = CausalLM(TEXT).features(Dataset.from_list([{"text": t} for t in texts]), tokenizer, 8)
    lengths = [len(r["input_ids"]) for r in rows]
    expected = sum(len(tokenizer(t)["input_ids"]) + 1 for t in texts if t)  # each text's tokens and its EOS
    assert sum(lengths) == expected and set(lengths[:-1]) == {8} and 0 < lengths[-1] <= 8
    assert all(r["labels"] == r["input_ids"] for r in rows)


def test_the_task_has_its_own_defaults_where_a_classifiers_do_not_fit():
    assert (CausalLM.default_max_length, CausalLM.default_learning_rate) == (1024, 2e-5)
    assert learning_rate(types.SimpleNamespace(learning_rate=None), CausalLM(TEXT)) == 2e-5
    assert learning_rate(types.SimpleNamespace(learning_rate=3e-4), CausalLM(TEXT)) == 3e-4  # the flag wins
    choice = types.SimpleNamespace(metric_for_best_model="perplexity", greater_is_better=None)
    assert best_metric(choice, CausalLM(TEXT)) == ("perplexity", False)  # the lowest perplexity is the best


def test_the_format_is_found_from_the_columns():
    flags = types.SimpleNamespace(packing=False)
    for row, fmt in [({"messages": [{"role": "user", "content": "hi"}]}, CHAT),
                     ({"conversations": [{"from": "human", "value": "hi"}]}, CHAT),
                     ({"prompt": "a", "completion": "b"}, PROMPT_COMPLETION), ({"text": "a"}, TEXT)]:  # fmt: skip
        cls, _ = detect_task(Dataset.from_list([row]))
        assert cls is CausalLM and CausalLM.from_data(flags, Dataset.from_list([row])).format == fmt
    assert detect_task(Dataset.from_list([{"text": "a", "label": 1}]))[0].name == "sequence-classification"
    with pytest.raises(UserError, match="the columns are sentence, label"):
        CausalLM.from_data(None, Dataset.from_list([{"sentence": "a", "label": 1}]))


def test_lora_sft_on_chat_rows_and_evaluate_py_reproduces_it(tiny_decoders, tmp_path):
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    lines = (SFT / "train_messages.jsonl").read_text().splitlines()
    train.write_text("\n".join(lines[:24]) + "\n")
    dev.write_text("\n".join((SFT / "validation_messages.jsonl").read_text().splitlines()[:9]) + "\n")
    flags = ["--use_peft", "--num_train_epochs", "1", "--max_length", "64"]
    results = run_in_process("train", train_args(tiny_decoders["llama"], train, dev, tmp_path / "out", *flags))
    record = json.loads((tmp_path / "out" / "args.json").read_text())
    assert record["task"] == "causal-lm" and record["format"] == CHAT and record["metric_for_best_model"] == "loss"
    assert record["learning_rate"] == 1e-3 and record["max_length"] == 64  # as given (train_args), in the record
    assert {"eval_loss", "eval_perplexity", "eval_mean_token_accuracy", "train_loss"} <= set(results)
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM" and not adapter["modules_to_save"]  # the LM head is not retrained
    assert "chat_template" in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) or (
        tmp_path / "out" / "chat_template.jinja").is_file()  # fmt: skip
    argv = ["--model_name_or_path", str(tmp_path / "out"), "--validation_file", str(dev), "--output_dir",
            str(tmp_path / "eval"), "--mixed_precision", "no", "--per_device_eval_batch_size", "8"]  # fmt: skip
    metrics = run_in_process("evaluate", argv)
    assert metrics["eval_samples"] == results["eval_samples"] == 9
    assert metrics["eval_mean_token_accuracy"] == results["eval_mean_token_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], rel=1e-6)


def test_examples_with_nothing_to_learn_are_dropped_and_counted(tokenizer, caplog):
    data = Dataset.from_list([{"prompt": "the plot was good " * 10, "completion": "yes"},
                              {"prompt": "the acting", "completion": "was bad"}])  # fmt: skip
    PartialState(cpu=True)  # accelerate's logger
    with caplog.at_level("WARNING"):
        rows = CausalLM(PROMPT_COMPLETION).features(data, tokenizer, 16)
    assert "1 of 2 examples have nothing to learn within --max_length 16" in caplog.text
    assert len(rows) == 1 and rows[0]["example_index"] == 0


def test_the_model_card_shows_how_to_generate_and_that_runs(tmp_path, tiny_decoders):
    rows = [{"prompt": "the plot was", "completion": "good"}] * 8
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_in_process("train", train_args(tiny_decoders["llama"], train, train, tmp_path / "out", "--max_length", "16"))
    printed = run_model_card_snippet(tmp_path / "out")  # the prompt ("Hello": <unk> to the tiny vocabulary) and more
    assert printed.startswith("<s> <unk>") and len(printed.split()) > 2, printed


def test_a_global_batch_gives_the_same_update_however_it_is_split(tiny_decoders, tmp_path):
    """Completions of very different lengths: 1 batch of 8 and 2 accumulated batches of 4 give the same weights only
    when each batch's summed token loss is divided by the whole step's tokens (not averaged per batch)."""
    from safetensors.torch import load_file

    rows = [{"prompt": "the plot was", "completion": " ".join(["good"] * (1 + 5 * (i % 4)))} for i in range(16)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    weights = {}
    for name, (size, steps) in {"one": ("8", "1"), "accumulated": ("4", "2")}.items():
        batches = ["--per_device_train_batch_size", size, "--gradient_accumulation_steps", steps]
        run_in_process("train", train_args(tiny_decoders["llama"], data, data, tmp_path / name, *batches))
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    worst = max((weights["one"][k] - weights["accumulated"][k]).abs().max().item() for k in weights["one"])
    assert worst < WEIGHTS_ATOL, f"weights differ by up to {worst}"


def test_chat_rows_and_templates_that_cannot_be_learnt_are_one_line(tokenizer):
    task = CausalLM(CHAT)
    chat_tokenizer = task.load_tokenizer(str(tokenizer.name_or_path), types.SimpleNamespace(trust_remote_code=False))
    with pytest.raises(UserError, match="a chat row must list turns with 'role' and 'content'"):
        task.features(Dataset.from_list([{"messages": [{"speaker": "user", "text": "hi"}]}]), chat_tokenizer, 64)
    # A template that renders only the last turn (as some that drop earlier reasoning do) moves earlier turns.
    chat_tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %} >{% endif %}"
    turns = [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "was good"}]
    with pytest.raises(UserError, match="does not render a conversation as the sum of its turns"):
        task.features(Dataset.from_list([{"messages": turns}]), chat_tokenizer, 64)
