"""accelerate_configs/fsdp.yaml (FSDP2, `fully_shard`) on 2 gloo CPU ranks, through tests/fsdp_on_cpu.py: the
shipped config as users launch it, with the FSDP state that accelerate keeps for GPUs.

The quick tests share one FSDP launch of the default MiniLM and its DDP twin (cpu.yaml); the slow ones resume a
sharded checkpoint, train LoRA and a causal LM under FSDP. fsdp.yaml loads the model on rank 0 only
(fsdp_cpu_ram_efficient_loading): the other ranks build it empty, and prepare() gives them rank 0's weights.
"""

import json
import re
import shutil

import pytest
import torch
from conftest import (
    REPO,
    WEIGHTS_ATOL,
    launch,
    launch_together,
    run_in_process,
    sentiment_files,
    tensor_names,
    train_args,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import src.model
from src.model import default_model_path, load_model

FSDP_CONFIG = REPO / "accelerate_configs" / "fsdp.yaml"
OPTIMIZER_REPORT = re.compile(r"fsdp_on_cpu rank (\d): optimizer slots (\d+), distinct (\d+), "
                              r"model's trainable held (\d+) of (\d+)")  # fmt: skip
PREPARE_REPORT = re.compile(r"fsdp_on_cpu rank (\d): parameters on meta before prepare (\d+) of (\d+), "
                            r"buffers after prepare (\w+)")  # fmt: skip


def fsdp_launch(args: list[str], **options) -> dict:
    """train.py under fsdp.yaml on 2 CPU ranks (fp32), as `launch`'s arguments."""
    return {"script": "tests/fsdp_on_cpu.py", "args": ["train.py", *args], "config": FSDP_CONFIG, **options}


def launch_fsdp(args: list[str]):
    return sharded_log(launch(**fsdp_launch(args)))


def sharded_log(result) -> str:
    """The log of a run under fsdp.yaml; fails the test unless the run ended well and was FSDP."""
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "Processes = 2 on cpu (FSDP)" in log, "the run was not sharded"
    return log


def assert_only_rank_0_read_the_model(log: str):
    """Rank 1 built its model empty (every parameter on the meta device, no checkpoint read), rank 0 wholly; after
    prepare() both hold the same buffers (RoPE's inv_freq, position ids), which accelerate does not broadcast."""
    reports = {int(rank): (int(on_meta), int(total), buffers) for rank, on_meta, total, buffers
               in PREPARE_REPORT.findall(log)}  # fmt: skip
    assert sorted(reports) == [0, 1], log[-3000:]
    (on_meta_0, total, buffers_0), (on_meta_1, _, buffers_1) = reports[0], reports[1]
    assert (on_meta_0, on_meta_1) == (0, total), f"parameters on meta before prepare, rank 0 and 1: {reports}"
    assert buffers_0 == buffers_1, f"rank 1's buffers are not rank 0's: {reports}"


def results(folder) -> dict:
    return json.loads((folder / "all_results.json").read_text())


def eval_metrics(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key.startswith("eval_")}


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


@pytest.fixture(scope="module")
def minilm_runs(tmp_path_factory):
    """The default MiniLM with its new head, 32 rows on 2 ranks of 4 rows, fp32 without clipping: under FSDP and
    under DDP. Clipping is off because FSDP computes the gradient norm over shards, in another order than DDP."""
    folder = tmp_path_factory.mktemp("fsdp-minilm")
    data = sentiment_files(folder, 32, 20)
    flags = ["--num_train_epochs", "1", "--per_device_train_batch_size", "4", "--max_grad_norm", "0"]
    fsdp, ddp = folder / "fsdp", folder / "ddp"
    sharded, ddp_run = launch_together(
        fsdp_launch(train_args(default_model_path(), *data, fsdp, *flags)),
        {"script": "train.py", "args": train_args(default_model_path(), *data, ddp, *flags)},
    )
    assert ddp_run.returncode == 0, ddp_run.stderr[-3000:]
    return {"data": data, "fsdp": fsdp, "ddp": ddp, "log": sharded_log(sharded)}


def test_fsdp_prepares_minilm_and_trains_it_to_the_weights_ddp_reaches(minilm_runs):
    """The shipped config wrapped BertEmbeddings too, and prepare crashed on MiniLM; now each BertLayer is sharded.
    With 2 ranks each gradient is the sum of 2 terms, the same in any order, so the weights are equal, not close."""
    assert "FSDP shards each BertLayer (6 layers)" in minilm_runs["log"]
    fsdp = load_file(minilm_runs["fsdp"] / "model.safetensors")
    ddp = load_file(minilm_runs["ddp"] / "model.safetensors")
    assert max_difference(fsdp, ddp) == 0.0
    assert results(minilm_runs["fsdp"])["train_loss"] == results(minilm_runs["ddp"])["train_loss"]


def test_each_rank_optimizer_holds_every_trainable_parameter_once(minilm_runs):
    """fsdp_cpu_ram_efficient_loading builds rank 1's model on the meta device, where accelerate's swap to sharded
    parameters by data pointer (all 0 there) would put one parameter in the optimizer many times, the others never."""
    reports = {int(rank): [int(n) for n in counts] for rank, *counts in OPTIMIZER_REPORT.findall(minilm_runs["log"])}
    assert sorted(reports) == [0, 1], minilm_runs["log"][-3000:]
    for rank, (slots, distinct, held, trainable) in reports.items():
        assert slots == distinct == held == trainable, f"rank {rank}: {reports[rank]}"


def test_only_rank_0_reads_the_checkpoint(minilm_runs):
    assert_only_rank_0_read_the_model(minilm_runs["log"])


def tied_llama(tiny_decoders, folder):
    """The tiny Llama with its LM head tied to its input embeddings (Llama 3.2 1B's and Qwen2.5 0.5B's layout)."""
    shutil.copytree(tiny_decoders["llama"], folder)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["minilm-new-head", "tied-llama", "qwen2-bf16-lora"])
