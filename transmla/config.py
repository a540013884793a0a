"""Every option of the library, with its default and its validation, in one place (pydantic).

The CLI flags (transmla/cli.py) and the pipeline's params (flows/params.py, params/*.yaml) are built
from these models, so a default is declared once. Constructing one directly (Python API, CLI)
raises a `TransMLAError` naming the field and the fix; inside a params profile the same models
validate as sections and report the YAML location instead.

    ConvertOptions     one conversion (flat: what config.json's `transmla.options` records)
      CalibrationOptions / TransMLAOptions / ExportOptions   its params sections
    FinetuneConfig     one recovery fine-tune run
    EvaluationOptions  perplexity + benchmarks

No torch here: this module is imported by everything and must stay cheap and dependency-free.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from transmla.errors import TransMLAError

METHODS = ("transmla", "mha2mla")
FREQFOLDS = (1, 2, 4, 8)  # RoRoPE FreqFold M (adjacent frequencies per PCA); must divide d/2
BENCHMARKS = ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande")
# transformers' DeepseekV3 builds kv_a_layernorm / q_a_layernorm with its default eps, 1e-6, not
# config.rms_norm_eps; the latent-norm identity is built for it (transmla.method.mla).
LATENT_NORM_EPS = 1e-6
REFIT_DAMP = 1e-4  # ridge of the output refit, relative to the mean eigenvalue of E[Z Z^T] (method.refit)
REFIT_MAX_DIM = 4096  # latent coordinates fitted jointly (heads x rank): bounds the refit's O(n^2) memory
FINETUNE_CORPORA = ("c4-demo", "wiki-demo", "wikitext2-train")


def _admits_bool(annotation) -> bool:
    """Whether a value of this type may hold a boolean: bool itself, a Literal of one, a pydantic model (its own
    fields decide), or a container or union of any of these."""
    from typing import get_args, get_origin

    if annotation is bool or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    return any(_admits_bool(a) for a in get_args(annotation))


def _holds_bool(v) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, dict):
        return any(_holds_bool(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_holds_bool(x) for x in v)


def no_bool_numbers(cls, v, info):
    """A before-validator for every field: a boolean (or a list or mapping holding one) where the field takes no
    boolean is refused. YAML reads yes/no/on/off as booleans and pydantic would take them as the numbers 1 and 0."""
    if _holds_bool(v) and not _admits_bool(cls.model_fields[info.field_name].annotation):
        raise ValueError(f"{v!r} {'is' if isinstance(v, bool) else 'holds'} a boolean, not a number or name "
                         "(YAML reads yes/no/on/off as booleans)")
    return v


def repeated(items) -> list:
    """The items a sequence names again after their first mention (equality, so unhashable items too)."""
    return [x for i, x in enumerate(items) if x in items[:i]]


def no_repeats(cls, v, info):
    """An after-validator for every field: a list naming one thing twice is refused. Each mention was run
    (and reported) once more: a model twice in pipeline.models gave Table 1 every row twice."""
    if isinstance(v, (list, tuple)) and repeated(v):
        raise ValueError(f"{info.field_name} names {repeated(v)} more than once")
    return v


class Options(BaseModel):
    """Frozen, no unknown keys; direct construction reports bad values as one TransMLAError."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a float is finite: inf passed gt=0
    _no_bools = field_validator("*", mode="before")(no_bool_numbers)
    _no_repeats = field_validator("*")(no_repeats)

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise options_error(e, type(self).__name__) from None

    # Only direct construction goes through __init__; inside a params profile pydantic validates the
    # section itself, so its errors keep their YAML location (flows/params.py).
    __init__.__pydantic_base_init__ = True

    def replace(self, **changes):
        """A validated copy with some fields changed."""
        return type(self)(**{**self.model_dump(), **changes})


