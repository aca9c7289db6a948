"""Flags, YAML config files and their validation."""

import importlib.util
import json

import pytest
from conftest import REPO

from src.args import build_train_parser, parse_args, parse_train_args, validate_train_args
from src.reporting import tracker_project


def parse(*argv):
    parser = build_train_parser()
    return validate_train_args(parser, parse_args(parser, list(argv)))


def error_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "usage:" not in message, "one line, no usage block"
    return message


def test_defaults_are_sensible():
    args = parse("--train_file", "train.csv")
    assert (args.num_train_epochs, args.per_device_train_batch_size, args.learning_rate) == (3, 32, None)  # the task's
    assert args.eval_steps is None  # at the end of each epoch
    demo = parse()  # the built-in demo is learnt within one epoch; evaluations along the way show the curve
    assert (demo.num_train_epochs, demo.eval_steps) == (1, 10)
    assert parse("--num_train_epochs", "2", "--eval_steps", "5").num_train_epochs == 2
    assert parse("--num_train_epochs", "3.0").num_train_epochs == 3  # Trainer's and TRL's float spelling
    assert args.max_length is None  # 128, or less for a model with fewer positions
    assert args.report_to == "tensorboard" and args.group_by_length


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size: must be a positive integer"),
        (["--per_device_eval_batch_size", "-4"], "--per_device_eval_batch_size"),
        (["--learning_rate", "0"], "--learning_rate: must be a positive number"),
        (["--learning_rate", "nan"], "--learning_rate"),
        (["--max_train_steps", "0"], "--max_train_steps"),
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
        (["--warmup_ratio", "1.5"], "--warmup_ratio: must be in [0, 1)"),
        (["--weight_decay", "-1"], "--weight_decay"),
        (["--num_train_epochs", "two"], "--num_train_epochs: must be a whole number, got 'two'"),
        (
            ["--num_train_epochs", "0.5"],
            "must be a positive whole number, got 0.5 (part of an epoch: --max_train_steps",
        ),
        (["--num_train_epochs", "0"], "--num_train_epochs: must be a positive whole number, got 0"),
        (["--cpu_threads", "all"], "--cpu_threads: must be a whole number, got 'all'"),
        (["--learning_rate", "fast"], "--learning_rate: must be a number, got 'fast'"),
        (
            ["--checkpointing_steps", "often"],
            "--checkpointing_steps: must be a positive number of steps or 'epoch'",
        ),
        (["--lr_scheduler_type", "exotic"], "--lr_scheduler_type: invalid choice"),
        (["--mixed_precision", "fp8x"], "--mixed_precision"),
        (["--validation_split_percentage", "100"], "--validation_split_percentage must be between 1 and 99"),
        (["--dataset_name", "glue", "--train_file", "a.csv"], "either --dataset_name or --train_file"),
        (["--validation_file", "dev.csv"], "--validation_file goes with --train_file"),
        (["--dataset_name", "imdb", "--validation_file", "dev.csv"], "--dataset_name's validation split is its own"),
        (["--dataset_config_name", "mrpc"], "--dataset_config_name needs --dataset_name"),
        (["--resume_from_checkpoint", "latest", "--overwrite_output_dir"], "choose one"),
        (["--text_column", "a", "--text_pair_column", "a"], "--text_pair_column must differ"),
        (["--tokenizer_name", "outputs/run/"], "--output_dir outputs/run is --tokenizer_name's folder: the run would"),
        (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        (
            ["--lerning_rate", "1"],
            "unrecognized arguments: --lerning_rate 1; did you mean --lerning_rate -> --learning",
        ),
        (["--task_name", "ner"], "run_ner's --task_name pos or ner picks the tag column: --label_column pos_tags"),
        (["--ddp_timeout", "0"], "--ddp_timeout: must be between 1 and 2592000 seconds"),
        (["--ddp_timeout", "30m"], "--ddp_timeout: must be a whole number, got '30m'"),
        (
            ["--data_preparation_timeout", "99999999999"],
            "--data_preparation_timeout: must be between 1 and 2592000 seconds (30 days)",
        ),
        (["--seed", "-1"], "--seed: must be between 0 and 4294967295"),
        (["--seed", "4294967296"], "--seed: must be between 0 and 4294967295"),
        (["--use_peft", "maybe"], "--use_peft/--no-use_peft: must be true or false, got 'maybe'"),
        (["--no-use_peft", "true"], "--no-use_peft takes no value"),
        (["--save_steps", "500"], "did you mean --save_steps -> --checkpointing_steps N?"),
        (["--max_new_tokens", "9"], "unrecognized arguments: --max_new_tokens 9 (see --help)"),  # evaluate.py's
        (["--torch_compile"], "--torch_compile -> accelerate launch --dynamo_backend inductor train.py"),
        (
            ["--eval_strategy", "steps", "--bf16"],
            "--eval_strategy -> --eval_steps N (default: at each epoch's end; always on), --bf16 -> --mixed_precision "
            "bf16?",
        ),
        # Not our --gradient_accumulation_steps, which a spelling match would suggest.
        (["--eval_accumulation_steps", "4"], "--eval_accumulation_steps -> nothing (evaluation gathers each batch"),
        (["--dataset_text_field=text"], "--dataset_text_field -> --text_column"),
        (["--padding_free"], "--padding_free -> --packing"),
        (["--bf16", "False"], "did you mean --bf16 -> --mixed_precision no?"),  # Trainer's spelling of no bf16
        (["--fp16=false"], "did you mean --fp16 -> --mixed_precision no?"),
        (["--packing_strategy", "bfd"], "--packing_strategy -> --packing (best-fit decreasing, TRL's bfd"),
        (["--logging_strategy", "steps"], "--logging_strategy -> --logging_steps N"),
        (["--cache_dir", "c"], "--cache_dir -> HF_HOME=DIR in the environment"),
        (["--debug"], "--debug -> --max_train_samples N --max_eval_samples N"),  # run_ner_no_trainer.py's
        (["--lora_task_type", "CAUSAL_LM"], "--lora_task_type -> nothing (the task gives LoRA its type"),  # TRL's
        # A launcher's flags after the script, and torch.distributed.launch's.
        (
            ["--num_processes", "2", "--local-rank=0"],
            "--num_processes -> accelerate launch --num_processes N train.py "
            "(the launcher's flags go before the script), --local-rank -> torchrun train.py",
        ),  # fmt: skip
        (["--eos_token", "</s>"], "did you mean --eos_token -> --tokenizer_name DIR (a tokenizer"),  # not --hub_token
    ],
)
def test_bad_values_get_one_line_naming_the_flag(capsys, argv, culprit):
    assert culprit in error_of(capsys, *argv)