def test_an_empty_model_is_the_loaded_model_without_its_weights(case, tiny_decoders, tmp_path, monkeypatch):
    """What a rank other than 0 builds under fsdp.yaml: the names, shapes and dtypes of rank 0's state dict (the
    checkpoint's bf16 for a frozen LoRA base under mixed precision), its tied weights, and its buffers, which prepare()
    keeps as they are."""
    if case == "minilm-new-head":
        auto_class, path, options = AutoModelForSequenceClassification, default_model_path(), {}
    elif case == "tied-llama":
        auto_class, path, options = AutoModelForCausalLM, tied_llama(tiny_decoders, tmp_path / "llama"), {}
    else:
        auto_class, path = AutoModelForSequenceClassification, tmp_path / "qwen2"
        AutoModelForCausalLM.from_pretrained(tiny_decoders["qwen2"], dtype=torch.bfloat16).save_pretrained(path)
        options = {"lora": True, "mixed_precision": "bf16"}

    def load():
        return load_model(auto_class, str(path), AutoConfig.from_pretrained(path, num_labels=2), **options)

    loaded = load()
    monkeypatch.setattr(src.model, "weights_come_from_rank_0", lambda: True)
    empty = load()
    assert all(parameter.device.type == "meta" for parameter in empty.parameters())
    layout = {name: (tensor.shape, tensor.dtype) for name, tensor in loaded.state_dict().items()}
    assert {name: (tensor.shape, tensor.dtype) for name, tensor in empty.state_dict().items()} == layout
    loaded_buffers, empty_buffers = dict(loaded.named_buffers()), dict(empty.named_buffers())
    assert loaded_buffers.keys() == empty_buffers.keys()
    assert all(buffer.device.type == "cpu" for buffer in empty_buffers.values())
    assert all(torch.equal(loaded_buffers[name], empty_buffers[name]) for name in loaded_buffers)
    tied = [model.get_output_embeddings() is not None
            and model.get_output_embeddings().weight is model.get_input_embeddings().weight
            for model in (loaded, empty)]  # fmt: skip
    assert tied == [case == "tied-llama"] * 2


def test_the_fsdp_save_is_a_whole_model_that_from_pretrained_loads(minilm_runs):
    folder = minilm_runs["fsdp"]
    assert tensor_names(folder / "model.safetensors") == tensor_names(minilm_runs["ddp"] / "model.safetensors")
    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu" and tensor.count_nonzero() > 0, f"{name} was not gathered"


