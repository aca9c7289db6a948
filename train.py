"""Fine-tune a Hugging Face sequence classifier (or regressor) with Accelerate.

One script from a laptop CPU to many GPUs on many machines:

    accelerate launch train.py                                  # built-in demo task, packaged MiniLM
    accelerate launch train.py --train_file train.csv --validation_file dev.csv
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train.py --config my_run.yaml
"""

import math
import signal
import time

import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from src.args import build_train_parser, parse_args, validate_train_args
from src.checkpoint import (
    check_output_dir,
    load_checkpoint,
    newest_checkpoint,
    remove_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from src.data import (
    build_eval_dataloader,
    build_train_dataloader,
    detect_columns,
    label_names_of,
    load_raw_splits,
    tokenize,
)
from src.errors import UserError, main_process_first, run_cli
from src.evaluation import evaluate
from src.metrics import check_best_metric, greater_is_better
from src.model import default_model_path, load_model, load_tokenizer, resolve_max_length
from src.reporting import (
    ThroughputWindow,
    append_jsonl,
    keep_records_up_to,
    plot_training_curves,
    read_jsonl,
    setup_logging,
    write_json,
)

logger = get_logger(__name__)


def parse_train_args(argv=None):
    parser = build_train_parser()
    return validate_train_args(parser, parse_args(parser, argv))


class StopRequest:
    """Turns SIGTERM/SIGINT (what SLURM, spot instances and Ctrl-C send) into a flag checked after each step."""

    def __init__(self):
        self.signal = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C stops at once


def main(args):
    # cpu=True when there is no accelerator: otherwise torchrun or `--multi_gpu` on a CPU-only machine starts
    # N unrelated single-process runs instead of N ranks of one.
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the scheduler counts optimizer updates; see the loop
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=str(args.output_dir), save_on_each_node=args.save_on_each_node),
    )
    setup_logging()
    is_writer = accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process

    check_output_dir(args.output_dir, args.overwrite_output_dir, bool(args.resume_from_checkpoint))
    resume_path = (
        resolve_checkpoint(args.resume_from_checkpoint, args.output_dir) if args.resume_from_checkpoint else None
    )
    set_seed(args.seed)

    # Data and model: rank 0 goes first and fills the caches (and downloads); the other ranks then read them.
    args.model_name_or_path = args.model_name_or_path or default_model_path()
    with main_process_first(accelerator):
        raw = load_raw_splits(args)
        args.text_column, args.text_pair_column, args.label_column = detect_columns(
            raw["train"].column_names, args.text_column, args.text_pair_column, args.label_column
        )
        label_names = label_names_of(raw["train"], args.label_column)
        tokenizer = load_tokenizer(args.model_name_or_path)
        args.max_length = resolve_max_length(args.max_length, tokenizer)
        label2id = {name: i for i, name in enumerate(label_names)} if label_names is not None else None
        columns = (args.text_column, args.text_pair_column, args.label_column, args.max_length, label2id)
        train_dataset = tokenize(raw["train"], tokenizer, *columns)
        eval_dataset = tokenize(raw["validation"], tokenizer, *columns)
        model = load_model(args.model_name_or_path, label_names, regression=label_names is None)
    is_regression = label_names is None
    args.metric_for_best_model = check_best_metric(args.metric_for_best_model, is_regression)
    if args.greater_is_better is None:
        args.greater_is_better = greater_is_better(args.metric_for_best_model)
    num_parameters = model.num_parameters()  # before prepare() wraps (and perhaps shards) it
    # No weight decay on biases and LayerNorm weights (the 1-D parameters). fused: one kernel for all tensors
    # instead of a loop over ~100; on 2 CPU cores MiniLM's update drops from ~190 to ~40 ms per step.
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, fused=accelerator.device.type in ("cpu", "cuda"))
    pad_to_multiple_of = 8 if accelerator.device.type == "cuda" else None  # tensor cores want multiples of 8
    train_dataloader = build_train_dataloader(
        train_dataset,
        tokenizer,
        args.per_device_train_batch_size,
        accelerator.num_processes,
        args.seed,
        args.group_by_length,
        pad_to_multiple_of,
    )
    eval_dataloader = build_eval_dataloader(
        eval_dataset, tokenizer, args.per_device_eval_batch_size, pad_to_multiple_of
    )
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    # prepare() shards the training loader, so the step counts come from its new length.
    # The engine's accumulation counts (DeepSpeed's config overrides the flag).
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader) / accumulation)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=math.ceil(args.warmup_ratio * max_train_steps),
        num_training_steps=max_train_steps,
    )
    accelerator.register_for_checkpointing(lr_scheduler)  # stepped once per update by the loop, saved with the state

    state = {
        "global_step": 0,
        "epoch": 0,
        "batches_in_epoch": 0,
        "best_metric": None,
        "best_checkpoint": None,
        "evals_without_improvement": 0,
        "num_processes": accelerator.num_processes,
    }
    if resume_path:
        state = load_checkpoint(accelerator, resume_path, args)
        if state["batches_in_epoch"] >= len(train_dataloader):
            state.update(epoch=state["epoch"] + 1, batches_in_epoch=0)
    if is_writer and args.overwrite_output_dir:
        remove_checkpoints(args.output_dir)
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(args.output_dir / "args.json", vars(args))
        # A resumed run drops what the interrupted one logged after its checkpoint; a new run starts afresh.
        keep_records_up_to(args.output_dir / "metrics.jsonl", state["global_step"])
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}
    project = (
        "tensorboard" if args.report_to == "tensorboard" else args.output_dir.name
    )  # logs in output_dir/tensorboard
    accelerator.init_trackers(project, config=hparams)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * accumulation
    task = "regression" if is_regression else f"classification into {len(label_names)} classes"
    logger.info("***** Running training *****")
    logger.info(f"  Model = {args.model_name_or_path} ({num_parameters / 1e6:.1f}M parameters), {task}")
    logger.info(f"  Num examples = {len(train_dataset)} train, {len(eval_dataset)} validation")
    logger.info(
        f"  Processes = {accelerator.num_processes} on {accelerator.device.type} "
        f"({accelerator.distributed_type.value}), mixed precision = {accelerator.mixed_precision}"
    )
    logger.info(f"  Num epochs = {num_epochs}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Gradient accumulation steps = {accumulation}")
    logger.info(
        f"  Total optimization steps = {max_train_steps}"
        + (f", resuming from {resume_path} at step {state['global_step']}" if resume_path else "")
    )
    logger.info(f"  Outputs = {args.output_dir.resolve()}")

    def log(record: dict):
        accelerator.log(record, step=state["global_step"])
        if accelerator.is_main_process:
            append_jsonl(args.output_dir / "metrics.jsonl", {"step": state["global_step"], **record})

    def checkpoint():
        with window.paused():  # throughput counts training time only
            path = save_checkpoint(
                accelerator, args.output_dir, {**state, "args": vars(args)}, is_writer, args.save_total_limit
            )
        logger.info(f"Saved checkpoint {path}")
        return path

    stop_request = StopRequest()
    progress = tqdm(
        total=max_train_steps,
        initial=state["global_step"],
        desc="Training",
        disable=not accelerator.is_local_main_process,
    )
    window = ThroughputWindow(accelerator.device)
    start_time = time.perf_counter()
    eval_metrics, stop_reason = {}, None
    # A run resumed from its last step has nothing left to train.
    for epoch in range(state["epoch"], num_epochs if state["global_step"] < max_train_steps else 0):
        model.train()
        train_dataloader.set_epoch(epoch)  # re-seeds the shuffle; before skip_first_batches for exact resume
        skip = state["batches_in_epoch"] if epoch == state["epoch"] else 0
        batches = skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
        for batch_in_epoch, batch in enumerate(batches, start=skip + 1):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            finite &= torch.isfinite(loss.detach())
            window.add(loss, batch)
            if not accelerator.sync_gradients:
                continue
            lr_scheduler.step()
            state.update(global_step=state["global_step"] + 1, epoch=epoch, batches_in_epoch=batch_in_epoch)
            step = state["global_step"]
            progress.update(1)

            # One collective per update: every rank learns whether any rank diverged or was asked to stop.
            out_of_time = args.max_time is not None and time.perf_counter() - start_time > args.max_time * 60
            flags = torch.tensor([not finite.item(), stop_request.signal or 0, out_of_time], device=accelerator.device)
            diverged, signum, out_of_time = accelerator.reduce(flags, reduction="max").tolist()
            if diverged:
                raise UserError(
                    f"the loss became NaN or infinite at step {step} (epoch {epoch}); nothing was saved from that "
                    f"step. Lower --learning_rate or keep --max_grad_norm, then --resume_from_checkpoint latest "
                    f"(newest checkpoint: {newest_checkpoint(args.output_dir) or 'none'})"
                )

            end_of_epoch = batch_in_epoch == len(train_dataloader)
            done = step >= max_train_steps
            if step % args.logging_steps == 0 or end_of_epoch or done:
                record = {
                    "epoch": round(epoch + batch_in_epoch / len(train_dataloader), 3),
                    **window.flush(accelerator),
                }
                record["learning_rate"] = lr_scheduler.get_last_lr()[0]
                log(record)
                progress.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    lr=f"{record['learning_rate']:.2e}",
                    samples_s=f"{record['samples_per_second']:.1f}",
                    tokens_s=f"{record['tokens_per_second']:.0f}",
                )

            saved = False
            if (args.eval_steps and step % args.eval_steps == 0) or end_of_epoch or done:
                with window.paused():  # throughput counts training time only
                    eval_metrics, _ = evaluate(model, eval_dataloader, accelerator, is_regression)
                log(eval_metrics)
                logger.info(f"step {step}: " + ", ".join(f"{k} = {v:.4f}" for k, v in eval_metrics.items()))
                value, best = eval_metrics[f"eval_{args.metric_for_best_model}"], state["best_metric"]
                if best is None or (value > best if args.greater_is_better else value < best):
                    state.update(best_metric=value, best_metrics=eval_metrics, evals_without_improvement=0)
                    if args.load_best_model_at_end:
                        state["best_checkpoint"] = str(args.output_dir / f"checkpoint-{step}")
                        checkpoint()
                        saved = True
                else:
                    state["evals_without_improvement"] += 1
                # Every rank computed these metrics from the same gathered predictions, so all stop together.
                if args.early_stopping_patience and state["evals_without_improvement"] >= args.early_stopping_patience:
                    stop_reason = (
                        f"no better {args.metric_for_best_model} in {args.early_stopping_patience} evaluations"
                    )

            every = args.checkpointing_steps
            periodic = (every == "epoch" and end_of_epoch) or (isinstance(every, int) and step % every == 0)
            if not saved and (periodic or signum or out_of_time):
                checkpoint()
            if signum or out_of_time:
                why = (
                    f"received {signal.Signals(int(signum)).name}" if signum else f"--max_time {args.max_time} reached"
                )
                logger.info(
                    f"Stopped at step {step} ({why}). To continue, run the same command with "
                    "--resume_from_checkpoint latest"
                )
                accelerator.end_training()
                raise SystemExit(128 + int(signum) if signum else 0)
            if stop_reason or done:
                break
        if stop_reason or state["global_step"] >= max_train_steps:
            break
    progress.close()
    window.flush(accelerator)  # an early stop can leave rows since the last log out of the totals
    train_runtime = time.perf_counter() - start_time
    if not eval_metrics:  # resumed from the last step: nothing left to train, but the results need metrics
        eval_metrics, _ = evaluate(model, eval_dataloader, accelerator, is_regression)
    if stop_reason:
        logger.info(f"Early stopping at step {state['global_step']}: {stop_reason}")

    if args.load_best_model_at_end and state["best_checkpoint"]:
        accelerator.load_state(state["best_checkpoint"])
        eval_metrics = state["best_metrics"]
        best = f"{args.metric_for_best_model} = {state['best_metric']:.4f}"
        logger.info(f"Loaded the best model ({best}) from {state['best_checkpoint']}")

    # Save: the full state dict (gathered under FSDP/DeepSpeed) without DDP's `module.` prefix.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        state_dict=state_dict,
    )
    results = {
        **eval_metrics,
        "train_runtime": train_runtime,
        "train_samples_per_second": window.totals["samples"] / train_runtime,
        "train_tokens_per_second": window.totals["tokens"] / train_runtime,
        "train_padding_fraction": 1 - window.totals["tokens"] / max(1, window.totals["padded_tokens"]),
        "num_processes": accelerator.num_processes,
        "total_train_batch_size": total_batch_size,
        "global_step": state["global_step"],
    }
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        write_json(args.output_dir / "all_results.json", results)
        plot_training_curves(read_jsonl(args.output_dir / "metrics.jsonl"), args.output_dir / "training_curves.png")
    accelerator.end_training()
    summary = ", ".join(f"{k} = {v:.4f}" for k, v in eval_metrics.items() if k != "eval_samples")
    logger.info(f"Done in {train_runtime:.0f}s: {summary}")
    logger.info(f"Model, all_results.json, metrics.jsonl and training_curves.png are in {args.output_dir.resolve()}")
    return results


if __name__ == "__main__":
    run_cli(main, parse_train_args)