def test_the_spelling_of_run_glue_and_trl_for_max_length_is_accepted_and_trainers_others_get_a_hint(capsys):
    """Trainer's --warmup_steps and --save_steps take fractions of the run as well (0.1): not the same flags as ours."""
    assert parse("--max_seq_length", "64").max_length == 64
    assert "--warmup_steps -> --num_warmup_steps" in error_of(capsys, "--warmup_steps", "3")


def test_yaml_config_is_read_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-4\nnum_train_epochs: 5\ngroup_by_length: false\nreport_to: none\n")
    args = parse("--config", str(config), "--num_train_epochs", "2")
    assert (args.learning_rate, args.num_train_epochs, args.group_by_length, args.report_to) == (1e-4, 2, False, "none")
    # The transformers examples' spellings are keys too, as they are flags.
    config.write_text("text_column_name: review\nlabel_column_name: stars\nblock_size: 64\nkeep_linebreaks: false\n")
    args = parse("--config", str(config))
    assert (args.text_column, args.label_column, args.max_length, args.keep_linebreaks) == (
        "review",
        "stars",
        64,
        False,
    )


@pytest.mark.parametrize(
    "text,culprit",
    [
        ("learning_rat: 0.1\n", "unknown key(s) 'learning_rat' (did you mean learning_rate?)"),
        # Every unknown key at once, with what to write in the file (Trainer's, a launcher's, an upper-case typo).
        (
            "bf16: true\nsave_steps: 500\nLEARNING_RATE: 1e-4\ndistributed_type: MULTI_CPU\n",
            "unknown key(s) 'bf16' (did you mean mixed_precision: bf16?); 'save_steps' (did you mean "
            "checkpointing_steps: N?); 'LEARNING_RATE' (did you mean learning_rate?); 'distributed_type' (did you mean "
            "accelerate launch --config_file FILE train.py (an accelerate config, not train.py's)?)",
        ),
        (
            "seed: 1\nlearning_rate: 1e-4\nlearning_rate: 3e-5\n",
            'learning_rate given twice in "<unicode string>", line 3',
        ),
        # Trainer's flags whose hint is a flag with a note, and a --no- form of a flag that is not on/off.
        ("warmup_steps: 3\n", "'warmup_steps' (did you mean num_warmup_steps (steps) or warmup_ratio?)"),
        (
            "bf16: false\nfp16: False\n",
            "'bf16' (did you mean mixed_precision: no?); 'fp16' (did you mean mixed_precisi",
        ),
        ("no-seed: 1\n", "unknown key(s) 'no-seed' (see --help)"),
        ("lora_target_modules: {q_proj: 1}\n", "lora_target_modules must be a single value"),
        ("lr_scheduler_kwargs: {power: 2}\n", "write lr_scheduler_kwargs as JSON in quotes, as on the command line"),
        ("max_time: 1:30\n", "--max_time: must be a number, got '1:30'"),  # YAML 1.1's 90 (minutes and seconds)
        ("max_length: 64\nblock_size: 256\n", "max_length and block_size are the same flag: keep one"),
        ("no-group_by_length: true\n", "unknown key(s) 'no-group_by_length' (did you mean group_by_length: false?)"),
        ("learning_rate: [1, 2]\n", "learning_rate must be a single value"),
        ("per_device_train_batch_size: 0\n", "--per_device_train_batch_size: must be a positive integer"),
        ("group_by_length: maybe\n", "group_by_length must be true or false"),
        ("- a\n- b\n", "must hold 'flag: value' pairs"),
        ("learning_rate: [\n", "is not valid YAML"),
        ("report_to: off\n", "argument --report_to: invalid choice: 'off'"),  # the word written, not YAML 1.1's false
        ("resume_from_checkpoint: true\n", "resume_from_checkpoint takes a value, not true (it is not an on/off flag)"),
        ("config: other.yaml\n", "a config file cannot name another (config: other.yaml)"),
    ],
)
def test_bad_config_files_are_named(tmp_path, capsys, text, culprit):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    message = error_of(capsys, "--config", str(config))
    assert culprit in message


