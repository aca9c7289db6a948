"""Fine-tune a Hugging Face model with Accelerate: sequence classification or regression, or a task of your own.

One script from a laptop CPU to many GPUs on many machines:

    accelerate launch train.py                                  # built-in demo task, packaged MiniLM
    accelerate launch train.py --train_file train.csv --validation_file dev.csv
    accelerate launch train.py --model_name_or_path Qwen/Qwen2.5-7B --use_peft --train_file train.csv ...   # LoRA
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train.py --config my_run.yaml

What is learnt (model, features, loss, metrics) is the task's: src/tasks/. This file is the loop around it.
"""

import gc
import sys

# Run as a script, in a process that ends with it: no garbage collection until the run is set up, and what the imports
# made frozen (never scanned); src/runtime.py, collection_resumes, says why. Imported (a notebook, the tests), or run
# by IPython's `%run train.py` (its kernel goes on, and would keep what is frozen), collection stays as it was.
_ipython = sys.modules.get("IPython")  # imported by some libraries outside IPython too: running is what counts
SCRIPT = __name__ == "__main__" and (_ipython is None or _ipython.get_ipython() is None)
if SCRIPT:
    gc.disable()
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from src.args import parse_train_args, refuse_other_tasks_flags, task_flags
from src.batch_size import fit_batch_sizes
from src.checkpoint import (
    check_output_dir,
    check_writable,
    holding_output_dir,
    is_checkpoint_writer,
    load_checkpoint,
    newest_checkpoint,
    read_checkpoint_args,
    readable_as_its_other_files,
    remove_checkpoints,
    remove_end_of_run_files,
    remove_run_files,
    resolve_checkpoint,
    save_checkpoint,
)
from src.data import check_columns, load_raw_splits
from src.errors import (
    UserError,
    about,
    errors_reach_every_rank,
    main_process_first,
    run_cli,
    unused_parameters_explained,
)
from src.evaluation import evaluate, evaluate_more, with_top_level_metrics
from src.hub import check_hub_access, push_to_hub, upload_command
from src.loaders import build_eval_dataloader, build_train_dataloader, collating_workers, padding_options
from src.model import prepare_for_training, resolve_max_length
from src.model_card import write_model_card
from src.optimizer import build_optimizer, build_scheduler, count_parameters, use_sharded_parameters
from src.plan import BatchSizes, Plan, learning_rate, make_plan
from src.record import run_record
from src.reporting import (
    append_jsonl,
    keep_records_up_to,
    metrics_line,
    read_jsonl,
    setup_logging,
    tracker_project,
    write_json,
)
from src.runtime import (
    accelerate_state_of_this_run,
    collection_resumes,
    make_accelerator,
    refuse_fsdp_without_gpus,
)
from src.signals import StopSignals, StopVote
from src.state import TrainState
from src.tasks import detect_task, task_class
from src.throughput import ThroughputWindow

if SCRIPT:
    gc.freeze()

logger = get_logger(__name__)


def build_accelerator(args, resume_path) -> tuple[Accelerator, str, int]:
    """The Accelerator, why it has its precision, and the CPU threads each process uses."""
    on_cpu = not torch.accelerator.is_available()
    # A resumed run keeps its precision, also on a machine that would choose another: resume stays exact.
    saved = read_checkpoint_args(resume_path).get("mixed_precision") if resume_path else None
    return make_accelerator(
        args,
        saved,
        find_unused_parameters=args.ddp_find_unused_parameters,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the scheduler counts optimizer updates; see train_step
        # Batches are copied to the GPU without making the host wait for the step in flight.
        dataloader_config=DataLoaderConfiguration(non_blocking=not on_cpu),
        log_with=None if args.report_to == "none" else args.report_to.split(","),
        project_config=ProjectConfiguration(project_dir=str(args.output_dir), save_on_each_node=args.save_on_each_node),
    )


