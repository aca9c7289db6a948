"""evaluate.py --predict_with_generate: a causal LM's answer to every prompt, in predictions.csv in data order, equal
to what transformers generates for each prompt alone, the same on 2 ranks whose weights every step needs from all
ranks (as under FSDP or ZeRO-3); the prompts of chat rows; one-line errors for rows without prompts."""

import csv
import json
import types

import pytest
from conftest import REPO, launch, run_in_process, sentiment_rows, train_args, write_rows
from datasets import Dataset

from src.errors import UserError
from src.tasks.causal_lm import CHAT, CausalLM

MAX_NEW_TOKENS = "8"


def answer_rows(count: int, seed: int) -> list[dict]:
    """Demo sentences as prompts, with answers of two lengths, so that some generations stop sooner than others."""
    answers = {"positive": "good", "negative": "bad , not good , so so"}
    return [{"prompt": row["sentence"], "completion": answers[row["label"]]} for row in sentiment_rows(count, seed)]


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory, tiny_decoders):
    """The tiny Llama after 10 steps on 40 prompt/completion rows, the training run's metrics, and 7 rows to evaluate
    (prompts of 8 to 13 tokens: batches mix lengths; 7 do not split evenly over 2 ranks)."""
    folder = tmp_path_factory.mktemp("generation")
    train = write_rows(folder / "train.jsonl", answer_rows(40, seed=1))
    dev = write_rows(folder / "dev.jsonl", answer_rows(7, seed=2))
    results = run_in_process(
        "train", train_args(tiny_decoders["llama"], train, dev, folder / "out", "--max_length", "48")
    )
    return {"model": folder / "out", "dev": dev, "results": results}


def evaluate_args(trained_lm, output_dir, *extra) -> list[str]:
    return ["--model_name_or_path", str(trained_lm["model"]), "--validation_file", str(trained_lm["dev"]),
            "--output_dir", str(output_dir), "--mixed_precision", "no", "--predict_with_generate",
            "--generation_max_length", MAX_NEW_TOKENS, *extra]  # fmt: skip


def predictions(folder) -> list[dict]:
    with open(folder / "predictions.csv", newline="") as file:
        return list(csv.DictReader(file))


def answers_alone(model_dir, prompts: list[str], num_beams: int) -> list[str]:
    """What plain transformers generates for each prompt alone (no padding, no batch, nothing from src/)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**ids, max_new_tokens=int(MAX_NEW_TOKENS), num_beams=num_beams, do_sample=False)
        answers.append(tokenizer.decode(output[0, ids.input_ids.shape[1] :], skip_special_tokens=True))
    return answers


def test_predictions_keep_the_data_rows_numbers_when_rows_are_dropped(trained_lm, tmp_path):
    """evaluate.py: a prompt that fills --max_length leaves nothing to score and its row is dropped; the other rows
    keep their data row's number in predictions.csv, each with its own loss (that of the same row evaluated alone)."""
    rows = [json.loads(line) for line in trained_lm["dev"].read_text().splitlines()][:3]
    rows[1]["prompt"] = " ".join([rows[1]["prompt"]] * 6)
    written = {}
    for name, data in [("all", rows), ("kept", [rows[0], rows[2]])]:
        dev = write_rows(tmp_path / f"{name}.jsonl", data)
        run_in_process("evaluate", ["--model_name_or_path", str(trained_lm["model"]), "--validation_file", str(dev),
                                    "--output_dir", str(tmp_path / name), "--max_length", "24"])  # fmt: skip
        written[name] = predictions(tmp_path / name)
    assert [row["index"] for row in written["all"]] == ["0", "2"]
    assert [row["loss"] for row in written["all"]] == [row["loss"] for row in written["kept"]]


