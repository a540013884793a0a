"""Where the pipeline's outputs live (dvc.yaml declares the same paths as outs/metrics)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path("artifacts")  # DVC-cached outs (statistics, checkpoints, eval logs); not in git
REPORTS = Path("reports")      # generated tables, figures and metrics; small, in git


def budget_str(budget: float) -> str:
    """The budget as DVC writes it in stage names and paths (0.3125 -> '0.3125')."""
    return repr(float(budget))


def variant(method: str, budget: float | None, finetuned: bool = False) -> str:
    """Name of one Table-1 row: original | <method>-<budget> | <method>-<budget>-ft (fine-tuned)."""
    name = "original" if method == "original" else f"{method}-{budget_str(budget)}"
    return name + "-ft" if finetuned else name


def calibration_file(model: str) -> Path:
    return ARTIFACTS / model / "calibration.safetensors"


def checkpoint_dir(model: str, method: str, budget: float) -> Path:
    return ARTIFACTS / model / variant(method, budget) / "model"


def finetuned_dir(model: str, method: str, budget: float) -> Path:
    return ARTIFACTS / model / variant(method, budget, True) / "model"


def eval_dir(model: str, method: str, budget: float | None, finetuned: bool = False) -> Path:
    return ARTIFACTS / model / variant(method, budget, finetuned) / "eval"


def metrics_file(model: str, method: str, budget: float | None, finetuned: bool = False) -> Path:
    return REPORTS / "metrics" / model / f"{variant(method, budget, finetuned)}.json"


def training_file(model: str, method: str, budget: float) -> Path:
    """The fine-tune run's summary (DVC metrics)."""
    return REPORTS / "metrics" / model / f"{variant(method, budget, True)}.train.json"


def loss_curve_file(model: str, method: str, budget: float) -> Path:
    """The fine-tune loss curves, one row per logged step (DVC plots)."""
    return REPORTS / "plots" / model / f"{variant(method, budget, True)}-loss.csv"


def throughput_dir(model: str, method: str, budget: float) -> Path:
    """throughput.md, fig6_speedup.png, results.json of one original-vs-converted measurement."""
    return REPORTS / "throughput" / model / variant(method, budget)


def figures_dir(model: str) -> Path:
    return REPORTS / "figures" / model


def case_study_file() -> Path:
    return REPORTS / "case_study.md"


def table_file() -> Path:
    return REPORTS / "table1.md"