def load_data_and_model(args, accelerator):
    """The task (from the training data), tokenizer, tokenized splits, the model to train and the text length.

    Rank 0 reads and tokenizes the data first, filling the caches (and downloading); the other ranks then read them.
    The model is built by every rank at once, as DeepSpeed ZeRO-3's `zero3_init_flag` needs (it partitions the weights
    in collectives of all ranks as they are created); the Hub's file locks let the ranks download it together.
    """
    with main_process_first(accelerator, args.data_preparation_timeout):
        raw = load_raw_splits(args)
        train = raw["train"]
        if args.task == "auto":
            cls, why = detect_task(train, args.label_column)
            logger.info(f"--task auto: {cls.name}, for {why}")
            refuse_other_tasks_flags(args, cls)
        else:
            cls = task_class(args.task)
        task = cls.from_data(args, train)  # labels from the whole split, as transformers' run_*.py scripts
        check_columns(raw, task.record())
        if args.max_train_samples:
            raw["train"] = train.take(args.max_train_samples)
        tokenizer = task.load_tokenizer(args.tokenizer_name, args)
    with errors_reach_every_rank(accelerator, args.data_preparation_timeout):
        model = task.build_model(args, tokenizer, accelerator.mixed_precision)
        model = prepare_for_training(model, args, accelerator, task)  # gradient checkpointing and LoRA, if asked
        max_length = resolve_max_length(
            args.max_length, tokenizer, getattr(model, "config", None), default=task.default_max_length
        )
    with main_process_first(accelerator, args.data_preparation_timeout):
        splits = {}
        for name, split in raw.items():  # 'train', 'validation', any further one (MNLI's 'validation_mismatched')
            with about(f"the {name} data"):  # a row's mistake, said with the split it is in
                splits[name] = task.features(split, tokenizer, max_length, args.preprocessing_num_workers)
        splits["train"] = task.training_rows(splits["train"], max_length)
        empty = [name for name, split in splits.items() if not len(split)]
        if empty:  # every row dropped: nothing to learn within max_length (see the task's warning)
            raise UserError(f"the {' and '.join(empty)} data has no example left within --max_length {max_length}")
    return task, tokenizer, splits, model, max_length


def build_dataloaders(args, accelerator, model, splits, tokenizer, task, resume_path, max_length):
    """The batch sizes (fitted to memory first, if asked), the training loader and one evaluation loader per
    validation split (MNLI has two), before prepare() shards them."""
    collator = task.collator(
        tokenizer, **padding_options(accelerator.device, max_length if args.pad_to_max_length else None)
    )
    sizes = BatchSizes(
        args.per_device_train_batch_size, args.gradient_accumulation_steps, args.per_device_eval_batch_size
    )
    if args.auto_find_batch_size:
        sizes = fit_batch_sizes(sizes, accelerator, model, splits, collator, task, resume_path)
    workers = collating_workers(args.dataloader_num_workers, accelerator.device)
    train_dataloader = build_train_dataloader(
        splits["train"], collator, sizes.per_device_train_batch_size, accelerator.num_processes, args.seed,
        args.group_by_length, accumulation=accelerator.gradient_accumulation_steps, num_workers=workers,
    )  # fmt: skip
    eval_dataloaders = {
        name: build_eval_dataloader(split, collator, sizes.per_device_eval_batch_size, workers)
        for name, split in splits.items()
        if name.startswith("validation")
    }
    return sizes, train_dataloader, eval_dataloaders


@dataclass
class Run:
    """What the loop works with: made once by main(), its state advanced by the loop."""

    args: object
    plan: Plan
    record: dict  # args.json: the flags, the plan and the task's record
    accelerator: Accelerator
    task: object
    model: torch.nn.Module
    optimizer: object
    lr_scheduler: object
    train_dataloader: object
    eval_dataloader: object
    state: TrainState
    stop_signals: StopSignals
    window: ThroughputWindow = None
    vote: StopVote = None
    progress: object = None
    start_time: float = field(default_factory=time.perf_counter)
    eval_metrics: dict = field(default_factory=dict)
    early_stop: str | None = None
    # This rank's share of the epoch's step losses so far (float32), on the device so that no step waits for the host;
    # added to state.epoch_loss_sum when the run ends.
    epoch_loss: torch.Tensor = None


def main(args) -> dict:
    """Train as `args` say; returns the final results. Accelerate's state that the run sets up is dropped as it returns,
    stops or fails, so that a later run in this process (a notebook, a loop over seeds) starts afresh."""
    with accelerate_state_of_this_run():
        return train(args)


