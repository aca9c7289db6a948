"""Shared fixtures: a tiny random BERT and tiny datasets, all made in temporary folders (no network)."""

import csv
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process main() starts from a clean Accelerate state and thread count, as a new process would."""
    import torch

    threads = torch.get_num_threads()
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.set_num_threads(threads)


def _vocabulary() -> list[str]:
    from src.demo_data import NEGATIVE, POSITIVE, SUBJECTS, TEMPLATES

    words = {
        w for text in SUBJECTS + [t for t, _ in TEMPLATES] for w in text.replace("{", " ").replace("}", " ").split()
    }
    words |= set(POSITIVE) | set(NEGATIVE) | {"neutral", "okay", "fine", "so", "so-so"}
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(words)


def make_tiny_model(folder: Path, dropout: float = 0.1) -> Path:
    """A 2-layer BERT with hidden size 32 and a word-level vocabulary of the test sentences."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(_vocabulary()) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), model_max_length=64).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(_vocabulary()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    import torch

    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_model_no_dropout(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows to .csv/.tsv/.json/.jsonl/.parquet, chosen by the file's extension."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    suffix = path.suffix
    if suffix in (".csv", ".tsv"):
        frame.to_csv(path, index=False, sep="\t" if suffix == ".tsv" else ",", quoting=csv.QUOTE_MINIMAL)
    elif suffix == ".json":
        frame.to_json(path, orient="records")
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    return path


def sentiment_rows(count: int, seed: int = 0) -> list[dict]:
    from src.demo_data import _sentence

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        sentence, label = _sentence(rng)
        rows.append({"sentence": sentence, "label": ["negative", "positive"][label]})
    return rows


@pytest.fixture
def tiny_data(tmp_path) -> tuple[Path, Path]:
    """(train.csv with 64 rows, dev.csv with 37 rows): string labels, an uneven validation size."""
    return write_rows(tmp_path / "train.csv", sentiment_rows(64, seed=1)), write_rows(
        tmp_path / "dev.csv", sentiment_rows(37, seed=2)
    )


def train_args(model: Path, train: Path, dev: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(model),
        "--train_file",
        str(train),
        "--validation_file",
        str(dev),
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--num_train_epochs",
        "2",
        "--learning_rate",
        "1e-3",
        "--report_to",
        "none",
        "--seed",
        "7",
        # fp32 everywhere: the default picks bf16 on CPUs with AMX, and the tests compare weights across runs.
        "--mixed_precision",
        "no",
        *extra,
    ]


def load_script(name: str):
    """train.py or evaluate.py as a module (evaluate.py would clash with the `evaluate` package by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_command(script: str, args: list[str], num_processes: int = 2) -> list[str]:
    """`accelerate launch` with really `num_processes` CPU ranks (gloo), on a random free-ish port."""
    port = str(random.randint(20000, 40000))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    return [*launcher, "--num_processes", str(num_processes), "--main_process_port", port, str(REPO / script), *args]


def launch(script: str, args: list[str], num_processes: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = launch_command(script, args, num_processes)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, tiny_model_no_dropout):
    """One 2-process training run (4 rows per rank), shared by the tests that compare other setups with it."""
    folder = tmp_path_factory.mktemp("two-ranks")
    train_file = write_rows(folder / "train.csv", sentiment_rows(64, seed=1))
    dev_file = write_rows(folder / "dev.csv", sentiment_rows(21, seed=2))
    args = [str(tiny_model_no_dropout), train_file, dev_file]
    result = launch("train.py", train_args(*args, folder / "out", "--per_device_train_batch_size", "4"))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"args": args, "output_dir": folder / "out", "log": result.stdout + result.stderr}


# Tiny random decoders in the layouts people fine-tune today. Their tokenizers, like Llama's and GPT-2's, have no
# padding token. None has dropout, so runs can be compared exactly.
DECODER_LAYOUTS = ("llama", "qwen2", "gpt2")


def make_tiny_decoder(folder: Path, layout: str) -> Path:
    """A 2-layer causal LM (hidden size 32) and a tokenizer made offline with the `tokenizers` library: Llama's a
    word-level one that adds a BOS token, Qwen2's and GPT-2's a byte-level BPE whose one special token is
    <|endoftext|>, trained on the demo sentences."""
    import json

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    if layout == "llama":
        bos, eos, unk = "<s>", "</s>", "<unk>"
        words = {token: i for i, token in enumerate([unk, bos, eos, *_vocabulary()[5:]])}
        backend = Tokenizer(models.WordLevel(words, unk_token=unk))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, words[bos])]
        )
    else:
        bos = eos = unk = "<|endoftext|>"
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        texts = [" ".join(_vocabulary()[5:])] + [row["sentence"] for row in sentiment_rows(200)]
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=[eos], initial_alphabet=alphabet, show_progress=False
        )
        backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)  # model_max_length: the huge "no limit" sentinel, as many LLM tokenizers have
    # Said explicitly: transformers loads any qwen2 model's tokenizer as Qwen2Tokenizer, which pads with
    # <|endoftext|> unless told there is no padding token.
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": None}, indent=2))

    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if layout == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **ids)  # fmt: skip
    else:
        config_class = LlamaConfig if layout == "llama" else Qwen2Config
        config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, **ids)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_decoders(tmp_path_factory) -> dict[str, Path]:
    return {layout: make_tiny_decoder(tmp_path_factory.mktemp(f"tiny-{layout}"), layout) for layout in DECODER_LAYOUTS}
