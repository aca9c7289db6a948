"""Decoder LLMs as classifiers, LoRA, gradient checkpointing and --auto_find_batch_size, on tiny random decoders
(Llama, Qwen2 and GPT-2 layouts whose tokenizers have no padding token) and the tiny BERT."""

import csv
import json
import re
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from conftest import (
    DECODER_LAYOUTS,
    WEIGHTS_ATOL,
    launch,
    load_script,
    run_model_card_snippet,
    sentiment_files,
    sentiment_rows,
    train_args,
)
from fake_oom import out_of_memory_above
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from src.args import build_train_parser, parse_args, validate_train_args
from src.batch_size import fit_batch_sizes, next_smaller
from src.errors import UserError
from src.lora import head_modules
from src.model import load_tokenizer, load_trained_model, prepare_for_training, resolve_max_length, save_model
from src.plan import BatchSizes
from src.tasks import task_of_model
from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification

train = load_script("train")
evaluate_script = load_script("evaluate")
TASK = SequenceClassification(SINGLE_LABEL, ("negative", "positive"), columns=("sentence", None, "label"))
TEXTS = [row["sentence"] for row in sentiment_rows(7, seed=3)] + ["bad", "the plot"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return sentiment_files(folder, 64, 21)


def run_train(*argv):
    return train.main(train.parse_train_args(list(argv)))


def run_evaluate(model_dir, data_file, output_dir, *flags):
    args = ["--model_name_or_path", str(model_dir), "--validation_file", str(data_file), *flags]
    return evaluate_script.main(evaluate_script.parse_eval_args([*args, "--output_dir", str(output_dir)]))


def flags(*argv):
    parser = build_train_parser()
    return validate_train_args(parser, parse_args(parser, list(argv)))


def built(model_dir, *argv, mixed_precision="no"):
    """(model, tokenizer) as train.py builds them."""
    tokenizer = load_tokenizer(str(model_dir))
    AcceleratorState._reset_state(reset_partial_state=True)  # a new precision, as in a new process
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    args = flags("--model_name_or_path", str(model_dir), *argv)
    model = TASK.build_model(args, tokenizer, accelerator.mixed_precision)
    return prepare_for_training(model, args, accelerator, TASK), tokenizer


def logits_alone_and_in_a_batch(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        batch = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in TEXTS])
    return alone, batch


def assert_same_logits(alone, batch):
    assert torch.allclose(alone, batch, atol=1e-5), f"padding moved logits by {(alone - batch).abs().max()}"
    assert torch.equal(alone.argmax(-1), batch.argmax(-1))


def weights(path):
    return load_file(path / "model.safetensors" if path.is_dir() else path)


# --- Decoders as sequence classifiers ---------------------------------------------------------------------------


def test_a_tokenizer_without_padding_pads_with_eos_on_the_right(tiny_decoders, tmp_path):
    for layout, folder in tiny_decoders.items():
        assert AutoTokenizer.from_pretrained(folder).pad_token is None, layout
        tokenizer = load_tokenizer(str(folder))
        assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.padding_side == "right", layout
        assert len(tokenizer) == AutoConfig.from_pretrained(folder).vocab_size, "no new token, no embedding resize"
    # A tokenizer shipped with left padding (as some chat models' are) is turned to the right.
    AutoTokenizer.from_pretrained(tiny_decoders["llama"], padding_side="left").save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).padding_side == "right"


def test_max_length_from_the_model_positions_when_the_tokenizer_has_no_limit(tiny_decoders):
    tokenizer = load_tokenizer(str(tiny_decoders["qwen2"]))
    assert tokenizer.model_max_length > 10**9, "the 'no limit' sentinel"
    assert resolve_max_length(None, tokenizer) == 128
    assert resolve_max_length(None, tokenizer, AutoConfig.from_pretrained(tiny_decoders["qwen2"])) == 64
    assert resolve_max_length(None, tokenizer, AutoConfig.from_pretrained(tiny_decoders["gpt2"])) == 64  # n_positions
    long_config = AutoConfig.from_pretrained(tiny_decoders["llama"], max_position_embeddings=131072)
    assert resolve_max_length(None, tokenizer, long_config) == 128
    assert resolve_max_length(4096, tokenizer, long_config) == 4096
    with pytest.raises(UserError, match="--max_length 65 is more than the model's 64 positions; use 64 or less"):
        resolve_max_length(65, tokenizer, AutoConfig.from_pretrained(tiny_decoders["llama"]))


