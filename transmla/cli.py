"""The `transmla` console command.

Subcommands print one JSON object on stdout (machine-readable), progress and logs on stderr.
User errors print one line `transmla: error: ... Fix: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from transmla.config import (PAPER_TRANSMLA, FINETUNE_CORPORA, FREQFOLDS, METHODS, ConvertOptions, EvaluationOptions,
                             FinetuneConfig, repeated)
from transmla.devices import check_device, rank_device
from transmla.errors import TransMLAError
from transmla.io.paths import write_text_atomic
from transmla.io.sources import DEFAULT_SOURCE, SYNTAX_HELP

SOURCE_HELP = f"model source (default {DEFAULT_SOURCE}); {SYNTAX_HELP}"
CO, EV = ConvertOptions.model_fields, EvaluationOptions.model_fields
FINETUNE_HELP = {
    "mode": "full: every weight; attention: only the MLA projections",
    "max_tokens": "distinct training tokens (the first blocks of the seeded order)",
    "epochs": "passes over the --max-tokens training tokens, reshuffled each pass (fractions allowed)",
    "schedule": "learning-rate schedule, with linear warmup",
    "attention_lr_scale": "learning rate of the MLA projections as a multiple of --lr (the rest keeps --lr)",
    "val_tokens": "held-out tokens for the validation loss",
    "eval_every": "steps between validation losses and resumable checkpoints",
    "dtype": "bfloat16 = mixed precision",
    "objective": "lm: next-token cross-entropy; kd: distil from --teacher (KL of its next-token distribution); kd+lm: both",
    "kd_temperature": "softmax temperature of the KL (the loss is scaled by its square)",
    "kd_weight": "weight of kd in kd+lm",
    "attn_weight": "add this times per-layer attention matching (each converted layer's attention output vs the "
                   "original's on the same input; needs --teacher)",
    "layerwise_epochs": "layer-wise distillation before the end-to-end phase: passes over the training tokens per "
                        "layer, fitting each converted layer's attention to the original's (0: none; needs --teacher)",
    "layerwise_lr": "Adam learning rate of the layer-wise distillation",
    "layerwise_batch_size": "blocks per step of the layer-wise distillation",
    "layerwise_schedule": "lr schedule of each layer's steps in the layer-wise distillation (cosine: a tenth "
                          "warmup, then a half cosine to zero)",
    "teacher_dtype": "dtype of the teacher's forward (no gradients)",
    "loss_chunk": "positions per output-head chunk of the loss (logits never held for the whole batch)",
    "gradient_checkpointing": "recompute each decoder layer in backward (less memory, ~30%% more time)",
}


def _flag_bool(v: str) -> bool:
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def _offline_defaults() -> None:
    # This project's default sources are all local; never let a library wander to a hub unasked.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_fetch_model(args) -> dict:
    from transmla.io.paths import check_output
    from transmla.io.sources import fetch_model

    check_output(args.out)  # before a download or dequantisation, not after it
    return fetch_model(args.source, args.out, cache=args.cache_dir)


def cmd_ppl(args) -> dict:
    from transmla.evaluation.perplexity import check_windows, wikitext2_perplexity
    from transmla.io.data import load_texts
    from transmla.io.paths import check_output
    from transmla.io.sources import load_model, source_info

    # refused before the model is materialised or loaded: main() writes --out after the whole evaluation
    check_windows(args.seqlen, args.max_tokens)
    if args.out is not None:  # "" too: refused as empty, not taken for "no file"
        check_output(args.out, "file")
    texts = load_texts("wikitext2-test", args.data_dir)  # a missing or broken data file, too
    info = source_info(args.model, cache=args.cache_dir)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, cache=args.cache_dir)
    out = wikitext2_perplexity(model, tok, seqlen=args.seqlen, max_tokens=args.max_tokens, texts=texts)
    out["model"] = args.model
    out["content_hash"] = info.get("content_hash")
    return out


def cmd_convert(args) -> dict:
    from transmla.convert import convert, plan_conversion, precheck
    from transmla.io.data import check_calibration_apart
    from transmla.pipeline.plan import format_plan

    # `transmla ppl` (and the pipeline) measure WikiText-2 test: a conversion fitted on it would be scored on it
    check_calibration_apart(args.cal_dataset, EV["ppl_dataset"].default, "--cal-dataset", args.data_dir)
    if args.dry_run:  # refuses what the run would refuse before its work, then plans from the config
        precheck(args.model, args.out, convert_options(args), cache=args.cache_dir, data_dir=args.data_dir,
                 weights=False)
        plan = plan_conversion(args.model, convert_options(args), cache=args.cache_dir)
        print(format_plan(plan), file=sys.stderr)
        return plan.to_dict()
    meta = convert(args.model, args.out, convert_options(args), cache=args.cache_dir, data_dir=args.data_dir)
    keys = ("method", "source", "qk_rope_head_dim", "kv_lora_rank", "kv_cache_ratio", "kv_cache_reduction",
            "mean_alpha", "calibration_seconds", "compute_seconds", "compute_cpu_seconds", "seconds", "peak_rss_gib",
            "calibration_data_peak_rss_gib", "conversion_peak_rss_gib", "notes")
    return {"out": str(args.out), **{k: meta[k] for k in keys}}


def _as_flag(e: TransMLAError, command: str, flags: dict[str, str] | None = None, fields=()) -> TransMLAError:
    """An options model's error (config.options_error: "FinetuneConfig: val_tokens: ...") in the command line's
    terms: the flag that sets the field and the command's help. flags: field -> flag where they are not named alike.
    fields: the model's field names, which a check across fields names in its message (kd_weight -> --kd-weight;
    names with an underscore only, and `objective`: plain words such as `mode` or `lr` stay prose)."""
    import re

    field = getattr(e, "field", None)
    if field is None:  # a check across fields: its message names them, as flags where they are known
        named = sorted((f for f in fields if "_" in f or f == "objective"), key=len, reverse=True)
        if not named:
            return e
        text = re.sub(r"\b(" + "|".join(named) + r")\b", lambda m: (flags or {}).get(m[1], "--" + m[1].replace("_", "-")),
                      e.problem.split(": ", 1)[-1])
        return TransMLAError(text, f"change one of the flags it names (see `transmla {command} --help`).")
    flag = (flags or {}).get(field, "--" + field.replace("_", "-"))
    return TransMLAError(f"{flag}: {e.reason}", f"pass a valid {flag} (see `transmla {command} --help`).")


def convert_options(args) -> ConvertOptions:
    """The options of `transmla convert`: --paper sets the paper's modes, explicit mode flags win. A flag the
    method drops is refused where it is told apart from its default (--freqfold 1, what both use, passes)."""
    if args.method == "mha2mla":  # its steps are fixed: these flags were dropped without a word
        given = [flag for flag, on in (
            ("--freqfold", args.freqfold not in (CO["freqfold"].default, 1)), ("--no-balance-kv", args.no_balance_kv),
            ("--[no-]attention-aware", args.attention_aware is not None), ("--pca", args.pca != CO["pca"].default),
            ("--calibration", args.calibration is not None), ("--[no-]refit", args.refit is not None),
            ("--rorope-metric", args.rorope_metric is not None), ("--paper", args.paper)) if on]
        if given:
            raise TransMLAError(f"--method mha2mla takes no {', '.join(given)}: the baseline's steps are fixed "
                                "(2-norm RoPE selection, joint SVD of the weights).",
                                "drop them, or convert with --method transmla.")
    if args.lossless:  # exact by construction (ConvertOptions.normalized): these were dropped without a word too
        given = [flag for flag, on in (
            ("--freqfold", args.freqfold not in (CO["freqfold"].default, 1)), ("--calibration", args.calibration is not None),
            ("--[no-]refit", args.refit is not None), ("--rorope-metric", args.rorope_metric is not None),
            ("--paper", args.paper)) if on]
        if given:
            raise TransMLAError(f"--lossless takes no {', '.join(given)}: it keeps every RoPE frequency and the full "
                                "rank from the original's statistics, with nothing to fold, refit or rank.",
                                "drop them, or drop --lossless for a compressed conversion.")
    base = PAPER_TRANSMLA if args.paper else {k: ConvertOptions.model_fields[k].default for k in PAPER_TRANSMLA}
    mode = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.items()}  # args stay as given
    try:
        return _convert_options(args, mode)
    except TransMLAError as e:
        raise _as_flag(e, "convert", {"balance_kv": "--no-balance-kv"}) from None


def _convert_options(args, mode: dict) -> ConvertOptions:
    return ConvertOptions(
        method=args.method, kv_cache_ratio=args.kv_cache_ratio, qk_rope_dim=args.qk_rope_dim,
        kv_lora_rank=args.kv_lora_rank, freqfold=args.freqfold, q_lora_rank=args.q_lora_rank,
        balance_kv=not args.no_balance_kv, pca=args.pca, lossless=args.lossless, **mode,
        cal_dataset=args.cal_dataset, cal_nsamples=args.cal_nsamples, cal_seqlen=args.cal_seqlen, seed=args.seed,
        cal_batch_size=args.cal_batch_size,
        dtype=args.dtype, device=args.device, latent_norm_eps=args.latent_norm_eps, load=args.load,
    )


def _bench_counts(flag: str, field: str, text: str, fix: str, **options) -> dict[str, int]:
    """A BENCHMARK=N[,BENCHMARK=N] flag for EvaluationOptions' `field`, validated as the params are (`options`:
    the other fields the check needs); one error naming the flag and its form otherwise."""
    try:
        pairs = [(k.strip(), int(v)) for k, v in (x.split("=") for x in text.split(",") if x.strip())]
        counts = dict(pairs)
        if len(counts) < len(pairs):  # the last one won without a word
            raise TransMLAError(f"{flag} {text!r} names a benchmark more than once.", fix)
        EvaluationOptions(**options, **{field: counts})
    except TransMLAError as e:
        raise TransMLAError(f"{flag} {text!r}: {e.problem}", fix) from None
    except ValueError as e:
        raise TransMLAError(f"{flag} {text!r}: {e}", fix) from None
    return counts


def _batch_size(text: str) -> int | str:
    """--batch-size: a positive integer, or lm-eval's auto / auto:N (passed on as it is)."""
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit() and int(text[5:]) >= 1):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise TransMLAError(f"--batch-size {text!r} is not a positive integer, auto or auto:N.",
                            "pass --batch-size N with N >= 1 (e.g. 8), --batch-size auto, or auto:N (N >= 1).")
    return n


