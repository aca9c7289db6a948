"""The model card every run writes, and the Hugging Face Hub: an access check before training, the upload after.

The token is taken out of the flags before anything is saved or logged, so it never reaches args.json,
checkpoints, trackers, logs or the model card; it lives on in the returned `HubTarget` only.
"""

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
from accelerate.logging import get_logger
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from src.errors import UserError, main_process_first
from src.glue import GLUE_DATASET
from src.model import PACKAGED_MODEL
from src.reporting import tracker_run_name

logger = get_logger(__name__)

# huggingface_hub's HTTP client has no timeout: a network that drops packets would hang the check for minutes.
ACCESS_CHECK_SECONDS = 30
PACKAGED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the default model folder holds


@dataclass(frozen=True)
class HubTarget:
    repo_id: str
    token: str | None = field(repr=False)


def check_hub_access(args, accelerator) -> HubTarget | None:
    """Remove --hub_token from `args`; with --push_to_hub, make sure (on the main process, in seconds) that the
    Hub answers, accepts the token and has a repository to write to. Returns where to push (main process only).
    """
    token, args.hub_token = args.hub_token, None
    if not args.push_to_hub:
        return None
    target = None
    with main_process_first(accelerator):  # a refusal stops every rank with the same one-line error
        if accelerator.is_main_process:
            target = _within(
                ACCESS_CHECK_SECONDS, _open_repo, args.hub_model_id or args.output_dir.resolve().name, token
            )
            args.hub_model_id = target.repo_id  # resolved to owner/name, saved in args.json
            logger.info(f"Will push to https://huggingface.co/{target.repo_id} at the end (access checked)")
    return target


def _open_repo(name: str, token: str | None) -> HubTarget:
    token = token or huggingface_hub.get_token()  # HF_TOKEN, else the `hf auth login` cache
    if not token:
        raise UserError(
            "--push_to_hub needs a Hugging Face token: run `hf auth login`, export HF_TOKEN, or pass --hub_token"
        )
    api = HfApi()
    try:
        role = api.whoami(token=token).get("auth", {}).get("accessToken", {}).get("role")
        if role == "read":
            raise UserError("--push_to_hub: the Hub token is read-only; create one with write access (`hf auth login`)")
        return HubTarget(api.create_repo(name, token=token, exist_ok=True).repo_id, token)
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise UserError(
                f"--push_to_hub: the Hub refused the token for {name} (HTTP {status}); check it with `hf auth whoami`, "
                "log in again with a write token, or pass another --hub_token or --hub_model_id"
            ) from err
        raise UserError(f"--push_to_hub: cannot create or open the repository {name}: {_short(err)}") from err
    except (UserError, ValueError):  # ValueError: no network problem (the name was checked with the flags)
        raise
    except Exception as err:  # no network, DNS, proxies, HF_HUB_OFFLINE: the HTTP layer's many exception types
        offline = "HF_HUB_OFFLINE is set; " if huggingface_hub.constants.HF_HUB_OFFLINE else ""
        raise UserError(
            f"--push_to_hub: the Hugging Face Hub cannot be reached ({offline}{_short(err)}); check the network, or "
            f"train without --push_to_hub and upload the output folder later with `hf upload {name} <output_dir>`"
        ) from err


