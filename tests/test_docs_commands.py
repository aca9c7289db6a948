"""The commands in README.md and docs/*.md work: every train.py and evaluate.py command shown in a shell code block
parses with the scripts' own parsers (and its launcher flags with the launcher's), and those a CPU finishes in
seconds run, on shrunken data, in a temporary folder.

A flag renamed or removed in src/args.py fails here until the docs say the new name; a README command that no
longer trains fails here before a reader finds out.
"""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import CPU_CONFIG, REPO, free_port, run_process, sentiment_rows, write_rows

from src.args import build_eval_parser, parse_args, parse_train_args

README = REPO / "README.md"
DOC_FILES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_BYTES = 12_000
SCRIPTS = ("train.py", "evaluate.py")
SHELL_FENCES = {"", "bash", "sh", "shell"}
PYTHONS = {"python", "python3"}
# Words that run the next words as a command: `nohup python train.py &`, `env X=1 python train.py`.
WRAPPERS = {"nohup", "env", "time", "exec"}

# Stand-ins for the files the everyday commands name, in the columns those commands expect (a text and a string
# label): with them, "train on your files, then evaluate" runs as shown. Other file names are the reader's own data.
STAND_INS = {"train.csv": (64, 1), "dev.csv": (32, 2), "test.csv": (32, 3)}  # name: (rows, seed)

# Appended to a command that runs here (the last value of a flag wins), so that a run takes seconds on 2 cores: a
# few batches, one epoch, no TensorBoard (its import alone is a second; tracking has tests of its own).
SHRINK = {
    "train.py": "--max_train_samples 64 --max_eval_samples 32 --num_train_epochs 1 --report_to none",
    "evaluate.py": "--max_eval_samples 32",
}
RUN_TIMEOUT_S = 180  # one shrunken run takes 5-15 s; the margin is for a loaded CI machine
# Offline as the whole suite (conftest.py), and one thread per process: two runs share the 2 cores (test_commands_run).
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# The launcher flags of a command that runs here: anything else asks for GPUs or other machines. The tests' own CPU
# config is the one accelerate config that starts CPU ranks (the others name GPUs, FSDP, DeepSpeed or machines).
CPU_LAUNCHER_FLAGS = {"--config_file", "--num_processes", "--main_process_port", "--cpu", "--mixed_precision"}
CPU_TORCHRUN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--standalone"}
CPU_ACCELERATE_CONFIGS = {CPU_CONFIG.relative_to(REPO).as_posix()}
MAX_PROCESSES = 2  # the CI machine's cores


@dataclass
class Command:
    """One train.py or evaluate.py command as a doc shows it."""

    source: str  # "docs/file.md:line"
    block: str  # "docs/file.md:line" of its code block: the commands of a block run in one folder, in order
    text: str  # as shown, continuation lines joined
    launcher: str  # "python", "accelerate" or "torchrun"
    launcher_flags: list[str]
    script: str
    argv: list[str]
    fragment: bool  # "..." stands for the reader's own flags
    why_not_run: str | None = "its flags do not parse (test_command_parses says why)"


def shell_blocks(path: Path):
    """(line number, lines) of each code block fenced as bash, sh, shell or with no language."""
    lines = path.read_text().splitlines()
    block_start, language = None, None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped.startswith("```"):
            continue
        if block_start is None:
            block_start, language = number, stripped[3:].strip().lower()
        else:
            if language in SHELL_FENCES:
                yield (
                    block_start,
                    [(block_start + i, text) for i, text in enumerate(lines[block_start : number - 1], 1)],
                )
            block_start = None


def logical_lines(numbered_lines):
    """(first line number, text) with `\\` continuations joined and here-documents left out."""
    pending, start, heredoc_end = "", None, None
    for number, line in numbered_lines:
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)", text)
        if heredoc:
            heredoc_end = heredoc.group(1)
        yield start, text.strip()
        start = None


