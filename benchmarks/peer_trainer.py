"""The benchmark's Trainer peer: the same fine-tune written the way a typical `transformers.Trainer` user would.

Standard defaults: DataCollatorWithPadding (dynamic padding), random shuffle (no length grouping), Trainer's
default AdamW, linear schedule, evaluation once at the end. Only the hyperparameters are set to train.py's.

    python benchmarks/peer_trainer.py --train_file train.tsv --validation_file dev.tsv --results trainer.json
"""

import numpy as np
from peer_common import (
    TokenCountingCollator,
    build_peer_parser,
    default_model_path,
    load_tokenized,
    write_results,
)
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)


def accuracy(eval_prediction) -> dict:
    logits, labels = eval_prediction
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main():
    args = build_peer_parser(__doc__.splitlines()[0]).parse_args()
    model_path = args.model_name_or_path or default_model_path()
    set_seed(args.seed)  # before loading the model: the new classification head is drawn from this seed

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = load_tokenized(args.train_file, args.validation_file, tokenizer, args.max_length)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)

    training_args = TrainingArguments(
        output_dir=str(args.output_dir or args.results.parent / "trainer_output"),
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_ratio,  # transformers 5: a float below 1 is a fraction of the total steps
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
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
    # Trainer's train_runtime starts after the model and loader are prepared: the training loop itself.
    train_metrics = trainer.train().metrics
    counts = collator.counts()
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
        },
    )
    print(f"trainer peer: accuracy {eval_metrics['eval_accuracy']:.4f}, train {train_metrics['train_runtime']:.1f}s")


if __name__ == "__main__":
    main()