def options_error(e: ValidationError, what: str) -> TransMLAError:
    first = e.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a check across fields: its message names them; the input is every option
        return TransMLAError(f"{what}: {msg}.", "change one of the options it names (see `transmla --help`).")
    where = ".".join(str(x) for x in first["loc"])
    err = TransMLAError(f"{what}: {where}: {msg} (got {first.get('input')!r}).",
                        f"set a valid `{where}` (see `transmla --help` or transmla/config.py).")
    err.field, err.reason = where, f"{msg} (got {first.get('input')!r})"  # for a caller that names it as a flag
    return err


def _freqfold(v: int) -> int:
    if v not in FREQFOLDS:
        raise ValueError(f"freqfold={v} is not one of {list(FREQFOLDS)}")
    return v


class CalibrationOptions(Options):
    """Calibration set: nsamples random windows of seqlen tokens (seeded), as the authors' code."""

    dataset: str = "wikitext2-train"
    nsamples: int = Field(128, ge=1)
    seqlen: int = Field(256, ge=2)
    batch_size: int = Field(8, ge=1)
    seed: int = Field(42, ge=0, lt=2**32)  # numpy's seed range (every seed here seeds numpy somewhere)


class TransMLAOptions(Options):
    """The paper's method: RoRoPE + FreqFold, then balanced-KV joint PCA on activations.

    The defaults are this project's recommended mode (measured best at every KV budget, reports/):
    the paper's steps calibrated layer by layer on the converted model, in attention's metric, with
    the value path (W_UV, o_proj) refit to the original layers' outputs. PAPER_TRANSMLA: the paper's own.
    """

    freqfold: int = 4
    balance_kv: bool = True
    pca: Literal["activations", "weights"] = "activations"
    attention_aware: bool = True  # extension: PCA in the metric attention sees (method.bkv.attention_metrics)
    # parallel: statistics of the original model (the paper); two_pass: the authors' code (PCA statistics
    # recomputed with RoPE dropped); sequential: layer by layer on the converted prefix (pipeline.stream)
    calibration: Literal["parallel", "two_pass", "sequential"] = "sequential"
    refit: bool = True  # extension: joint least-squares refit of W_UV and o_proj to the original layer's output (method.refit)
    # extension: RoRoPE's PCA ranks components by key energy (the paper) or by the score energy the queries
    # read from them (method.rorope); query helps few-KV-head models (Qwen2.5-0.5B, g=2: lower perplexity, no
    # looping continuation instead of one) and is neutral on SmolLM2 (reports/ablation/)
    rorope_metric: Literal["key", "query"] = "query"

    @field_validator("freqfold")
    @classmethod
    def _ff(cls, v):
        return _freqfold(v)


class ExportOptions(Options):
    dtype: Literal["float32", "bfloat16"] = "float32"
    latent_norm_eps: float | None = Field(None, gt=0)  # None: transformers' fixed 1e-6; vLLM: config.rms_norm_eps


# The paper's TransMLA (Table 1's row): statistics of the original model, no extensions.
PAPER_TRANSMLA = {"attention_aware": False, "calibration": "parallel", "refit": False, "rorope_metric": "key"}


_CAL, _TM, _EX = CalibrationOptions.model_fields, TransMLAOptions.model_fields, ExportOptions.model_fields