def words_of(text: str) -> list[str]:
    """Shell words, without the comment (bash starts one at a word beginning with #) or redirections."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split, lexer.commenters = True, ""  # word by word, so that a comment's quotes are never read
    kept, skip_next = [], False
    while True:
        try:
            word = lexer.get_token()
        except ValueError:  # an unclosed quote: prose in a block without a language, not a command
            return []
        if word is None or word.startswith("#"):
            break
        if skip_next:
            skip_next = False
        elif word in (">", ">>", "<", "2>", "&>"):
            skip_next = True
        elif not re.match(r"^(\d?>|&>|<)", word):
            kept.append(word)
    return kept


def segments(words: list[str]):
    """The simple commands of a line: `a && b; c | d &` gives a, b, c and d."""
    current = []
    for word in words:
        if word in ("&&", "||", ";", "|", "&"):
            if current:
                yield current
            current = []
        else:
            current.append(word)
    if current:
        yield current


def command_of(words: list[str], source: str, block: str, text: str) -> Command | None:
    """The train.py or evaluate.py command in these words, or None for any other command (pip, ruff, sbatch...)."""
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in WRAPPERS):
        words = words[1:]
    if words and words[0] == "srun":  # SLURM's options first, then the launcher it starts on each node
        starts = [i for i, word in enumerate(words) if word in PYTHONS | {"accelerate", "torchrun"}]
        words = words[starts[0] :] if starts else []
    at = next((i for i, word in enumerate(words) if Path(word).name in SCRIPTS), None)
    if at is None or at == 0:
        return None
    before, argv = words[:at], words[at + 1 :]
    if before[0] in PYTHONS and all(word.startswith("-") and word not in ("-m", "-c") for word in before[1:]):
        launcher, launcher_flags = "python", []
    elif before[:2] == ["accelerate", "launch"]:
        launcher, launcher_flags = "accelerate", before[2:]
    elif before[0] == "torchrun":
        launcher, launcher_flags = "torchrun", before[1:]
    else:
        return None  # e.g. `cat train.py`: not a run of ours
    return Command(
        source=source,
        block=block,
        text=text,
        launcher=launcher,
        launcher_flags=launcher_flags,
        script=Path(words[at]).name,
        argv=[word for word in argv if word != "..."],
        fragment="..." in argv,
    )


def extract_commands() -> list[Command]:
    commands = []
    for path in DOC_FILES:
        name = path.relative_to(REPO).as_posix()
        for block_line, numbered_lines in shell_blocks(path):
            for line, text in logical_lines(numbered_lines):
                for words in segments(words_of(text)):
                    command = command_of(words, f"{name}:{line}", f"{name}:{block_line}", text)
                    if command:
                        commands.append(command)
    return commands


def flag_value(words: list[str], flag: str) -> str | None:
    """The last value given to `flag` (as `--flag value` or `--flag=value`), as argparse would keep it."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def repo_file(word: str) -> Path | None:
    """The project's own file that a relative path names (a config, an example), or None."""
    path = REPO / word
    return path if not Path(word).is_absolute() and path.is_file() and not word.startswith("outputs/") else None


def resolved_argv(command: Command) -> tuple[list[str], bool]:
    """The script's words with the project's own files made absolute, and a `--config` that names the reader's own
    file (not in the repo) left out; True when one was left out."""
    words, own_config, skip = [], False, False
    for i, word in enumerate(command.argv):
        if skip:
            skip = False
            continue
        config = word.split("=", 1)[1] if word.startswith("--config=") else None
        if word == "--config" and i + 1 < len(command.argv):
            config, skip = command.argv[i + 1], True
        if config is not None:
            if repo_file(config):
                words += ["--config", str(repo_file(config))]
            else:
                own_config = True
            continue
        words.append(str(repo_file(word)) if repo_file(word) else word)
    return words, own_config


def parsed_args(command: Command):
    """The script's flags as it parses them (train.py's also validated together); SystemExit on a parser error."""
    argv, _ = resolved_argv(command)
    if command.script == "train.py":
        return parse_train_args(argv)  # with the flags of the task that --task names
    return parse_args(build_eval_parser(), argv)


def check_script_flags(command: Command, capsys):
    """The script's parser accepts the flags; its error fails the test, naming the doc's line."""
    try:
        parsed_args(command)
        return
    except SystemExit as exit_info:
        message = capsys.readouterr().err.strip() or f"exit status {exit_info.code}"
    pytest.fail(f"{command.source}: `{command.text}`\n  {message}", pytrace=False)


def check_launcher_flags(command: Command, capsys):
    """The launcher's own parser accepts the flags before the script, and a --config_file is one of ours."""
    if command.launcher == "python":
        return
    if command.launcher == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
    else:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    message = None
    try:
        parser.parse_args([*command.launcher_flags, command.script])
    except SystemExit:
        message = " ".join(capsys.readouterr().err.strip().splitlines()[-1:])  # the last line: the usage block is long
    if message is not None:
        pytest.fail(f"{command.source}: `{command.text}`\n  launcher flags: {message}", pytrace=False)
    config_file = flag_value(command.launcher_flags, "--config_file")
    if config_file is not None:
        assert repo_file(config_file), f"{command.source}: --config_file {config_file} is not a file of this repository"