def test_config_values_are_read_as_written_on_the_command_line(tmp_path, capsys, monkeypatch):
    """YAML 1.1 reads 0123 as 83 and `on` as true; here a value means what the same word means as a flag."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text("seed: 0123\ntext_column: on\ngroup_by_length: off\noutput_dir: ~/runs/a\n"
                      "resume_from_checkpoint: ~/runs/a/checkpoint-2\n")  # fmt: skip
    args = parse("--config", str(config))
    assert (args.seed, args.text_column, args.group_by_length) == (123, "on", False)
    assert args.resume_from_checkpoint == str(tmp_path / "runs" / "a" / "checkpoint-2")
    # `~` is the home folder also where no shell expands it.
    assert args.output_dir == tmp_path / "runs" / "a" == parse("--output_dir=~/runs/a").output_dir
    message = error_of(capsys, "--config", str(config), "--config", str(config))
    assert "--config given more than once: merge the files into one" in message


def test_missing_config_file(tmp_path, capsys):
    assert "cannot read --config" in error_of(capsys, "--config", str(tmp_path / "nope.yaml"))


def test_help_groups_flags_and_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        build_train_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for group in ("model:", "data (", "training:", "evaluation:", "checkpoints:", "logging:"):
        assert group in text
    assert "(default: 0.01)" in text  # --weight_decay: defaults are shown
    assert "  --use_peft [true|false], --no-use_peft\n" in text  # an on/off flag's --no- form takes no value


def test_report_to_takes_trainers_list_of_trackers(tmp_path, capsys, monkeypatch):
    """`--report_to tensorboard wandb` as Trainer takes it, kept as one text in args.json ("tensorboard,wandb")."""
    assert parse("--report_to", "all").report_to == "all"
    assert parse("--report_to", "tensorboard", "tensorboard").report_to == "tensorboard"
    config = tmp_path / "run.yaml"
    config.write_text("report_to: [tensorboard]\n")
    assert parse("--config", str(config)).report_to == "tensorboard"
    assert "--report_to none tensorboard: all and none stand alone" in error_of(capsys, "--report_to", "none",
                                                                                "tensorboard")  # fmt: skip
    if importlib.util.find_spec("wandb") is None:  # every tracker named is checked, not the first only
        assert "--report_to wandb: the package is not installed" in error_of(capsys, "--report_to", "tensorboard",
                                                                              "wandb")  # fmt: skip
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: name in ("wandb", "mlflow") or installed(name))
    several = parse("--report_to", "tensorboard", "wandb", "--with_tracking").report_to
    assert several == parse("--report_to", "tensorboard,wandb").report_to == "tensorboard,wandb"  # args.json's, too
    assert parse("--report_to", "tensorboard,", "wandb").report_to == several  # the shell's split of `a, b`
    assert "--report_to: must name a tracker" in error_of(capsys, "--report_to", ",")
    config.write_text("report_to: [wandb, mlflow]\n")
    assert parse("--config", str(config)).report_to == "wandb,mlflow"
    # TensorBoard beside another tracker writes into the folder named as the others' project: the output folder's.
    assert (
        tracker_project(several, tmp_path / "run") == "run"
        and tracker_project("tensorboard", tmp_path) == "tensorboard"
    )


def test_evaluate_needs_a_model_from_the_command_line_or_its_config(tmp_path, capsys):
    from conftest import load_script

    parse_eval_args = load_script("evaluate").parse_eval_args
    with pytest.raises(SystemExit):
        parse_eval_args(["--validation_file", "dev.csv"])
    assert "--model_name_or_path is required" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"validation_file": "data/dev.jsonl"}))  # a run's record
    with pytest.raises(SystemExit):
        parse_eval_args(["--model_name_or_path", str(run)])
    assert "--dataset_name (the model was evaluated in training on --validation_file data/dev.jsonl)" in (
        capsys.readouterr().err
    )
    (run / "args.json").write_text(json.dumps({"train_file": "all.csv", "validation_split_percentage": 10}))
    with pytest.raises(SystemExit):
        parse_eval_args(["--model_name_or_path", str(run)])
    assert "evaluated in training on 10% of --train_file all.csv, held out at random" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # ignored without it
        parse_eval_args(["--model_name_or_path", str(run), "--validation_file", "d.csv", "--generation_num_beams", "2"])
    assert "--generation_num_beams shape(s) the answers of --predict_with_generate: add it, or drop it" in (
        capsys.readouterr().err
    )
    config = tmp_path / "eval.yaml"
    config.write_text(f"model_name_or_path: {tmp_path}\nvalidation_file: dev.csv\n")
    args = parse_eval_args(["--config", str(config)])
    # No --output_dir: the results go to the model folder (evaluate.py's main() decides where, from this).
    assert args.model_name_or_path == str(tmp_path) and args.output_dir is None
    config.write_text("train_file: train.csv\nlearning_rate: 1e-4\n")  # the training run's file, all keys named at once
    with pytest.raises(SystemExit):
        parse_eval_args(["--config", str(config)])
    message = capsys.readouterr().err
    assert "unknown key(s) 'train_file'; 'learning_rate'; evaluate.py reads the training run's settings" in message
    config.write_text("validation_fil: dev.csv\n")  # a typo of its own key: no word of train.py's
    with pytest.raises(SystemExit):
        parse_eval_args(["--config", str(config)])
    message = capsys.readouterr().err
    assert "'validation_fil' (did you mean validation_file?)" in message and "args.json" not in message


ON_OFF = ["--use_peft", "--load_best_model_at_end", "--overwrite_output_dir", "--gradient_checkpointing",
          "--trust_remote_code", "--packing", "--assistant_only_loss", "--return_entity_level_metrics"]  # fmt: skip


@pytest.mark.parametrize("flag", ON_OFF)
def test_on_off_flags_take_trainers_true_and_false(flag):
    """Trainer and TRL write `--gradient_checkpointing True`; transformers' examples' type=bool read 'False' as true."""
    task = {"--packing": "causal-lm", "--assistant_only_loss": "causal-lm"}.get(flag, "auto")
    dest = flag[2:]
    assert getattr(parse_train_args(["--task", task, flag]), dest) is True
    for word, value in (("True", True), ("true", True), ("1", True), ("False", False), ("no", False)):
        assert getattr(parse_train_args(["--task", task, flag, word]), dest) is value, word
    assert getattr(parse_train_args(["--task", task, f"--no-{dest}"]), dest) is False


def test_on_off_flags_can_be_turned_off_from_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("load_best_model_at_end: true\n")
    assert not parse("--config", str(config), "--no-load_best_model_at_end").load_best_model_at_end


def test_the_example_config_file_is_valid():
    args = parse("--config", "examples/run.yaml")
    assert args.dataset_name == "nyu-mll/glue" and args.load_best_model_at_end


def test_the_example_run_files_hold_only_train_py_flags():
    for config in sorted((REPO / "examples").glob("*.yaml")):
        args = parse_train_args(["--config", str(config)])
        assert args.output_dir is not None, config


def test_lora_target_modules_take_trls_spaces_and_our_commas():
    """One spelling in args.json, which a resume compares: the shell's split of `q_proj, v_proj` too."""
    for argv in (["q_proj", "v_proj"], ["q_proj,v_proj"], ["q_proj,", "v_proj"], ["q_proj, v_proj"]):
        assert parse_train_args(["--use_peft", "--lora_target_modules", *argv]).lora_target_modules == "q_proj,v_proj"


