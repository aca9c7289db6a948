"""A randomly initialised Llama-layout causal LM, with a tokenizer without a padding token, and optionally long-text
data: to try train.py's large-model paths (LoRA, FSDP, memory) with nothing to download.

    python examples/make_random_llm.py --size 1b --output /tmp/llama-1b --data /tmp/long-texts --words 200
    accelerate launch train.py --model_name_or_path /tmp/llama-1b --train_file /tmp/long-texts/train.csv \
        --validation_file /tmp/long-texts/dev.csv --max_length 256 --use_peft

The sizes are Llama 3.2 1B's and Llama 3.1 8B's shapes (128,256-token embeddings), and a tiny one for a first try
on a CPU. The tokenizer is the packaged all-MiniLM-L6-v2's English WordPiece vocabulary (lower-cased), with Llama
3's BOS and EOS added, so that real text (the chat and instruction data in ../shared/data) is tokenized into words
and pieces, not unknown tokens. The --data texts are the demo task's sentences (`src/demo_data.py`) strung together,
labelled by the last one. Weights are random: the point is memory, speed and mechanics, not accuracy.
"""

import argparse
import csv
import random
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, processors
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.demo_data import LABEL_NAMES, _sentence  # noqa: E402
from src.model import default_model_path  # noqa: E402

# (hidden size, MLP size, layers, attention heads, key-value heads)
SIZES = {"tiny": (64, 128, 2, 4, 2), "1b": (2048, 8192, 16, 32, 8), "8b": (4096, 14336, 32, 32, 8)}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def make_tokenizer() -> PreTrainedTokenizerFast:
    """MiniLM's WordPiece (30,522 English words and pieces) that adds BOS like Llama 3's instead of BERT's [CLS] and
    [SEP], and has no padding token, like it."""
    backend = Tokenizer.from_file(str(Path(default_model_path()) / "tokenizer.json"))
    backend.no_truncation()  # MiniLM's file cuts at 128 tokens and pads: the tokenizer's caller decides both
    backend.no_padding()
    backend.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token="[UNK]")


def write_data(folder: Path, words: int, rows: int, seed: int = 0):
    """train.csv and dev.csv: texts of about `words` words, labelled like their last sentence."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", rows), ("dev", max(64, rows // 10))):
        with open(folder / f"{name}.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["sentence", "label"])
            for _ in range(count):
                sentences = []
                while sum(len(s.split()) for s, _ in sentences) < words:
                    sentences.append(_sentence(rng))
                writer.writerow([" . ".join(s for s, _ in sentences), LABEL_NAMES[sentences[-1][1]]])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--size", choices=SIZES, default="tiny", help="Layers and widths: see SIZES.")
    parser.add_argument("--output", type=Path, required=True, help="Folder for the model and tokenizer.")
    parser.add_argument("--data", type=Path, help="Also write train.csv and dev.csv of long texts here.")
    parser.add_argument("--words", type=int, default=200, help="Words per text in --data.")
    parser.add_argument("--rows", type=int, default=2000, help="Training rows in --data.")
    args = parser.parse_args()

    tokenizer = make_tokenizer()
    hidden, mlp, layers, heads, kv_heads = SIZES[args.size]
    config = LlamaConfig(
        vocab_size=128256 if args.size != "tiny" else len(tokenizer),
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 8B parameters on a CPU takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"{args.output}: {model.num_parameters() / 1e6:,.1f}M parameters (bf16), tokenizer without a padding token")
    if args.data:
        write_data(args.data, args.words, args.rows)
        print(f"{args.data}: train.csv and dev.csv, {args.words} words per text")


if __name__ == "__main__":
    main()
