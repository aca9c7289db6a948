"""Fine-tune a Hugging Face sequence classifier (or regressor) with Accelerate.

One script from a laptop CPU to many GPUs on many machines:

    accelerate launch train.py                                  # built-in demo task, packaged MiniLM
    accelerate launch train.py --train_file train.csv --validation_file dev.csv
    accelerate launch train.py --model_name_or_path Qwen/Qwen2.5-7B --use_peft --train_file train.csv ...   # LoRA
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train.py --config my_run.yaml
"""

import gc
import math
import time
from datetime import timedelta

import torch
from accelerate import Accelerator, PartialState
from accelerate.data_loader import skip_first_batches
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from src.args import build_train_parser, parse_args, validate_train_args
from src.batch_size import fit_batch_sizes
from src.checkpoint import (
    check_output_dir,
    load_checkpoint,
    newest_checkpoint,
    read_checkpoint_args,
    remove_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from src.data import (
    build_eval_dataloader,
    build_train_dataloader,
    detect_columns,
    load_raw_splits,
    padding_options,
    tokenize,
)
from src.errors import UserError, main_process_first, run_cli
from src.evaluation import evaluate, evaluate_more
from src.hub import check_hub_access, push_to_hub, write_model_card
from src.metrics import check_best_metric, greater_is_better
from src.model import (
    build_model,
    build_optimizer,
    count_parameters,
    default_model_path,
    load_tokenizer,
    resolve_max_length,
    save_model,
)
from src.precision import choose_precision
from src.reporting import (
    ThroughputWindow,
    append_jsonl,
    keep_records_up_to,
    plot_training_curves,
    read_jsonl,
    setup_logging,
    tracker_run_name,
    write_json,
)
from src.runtime import StopSignals, StopVote, refuse_fsdp_without_gpus, set_cpu_threads
from src.task import detect_task

logger = get_logger(__name__)


def parse_train_args(argv=None):
    parser = build_train_parser()
    return validate_train_args(parser, parse_args(parser, argv))


def build_accelerator(args, resume_path) -> Accelerator:
    on_cpu = not torch.accelerator.is_available()
    # Without cpu=True, torchrun or `--multi_gpu` on a machine without GPUs would start N unrelated
    # single-process runs instead of N ranks of one. The process group comes first: rank 0 may time both
    # precisions on this machine's threads, and every rank takes its answer.
    PartialState(cpu=on_cpu, timeout=timedelta(seconds=args.ddp_timeout))
    args.cpu_threads = set_cpu_threads(args.cpu_threads) if on_cpu else torch.get_num_threads()
    # A resumed run keeps its precision, also on a machine that would choose another: resume stays exact.
    saved = read_checkpoint_args(resume_path).get("mixed_precision") if resume_path else None
    precision, args.mixed_precision_reason = choose_precision(args.mixed_precision, on_cpu, saved)
    if not on_cpu:
        torch.set_float32_matmul_precision("high")  # TF32: what stays fp32 runs on tensor cores too
    accelerator = Accelerator(
        cpu=on_cpu,
        mixed_precision=precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the scheduler counts optimizer updates; see the loop
        # Batches are copied to the GPU without making the host wait for the step in flight.
        dataloader_config=DataLoaderConfiguration(non_blocking=not on_cpu),
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=str(args.output_dir), save_on_each_node=args.save_on_each_node),
    )
    args.mixed_precision = accelerator.mixed_precision
    return accelerator


def load_data_and_model(args, accelerator):
    """The task (from the training labels), tokenizer, tokenized splits and the model to train.

    Rank 0 goes first and fills the caches (and downloads); the other ranks then read them.
    """
    args.model_name_or_path = args.model_name_or_path or default_model_path()
    with main_process_first(accelerator, args.data_preparation_timeout):
        raw = load_raw_splits(args)
        columns = detect_columns(raw["train"].column_names, args.text_column, args.text_pair_column, args.label_column)
        args.text_column, args.text_pair_column, args.label_column = columns
        task = detect_task(raw["train"], args.label_column, args.class_weights, args.multi_label_threshold)
        args.class_weight_values = task.weights_by_label()  # in args.json, so evaluate.py weighs its loss the same
        tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        # A new head; LoRA and gradient checkpointing if asked.
        model = build_model(args, task, tokenizer, accelerator, trust_remote_code=args.trust_remote_code,
                            ignore_mismatched_sizes=args.ignore_mismatched_sizes)  # fmt: skip
        args.max_length = resolve_max_length(args.max_length, tokenizer, model.config)
        # 'train', 'validation' and any further validation split (MNLI's 'validation_mismatched').
        splits = {name: tokenize(split, tokenizer, columns, args.max_length, task) for name, split in raw.items()}
    return task, tokenizer, splits, model