def train(args) -> dict:
    refuse_fsdp_without_gpus()
    check_writable(args.output_dir)  # before hours of work
    resume = args.resume_from_checkpoint
    resume_path = resolve_checkpoint(resume, args.output_dir) if resume else None
    check_output_dir(args.output_dir, args.overwrite_output_dir, resume_path)
    setup_logging()
    accelerator, precision_reason, cpu_threads = build_accelerator(args, resume_path)
    hub_target = check_hub_access(args, accelerator)  # in seconds, before hours of training
    set_seed(args.seed)

    task, tokenizer, splits, model, max_length = load_data_and_model(args, accelerator)
    trainable_parameters, total_parameters = count_parameters(model)  # before prepare() wraps (and perhaps shards) it
    optimizer = build_optimizer(model, args, accelerator.device, learning_rate(args, task))
    sizes, train_dataloader, eval_dataloaders = build_dataloaders(
        args, accelerator, model, splits, tokenizer, task, resume_path, max_length
    )
    model, optimizer, train_dataloader, *eval_dataloaders_prepared = accelerator.prepare(
        model, optimizer, train_dataloader, *eval_dataloaders.values()
    )
    use_sharded_parameters(optimizer, model, accelerator)  # FSDP: accelerate's swap can lose parameters
    eval_dataloaders = dict(zip(eval_dataloaders, eval_dataloaders_prepared))
    # Every rank started from the same weights; from here each draws its own dropout masks.
    set_seed(args.seed, device_specific=True)

    # prepare() shards the training loader, so the step counts come from its new length.
    plan = make_plan(args, accelerator, task, sizes, max_length, precision_reason, cpu_threads, train_dataloader)
    lr_scheduler = build_scheduler(optimizer, args, plan.max_train_steps)
    accelerator.register_for_checkpointing(lr_scheduler)  # stepped once per update by the loop, saved with the state

    record = run_record(args, plan, task, hub_target)
    # The run holds --output_dir from here until it returns: a second run started into it is refused.
    with holding_output_dir(accelerator, args.output_dir, args.save_on_each_node):
        state = start_or_resume(args, accelerator, task, resume_path, record, len(train_dataloader))
        collection_resumes(SCRIPT)
        logger.info("***** Running training *****")
        lora = f" with LoRA (r={args.lora_r}, {args.lora_target_modules})" if args.use_peft else ""
        model_name = args.model_name_or_path or f"a new {args.config_name or args.model_type} with random weights"
        logger.info(f"  Model = {model_name}{lora}, {task.describe()}")
        share = f"{100 * trainable_parameters / total_parameters:.2f}%"
        logger.info(f"  Parameters = {total_parameters:,}, trainable {trainable_parameters:,} ({share})")
        logger.info(f"  Num examples = {len(splits['train'])} train, {len(splits['validation'])} validation")
        logger.info(
            f"  Processes = {accelerator.num_processes} on {accelerator.device.type} "
            f"({accelerator.distributed_type.value}), {cpu_threads} CPU threads and {plan.dataloader_num_workers} "
            "collating workers per process, "
            f"mixed precision = {plan.mixed_precision} ({precision_reason})"
        )
        logger.info(f"  Instantaneous batch size per device = {plan.per_device_train_batch_size}")
        logger.info(
            f"  Total train batch size (w. parallel, distributed & accumulation) = {plan.total_train_batch_size}"
        )
        logger.info(
            f"  Gradient accumulation steps = {plan.gradient_accumulation_steps}, num epochs = {plan.num_epochs}"
        )
        resuming = f", resuming from {resume_path} at step {state.global_step}" if resume_path else ""
        logger.info(f"  Total optimization steps = {plan.max_train_steps}{resuming}")
        logger.info(f"  Outputs = {args.output_dir.resolve()}")

        # Signals are turned into a checkpoint from here on; a signal during the final save waits for it to end.
        with StopSignals() as stop_signals:
            run = Run(args, plan, record, accelerator, task, model, optimizer, lr_scheduler, train_dataloader,
                      eval_dataloaders.pop("validation"), state, stop_signals)  # fmt: skip
            with unused_parameters_explained():
                stop_status = train_loop(run)
            if stop_status is None:
                throughput = finish_training(run)
                eval_metrics = run.eval_metrics | evaluate_more(model, eval_dataloaders, accelerator, task)  # MNLI's mm
                results = {
                    **with_top_level_metrics(eval_metrics, task),
                    **throughput,
                    "num_processes": accelerator.num_processes,
                    "cpu_threads_per_process": cpu_threads,
                    "total_train_batch_size": plan.total_train_batch_size,
                    "global_step": state.global_step,
                    "epoch": round(state.epoch + state.batches_in_epoch / len(train_dataloader), 3),  # as Trainer's
                    "trainable_parameters": trainable_parameters,
                    "total_parameters": total_parameters,
                }
                save_final(run, tokenizer, results)
                stop_status = stop_after_final_save(args, accelerator, stop_signals, hub_target)
        # DDP's reducer holds the process group. Freed after end_training() destroyed the group, it tears gloo down
        # while holding the GIL, which can deadlock with gloo's worker thread (seen: a finished rank that never exited).
        del model, run
        accelerator.free_memory()
        accelerator.end_training()
        if stop_status is not None:
            raise SystemExit(stop_status)  # stopped by a signal or --max_time, with a checkpoint to resume from
        push_to_hub(args, accelerator, hub_target)  # outside StopSignals: Ctrl-C may interrupt a slow upload
    logger.info(f"Done in {results['train_runtime']:.0f}s: {metrics_line(eval_metrics)}")
    written = "Model, model card (README.md), all_results.json, metrics.jsonl and training_curves.png"
    logger.info(f"{written} are in {args.output_dir.resolve()}")
    return results


