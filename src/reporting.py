"""What people look at: the console, metrics.jsonl, throughput, training curves and evaluation pictures.

The writing and plotting functions are called on the main process only.
"""

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import datasets
import torch
import transformers


def tracker_run_name(report_to: str, output_dir: Path) -> str:
    """The name trackers file the run under. TensorBoard writes into output_dir/<this name>: `tensorboard/` when it
    is the only tracker; with --report_to all the other trackers' runs are named after the output folder."""
    return "tensorboard" if report_to == "tensorboard" else Path(output_dir).name


def setup_logging():
    """Our INFO lines on the main process; the libraries' warnings, load reports and progress bars kept out."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def write_json(path: Path, values: dict):
    Path(path).write_text(json.dumps(values, indent=2, default=str) + "\n")


def append_jsonl(path: Path, record: dict):
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")


def keep_records_up_to(path: Path, step: int):
    if Path(path).exists():
        kept = [record for record in read_jsonl(path) if record["step"] <= step]
        Path(path).write_text("".join(json.dumps(record) + "\n" for record in kept))


def read_jsonl(path: Path) -> list[dict]:
    """The records, without a last line cut short by a run killed while writing it."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def pyplot():
    """matplotlib.pyplot, imported when the first picture is drawn (0.3-0.5 s that start-up need not wait for)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters and CI
    import matplotlib.pyplot

    return matplotlib.pyplot


def plot_training_curves(records: list[dict], path: Path) -> dict[str, tuple[list, list]]:
    """Training loss, learning rate and every eval_* metric against the optimizer step, one panel each.

    Returns what the figure shows, read back from it: {panel title: (steps, values)}.
    """
    plt = pyplot()
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    # Per-label scores (eval_f1/<label>) stay in metrics.jsonl: a panel for each of many labels would not fit.
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval_") and k != "eval_samples" and "/" not in k})
    panels = [("loss", "training loss", train), ("learning_rate", "learning rate", train)]
    panels += [(key, key.removeprefix("eval_").replace("_", " "), evals) for key in eval_keys]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, (key, title, source) in zip(axes.flat, panels):
        points = [(r["step"], r[key]) for r in source if key in r]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if key.startswith("eval_") else None, markersize=4)
        ax.set_title(title if key == "loss" or key == "learning_rate" else f"validation {title}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return {
        ax.get_title(): (list(map(float, line.get_xdata())), list(map(float, line.get_ydata())))
        for ax in axes.flat
        for line in ax.lines
    }


def plot_confusion_matrix(labels: list[int], predictions: list[int], names: list[str], path: Path) -> list[list[int]]:
    """Counts of true (rows) against predicted (columns) classes, with the class names on both axes.

    Returns the counts the picture shows, read back from it.
    """
    plt = pyplot()
    size = len(names)
    counts = [[0] * size for _ in range(size)]
    for true, predicted in zip(labels, predictions):
        counts[true][predicted] += 1
    side = max(4.0, 0.6 * size + 2)
    figure, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(counts, cmap="Blues")
    figure.colorbar(image, ax=ax, fraction=0.046)
    ax.set_xticks(range(size), names, rotation=45 if size > 4 else 0, ha="right" if size > 4 else "center")
    ax.set_yticks(range(size), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = sum(counts[i][i] for i in range(size)) / max(1, len(labels))
    ax.set_title(f"confusion matrix ({len(labels)} examples, accuracy {accuracy:.3f})")
    peak = max(max(row) for row in counts) or 1
    if size <= 20:
        for i in range(size):
            for j in range(size):
                color = "white" if counts[i][j] > peak / 2 else "black"
                ax.text(j, i, counts[i][j], ha="center", va="center", color=color)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return image.get_array().tolist()


def plot_regression(labels: list[float], predictions: list[float], path: Path) -> list[list[float]]:
    """Predicted against true values, with the diagonal where they would be equal.

    Returns the (true, predicted) points the picture shows, read back from it.
    """
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(labels, predictions, s=8, alpha=0.5)
    low, high = min(labels + predictions), max(labels + predictions)
    ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1, label="predicted = true")
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    ax.set_title(f"predicted vs true ({len(labels)} examples)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return ax.collections[0].get_offsets().tolist()


class ThroughputWindow:
    """Loss and token counts since the last log, kept on the device so that logging is the only sync."""

    def __init__(self, device):
        self.sums = torch.zeros(2, device=device)  # loss, real (unpadded) tokens
        self.nonfinite = torch.zeros((), device=device)  # NaN or infinite losses so far, checked when syncing anyway
        self.batches = self.samples = self.padded_tokens = 0
        self.start = time.perf_counter()
        self.totals = {"samples": 0, "tokens": 0.0, "padded_tokens": 0}

    def add(self, loss, batch):
        loss = loss.detach().float()
        self.sums += torch.stack([loss, batch["attention_mask"].sum().float()])
        self.nonfinite += ~torch.isfinite(loss)
        self.batches += 1
        self.samples += batch["input_ids"].shape[0]
        self.padded_tokens += batch["input_ids"].numel()

    def nonfinite_losses(self, accelerator) -> int:
        """NaN or infinite losses so far on all ranks (a collective: call on every rank)."""
        return int(accelerator.reduce(self.nonfinite.clone(), reduction="sum").item())

    @contextmanager
    def paused(self):
        """Leave the time spent inside (evaluation, checkpointing) out of the throughput."""
        started = time.perf_counter()
        yield
        self.start += time.perf_counter() - started

    def flush(self, accelerator) -> dict:
        """Mean loss and throughput over all ranks since the last flush (a collective: call on every rank)."""
        local = torch.cat([self.sums, self.sums.new_tensor([self.batches, self.samples, self.padded_tokens])])
        loss, tokens, batches, samples, padded = accelerator.reduce(local, reduction="sum").tolist()
        seconds = time.perf_counter() - self.start
        samples = int(samples)
        self.totals = {
            "samples": self.totals["samples"] + samples,
            "tokens": self.totals["tokens"] + tokens,
            "padded_tokens": self.totals["padded_tokens"] + int(padded),
        }
        self.sums.zero_()
        self.batches = self.samples = self.padded_tokens = 0
        self.start = time.perf_counter()
        return {
            "loss": loss / max(1, batches),
            "samples_per_second": samples / seconds,
            "tokens_per_second": tokens / seconds,
        }