def build_dataloaders(args, accelerator, model, splits, tokenizer, task, resume_path):
    """The training loader (its batch size fitted to memory first, if asked) and one evaluation loader per
    validation split (MNLI has two), before prepare() shards them."""
    padding = padding_options(accelerator.device, args.max_length if args.pad_to_max_length else None)
    if args.auto_find_batch_size:
        fit_batch_sizes(args, accelerator, model, splits, tokenizer, task, resume_path, padding)
    train_dataloader = build_train_dataloader(
        splits["train"], tokenizer, args.per_device_train_batch_size, accelerator.num_processes, args.seed,
        args.group_by_length, accumulation=accelerator.gradient_accumulation_steps, **padding,
    )  # fmt: skip
    eval_dataloaders = {
        name: build_eval_dataloader(split, tokenizer, args.per_device_eval_batch_size, **padding)
        for name, split in splits.items()
        if name.startswith("validation")
    }
    return train_dataloader, eval_dataloaders


def main(args):
    refuse_fsdp_without_gpus()
    check_output_dir(args.output_dir, args.overwrite_output_dir, bool(args.resume_from_checkpoint))
    resume = args.resume_from_checkpoint
    resume_path = resolve_checkpoint(resume, args.output_dir) if resume else None
    accelerator = build_accelerator(args, resume_path)
    setup_logging()
    hub_target = check_hub_access(args, accelerator)  # in seconds, before hours of training; the token leaves args
    set_seed(args.seed)

    task, tokenizer, splits, model = load_data_and_model(args, accelerator)
    args.metric_for_best_model = check_best_metric(args.metric_for_best_model, task)
    if args.greater_is_better is None:
        args.greater_is_better = greater_is_better(args.metric_for_best_model)
    trainable_parameters, total_parameters = count_parameters(model)  # before prepare() wraps (and perhaps shards) it

    optimizer = build_optimizer(model, args, accelerator.device)
    train_dataloader, eval_dataloaders = build_dataloaders(
        args, accelerator, model, splits, tokenizer, task, resume_path
    )
    model, optimizer, train_dataloader, *eval_dataloaders_prepared = accelerator.prepare(
        model, optimizer, train_dataloader, *eval_dataloaders.values()
    )
    eval_dataloaders = dict(zip(eval_dataloaders, eval_dataloaders_prepared))
    # Every rank started from the same weights; from here each draws its own dropout masks.
    set_seed(args.seed, device_specific=True)

    # prepare() shards the training loader, so the step counts come from its new length.
    # The engine's accumulation counts (DeepSpeed's config overrides the flag).
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader) / accumulation)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    warmup_steps = args.num_warmup_steps if args.num_warmup_steps is not None else args.warmup_ratio * max_train_steps
    if warmup_steps >= max_train_steps > 0:  # the learning rate would never reach --learning_rate
        raise UserError(f"--num_warmup_steps {args.num_warmup_steps} is not less than the run's {max_train_steps} "
                        "optimizer steps: lower it, or use --warmup_ratio")  # fmt: skip
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=math.ceil(warmup_steps),
        num_training_steps=max_train_steps,
    )
    accelerator.register_for_checkpointing(lr_scheduler)  # stepped once per update by the loop, saved with the state

    state = start_or_resume(args, accelerator, resume_path, len(train_dataloader))
    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * accumulation
    logger.info("***** Running training *****")
    lora = f" with LoRA (r={args.lora_r}, {args.lora_target_modules})" if args.use_peft else ""
    logger.info(f"  Model = {args.model_name_or_path}{lora}, {task.describe()}")
    share = f"{100 * trainable_parameters / total_parameters:.2f}%"
    logger.info(f"  Parameters = {total_parameters:,}, trainable {trainable_parameters:,} ({share})")
    logger.info(f"  Num examples = {len(splits['train'])} train, {len(splits['validation'])} validation")
    logger.info(
        f"  Processes = {accelerator.num_processes} on {accelerator.device.type} "
        f"({accelerator.distributed_type.value}), {args.cpu_threads} CPU threads per process, "
        f"mixed precision = {accelerator.mixed_precision} ({args.mixed_precision_reason})"
    )
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Gradient accumulation steps = {accumulation}, num epochs = {num_epochs}")
    resuming = f", resuming from {resume_path} at step {state['global_step']}" if resume_path else ""
    logger.info(f"  Total optimization steps = {max_train_steps}{resuming}")
    logger.info(f"  Outputs = {args.output_dir.resolve()}")

    # Signals are turned into a checkpoint from here on; a signal during the final save waits for it to end.
    with StopSignals() as stop_signals:
        eval_metrics, throughput, stop_status = train_loop(
            args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloaders.pop("validation"),
            task, state, max_train_steps, num_epochs, stop_signals,
        )  # fmt: skip
        if stop_status is None:
            eval_metrics |= evaluate_more(model, eval_dataloaders, accelerator, task)  # MNLI mismatched, at the end
            results = {
                **eval_metrics,
                **throughput,
                "num_processes": accelerator.num_processes,
                "cpu_threads_per_process": args.cpu_threads,
                "total_train_batch_size": total_batch_size,
                "global_step": state["global_step"],
                "trainable_parameters": trainable_parameters,
                "total_parameters": total_parameters,
            }
            save_final(args, accelerator, model, tokenizer, results)
    # DDP's reducer holds the process group. Freed after end_training() destroyed the group, it tears gloo down
    # while holding the GIL, which can deadlock with gloo's worker thread (seen: a finished rank that never exited).
    del model
    accelerator.free_memory()
    accelerator.end_training()
    if stop_status is not None:
        raise SystemExit(stop_status)  # stopped by a signal or --max_time, with a checkpoint to resume from
    push_to_hub(args, accelerator, hub_target)  # outside StopSignals: Ctrl-C may interrupt a slow upload
    summary = ", ".join(f"{k} = {v:.4f}" for k, v in eval_metrics.items() if k != "eval_samples")
    logger.info(f"Done in {results['train_runtime']:.0f}s: {summary}")
    written = "Model, model card (README.md), all_results.json, metrics.jsonl and training_curves.png"
    logger.info(f"{written} are in {args.output_dir.resolve()}")
    return results