class ConvertOptions(Options):
    """Everything that defines a conversion. Field order is the record's order (config.json)."""

    method: Literal["transmla", "mha2mla"] = "transmla"
    kv_cache_ratio: float | None = None  # shorthand: picks qk_rope_dim and kv_lora_rank
    qk_rope_dim: int | None = Field(None, ge=2)
    kv_lora_rank: int | None = Field(None, ge=1)
    freqfold: int = _TM["freqfold"].default
    q_lora_rank: int | None = Field(None, ge=1)
    balance_kv: bool = _TM["balance_kv"].default
    attention_aware: bool = _TM["attention_aware"].default
    pca: Literal["activations", "weights"] = _TM["pca"].default
    calibration: Literal["parallel", "two_pass", "sequential"] = _TM["calibration"].default
    refit: bool = _TM["refit"].default
    rorope_metric: Literal["key", "query"] = _TM["rorope_metric"].default
    lossless: bool = False
    cal_dataset: str = _CAL["dataset"].default
    cal_nsamples: int = Field(_CAL["nsamples"].default, ge=1)
    cal_seqlen: int = Field(_CAL["seqlen"].default, ge=2)
    cal_batch_size: int = Field(_CAL["batch_size"].default, ge=1)
    seed: int = Field(_CAL["seed"].default, ge=0, lt=2**32)
    dtype: str = _EX["dtype"].default
    device: str = "cpu"
    latent_norm_eps: float | None = Field(_EX["latent_norm_eps"].default, gt=0)
    # model: the whole source model in memory (float32); layers: one decoder layer at a time, read from the
    # source's safetensors when its turn comes and written out when converted (io.lazy; same result)
    load: Literal["model", "layers"] = "model"

    @field_validator("freqfold")
    @classmethod
    def _ff(cls, v):
        return _freqfold(v)

    @field_validator("kv_cache_ratio")
    @classmethod
    def _ratio(cls, v):
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"kv_cache_ratio={v} is not in (0, 1] (0.125 = an 87.5% cut)")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v == "float16":
            raise ValueError("float16 cannot hold the kv_a_layernorm identity (the scaled latent underflows); "
                             "use bfloat16 or float32")
        if v not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {v!r} is not float32 or bfloat16")
        return v

    @model_validator(mode="after")
    def _lossless(self):
        if self.lossless and self.method != "transmla":
            raise ValueError("lossless is a TransMLA mode (drop --method mha2mla or --lossless)")
        budget = [k for k in ("kv_cache_ratio", "qk_rope_dim", "kv_lora_rank") if getattr(self, k) is not None]
        if self.lossless and budget:  # lossless keeps every RoPE dim and the full rank: a budget would be ignored
            raise ValueError(f"lossless keeps the whole KV cache, so it takes no {' / '.join(budget)} "
                             "(drop --lossless or the budget options)")
        # from the raw fields (normalized() builds new options, which would run this validator again, forever):
        # MHA2MLA and lossless normalize calibration to parallel
        if self.load == "layers" and self.calibration == "two_pass" and self.method == "transmla" and not self.lossless:
            raise ValueError("load=layers streams one pass over the layers; two_pass needs a second one "
                             "(use calibration parallel or sequential, or load model)")
        return self

    @classmethod
    def from_sections(cls, method: str, budget: float | None, transmla: dict,
                      calibration: CalibrationOptions, export: ExportOptions, device: str, **explicit) -> "ConvertOptions":
        """The options a (method, budget) of a params profile stands for; `transmla`: TransMLAOptions fields
        (empty for MHA2MLA, which normalizes them away)."""
        c = calibration
        return cls(**{"method": method, "kv_cache_ratio": budget, **transmla, "cal_dataset": c.dataset,
                      "cal_nsamples": c.nsamples, "cal_seqlen": c.seqlen, "cal_batch_size": c.batch_size,
                      "seed": c.seed, **export.model_dump(), "device": device, **explicit})

    @property
    def norm_eps(self) -> float:
        return LATENT_NORM_EPS if self.latent_norm_eps is None else self.latent_norm_eps

    def normalized(self) -> "ConvertOptions":
        """Options a method ignores set to one canonical value, so they never split a cache or a record:
        MHA2MLA has no FreqFold, balancing, PCA mode or metric; lossless TransMLA keeps every frequency and rank
        (the original model's statistics, no refit)."""
        if self.method == "mha2mla":
            return self.replace(freqfold=1, balance_kv=False, pca="weights", attention_aware=False,
                                calibration="parallel", refit=False, rorope_metric="key")
        if self.lossless:  # exact by construction: nothing for layer-by-layer statistics, a refit or a metric to improve
            return self.replace(freqfold=1, calibration="parallel", refit=False, rorope_metric="key")
        return self

    @property
    def streamed(self) -> bool:
        """Whether the conversion pushes the calibration set through the model layer by layer (pipeline.stream)."""
        n = self.normalized()
        return n.calibration != "parallel" or n.refit

    def rotation_options(self) -> dict:
        """What the per-layer rotation step depends on (besides weights, statistics and the RoPE plan)."""
        n = self.normalized()
        return {"method": n.method, "freqfold": n.freqfold, "rorope_metric": n.rorope_metric}

    def basis_options(self) -> dict:
        """What the per-layer BKV basis step depends on (besides weights, statistics, rotation and rank)."""
        n = self.normalized()
        return {"method": n.method, "balance_kv": n.balance_kv, "pca": n.pca, "attention_aware": n.attention_aware}

    def stream_options(self) -> dict:
        """What the layer-streamed conversion step depends on (besides weights, the calibration data, statistics,
        the RoPE plan and rank): the method's options, the calibration sizes and seed, the query rank, the latent
        norm's eps. Not the export's dtype, the device, the load mode or the budget's spelling: the step builds
        every layer in float64 on the CPU from the plan and rank, so those would only split its cache."""
        drop = ("kv_cache_ratio", "qk_rope_dim", "kv_lora_rank", "cal_dataset", "dtype", "device", "load")
        return {k: v for k, v in self.normalized().model_dump().items() if k not in drop}

    def used(self) -> dict:
        """The options this method actually uses (tracking): no fields the method ignores, no unset shorthands."""
        n = self.normalized().model_dump()
        if self.method == "mha2mla":
            for k in ("freqfold", "balance_kv", "pca", "attention_aware", "calibration", "refit", "rorope_metric", "lossless"):
                n.pop(k)
        return {k: v for k, v in n.items() if v is not None}