def start_or_resume(args, accelerator, task, resume_path, record: dict, batches_per_epoch: int) -> TrainState:
    """The loop's position (restored from a checkpoint, or a fresh start), with the run's files set up."""
    state = TrainState(num_processes=accelerator.num_processes)
    if resume_path:
        state = load_checkpoint(accelerator, resume_path, record, task_flags(type(task)), task.record())
        if state.best_checkpoint and not Path(state.best_checkpoint).is_dir():  # its folder moved (a copied run)?
            beside = resume_path.parent / Path(state.best_checkpoint).name
            if args.load_best_model_at_end and not beside.is_dir():
                raise UserError(f"--load_best_model_at_end: the run's best checkpoint so far, {state.best_checkpoint}, "
                                f"is gone, and not beside {resume_path} either: copy it there, or resume without "
                                "the flag")  # fmt: skip
            state.best_checkpoint = str(beside)
        if state.batches_in_epoch >= batches_per_epoch:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    # Trackers first: one that cannot start (say, wandb without an API key) stops the run before an old one is removed.
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in record.items()}
    named = {"wandb": {"name": args.output_dir.name}}  # W&B's run named after the output folder, as Trainer's
    accelerator.init_trackers(tracker_project(args.report_to, args.output_dir), hparams, init_kwargs=named)
    if is_checkpoint_writer(accelerator, args.save_on_each_node):
        after = state.global_step if resume_path else None
        if later := remove_checkpoints(
            args.output_dir, only_incomplete=not args.overwrite_output_dir, after_step=after
        ):
            logger.info(f"Removed {', '.join(later)}: saved after step {state.global_step}, which this run resumes "
                        "from and goes on from afresh")  # fmt: skip
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        if args.overwrite_output_dir:  # every flag's value that may be a path is kept, should it be one in there
            remove_run_files(
                args.output_dir, keep=[value for value in vars(args).values() if isinstance(value, (str, Path))]
            )
        elif resume_path:  # done, and described by its card, only once it ends
            remove_end_of_run_files(args.output_dir, task.pictures)
        write_json(args.output_dir / "args.json", record)
        # A resumed run drops what the interrupted one logged after its checkpoint; a new run starts afresh.
        keep_records_up_to(args.output_dir / "metrics.jsonl", state.global_step)
    return state