def test_chat_rows_for_a_model_trained_without_a_chat_template_are_one_line(trained_lm, tmp_path):
    """evaluate.py has no --chat_template_path: its error must not send the user to that flag."""
    dev = write_rows(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "good"}]}])  # fmt: skip
    argv = ["--model_name_or_path", str(trained_lm["model"]), "--validation_file", str(dev), "--output_dir", "e"]
    with pytest.raises(UserError, match="no chat template .* evaluate.py uses the template saved with the model"):
        run_in_process("evaluate", argv)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_each_prompts_answer_is_what_the_model_generates_for_it_alone(trained_lm, tmp_path, num_beams):
    """Batches of 3 prompts of different lengths, sorted by length: each answer lands on its own row, and left padding
    leaves every answer as it is alone. The metrics are the training run's."""
    beams = ["--generation_num_beams", str(num_beams)]
    metrics = run_in_process(
        "evaluate", evaluate_args(trained_lm, tmp_path, "--per_device_eval_batch_size", "3", *beams)
    )
    rows = predictions(tmp_path)
    assert list(rows[0]) == ["index", "tokens", "loss", "generation"]
    assert [row["index"] for row in rows] == [str(i) for i in range(7)]
    prompts = [row["prompt"] for row in map(json.loads, trained_lm["dev"].read_text().splitlines())]
    expected = answers_alone(trained_lm["model"], prompts, num_beams)
    assert len(set(expected)) > 1, "the answers must differ for the test to see them out of order"
    assert [row["generation"] for row in rows] == expected
    assert metrics["eval_loss"] == pytest.approx(trained_lm["results"]["eval_loss"], rel=1e-6)
    assert metrics["eval_mean_token_accuracy"] == trained_lm["results"]["eval_mean_token_accuracy"]


def test_two_ranks_with_sharded_steps_write_what_one_process_writes(trained_lm, tmp_path):
    """2 ranks x 2 prompts (7 prompts: the last batch is evened out with a repeat), each forward pass a collective of
    both ranks as under FSDP: the run finishes only if a rank whose answers end sooner still steps with the other.
    --max_length 12 leaves 2 rows nothing to score: 5 examples scored over 2 ranks, each once, and 7 answered, each on
    its own data row, as on one process."""
    short = ["--max_length", "12"]
    run_in_process("evaluate", evaluate_args(trained_lm, tmp_path / "one", "--per_device_eval_batch_size", "3", *short))
    two = evaluate_args(
        trained_lm, tmp_path / "two", "--per_device_eval_batch_size", "2", "--ddp_timeout", "30", *short
    )
    result = launch("tests/sharded_steps.py", ["evaluate.py", *two], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert predictions(tmp_path / "two") == predictions(tmp_path / "one")
    assert sum(row["loss"] == "" for row in predictions(tmp_path / "two")) == 2
    assert json.loads((tmp_path / "two" / "eval_results.json").read_text())["eval_samples"] == 5


def test_a_conversations_prompt_is_everything_before_its_last_answer(tiny_decoders):
    task = CausalLM(CHAT, chat_template=(REPO / "examples" / "chat_template.jinja").read_text())
    tokenizer = task.load_tokenizer(str(tiny_decoders["llama"]), types.SimpleNamespace(trust_remote_code=False))
    turns = [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "was good"},
             {"role": "user", "content": "and the acting"}, {"role": "assistant", "content": "was bad"}]  # fmt: skip
    sharegpt = [{"from": "human" if t["role"] == "user" else "gpt", "value": t["content"]} for t in turns]
    prompts = task.prompts(Dataset.from_list([{"messages": turns}, {"messages": turns[:3]}]), tokenizer)
    prompts += task.prompts(Dataset.from_list([{"conversations": sharegpt}]), tokenizer)
    eos = tokenizer.eos_token  # the template's turns as the tiny tokenizer's words (its markers are <unk> to it)
    before_last_answer = (
        f"{tokenizer.bos_token}<|user|>\nthe plot{eos}\n<|assistant|>\nwas good{eos}\n<|user|>\nand the acting{eos}\n"
    )
    expected = tokenizer(before_last_answer + "<|assistant|>\n", add_special_tokens=False)["input_ids"]
    assert prompts == [expected] * 3