@pytest.mark.parametrize("layout", DECODER_LAYOUTS)
def test_a_text_gets_the_same_logits_alone_and_padded_in_a_batch(tiny_decoders, data, tmp_path, layout):
    """For the model train.py trains and for the folder it saves, read with plain from_pretrained."""
    model, tokenizer = built(tiny_decoders[layout])
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    assert_same_logits(*logits_alone_and_in_a_batch(model, tokenizer))
    if layout == "gpt2":  # learned absolute positions: the check fails with left padding, as it should
        tokenizer.padding_side = "left"
        alone, batch = logits_alone_and_in_a_batch(model, tokenizer)
        assert not torch.allclose(alone, batch, atol=1e-3)

    out = tmp_path / "out"
    results = run_train(*train_args(tiny_decoders[layout], *data, out, "--max_train_steps", "3"))
    assert results["trainable_parameters"] == results["total_parameters"] == model.num_parameters()
    saved = AutoModelForSequenceClassification.from_pretrained(out)
    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    assert saved_tokenizer.pad_token == saved_tokenizer.eos_token and saved_tokenizer.padding_side == "right"
    assert saved.config.pad_token_id == saved_tokenizer.pad_token_id
    assert saved.config.id2label == {0: "negative", 1: "positive"}
    assert_same_logits(*logits_alone_and_in_a_batch(saved, saved_tokenizer))


@pytest.mark.parametrize("lora", [False, True])
def test_decoders_keep_no_kv_cache_nor_does_their_saved_folder(tiny_decoders, tmp_path, lora):
    """A classifier never generates: the keys and values of every layer kept at each forward pass would only cost
    memory, in training and evaluation alike, and in whatever loads the saved folder (its config.json says so)."""
    for layout, folder in tiny_decoders.items():
        model, tokenizer = built(folder, *(["--use_peft"] if lora else []))  # as train.py builds it
        assert model.config.use_cache is False, layout
        with torch.no_grad():
            assert model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).past_key_values is None, layout
        for merge in (False, True) if lora else (False,):
            out = tmp_path / f"{layout}-{merge}"
            out.mkdir()  # as train.py made it
            save_model(Accelerator(cpu=True), model, out, AutoModelForSequenceClassification, merge_lora=merge)
            assert json.loads((out / "config.json").read_text())["use_cache"] is False, (layout, merge)
            # A classifier by its class too, not the causal LM the base was saved as: a folder without args.json is
            # evaluated (and shown on the Hub) as the model its config names.
            assert task_of_model(out) == "sequence-classification", (layout, merge)
            # as evaluate.py loads it
            loaded = load_trained_model(AutoModelForSequenceClassification, str(out), tokenizer.pad_token_id)
            assert loaded.config.use_cache is False, (layout, merge)


# --- LoRA -------------------------------------------------------------------------------------------------------


def test_lora_adapts_every_linear_layer_of_the_backbone_and_trains_the_head_in_full(tiny_decoders, tiny_model):
    for folder, head in (
        (tiny_decoders["llama"], "score"),
        (tiny_decoders["gpt2"], "score"),
        (tiny_model, "classifier"),
    ):
        plain, _ = built(folder)
        prefix = plain.base_model_prefix + "."
        linears = {
            n for n, m in plain.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and n.startswith(prefix)
        }
        model, _ = built(folder, "--use_peft", "--lora_r", "4")
        assert head_modules(model.get_base_model()) == [head]
        adapted = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        assert adapted == linears, folder
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert all(".lora_" in n or f"{head}.modules_to_save." in n for n in trainable)
        assert any(f"{head}.modules_to_save." in n for n in trainable), "the head is trained in full"