def train_loop(run: Run) -> int | None:
    """Train from `run.state` to the last step (or an early stop). Returns None, or, stopped by a signal or
    --max_time after saving a checkpoint, the exit status."""
    state, plan, args = run.state, run.plan, run.args
    run.progress = tqdm(total=plan.max_train_steps, initial=state.global_step, desc="Training",
                        disable=not run.accelerator.is_local_main_process)  # fmt: skip
    run.window, run.vote = ThroughputWindow(run.accelerator.device), StopVote(run.accelerator)
    by_rank = state.epoch_loss_by_rank  # a resumed run's sums so far this epoch, restored exactly
    run.epoch_loss = torch.tensor(
        by_rank[run.accelerator.process_index] if by_rank else 0.0, device=run.accelerator.device
    )
    run.early_stop = early_stop_reason(run)  # resumed after its patience ran out: nothing left to train
    for epoch in range(state.epoch, plan.num_epochs):
        if run.early_stop or state.global_step >= plan.max_train_steps:  # also a run resumed from its last step
            break
        for batches, batch_in_epoch in optimizer_steps(run, epoch):
            train_step(run, batches)
            state.advance(epoch, batch_in_epoch)
            run.progress.update(1)
            signum, out_of_time = stop_requested(run)
            end_of_epoch = batch_in_epoch == len(run.train_dataloader)
            done = state.global_step >= plan.max_train_steps
            if state.global_step % args.logging_steps == 0 or end_of_epoch or done:
                log_training(run, epoch, batch_in_epoch)
            saved = False
            if (args.eval_steps and state.global_step % args.eval_steps == 0) or end_of_epoch or done:
                saved = evaluate_and_keep_best(run)
            every = args.checkpointing_steps
            periodic = (every == "epoch" and end_of_epoch) or (
                isinstance(every, int) and state.global_step % every == 0
            )
            # Out of time on the run's last step changes nothing: it ends as it would. A signal still stops it at once
            # with a checkpoint (the job's grace time may not hold the final save); the resumed run then finishes.
            finished = (run.early_stop or done) and not signum
            if not saved and (periodic or signum or (out_of_time and not finished)):
                checkpoint(run)
            if finished:
                break
            if signum or out_of_time:
                why = run.stop_signals.describe(signum) if signum else f"--max_time {args.max_time} minutes reached"
                unless = "without --overwrite_output_dir, " if args.overwrite_output_dir else ""  # it would start anew
                logger.info(f"Stopped at step {state.global_step} ({why}). To continue, run the same command "
                            f"{unless}with --resume_from_checkpoint latest")  # fmt: skip
                return 128 + signum if signum else 0
    return None


def optimizer_steps(run: Run, epoch: int):
    """The epoch's batches from where the run stands, grouped by optimizer step (the epoch's last group may be
    shorter), each with the number of batches of the epoch done after it."""
    loader, state = run.train_dataloader, run.state
    run.model.train()  # from_pretrained gives a model in eval mode: dropout on
    loader.set_epoch(epoch)  # re-seeds the shuffle; before skip_first_batches for exact resume
    skip = state.batches_in_epoch if epoch == state.epoch else 0
    if not skip:  # a new epoch: train_loss is the last epoch's
        state.epoch_loss_sum, state.epoch_steps = 0.0, 0
        run.epoch_loss.zero_()
    group = []
    for batch_in_epoch, batch in enumerate(skip_first_batches(loader, skip) if skip else loader, start=skip + 1):
        group.append(batch)
        if len(group) == run.plan.gradient_accumulation_steps or batch_in_epoch == len(loader):
            yield group, batch_in_epoch
            group = []


def train_step(run: Run, batches: list[dict]):
    """One optimizer update from the step's batches, its loss the mean over all their units on all ranks.

    Units (examples, or label tokens) vary from batch to batch, so each batch's summed loss is divided by the step's
    units on all ranks, counted before the first forward pass, rather than averaged per batch: accelerate's guide to
    gradient accumulation on samples of variable size. The step's batches are therefore in hand at once, so the
    gradients are synchronised on the last batch only (`no_sync` on the others) instead of through `accumulate()`,
    which would take the early end of the loader for the step's end. accelerate divides each loss by the
    accumulation steps and DDP averages over ranks: both are made up for in `scale`.
    """
    accelerator, model, task = run.accelerator, run.model, run.task
    # clamp: a step whose labels are all ignored (every token cut off, say) adds nothing, instead of 0/0 = NaN.
    units = accelerator.reduce(sum(task.units(batch) for batch in batches), reduction="sum").clamp(min=1)
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / units
    for i, batch in enumerate(batches):
        counts = task.counts(batch)  # before the step, which may take keys out of the batch
        with accelerator.no_sync(model) if i < len(batches) - 1 else nullcontext():
            step = task.step(model, batch)
            accelerator.backward(step.loss * scale)
        run.window.add(step, counts)
        run.epoch_loss += step.loss.detach().float() / units  # summed over ranks: the step's loss
    if run.args.max_grad_norm > 0:
        accelerator.clip_grad_norm_(model.parameters(), run.args.max_grad_norm)
    run.optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # fp16's scaler skips updates whose gradients overflowed
        run.lr_scheduler.step()
    run.optimizer.zero_grad()


