"""--packing: training rows packed from several examples give each example the logits it has alone, and the batch the
same loss, label tokens and gradients as the examples unpacked."""

import json

import pytest
import torch
from accelerate import PartialState
from conftest import DECODER_LAYOUTS, run_in_process, train_args
from datasets import Dataset

from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN
from src.model import load_tokenizer
from src.tasks.causal_lm import IGNORE, PROMPT_COMPLETION, CausalLM

TASK = CausalLM(PROMPT_COMPLETION, packing=True)
MAX_LENGTH = 32
# Packed and alone, an example's logits come from the same float32 operations on the same values, only summed in
# another order where the shapes differ (matmul blocking): each sum of n terms may move by ~n * 2^-24 of its size,
# ~4e-6 for the tiny models' sums of up to 64 terms and logits under 1 (measured: 1.2e-7), well under 1e-5.
# Tokens that attend to the example before them are off by 0.1 to 0.35 (measured with the KV cache on).
LOGITS_ATOL = 1e-5


def rows(count: int) -> list[dict]:
    """Prompt/completion rows of different lengths (6 to 13 tokens for the tiny Llama), no two alike."""
    return [
        {"prompt": "the plot was", "completion": " ".join([["good", "bad"][i % 2]] * (1 + i))} for i in range(count)
    ]


def model_and_features(folder, count: int = 8):
    from transformers import AutoModelForCausalLM

    PartialState(cpu=True)  # accelerate's logger, which packing logs to
    tokenizer = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(folder)
    # The saved config keeps its KV cache on: the task's step must turn it off for packed rows.
    assert model.config.use_cache
    model.train()  # the tiny decoders have no dropout
    return model, tokenizer, TASK.features(Dataset.from_list(rows(count)), tokenizer, MAX_LENGTH)


def batch_of(dataset: Dataset, tokenizer) -> dict:
    return TASK.collator(tokenizer)([row for row in dataset.remove_columns([INDEX_COLUMN, LENGTH_COLUMN])])