def test_frozen_weights_keep_the_checkpoint_dtype_under_mixed_precision(tiny_decoders, tmp_path):
    """Trainable weights are fp32 everywhere; a bf16 checkpoint's frozen weights stay bf16 under LoRA + autocast."""
    bf16 = tmp_path / "bf16"
    AutoModelForSequenceClassification.from_pretrained(tiny_decoders["llama"], dtype=torch.bfloat16).save_pretrained(
        bf16
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_decoders["llama"] / name, bf16 / name)

    def dtypes(*argv, mixed_precision):
        model, _ = built(bf16, *argv, mixed_precision=mixed_precision)
        trainable = {p.dtype for p in model.parameters() if p.requires_grad}
        # (peft keeps the new head's initial weights too, as `original_module`: fp32 like the trained copy.)
        frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "original_module" not in n}
        return trainable, frozen

    assert dtypes("--use_peft", mixed_precision="bf16") == ({torch.float32}, {torch.bfloat16})
    assert dtypes("--use_peft", mixed_precision="no") == ({torch.float32}, {torch.float32})
    assert dtypes(mixed_precision="bf16") == ({torch.float32}, set()), "full fine-tuning: fp32 master weights"


def test_a_lora_folder_on_a_bf16_base_loads_with_the_dtypes_it_trained_in(tiny_decoders, tmp_path):
    """evaluate.py, in the run's bf16, loads the frozen base in bf16 as training had it and the trained head in fp32,
    exactly as saved: a head rounded to bf16 would score otherwise than the run's own evaluations did."""
    bf16 = tmp_path / "bf16"
    AutoModelForSequenceClassification.from_pretrained(tiny_decoders["llama"], dtype=torch.bfloat16).save_pretrained(
        bf16
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_decoders["llama"] / name, bf16 / name)
    model, tokenizer = built(bf16, "--use_peft", mixed_precision="bf16")
    out = tmp_path / "out"
    out.mkdir()  # as train.py made it
    save_model(Accelerator(cpu=True), model, out, AutoModelForSequenceClassification)
    loaded = load_trained_model(AutoModelForSequenceClassification, str(out), tokenizer.pad_token_id, "bf16")
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    again = dict(loaded.named_parameters())
    assert any(".modules_to_save." in n for n in trained), "the head is among the trained weights"
    changed = [n for n, p in trained.items() if again[n].dtype != torch.float32 or not torch.equal(again[n], p)]
    assert not changed, changed
    frozen = {p.dtype for n, p in loaded.named_parameters() if n not in trained and "original_module" not in n}
    assert frozen == {torch.bfloat16}


