"""Where the pipeline's outputs live (dvc.yaml declares the same paths as outs/metrics)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path("artifacts")  # DVC-cached outs (statistics, checkpoints, eval logs); not in git
REPORTS = Path("reports")      # generated tables, figures and metrics; small, in git


def budget_str(budget: float) -> str:
    """The budget as DVC writes it in stage names and paths (0.3125 -> '0.3125')."""
    return repr(float(budget))


def variant(method: str, budget: float | None) -> str:
    return "original" if method == "original" else f"{method}-{budget_str(budget)}"


def calibration_file(model: str) -> Path:
    return ARTIFACTS / model / "calibration.safetensors"


def checkpoint_dir(model: str, method: str, budget: float) -> Path:
    return ARTIFACTS / model / variant(method, budget) / "model"


def eval_dir(model: str, method: str, budget: float | None) -> Path:
    return ARTIFACTS / model / variant(method, budget) / "eval"


def metrics_file(model: str, method: str, budget: float | None) -> Path:
    return REPORTS / "metrics" / model / f"{variant(method, budget)}.json"


def figures_dir(model: str) -> Path:
    return REPORTS / "figures" / model


def table_file() -> Path:
    return REPORTS / "table1.md"