def test_yaml_takes_trls_lists_of_modules_and_quoted_true_and_false(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text('use_peft: "true"\nlora_target_modules: [q_proj, v_proj]\ngroup_by_length: "False"\n')
    args = parse_train_args(["--config", str(config)])
    assert (args.use_peft, args.lora_target_modules, args.group_by_length) == (True, "q_proj,v_proj", False)
    config.write_text("use_peft: yes\nlora_target_modules: q_proj v_proj\n")  # as --help writes them
    assert parse_train_args(["--config", str(config)]).lora_target_modules == "q_proj,v_proj"
    config.write_text("<<: {seed: 3, use_peft: true, lora_r: 8}\nlora_r: 4\n")  # a YAML merge key, overridden
    assert (parse_train_args(["--config", str(config)]).seed, parse_train_args(["--config", str(config)]).lora_r) == (
        3,
        4,
    )
    config.write_text("mixed_precision: no\n")  # YAML's False: what accelerate's own files quote as 'no'
    assert parse_train_args(["--config", str(config)]).mixed_precision == "no"


def test_an_empty_path_or_name_on_the_command_line_drops_the_config_files(tmp_path, capsys):
    """examples/sft_chat.yaml names a --train_file: a run of the same settings on a dataset from the Hub drops it."""
    config = tmp_path / "run.yaml"
    config.write_text("train_file: train.jsonl\nvalidation_file: dev.jsonl\ndataset_name: a/b\n")
    args = parse_train_args(["--config", str(config), "--train_file", "", "--validation_file="])
    assert (args.train_file, args.validation_file, args.dataset_name) == (None, None, "a/b")
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(config)])
    assert "not both (an empty value drops a --config file's: --train_file '')" in capsys.readouterr().err
    config.write_text("output_dir: runs/a\n")
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(config), "--output_dir", ""])
    assert "--output_dir is empty: name the folder that the run writes to" in capsys.readouterr().err
    # With nothing to drop, an empty path is a mistake (a script's unset variable), not a request for the demo.
    for argv in (["--train_file", ""], ["--config="], ["--config", str(config), "--validation_file", ""]):
        with pytest.raises(SystemExit):
            parse_train_args(argv)
        assert "is empty: an empty path only drops a --config file's" in capsys.readouterr().err