class FinetuneConfig(Options):
    """What defines a fine-tune run (CPU-sized defaults: 30 steps of 8 x 512 tokens)."""

    mode: Literal["full", "attention"] = "full"
    max_tokens: int = Field(122_880, ge=1)  # distinct training tokens: the first ceil(max_tokens / seqlen) blocks
    # passes over those blocks, reshuffled each pass (steps = ceil(epochs * max_tokens / (batch * accum * seqlen))):
    # a small budget of text seen several times, as distillation can use it (fractions allowed)
    epochs: float = Field(1.0, gt=0)
    seqlen: int = Field(512, ge=2)
    batch_size: int = Field(8, ge=1)  # per device
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)  # the paper's SmolLM setting (appendix E)
    schedule: Literal["constant", "cosine"] = "constant"  # both with linear warmup
    warmup_ratio: float = Field(0.08, ge=0, lt=1)  # the paper's 87.5% SmolLM setting
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # learning rate of the MLA projections (the weights the conversion rewrote) as a multiple of lr; the
    # rest of the model (MLPs, embeddings, norms: the original's own weights) keeps lr
    attention_lr_scale: float = Field(1.0, gt=0)
    val_tokens: int = Field(16_384, ge=1)  # held-out blocks for the validation loss
    eval_every: int = Field(10, ge=1)  # steps between validation losses (and resumable checkpoints)
    log_every: int = Field(5, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = mixed precision; float16 underflows the latent
    device: str = "cpu"
    seed: int = Field(0, ge=0, lt=2**32)
    # lm: next-token cross-entropy; kd: KL from the original model's next-token distribution; kd+lm: both
    objective: Literal["lm", "kd", "kd+lm"] = "lm"
    kd_temperature: float = Field(1.0, gt=0)  # softens both distributions; the loss is scaled by tau^2
    kd_weight: float = Field(1.0, ge=0)  # kd+lm = kd_weight * kd + lm
    # + attn_weight * per-layer attention matching (the converted layer's attention output vs the
    # original's on the same input, relative squared error, mean over layers); > 0 needs the teacher
    attn_weight: float = Field(0.0, ge=0)
    # layer-wise distillation before the end-to-end phase (training.layerwise): each converted layer's
    # attention fitted alone to the original's on the converted prefix's own stream, in order; passes
    # over the training tokens per layer (0: none; > 0 needs the teacher), its Adam lr and batch (blocks)
    layerwise_epochs: float = Field(0.0, ge=0)
    layerwise_lr: float = Field(1e-3, gt=0)
    layerwise_batch_size: int = Field(4, ge=1)
    # each layer's steps at a constant lr, or warmed up over their first tenth and decayed to zero (cosine)
    layerwise_schedule: Literal["constant", "cosine"] = "constant"
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"  # the teacher's forward (no gradients)
    loss_chunk: int = Field(1024, ge=1)  # positions per output-head chunk: logits never held for the whole batch
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward

    @field_validator("device")
    @classmethod
    def _one_trainer_device(cls, v):
        # transformers' Trainer trains on the first visible GPU (one process) or the rank's own (a distributed
        # launch), whatever index is given: cuda:N would load onto N and train on another
        if v.startswith("cuda:") and v != "cuda:0":
            raise ValueError(f"device {v}: the fine-tune trains on the first visible GPU whatever index is given; "
                             f"run with CUDA_VISIBLE_DEVICES={v[5:]} and device cuda")
        return v

    @model_validator(mode="after")
    def _settings_used(self):
        # a setting changed from its default that the run's objective never reads would be dropped without a word
        # (kd_weight with kd: the run trains on kd alone, whatever it says)
        layerwise = (self.layerwise_epochs > 0, "layerwise_epochs > 0")
        used_when = {"kd_weight": (self.objective == "kd+lm", "objective kd+lm"),
                     "kd_temperature": (self.objective != "lm", "objective kd or kd+lm"),
                     "layerwise_lr": layerwise, "layerwise_batch_size": layerwise, "layerwise_schedule": layerwise}
        for name, (used, needs) in used_when.items():
            value = getattr(self, name)
            if not used and value != type(self).model_fields[name].default:
                raise ValueError(f"{name} {value} is only read with {needs}; this run has objective "
                                 f"{self.objective}, layerwise_epochs {self.layerwise_epochs:g}: set {needs}, or "
                                 f"leave {name} at its default ({type(self).model_fields[name].default})")
        if self.objective == "kd+lm" and self.kd_weight == 0:
            raise ValueError("objective kd+lm with kd_weight 0 trains on lm alone (and loads the teacher for "
                             "nothing): use objective lm, or a kd_weight > 0")
        return self

    @property
    def needs_teacher(self) -> bool:
        return self.teacher_setting is not None

    @property
    def teacher_setting(self) -> tuple[str, object] | None:
        """The first (field, value) that distils from the original model, None when none does."""
        for name, on in (("objective", self.objective != "lm"), ("attn_weight", self.attn_weight > 0),
                         ("layerwise_epochs", self.layerwise_epochs > 0)):
            if on:
                return name, getattr(self, name)
        return None

    @property
    def max_steps(self) -> int:
        """Optimizer steps for `epochs` passes over the budget's ceil(max_tokens / seqlen) blocks. A pass is
        Trainer's pass: ceil(blocks per process / batch_size) batches, a partial last one included, in
        ceil(batches / grad_accum) steps (batch_size is per device; a distributed run, torchrun / accelerate
        launch, splits the blocks over its WORLD_SIZE processes). Counting steps from tokens instead (epochs x
        max_tokens / tokens per step) lost the partial batches' share: 5 blocks at batch 4, epochs 4 ran 14
        block-passes, not 20."""
        import math
        import os

        blocks = math.ceil(self.max_tokens / self.seqlen)
        batches = math.ceil(math.ceil(blocks / int(os.environ.get("WORLD_SIZE", "1"))) / self.batch_size)
        return max(1, math.ceil(self.epochs * math.ceil(batches / self.grad_accum)))

    def train_blocks(self, available: int) -> int:
        """Blocks the run trains on, of `available`: those holding its max_tokens distinct tokens."""
        return min(available, -(-self.max_tokens // self.seqlen))


class EvaluationOptions(Options):
    """WikiText-2 perplexity (non-overlapping windows) and the six Table-1 benchmarks (lm-eval, zero-shot)."""

    ppl_dataset: str = "wikitext2-test"
    ppl_seqlen: int = Field(2048, ge=2)
    ppl_max_tokens: int | None = Field(None, ge=2)  # None: the whole test set
    tasks: tuple[str, ...] = BENCHMARKS
    # paper: cloze MMLU + acc_norm everywhere (the paper's and MHA2MLA's); lm_eval: letter MMLU, acc for MMLU/WG
    protocol: Literal["paper", "lm_eval"] = "paper"
    limit: int | None = Field(None, ge=1)  # docs per benchmark (MMLU: in all, stratified by subject); None: every doc
    limits: dict[str, int] = {}  # benchmark -> its own number of docs (with a limit)
    # benchmark -> docs the original model (the table's reference row) scores: a superset of the shared sample,
    # so its absolute level is measured on more documents; the rows' paired differences use the shared ones
    reference_limits: dict[str, int] = {}
    batch_size: int = Field(8, ge=1)
    seed: int = Field(1234, ge=0, lt=2**32)
    # hf: lm-eval's HF model in the pipeline's process; vllm: lm-eval's own vLLM backend in the vLLM env
    # (transmla.runtime.vllm_env), which is what evaluates 7B+ models on GPUs (transmla.evaluation.benchmarks)
    backend: Literal["hf", "vllm"] = "hf"
    tensor_parallel: int = Field(1, ge=1)  # vllm: GPUs per model replica
    data_parallel: int = Field(1, ge=1)  # vllm: model replicas, each on its own GPUs (lm-eval dispatches them with Ray)
    parallelize: bool = False  # hf: split one model over all visible GPUs (lm-eval's HFLM parallelize)

    @model_validator(mode="after")
    def _backend(self):
        if self.backend == "hf" and (self.tensor_parallel > 1 or self.data_parallel > 1):
            raise ValueError("tensor_parallel / data_parallel are the vllm backend's; with backend hf use "
                             "parallelize: true to split a model over GPUs")
        if self.backend == "vllm" and self.parallelize:
            raise ValueError("parallelize is the hf backend's; the vllm backend splits a model with tensor_parallel")
        return self

    @field_validator("tasks")
    @classmethod
    def _known(cls, v):
        if not v:  # else the evaluation would fail after the perplexity run, not here
            raise ValueError(f"tasks names no benchmark; choose from {list(BENCHMARKS)}")
        bad = [t for t in v if t not in BENCHMARKS]
        if bad:
            raise ValueError(f"unknown benchmarks {bad}; choose from {list(BENCHMARKS)}")
        return v  # twice: refused as every list is (no_repeats)

    @field_validator("limits", "reference_limits")
    @classmethod
    def _limits(cls, v, info):
        bad = [t for t in v if t not in BENCHMARKS]
        if bad:
            raise ValueError(f"{info.field_name} names unknown benchmarks {bad}; choose from {list(BENCHMARKS)}")
        if any(n < 1 for n in v.values()):
            raise ValueError(f"{info.field_name} must be positive numbers of docs, got {v}")
        return v

    @model_validator(mode="after")
    def _one_window(self):
        # else refused by the perplexity run itself, after the model loaded (under dvc repro: after the conversions)
        if self.ppl_max_tokens is not None and self.ppl_max_tokens < self.ppl_seqlen:
            raise ValueError(f"ppl_max_tokens {self.ppl_max_tokens} is fewer than one ppl_seqlen window "
                             f"({self.ppl_seqlen}): raise ppl_max_tokens or lower ppl_seqlen")
        return self

    @model_validator(mode="after")
    def _reference_superset(self):
        if self.limits and self.limit is None:
            raise ValueError("limits needs a limit: with limit null every doc of every benchmark is scored and limits "
                             "would be ignored; to score all docs set limits: {} (and reference_limits: {}) too")
        if self.reference_limits and self.limit is None:
            raise ValueError("reference_limits needs a limit (with every doc scored there is no larger sample)")
        small = {t: n for t, n in self.reference_limits.items() if n < self.limits.get(t, self.limit or 0)}
        if small:
            raise ValueError(f"reference_limits {small} are smaller than the shared sample "
                             f"({ {t: self.limits.get(t, self.limit) for t in small} }): the reference must score a superset")
        return self