def test_evaluation_under_fsdp_equals_one_rank_evaluation(minilm_runs, tmp_path):
    """train.py's last evaluation, sharded on 2 ranks, against evaluate.py on 1 rank on the saved model. The loss
    may differ in the last bits: the batches, and so the padding around each text, are not the same."""
    under_fsdp = eval_metrics(results(minilm_runs["fsdp"]))
    argv = ["--model_name_or_path", str(minilm_runs["fsdp"]), "--validation_file", str(minilm_runs["data"][1]),
            "--output_dir", str(tmp_path), "--mixed_precision", "no"]  # fmt: skip
    one_rank = eval_metrics(run_in_process("evaluate", argv))
    assert one_rank.keys() == under_fsdp.keys()
    assert one_rank.pop("eval_loss") == pytest.approx(under_fsdp.pop("eval_loss"), rel=1e-6)
    assert one_rank == under_fsdp
    assert eval_metrics(results(minilm_runs["ddp"])) == eval_metrics(results(minilm_runs["fsdp"]))


@pytest.mark.slow
def test_evaluate_py_under_fsdp_writes_what_one_rank_writes(minilm_runs, tmp_path):
    """evaluate.py with the shipped config: the model read on rank 0 only and sharded as in training (accelerate 1.15
    refuses FSDP2 through prepare_model), every example counted once."""
    argv = ["evaluate.py", "--model_name_or_path", str(minilm_runs["fsdp"]), "--validation_file",
            str(minilm_runs["data"][1]), "--mixed_precision", "no", "--per_device_eval_batch_size", "8"]  # fmt: skip
    run_in_process("evaluate", [*argv[1:], "--output_dir", str(tmp_path / "one")])
    result = launch("tests/fsdp_on_cpu.py", [*argv, "--output_dir", str(tmp_path / "fsdp")], config=FSDP_CONFIG)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert_only_rank_0_read_the_model(result.stdout + result.stderr)
    assert (tmp_path / "fsdp" / "predictions.csv").read_text() == (tmp_path / "one" / "predictions.csv").read_text()
    sharded, one_rank = (json.loads((tmp_path / n / "eval_results.json").read_text()) for n in ("fsdp", "one"))
    assert sharded.pop("eval_loss") == pytest.approx(one_rank.pop("eval_loss"), rel=1e-6)  # other batches' padding
    assert sharded == one_rank


def test_fsdp_shards_the_largest_layer_list_unless_the_config_names_layers(tiny_decoders):
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from src.model import choose_fsdp_layers

    PartialState(cpu=True)  # accelerate's logger, which says what was chosen

    def chosen(model, **config):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **config)
        choose_fsdp_layers(model, plugin)
        return plugin.transformer_cls_names_to_wrap

    minilm = AutoModelForSequenceClassification.from_pretrained(default_model_path())
    assert chosen(minilm) == ["BertLayer"]  # not BertEmbeddings, which BERT's _no_split_modules names too
    assert chosen(AutoModelForCausalLM.from_pretrained(tiny_decoders["llama"])) == ["LlamaDecoderLayer"]
    assert chosen(minilm, transformer_cls_names_to_wrap="BertEmbeddings") == ["BertEmbeddings"]  # the user's choice