def stop_requested(run: Run) -> tuple[int, int]:
    """(the stop signal, or 0; whether --max_time ran out), agreed by every rank so that all stop at the same step."""
    max_time = run.args.max_time
    out_of_time = max_time is not None and time.perf_counter() - run.start_time > max_time * 60
    return tuple(run.vote.agree([run.stop_signals.requested(), out_of_time]))


def log(run: Run, record: dict):
    run.accelerator.log(record, step=run.state.global_step)
    if run.accelerator.is_main_process:
        append_jsonl(run.args.output_dir / "metrics.jsonl", {"step": run.state.global_step, **record})


def log_training(run: Run, epoch: int, batch_in_epoch: int):
    """The loss and throughput since the last log, over all ranks."""
    record = {
        "epoch": round(epoch + batch_in_epoch / len(run.train_dataloader), 3),
        **run.window.flush(run.accelerator),
    }
    record["learning_rate"] = run.lr_scheduler.get_last_lr()[0]
    check_finite(run)
    log(run, record)
    run.progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['learning_rate']:.2e}",
                             samples_s=f"{record['samples_per_second']:.1f}",
                             tokens_s=f"{record['tokens_per_second']:.0f}")  # fmt: skip


def evaluate_and_keep_best(run: Run) -> bool:
    """Evaluate, keep track of the best model (a checkpoint of it with --load_best_model_at_end) and of early
    stopping. Returns whether a checkpoint was saved."""
    args, state, plan = run.args, run.state, run.plan
    check_finite(run)
    with run.window.paused():  # throughput counts training time only
        run.eval_metrics, _ = evaluate(run.model, run.eval_dataloader, run.accelerator, run.task)
    log(run, run.eval_metrics)
    logger.info(f"step {state.global_step}: {metrics_line(run.eval_metrics, leave_out=())}")
    if f"eval_{plan.metric_for_best_model}" not in run.eval_metrics:  # a task author's slip, caught at its first use
        returned = [key.removeprefix("eval_") for key in run.eval_metrics if key not in ("eval_samples", "eval_loss")]
        raise UserError(f"{type(run.task).__name__}.metric_names() lists {plan.metric_for_best_model!r} and its "
                        f"metrics() did not return it (it returned {', '.join(returned)})")  # fmt: skip
    value = run.eval_metrics[f"eval_{plan.metric_for_best_model}"]
    saved = False
    if state.improved(value, plan.greater_is_better):
        state.best_metric, state.best_metrics, state.evals_without_improvement = value, run.eval_metrics, 0
        if args.load_best_model_at_end:
            state.best_checkpoint = str(args.output_dir / f"checkpoint-{state.global_step}")
            saved = checkpoint(run)
    else:
        state.evals_without_improvement += 1
    # Every rank computed these metrics from the same gathered predictions, so all stop together.
    run.early_stop = early_stop_reason(run)
    return saved


def early_stop_reason(run: Run) -> str | None:
    """Why the run stops early (--early_stopping_patience evaluations without improvement), from the run state."""
    patience = run.args.early_stopping_patience
    if patience and run.state.evals_without_improvement >= patience:
        return f"no better {run.plan.metric_for_best_model} in {patience} evaluations"
    return None


def check_finite(run: Run):
    if run.window.nonfinite_losses(run.accelerator):
        advice = "start again with a lower --learning_rate (a resume keeps the optimizer's settings)"
        if not run.args.max_grad_norm:
            newest = newest_checkpoint(run.args.output_dir)
            resume = f": --resume_from_checkpoint latest continues from {newest}" if newest else ""
            advice += f", or with gradient clipping on (--max_grad_norm 1){resume}"
        raise UserError(f"the loss became NaN or infinite by step {run.state.global_step} (epoch {run.state.epoch}); "
                        f"nothing was saved since: {advice}")  # fmt: skip