def cmd_eval(args) -> dict:
    from transmla.evaluation.benchmarks import check_evaluation, evaluate
    from transmla.io.sources import materialize

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = args.limit  # None: every doc; 0 or less is refused by check_evaluation (it is not "all")
    batch_size = _batch_size(args.batch_size)
    if not 0 <= args.seed < 2**32:  # numpy's range: refused before the model loads, not by numpy after
        raise TransMLAError(f"--seed {args.seed} is out of range.", f"pass a seed in [0, {2**32 - 1}].")
    # evaluate() checks the same, but only once materialize() has run: a GGUF source would be dequantised
    # first. --limit goes before --superset, whose check reads it (a bad --limit would be blamed on it).
    check_evaluation(tasks, limit, args.num_fewshot, args.protocol, args.backend, args.tensor_parallel,
                     args.data_parallel, args.parallelize, args.out)
    # its form and names checked beside any limit (limit or 1); a --limits without --limit is refused apart
    limits = _bench_counts("--limits", "limits", args.limits or "", "write it as BENCHMARK=N[,BENCHMARK=N], e.g. mmlu=400.",
                           limit=limit or 1)
    if limits and limit is None:
        raise TransMLAError("--limits needs --limit: without it every document of every benchmark is scored.",
                            "pass --limit N too (the docs of each benchmark --limits does not name), or drop --limits.")
    superset = _bench_counts("--superset", "reference_limits", args.superset or "",
                             "write it as BENCHMARK=N[,BENCHMARK=N] with N at least the sample's own size, "
                             "e.g. mmlu=1000 with --limit 146.", limit=limit, limits=limits)
    for flag, counts in (("--limits", limits), ("--superset", superset)):
        extra = [t for t in counts if t not in tasks]
        if extra:  # ignored, yet recorded in results.json as if used (a profile's limits may name more: -S tasks)
            raise TransMLAError(f"{flag} names {', '.join(extra)}, which --tasks {','.join(tasks)} does not run.",
                                f"add {', '.join(extra)} to --tasks, or drop {'them' if len(extra) > 1 else 'it'} "
                                f"from {flag}.")
    return evaluate(materialize(args.model, args.cache_dir), tasks=tasks, limit=limit, num_fewshot=args.num_fewshot,
                    batch_size=batch_size, seed=args.seed, dtype=args.dtype, device=args.device,
                    out_dir=args.out, data_dir=args.data_dir, protocol=args.protocol, limits=limits,
                    backend=args.backend, tensor_parallel=args.tensor_parallel, data_parallel=args.data_parallel,
                    parallelize=args.parallelize, superset=superset or None)


