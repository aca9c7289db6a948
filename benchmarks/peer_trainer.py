"""The benchmark's Trainer peer: the same fine-tune written the way a typical `transformers.Trainer` user would.

Standard defaults: DataCollatorWithPadding (dynamic padding), random shuffle (no length grouping), Trainer's
default AdamW, linear schedule, evaluation once at the end. Only the hyperparameters are set to train.py's.
The options are what a user tuning Trainer would switch on: length-grouped batches, bf16, a fused AdamW,
torch.compile.

    python benchmarks/peer_trainer.py --train_file train.tsv --validation_file dev.tsv --results trainer.json
    python benchmarks/peer_trainer.py ... --group_by_length             # the tuned Trainer of run_benchmark.py
"""

import time

import numpy as np
import torch
from peer_common import (
    TokenCountingCollator,
    build_peer_parser,
    default_model_path,
    load_tokenized,
    trainer_settings,
    write_results,
)
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class SteadyStateTimer(TrainerCallback):
    """Times the steps after the first `skip` (compilation, warm-up) up to the end, synchronising the GPU."""

    def __init__(self, skip: int):
        self.skip, self.start, self.seconds, self.steps = skip, None, None, 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.skip:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self.start is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds, self.steps = time.perf_counter() - self.start, state.global_step - self.skip


def accuracy(eval_prediction) -> dict:
    logits, labels = eval_prediction
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main():
    parser = build_peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--group_by_length", action="store_true", help="train_sampling_strategy='group_by_length'.")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (Trainer's bf16=True).")
    parser.add_argument("--torch_compile", action="store_true", help="Trainer's torch_compile=True.")
    parser.add_argument("--optim", default="adamw_torch", help="Trainer's optimizer, e.g. adamw_torch_fused.")
    parser.add_argument("--max_steps", type=int, default=-1, help="Stop after this many steps (overrides epochs).")
    parser.add_argument("--timing_skip_steps", type=int, help="Also time the steps after the first N (GPU runs).")
    parser.add_argument(
        "--dataloader_num_workers", type=int, default=0, help="Trainer's collating worker processes (counts: none)."
    )
    args = parser.parse_args()
    model_path = args.model_name_or_path or default_model_path()
    set_seed(args.seed)  # before loading the model: the new classification head is drawn from this seed

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = load_tokenized(args.train_file, args.validation_file, tokenizer, args.max_length)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)

    training_args = TrainingArguments(
        **trainer_settings(args, str(args.output_dir or args.results.parent / "trainer_output")),
        torch_compile=args.torch_compile,
        optim=args.optim,
        max_steps=args.max_steps,
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_persistent_workers=args.dataloader_num_workers > 0,
    )
    # One collator for training and evaluation (as Trainer does); its counts are read right after training.
    collator = TokenCountingCollator(DataCollatorWithPadding(tokenizer))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["validation"],
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=accuracy,
    )
    timer = SteadyStateTimer(args.timing_skip_steps) if args.timing_skip_steps else None
    if timer:
        trainer.add_callback(timer)
    # Trainer's train_runtime starts after the model and loader are prepared: the training loop itself.
    train_metrics = trainer.train().metrics
    # With workers, each counts in its own copy of the collator, and the counts stay there.
    counts = collator.counts() if not args.dataloader_num_workers else {}
    eval_metrics = trainer.evaluate()
    if args.output_dir:
        trainer.save_model(str(args.output_dir))  # model and tokenizer, as train.py leaves them

    write_results(
        args.results,
        {
            "eval_accuracy": eval_metrics["eval_accuracy"],
            "eval_runtime": eval_metrics["eval_runtime"],
            "train_runtime": train_metrics["train_runtime"],
            **counts,
            "global_step": trainer.state.global_step,
            "bf16": args.bf16,
            "threads": torch.get_num_threads(),
            **({"steady_seconds": timer.seconds, "steady_steps": timer.steps} if timer else {}),
        },
    )
    print(f"trainer peer: accuracy {eval_metrics['eval_accuracy']:.4f}, train {train_metrics['train_runtime']:.1f}s")


if __name__ == "__main__":
    main()
