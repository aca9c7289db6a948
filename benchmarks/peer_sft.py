"""The causal-LM peer of benchmarks/sft_peer.py: TRL's SFTTrainer on prompt/completion rows, set to train.py's settings.

TRL as its documentation shows it: the model and tokenizer from a folder, the rows from a .jsonl file, an SFTConfig;
completion-only loss (TRL's default for prompt/completion rows), packing with TRL's default `bfd` strategy (which turns
on its padding-free collator). Changed from TRL's defaults to match train.py: no gradient checkpointing (SFTConfig
turns it on; train.py does not), bf16 only when asked, no weight decay or warmup beyond what the runner passes.

    python benchmarks/peer_sft.py --model_name_or_path M --train_file train.jsonl --validation_file dev.jsonl \
        --results trl.json [--packing] [--bf16] [--group_by_length]
"""

import time

import torch
from datasets import load_dataset
from peer_common import TokenCountingCollator, build_peer_parser, trainer_settings, write_results
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer


def token_weighted_eval_loss(trainer: SFTTrainer) -> tuple[float, int]:
    """(the loss per completion token over the whole validation set, the number of such tokens).

    TRL's own eval_loss is Trainer's mean of per-batch means (each batch's loss per token, weighted by the batch's
    rows), so a batch of short completions weighs as much as one of long ones; train.py divides the summed loss by
    every predicted token of the set. This pass computes train.py's quantity on TRL's own tokenized rows, through the
    same fused LM head and autocast that TRL's evaluation uses."""
    model = trainer.model
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad(), trainer.compute_loss_context_manager():
        for batch in trainer.get_eval_dataloader():
            batch = trainer._prepare_inputs(batch)
            outputs = model(**batch, use_cache=False, fused_lm_head=True)
            loss_sum -= outputs.log_probs.double().sum().item()  # zero where the label is ignored
            tokens += int(outputs.label_mask.sum())
    return loss_sum / max(1, tokens), tokens


def main():
    parser = build_peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--packing", action="store_true", help="SFTConfig(packing=True): bfd, padding-free.")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (bf16=True; SFTConfig's default).")
    parser.add_argument("--group_by_length", action="store_true", help="train_sampling_strategy='group_by_length'.")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    data = load_dataset("json", data_files={"train": str(args.train_file), "validation": str(args.validation_file)})
    config = SFTConfig(
        **trainer_settings(args, str(args.output_dir or args.results.parent / "trl_output")),
        max_length=args.max_length,
        packing=args.packing,
        eval_packing=False,  # train.py evaluates unpacked rows: per-example metrics, the same with or without packing
        gradient_checkpointing=False,  # SFTConfig's default is True; train.py's is off, and it costs ~20-30% here
    )
    trainer = SFTTrainer(
        model=args.model_name_or_path,
        args=config,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
    )
    # SFTTrainer builds its collator (padding-free with packing) and refuses a custom one then: wrap the one it built.
    collator = TokenCountingCollator(trainer.data_collator)
    trainer.data_collator = collator
    train_metrics = trainer.train().metrics  # train_runtime: the training loop only, after the data are prepared
    counts = collator.counts()
    eval_metrics = trainer.evaluate()
    if args.output_dir:
        trainer.save_model(str(args.output_dir))  # model and tokenizer, as train.py leaves them

    # Not part of TRL's run: timed, so that the runner can take it out of the wall time.
    started = time.perf_counter()
    eval_loss_per_token, eval_tokens = token_weighted_eval_loss(trainer)
    extra_seconds = time.perf_counter() - started

    write_results(
        args.results,
        {
            "eval_loss": eval_metrics["eval_loss"],  # TRL's: the mean of per-batch means
            "eval_loss_per_token": eval_loss_per_token,
            "eval_tokens": eval_tokens,
            "eval_runtime": eval_metrics["eval_runtime"],
            "train_loss": train_metrics["train_loss"],
            "train_runtime": train_metrics["train_runtime"],
            **counts,
            "train_rows": len(trainer.train_dataset),
            "global_step": trainer.state.global_step,
            "bf16": args.bf16,
            "threads": torch.get_num_threads(),
            "extra_seconds": extra_seconds,
        },
    )
    print(f"TRL peer: eval_loss {eval_metrics['eval_loss']:.4f} (per token {eval_loss_per_token:.4f}), "
          f"train {train_metrics['train_runtime']:.1f}s")  # fmt: skip


if __name__ == "__main__":
    main()