def test_prompts_without_answers_are_answered_and_rows_that_cannot_be_scored_too(trained_lm, tmp_path, caplog):
    """New prompts (no completion column) get answers and no scores; beside scored rows, a prompt that fills
    --max_length (nothing left to score) still gets its answer, on its own data row."""
    prompts = [row["prompt"] for row in map(json.loads, trained_lm["dev"].read_text().splitlines())]
    alone = write_rows(tmp_path / "prompts.jsonl", [{"prompt": prompt} for prompt in prompts[:3]])
    with caplog.at_level("WARNING"):
        metrics = run_in_process(
            "evaluate", evaluate_args(trained_lm, tmp_path / "new", "--validation_file", str(alone))
        )
    assert metrics == {"eval_samples": 0} and "nothing to learn" not in caplog.text  # nobody asked for a score
    rows = predictions(tmp_path / "new")
    assert list(rows[0]) == ["index", "generation"] and [row["index"] for row in rows] == ["0", "1", "2"]
    assert [row["generation"] for row in rows] == answers_alone(trained_lm["model"], prompts[:3], num_beams=1)

    run_in_process("evaluate", evaluate_args(trained_lm, tmp_path / "all"))
    run_in_process("evaluate", evaluate_args(trained_lm, tmp_path / "short", "--max_length", "12"))
    full, short = predictions(tmp_path / "all"), predictions(tmp_path / "short")
    assert [row["index"] for row in short] == [str(i) for i in range(7)]
    assert sum(row["loss"] == "" for row in short) == 2, "2 of the 7 prompts fill 12 tokens"
    assert [row["generation"] for row in short] == [row["generation"] for row in full]
    # Each scored row keeps its own scores beside its answer: those of its data row, scored without generating.
    scored = evaluate_args(trained_lm, tmp_path / "scored", "--max_length", "12")
    generating = scored.index("--predict_with_generate")
    run_in_process("evaluate", scored[:generating] + scored[generating + 3 :])  # and its --generation_max_length N
    assert {row["index"]: (row["tokens"], row["loss"]) for row in short if row["loss"]} == {
        row["index"]: (row["tokens"], row["loss"]) for row in predictions(tmp_path / "scored")}  # fmt: skip


def test_rows_without_prompts_are_one_line_errors(trained_lm, tiny_model, tmp_path):
    texts = write_rows(tmp_path / "texts.jsonl", [{"text": "the plot was good"}])
    with pytest.raises(UserError, match="a model for causal-LM fine-tuning on text has none to answer"):
        run_in_process("evaluate", evaluate_args(trained_lm, tmp_path, "--validation_file", str(texts)))
    sentences = write_rows(tmp_path / "sentences.csv", sentiment_rows(4))
    argv = ["--model_name_or_path", str(tiny_model), "--validation_file", str(sentences), "--output_dir", str(tmp_path),
            "--predict_with_generate"]  # fmt: skip
    with pytest.raises(UserError, match="a model for classification into 2 classes has none to answer"):
        run_in_process("evaluate", argv)
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": "the plot was"}])
    argv = ["--model_name_or_path", str(trained_lm["model"]), "--validation_file", str(prompts)]
    with pytest.raises(UserError, match=r"\(its columns: prompt\); prompts alone are answered with --predict_with_gen"):
        run_in_process("evaluate", argv)  # nothing to score, and the flag that would answer them not given


def test_data_of_another_format_than_the_models_is_scored_with_a_warning(trained_lm, tmp_path, caplog):
    """The run record says what the model learnt from; evaluate.py reads the data's own shape and says so."""
    texts = write_rows(tmp_path / "texts.jsonl", [{"text": "the plot was good"}])
    argv = ["--model_name_or_path", str(trained_lm["model"]), "--validation_file", str(texts), "--output_dir",
            str(tmp_path / "out"), "--mixed_precision", "no"]  # fmt: skip
    with caplog.at_level("WARNING"):
        assert "eval_perplexity" in run_in_process("evaluate", argv)
    assert "trained on prompt-completion rows and this data is text: it is scored as text" in caplog.text


def test_a_prompt_longer_than_the_models_positions_keeps_its_end():
    """Prompt and answer must fit the model's positions (GPT-2's learnt ones fail past them with an index error)."""
    from accelerate import PartialState

    from src.generation import _fit

    PartialState(cpu=True)  # accelerate's logger, which warns on the main process only
    assert _fit([[1, 2, 3, 4, 5], [6]], 6, 3) == [[3, 4, 5], [6]]
    assert _fit([[1] * 9], None, 3) == [[1] * 9]  # no limit the config knows
    with pytest.raises(UserError, match="--generation_max_length 6 leaves no room for a prompt"):
        _fit([[1]], 6, 6)