def _check_corpora(names: list[str], data_dir, max_documents: int | None = None) -> None:
    """--corpora: known text corpora with their offline files present (hub: read with a document limit), checked
    before the model loads."""
    from transmla.io.data import DATA_SOURCE_ENV, check_document_limit, local_path, training_spec

    if not names:
        raise TransMLAError("--corpora names no data set.", f"pass e.g. --corpora {','.join(FINETUNE_CORPORA)}.")
    if repeated(names):  # its documents were packed twice: the same articles in training and validation blocks
        raise TransMLAError(f"--corpora names {repeated(names)} more than once.", "name each corpus once.")
    if max_documents is not None and max_documents < 1:
        raise TransMLAError(f"--max-documents {max_documents} is not a positive number of documents.",
                            "pass --max-documents N with N >= 1, or leave it out to read every document.")
    for n in names:
        try:
            training_spec(n)
            check_document_limit(n, max_documents, setting="--max-documents")
            if os.environ.get(DATA_SOURCE_ENV, "local") == "local":  # the hub path is only reachable by loading
                local_path(n, data_dir)
        except TransMLAError as e:
            raise TransMLAError(f"--corpora {n}: {e.problem}", e.fix) from None


def finetune_config(args) -> FinetuneConfig:
    """The FinetuneConfig of `transmla finetune`'s flags; a bad value is one error naming its flag."""
    try:
        return FinetuneConfig(**{k: getattr(args, k) for k in FinetuneConfig.model_fields})
    except TransMLAError as e:
        raise _as_flag(e, "finetune", fields=FinetuneConfig.model_fields) from None


