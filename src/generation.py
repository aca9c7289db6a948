"""Generation for evaluate.py --predict_with_generate: an answer to every prompt, each once and in row order, on any
number of processes."""

import torch
from accelerate.logging import get_logger
from datasets import Dataset

from src.errors import UserError
from src.loaders import INDEX_COLUMN, LENGTH_COLUMN, build_eval_dataloader
from src.model import positions

logger = get_logger(__name__)


def end_tokens(generation_config) -> set[int]:
    """The model's own end tokens (`eos_token_id`: one, a list, or none), such as a chat model's end of turn."""
    eos = generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


def stop_tokens(tokenizer, generation_config) -> list[int]:
    """The tokens that end an answer: the tokenizer's EOS, which train.py appends to every answer, and the model's
    own."""
    return sorted({tokenizer.eos_token_id, *end_tokens(generation_config)} - {None})


def generate(model, prompts: list[list[int]], tokenizer, accelerator, batch_size: int, max_new_tokens: int,
             num_beams: int) -> list[str]:  # fmt: skip
    """The decoded new tokens (special tokens skipped) for each prompt, in the prompts' order: greedy, or beam search
    with `num_beams`, up to `max_new_tokens` or an end-of-sequence token.

    Each rank generates for its shard of the prompts. With more than one process every rank takes part in every
    generation step until all ranks are done (`synced_gpus`): under FSDP or ZeRO-3 each step gathers the sharded
    weights from all ranks, so a rank that stopped early would leave the others waiting forever.
    """
    model = accelerator.unwrap_model(model)
    prompts = _fit(prompts, positions(model.config), max_new_tokens)
    lengths = [len(prompt) for prompt in prompts]
    dataset = Dataset.from_dict({"input_ids": prompts, "attention_mask": [[1] * n for n in lengths],
                                 INDEX_COLUMN: list(range(len(prompts))), LENGTH_COLUMN: lengths})  # fmt: skip

    # Padded on the left, so that every prompt's last token is the batch's last column and the new tokens follow it
    # (the saved tokenizer pads on the right, as training needs, and is left as it is).
    def collate(rows):
        return tokenizer.pad(rows, padding_side="left", return_tensors="pt")

    dataloader = accelerator.prepare(build_eval_dataloader(dataset, collate, batch_size))
    stop = stop_tokens(tokenizer, model.generation_config)  # a train.py model has them in its config: others too
    training = model.training
    model.eval()
    texts, seen = {}, 0
    for batch in dataloader:
        index = batch.pop(INDEX_COLUMN)
        # Autocast here too: a LoRA model's generate() calls its base model, outside the forward that prepare() wraps.
        with torch.no_grad(), accelerator.autocast():
            output = model.generate(
                **batch, max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False, use_cache=True,
                eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
                synced_gpus=accelerator.num_processes > 1,
            )  # fmt: skip
        # The ranks' answers differ in length: padded to the longest, then each prompt once (the sampler's repeats
        # that even out the last batches are dropped).
        answers = accelerator.pad_across_processes(output[:, batch["input_ids"].shape[1] :], dim=1,
                                                   pad_index=tokenizer.pad_token_id)  # fmt: skip
        gathered = accelerator.gather_for_metrics({"index": index, "answers": answers})
        seen += len(gathered["index"])
        texts.update(zip(gathered["index"].tolist(), tokenizer.batch_decode(gathered["answers"],
                                                                            skip_special_tokens=True)))  # fmt: skip
    model.train(training)
    if seen != len(prompts) or len(texts) != len(prompts):  # indices are 0..n-1: n seen, n distinct
        raise RuntimeError("generation did not see every prompt exactly once; please report this as a bug")
    return [texts[i] for i in range(len(prompts))]


def prompt_room(positions: int | None, max_new_tokens: int) -> int | None:
    """How many tokens of a prompt the model's `positions` hold beside `max_new_tokens` (None: no limit known)."""
    if positions is not None and positions <= max_new_tokens:
        raise UserError(f"--generation_max_length {max_new_tokens} leaves no room for a prompt in the model's "
                        f"{positions} positions: lower it")  # fmt: skip
    return positions and positions - max_new_tokens


def _fit(prompts: list[list[int]], positions: int | None, max_new_tokens: int) -> list[list[int]]:
    """Prompts cut to what the model's positions hold beside the answer, keeping their ends (the question, the
    generation prompt): past its positions a model of learnt positions (GPT-2's) fails with an index error."""
    room = prompt_room(positions, max_new_tokens)
    if room is None:
        return prompts
    if cut := sum(len(prompt) > room for prompt in prompts):
        logger.warning(f"{cut} prompt(s) longer than the {room} tokens that the model's {positions} positions hold "
                       f"beside --generation_max_length {max_new_tokens} keep their last {room} tokens")  # fmt: skip
    return [prompt[-room:] for prompt in prompts]