def start_or_resume(args, accelerator, resume_path, batches_per_epoch: int) -> dict:
    """The loop's position (restored from a checkpoint, or a fresh start), with the run's files set up."""
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
        if state["batches_in_epoch"] >= batches_per_epoch:
            state.update(epoch=state["epoch"] + 1, batches_in_epoch=0)
    # Trackers first: one that cannot start (say, wandb without an API key) stops the run before an old one is removed.
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}
    accelerator.init_trackers(tracker_run_name(args.report_to, args.output_dir), hparams)
    is_writer = accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process
    if is_writer:
        remove_checkpoints(args.output_dir, only_incomplete=not args.overwrite_output_dir)
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(args.output_dir / "args.json", vars(args))
        # A resumed run drops what the interrupted one logged after its checkpoint; a new run starts afresh.
        keep_records_up_to(args.output_dir / "metrics.jsonl", state["global_step"])
    return state


def train_loop(
    args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, task, state,
    max_train_steps, num_epochs, stop_signals,
) -> tuple[dict, dict, int | None]:  # fmt: skip
    """Train from `state` to the last step (or an early stop): the final metrics, the throughput, and None; or,
    stopped by a signal or --max_time after saving a checkpoint, the exit status as the third item."""
    is_writer = accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process

    def log(record: dict):
        accelerator.log(record, step=state["global_step"])
        if accelerator.is_main_process:
            append_jsonl(args.output_dir / "metrics.jsonl", {"step": state["global_step"], **record})

    def check_finite():
        if window.nonfinite_losses(accelerator):
            raise UserError(
                f"the loss became NaN or infinite by step {state['global_step']} (epoch {state['epoch']}); nothing "
                "was saved since. Lower --learning_rate or keep --max_grad_norm, then --resume_from_checkpoint "
                f"latest (newest checkpoint: {newest_checkpoint(args.output_dir) or 'none'})"
            )

    def checkpoint():
        check_finite()
        with window.paused():  # throughput counts training time only
            path = save_checkpoint(
                accelerator, args.output_dir, {**state, "args": vars(args)}, is_writer, args.save_total_limit
            )
        logger.info(f"Saved checkpoint {path}")

    progress = tqdm(
        total=max_train_steps,
        initial=state["global_step"],
        desc="Training",
        disable=not accelerator.is_local_main_process,
    )
    window = ThroughputWindow(accelerator.device)
    vote = StopVote(accelerator)
    start_time = time.perf_counter()
    eval_metrics, stop_reason = {}, None
    # A run resumed from its last step has nothing left to train.
    for epoch in range(state["epoch"], num_epochs if state["global_step"] < max_train_steps else 0):
        model.train()
        train_dataloader.set_epoch(epoch)  # re-seeds the shuffle; before skip_first_batches for exact resume
        skip = state["batches_in_epoch"] if epoch == state["epoch"] else 0
        batches = skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batch_in_epoch, batch in enumerate(batches, start=skip + 1):
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                loss = task.loss(model(**batch).logits, labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            window.add(loss, batch)
            if not accelerator.sync_gradients:
                continue
            if not accelerator.optimizer_step_was_skipped:  # fp16's scaler skips updates whose gradients overflowed
                lr_scheduler.step()
            state.update(global_step=state["global_step"] + 1, epoch=epoch, batches_in_epoch=batch_in_epoch)
            step = state["global_step"]
            progress.update(1)

            # Every rank learns whether any rank was signalled or ran out of time, so all stop at the same step.
            out_of_time = args.max_time is not None and time.perf_counter() - start_time > args.max_time * 60
            signum, out_of_time = vote.agree([stop_signals.requested(), out_of_time])

            end_of_epoch = batch_in_epoch == len(train_dataloader)
            done = step >= max_train_steps
            if step % args.logging_steps == 0 or end_of_epoch or done:
                record = {
                    "epoch": round(epoch + batch_in_epoch / len(train_dataloader), 3),
                    **window.flush(accelerator),
                }
                record["learning_rate"] = lr_scheduler.get_last_lr()[0]
                check_finite()
                log(record)
                progress.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    lr=f"{record['learning_rate']:.2e}",
                    samples_s=f"{record['samples_per_second']:.1f}",
                    tokens_s=f"{record['tokens_per_second']:.0f}",
                )

            saved = False
            if (args.eval_steps and step % args.eval_steps == 0) or end_of_epoch or done:
                check_finite()
                with window.paused():  # throughput counts training time only
                    eval_metrics, _ = evaluate(model, eval_dataloader, accelerator, task)
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
                why = stop_signals.describe(signum) if signum else f"--max_time {args.max_time} minutes reached"
                logger.info(
                    f"Stopped at step {step} ({why}). To continue, run the same command with "
                    "--resume_from_checkpoint latest"
                )
                return eval_metrics, {}, 128 + signum if signum else 0
            if stop_reason or done:
                break
        if stop_reason or state["global_step"] >= max_train_steps:
            break
    progress.close()
    window.flush(accelerator)  # an early stop can leave rows since the last log out of the totals
    check_finite()
    train_runtime = time.perf_counter() - start_time
    if not eval_metrics:  # resumed from the last step: nothing left to train, but the results need metrics
        eval_metrics, _ = evaluate(model, eval_dataloader, accelerator, task)
    if stop_reason:
        logger.info(f"Early stopping at step {state['global_step']}: {stop_reason}")
    if args.load_best_model_at_end and state["best_checkpoint"]:
        accelerator.load_state(state["best_checkpoint"])
        eval_metrics = state["best_metrics"]
        best = f"{args.metric_for_best_model} = {state['best_metric']:.4f}"
        logger.info(f"Loaded the best model ({best}) from {state['best_checkpoint']}")
    totals = window.totals
    throughput = {
        "train_runtime": train_runtime,
        "train_samples_per_second": totals["samples"] / train_runtime,
        "train_tokens_per_second": totals["tokens"] / train_runtime,
        "train_padding_fraction": 1 - totals["tokens"] / max(1, totals["padded_tokens"]),
    }
    return eval_metrics, throughput, None


def save_final(args, accelerator, model, tokenizer, results: dict):
    """The model (or LoRA adapter and head), tokenizer and results."""
    accelerator.wait_for_everyone()
    save_model(accelerator, model, args.output_dir, args.merge_lora, args.trust_remote_code)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        write_json(args.output_dir / "all_results.json", results)
        write_model_card(args.output_dir, vars(args), results)
        plot_training_curves(read_jsonl(args.output_dir / "metrics.jsonl"), args.output_dir / "training_curves.png")


if __name__ == "__main__":
    # What is alive after the imports (the libraries' objects) and at the end (model, data) is freed by the
    # process's exit, not by Python: frozen, no garbage collection scans it again, the exit's included
    # (~1.5 s less CPU during a run with torch and transformers loaded, 0.1-0.9 s less at exit).
    gc.freeze()
    try:
        run_cli(main, parse_train_args)
    finally:
        gc.freeze()