def cmd_finetune(args) -> dict:
    from pathlib import Path

    from transmla.io.data import load_documents
    from transmla.io.paths import check_output
    from transmla.training.finetune import (check_mla_type, check_teacher_config,
                                            check_teacher_is_not_student, check_teacher_tokenizer,
                                            check_training_blocks, finetune_on_corpora, pack_corpus)
    from transmla.io.sources import load_model, load_tokenizer, source_config
    from transmla.runtime.memory import peak_rss_bytes

    cfg = finetune_config(args)
    if cfg.needs_teacher and not args.teacher:
        name, value = cfg.teacher_setting
        shown = value if isinstance(value, str) else f"{value:g}"
        raise TransMLAError(f"--{name.replace('_', '-')} {shown} distils from the original model.",
                            "pass --teacher SOURCE (the model you converted), or use --objective lm --attn-weight 0 "
                            "--layerwise-epochs 0.")
    if not args.teacher and cfg.teacher_dtype != FinetuneConfig.model_fields["teacher_dtype"].default:
        raise TransMLAError(f"--teacher-dtype {cfg.teacher_dtype} without --teacher: there is no teacher to run in it.",
                            "pass --teacher SOURCE, or drop --teacher-dtype.")
    out = check_output(args.out)  # fail before hours of training, not after
    work = Path(args.work_dir) if args.work_dir else out.with_name(f".{out.name}.trainer")
    if not args.work_dir and (work.is_file() or work.is_symlink() and not work.is_dir()):  # mkdir failed after loading
        raise TransMLAError(f"The fine-tune's work folder {work} (the default beside --out) is a file.",
                            "remove it, or pass --work-dir DIR (a folder outside --out).")
    if args.work_dir:  # it may exist: a rerun resumes from its checkpoints
        check_output(work, "dir", "--work-dir")
        work = work.resolve()
        if work == out or out in work.parents:  # the model is written over --out as a whole, at the end
            raise TransMLAError(f"--work-dir {work} is --out or inside it.",
                                "give --work-dir a folder outside --out (the default is a hidden sibling of --out).")
        from transmla.training.finetune import check_work_dir

        check_work_dir(work)  # before any weight loads
    names = [c.strip() for c in args.corpora.split(",") if c.strip()]
    _check_corpora(names, args.data_dir, args.max_documents)
    student = source_config(args.model, args.cache_dir)  # configs, not weights: checked before any loads
    check_mla_type(student.get("model_type"))
    if args.teacher:
        check_teacher_config(student, source_config(args.teacher, args.cache_dir), cfg)
    # the corpora are read and split before any weights load: a --val-tokens or --seqlen the corpora cannot
    # satisfy is refused in seconds, named as the flag
    docs = {n: load_documents(n, data_dir_override=args.data_dir, max_documents=args.max_documents) for n in names}
    flag = lambda field: "--" + field.replace("_", "-")  # noqa: E731
    student_tok = load_tokenizer(args.model, args.cache_dir)
    if args.teacher:  # tokenizers and folders, still before any weights load
        check_teacher_tokenizer(student_tok, load_tokenizer(args.teacher, args.cache_dir))
        check_teacher_is_not_student(args.model, args.teacher)
    packed = pack_corpus(student_tok, docs, cfg.seqlen, cfg.val_tokens, cfg.seed, setting=flag)
    check_training_blocks(len(packed[0]), cfg, setting=flag)
    device = rank_device(args.device)  # one process of a distributed launch: its own GPU
    model, tok = load_model(args.model, dtype="float32", device=device, cache=args.cache_dir)
    teacher = None  # with --objective lm a teacher only scores: the validation KL, for comparing objectives
    if args.teacher:
        teacher = load_model(args.teacher, dtype=cfg.teacher_dtype, device=device, cache=args.cache_dir)[0]
    with contextlib.redirect_stdout(sys.stderr):  # Trainer prints its logs; stdout stays the result's JSON
        record = finetune_on_corpora(model, tok, docs, cfg, work, out, teacher=teacher, packed=packed)
    keys = ("objective", "val_loss_before", "val_loss_after", "val_kd_before", "val_kd_after", "val_attn_before",
            "val_attn_after", "train_loss", "steps",
            "tokens_trained", "resumed_from", "seconds_this_run", "tokens_per_second", "params", "layerwise")
    return {"out": str(out), **{k: record[k] for k in keys}, "peak_rss_gib": round(peak_rss_bytes() / 2**30, 3)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transmla",
        description="Convert GQA models to DeepSeek-style multi-head latent attention (TransMLA).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=None, help="model cache (default $TRANSMLA_CACHE_DIR or ~/.cache/transmla)")
    common.add_argument("--data-dir", default=None, help="offline data folder (default $TRANSMLA_DATA_DIR or ../shared/data)")

    f = sub.add_parser("fetch-model", parents=[common], help="materialise a model source as a safetensors HF directory",
                       description="Write a model source as a plain safetensors Hugging Face directory.")
    f.add_argument("source", nargs="?", default=DEFAULT_SOURCE, help=SOURCE_HELP)
    f.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    f.set_defaults(func=cmd_fetch_model)

    q = sub.add_parser("ppl", parents=[common], help="WikiText-2 test perplexity",
                       description="WikiText-2 test perplexity: rows joined with blank lines, tokenised once, "
                                   "non-overlapping windows, mean NLL over all predicted tokens.")
    q.add_argument("--model", default=DEFAULT_SOURCE, help=SOURCE_HELP)
    q.add_argument("--seqlen", type=int, default=EV["ppl_seqlen"].default, help="window length in tokens")
    q.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")
    q.add_argument("--device", default="cpu", help="torch device (default cpu)")
    q.add_argument("--out", default=None, help="also write the JSON result to this file (atomically)")
    q.set_defaults(func=cmd_ppl)

    c = sub.add_parser("convert", parents=[common], help="convert a GQA model to DeepSeek-V3 MLA",
                       description="Convert a GQA model (Llama, Qwen2, Mistral, SmolLM) into a stock DeepSeek-V3 "
                                   "MLA checkpoint: merge KV heads, RoRoPE + FreqFold, BKV joint PCA.")
    c.add_argument("--model", default=DEFAULT_SOURCE, help=SOURCE_HELP)
    c.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    c.add_argument("--method", default=CO["method"].default, choices=METHODS, help="transmla (default) or the MHA2MLA baseline")
    c.add_argument("--kv-cache-ratio", type=float, default=None,
                   help="target fraction of the original per-token KV cache (e.g. 0.125 = 87.5%% cut); picks rope dim and rank")
    c.add_argument("--qk-rope-dim", type=int, default=None, help="RoPE dims kept (qk_rope_head_dim; must divide head dim)")
    c.add_argument("--kv-lora-rank", type=int, default=None, help="latent rank of the compressed KV")
    c.add_argument("--freqfold", type=int, default=CO["freqfold"].default, choices=FREQFOLDS,
                   help=f"adjacent frequencies per RoRoPE PCA (default {CO['freqfold'].default})")
    c.add_argument("--q-lora-rank", type=int, default=None, help="low-rank queries from PCA of query activations")
    c.add_argument("--no-balance-kv", action="store_true", help="ablation: skip the key/value norm balancing")
    c.add_argument("--attention-aware", action=argparse.BooleanOptionalAction, default=None,
                   help="extension: joint PCA weighted by query and o_proj metrics (what attention actually uses)")
    c.add_argument("--pca", default=CO["pca"].default, choices=["activations", "weights"], help="joint KV PCA basis source")
    c.add_argument("--calibration", default=None, choices=["parallel", "two_pass", "sequential"],
                   help="statistics of the original model (parallel, the paper), recomputed with RoPE dropped "
                        "(two_pass, the authors' code) or layer by layer on the converted model (sequential, default)")
    c.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="extension: least-squares refit of the value up-projections to the original layers' outputs")
    c.add_argument("--rorope-metric", default=None, choices=["key", "query"],
                   help="rank RoRoPE components by key energy (key, the paper) or by the score energy the queries "
                        "read (query, default: better for models with few KV heads, e.g. Qwen2.5-0.5B)")
    c.add_argument("--paper", action="store_true",
                   help="the paper's TransMLA: --calibration parallel --no-refit --no-attention-aware --rorope-metric key unless "
                        "given explicitly (ablations: --paper --refit)")
    c.add_argument("--lossless", action="store_true", help="keep RoPE on all g*d key dims, no rank cut (exact)")
    c.add_argument("--cal-dataset", default=CO["cal_dataset"].default,
                   help="calibration text: a data set name, path:FILE_OR_DIR (a .jsonl with 'text', a text file, or a "
                        "directory of source/text files), or several joined by '+' sharing the windows equally "
                        "(a code model: wikitext2-train+path:/some/repo)")
    c.add_argument("--cal-nsamples", type=int, default=CO["cal_nsamples"].default, help="calibration sequences")
    c.add_argument("--cal-seqlen", type=int, default=CO["cal_seqlen"].default, help="tokens per calibration sequence")
    c.add_argument("--seed", type=int, default=CO["seed"].default, help="calibration sampling seed")
    c.add_argument("--cal-batch-size", type=int, default=CO["cal_batch_size"].default,
                   help="calibration windows per forward: smaller holds fewer activations at once (peak memory), "
                        "same statistics up to float rounding")
    c.add_argument("--dtype", default=CO["dtype"].default, help="exported weight dtype: float32 or bfloat16 (float16 is refused)")
    c.add_argument("--device", default=CO["device"].default, help="torch device for calibration")
    c.add_argument("--load", default=CO["load"].default, choices=["model", "layers"],
                   help="model: the whole source in memory; layers: one decoder layer at a time from its safetensors "
                        "(peak memory independent of depth; same result)")
    c.add_argument("--dry-run", action="store_true",
                   help="print the plan (shapes, KV cache, peak memory of both load modes, time estimate) from the "
                        "config alone, without reading any weight")
    c.add_argument("--latent-norm-eps", type=float, default=None,
                   help="eps of the target runtime's kv_a_layernorm (default 1e-6, transformers' fixed value; "
                        "vLLM uses config.rms_norm_eps)")
    c.set_defaults(func=cmd_convert)

    t = sub.add_parser("finetune", parents=[common], help="recovery fine-tune of a converted model (Trainer)",
                       description="Causal-LM fine-tune of a converted (stock DeepseekV3) checkpoint on packed text "
                                   "corpora with a held-out validation split; writes a stock checkpoint. Running the "
                                   "same command again after an interruption resumes from the last checkpoint.")
    t.add_argument("--model", required=True, help="converted model directory (transmla convert --out)")
    t.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    t.add_argument("--corpora", default=",".join(FINETUNE_CORPORA), help="comma list of data sets")
    for name, field in FinetuneConfig.model_fields.items():  # one flag per config field, same defaults
        choices = getattr(field.annotation, "__args__", None) if "Literal" in str(field.annotation) else None
        kind = type(field.default) if field.default is not None else str
        kind = _flag_bool if kind is bool else kind
        t.add_argument("--" + name.replace("_", "-"), type=kind, default=field.default, choices=choices,
                       help=FINETUNE_HELP.get(name, "") + f" (default {field.default})")
    t.add_argument("--teacher", default=None,
                   help="the original model (any source `transmla convert` takes): the kd objectives distil from it; "
                        "with --objective lm it only scores the validation KL")
    t.add_argument("--work-dir", default=None, help="Trainer checkpoints (default: .<out>.trainer beside --out)")
    t.add_argument("--max-documents", type=int, default=None,
                   help="the first N documents of each corpus (default: all); needed for a document corpus read "
                        "from the hub (TRANSMLA_DATA_SOURCE=hub), which is then streamed up to N")
    t.set_defaults(func=cmd_finetune)

    e = sub.add_parser("eval", parents=[common], help="six-benchmark evaluation with lm-eval (offline)",
                       description="Zero-shot MMLU, ARC-Easy, ARC-Challenge, PIQA, HellaSwag, OpenBookQA and "
                                   "WinoGrande with lm-evaluation-harness on the local data files. The paper's "
                                   "ARC column is the mean of ARC-Easy and ARC-Challenge (arc_mean).")
    e.add_argument("--model", default=DEFAULT_SOURCE, help=SOURCE_HELP)
    e.add_argument("--tasks", default=",".join(EV["tasks"].default), help="comma list (default all six Table-1 benchmarks)")
    e.add_argument("--limit", type=int, default=EV["limit"].default,
                   help="docs per benchmark (MMLU: in all, stratified by subject), a seeded random subset; default: all")
    e.add_argument("--limits", default=None, help="per-benchmark docs overriding --limit, e.g. mmlu=400")
    e.add_argument("--superset", default=None,
                   help="score these benchmarks on more docs that include the --limit sample, e.g. mmlu=1000 "
                        "(a reference model: other models' paired differences to it use the shared docs)")
    e.add_argument("--protocol", default=EV["protocol"].default, choices=["paper", "lm_eval"],
                   help="paper: cloze MMLU, acc_norm on every benchmark (the paper's); lm_eval: letter MMLU, acc for MMLU/WG")
    e.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples (default 0, as in the paper)")
    e.add_argument("--batch-size", default=str(EV["batch_size"].default), help="lm-eval batch size (int or 'auto')")
    e.add_argument("--seed", type=int, default=EV["seed"].default, help="seed for sampling and lm-eval")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--device", default="cpu")
    e.add_argument("--backend", default=EV["backend"].default, choices=["hf", "vllm"],
                   help="hf: lm-eval's HF model in this process; vllm: lm-eval's vLLM backend in the vLLM env "
                        "(python -m transmla.runtime.vllm_env; MLA exports are padded for it)")
    e.add_argument("--tensor-parallel", type=int, default=EV["tensor_parallel"].default, help="vllm: GPUs per replica")
    e.add_argument("--data-parallel", type=int, default=EV["data_parallel"].default, help="vllm: model replicas (Ray)")
    e.add_argument("--parallelize", action="store_true", help="hf: split the model over all visible GPUs")
    e.add_argument("--out", default=None, help="directory for results.json and samples/<task>.jsonl")
    e.set_defaults(func=cmd_eval)
    return p


