"""The benchmark's plain-PyTorch peer: the same fine-tune as a hand-written loop, without Accelerate.

DataLoader with shuffle and DataCollatorWithPadding, AdamW with no decay on 1-D parameters (as train.py),
a linear schedule with the same warmup, gradient clipping at 1.0, evaluation once at the end.

    python benchmarks/peer_plain.py --train_file train.tsv --validation_file dev.tsv --results plain.json
"""

import math
import time

import torch
from peer_common import (
    TokenCountingCollator,
    build_peer_parser,
    default_model_path,
    load_tokenized,
    write_results,
)
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
    set_seed,
)


def evaluate_accuracy(model, dataloader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in dataloader:
            predictions = model(**batch).logits.argmax(dim=-1)
            correct += (predictions == batch["labels"]).sum().item()
            total += len(predictions)
    return correct / total


def main():
    args = build_peer_parser(__doc__.splitlines()[0]).parse_args()
    model_path = args.model_name_or_path or default_model_path()
    set_seed(args.seed)  # before loading the model: the new classification head is drawn from this seed

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = load_tokenized(args.train_file, args.validation_file, tokenizer, args.max_length)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)

    collator = TokenCountingCollator(DataCollatorWithPadding(tokenizer))
    train_loader = DataLoader(
        dataset["train"],
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(args.seed),
    )
    eval_loader = DataLoader(
        dataset["validation"], batch_size=args.per_device_eval_batch_size, collate_fn=DataCollatorWithPadding(tokenizer)
    )

    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},  # biases and LayerNorms
        ],
        lr=args.learning_rate,
    )
    num_steps = args.num_train_epochs * len(train_loader)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=math.ceil(args.warmup_ratio * num_steps), num_training_steps=num_steps
    )

    start = time.perf_counter()
    model.train()
    for _ in range(args.num_train_epochs):
        for batch in train_loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    train_runtime = time.perf_counter() - start

    start = time.perf_counter()
    eval_accuracy = evaluate_accuracy(model, eval_loader)
    eval_runtime = time.perf_counter() - start
    if args.output_dir:
        model.save_pretrained(args.output_dir)  # model and tokenizer, as train.py leaves them
        tokenizer.save_pretrained(args.output_dir)

    write_results(
        args.results,
        {
            "eval_accuracy": eval_accuracy,
            "eval_runtime": eval_runtime,
            "train_runtime": train_runtime,
            **collator.counts(),
            "global_step": num_steps,
            "threads": torch.get_num_threads(),
        },
    )
    print(f"plain peer: accuracy {eval_accuracy:.4f}, train {train_runtime:.1f}s")


if __name__ == "__main__":
    main()