def test_lora_output_checkpoints_resume_and_evaluation(tiny_decoders, data, tmp_path):
    """One LoRA run (with dropout): what it saves, how it loads, and an exact resume from its first checkpoint."""
    base, out = tiny_decoders["llama"], tmp_path / "lora"
    lora = ("--use_peft", "--lora_r", "4", "--checkpointing_steps", "5", "--logging_steps", "1", "--max_length", "9")
    results = run_train(*train_args(base, *data, out, *lora))

    # The output: adapter and head, config (labels, pad token) and tokenizer; no copy of the base model.
    files = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "config.json", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    adapter = load_file(out / "adapter_model.safetensors")
    assert sum(t.numel() for t in adapter.values()) == results["trainable_parameters"] < results["total_parameters"]
    assert any("score" in key for key in adapter), "the head is saved with the adapter"
    assert (out / "adapter_model.safetensors").stat().st_size < (base / "model.safetensors").stat().st_size / 2
    checkpoint = weights(out / "checkpoint-5")
    assert all(".lora_" in key or ".modules_to_save." in key for key in checkpoint), "only the trainable weights"
    assert sum(t.numel() for t in checkpoint.values()) == results["trainable_parameters"]

    # The model card's code for inference (the README's line), run as written: labels and pad token come
    # from the folder, and batching changes no prediction.
    card = (out / "README.md").read_text()
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    loaded = {}
    exec(code, loaded)
    model, tokenizer = loaded["model"], loaded["tokenizer"]
    assert type(model).__name__ == "PeftModelForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"} and model.config.pad_token_id is not None
    assert_same_logits(*logits_alone_and_in_a_batch(model, tokenizer))

    # evaluate.py takes the folder and reproduces the run's final metrics (texts cut at the run's --max_length):
    # exactly with the run's evaluation batches; with its own batch size of 64 the batches pad the texts to other
    # lengths, which moves each loss in its last float32 bits (eval_loss sums them in float64, which shows it).
    final = {k: v for k, v in results.items() if k.startswith("eval_")}
    assert run_evaluate(out, data[1], tmp_path / "eval8", "--per_device_eval_batch_size", "8") == final
    metrics = run_evaluate(out, data[1], tmp_path / "eval")
    assert metrics == {**final, "eval_loss": pytest.approx(final["eval_loss"], rel=1e-6)}

    # A fresh folder with only the first checkpoint, resumed: bit for bit the uninterrupted run; with another LoRA
    # scale or rank it would continue another model (or fail to load the adapter's shapes): refused first.
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-5", resumed / "checkpoint-5")
    for flag, value in (("--lora_alpha", "64"), ("--lora_r", "8")):
        other = train_args(base, *data, resumed, *lora, flag, value, "--resume_from_checkpoint", "latest")
        with pytest.raises(UserError, match=f"made with other settings \\({flag} \\d+ -> {value}\\)"):
            run_train(*other)
    run_train(*train_args(base, *data, resumed, *lora, "--resume_from_checkpoint", str(resumed / "checkpoint-5")))
    again = load_file(resumed / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], again[k]) for k in adapter)

    def losses(folder, after=0):
        records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in records if r["step"] > after]

    assert losses(resumed) == losses(out, after=5)
    # The adapter's folder is no whole model to start another run from: said, not transformers' missing weights.
    with pytest.raises(UserError, match=f"--model_name_or_path {out} holds a LoRA adapter, not a whole model: start"):
        run_train(*train_args(out, *data, tmp_path / "next"))


def test_merged_lora_output_is_a_plain_model(tiny_decoders, data, tmp_path):
    out = tmp_path / "merged"
    results = run_train(*train_args(tiny_decoders["gpt2"], *data, out, "--use_peft", "--merge_lora"))
    assert not list(out.glob("adapter*")) and (out / "model.safetensors").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "GPT2ForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"} and "lora" not in str(list(weights(out)))
    # Its card loads it as the plain model it is (the flag asked for LoRA, but no adapter is left to load on a base).
    assert "library_name: transformers" in (out / "README.md").read_text()
    assert re.search(r"'label': '(negative|positive)'", run_model_card_snippet(out))
    metrics = run_evaluate(out, data[1], tmp_path / "eval")
    assert metrics["eval_accuracy"] == results["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], abs=1e-5)  # merging rounds: W + BA


def test_lora_on_a_base_whose_head_has_another_size_saves_merges_and_evaluates(tiny_decoders, data, tmp_path):
    """A 3-class base fine-tuned on 2 classes: the new head is trained and saved; loading the adapter again (to
    merge it, or in evaluate.py) puts it on that base without tripping over the base's own head."""
    base = tmp_path / "base-3-classes"
    AutoModelForSequenceClassification.from_pretrained(tiny_decoders["gpt2"], num_labels=3).save_pretrained(base)
    load_tokenizer(str(tiny_decoders["gpt2"])).save_pretrained(base)
    for merge in ([], ["--merge_lora"]):
        out = tmp_path / f"out{len(merge)}"
        results = run_train(*train_args(base, *data, out, "--use_peft", *merge))
        metrics = run_evaluate(out, data[1], tmp_path / f"eval{len(merge)}")
        assert metrics["eval_accuracy"] == results["eval_accuracy"]
        assert metrics["eval_loss"] == pytest.approx(results["eval_loss"], abs=1e-5)

    # The adapter folder moved away from its base, or damaged: one line that says which file to mend.
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "out0", moved)
    shutil.rmtree(base)
    with pytest.raises(UserError, match=f"set base_model_name_or_path in {moved / 'adapter_config.json'}"):
        load_trained_model(AutoModelForSequenceClassification, str(moved))
    (moved / "adapter_config.json").write_text("{not json")
    with pytest.raises(UserError, match="adapter_config.json cannot be read"):
        load_trained_model(AutoModelForSequenceClassification, str(moved))


