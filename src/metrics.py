"""Metric modules of the `evaluate` library, loaded from src/metric_modules; tasks compute their metrics with them.

`evaluate.load("accuracy")` fetches its module from the Hub; loading the shipped files works offline.
"""

import importlib
import sys
from functools import cache
from pathlib import Path

MODULES = Path(__file__).parent / "metric_modules"


def _evaluate_library():
    """The `evaluate` package itself: run from the repo root, the project's evaluate.py would shadow it."""
    repo = Path(__file__).resolve().parents[1]
    if hasattr(sys.modules.get("evaluate"), "load"):
        return sys.modules["evaluate"]
    sys.modules.pop("evaluate", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != repo]
    try:
        return importlib.import_module("evaluate")
    finally:
        sys.path[:] = saved


@cache
def load_metric(module: str, config_name: str | None = None):
    """src/metric_modules/<module>.py, in its configuration `config_name`."""
    # keep_in_memory: every rank computes the same metric; files in a shared cache would collide.
    return _evaluate_library().load(str(MODULES / f"{module}.py"), config_name, keep_in_memory=True)
