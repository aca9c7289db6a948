"""Metric modules of the `evaluate` library, loaded from src/metric_modules; tasks compute their metrics with them.

`evaluate.load("accuracy")` fetches its module from the Hub; loading the shipped files works offline.
"""

import importlib
import sys
from contextlib import contextmanager
from functools import cache
from pathlib import Path

MODULES = Path(__file__).parent / "metric_modules"


@contextmanager
def _evaluate_library():
    """The `evaluate` package itself, as sys.modules["evaluate"] while the block runs: the metric modules it loads
    `import evaluate`. Run from the repo root, the project's evaluate.py would shadow it; imported (a notebook's
    `import evaluate`), that script is put back afterwards, so that its `evaluate.main` still works."""
    shadow = sys.modules.get("evaluate")
    if hasattr(shadow, "load"):
        yield shadow
        return
    sys.modules.pop("evaluate", None)
    repo, saved = Path(__file__).resolve().parents[1], sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != repo]
    try:
        yield importlib.import_module("evaluate")
    finally:
        sys.path[:] = saved
        if shadow is not None:
            sys.modules["evaluate"] = shadow


@cache
def load_metric(module: str, config_name: str | None = None):
    """src/metric_modules/<module>.py, in its configuration `config_name`."""
    with _evaluate_library() as evaluate:
        # keep_in_memory: every rank computes the same metric; files in a shared cache would collide.
        return evaluate.load(str(MODULES / f"{module}.py"), config_name, keep_in_memory=True)
