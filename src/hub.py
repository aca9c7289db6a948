"""The Hugging Face Hub: an access check before training, the upload after.

The token never reaches args.json, checkpoints, trackers, logs or the model card: the run record leaves it out
(src/record.py), and it lives on in the returned `HubTarget` only.
"""

import multiprocessing
import shlex
from dataclasses import dataclass, field
from multiprocessing.pool import ThreadPool

import huggingface_hub
from accelerate.logging import get_logger
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from src.checkpoint import LOCK_FILE
from src.errors import UserError, main_process_first
from src.reporting import tracker_project

logger = get_logger(__name__)

# huggingface_hub's HTTP client has no timeout: a network that drops packets would hang the check for minutes.
ACCESS_CHECK_SECONDS = 30


@dataclass(frozen=True)
class HubTarget:
    repo_id: str
    token: str | None = field(repr=False)


def check_hub_access(args, accelerator) -> HubTarget | None:
    """With --push_to_hub, make sure (on the main process, in seconds) that the Hub answers, accepts the token and has
    a repository to write to. Returns where to push (main process only).
    """
    if not args.push_to_hub:
        return None
    target = None
    with main_process_first(accelerator):  # a refusal stops every rank with the same one-line error
        if accelerator.is_main_process:
            target = _within(
                ACCESS_CHECK_SECONDS, _open_repo, args.hub_model_id or args.output_dir.resolve().name, args.hub_token
            )
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
    """`function(*args)`, or a UserError if it has not answered in `seconds` (its daemon thread is left to die)."""
    pool = ThreadPool(1)
    try:
        return pool.apply_async(function, args).get(seconds)
    except multiprocessing.TimeoutError:
        raise UserError(
            f"--push_to_hub: the Hugging Face Hub did not answer within {seconds} s; check the network or proxy "
            "settings, or train without --push_to_hub and upload later with `hf upload`"
        ) from None
    finally:
        pool.close()


def push_to_hub(args, accelerator, target: HubTarget | None):
    """Upload the output folder (without checkpoints and TensorBoard files) from the main process."""
    if target is None or not accelerator.is_main_process:
        return
    logger.info(f"Uploading {args.output_dir} to https://huggingface.co/{target.repo_id}")
    try:
        HfApi().upload_folder(
            repo_id=target.repo_id,
            folder_path=args.output_dir,
            commit_message="End of training",
            ignore_patterns=_local_only(args),
            token=target.token,
        )
    except Exception as err:  # after a long training: say where the model is and how to upload it by hand
        raise UserError(
            f"--push_to_hub: the upload to {target.repo_id} failed ({_short(err)}); the model is saved in "
            f"{args.output_dir}: upload it with `{upload_command(args, target)}`"
        ) from err
    logger.info(f"Pushed to https://huggingface.co/{target.repo_id}")


def _local_only(args) -> list[str]:
    """What stays out of the upload (patterns of huggingface_hub's, which `hf upload --exclude` takes too): checkpoints
    are for resuming here (optimizer states, several GB for large models), TensorBoard's event files are noise on a
    model page, the lock file marks a run writing here. The final weights, tokenizer, card, results, args.json and
    curves go up."""
    return ["checkpoint-*/", f"{tracker_project(args.report_to, args.output_dir)}/", LOCK_FILE]


def upload_command(args, target: HubTarget) -> str:
    """What uploads the output folder by hand, as push_to_hub would."""
    excluded = " ".join(f"--exclude {shlex.quote(pattern)}" for pattern in _local_only(args))
    return f"hf upload {target.repo_id} {shlex.quote(str(args.output_dir))} {excluded}"


def _short(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
