"""LoRA (peft): adapters on the frozen backbone, the head trained in full; checkpoints of the trainable weights only;
a LoRA output folder loaded back on the base model it names."""

import warnings
from pathlib import Path

from accelerate.utils import DistributedType
from peft import LoraConfig, PeftConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_model as load_safetensors
from torch.nn import Linear
from transformers import AutoConfig
from transformers.pytorch_utils import Conv1D
from transformers.utils import CONFIG_NAME

from src.errors import UserError
from src.model import check_tied_as_configured, empty_on_this_rank

ADAPTER_CONFIG = "adapter_config.json"  # peft's file: the folder holds a LoRA adapter and head, not a whole model
CHECKPOINT_WEIGHTS = "model.safetensors"  # what accelerate's save_state calls the model's weights
# peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`: a FutureWarning for peft, not for users.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def is_adapter_folder(name_or_path) -> bool:
    return (Path(name_or_path) / ADAPTER_CONFIG).is_file()


def head_modules(model) -> list[str]:
    """The classification head: the modules outside the backbone that have weights (`score` on decoders,
    `classifier` on BERT, `pre_classifier` and `classifier` on DistilBERT, `classification_head` on BART...)."""
    return [
        name
        for name, module in model.named_children()
        if module is not model.base_model and next(module.parameters(), None) is not None
    ]


def add_lora(model, args, accelerator, task_type: str, new_head: bool) -> PeftModel:
    """LoRA adapters on the backbone; a new head (`new_head`: nothing to adapt) is trained in full and saved with
    them, where a pretrained one (a causal LM's) is adapted through the backbone. `task_type`: peft's (SEQ_CLS, ...).

    With 'all-linear' peft targets every linear layer except those it is told to train in full, i.e. the head.
    Adapters and head are kept in fp32 (peft upcasts adapters on a bf16/fp16 base; the head is cast here).
    """
    head = head_modules(model) if new_head else []
    targets = args.lora_target_modules  # peft's 'all-linear', or the comma-separated module names
    targets = targets if targets == "all-linear" else [name.strip() for name in targets.split(",") if name.strip()]
    for name in head:
        getattr(model, name).float()
    config = LoraConfig(
        task_type=TaskType(task_type),
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        modules_to_save=head,
        fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()),  # GPT-2's transposed linears
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as err:
        reason = " ".join(str(err).split()).split(". ")[0][:200]  # peft's first sentence
        output = model.get_output_embeddings()  # a causal LM's lm_head: all-linear leaves it out too
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(
            module, (Linear, Conv1D)) and module is not output and name.split(".")[0] not in head})  # fmt: skip
        raise UserError(
            f"--lora_target_modules {args.lora_target_modules}: {reason}; name linear layers of the backbone (this "
            f"model's: {', '.join(linear)}) or use all-linear"
        ) from err
    if accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        checkpoint_trainable_weights_only(accelerator)
    return model


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


def load_adapter_folder(auto_class, folder, dtype, pad_token_id=None, trust_remote_code=False, new_head=True):
    """A train.py LoRA output: the base model it names, with the folder's config (labels, pad token; else the
    base's), adapter and head."""
    try:
        adapter = PeftConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:  # ValueError: a damaged file's JSON error
        raise UserError(f"{Path(folder) / ADAPTER_CONFIG} cannot be read ({' '.join(str(err).split())[:200]})") from err
    if new_head and not adapter.modules_to_save:
        raise UserError(f"{folder} holds a LoRA adapter without a trained head: evaluate a train.py output")
    fields = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    try:
        # Without a config of its own (a causal LM's adapter: see save_model), the base model's.
        has_config = Path(folder, CONFIG_NAME).is_file()
        config = AutoConfig.from_pretrained(
            folder if has_config else adapter.base_model_name_or_path, trust_remote_code=trust_remote_code, **fields
        )
        # Under FSDP with fsdp_cpu_ram_efficient_loading, ranks other than 0 build the base empty: prepare() gives
        # them rank 0's weights, adapter included.
        base = empty_on_this_rank(auto_class, config, dtype, trust_remote_code)
        empty = base is not None
        if not empty:
            base = auto_class.from_pretrained(
                adapter.base_model_name_or_path,
                config=config,
                dtype=dtype,
                # The base's own head may have another number of labels; the folder's trained head replaces it.
                ignore_mismatched_sizes=True,
                trust_remote_code=trust_remote_code,
            )
            check_tied_as_configured(base, adapter.base_model_name_or_path)
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(
            f"{folder} is a LoRA adapter on {adapter.base_model_name_or_path}, which cannot be loaded "
            f"({' '.join(str(err).split())[:300]}); the base model must be where training found it, or set "
            f"base_model_name_or_path in {Path(folder) / ADAPTER_CONFIG} to where it is now"
        ) from err
    for name in head_modules(base) if new_head else []:  # as in training: the saved fp32 head stays exact
        getattr(base, name).float()
    with warnings.catch_warnings():
        if empty:  # peft puts the adapter on the meta device too, where torch warns of each weight it cannot copy
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter", category=UserWarning)
        return PeftModel.from_pretrained(base, folder)
