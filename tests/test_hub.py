"""--push_to_hub against a stand-in for the Hub (HfApi's methods replaced), the token's privacy, model cards."""

import json
import logging
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
from conftest import load_script, train_args
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import filter_repo_objects

import src.hub
from src.errors import UserError
from src.hub import HubTarget, check_hub_access, push_to_hub
from src.model_card import write_model_card
from src.plan import Plan
from src.record import run_record
from src.reporting import tracker_project
from src.tasks.sequence_classification import SINGLE_LABEL, SequenceClassification

train = load_script("train")
SECRET = "hf_SeCrEtToKeN0123456789"
BINARY = SequenceClassification(SINGLE_LABEL, ("negative", "positive"), columns=("sentence", None, "label"))


class FakeHub:
    """Records what train.py asks of the Hub; `role`, `refuse` and `delay` make it answer otherwise."""

    def __init__(self, output_dir: Path | None = None):
        self.output_dir, self.calls, self.uploaded = output_dir, [], None
        self.role, self.refuse, self.delay, self.upload_error = "write", None, 0, None

    def whoami(self, api, token=None, **kwargs):
        time.sleep(self.delay)
        # Whether training had started: it writes args.json first.
        started = bool(self.output_dir and (self.output_dir / "args.json").exists())
        self.calls.append(("whoami", token, started))
        if self.refuse:
            request = httpx2.Request("GET", "https://huggingface.co/api/whoami-v2")
            raise HfHubHTTPError("Invalid user token.", response=httpx2.Response(self.refuse, request=request))
        return {"name": "alice", "auth": {"accessToken": {"role": self.role}}}

    def create_repo(self, api, repo_id, token=None, exist_ok=False, **kwargs):
        self.calls.append(("create_repo", repo_id, exist_ok))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"alice/{repo_id}")

    def upload_folder(self, api, *, repo_id, folder_path, token=None, ignore_patterns=None, **kwargs):
        if self.upload_error:
            raise self.upload_error
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        self.uploaded = {"repo_id": repo_id, "token": token,
                         "files": list(filter_repo_objects(files, ignore_patterns=ignore_patterns))}  # fmt: skip


@pytest.fixture
def one_process():
    """What check_hub_access and push_to_hub need of an Accelerator (and accelerate's logging needs a state)."""
    from accelerate import PartialState

    return PartialState(cpu=True)


@pytest.fixture
def fake_hub(monkeypatch):
    hub = FakeHub()
    for name in ("whoami", "create_repo", "upload_folder"):
        monkeypatch.setattr(HfApi, name, lambda api, *a, _name=name, **k: getattr(hub, _name)(api, *a, **k))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


def test_push_checks_first_uploads_last_and_never_writes_the_token(tmp_path, tiny_model, tiny_data, fake_hub, capfd,
                                                                   caplog):  # fmt: skip
    out = tmp_path / "my-classifier"
    fake_hub.output_dir = out
    args = train_args(tiny_model, *tiny_data, out, "--push_to_hub", "--hub_token", SECRET, "--checkpointing_steps",
                      "8", "--report_to", "tensorboard", "--num_train_epochs", "1")  # fmt: skip
    caplog.set_level(logging.INFO)
    train.main(train.parse_train_args(args))

    assert fake_hub.calls == [("whoami", SECRET, False), ("create_repo", "my-classifier", True)], "before training"
    uploaded = fake_hub.uploaded
    assert uploaded["repo_id"] == "alice/my-classifier" and uploaded["token"] == SECRET
    files = set(uploaded["files"])
    expected = {"model.safetensors", "config.json", "tokenizer.json", "README.md", "all_results.json", "args.json",
                "metrics.jsonl", "training_curves.png"}  # fmt: skip
    assert expected <= files, files
    assert not [f for f in files if f.startswith(("checkpoint-", "tensorboard/"))]
    assert (out / "checkpoint-8").is_dir() and list((out / "tensorboard").rglob("events.out.tfevents.*"))

    settings = json.loads((out / "args.json").read_text())
    assert "hub_token" not in settings and settings["hub_model_id"] == "alice/my-classifier"
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and '"alice/my-classifier"' in card
    # Nowhere on disk (args.json, checkpoints, TensorBoard's hparams, the card), nor in the logs.
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err + caplog.text
    assert "alice/my-classifier" in captured.err + caplog.text


