"""Resumable checkpoints: accelerate's `save_state` plus where the loop stood, and nothing half-written.

A checkpoint is written to `checkpoint-<step>.incomplete/` and renamed to `checkpoint-<step>/` only when
every rank has finished writing, so a kill during a save leaves the previous checkpoint as the latest.
"""

import fcntl
import json
import os
import shutil
import socket
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import RNG_STATE_NAME, load

from src.errors import UserError, errors_reach_every_rank
from src.record import RECORD_FILE
from src.state import TrainState

logger = get_logger(__name__)

STATE_FILE = "training_state.json"
PREFIX = "checkpoint-"
RESULTS_FILE = "all_results.json"
LOCK_FILE = ".lock"  # held by the run writing into the folder: see holding_output_dir


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    found = []
    for path in Path(output_dir).glob(f"{PREFIX}*"):
        step = path.name[len(PREFIX) :]
        if step.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def check_writable(folder: Path, flag: str = "--output_dir"):
    """A folder that can be made and written, checked before hours of work: a path through a file, or a read-only
    or foreign folder, would fail at the first save."""
    existing = next(path for path in (Path(folder), *Path(folder).absolute().parents) if path.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {folder}: {existing} is a file, not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK):
        raise UserError(f"{flag} {folder}: {existing} cannot be written (read-only, or another user's); choose "
                        f"another {flag}")  # fmt: skip


def check_output_dir(output_dir: Path, overwrite: bool, resume_from: Path | None):
    """Refuse to train over a finished run or its checkpoints unless asked to (--overwrite_output_dir, or a resume of
    that run from a checkpoint in it)."""
    if not Path(output_dir).is_dir():
        return
    if holder := _in_use_by(output_dir):  # a run still going there: resuming it or starting afresh would both fail
        raise UserError(_in_use(output_dir, holder))
    if overwrite or resume_from is not None and Path(resume_from).resolve().parent == Path(output_dir).resolve():
        return
    earlier = [p.name for p in complete_checkpoints(output_dir)] + (
        [RESULTS_FILE] if (Path(output_dir) / RESULTS_FILE).exists() else []
    )
    if earlier and resume_from is not None:  # another folder's checkpoint would continue over this run's files
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier[-3:])}), and --resume_from_checkpoint "
            f"{resume_from} is another folder's checkpoint: resume it into its own folder ({Path(resume_from).parent}) "
            "or an empty one"
        )
    if earlier:
        # A finished run that kept no checkpoint cannot be continued: only the choices that work are offered.
        resume = "--resume_from_checkpoint latest to continue it, " if earlier[0] != RESULTS_FILE else ""
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier[-3:])}); pass {resume}"
            "--overwrite_output_dir to start afresh there, or choose another --output_dir"
        )


@contextmanager
def holding_output_dir(accelerator, output_dir: Path, save_on_each_node: bool = False):
    """While the run is in this block, no other may write into `output_dir`: a second run started into it (a duplicate
    job, or a requeued one while the old one still saves) would mix its files with this one's, and is refused. An
    advisory lock on LOCK_FILE, taken by the processes that write checkpoints, which the system also lets go of when
    the process ends, however it ends."""
    with errors_reach_every_rank(accelerator):  # a refusal stops every rank
        lock = _lock(output_dir, save_on_each_node) if is_checkpoint_writer(accelerator, save_on_each_node) else None
    try:
        yield
    finally:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)  # processes forked from here (datasets' map) share it: closing won't do
            lock.close()


def _in_use(output_dir: Path, holder: str) -> str:
    return (
        f"--output_dir {output_dir} is in use by another run ({holder}): wait for it to end, or choose another "
        f"--output_dir; if that process is gone (its machine failed), delete {Path(output_dir) / LOCK_FILE}"
    )


def _in_use_by(output_dir: Path) -> str | None:
    """Who holds `output_dir`'s lock now, or None. Probed with a shared lock, which the ranks of one run may all
    take at once, and let go of at once."""
    try:
        with open(Path(output_dir) / LOCK_FILE) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return file.read().strip() or "another process"
            fcntl.flock(file, fcntl.LOCK_UN)
    except OSError:  # no lock file (no run was ever there), or a file system without locks
        return None
    return None


