"""Peak host memory (RSS) of each rank when train.py loads a model under accelerate_configs/fsdp.yaml
(fsdp_cpu_ram_efficient_loading), on 2 gloo CPU ranks through tests/fsdp_on_cpu.py: the packaged MiniLM (22.7M
parameters) and a random Llama-layout model of 276M parameters (bf16 checkpoint, trained in fp32), one training step.

    python benchmarks/fsdp_loading_memory.py
    python benchmarks/fsdp_loading_memory.py --repo /tmp/other-checkout   # the same with another version's src/

"through prepare" is the peak until the model is sharded (loading, then prepare): what a GPU machine's host holds,
as the shards then live on the GPUs. "at exit" adds a training step and the final save with every shard on the
CPU. Each rank's figure includes ~0.5 GB of Python, PyTorch and transformers.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
LLAMA = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 4}  # fmt: skip
REPORT = re.compile(r"fsdp_on_cpu rank (\d): parameters on meta before prepare (\d+) of (\d+), .*peak RSS (\d+) MiB")
EXIT_REPORT = re.compile(r"fsdp_on_cpu rank (\d): peak RSS (\d+) MiB")


def make_llama(folder: Path) -> Path:
    import torch
    from make_random_llm import make_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = make_tokenizer()
    config = LlamaConfig(vocab_size=32000, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=512, **LLAMA)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(repo: Path, model: str, data: Path, output_dir: Path) -> list[tuple]:
    """(rank, parameters on meta before prepare, parameters, peak MiB through prepare, peak MiB at exit) per rank."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp.yaml",
               "--num_processes", "2", "--mixed_precision", "no", "tests/fsdp_on_cpu.py", "train.py",
               "--model_name_or_path", model, "--train_file", str(data / "train.csv"), "--validation_file",
               str(data / "dev.csv"), "--output_dir", str(output_dir), "--max_train_steps", "1",
               "--per_device_train_batch_size", "2", "--max_length", "64", "--max_eval_samples", "8",
               "--report_to", "none", "--mixed_precision", "no"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    log = result.stdout + result.stderr
    if result.returncode:
        sys.exit(log[-3000:])
    at_exit = dict(EXIT_REPORT.findall(log))
    return [(int(rank), int(on_meta), int(total), int(peak), int(at_exit[rank]))
            for rank, on_meta, total, peak in sorted(REPORT.findall(log))]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="The checkout whose train.py and src/ run.")
    args = parser.parse_args()
    from make_random_llm import write_data

    sys.path.insert(0, str(REPO))
    from src.model import default_model_path

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        write_data(work / "data", words=40, rows=16)
        models = {"MiniLM (22.7M, fp32 checkpoint)": default_model_path(),
                  "Llama layout (276M, bf16 checkpoint)": str(make_llama(work / "llama"))}  # fmt: skip
        print("| model | rank | parameters on meta before prepare | peak RSS through prepare | peak RSS at exit |")
        print("| --- | --- | --- | --- | --- |")
        for name, model in models.items():
            for rank, on_meta, total, peak, at_exit in measure(args.repo, model, work / "data", work / name[:5]):
                print(f"| {name} | {rank} | {on_meta:,} of {total:,} | {peak:,} MiB | {at_exit:,} MiB |", flush=True)


if __name__ == "__main__":
    main()
