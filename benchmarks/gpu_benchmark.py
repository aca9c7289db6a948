"""GPU throughput: train.py against transformers' Trainer, tokens/s, MFU and peak memory, in one command.

    python benchmarks/gpu_benchmark.py --report_dir $OUT          # one GPU, about 6 minutes end to end
    python benchmarks/gpu_benchmark.py --tiny --report_dir /tmp/g  # tiny models on the CPU: checks the plumbing

Models are random-initialised from their configs (speed does not depend on the weights, and nothing is
downloaded): a MiniLM-size and a BERT-base-size encoder, each trained by train.py and by Trainer with the same
GPU settings (bf16, SDPA attention, fused AdamW, torch.compile), Trainer twice: at its defaults (collating in its
process) and with as many collating workers as train.py's default; and a ~1B Llama-layout classifier trained
by train.py with LoRA (`--use_peft`) and in full under accelerate_configs/fsdp.yaml with 1 process. The data
are rows of random words from a word-level tokenizer made here, each truncated to exactly --seq_len tokens.

tokens/s is the steady rate: the steps after the first --skip_steps (compilation, warm-up), synchronised with
the GPU at both ends. MFU = model FLOPs per token x tokens/s / the measured bf16 matmul rate
(benchmarks/matmul_peak.py), with 6 N FLOPs per token for full fine-tuning and 4 N for LoRA (frozen weights get
no weight gradient), N the non-embedding parameters; attention's own FLOPs are left out. Peak memory is the
GPU's memory in use (nvidia-smi, every 0.2 s) less what was in use before the run, so it includes the run's CUDA
context (~0.5 GiB). A final short run with `torch.cuda.set_sync_debug_mode("warn")` counts the places where
train.py's run makes the host wait for the GPU. Runs that would not end within --budget_s are skipped, and said so.

With --diagnose, two diagnoses of where a step's time goes: first, one BERT-base step (eager, then each layer
compiled) queued behind a GPU sleep, which gives the GPU's own time for the step; then the host's Python stacks of
the first model's runs sampled by py-spy (waiting included) into <run>.folded, one line per stack.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))

VOCAB_WORDS = 30517  # + 5 special tokens: BERT's vocabulary size
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# name: (layout, sizes); TINY: the same layouts at toy sizes for the CPU check.
MODELS = {
    "minilm": ("bert", dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)),
    "bert-base": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)),
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            intermediate_size=5632,
        ),
    ),  # fmt: skip  # TinyLlama-1.1B's layout
}
TINY = {
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "llama": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
    ),
}
# (run name, model, runner, per-device batch, steps); runner: ours (defaults: on a GPU, collating workers; each layer
# compiled by accelerate's regional compilation) | in-process (ours collating in the process, --dataloader_num_workers
# 0: the default before 2026-11-27) | whole (in-process with the whole model compiled, as Trainer's torch_compile=True
# does) | trainer (its defaults: collating in the process) | trainer-workers (with as many collating workers as ours) |
# lora | fsdp.
RUNS = [  # most wanted first: runs that would overrun the budget are the ones skipped
    ("bert-base train.py", "bert-base", "ours", 128, 150),
    ("bert-base Trainer", "bert-base", "trainer", 128, 150),
    ("bert-base Trainer, collating workers", "bert-base", "trainer-workers", 128, 150),
    ("minilm train.py", "minilm", "ours", 256, 150),
    ("minilm Trainer", "minilm", "trainer", 256, 150),
    ("minilm Trainer, collating workers", "minilm", "trainer-workers", 256, 150),
    ("bert-base train.py, collating in the process", "bert-base", "in-process", 128, 150),
    ("bert-base train.py, whole model compiled", "bert-base", "whole", 128, 150),
    ("llama-1b LoRA train.py", "llama-1b", "lora", 16, 60),
    ("llama-1b full FSDP train.py", "llama-1b", "fsdp", 16, 60),
]
RUNNERS = ["ours", "trainer", "trainer-workers", "in-process", "whole", "lora", "fsdp"]
GROUPS = {"minilm": ["minilm"], "bert-base": ["bert-base"], "llama": ["llama-1b"]}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report_dir", type=Path, default=BENCHMARKS / "results" / "gpu", help="Table, JSON, logs.")
    parser.add_argument("--work_dir", type=Path, default=BENCHMARKS / "results" / "gpu_work", help="Models and data.")
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS), help="Model groups to run.")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=RUNNERS, help="Runs of these runners.")
    parser.add_argument("--seq_len", type=int, default=128, help="Tokens per row (every row is this long).")
    parser.add_argument("--skip_steps", type=int, default=40, help="Warm-up steps left out of the steady rate.")
    parser.add_argument("--budget_s", type=float, default=450, help="Skip runs that would end after this many s.")
    parser.add_argument("--no_compile", action="store_true", help="Leave torch.compile off for both runners.")
    parser.add_argument("--no_sync_check", action="store_true", help="Skip the host-sync count.")
    parser.add_argument("--diagnose", action="store_true",
                        help="Before the runs, the GPU's own time for a BERT-base step; during the first "
                             "model's runs, their Python stacks sampled by py-spy (idle included), to "
                             "<run>.folded.")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="Toy sizes, few steps, CPU allowed: test the plumbing.")
    parser.add_argument("--sync_check", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args()


def make_tokenizer(folder: Path):
    """A word-level BERT tokenizer over w0 ... w30516: one token per word, so row lengths are exact."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = SPECIAL + [f"w{i}" for i in range(VOCAB_WORDS)]
    # vocab=, not vocab_file=: transformers 5 ignores the file and would read every word as [UNK].
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)}, model_max_length=512)
    tokenizer.save_pretrained(folder)
    return tokenizer