def test_lora_flags_are_checked(tiny_decoders, data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        flags("--merge_lora")
    assert "--merge_lora merges a LoRA adapter into the model: it needs --use_peft" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        flags("--lora_r", "4", "--lora_dropout", "0.1")
    assert "--lora_r, --lora_dropout set(s) up LoRA: add --use_peft, or drop them" in capsys.readouterr().err
    assert flags("--lora_r", "4", "--use_peft").lora_r == 4
    args = train_args(tiny_decoders["llama"], *data, tmp_path / "out", "--use_peft", "--lora_target_modules", "qkv")
    with pytest.raises(
        UserError,
        match=r"--lora_target_modules qkv: No modules were targeted.*; name linear layers of "
        r"the backbone \(this model's: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\)",
    ):
        run_train(*args)
    defaults = flags()
    assert (defaults.lora_r, defaults.lora_alpha, defaults.lora_dropout) == (16, 32, 0.05)
    assert defaults.lora_target_modules == "all-linear" and not defaults.use_peft


# --- Memory -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_changes_no_result(tiny_decoders, data, tmp_path, lora):
    with warnings.catch_warnings():  # through transformers' current name, not the deprecated one
        warnings.filterwarnings("error", "`gradient_checkpointing_enable` is deprecated", FutureWarning)
        model, _ = built(tiny_decoders["llama"], "--gradient_checkpointing", *(["--use_peft"] if lora else []))
    assert (model.get_base_model() if lora else model).is_activation_checkpointing
    extra = ("--max_train_steps", "4", "--logging_steps", "1", *(["--use_peft"] if lora else []))  # LoRA dropout on
    plain = run_train(*train_args(tiny_decoders["llama"], *data, tmp_path / "plain", *extra))
    checkpointed = run_train(
        *train_args(tiny_decoders["llama"], *data, tmp_path / "gc", *extra, "--gradient_checkpointing")
    )

    def losses(folder):
        return [r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(tmp_path / "gc") == pytest.approx(losses(tmp_path / "plain"), abs=1e-6)
    assert checkpointed["eval_loss"] == pytest.approx(plain["eval_loss"], abs=1e-6)


def test_next_smaller_batch_size_keeps_the_total_exact():
    def sizes(requested):
        found = [requested]
        while found[-1]:
            found.append(next_smaller(found[-1], requested))
        return found

    assert sizes(32) == [32, 16, 8, 4, 2, 1, 0]
    assert sizes(12) == [12, 6, 3, 1, 0]
    assert sizes(10) == [10, 5, 2, 1, 0]
    assert sizes(7) == [7, 1, 0]


def test_auto_batch_size_backs_off_keeps_the_total_and_its_size_on_resume(
    tiny_model, data, tmp_path, monkeypatch, caplog
):
    """On the tiny BERT, which has dropout: the probe must leave no trace in the run (RNG, gradients)."""
    common = ("--max_train_steps", "4", "--checkpointing_steps", "2")
    monkeypatch.setattr(PreTrainedModel, "__call__", out_of_memory_above(2), raising=False)
    auto = run_train(*train_args(tiny_model, *data, tmp_path / "auto", *common, "--auto_find_batch_size"))
    assert "8 examples of up to" in caplog.text
    assert "--per_device_train_batch_size 2 and --gradient_accumulation_steps 4 (was 8 and 1)" in caplog.text
    saved = json.loads((tmp_path / "auto" / "args.json").read_text())
    assert (saved["per_device_train_batch_size"], saved["gradient_accumulation_steps"]) == (2, 4)
    assert auto["total_train_batch_size"] == 8 and auto["global_step"] == 4

    explicit = ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4")
    run_train(*train_args(tiny_model, *data, tmp_path / "explicit", *common, *explicit))
    a, b = weights(tmp_path / "auto"), weights(tmp_path / "explicit")
    assert all(torch.equal(a[k], b[k]) for k in a), "the same run as asking for 2 x 4"

    # Resumed on a machine with more memory, the run keeps the size it started with (and the same batches).
    monkeypatch.undo()
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "auto" / "checkpoint-2", resumed / "checkpoint-2")
    run_train(*train_args(tiny_model, *data, resumed, *common, "--auto_find_batch_size", "--resume_from_checkpoint",
                          str(resumed / "checkpoint-2")))  # fmt: skip
    c = weights(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a)
    # Another total batch than the run's is refused, not replaced by the sizes the run found for its own.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "auto" / "checkpoint-2", other / "checkpoint-2")
    made = r"made with 8 examples per process and optimizer step \(--per_device_train_batch_size 2 x "
    asks = r"--gradient_accumulation_steps 4\) and this run asks for 16 \(8 x 2\): resume with sizes that make 8"
    with pytest.raises(UserError, match=made + asks):
        run_train(*train_args(tiny_model, *data, other, *common, "--auto_find_batch_size", "--resume_from_checkpoint",
                              str(other / "checkpoint-2"), "--gradient_accumulation_steps", "2"))  # fmt: skip


def test_auto_batch_size_multiplies_the_accumulation_asked_for(tiny_model, data, tmp_path, monkeypatch, caplog):
    """8 rows accumulated twice, of which 2 fit: 2 rows accumulated 8 times, the total batch of 16 kept."""
    monkeypatch.setattr(PreTrainedModel, "__call__", out_of_memory_above(2), raising=False)
    auto = run_train(*train_args(tiny_model, *data, tmp_path / "auto", "--gradient_accumulation_steps", "2",
                                 "--max_train_steps", "1", "--auto_find_batch_size"))  # fmt: skip
    assert "--per_device_train_batch_size 2 and --gradient_accumulation_steps 8 (was 8 and 2)" in caplog.text
    assert auto["total_train_batch_size"] == 16


def test_auto_batch_size_also_fits_the_evaluation_batch(tiny_model, data, tmp_path, monkeypatch, caplog):
    """Training fits 8 rows, evaluation (without gradients, beside AdamW's moments) only 3: the evaluation batch
    is halved from 8 to 2, said in the log, saved in args.json, and the run evaluates as if asked for 2."""
    monkeypatch.setattr(PreTrainedModel, "__call__", out_of_memory_above(8, max_eval_rows=3), raising=False)
    auto = run_train(*train_args(tiny_model, *data, tmp_path / "auto", "--max_train_steps", "2",
                                 "--auto_find_batch_size"))  # fmt: skip
    assert "8 validation examples of up to" in caplog.text and "--per_device_eval_batch_size 2" in caplog.text
    saved = json.loads((tmp_path / "auto" / "args.json").read_text())
    assert (saved["per_device_train_batch_size"], saved["per_device_eval_batch_size"]) == (8, 2)
    monkeypatch.undo()
    explicit = run_train(*train_args(tiny_model, *data, tmp_path / "explicit", "--max_train_steps", "2",
                                     "--per_device_eval_batch_size", "2"))  # fmt: skip
    assert auto["eval_loss"] == explicit["eval_loss"] and auto["eval_accuracy"] == explicit["eval_accuracy"]


def test_auto_batch_size_refusals(tiny_model, data, tmp_path, monkeypatch):
    monkeypatch.setattr(PreTrainedModel, "__call__", out_of_memory_above(0), raising=False)
    with pytest.raises(UserError, match="--auto_find_batch_size: even 1 example of \\d+ tokens per device runs out"):
        run_train(*train_args(tiny_model, *data, tmp_path / "out", "--auto_find_batch_size"))
    for engine in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(UserError, match=f"cannot probe memory under {engine.value}.*set --per_device_train"):
            fit_batch_sizes(BatchSizes(8, 1, 8), SimpleNamespace(distributed_type=engine), None, None, None, TASK)


def test_auto_batch_size_reports_an_error_other_than_out_of_memory_as_it_is(tiny_model, data, tmp_path, monkeypatch):
    """A bug in the model or the task met by the probe is that bug, not "even 1 example runs out of memory"."""

    def broken(self, *args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x32 and 64x2)")

    monkeypatch.setattr(PreTrainedModel, "__call__", broken, raising=False)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_train(*train_args(tiny_model, *data, tmp_path / "out", "--auto_find_batch_size"))


# --- Two real processes -----------------------------------------------------------------------------------------


def test_full_fine_tuning_on_two_ranks_where_one_runs_out_of_memory(tiny_decoders, data, tmp_path, monkeypatch):
    """Rank 1 fits only 2 of the 4 examples asked for: both ranks train with 2 x 2 accumulation, like one rank
    with 4 x 2, and the decoder's padding token reaches the saved folder. Rank 1 also fits only 3 of the 8
    validation examples asked for: both ranks evaluate 2 at a time, and every example is still counted once."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = train_args(
        tiny_decoders["llama"], *data, two, "--per_device_train_batch_size", "4", "--auto_find_batch_size"
    )
    monkeypatch.setenv("FAKE_OOM", "1:2:3")
    result = launch("tests/fake_oom.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "rank 1: simulated out of memory" in log and "rank 0: simulated" not in log
    assert log.count("--per_device_train_batch_size 2 and --gradient_accumulation_steps 2") == 1
    assert log.count("evaluating with --per_device_eval_batch_size 2") == 1, "agreed by both ranks, logged once"
    assert json.loads((two / "args.json").read_text())["per_device_eval_batch_size"] == 2

    run_train(*train_args(tiny_decoders["llama"], *data, one, "--per_device_train_batch_size", "4",
                          "--gradient_accumulation_steps", "2"))  # fmt: skip
    results = json.loads((two / "all_results.json").read_text())
    assert results["num_processes"] == 2 and results["total_train_batch_size"] == 8
    assert results["eval_samples"] == 21, "batches of 2 on 2 ranks: the padding repeats are not counted"
    assert results["trainable_parameters"] == results["total_parameters"]
    a, b = weights(one), weights(two)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < WEIGHTS_ATOL, f"weights differ by up to {worst}"  # sums in another order
    assert AutoConfig.from_pretrained(two).pad_token_id == AutoTokenizer.from_pretrained(two).pad_token_id == 2


def test_lora_on_two_ranks_matches_one_rank_and_resumes_exactly(tiny_decoders, data, tmp_path):
    """With gradient accumulation and checkpointing; no LoRA dropout, whose random draws differ between 1 and 2
    ranks. 2 ranks x 2 examples x 2 accumulation steps see the same examples in each update as 1 x 4 x 2."""
    base = tiny_decoders["qwen2"]
    lora = ("--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--gradient_checkpointing", "--max_train_steps", "7",
            "--checkpointing_steps", "3", "--gradient_accumulation_steps", "2",
            "--per_device_train_batch_size", "2")  # fmt: skip
    two = tmp_path / "two"
    result = launch("train.py", train_args(base, *data, two, *lora))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (two / "model.safetensors").exists() and (two / "adapter_model.safetensors").exists()
    adapter = load_file(two / "adapter_model.safetensors")
    assert all(".lora_" in key or "score" in key for key in weights(two / "checkpoint-3"))

    one = tmp_path / "one"
    run_train(*train_args(base, *data, one, *lora[:-2], "--per_device_train_batch_size", "4"))
    single = load_file(one / "adapter_model.safetensors")
    worst = max((adapter[k] - single[k]).abs().max().item() for k in adapter)
    assert worst < WEIGHTS_ATOL, f"adapters differ by up to {worst}"  # sums in another order
    final = json.loads((two / "all_results.json").read_text())
    metrics = run_evaluate(two, data[1], tmp_path / "eval")
    assert metrics["eval_accuracy"] == final["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(final["eval_loss"], abs=1e-6)  # 2 ranks' sums in another order

    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoint-3", resumed / "checkpoint-3")
    result = launch("train.py", train_args(base, *data, resumed, *lora, "--resume_from_checkpoint", "latest"))
    assert result.returncode == 0, result.stderr[-3000:]
    again = load_file(resumed / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], again[k]) for k in adapter), "bit for bit the uninterrupted run"


def test_the_random_llm_builder_makes_what_train_py_reads(tmp_path, monkeypatch):
    """examples/make_random_llm.py, at its tiny size: a Llama-layout model, no padding token, labelled long texts."""
    import importlib.util
    import sys

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("make_random_llm", REPO / "examples" / "make_random_llm.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    argv = ["make_random_llm.py", "--size", "tiny", "--output", str(tmp_path / "m"), "--data", str(tmp_path / "d")]
    monkeypatch.setattr(sys, "argv", [*argv, "--words", "40", "--rows", "10"])
    builder.main()
    assert AutoTokenizer.from_pretrained(tmp_path / "m").pad_token is None
    model, tokenizer = built(tmp_path / "m")
    assert type(model).__name__ == "LlamaForSequenceClassification" and tokenizer.pad_token == "<|end_of_text|>"
    rows = list(csv.DictReader((tmp_path / "d" / "train.csv").read_text().splitlines()))
    assert len(rows) == 10 and all(len(row["sentence"].split()) >= 40 for row in rows)
    assert {row["label"] for row in rows} <= {"negative", "positive"}
    assert tokenizer.unk_token_id not in tokenizer(rows[0]["sentence"])["input_ids"], "the tokenizer knows every word"


def gpu_check_commands(stage: str, gpus: int | None = None) -> str:
    """What examples/llm_gpu_check.sh would run for `stage` with `gpus` GPUs, or as many as nvidia-smi lists (none
    here): its DRY_RUN mode, bash only."""
    import subprocess

    from conftest import REPO

    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "WORK": "/work-dir"} | ({"GPUS": str(gpus)} if gpus else {})
    result = subprocess.run(["bash", "examples/llm_gpu_check.sh", stage], cwd=REPO, env=env, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_the_gpu_check_shards_fsdp_over_several_gpus_and_says_one_gpu_shards_nothing():
    sharded, single = gpu_check_commands("fsdp-full", 2), gpu_check_commands("fsdp-full")
    assert "accelerate_configs/fsdp.yaml --num_processes 2 train.py" in sharded and "sharded over 2 GPUs" in sharded
    assert "--num_processes 1 train.py" in single and "shards nothing, a smoke test only" in single
    checks = [line for line in gpu_check_commands("single").splitlines() if line.startswith("check: ")]
    assert [line.split()[1] for line in checks] == ["batch", "resume", "evaluate", "evaluate"]
    assert "dry run, nothing was run" in single and "every check passed" not in single


def test_the_gpu_checks_fail_with_a_reason_when_a_number_is_off(tmp_path, capsys):
    """examples/llm_gpu_check.py, which decides whether the GPU check passed, on made-up run folders."""
    import importlib.util

    from conftest import REPO
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("llm_gpu_check", REPO / "examples" / "llm_gpu_check.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)

    def run_folder(name, weight, losses, eval_loss):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"w": torch.full((3,), weight)}, folder / "adapter_model.safetensors")
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses))
        metrics = {"eval_loss": eval_loss, "eval_accuracy": 0.5, "eval_samples": 64}
        (folder / "all_results.json").write_text(json.dumps(metrics))
        (folder / "eval_results.json").write_text(json.dumps(metrics))
        return str(folder)

    run = run_folder("run", 0.1, [(5, 0.7), (15, 0.6)], 0.69)
    assert checks.main(["resume", run, run_folder("resumed", 0.1, [(15, 0.6)], 0.69)]) == 0
    assert checks.main(["resume", run, run_folder("lost-step", 0.1 + 2e-4, [(15, 0.6)], 0.69)]) == 1
    assert "final weights differ from the uninterrupted run's by up to 0.0002" in capsys.readouterr().err
    assert checks.main(["evaluate", run, run_folder("evaluated", 0.1, [], 0.6901)]) == 0
    assert checks.main(["evaluate", run, run_folder("other-model", 0.1, [], 0.75)]) == 1
    assert "evaluate.py gives loss 0.75" in capsys.readouterr().err
    (tmp_path / "low.mem").write_text("100\n900\n")
    (tmp_path / "high.mem").write_text("100\n950\n")
    assert checks.main(["less-memory", str(tmp_path / "low.mem"), str(tmp_path / "high.mem")]) == 0
    assert checks.main(["less-memory", str(tmp_path / "high.mem"), str(tmp_path / "low.mem")]) == 1