def checkpoint(run: Run) -> bool:
    check_finite(run)
    run.state.epoch_loss_by_rank = run.accelerator.gather(run.epoch_loss.reshape(1)).tolist()  # float32, kept exact
    with run.window.paused():  # throughput counts training time only
        path = save_checkpoint(run.accelerator, run.args.output_dir, asdict(run.state) | {"args": run.record},
                               is_checkpoint_writer(run.accelerator, run.args.save_on_each_node),
                               run.args.save_total_limit)  # fmt: skip
    logger.info(f"Saved checkpoint {path}")
    return True


def finish_training(run: Run) -> dict:
    """After the last step or an early stop: the final metrics (the best model's, if asked) and the throughput."""
    run.progress.close()
    run.window.flush(run.accelerator)  # an early stop can leave rows since the last log out of the totals
    check_finite(run)
    state = run.state
    state.epoch_loss_sum += run.accelerator.reduce(run.epoch_loss.clone(), reduction="sum").item()  # a collective
    train_runtime = time.perf_counter() - run.start_time
    if not run.eval_metrics:  # resumed from the last step: nothing left to train, but the results need metrics
        run.eval_metrics, _ = evaluate(run.model, run.eval_dataloader, run.accelerator, run.task)
    if run.early_stop:
        logger.info(f"Early stopping at step {run.state.global_step}: {run.early_stop}")
    if run.args.load_best_model_at_end and state.best_checkpoint:
        best_checkpoint = state.best_checkpoint
        run.accelerator.load_state(best_checkpoint)
        run.eval_metrics = state.best_metrics
        direction = "higher" if run.plan.greater_is_better else "lower"  # a task's lower_is_better, or the flag
        best = f"{run.plan.metric_for_best_model} = {state.best_metric:.4f}, {direction} is better"
        logger.info(f"Loaded the best model ({best}) from {best_checkpoint}")
    totals = run.window.totals
    summary = {
        # As run_*_no_trainer.py report it: the mean step loss of the last epoch, over every rank.
        "train_loss": state.epoch_loss_sum / max(1, state.epoch_steps),
        "train_runtime": train_runtime,
        "train_samples_per_second": totals["samples"] / train_runtime,
        "train_tokens_per_second": totals["tokens"] / train_runtime,
        # Nothing trained (resumed from the last step): no padding to speak of, not all of it.
        "train_padding_fraction": 1 - totals["tokens"] / totals["padded_tokens"] if totals["padded_tokens"] else 0.0,
    }
    run.accelerator.log(summary, step=state.global_step)  # to the trackers, as Trainer's final log
    return summary


def stop_after_final_save(args, accelerator, stop_signals: StopSignals, hub_target) -> int | None:
    """The exit status if any rank received a stop signal during the final evaluation or save, which finished: every
    rank stops then (before the upload), not only those signalled. A collective, so also a barrier after the save."""
    requested = torch.tensor(stop_signals.requested(), device=accelerator.device)
    signum = int(accelerator.reduce(requested, reduction="max"))
    if not signum:
        return None
    upload = f"; upload it with `{upload_command(args, hub_target)}`" if hub_target else ""
    logger.info(f"The run finished and is saved, and stops here ({stop_signals.describe(signum)}){upload}")
    return 128 + signum


def save_final(run: Run, tokenizer, results: dict):
    """The model (or LoRA adapter and head), tokenizer, results, model card and curves."""
    run.accelerator.wait_for_everyone()
    output_dir = run.args.output_dir
    run.task.save_model(run.accelerator, run.model, output_dir, run.args)
    if run.accelerator.is_main_process:
        readable_as_its_other_files(output_dir)
        tokenizer.save_pretrained(output_dir)
        write_json(output_dir / "all_results.json", results)
        write_model_card(output_dir, run.record, results, run.task)
        from src.plots import plot_training_curves  # matplotlib's import (~1 s) only when a run gets this far

        plot_training_curves(read_jsonl(output_dir / "metrics.jsonl"), output_dir / "training_curves.png")


if __name__ == "__main__":
    run_cli(main, parse_train_args)
