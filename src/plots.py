"""Pictures of a run: training curves, a confusion matrix, predicted against true values."""

from pathlib import Path


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
            # Evaluations as points; a series of one point (a short run's one log) too, or it would not show.
            dots = key.startswith("eval_") or len(points) == 1
            ax.plot(steps, values, marker="o" if dots else None, markersize=4)
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
    from sklearn.metrics import ConfusionMatrixDisplay

    plt = pyplot()
    size = len(names)
    side = max(4.0, 0.6 * size + 2)
    figure, ax = plt.subplots(figsize=(side + 1, side))
    shown = ConfusionMatrixDisplay.from_predictions(
        labels, predictions, labels=range(size), display_labels=names, ax=ax, cmap="Blues",
        include_values=size <= 20, xticks_rotation=45 if size > 4 else "horizontal", colorbar=True,
    )  # fmt: skip
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = shown.confusion_matrix.trace() / max(1, len(labels))
    ax.set_title(f"confusion matrix ({len(labels)} examples, accuracy {accuracy:.3f})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return shown.im_.get_array().tolist()


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