def _lock(output_dir: Path, save_on_each_node: bool):
    """LOCK_FILE, open and locked, naming this process; None on a file system without locks."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    file = None
    try:
        file = open(Path(output_dir) / LOCK_FILE, "a+")  # noqa: SIM115 (closed by holding_output_dir)
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        hint = ("; with --save_on_each_node the nodes must not share it (another node of this run may hold it)"
                if save_on_each_node else "")  # fmt: skip
        raise UserError(_in_use(output_dir, holder) + hint) from None
    except OSError as err:  # a file system without locks (some network ones), a lock file not ours: unguarded
        if file is not None:
            file.close()
        logger.warning(f"--output_dir {output_dir} cannot be locked ({err.strerror}): make sure no other run writes "
                       "into it")  # fmt: skip
        return None
    file.truncate(0)
    file.write(f"train.py, pid {os.getpid()} on {socket.gethostname()}\n")
    file.flush()
    return file


def remove_run_files(output_dir: Path, keep=()):
    """An overwritten run's files, if the folder holds a run (its args.json): all but its TensorBoard logs and other
    folders, and the paths in `keep` (what the new run reads: its data or --config kept there). Any of them left
    beside the new run's would be read with it: an adapter_config.json makes a whole model's folder read as an
    adapter, a config.json an adapter's as a whole model, a chat_template.jinja changes the tokenizer, an
    eval_results.json is another model's."""
    if not (Path(output_dir) / RECORD_FILE).is_file():  # not a run's folder: nothing of it is ours to delete
        return
    kept = {Path(path).resolve() for path in keep}
    for path in Path(output_dir).iterdir():
        if path.is_file() and path.name != LOCK_FILE and path.resolve() not in kept:
            path.unlink()


# What the end of a run writes into its folder (the model, whole, sharded or an adapter, with its configs; the card,
# results and curves) and evaluate.py beside it. The tokenizer's files, the same on a resume, are left.
END_OF_RUN_FILES = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "adapter_model.*",
                    "config.json", "generation_config.json", "adapter_config.json", "README.md", RESULTS_FILE,
                    "training_curves.png", "eval_results.json", "predictions.csv")  # fmt: skip


def remove_end_of_run_files(output_dir: Path, pictures=()):
    """What the end of the run that a resume continues wrote, and evaluate.py's results (with the task's `pictures`):
    the resumed run writes its own as it ends, and an old one beside them would be read with them (a merged model's
    config.json beside a new adapter's files) or describe a model that is gone. Other files, the user's, stay."""
    if not (Path(output_dir) / RECORD_FILE).is_file():  # a resume into a new folder: nothing there is ours
        return
    for pattern in (*END_OF_RUN_FILES, *pictures):
        for path in Path(output_dir).glob(pattern):
            path.unlink()


def remove_checkpoints(output_dir: Path, only_incomplete: bool = False, after_step: int | None = None) -> list[str]:
    """All checkpoints, or only the folders of saves cut short (by SIGKILL, SIGQUIT or a crash) and, `after_step`
    given (a resume from an earlier checkpoint), those saved after it: they belong to a continuation that the resumed
    run replaces, as its metrics.jsonl records do, and would otherwise be the 'latest' one and outrank its own in the
    rotation. Returns the names of the later ones."""
    later = {}
    for path in Path(output_dir).glob(f"{PREFIX}*"):
        step = path.name[len(PREFIX) :]
        is_later = after_step is not None and step.isdigit() and int(step) > after_step
        if is_later or not only_incomplete or step.endswith(".incomplete"):
            shutil.rmtree(path)
        if is_later:
            later[int(step)] = path.name
    return [later[step] for step in sorted(later)]


def is_checkpoint_writer(accelerator, save_on_each_node: bool) -> bool:
    """The process that writes, renames and rotates checkpoints: the main one, or each node's own local main one when
    the nodes share no file system (--save_on_each_node)."""
    return accelerator.is_local_main_process if save_on_each_node else accelerator.is_main_process


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (another thread may be creating a file)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):
        umask = os.umask(0o077)  # elsewhere read by setting it, to a strict value for that instant, and back
        os.umask(umask)
        return umask