@pytest.mark.slow
def test_a_sharded_checkpoint_mid_epoch_resumes_to_the_uninterrupted_weights(tiny_model, tmp_path):
    """2 epochs of 4 steps, with dropout (whose random state the checkpoint carries); checkpoint-5 is one step into
    the second epoch. Every rank is killed (SIGKILL) as soon as it is complete; the resumed run ends bit for bit
    where the uninterrupted one does."""
    data = sentiment_files(tmp_path, 32, 20)
    flags = ["--per_device_train_batch_size", "4", "--checkpointing_steps", "5"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    finished, killed = launch_together(
        fsdp_launch(train_args(tiny_model, *data, uninterrupted, *flags)),
        fsdp_launch(train_args(tiny_model, *data, resumed, *flags), env={"FSDP_ON_CPU_KILL_AFTER_CHECKPOINT": "5"}),
    )
    sharded_log(finished)
    assert killed.returncode != 0 and not (resumed / "model.safetensors").exists()
    checkpoint = resumed / "checkpoint-5"
    assert sorted(path.name for path in resumed.glob("checkpoint-*")) == [checkpoint.name]
    assert list(checkpoint.glob("pytorch_model_fsdp_0/*.distcp")) and list(checkpoint.glob("optimizer_0/*.distcp"))
    log = launch_fsdp(train_args(tiny_model, *data, resumed, *flags, "--resume_from_checkpoint", "latest"))
    assert f"resuming from {checkpoint} at step 5" in log
    first, second = load_file(uninterrupted / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_lora_under_fsdp_saves_the_adapter_only_and_evaluate_py_reproduces_it(tiny_model, tmp_path):
    data = sentiment_files(tmp_path, 32, 20)
    out = tmp_path / "out"
    launch_fsdp(train_args(tiny_model, *data, out, "--use_peft", "--lora_r", "4", "--lora_dropout", "0"))
    assert not (out / "model.safetensors").exists()
    adapter = tensor_names(out / "adapter_model.safetensors")
    assert adapter and all(".lora_" in name or ".classifier." in name for name in adapter), sorted(adapter)

    def evaluate_args(output_dir):
        return ["--model_name_or_path", str(out), "--validation_file", str(data[1]), "--output_dir", str(output_dir),
                "--mixed_precision", "no"]  # fmt: skip

    again = eval_metrics(run_in_process("evaluate", evaluate_args(tmp_path / "eval")))
    trained = eval_metrics(results(out))
    assert again.pop("eval_loss") == pytest.approx(trained.pop("eval_loss"), rel=1e-6)  # other batches' padding
    assert again == trained
    # evaluate.py under FSDP: rank 1 builds the base model empty (an 8B base would be read by every rank) and gets
    # rank 0's weights, adapter included, in prepare.
    result = launch("tests/fsdp_on_cpu.py", ["evaluate.py", *evaluate_args(tmp_path / "sharded")], config=FSDP_CONFIG)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert_only_rank_0_read_the_model(log)
    assert "copying from a non-meta parameter" not in log, "a warning for each adapter weight rank 1 does not read"
    sharded = json.loads((tmp_path / "sharded" / "eval_results.json").read_text())
    one_rank = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert sharded.pop("eval_loss") == pytest.approx(one_rank.pop("eval_loss"), rel=1e-6)
    assert sharded == one_rank


@pytest.mark.slow
def test_a_causal_lm_under_fsdp_trains_like_one_rank_of_the_whole_batch(tiny_decoders, tmp_path):
    """2 ranks x 4 rows against 1 rank x 8 rows: the same updates, summed in another order (WEIGHTS_ATOL: conftest).
    Completions of 1 to 19 words give the ranks different numbers of tokens, which each step's loss must count on
    both ranks together. The Llama ties its LM head to its embeddings and has RoPE buffers, which rank 1, building
    its model empty, must end with as rank 0 has them."""
    rows = [{"prompt": "the plot was", "completion": " ".join(["good"] * (1 + 7 * i % 19))} for i in range(32)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = tied_llama(tiny_decoders, tmp_path / "llama")
    log = launch_fsdp(train_args(model, data, data, tmp_path / "fsdp", "--per_device_train_batch_size", "4"))
    assert "FSDP shards each LlamaDecoderLayer (2 layers)" in log
    assert_only_rank_0_read_the_model(log)
    run_in_process("train", train_args(model, data, data, tmp_path / "one", "--per_device_train_batch_size", "8"))
    worst = max_difference(load_file(tmp_path / "fsdp" / "model.safetensors"),
                           load_file(tmp_path / "one" / "model.safetensors"))  # fmt: skip
    print(f"a causal LM under FSDP (2 x 4) and on 1 rank (1 x 8): weights differ by up to {worst:.1e}")
    assert worst < WEIGHTS_ATOL, f"weights differ by up to {worst}"


@pytest.mark.slow
def test_a_llama_layout_classifier_under_fsdp_trains_to_the_weights_ddp_reaches(tiny_decoders, tmp_path):
    """A decoder classifier: a new score head (empty on rank 1 until prepare), pooled at each text's last token.
    2 ranks add the same two gradients under FSDP as under DDP, so the weights are equal, not close."""
    data = sentiment_files(tmp_path, 32, 16)
    flags = ["--num_train_epochs", "1", "--per_device_train_batch_size", "4", "--max_grad_norm", "0"]
    model = tiny_decoders["llama"]
    sharded, ddp = launch_together(
        fsdp_launch(train_args(model, *data, tmp_path / "fsdp", *flags)),
        {"script": "train.py", "args": train_args(model, *data, tmp_path / "ddp", *flags)},
    )
    assert_only_rank_0_read_the_model(sharded_log(sharded))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    weights = [load_file(tmp_path / name / "model.safetensors") for name in ("fsdp", "ddp")]
    assert "score.weight" in weights[0] and max_difference(*weights) == 0.0


def test_a_mistake_only_rank_0_can_see_in_the_weights_stops_every_rank_with_its_message(tiny_model, tmp_path):
    """Under fsdp.yaml rank 0 alone reads the checkpoint: a head for 3 labels, refused for 2-label data by
    --no-ignore_mismatched_sizes, is found there only, and rank 1 (which built its model empty) must stop with the
    same one-line error instead of waiting for rank 0 in the next collective."""
    three = tmp_path / "three-labels"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3, ignore_mismatched_sizes=True)
    model.save_pretrained(three)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, three / name)
    data = sentiment_files(tmp_path, 16, 8)
    args = train_args(three, *data, tmp_path / "out", "--no-ignore_mismatched_sizes")
    result = launch(**fsdp_launch(args, timeout=120))
    assert result.returncode != 0
    # Both ranks print at once into the launcher's one stream, where their lines may interleave.
    assert "[rank 0] error:" in result.stderr and "[rank 1] error:" in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("has a classification head for another number of labels") == 2


def test_a_rank_that_gets_rank_0s_weights_builds_them_empty_in_the_dtype_rank_0_reads(tiny_decoders, monkeypatch):
    """dtype "auto" (a frozen LoRA base under mixed precision) is the config's; a config that names none leaves the
    dtype to the weights, which only reading them tells: then this rank reads them too (None)."""
    config = AutoConfig.from_pretrained(tiny_decoders["llama"])
    monkeypatch.setattr(src.model, "weights_come_from_rank_0", lambda: True)
    config.dtype = torch.bfloat16
    empty = src.model.empty_on_this_rank(AutoModelForCausalLM, config, "auto", False)
    assert {(p.device.type, p.dtype) for p in empty.parameters()} == {("meta", torch.bfloat16)}
    assert src.model.empty_on_this_rank(AutoModelForCausalLM, config, torch.float32, False).dtype == torch.float32
    config.dtype = None
    assert src.model.empty_on_this_rank(AutoModelForCausalLM, config, "auto", False) is None
    monkeypatch.setattr(src.model, "weights_come_from_rank_0", lambda: False)
    assert src.model.empty_on_this_rank(AutoModelForCausalLM, config, torch.float32, False) is None


def test_a_checkpoint_whose_config_ties_a_head_its_weights_keep_apart_is_refused_under_fsdp(
    tiny_decoders, tmp_path, monkeypatch
):
    """transformers keeps such a head apart on rank 0, which reads the weights; FSDP's prepare() ties it again on every
    rank, and rank 0's broadcast would write the head and the embeddings into one tensor, one over the other."""
    import src.errors

    folder = tmp_path / "untied"
    shutil.copytree(tiny_decoders["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    assert not config["tie_word_embeddings"], "the tiny Llama stores a head of its own"
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    config = AutoConfig.from_pretrained(folder)
    assert load_model(AutoModelForCausalLM, str(folder), config).lm_head is not None  # without FSDP: as transformers
    for name, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(src.errors.UserError, match='ties lm_head.weight to the .*"tie_word_embeddings": false'):
        load_model(AutoModelForCausalLM, str(folder), config)