def write_rows(path: Path, rows: int, words: int, seed: int):
    """sentence<TAB>label rows of random words; the label says whether the first word is in the upper half."""
    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for _ in range(rows):
        ids = [rng.randrange(VOCAB_WORDS) for _ in range(words)]
        lines.append(" ".join(f"w{i}" for i in ids) + f"\t{int(ids[0] >= VOCAB_WORDS // 2)}")
    path.write_text("\n".join(lines) + "\n")


def make_model(name: str, folder: Path, tiny: bool, device: str) -> dict:
    """A random-initialised classifier saved (bf16 weights) with the tokenizer; its parameter counts."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig, LlamaConfig

    kind, sizes = MODELS[name]
    sizes = TINY[kind] if tiny else sizes
    common = dict(vocab_size=len(SPECIAL) + VOCAB_WORDS, num_labels=2, pad_token_id=0, **sizes)
    config = BertConfig(**common) if kind == "bert" else LlamaConfig(max_position_embeddings=2048, **common)
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.bfloat16)
    embeddings = model.get_input_embeddings().weight.numel()
    if kind == "bert":
        embeddings = sum(p.numel() for p in model.base_model.embeddings.parameters())
    total = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    for file in (folder.parent / "tokenizer").iterdir():
        shutil.copy2(file, folder / file.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # give the memory back: the runs' peak memory is read off the whole GPU
    return {"total": total, "non_embedding": total - embeddings}


class MemoryPoll:
    """The most GPU memory in use (MiB) while the block runs, less what was in use before; None without nvidia-smi."""

    QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

    def __enter__(self):
        self.peak, self.process = None, None
        if shutil.which("nvidia-smi"):
            self.before = int(subprocess.run(self.QUERY, capture_output=True, text=True).stdout.split()[0])
            self.process = subprocess.Popen([*self.QUERY, "-lms", "200"], stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self.read, daemon=True)
            self.thread.start()
        return self

    def read(self):
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak or 0, int(line.split()[0]) - self.before)

    def __exit__(self, *exc_info):
        if self.process:
            self.process.terminate()
            self.process.wait()


def ours_command(runner: str, model: Path, data: dict, batch: int, steps: int, out: Path, args, gpu: bool) -> list:
    train_args = ["--model_name_or_path", str(model), "--train_file", str(data["train"]),
                  "--validation_file", str(data["validation"]), "--max_length", str(args.seq_len),
                  "--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", str(batch),
                  "--max_train_steps", str(steps), "--learning_rate", "5e-5",
                  "--logging_steps", "2" if args.tiny else "10",
                  "--report_to", "none", "--output_dir", str(out), "--overwrite_output_dir"]  # fmt: skip
    if runner == "lora":
        train_args += ["--use_peft"]
    if runner in (
        "in-process",
        "whole",
    ):  # whole: as measured on 2026-11-27, when collating in the process was the default
        train_args += ["--dataloader_num_workers", "0"]
    if not gpu:
        return [sys.executable, str(REPO / "train.py"), *train_args]
    config = "fsdp.yaml" if runner == "fsdp" else "single_gpu.yaml"
    config_file = str(REPO / "accelerate_configs" / config)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file, "--num_processes", "1"]
    if runner in ("ours", "in-process", "whole") and not args.no_compile:
        # Accelerate's own switch: prepare() compiles the model with inductor, by default each repeated layer once
        # (fast to compile).
        launch += ["--dynamo_backend", "inductor"]
        launch += [] if runner == "whole" else ["--dynamo_use_regional_compilation"]
    return [*launch, str(REPO / "train.py"), *train_args]


def trainer_command(model: Path, data: dict, batch: int, steps: int, out: Path, args, gpu: bool) -> list:
    command = [sys.executable, str(BENCHMARKS / "peer_trainer.py"), "--model_name_or_path", str(model),
               "--train_file", str(data["train"]), "--validation_file", str(data["validation"]),
               "--max_length", str(args.seq_len), "--per_device_train_batch_size", str(batch),
               "--per_device_eval_batch_size", str(batch), "--max_steps", str(steps),
               "--optim", "adamw_torch_fused", "--timing_skip_steps", str(args.skip_steps),
               "--results", str(out / "results.json"), "--output_dir", str(out / "model")]  # fmt: skip
    if gpu:
        command += ["--bf16"] + ([] if args.no_compile else ["--torch_compile"])
    return command


def steady_rate_ours(out: Path, batch: int, skip: int) -> tuple[float, float] | None:
    """(tokens/s, rows) over the logged windows after step `skip`, from train.py's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = tokens = 0.0
    previous = 0
    for record in records:
        if "tokens_per_second" not in record:
            continue
        window = (record["step"] - previous) * batch / record["samples_per_second"]
        if previous >= skip:
            seconds += window
            tokens += window * record["tokens_per_second"]
        previous = record["step"]
    return (tokens / seconds) if seconds else None