def test_a_flag_that_the_config_files_other_flag_overrides_is_refused(tmp_path, capsys):
    """--max_train_steps wins over the epochs, --num_warmup_steps over the ratio: from the file, over the command line's
    flag, which the docs say wins."""
    config = tmp_path / "run.yaml"
    config.write_text("max_train_steps: 6\nnum_warmup_steps: 5\n")
    for argv, words in ((["--num_train_epochs", "1"], "--num_train_epochs is overridden by --config "),
                        (["--warmup_ratio=0"], "--warmup_ratio is overridden by --config ")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_train_args(["--config", str(config), *argv])
        winner = {"--num_train_epochs": "max_train_steps", "--warmup_ratio": "num_warmup_steps"}[words.split()[0]]
        assert f"{words}{config}'s {winner}: drop {winner} from the file, or give --{winner}" in capsys.readouterr().err
    args = parse_train_args(["--config", str(config), "--num_train_epochs", "1", "--max_train_steps", "2"])
    assert (args.max_train_steps, args.num_warmup_steps) == (2, 5)


def test_no_use_peft_on_the_command_line_drops_the_config_files_lora_settings(tmp_path, capsys):
    """A file written for LoRA, run once as a full fine-tune to compare: its LoRA settings go with its --use_peft.
    Set without --use_peft in the file itself, or on the command line, they are still refused."""
    config = tmp_path / "lora.yaml"
    config.write_text("use_peft: true\nlora_r: 8\nlora_target_modules: q_proj\nmerge_lora: true\nseed: 3\n")
    full = parse_train_args(["--config", str(config), "--no-use_peft"])
    assert (full.use_peft, full.lora_r, full.lora_target_modules, full.merge_lora, full.seed) == (
        False, 16, "all-linear", False, 3)  # fmt: skip
    assert parse_train_args(["--config", str(config), "--use_peft", "false"]).lora_r == 16
    assert parse_train_args(["--config", str(config)]).lora_r == 8
    for file, argv in (("lora_r: 8\n", []), ("use_peft: true\n", ["--no-use_peft", "--lora_r", "8"])):
        config.write_text(file)
        with pytest.raises(SystemExit):
            parse_train_args(["--config", str(config), *argv])
        assert "--lora_r set(s) up LoRA: add --use_peft, or drop it" in capsys.readouterr().err


def test_evaluate_py_hints_only_at_its_own_flags(capsys):
    """Trainer's --lr is --learning_rate in train.py; evaluate.py trains nothing, so it names no flag it lacks."""
    from conftest import load_script

    parse_eval_args = load_script("evaluate").parse_eval_args
    for flag, hint in (("--lr", None), ("--bf16", "--bf16 -> --mixed_precision bf16"),
                       ("--max_new_tokens", "--max_new_tokens -> --generation_max_length N")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_eval_args(["--model_name_or_path", "m", "--validation_file", "dev.csv", flag])
        message = capsys.readouterr().err
        assert (hint in message) if hint else ("did you mean" not in message), message


def test_the_command_lines_task_wins_over_the_config_files_and_brings_its_flags(tmp_path):
    """The task decides which flags exist; --task on the command line wins over a shared file's, as any flag does."""
    config = tmp_path / "run.yaml"
    config.write_text("task: causal-lm\nseed: 3\n")
    args = parse_train_args(
        ["--config", str(config), "--task", "token-classification", "--return_entity_level_metrics"]
    )
    assert (args.task, args.return_entity_level_metrics, args.seed) == ("token-classification", True, 3)
    assert not hasattr(args, "packing")  # the file's task's flags are not registered


def test_a_null_config_value_leaves_the_flag_at_its_default(tmp_path):
    """`key:`, `~` or null: not given (a template's blank, or a merged default taken back), never the text 'None'."""
    config = tmp_path / "run.yaml"
    config.write_text("<<: {max_train_steps: 5, seed: 3}\nmax_train_steps: null\nlearning_rate: ~\nuse_peft:\n")
    args = parse("--config", str(config))
    assert (args.max_train_steps, args.learning_rate, args.use_peft, args.seed) == (None, None, False, 3)


def test_the_parsed_flags_are_read_only():
    """What a function receives does not depend on when it is called: a value settled later belongs in the Plan."""
    args = parse_train_args(["--seed", "3"])
    with pytest.raises(AttributeError, match=r"read-only once parsed \(--seed\); derived values belong in the Plan"):
        args.seed = 4
    with pytest.raises(AttributeError, match="read-only"):
        args.max_length = 64  # nor can a new one be added
    assert args.seed == 3 and args.max_length is None