def test_a_generation_length_without_room_for_a_prompt_is_refused_before_the_scoring(trained_lm, tmp_path, monkeypatch):
    import src.evaluation

    monkeypatch.setattr(src.evaluation, "evaluate", lambda *args: pytest.fail("scored before the refusal"))
    argv = evaluate_args(trained_lm, tmp_path)
    argv[argv.index("--generation_max_length") + 1] = "64"  # the tiny Llama's positions
    with pytest.raises(UserError, match="--generation_max_length 64 leaves no room for a prompt in the model's 64 p"):
        run_in_process("evaluate", argv)


def test_answers_end_at_the_tokenizers_eos_and_at_the_models_own(trained_lm):
    """The tokenizer's EOS (which train.py appends to every answer) ends an answer, and so does the model's own in its
    generation_config (a chat model's end of turn), when the two differ. Here each is the word "not" in turn, which
    the trained model says in most answers."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.generation import generate

    tokenizer = AutoTokenizer.from_pretrained(trained_lm["model"])
    model = AutoModelForCausalLM.from_pretrained(trained_lm["model"])
    rows = map(json.loads, trained_lm["dev"].read_text().splitlines())
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    accelerator = Accelerator(cpu=True)

    def answers():
        return generate(model, prompts, tokenizer, accelerator, 8, int(MAX_NEW_TOKENS), 1)

    free = answers()
    assert "" in free and any(" not " in answer for answer in free), free  # some end at once, some say "not" and more
    ending_at_not = [answer[: answer.index(" not") + 4] if " not" in answer else answer for answer in free]
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("not")  # the model's own
    assert answers() == ending_at_not
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tokenizer.eos_token = "not"  # the tokenizer's
    assert answers() == ending_at_not


def test_a_prompt_longer_than_gpt2s_learnt_positions_is_answered_from_its_end(tiny_decoders):
    """GPT-2's 64 learnt positions: a prompt of more tokens keeps its last 64 - 4 beside 4 new tokens (unfitted, its
    positions past 64 fail with an index error), answered as those 60 tokens alone."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.generation import generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_decoders["gpt2"])
    tokenizer.pad_token = tokenizer.eos_token  # as the causal-LM task sets it for a tokenizer without one
    model = AutoModelForCausalLM.from_pretrained(tiny_decoders["gpt2"]).eval()
    prompt = tokenizer(" ".join(["the plot was good"] * 20))["input_ids"]
    assert len(prompt) > 64
    [answer] = generate(model, [prompt], tokenizer, Accelerator(cpu=True), 1, 4, 1)
    with torch.no_grad():
        alone = model.generate(torch.tensor([prompt[-60:]]), max_new_tokens=4, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    assert answer == tokenizer.decode(alone[0, 60:], skip_special_tokens=True)


def test_a_saved_causal_lm_keeps_its_kv_cache_on_for_what_generates_with_it(trained_lm):
    """Training and scoring turn the cache off in the task's step; a plain forward pass of the saved model returns
    the keys and values that incremental decoding feeds back (a classifier's folder keeps it off: test_llm.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    assert json.loads((trained_lm["model"] / "config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(trained_lm["model"]).eval()
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).past_key_values is not None


def test_a_lora_model_generates_under_the_runs_autocast_too(trained_lm):
    """A LoRA model's generate() calls its base model, outside the forward that prepare() wraps in autocast: under
    bf16 its answers were computed in fp32, unlike its loss and a whole model's answers."""
    from contextlib import contextmanager

    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.generation import generate

    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(trained_lm["model"])
    base = AutoModelForCausalLM.from_pretrained(trained_lm["model"])
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear"))
    inside, seen = [False], []

    @contextmanager
    def autocast(*args, **kwargs):  # stands for accelerate's, which under "no" precision does nothing to see
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    accelerator.autocast = autocast
    base.lm_head.register_forward_hook(lambda *_: seen.append(inside[0]))
    generate(accelerator.prepare(model), [tokenizer("a good film")["input_ids"]], tokenizer, accelerator, 1, 2, 1)
    assert seen and all(seen), "every forward pass of generation under the run's autocast"