def gpu_ms_per_step(folder: Path, batch: int, seq_len: int, regional: bool) -> float:
    """The GPU's own time for one training step of the saved classifier on a batch already on the GPU (bf16 autocast,
    fused AdamW, SDPA, as the runs): the step is queued behind a ~1 s GPU sleep, so the GPU, once awake, runs its
    kernels back to back whatever the host's pace. Best of 3. `regional`: each layer compiled, as accelerate's
    regional compilation does."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = model.cuda().train()
    if regional:
        for layer in model.base_model.encoder.layer:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
    ids = torch.randint(len(SPECIAL), VOCAB_WORDS, (batch, seq_len), device="cuda")
    labels = torch.randint(0, 2, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000_000)  # cycles: ~1 s
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(min(times), 2)


def sync_check(argv: list[str]):
    """In this process: train.py's main() with CUDA's sync debug mode on; prints where the host waited for the GPU.

    The mode is on for the whole run, so the places are counted by file and line: train.py's are the training loop's,
    src/evaluation.py's the gathering of predictions (which syncs by design)."""
    import importlib.util
    import warnings
    from collections import Counter

    import torch

    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = train.parse_train_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():  # on the CPU (the --tiny check) there is nothing to watch
            torch.cuda.set_sync_debug_mode("warn")
        try:
            results = train.main(args)
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
    places = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower())
    print("SYNC_CHECK " + json.dumps({"steps": results["global_step"], "places": dict(places.most_common(16))}))


