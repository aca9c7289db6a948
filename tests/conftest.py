"""Shared fixtures: a tiny random BERT and tiny datasets, all made in temporary folders (no network)."""

import contextlib
import csv
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
# The README's command runs 2 pytest-xdist workers, `--dist loadfile` keeping each file on one worker so that its
# module fixtures (trained models, launches) are built once. The workers share the cores: each run, in process or
# launched, would otherwise take every core as if alone (src/runtime.py), and OpenMP threads kept waiting for a busy
# core cost more than they give. An exported OMP_NUM_THREADS is a user's choice there: one thread per process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite tests CPU runs (gloo ranks, the CPU's precision rules, fp32 comparisons): on a machine with GPUs the
# in-process runs and every launched rank stay on the CPU, so the same assertions hold there.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The precision decision's per-machine cache (src/precision.py): the tests neither read nor write the user's.
os.environ["FINETUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="finetune-cache-")
# pytest started in the background by a script (`pytest &`: some CI runners, nohup) finds SIGINT ignored, which
# train.py rightly keeps and every process a test starts inherits: the Ctrl-C tests run as from a terminal instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Collecting the tests imports torch, transformers, datasets and accelerate: no garbage, but the collector would scan
# what they make over and over. Off until collection has ended, then frozen (never scanned again), as the scripts
# do after their imports; the in-process runs' own collections then stay cheap.
gc.disable()


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"
SHARED_DATA = REPO.parent / "shared" / "data"  # real data beside the clone (CI puts it there); never copied in
SST2 = SHARED_DATA / "sst2"


def read_shared(path: Path) -> str:
    """A file of the real data beside the clone; a clone without it (a copy of the template elsewhere) skips the test
    that reads it, with the reason, rather than failing."""
    if not path.is_file():
        pytest.skip(f"no {path}: the real data beside the clone (CI has it)")
    return path.read_text()


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
    """Every word piece of the test sentences as BERT's pre-tokenizer splits them ("so-so" is so, -, so)."""
    from tokenizers.pre_tokenizers import BertPreTokenizer

    from src.demo_data import NEGATIVE, POSITIVE, SUBJECTS, TEMPLATES

    texts = SUBJECTS + [t.replace("{", " ").replace("}", " ") for t, _ in TEMPLATES] + POSITIVE + NEGATIVE
    texts += ["neutral okay fine so so-so"]
    words = {piece for text in texts for piece, _ in BertPreTokenizer().pre_tokenize_str(text)}
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(words)


def make_tiny_model(folder: Path, dropout: float = 0.1) -> Path:
    """A 2-layer BERT with hidden size 32 and a word-level vocabulary of the test sentences."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    # vocab=, not vocab_file=: transformers 5 ignores vocab_file here and every word would become [UNK].
    vocabulary = {word: i for i, word in enumerate(_vocabulary())}
    BertTokenizerFast(vocab=vocabulary, model_max_length=64).save_pretrained(folder)
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


def score_rows(count: int, seed: int = 0) -> list[dict]:
    """Text pairs with a float score (a regression task) that follows the sentiment of the first text."""
    return [
        {"sentence1": r["sentence"], "sentence2": "so so", "score": float(r["label"] == "positive") + (i % 3) / 4}
        for i, r in enumerate(sentiment_rows(count, seed))
    ]


def sentiment_files(folder: Path, train_rows: int, dev_rows: int) -> tuple[Path, Path]:
    """(train.csv, dev.csv) of demo sentences with string labels, from seeds 1 and 2."""
    return (write_rows(folder / "train.csv", sentiment_rows(train_rows, seed=1)),
            write_rows(folder / "dev.csv", sentiment_rows(dev_rows, seed=2)))  # fmt: skip


@pytest.fixture
def tiny_data(tmp_path) -> tuple[Path, Path]:
    """(train.csv with 64 rows, dev.csv with 37 rows): string labels, an uneven validation size."""
    return sentiment_files(tmp_path, 64, 37)


# Two fp32 runs of the same training whose sums run in another order (1 rank of 8 rows or 2 ranks of 4, or
# accumulation) are equal up to rounding. Each sum of n float32 terms is off by at most ~n * 2^-24 of its size:
# relative ~1e-6 for the tests' batches and hidden sizes. AdamW turns a relative change of a gradient into at most
# the same relative change of the update, and an update is at most ~lr = 1e-3, so over the tests' <= 16 steps the
# weights may drift apart by ~16 * 1e-3 * 1e-6 = 2e-8, times whatever the steps amplify it (measured: ~1e-6).
# WEIGHTS_ATOL leaves that amplification a 100x margin and stays 10x under a single step's lr; a lost or doubled
# gradient changes the loss at once, which the tests check at LOSS_ATOL (losses are ~0.7; 1e-6 relative is 1e-6).
WEIGHTS_ATOL = 1e-4
LOSS_ATOL = 1e-5


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


def free_port() -> str:
    """A port that the operating system just found free (not the global `random`, which train.main reseeds: two
    launches after runs with the same seed would draw the same port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def launch_command(script: str, args: list[str], num_processes: int = 2, config: Path = CPU_CONFIG) -> list[str]:
    """`accelerate launch` with really `num_processes` CPU ranks (gloo), on a free port, in fp32 (the GPU configs
    ask for bf16)."""
    port = free_port()
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--mixed_precision",
                "no"]  # fmt: skip
    return [*launcher, "--num_processes", str(num_processes), "--main_process_port", port, str(REPO / script), *args]


def run_process(command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True), except that on a timeout every process it started
    is killed, not only the first: a launcher's ranks (torchrun starts each in a session of its own) and their
    workers, so that none writes on into the next test."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@contextmanager
def another_run_holding(folder: Path):
    """A process that holds `folder` as a run does (its lock on it) until the block ends; yields that process's pid."""
    hold = f"from src.checkpoint import _lock; lock = _lock({str(folder)!r}, False); print('held'); input()"
    holder = subprocess.Popen([sys.executable, "-u", "-c", hold], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def kill_tree(process: subprocess.Popen):
    """Kill a process and every process below it, wherever their sessions are, and reap them."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        psutil.wait_procs(tree, timeout=30)
    process.communicate()


def launch(
    script: str,
    args: list[str],
    num_processes: int = 2,
    timeout: int = 300,
    config: Path = CPU_CONFIG,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run a real multi-process launch to its end (every process of it killed on a timeout); `env`: variables of
    this launch only, over the test's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_process(launch_command(script, args, num_processes, config), timeout, cwd=REPO, env=env)


def launch_together(*launches: dict) -> list[subprocess.CompletedProcess]:
    """Independent launches (each a dict of `launch`'s arguments) run at once. A launch spends its first seconds on one
    core, importing libraries in the launcher before its ranks start: two together keep a 2-core machine busier than
    one after the other (2 tiny 2-rank runs: 15 s together, 17-18 s in turn)."""
    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        return list(pool.map(lambda arguments: launch(**arguments), launches))


# The 2-rank reference run's settings beyond train_args: 2 ranks x 4 (the 1-rank twin uses 8), evaluation every 3
# steps, the best model by the *highest* eval loss (so an early evaluation is the best and "final = best" can fail),
# early stopping after 3 evaluations without improvement (in epoch 2), checkpoints every 2 steps rotated to 2.
TWO_RANK_FLAGS = ["--logging_steps", "1", "--eval_steps", "3", "--metric_for_best_model", "loss", "--greater_is_better",
                  "--load_best_model_at_end", "--early_stopping_patience", "3", "--checkpointing_steps", "2",
                  "--save_total_limit", "2"]  # fmt: skip


def launched_once(tmp_path_factory, name: str, launch_run) -> dict:
    """A session fixture's 2-rank run, `launch_run(folder)`: {"args": [model, train file, validation file], "flags",
    "output_dir", "log"}. Each pytest-xdist worker has a session of its own, which would launch the run again (~20 s
    of 2 cores): the first worker to ask launches it, into the folder the workers share, and the others read it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, which holds each worker's own
    record = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not record.is_file():
            record.write_text(json.dumps(launch_run(shared / name), default=str))
    run = json.loads(record.read_text())
    return {**run, "args": [Path(word) for word in run["args"]], "output_dir": Path(run["output_dir"])}


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, tiny_model_no_dropout):
    """One 2-process training run (4 rows per rank, dropout 0), shared by the tests that check what 2 ranks do.

    Real ranks (not in-process): DDP gradient averaging, sharding, gather_for_metrics, one writer, the early-stop
    and best-model decisions taken on every rank alike, and the saved weights of a wrapped model. Each rank collates
    in a worker process, as runs on GPUs do by default: the batches each rank sees and evaluates must be the same as
    collated in the rank. To reproduce it elsewhere: train_args(*run["args"], output_dir, *run["flags"]). Read-only.
    """

    def launch_run(folder: Path) -> dict:
        folder.mkdir()
        train_file = write_rows(folder / "train.csv", sentiment_rows(64, seed=1))
        dev_file = write_rows(folder / "dev.csv", sentiment_rows(21, seed=2))
        args = [tiny_model_no_dropout, train_file, dev_file]
        flags = ["--per_device_train_batch_size", "4", *TWO_RANK_FLAGS]
        result = launch("train.py", train_args(*args, folder / "out", *flags, "--dataloader_num_workers", "1"))
        assert result.returncode == 0, result.stderr[-3000:]
        return {"args": args, "flags": flags, "output_dir": folder / "out", "log": result.stdout + result.stderr}

    return launched_once(tmp_path_factory, "two-ranks", launch_run)


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


def run_in_process(script, argv: list[str]):
    """train.py's or evaluate.py's main() in this process, leaving no Accelerate state behind (for fixtures)."""
    from accelerate.state import AcceleratorState, GradientState

    module = load_script(script)
    parse = module.parse_train_args if script == "train" else module.parse_eval_args
    try:
        return module.main(parse(argv))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(scope="session")
def trained_tiny_model(tmp_path_factory, tiny_model) -> Path:
    """A train.py output folder (1 epoch of the tiny BERT on 48 rows, string labels negative/positive), for the
    tests that evaluate a trained model. Read-only: evaluate it with --output_dir elsewhere."""
    folder = tmp_path_factory.mktemp("trained")
    train_file = write_rows(folder / "train.csv", sentiment_rows(48, seed=3))
    dev_file = write_rows(folder / "dev.csv", sentiment_rows(16, seed=4))
    run_in_process("train", train_args(tiny_model, train_file, dev_file, folder / "model", "--num_train_epochs", "1"))
    return folder / "model"


def reference_logits(model_dir: Path, texts: list[str], pairs: list[str] | None = None):
    """The saved model's logits, one example at a time with plain transformers: no padding, no batching, nothing
    from src/ or the scripts, to check what train.py and evaluate.py report against."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.cat(
            [
                model(**tokenizer(text, pairs[i] if pairs else None, truncation=True, return_tensors="pt")).logits
                for i, text in enumerate(texts)
            ]
        )


def tensor_names(path: Path) -> set[str]:
    """Every tensor name in a safetensors file's header."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return set(file.keys())


@pytest.fixture(scope="session")
def two_rank_dropout_run(tmp_path_factory, tiny_model):
    """A 2-process regression run on text pairs with dropout 0.1 (4 rows per rank, checkpoints every 4 steps).

    Real ranks: regression predictions gathered from 2 ranks, and dropout under DDP, where each rank draws
    masks from the same seeded stream for its own rows, so the run cannot equal 1 rank of 8. What holds instead:
    it is reproducible from run to run (test_multinode starts it again on two 'machines') and it differs from
    the same run without dropout (test_distributed).
    """

    def launch_run(folder: Path) -> dict:
        folder.mkdir()
        train_file = write_rows(folder / "train.jsonl", score_rows(64, seed=1))
        dev_file = write_rows(folder / "dev.parquet", score_rows(21, seed=2))
        args = [tiny_model, train_file, dev_file]
        flags = ["--per_device_train_batch_size", "4", "--label_column", "score", "--checkpointing_steps", "4"]
        result = launch("train.py", train_args(*args, folder / "out", *flags, "--dataloader_num_workers", "1"))
        assert result.returncode == 0, result.stderr[-3000:]
        return {"args": args, "flags": flags, "output_dir": folder / "out", "log": result.stdout + result.stderr}

    return launched_once(tmp_path_factory, "two-ranks-dropout", launch_run)


def run_model_card_snippet(folder: Path) -> str:
    """Run the Python the model card (folder/README.md) shows for using the model; what it printed."""
    import io
    import re
    from contextlib import redirect_stdout

    code = re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.DOTALL).group(1)
    printed = io.StringIO()
    with redirect_stdout(printed):
        exec(compile(code, str(folder / "README.md"), "exec"), {})
    return printed.getvalue()