def processes(command: Command) -> int:
    """How many processes the launcher starts: its flag, else its accelerate config's, else 1."""
    count_flag = "--num_processes" if command.launcher == "accelerate" else "--nproc_per_node"
    count = flag_value(command.launcher_flags, count_flag)
    config_file = flag_value(command.launcher_flags, "--config_file")
    if count is None and config_file and repo_file(config_file):
        count = yaml.safe_load(repo_file(config_file).read_text()).get("num_processes")
    return int(count) if str(count).isdigit() else 1


def reason_not_to_run(command: Command, args, produced: set[str], shown: set[str]) -> str | None:
    """Why this command is only parsed here, or None when it runs. `produced`: the output folders that earlier
    commands of its block write here (an evaluate.py after its train.py); `shown`: those that all of them write."""
    # The reader's own flags, config file, model or data: nothing to run until the reader fills them in.
    if command.fragment:
        return "a fragment: '...' stands for the reader's own flags"
    if resolved_argv(command)[1]:
        return "reads the reader's own --config file"
    # GPU configs (single_gpu, multi_gpu, fsdp, deepspeed), multi_node.yaml and the launcher flags for GPUs or
    # machines need hardware that CI lacks. Their flags and config files are still checked (test_command_parses),
    # and accelerate's own loader reads every config in test_launchers.py.
    flags = [word.split("=", 1)[0] for word in command.launcher_flags if word.startswith("-")]
    allowed = {"accelerate": CPU_LAUNCHER_FLAGS, "torchrun": CPU_TORCHRUN_FLAGS}.get(command.launcher, set())
    config_file = flag_value(command.launcher_flags, "--config_file")
    if any(flag not in allowed for flag in flags) or (config_file and config_file not in CPU_ACCELERATE_CONFIGS):
        return "asks for GPUs or several machines"
    if processes(command) > MAX_PROCESSES:
        return f"starts more processes than the {MAX_PROCESSES} this test starts"
    # A resume continues a run that was stopped mid-way, which a shrunken run never is; test_checkpoints.py and
    # test_preemption.py stop runs and resume them exactly.
    if getattr(args, "resume_from_checkpoint", None):
        return "continues a stopped run"
    # Hub models, datasets and uploads: the tests run offline (HF_HUB_OFFLINE=1, conftest.py).
    glue_from_the_hub = getattr(args, "task_name", None) and not args.train_file
    if getattr(args, "push_to_hub", False) or args.dataset_name or glue_from_the_hub:
        return "needs the Hugging Face Hub (the tests run offline)"
    # The model the command names (train.py fills in the packaged default when it names none).
    model = flag_value(resolved_argv(command)[0], "--model_name_or_path")
    if model and Path(model).as_posix() in shown - produced:
        return "evaluates the output of a command above it that does not run here"
    if model and not (repo_file(model) or Path(model).as_posix() in produced):
        return "names a Hub model or the reader's own (the tests run offline)"
    for data in (getattr(args, "train_file", None), args.validation_file):
        if data and Path(data).as_posix() not in STAND_INS and not repo_file(str(data)):
            return "reads the reader's own data files"
    if args.output_dir and Path(args.output_dir).is_absolute():
        return "writes outside the test's folder"
    return None


COMMANDS = extract_commands()


def runnable_blocks() -> dict[str, list[Command]]:
    """The blocks with a command that runs here, each with its commands that run, in order; sets `why_not_run`."""
    blocks, produced, shown = {}, {}, {}
    for command in COMMANDS:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = parsed_args(command)
        except SystemExit:
            continue  # not run; test_command_parses reports the parser's error
        here, written = produced.setdefault(command.block, set()), shown.setdefault(command.block, set())
        command.why_not_run = reason_not_to_run(command, args, here, written)
        if command.script == "train.py":
            written.add(Path(args.output_dir).as_posix())
            if command.why_not_run is None:
                here.add(Path(args.output_dir).as_posix())
        if command.why_not_run is None:
            blocks.setdefault(command.block, []).append(command)
    return blocks


RUNNABLE = runnable_blocks()


@pytest.mark.parametrize("command", COMMANDS, ids=[command.source for command in COMMANDS])
def test_command_parses(command, capsys):
    check_launcher_flags(command, capsys)
    check_script_flags(command, capsys)


def test_the_docs_show_commands_and_the_first_run_is_tested():
    """The extraction itself works: a change of fences or quoting that hid every command would pass the rest."""
    assert len(COMMANDS) >= 15, [command.source for command in COMMANDS]
    first = next(command for command in COMMANDS if command.source.startswith("README.md"))
    assert (first.script, first.argv) == ("train.py", []), "the README's first command is the default run"
    assert first.why_not_run is None, f"the README's first run is not run here: {first.why_not_run}"