def test_the_token_comes_from_hf_token_or_the_login_cache(fake_hub, monkeypatch, tmp_path, one_process):
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    args = SimpleNamespace(hub_token=None, push_to_hub=True, hub_model_id="team/model", output_dir=tmp_path)
    target = check_hub_access(args, one_process)
    assert target == HubTarget("team/model", "hf_from_the_environment") and "hf_from" not in repr(target)
    assert fake_hub.calls[0] == ("whoami", "hf_from_the_environment", False)

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(src.hub.huggingface_hub, "get_token", lambda: None)  # no `hf auth login` either
    with pytest.raises(UserError, match="--push_to_hub needs a Hugging Face token: run `hf auth login`, export"):
        check_hub_access(SimpleNamespace(hub_token=None, push_to_hub=True, hub_model_id="m", output_dir=tmp_path),
                         one_process)  # fmt: skip


def test_without_push_to_hub_the_token_is_dropped_and_the_hub_untouched(fake_hub, tmp_path, one_process):
    args = SimpleNamespace(hub_token=SECRET, push_to_hub=False, hub_model_id=None, output_dir=tmp_path,
                           train_file=None, validation_file=None)  # fmt: skip
    assert check_hub_access(args, one_process) is None and not fake_hub.calls
    plan = Plan("no", "asked for", 1, 0, 5e-5, 8, 1, 8, 64, "accuracy", True, 10, 1, 8)
    record = run_record(args, plan, BINARY)
    assert "hub_token" not in record and SECRET not in json.dumps(record)


@pytest.mark.parametrize(
    "setup,message",
    [
        (
            {"refuse": 401},
            "--push_to_hub: the Hub refused the token for out (HTTP 401); check it with `hf auth whoami`",
        ),
        ({"role": "read"}, "--push_to_hub: the Hub token is read-only; create one with write access"),
    ],
)
def test_a_refused_token_stops_before_training(tmp_path, tiny_model, tiny_data, fake_hub, setup, message):
    vars(fake_hub).update(setup)
    args = train_args(tiny_model, *tiny_data, tmp_path / "out", "--push_to_hub", "--hub_token", SECRET)
    with pytest.raises(UserError) as error:
        train.main(train.parse_train_args(args))
    assert str(error.value).startswith(message) and SECRET not in str(error.value)
    assert not (tmp_path / "out").exists(), "nothing trained, nothing written"