def readable_as_its_other_files(folder: Path):
    """The weights in `folder` get the mode every new file gets here (0644 under the usual umask 022). safetensors 0.8
    writes them through a temporary file, whose mode 0600 they keep (safetensors issue 782): teammates on a shared
    cluster, or a container's other user, could read config.json but neither load nor resume the weights."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).glob("*.safetensors"):
        with suppress(OSError):  # another user's file in a shared folder: left as it is, the run goes on
            os.chmod(path, mode)


def save_checkpoint(accelerator, output_dir: Path, state: dict, is_writer: bool, save_total_limit=None) -> Path:
    """Save model, optimizer, scheduler and RNG states (every rank) and `state` (the loop's position).

    `is_writer`: the process that renames and rotates, the main one, or each node's local main when nodes
    do not share a file system.
    """
    final = Path(output_dir) / f"{PREFIX}{state['global_step']}"
    partial = final.with_name(final.name + ".incomplete")
    if is_writer and partial.exists():
        shutil.rmtree(partial)  # left by a run killed while saving
    accelerator.wait_for_everyone()  # nobody may write into the folder while it is being removed
    accelerator.save_state(str(partial))
    if is_writer:
        (partial / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        readable_as_its_other_files(partial)
    accelerator.wait_for_everyone()  # every rank's files are in before the checkpoint counts
    if is_writer:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        if save_total_limit:  # Trainer's rule: K in all, but never the newest (to resume from) nor the best
            checkpoints = complete_checkpoints(output_dir)
            best = Path(state.get("best_checkpoint") or final).name
            protected = [path for path in checkpoints if path.name in (final.name, best)]
            others = [path for path in checkpoints if path not in protected]
            for old in others[: max(0, len(checkpoints) - max(save_total_limit, len(protected)))]:
                shutil.rmtree(old)
    # No rank returns (and perhaps exits after a stop signal) before the checkpoint is renamed: a job step
    # whose first launcher exits can be torn down with everything in it (srun --kill-on-bad-exit).
    accelerator.wait_for_everyone()
    return final


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """The folder named by --resume_from_checkpoint (a path, or 'latest' in --output_dir), checked."""
    if spec == "latest":
        latest = newest_checkpoint(output_dir)
        if latest is None and (Path(output_dir) / RESULTS_FILE).exists():
            raise UserError(
                f"--resume_from_checkpoint latest: {output_dir} holds a finished run that kept no checkpoint; to train "
                f"its model further, start a new run with --model_name_or_path {output_dir} (and another --output_dir)"
            )
        if latest is None:
            raise UserError(
                f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir} yet; to start the run, "
                "drop --resume_from_checkpoint"
            )
        return latest
    path = Path(spec)
    if not path.is_dir():
        trainers = spec.lower() == "true"  # Trainer's resume_from_checkpoint=True
        latest = " (Trainer's True is 'latest' here: the newest checkpoint in --output_dir)" if trainers else ""
        raise UserError(f"--resume_from_checkpoint {spec}: no such folder{latest}")
    if path.name.endswith(".incomplete"):  # a save cut short, whatever it holds; the next save replaces it
        raise UserError(f"--resume_from_checkpoint {spec}: a save that was cut short; use an earlier checkpoint or "
                        "'latest'")  # fmt: skip
    if not (path / STATE_FILE).is_file():
        raise UserError(
            f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_FILE}); it may have been "
            "cut short while saving: use an earlier checkpoint or 'latest'"
        )
    return path


# What a resumed run must keep to continue exactly: what decides the batches, the adapter and the optimizer's settings;
# with the task and its own flags and settings (its record: columns, labels, which tokens are learnt), which
# load_checkpoint adds.
SAME_ON_RESUME = (
    "task",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "group_by_length",
    "train_file_sha256",  # the data, by its contents (src/record.py)
    "validation_held_out",
    "dataset_name",
    "dataset_config_name",
    "task_name",
    "max_train_samples",
    "validation_split_percentage",  # without a validation file, it decides which rows train
    "max_length",
    "mixed_precision",  # kept when not given (a machine that would choose another); given, it must be the same
    "tokenizer_name",
    "model_type",  # a new model's definition: its config
    "config_name",
    "config_overrides",
    "keep_linebreaks",  # a .txt file's blocks
    "use_peft",  # the adapter's shape and scale: a resume with others continues another model or cannot load
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    # The optimizer's settings, which its state from the checkpoint would override without a word, and the schedule's
    # shape, which would change mid-run. A longer run (--num_train_epochs, --max_train_steps) may resume.
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_ratio",
    "num_warmup_steps",
    # What the best model so far was chosen by: another metric's value would be compared with the saved best, and
    # without a checkpoint of it (--load_best_model_at_end added on resume) that best could not be loaded at the end.
    "metric_for_best_model",
    "greater_is_better",
    "load_best_model_at_end",
)


def _change(key: str, then, now) -> str:
    """A setting that differs, in the user's words: the flag, or what of it the record holds (a file's hash)."""
    if key == "validation_held_out":  # rows held out of the training file: no validation file given
        key, then, now = "validation_file", not then, not now
    elif key.endswith("_sha256"):  # train_file_sha256: --train_file's contents, chat_template_sha256: a template's
        if then and now:
            return f"{key.removesuffix('_sha256')}: other contents"
        key = key.removesuffix("_sha256")
    else:
        earlier = " (a checkpoint of an earlier version: compared by path)" if key == "train_file" else ""
        return f"--{key} {then} -> {now}{earlier}"
    return f"{key}: {'one' if then else 'none'} then, {'one' if now else 'none'} now"


def read_checkpoint_args(path: Path) -> dict:
    """The resolved flags a checkpoint was saved with ({} if unreadable: load_checkpoint says why)."""
    try:
        return json.loads((Path(path) / STATE_FILE).read_text()).get("args", {})
    except (OSError, ValueError, AttributeError):
        return {}


def load_checkpoint(accelerator, path: Path, record: dict, task_flags=(), task_settings=()) -> TrainState:
    """Restore everything `save_checkpoint` saved; returns the loop's position. `record`: this run's (args.json);
    `task_flags`: the task's own flags, compared as SAME_ON_RESUME is; `task_settings`: the keys the task wrote
    (`Task.record()`), compared too, and named where no flag's change explains theirs."""
    try:
        saved_state = json.loads((path / STATE_FILE).read_text())
        position = [saved_state[key] for key in ("global_step", "epoch", "batches_in_epoch", "num_processes")]
        state = TrainState.from_dict(saved_state)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"checkpoint {path}: {STATE_FILE} is unreadable or incomplete ({err}); use another") from err
    saved = dict(saved_state.get("args", {}))
    # Checkpoints of earlier versions name the training file by its path only, and whether validation rows were held
    # out of it by their flags.
    saved.setdefault("validation_held_out", bool(saved.get("train_file") and not saved.get("validation_file")))
    flags = (*SAME_ON_RESUME, *task_flags, *(() if "train_file_sha256" in saved else ("train_file",)))
    changed = [_change(key, saved[key], record.get(key)) for key in flags
               if key in saved and str(saved[key]) != str(record.get(key))]  # fmt: skip
    changed = changed or [_change(key, saved[key], record.get(key)) for key in task_settings
                          if key in saved and str(saved[key]) != str(record.get(key))]  # fmt: skip
    if changed:
        raise UserError(
            f"checkpoint {path} was made with other settings ({'; '.join(changed)}): resume with the same ones "
            "so the run continues exactly, or start a new run"
        )
    # First: another number of processes also changes the steps an epoch takes, which the next check counts.
    if position[3] != accelerator.num_processes:
        written = f"{position[3]} process{'es' if position[3] > 1 else ''}"
        raise UserError(
            f"checkpoint {path} was written by {written} and this run has {accelerator.num_processes}; resume with "
            "the same number so the data order continues exactly"
        )
    if position[0] > record.get("max_train_steps", position[0]):  # it would end at once, its weights the final ones
        raise UserError(
            f"checkpoint {path} is at step {position[0]}, past this run's {record['max_train_steps']} optimizer steps "
            "(--max_train_steps, --num_train_epochs): resume with at least as many, or start a new run"
        )
    try:
        # load_state skips an unreadable RNG state file with a note on the main process only, and the run goes on
        # no longer exact: read this rank's first, so that a damaged one is an error.
        load(path / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl")
        accelerator.load_state(str(path))
    except Exception as err:  # torch, safetensors and pickle each raise their own types for a damaged file
        raise UserError(
            f"checkpoint {path} cannot be loaded ({' '.join(str(err).split())[:300]}); it is damaged, or from "
            f"another model, or a flag that shapes the model or optimizer changed (a flag of your own belongs in "
            f"SAME_ON_RESUME, src/checkpoint.py): use an earlier checkpoint{_earlier(path)}, or the run's flags"
        ) from err
    # Without a shared file system each node picks its own 'latest': every rank must have the same step.
    steps = accelerator.gather(torch.tensor([state.global_step], device=accelerator.device))
    if steps.min() != steps.max():
        raise UserError(
            f"the ranks resumed from different steps ({sorted(set(steps.tolist()))}): the nodes' --output_dir "
            "folders hold different checkpoints; pass the same checkpoint path on every node"
        )
    return state


def _earlier(path: Path) -> str:
    """The checkpoint saved before `path` in its folder, as a flag ('latest' would pick `path` again)."""
    checkpoints = complete_checkpoints(path.parent)
    earlier = checkpoints[: checkpoints.index(path)] if path in checkpoints else []
    return f" (--resume_from_checkpoint {earlier[-1]})" if earlier else " (there is none: start the run again)"


def newest_checkpoint(output_dir: Path) -> Path | None:
    return (complete_checkpoints(output_dir) or [None])[-1]  # none in a folder that does not exist either