def segments(positions: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each packed example in a row: where its position ids restart at 0 (padding: 0s at the end)."""
    starts = [i for i, position in enumerate(positions) if position == 0] + [len(positions)]
    return list(zip(starts, starts[1:]))


@pytest.mark.parametrize("layout", DECODER_LAYOUTS)
def test_a_packed_example_has_the_logits_it_has_alone(tiny_decoders, layout):
    model, tokenizer, features = model_and_features(tiny_decoders[layout])
    packed = TASK.training_rows(features, MAX_LENGTH)
    assert len(packed) < len(features) and max(packed[LENGTH_COLUMN]) <= MAX_LENGTH
    batch = batch_of(packed, tokenizer)
    captured = []
    hook = model.register_forward_hook(lambda module, args, output: captured.append(output["logits"]))
    with torch.no_grad():
        TASK.step(model, dict(batch))  # the loop's own path to the model: what it passes, and what it leaves out
    hook.remove()
    alone = {tuple(row["input_ids"]): row for row in features}
    found, worst = 0, 0.0
    for row, (ids, positions) in enumerate(zip(batch["input_ids"].tolist(), batch["position_ids"].tolist())):
        for start, end in segments(positions):
            example = alone.get(tuple(ids[start:end]))
            if example is None:  # a padding token
                continue
            with torch.no_grad():
                reference = model(input_ids=torch.tensor([example["input_ids"]]))["logits"][0]
            worst = max(worst, (captured[0][row, start:end] - reference).abs().max().item())
            found += 1
    assert found == len(features), "every example is in the packed rows once"
    assert worst < LOGITS_ATOL, f"{layout}: packed logits differ from the example's alone by up to {worst}"


@pytest.mark.parametrize("layout", DECODER_LAYOUTS)
def test_a_packed_batch_gives_the_same_loss_label_tokens_and_gradients(tiny_decoders, layout):
    model, tokenizer, features = model_and_features(tiny_decoders[layout])
    # Half the examples learn every token, as text does: their first one too, which a packed row must not learn from
    # the example before it (an example alone never predicts its first token).
    features = features.map(lambda row, i: {"labels": row["input_ids"] if i % 2 else row["labels"]}, with_indices=True)
    seen = {}
    for name, dataset in {"unpacked": features, "packed": TASK.training_rows(features, MAX_LENGTH)}.items():
        batch = batch_of(dataset, tokenizer)
        model.zero_grad()
        units = TASK.units(batch).item()  # counted before the forward pass, as the loop does
        step = TASK.step(model, batch)
        step.loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        seen[name] = {"rows": len(batch["input_ids"]), "units": (units, step.units.item()), "loss": step.loss.item(),
                      "grads": grads}  # fmt: skip
    unpacked, packed = seen["unpacked"], seen["packed"]
    assert packed["rows"] < unpacked["rows"], "the examples are packed into fewer rows"
    # The same label tokens, whether counted before the forward pass or in it: a learnt first token would add some.
    assert packed["units"] == unpacked["units"] and len(set(packed["units"])) == 1
    # Sums of the same terms in another order: float32 rounding, measured at up to 1.5e-7 of the loss and 3e-7 of the
    # largest gradient (the summed loss's gradients are ~30).
    assert packed["loss"] == pytest.approx(unpacked["loss"], rel=1e-5)
    worst = (packed["grads"] - unpacked["grads"]).abs().max().item()
    assert worst <= 1e-5 * unpacked["grads"].abs().max().item(), f"{layout}: gradients differ by up to {worst}"


def test_best_fit_decreasing_fills_rows_and_marks_each_example():
    lengths = [3, 3, 3, 7, 7, 7]  # in this order, first fit needs 4 rows of 10; longest first, 3 full rows
    examples = [[100 * n + t for t in range(length)] for n, length in enumerate(lengths)]
    features = Dataset.from_dict({"input_ids": examples, "attention_mask": [[1] * len(ids) for ids in examples],
                                  "labels": examples, INDEX_COLUMN: list(range(len(examples))),
                                  LENGTH_COLUMN: lengths})  # fmt: skip
    PartialState(cpu=True)  # accelerate's logger, which packing logs to
    packed = TASK.training_rows(features, 10)
    assert packed[LENGTH_COLUMN] == [10, 10, 10]
    seen = []
    for row in packed:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == row[LENGTH_COLUMN]
        for start, end in segments(row["position_ids"]):
            ids, labels = row["input_ids"][start:end], row["labels"][start:end]
            assert row["position_ids"][start:end] == list(range(end - start)) and ids in examples
            # Nothing learns an example's first token from the previous example's last.
            assert labels == [IGNORE, *ids[1:]]
            seen.append(ids)
    assert sorted(seen) == sorted(examples)
    assert CausalLM(PROMPT_COMPLETION).training_rows(features, 10) is features  # without --packing


def test_a_packed_run_trains_says_how_it_packed_evaluates_every_example_and_resumes_only_packed(
    tiny_decoders, tmp_path, caplog
):
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows(16)))
    dev.write_text("".join(json.dumps(row) + "\n" for row in rows(5)))
    argv = train_args(tiny_decoders["llama"], train, dev, tmp_path / "out", "--max_length", str(MAX_LENGTH),
                      "--num_train_epochs", "1", "--per_device_train_batch_size", "2")  # fmt: skip
    with caplog.at_level("INFO"):
        results = run_in_process("train", [*argv, "--packing", "--checkpointing_steps", "2"])
    # 6 to 21 tokens each, 216 in all: 7 rows of 32 is the fewest, and 4 steps of 2 rows.
    assert "--packing: 16 training examples packed into 7 rows of up to 32 tokens" in caplog.text
    assert results["global_step"] == 4 and results["train_loss"] > 0
    assert results["eval_samples"] == 5  # evaluation is per example, unpacked
    assert json.loads((tmp_path / "out" / "args.json").read_text())["packing"] is True
    with pytest.raises(UserError, match="--packing True -> False"):  # other rows: the run would not continue exactly
        run_in_process("train", [*argv, "--resume_from_checkpoint", "latest"])