def _within(seconds: float, function, *args):
    """`function(*args)`, or a UserError if it has not answered in `seconds` (its thread is left to die)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise UserError(
            f"--push_to_hub: the Hugging Face Hub did not answer within {seconds} s; check the network or proxy "
            "settings, or train without --push_to_hub and upload later with `hf upload`"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def push_to_hub(args, accelerator, target: HubTarget | None):
    """Upload the output folder (without checkpoints and TensorBoard files) from the main process."""
    if target is None or not accelerator.is_main_process:
        return
    logger.info(f"Uploading {args.output_dir} to https://huggingface.co/{target.repo_id}")
    # Checkpoints are for resuming here (optimizer states, several GB for large models); TensorBoard's event files
    # are noise on a model page. The final weights, tokenizer, card, results, args.json and curves go up.
    local_only = ["checkpoint-*", tracker_run_name(args.report_to, args.output_dir)]
    try:
        HfApi().upload_folder(
            repo_id=target.repo_id,
            folder_path=args.output_dir,
            commit_message="End of training",
            ignore_patterns=[f"{folder}/" for folder in local_only],
            token=target.token,
        )
    except Exception as err:  # after a long training: say where the model is and how to upload it by hand
        raise UserError(
            f"--push_to_hub: the upload to {target.repo_id} failed ({_short(err)}); the model is saved in "
            f"{args.output_dir}: upload it with `hf upload {target.repo_id} {args.output_dir} "
            + " ".join(f"--exclude '{folder}/*'" for folder in local_only)
            + "`"
        ) from err
    logger.info(f"Pushed to https://huggingface.co/{target.repo_id}")


def _short(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def write_model_card(output_dir: Path, settings: dict, results: dict):
    """README.md: base model, data, task and labels, final metrics, hyperparameters and how to load the model.

    `settings` is the run's resolved flags (args.json); keys it does not know are ignored, missing ones skipped.
    """
    output_dir = Path(output_dir)
    config_file = output_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    base = _base_model_id(settings.get("model_name_or_path"))
    base_name = base or settings.get("model_name_or_path")  # a local folder we cannot name is shown as its path
    data = _describe_data(settings)
    problem_type = config.get("problem_type")
    labels = [config["id2label"][str(i)] for i in range(len(config.get("id2label", {})))]
    adapter = (output_dir / "adapter_config.json").is_file()  # a LoRA/PEFT run saved its adapter only
    where = settings.get("hub_model_id") if settings.get("push_to_hub") else str(output_dir)

    metadata = ["---", f"library_name: {'peft' if adapter else 'transformers'}", "pipeline_tag: text-classification"]
    if base:
        metadata.append(f"base_model: {base}")
    if settings.get("dataset_name") or settings.get("task_name"):
        metadata.append(f"datasets: [{settings.get('dataset_name') or GLUE_DATASET}]")
    metadata += ["tags: [text-classification, accelerate]", "---", ""]

    kind = {
        "regression": "regression (one score per text)",
        "multi_label_classification": f"multi-label classification ({len(labels)} labels, any number per text)",
    }.get(problem_type, f"classification into {len(labels)} classes")
    lines = [
        f"# {settings.get('hub_model_id') if settings.get('push_to_hub') else output_dir.name}",
        "",
        f"Fine-tuned from `{base_name}` on {data} for {kind}, with an Accelerate training script (train.py).",
        "",
    ]
    if labels and problem_type != "regression":
        lines += ["## Labels", "", "| id | label |", "| --- | --- |"]
        lines += [f"| {i} | {name} |" for i, name in enumerate(labels)] + [""]

    metrics = {k: v for k, v in results.items() if k.startswith("eval_") and "samples" not in k}
    if metrics:
        examples = f" ({results['eval_samples']} examples)" if "eval_samples" in results else ""
        lines += ["## Results", "", f"On the validation data{examples}, at the end of training:", ""]
        lines += ["| metric | value |"]
        lines += ["| --- | --- |"] + [f"| {k.removeprefix('eval_')} | {v:.4g} |" for k, v in metrics.items()] + [""]

    lines += ["## Training", "", "| setting | value |", "| --- | --- |"]
    for key, value in _hyperparameters(settings, results):
        lines.append(f"| {key} | {value} |")
    lines += ["", "Every flag of the run is in `args.json`; the curves are in `training_curves.png`.", ""]

    lines += ["## How to use", "", "```python"]
    if adapter:
        # The base model takes this folder's config (labels, pad token, head size); peft's AutoPeft* classes
        # would rebuild it from the base model's own config and fail on the head, or lose the labels.
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer",
            "",
            f'config = AutoConfig.from_pretrained("{where}")',
            f'base = AutoModelForSequenceClassification.from_pretrained("{base_name}", config=config)  # trained from',
            f'model = PeftModel.from_pretrained(base, "{where}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        ]
    else:
        multi = problem_type == "multi_label_classification"
        lines += [
            "from transformers import pipeline",
            "",
            f'classifier = pipeline("text-classification", model="{where}"{", top_k=None" if multi else ""})',
            'print(classifier("Your text here"))',
        ]
        if multi:
            threshold = settings.get("multi_label_threshold", 0.5)
            lines.append(f"# every label with its sigmoid score; the run predicts the labels scoring above {threshold}")
    lines += ["```", ""]
    (output_dir / "README.md").write_text("\n".join(metadata + lines))


def _base_model_id(name: str | None) -> str | None:
    """The Hub id of the base model, for the card's metadata; None for a local folder we cannot name."""
    if not name:
        return None
    if Path(name, "config.json").is_file():
        return PACKAGED_MODEL_ID if PACKAGED_MODEL in Path(name).parts else None
    return name


def _describe_data(settings: dict) -> str:
    if settings.get("task_name"):
        source = "the Hub" if not settings.get("train_file") else f"local files ({Path(settings['train_file']).name})"
        return f"GLUE {settings['task_name'].upper()} ({source})"
    if settings.get("dataset_name"):
        config = settings.get("dataset_config_name")
        return f"`{settings['dataset_name']}`" + (f" ({config})" if config else "")
    if settings.get("train_file"):
        validation = settings.get("validation_file")
        return f"`{Path(settings['train_file']).name}`" + (
            f" (validation: `{Path(validation).name}`)" if validation else ""
        )
    return "the built-in synthetic demo task"


def _hyperparameters(settings: dict, results: dict) -> list[tuple[str, object]]:
    rows = [
        ("learning rate", settings.get("learning_rate")),
        ("optimizer steps", results.get("global_step")),
        ("epochs", settings.get("num_train_epochs") if not settings.get("max_train_steps") else None),
        ("total train batch size", results.get("total_train_batch_size")),
        ("per-device batch size", settings.get("per_device_train_batch_size")),
        ("processes", results.get("num_processes")),
        ("gradient accumulation steps", settings.get("gradient_accumulation_steps")),
        ("scheduler", settings.get("lr_scheduler_type")),
        ("warmup", _warmup(settings)),
        ("weight decay", settings.get("weight_decay")),
        ("max length", settings.get("max_length")),
        ("mixed precision", settings.get("mixed_precision")),
        ("seed", settings.get("seed")),
    ]
    if settings.get("class_weights") not in (None, "none"):
        values = settings.get("class_weight_values") or {}
        shown = ", ".join(f"{k}: {v:.3g}" for k, v in list(values.items())[:20])
        rows.append(("class weights", f"{settings['class_weights']} ({shown})" if shown else settings["class_weights"]))
    if settings.get("use_peft"):
        rows.append(("PEFT", ", ".join(f"{k}={v}" for k, v in settings.items() if k.startswith("lora_")) or "yes"))
    return [(key, value) for key, value in rows if value is not None]


def _warmup(settings: dict):
    if settings.get("num_warmup_steps") is not None:
        return f"{settings['num_warmup_steps']} steps"
    return f"{settings['warmup_ratio']:.0%} of the steps" if settings.get("warmup_ratio") is not None else None