def test_an_unreachable_hub_stops_before_training(tmp_path, tiny_model, tiny_data, monkeypatch):
    """The real huggingface_hub, offline (conftest sets HF_HUB_OFFLINE=1)."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    args = train_args(tiny_model, *tiny_data, tmp_path / "out", "--push_to_hub")
    expected = r"the Hugging Face Hub cannot be reached \(HF_HUB_OFFLINE is set; .*`hf upload out <output_dir>`"
    with pytest.raises(UserError, match="--push_to_hub: " + expected):
        train.main(train.parse_train_args(args))
    assert not (tmp_path / "out").exists()


def test_a_hub_that_does_not_answer_is_given_up_on(fake_hub, monkeypatch, tmp_path, one_process):
    fake_hub.delay = 5
    monkeypatch.setattr(src.hub, "ACCESS_CHECK_SECONDS", 0.2)
    args = SimpleNamespace(hub_token=SECRET, push_to_hub=True, hub_model_id=None, output_dir=tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(UserError, match="the Hugging Face Hub did not answer within 0.2 s"):
        check_hub_access(args, one_process)
    assert time.monotonic() - started < 4, "gave up without waiting for the answer"


def test_with_every_tracker_the_tensorboard_logs_stay_local_too(fake_hub, tmp_path, one_process):
    """--report_to all: TensorBoard writes into a folder named after the run (the other trackers' run name)."""
    out = tmp_path / "my-run"
    for name in ("model.safetensors", "my-run/events.out.tfevents.1", "checkpoint-2/optimizer.bin"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    push_to_hub(SimpleNamespace(output_dir=out, report_to="all"), one_process, HubTarget("alice/run", SECRET))
    assert fake_hub.uploaded["files"] == ["model.safetensors"]


def test_trackers_file_the_run_in_the_project_wandb_project_names(monkeypatch, tmp_path):
    """As Trainer's W&B runs; Accelerate hands W&B its project name, which would override the variable."""
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert tracker_project("wandb", tmp_path / "my-run") == "my-run"
    monkeypatch.setenv("WANDB_PROJECT", "team")
    assert tracker_project("wandb", tmp_path / "my-run") == tracker_project("all", tmp_path / "my-run") == "team"
    assert tracker_project("tensorboard", tmp_path / "my-run") == "tensorboard"


def test_a_failed_upload_says_where_the_model_is(fake_hub, tmp_path, one_process):
    fake_hub.upload_error = ConnectionError("connection reset")
    folder = tmp_path / "my run"  # a space: the command to paste quotes the folder
    args = SimpleNamespace(output_dir=folder, report_to="tensorboard")
    command = rf"hf upload alice/run '{folder}' --exclude 'checkpoint-\*/' --exclude tensorboard/ --exclude .lock"
    with pytest.raises(UserError, match=rf"upload to alice/run failed \(connection reset\); the model is saved in "
                                        rf"{folder}: upload it with `{command}`"):  # fmt: skip
        push_to_hub(args, one_process, HubTarget("alice/run", SECRET))
    push_to_hub(args, SimpleNamespace(is_main_process=False), HubTarget("alice/run", SECRET))  # not the main process


def test_the_printed_upload_command_uploads_what_push_to_hub_would(fake_hub, tmp_path, one_process, monkeypatch):
    """The `hf upload` command that a failed upload (or a stop after the final save) prints, run by huggingface_hub's
    own CLI: the same files go up as with --push_to_hub, checkpoints and TensorBoard logs left out."""
    from huggingface_hub.cli.hf import main as hf_cli

    folder = tmp_path / "my run"
    for name in ("model.safetensors", "README.md", "checkpoint-2/optimizer.bin", "tensorboard/events.out", ".lock"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    args = SimpleNamespace(output_dir=folder, report_to="tensorboard")
    push_to_hub(args, one_process, HubTarget("alice/run", SECRET))
    pushed = fake_hub.uploaded["files"]
    assert pushed == ["README.md", "model.safetensors"]
    fake_hub.uploaded = None
    monkeypatch.setattr("sys.argv", shlex.split(src.hub.upload_command(args, HubTarget("alice/run", SECRET))))
    try:
        hf_cli()
    except SystemExit as exit:
        assert not exit.code, "the hf CLI refused the command"
    assert fake_hub.uploaded["files"] == pushed and fake_hub.uploaded["repo_id"] == "alice/run"


def test_the_model_card_of_an_adapter_run_and_unknown_settings(tmp_path):
    """A LoRA output folder (adapter only, no config.json) and flags this card does not know are fine."""
    (tmp_path / "adapter_config.json").write_text("{}")
    settings = {"model_name_or_path": "meta-llama/Llama-3.2-1B", "use_peft": True, "lora_r": 8, "lora_alpha": 16,
                "some_future_flag": [1, 2], "dataset_name": "imdb", "learning_rate": 2e-4, "hub_token": SECRET,
                "num_warmup_steps": 5, "warmup_ratio": 0.1}  # fmt: skip
    write_model_card(tmp_path, settings, {"eval_accuracy": 0.91234, "eval_samples": 100, "global_step": 30}, BINARY)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: peft" in card and "base_model: meta-llama/Llama-3.2-1B" in card
    base = 'AutoModelForSequenceClassification.from_pretrained("meta-llama/Llama-3.2-1B", config=config, ignore_mis'
    assert base + "matched_sizes=True)" in card
    assert "PeftModel.from_pretrained(base, " in card and "datasets: [imdb]" in card
    assert "| accuracy | 0.9123 |" in card and "(100 examples)" in card
    assert "| PEFT | lora_r=8, lora_alpha=16 |" in card and "| warmup | 5 steps |" in card
    assert SECRET not in card


def test_the_card_of_the_packaged_model_names_it_by_its_hub_id(tmp_path):
    """The default model lives in site-packages; the card (perhaps pushed to the Hub) names it, not that path."""
    from src.model import default_model_path

    write_model_card(tmp_path, {"model_name_or_path": default_model_path()}, {}, BINARY)
    card = (tmp_path / "README.md").read_text()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card
    assert "Fine-tuned from `sentence-transformers/all-MiniLM-L6-v2`" in card and "site-packages" not in card
    # An adapter's code loads the base from where the run did, offline too, and this folder by its absolute path
    # (run from elsewhere, a relative one would be a Hub name); pushed, both by their Hub ids.
    (tmp_path / "adapter_config.json").write_text("{}")
    for pushed, base, where in ((False, default_model_path(), tmp_path.resolve()),
                                (True, "sentence-transformers/all-MiniLM-L6-v2", "me/tuned")):  # fmt: skip
        settings = {"model_name_or_path": default_model_path(), "push_to_hub": pushed, "hub_model_id": "me/tuned"}
        write_model_card(tmp_path, settings, {}, BINARY)
        card = (tmp_path / "README.md").read_text()
        assert f'from_pretrained("{base}", config=config' in card, pushed
        assert f'PeftModel.from_pretrained(base, "{where}")' in card, pushed
    # A base in a folder given by a relative path: by its absolute one, as the folder (the path means another folder,
    # or a Hub name, from elsewhere).
    (tmp_path / "models" / "base").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        write_model_card(tmp_path, {"model_name_or_path": "models/base"}, {}, BINARY)
    card = (tmp_path / "README.md").read_text()
    assert f'from_pretrained("{tmp_path.resolve() / "models" / "base"}", config=config' in card


def test_a_task_that_gives_no_usage_gets_the_evaluate_py_command(tmp_path):
    """Commands to paste: a folder with a space in its name is quoted."""
    from src.tasks.base import Task

    folder = tmp_path / "my tagger"
    folder.mkdir()

    def commands() -> list[list[str]]:
        card = (folder / "README.md").read_text()
        return [shlex.split(line) for line in card.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]

    write_model_card(folder, {}, {}, Task())
    assert commands() == [["python", "evaluate.py", "--model_name_or_path", str(folder), "--validation_file",
                           "your_data.csv"]]  # fmt: skip
    write_model_card(folder, {"push_to_hub": True, "hub_model_id": "me/tagger"}, {}, Task())  # pushed: fetch it
    assert commands() == [["hf", "download", "me/tagger", "--local-dir", "my tagger"],
                          ["python", "evaluate.py", "--model_name_or_path", "my tagger", "--validation_file",
                           "your_data.csv"]]  # fmt: skip


def test_every_train_output_has_a_model_card(tmp_path, tiny_model, tiny_data):
    out = tmp_path / "out"
    train.main(train.parse_train_args(train_args(tiny_model, *tiny_data, out, "--num_train_epochs", "1")))
    card = (out / "README.md").read_text()
    results = json.loads((out / "all_results.json").read_text())
    assert "classification into 2 classes" in card and "| 1 | positive |" in card
    assert f"| accuracy | {results['eval_accuracy']:.4g} |" in card
    assert "`train.csv` (validation: `dev.csv`)" in card and f'model="{out}"' in card
    assert "base_model" not in card, "a local folder is no Hub id"
    assert f"| optimizer steps | {results['global_step']} |" in card and "| epochs | 1.0 |" in card