def test_the_extraction_reads_commands_as_the_shell_would(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\n"
        "pip install -r requirements.txt && HF_HUB_OFFLINE=1 python -u train.py --seed 1  # the reader's comment\n"
        "accelerate launch --config_file accelerate_configs/cpu.yaml \\\n"
        "  evaluate.py --model_name_or_path out > log 2>&1\n"
        "srun --nodes 2 torchrun --nproc_per_node 8 train.py ...\n"
        "nohup python train.py --max_time 60 &\n"
        "pkill -KILL -f train.py\n"
        "```\n"
        "```python\n"
        "subprocess.run(['python', 'train.py'])\n"
        "```\n"
    )
    found = []
    for block_line, numbered_lines in shell_blocks(doc):
        for line, text in logical_lines(numbered_lines):
            found += [command_of(words, f"doc.md:{line}", block_line, text) for words in segments(words_of(text))]
    shown = [(c.source, c.launcher, c.launcher_flags, c.script, c.argv, c.fragment) for c in found if c]
    assert shown == [
        ("doc.md:2", "python", [], "train.py", ["--seed", "1"], False),
        ("doc.md:3", "accelerate", ["--config_file", "accelerate_configs/cpu.yaml"], "evaluate.py",
         ["--model_name_or_path", "out"], False),
        ("doc.md:5", "torchrun", ["--nproc_per_node", "8"], "train.py", [], True),
        ("doc.md:6", "python", [], "train.py", ["--max_time", "60"], False),
    ]  # fmt: skip


def test_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs the suite in 2 pytest-xdist workers; the README must show readers the same command."""
    command = "python -m pytest -q -n 2 --dist loadfile"
    lines = [text for _, lines in shell_blocks(README) for _, text in lines]
    assert command in lines
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def stand_ins(folder: Path):
    for name, (rows, seed) in STAND_INS.items():
        write_rows(folder / name, sentiment_rows(rows, seed=seed))


def run_words(command: Command) -> list[str]:
    """The command as this test starts it: this interpreter, the repository's scripts, the shrinking flags."""
    launcher = {
        "python": [sys.executable],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }[command.launcher]
    launcher_flags = [str(repo_file(word)) if repo_file(word) else word for word in command.launcher_flags]
    if command.launcher == "accelerate":
        launcher_flags += ["--main_process_port", free_port()]  # 29500 may be another test's rendezvous
    argv, _ = resolved_argv(command)
    return [*launcher, *launcher_flags, str(REPO / command.script), *argv, *SHRINK[command.script].split()]


def run_block(block: str, folder: Path) -> str | None:
    """Run the block's commands in order, in one folder (an evaluate.py reads what the train.py before it wrote);
    what failed, or None."""
    folder.mkdir()
    stand_ins(folder)
    for command in RUNNABLE[block]:
        try:
            result = run_process(run_words(command), RUN_TIMEOUT_S, cwd=folder, env=RUN_ENV)
        except subprocess.TimeoutExpired:  # run_process has killed every process the command started
            return f"{command.source}: `{command.text}` ran over {RUN_TIMEOUT_S} s"
        if result.returncode != 0:
            return f"{command.source}: `{command.text}` failed:\n{result.stderr[-3000:]}"
    return None


def test_commands_run(tmp_path):
    """Two blocks at a time: a shrunken run spends most of its time importing libraries on one core, so two of them
    share the CI machine's 2 cores well (one thread per rank, set in RUN_ENV), and the file adds ~25 s, not ~40."""
    blocks = sorted(RUNNABLE, key=lambda block: -sum(processes(command) for command in RUNNABLE[block]))
    folders = [tmp_path / re.sub(r"\W", "_", block) for block in blocks]
    with ThreadPoolExecutor(max_workers=MAX_PROCESSES) as pool:
        failures = [failure for failure in pool.map(run_block, blocks, folders) if failure]
    assert not failures, "\n\n".join(failures)


def markdown_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_readme_is_short_and_its_links_exist():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move details into docs/ (at most {README_MAX_BYTES})"
    docs_links = [link for link in markdown_links(README) if link.startswith("docs/")]
    assert docs_links, "the README links to its details in docs/"
    for path in DOC_FILES:
        for link in markdown_links(path):
            target, _, anchor = link.partition("#")
            linked = (path.parent / target) if target else path
            assert linked.is_file(), f"{path.relative_to(REPO)} links to {link}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in heading_anchors(linked), f"{path.relative_to(REPO)} links to {link}: no such heading"