def main():
    args = parse_args()
    if args.sync_check is not None:
        return sync_check(args.sync_check)
    started = time.perf_counter()
    import torch
    import transformers
    from matmul_peak import measure

    sys.path.append(str(REPO))  # last: the repo's evaluate.py must not hide the library
    from src.loaders import collating_workers

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu and not args.tiny:
        raise SystemExit("no CUDA GPU: run with --tiny to check the script on the CPU")
    if args.diagnose and not shutil.which("py-spy"):
        raise SystemExit("--diagnose samples with py-spy, not on the PATH (benchmarks/gpu_prepare.sh fetches it)")
    runs = [run for run in RUNS if any(run[1] in GROUPS[group] for group in args.only) and run[2] in args.runners]
    if args.tiny:
        runs = [(name, model, runner, 4, 6) for name, model, runner, _, _ in runs if runner != "fsdp" or gpu]
    if not runs:
        fsdp = " (FSDP runs need a GPU)" if "fsdp" in args.runners and not gpu else ""
        raise SystemExit(f"no run of {' '.join(args.runners)} on {' '.join(args.only)}{fsdp}: see RUNS")
    args.report_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    if args.tiny:
        args.seq_len, args.skip_steps = min(args.seq_len, 32), 2
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["HF_DATASETS_CACHE"] = str(args.work_dir / "datasets_cache")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("accelerate", "peft", "datasets", "evaluate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "MISSING"
    device_name = torch.cuda.get_device_name(0) if gpu else "CPU"
    peak = measure(device, torch.bfloat16, 8192 if gpu else 512)
    if gpu:
        torch.cuda.empty_cache()
    print(f"{device_name}; {', '.join(f'{k} {v}' for k, v in versions.items())}; bf16 matmul {peak / 1e12:.1f} TFLOP/s")

    make_tokenizer(args.work_dir / "tokenizer")
    rows = max(batch * steps for _, _, _, batch, steps in runs)
    data = {"train": args.work_dir / "train.tsv", "validation": args.work_dir / "validation.tsv"}
    write_rows(data["train"], rows, args.seq_len + 2, seed=0)  # + 2: longer than the limit with [CLS]/[SEP]
    write_rows(data["validation"], 4 * runs[0][3] if runs else 64, args.seq_len + 2, seed=1)

    results, log = [], []
    params = {}
    notes = {}
    if args.diagnose and gpu and "bert-base" in [run[1] for run in runs]:
        params["bert-base"] = make_model("bert-base", args.work_dir / "bert-base", args.tiny, device.type)
        for regional in (False, True):
            key = f"bert-base, the GPU's ms per step {'with each layer compiled' if regional else 'eager'}"
            try:
                notes[key] = gpu_ms_per_step(args.work_dir / "bert-base", 128, args.seq_len, regional)
            except Exception as err:  # a diagnosis: the runs go on without it
                notes[key] = f"failed: {err!r}"[:300]
            torch.cuda.empty_cache()  # the runs' peak memory is read off the whole GPU
            print(f"[{time.perf_counter() - started:5.0f} s] {key}: {notes[key]}", flush=True)
    for name, model_name, runner, batch, steps in runs:
        elapsed = time.perf_counter() - started
        row = {"run": name, "batch": batch, "steps": steps, "status": "ok"}
        results.append(row)
        estimate = {"lora": 60, "fsdp": 90}.get(runner, 75)
        if elapsed + estimate > args.budget_s and not args.tiny:
            row["status"] = f"skipped: {elapsed:.0f} s used of the {args.budget_s:.0f} s budget"
            continue
        folder = args.work_dir / model_name
        if model_name not in params:
            params[model_name] = make_model(model_name, folder, args.tiny, device.type)
        row["params_M"] = params[model_name]["total"] / 1e6
        out = args.work_dir / "runs" / name.replace(" ", "_")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if runner.startswith("trainer"):
            command = trainer_command(folder, data, batch, steps, out, args, gpu)
            if runner == "trainer-workers":  # as many as train.py collates in by default on a GPU of this host
                row["collating_workers"] = collating_workers(None, torch.device("cuda"))
                command += ["--dataloader_num_workers", str(row["collating_workers"])]
        else:
            command = ours_command(runner, folder, data, batch, steps, out, args, gpu)
        print(f"[{time.perf_counter() - started:5.0f} s] {name}: {' '.join(command[1:4])} ...", flush=True)
        if (
            args.diagnose
            and model_name == runs[0][1]
            and runner in ("ours", "trainer", "trainer-workers", "in-process")
        ):
            folded = args.report_dir / (name.split(",")[0].replace(" ", "_") + f"_{runner}.folded")
            command = ["py-spy", "record", "--idle", "--nonblocking", "--subprocesses", "--rate", "100",
                       "--format", "raw", "--output", str(folded), "--", *command]  # fmt: skip
        run_start = time.perf_counter()
        timeout = max(60, args.budget_s + 30 - elapsed)
        with MemoryPoll() as memory:
            try:
                done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
                code, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as err:
                code, output = "timeout", str(err.stdout or "")
        row["wall_s"] = time.perf_counter() - run_start
        row["peak_memory_GiB"] = memory.peak / 1024 if memory.peak else None
        log.append(f"===== {name} (exit {code})\n{' '.join(command)}\n" + output[-6000:])
        if code != 0:
            row["status"] = f"FAILED (exit {code}); see gpu_logs.txt"
            write_report(args, started, device_name, versions, peak, results, log, None, notes)
            continue
        if runner.startswith("trainer"):
            measured = json.loads((out / "results.json").read_text())
            # Every row is --seq_len tokens long (the peer's own count stays in its workers when it has any).
            rate = measured["steady_steps"] * batch * args.seq_len / measured["steady_seconds"]
        else:
            rate = steady_rate_ours(out, batch, args.skip_steps)
        flops_per_token = (4 if runner == "lora" else 6) * params[model_name]["non_embedding"]
        row.update(tokens_per_s=rate, mfu=flops_per_token * rate / peak if rate else None)
        write_report(args, started, device_name, versions, peak, results, log, None, notes)

    encoder = next((name for name in ("minilm", "bert-base") if name in params), None)
    in_budget = args.tiny or time.perf_counter() - started + 45 < args.budget_s
    if not args.no_sync_check and encoder and in_budget:
        out = args.work_dir / "runs" / "sync_check"
        batch, steps = (4, 6) if args.tiny else (64, 30)
        argv = ours_command("ours", args.work_dir / encoder, data, batch, steps, out, args, gpu=False)[2:]
        argv += ["--mixed_precision", "bf16"]
        done = subprocess.run([sys.executable, __file__, "--sync_check", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        found = [line for line in done.stdout.splitlines() if line.startswith("SYNC_CHECK ")]
        sync = json.loads(found[-1].split(" ", 1)[1]) if found else {"error": done.stderr[-2000:]}
        log.append("===== sync check\n" + json.dumps(sync, indent=1))
    else:
        sync = None

    print(write_report(args, started, device_name, versions, peak, results, log, sync, notes))


def write_report(args, started, device_name, versions, peak, results, log, sync, notes):
    """The table, JSON and logs so far: written after every run, so a run cut short still reports what it measured."""
    compiled = ", torch.compile" if device_name != "CPU" and not args.no_compile else ""
    lines = [f"### GPU benchmark: {device_name}, seq len {args.seq_len}, bf16{compiled}, {time.strftime('%F')}", "",
             f"{', '.join(f'{k} {v}' for k, v in versions.items())}; measured bf16 matmul peak "
             f"{peak / 1e12:,.1f} TFLOP/s", "",
             "| run | params M | batch x steps | steady tokens/s | MFU | vs Trainer | vs Trainer, workers "
             "| peak GPU GiB | wall s | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rates = {row["run"]: row.get("tokens_per_s") for row in results}
    for row in results:
        model = row["run"].split(" train.py")[0]
        versus = ["", ""]  # against Trainer at its defaults, and with collating workers (a run that failed: blank)
        for i, trainer in enumerate((f"{model} Trainer", f"{model} Trainer, collating workers")):
            if "train.py" in row["run"] and row.get("tokens_per_s") and rates.get(trainer):
                versus[i] = f"{row['tokens_per_s'] / rates[trainer]:.2f}x"
        cells = [row["run"], f"{row['params_M']:,.0f}" if "params_M" in row else "", f"{row['batch']} x {row['steps']}",
                 f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "",
                 f"{row['mfu']:.1%}" if row.get("mfu") else "", *versus,
                 f"{row['peak_memory_GiB']:.1f}" if row.get("peak_memory_GiB") else "",
                 f"{row['wall_s']:.0f}" if "wall_s" in row else "", row["status"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if sync is not None:
        lines += ["", f"Where train.py's run made the host wait for the GPU (file:line: count): {json.dumps(sync)}"]
    for key, value in notes.items():
        lines += ["", f"{key}: {value}"]
    lines += ["", f"Whole benchmark: {time.perf_counter() - started:.0f} s"]
    table = "\n".join(lines) + "\n"
    (args.report_dir / "gpu_benchmark.md").write_text(table)
    everything = {"versions": versions, "peak": peak, "runs": results, "sync": sync, "notes": notes}
    (args.report_dir / "gpu_benchmark.json").write_text(json.dumps(everything, indent=1))
    (args.report_dir / "gpu_logs.txt").write_text("\n".join(log))
    return table


if __name__ == "__main__":
    main()