class Stopped(KeyboardInterrupt):
    """A SIGTERM / SIGHUP turned into what Ctrl-C raises, so the command unwinds the same way."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM and SIGHUP (`kill`, a closed terminal) stop the command as Ctrl-C does: by an exception, so
    atomic writes and temporary folders (a model being materialised, a checkpoint) are cleaned up on the way
    out; Python's default for them ends the process where it stands. Ignored signals stay ignored (nohup);
    outside the main thread (an embedding program) nothing is changed."""
    import signal

    def stop(signum, frame):
        raise Stopped(signum)

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        try:
            if sig is None or signal.getsignal(sig) is signal.SIG_IGN:
                continue
            previous[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread
            break
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def _no_blank_options(args) -> None:
    """An option given as "" (an unset shell variable, `--teacher "$T"`) was read as "not given" (--teacher,
    --data-dir, --cache-dir: the defaults ran without a word) or as the working directory: refused, naming it."""
    for name, value in vars(args).items():
        if isinstance(value, str) and not value.strip() and name != "command":
            flag = "--" + name.replace("_", "-") if name != "source" else "SOURCE"
            raise TransMLAError(f"{flag} is empty (an unset shell variable?).",
                                f"give {flag} a value, or leave it out for its default.")


def main(argv: list[str] | None = None) -> int:
    import signal

    _offline_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _no_blank_options(args)
        with _stop_on_signals():
            if getattr(args, "device", None) is not None:
                check_device(args.device)
            result = args.func(args)
    except TransMLAError as e:
        print(f"transmla: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or a SIGTERM / SIGHUP made one by _stop_on_signals
        signum = e.signum if isinstance(e, Stopped) else int(signal.SIGINT)
        print(f"transmla: stopped by {signal.Signals(signum).name} (temporary files removed); rerun the command to "
              "go on.", file=sys.stderr)
        return 128 + signum
    if args.command == "eval":
        result = {k: v for k, v in result.items() if k != "columns"}
    text = json.dumps(result, indent=None if args.command == "ppl" else 2)
    if getattr(args, "out", None) is not None and args.command == "ppl":
        write_text_atomic(args.out, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
