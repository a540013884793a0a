"""One small registry of the data sets the pipeline uses.

Offline (default): local JSONL files under the shared data folder (`../shared/data` beside the repo,
overridable by `TRANSMLA_DATA_DIR` or an explicit `data_dir`). Online: the same data set by its hub
name, for machines that reach a hub (`source="hub"`, or `TRANSMLA_DATA_SOURCE=hub`).

On the hub a data set is read at one commit: `hub_revision` resolves it (the spec's pinned
`hub_revision`, else the repo's newest commit) and the loaders take it as `revision=`, so a pipeline
input's cache key (tasks.model.dataset_ref, which records the sha) and the rows it is computed on agree.

Rows keep the schema of the hub data set, so lm-eval task definitions and the calibration code read
either source unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from transmla.errors import TransMLAError
from transmla.io.paths import DATA_DIR_ENV, data_dir

DATA_SOURCE_ENV = "TRANSMLA_DATA_SOURCE"


@dataclass(frozen=True)
class DatasetSpec:
    """A data set: a local JSONL file (relative to the data dir) and its hub equivalent."""

    name: str
    local_file: str | None  # relative to the data dir; None: hub only
    hub_path: str
    hub_name: str | None
    hub_split: str
    text_field: str | None = "text"
    line_rows: bool = False  # rows are the lines of one running text (WikiText), not documents
    hub_revision: str | None = None  # a branch, tag or commit to pin on the hub; None: the newest commit


REGISTRY: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec("wikitext2-test", "wikitext2/test.jsonl", "wikitext", "wikitext-2-raw-v1", "test", line_rows=True),
        # Only the first ~2.9 MB of the train split exists offline; it is the calibration source.
        DatasetSpec("wikitext2-train", "wikitext2/train_partial.jsonl", "wikitext", "wikitext-2-raw-v1", "train", line_rows=True),
        DatasetSpec("c4-demo", "corpus/c4_demo.jsonl", "allenai/c4", "en", "train"),
        DatasetSpec("wiki-demo", "corpus/wiki_demo.jsonl", "wikimedia/wikipedia", "20231101.en", "train"),
        # The paper's fine-tune corpus (SmolLM pre-training mix, appendix E); hub only.
        DatasetSpec("fineweb-edu-dedup", None, "HuggingFaceTB/smollm-corpus", "fineweb-edu-dedup", "train"),
        DatasetSpec("cosmopedia-v2", None, "HuggingFaceTB/smollm-corpus", "cosmopedia-v2", "train"),
        DatasetSpec("arc_easy", "benchmarks/arc_easy_test.jsonl", "allenai/ai2_arc", "ARC-Easy", "test", None),
        DatasetSpec("arc_challenge", "benchmarks/arc_challenge_test.jsonl", "allenai/ai2_arc", "ARC-Challenge", "test", None),
        DatasetSpec("hellaswag", "benchmarks/hellaswag_validation.jsonl", "Rowan/hellaswag", None, "validation", None),
        DatasetSpec("piqa", "benchmarks/piqa_validation.jsonl", "baber/piqa", None, "validation", None),
        DatasetSpec("openbookqa", "benchmarks/openbookqa_test.jsonl", "allenai/openbookqa", "main", "test", None),
        DatasetSpec("winogrande", "benchmarks/winogrande_xl_validation.jsonl", "allenai/winogrande", "winogrande_xl", "validation", None),
        DatasetSpec("mmlu_test", "benchmarks/mmlu_test.jsonl", "cais/mmlu", "all", "test", None),
        DatasetSpec("mmlu_dev", "benchmarks/mmlu_dev.jsonl", "cais/mmlu", "all", "dev", None),
        DatasetSpec("mmlu_validation", "benchmarks/mmlu_validation.jsonl", "cais/mmlu", "all", "validation", None),
    ]
}


def spec(name: str) -> DatasetSpec:
    if name not in REGISTRY:
        raise TransMLAError(
            f"Unknown data set {name!r}.", f"use one of: {', '.join(sorted(REGISTRY))}."
        )
    return REGISTRY[name]


def text_spec(name: str, train: bool = False) -> DatasetSpec:
    """spec(name) of a data set to be read as text (calibration, perplexity, fine-tuning corpora): a benchmark's
    rows (question, choices) are refused, naming the text corpora (train: only those one may train on)."""
    s = spec(name)
    if s.text_field is None:
        texts = ", ".join(sorted(k for k, v in REGISTRY.items()
                                 if v.text_field is not None and (v.hub_split == "train" or not train)))
        raise TransMLAError(f"{name} is a benchmark (rows of questions and choices), not a text corpus.",
                            f"name a text corpus: {texts}.")
    return s


def training_spec(name: str) -> DatasetSpec:
    """text_spec(name) of a set to train on (fine-tuning corpora): an evaluation split is refused, since every
    perplexity measured on it afterwards would score the run's own training text."""
    s = text_spec(name, train=True)  # the corpora offered are the ones training_spec accepts
    if s.hub_split != "train":
        train = ", ".join(sorted(k for k, v in REGISTRY.items() if v.text_field is not None and v.hub_split == "train"))
        raise TransMLAError(f"{name} is an evaluation split ({s.hub_split}): the perplexity measured on it after "
                            "training on it would score the training text.", f"train on: {train}.")
    return s


def local_path(name: str, data_dir_override: str | os.PathLike | None = None) -> Path:
    """Absolute path of a data set's local file; a clear error if it is missing."""
    s = spec(name)
    if s.local_file is None:
        raise TransMLAError(f"Data set {name!r} has no offline copy (hub: {s.hub_path} {s.hub_name}).",
                            f"set {DATA_SOURCE_ENV}=hub on a machine with hub access, or use a local corpus.")
    root = data_dir(data_dir_override)
    path = root / s.local_file
    if not path.is_file():
        raise TransMLAError(
            f"Data file not found: {path} (data set {name!r}).",
            f"point --data-dir (or the environment variable {DATA_DIR_ENV}, or the `data_dir` param) at the folder "
            f"holding the offline data (the repository expects it at ../shared/data), "
            f"or set {DATA_SOURCE_ENV}=hub on a machine with hub access.",
        )
    return path


def _source(source: str | None) -> str:
    source = source or os.environ.get(DATA_SOURCE_ENV, "local")
    if source not in ("local", "hub"):
        raise TransMLAError(f"Unknown data source {source!r}.", f"set {DATA_SOURCE_ENV} to 'local' or 'hub'.")
    return source


def _where(s: DatasetSpec) -> str:
    return f"{s.hub_path!r}" + (f" ({s.hub_name})" if s.hub_name else "") + f", split {s.hub_split!r}"


def _offline_fix(s: DatasetSpec) -> str:
    if s.local_file is None:
        return f"data set {s.name!r} has no offline copy: run on a machine with hub access"
    return f"without hub access, unset {DATA_SOURCE_ENV} to read the local files"


def hub_revision(name: str) -> str:
    """The commit sha a data set is read at on the hub: its spec's pinned `hub_revision` resolved to a
    commit, else the repo's newest commit (one API request). A hub failure is one clear error."""
    s = spec(name)
    from huggingface_hub import HfApi

    try:
        sha = HfApi().dataset_info(s.hub_path, revision=s.hub_revision).sha
    except Exception as e:  # noqa: BLE001  (offline, unreachable, missing, gated: one error naming the fix)
        from huggingface_hub.errors import RevisionNotFoundError

        from transmla.io.sources import _hub_failure

        reason, fix = _hub_failure(e)
        if isinstance(e, RevisionNotFoundError):
            reason, fix = (f"no revision {s.hub_revision!r}",
                           f"correct the hub_revision of {name!r} in transmla/io/data.py")
        raise TransMLAError(f"Could not resolve the hub data set {_where(s)} (data set {name!r}) to a commit ({reason}).",
                            f"{fix}; {_offline_fix(s)}.") from e
    if not sha:
        raise TransMLAError(f"The hub reported no commit for the data set {_where(s)} (data set {name!r}).",
                            f"retry, or pin a commit as its hub_revision in transmla/io/data.py; {_offline_fix(s)}.")
    return sha


def _hub_load_error(s: DatasetSpec, revision: str | None, e: BaseException) -> TransMLAError:
    from transmla.io.sources import _first_line

    at = f" at {revision[:12]}" if revision else ""
    return TransMLAError(
        f"Could not load the data set {s.name!r} from the hub ({_where(s)}{at}: {e.__class__.__name__}: {_first_line(e)}).",
        f"check the network (HF_ENDPOINT for a mirror), HF_TOKEN and unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE; "
        f"{_offline_fix(s)}.")


def _hub_dataset(s: DatasetSpec, revision: str | None, **kwargs):
    import datasets  # heavy; only on the online path

    try:
        return datasets.load_dataset(s.hub_path, s.hub_name, split=s.hub_split, revision=revision, **kwargs)
    except Exception as e:  # noqa: BLE001  (offline, missing, bad config: one error naming the fix)
        raise _hub_load_error(s, revision, e) from e


def check_document_limit(name: str, max_documents: int | None, source: str | None = None,
                         setting: str | None = "max_documents") -> None:
    """A document corpus on the hub (C4, Wikipedia, the SmolLM corpus: tens to hundreds of GB) is read streamed,
    up to a number of documents: refused without one, since the datasets library would download the whole split
    first. `setting`: where the caller takes that number (None: it takes none, e.g. calibration, perplexity).
    Local files and line-row sets (WikiText) are read whole."""
    s = text_spec(name)
    if _source(source) == "hub" and max_documents is None and not s.line_rows:
        fix = (f"set {setting} N (it is then streamed up to N documents; the offline demo holds a few hundred), or "
               if setting else "") + f"read the offline file ({DATA_SOURCE_ENV}=local)"
        raise TransMLAError(f"{name} on the hub is {_where(s)}: read without a document limit it would be downloaded "
                            "whole (tens to hundreds of GB).", fix + ("." if setting else ", or a path: part holding "
                                                                      "the text."))


def load_rows(name: str, data_dir_override=None, source: str | None = None, revision: str | None = None) -> list[dict]:
    """All rows of a data set, as dicts in the hub schema.

    revision: on the hub, the commit to read (a dataset ref's `revision`); None: the spec's pinned
    `hub_revision`, else the newest commit. Ignored for local files. A hub document corpus is refused
    (check_document_limit: load_documents streams it)."""
    s = spec(name)
    if _source(source) == "hub":
        if s.text_field is not None:
            check_document_limit(name, None, source, setting=None)
        revision = revision or s.hub_revision
        return [dict(r) for r in _hub_dataset(s, revision)]
    path = local_path(name, data_dir_override)
    rows = read_jsonl(path, field=s.text_field)
    if not rows:  # an emptied file would score no document or no token, and fail far from here
        raise TransMLAError(f"Data file {path} (data set {name!r}) holds no rows.",
                            "restore it from the offline data (../shared/data), or point --data-dir "
                            f"({DATA_DIR_ENV}, the `data_dir` param) at a complete copy.")
    return rows


def read_jsonl(path: Path, field: str | None = None) -> list[dict]:
    """The rows of a JSONL file (a UTF-8 byte-order mark allowed), each a JSON object with, if `field` is given, a
    string there; a line that is not is one error naming the file and line, not a parser's traceback."""
    fix = "repair or replace the file: one JSON object per line" + (f" with a string {field!r}" if field else "") + "."
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise TransMLAError(f"{path}:{i} is not JSON ({e.msg}).", fix) from None
                if not isinstance(row, dict):
                    raise TransMLAError(f"{path}:{i} is not a JSON object.", fix)
                if field is not None and not isinstance(row.get(field), str):
                    raise TransMLAError(f"{path}:{i} has no string {field!r} field.", fix)
                rows.append(row)
    except UnicodeDecodeError as e:
        raise TransMLAError(f"{path} is not UTF-8 text (byte {e.start} of a line).", fix) from None
    return rows


def load_texts(name: str, data_dir_override=None, source: str | None = None, revision: str | None = None) -> list[str]:
    """The `text` field of every row (blank rows kept, as WikiText-2 perplexity expects)."""
    s = text_spec(name)
    return [r[s.text_field] for r in load_rows(name, data_dir_override, source, revision)]


def load_documents(name: str, data_dir_override=None, source: str | None = None,
                   max_documents: int | None = None, revision: str | None = None) -> list[str]:
    """A text data set as documents: each non-blank row, or for line-row sets (WikiText) the rows
    joined with blank lines into one running text, the way the perplexity evaluation reads them.

    `max_documents` takes the first N documents; on the hub path the data set is then streamed, so a
    corpus like C4 is never downloaded whole. `revision`: as for load_rows.
    """
    s = spec(name)
    check_document_limit(name, max_documents, source)
    if _source(source) == "hub" and max_documents is not None:
        revision = revision or s.hub_revision
        ds = _hub_dataset(s, revision, streaming=True)
        try:  # a streamed set is read here: its network errors surface while iterating
            rows = list(ds if s.line_rows else ds.take(max_documents))
        except Exception as e:  # noqa: BLE001
            raise _hub_load_error(s, revision, e) from e
        texts = [r[s.text_field] for r in rows]
    else:
        texts = load_texts(name, data_dir_override, source, revision)
    docs = ["\n\n".join(texts)] if s.line_rows else [t for t in texts if t.strip()]
    return docs if max_documents is None else docs[:max_documents]


# Calibration corpora beyond the registry: a model should be calibrated on text like its use (a code
# model on code). `cal_dataset` is one part or several joined by '+', each a registry name or
# `path:FILE_OR_DIR`; every part gets an equal share of the calibration windows.
PATH_PREFIX = "path:"
TEXT_SUFFIXES = frozenset(
    ".py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .kt .scala .js .ts .tsx .jsx .rb .php .cs .swift .m .sh .sql "
    ".lua .r .jl .hs .ml .ex .md .rst .txt .tex .html .css .toml .yaml .yml .json".split()
)
MAX_PATH_CHARS = 4_000_000  # a directory is read in sorted order up to this many characters (WikiText-2 train: 2.9 MB)


def split_calibration(name: str) -> list[str]:
    """The parts of a calibration data spec, unchecked: '+' separates them, except inside a path: part, where
    a '+' followed by neither a registry name nor path: belongs to the path (a folder named c++src)."""
    parts: list[str] = []
    for piece in name.split("+"):
        new = piece.strip() in REGISTRY or piece.strip().startswith(PATH_PREFIX)
        if parts and not new and parts[-1].startswith(PATH_PREFIX):
            parts[-1] += "+" + piece
        else:
            parts.append(piece)
    return [p.strip() for p in parts]


def check_calibration_apart(cal_dataset: str, ppl_dataset: str, setting: str, data_dir_override=None) -> None:
    """Refuse a calibration mix that includes the set perplexity is measured on: the conversion would be fitted
    on the very text it is then scored on. By name, and by content for `path:` parts (a copy of the set's file,
    or the file itself: paragraphs of the set verbatim in the part), where the set's local file is here."""
    parts = split_calibration(cal_dataset)
    fix = "calibrate on wikitext2-train (the default), another corpus or a path: part without that text."
    if ppl_dataset in parts:
        raise TransMLAError(f"{setting} {cal_dataset!r} includes {ppl_dataset}, the set perplexity is measured on: "
                            "the conversion would be fitted on the text it is scored on.", fix)
    paths = [p for p in parts if p.startswith(PATH_PREFIX) and _path_of(p).exists()]
    if not paths:
        return
    try:
        local_path(ppl_dataset, data_dir_override)
    except TransMLAError:
        return  # the set is not here to compare with (the evaluation that reads it says so)
    scored = _long_lines(load_texts(ppl_dataset, data_dir_override, "local"))
    for p in paths:
        hits = len(scored & _long_lines(path_texts(p)))
        if hits:
            raise TransMLAError(f"{setting} part {p!r} holds text of {ppl_dataset}, the set perplexity is measured on "
                                f"({hits} of its {len(scored)} lines of 200+ characters verbatim): the conversion "
                                "would be fitted on the text it is scored on.", fix)


def _long_lines(texts: list[str], min_chars: int = 200) -> set[str]:
    """The lines of at least `min_chars` characters of some texts, stripped: a copy of a set, whole or any part of
    it, as rows or as plain text, shares them; text from other documents shares none (such a line is not repeated
    by chance)."""
    return {s for t in texts for line in t.split("\n") if len(s := line.strip()) >= min_chars}


def calibration_parts(name: str) -> list[str]:
    """The parts of a calibration data spec ('wikitext2-train+path:/src/repo'); a clear error if one is bad."""
    parts = split_calibration(name)
    for p in parts:
        if p.startswith(PATH_PREFIX):
            if not _path_of(p).exists():
                raise TransMLAError(f"Calibration path not found: {p.removeprefix(PATH_PREFIX)!r} (in {name!r}).",
                                    "point path: at an existing .jsonl or text file, or a directory of them ('+' "
                                    "between parts: name+path:FILE).")
        else:
            text_spec(p)  # unknown names (listing the registry) and benchmarks fail here
    return parts


def check_calibration_files(name: str, data_dir_override=None, source: str | None = None) -> None:
    """Every part of a calibration spec is there to read: registry names known (and, offline, their local
    files present), path: parts existing. Cheap; run before any model is loaded."""
    for p in calibration_parts(name):
        if not p.startswith(PATH_PREFIX):
            if _source(source) == "local":
                local_path(p, data_dir_override)
        elif not any(t.strip() for t in path_texts(p)):  # read (at most MAX_PATH_CHARS): an empty file, a bad row
            raise TransMLAError(f"Calibration path {p.removeprefix(PATH_PREFIX)!r} holds no text (in {name!r}).",
                                "point path: at a file or directory with the text to calibrate on.")


def _path_of(part: str) -> Path:
    return Path(part.removeprefix(PATH_PREFIX)).expanduser()


def path_texts(part: str) -> list[str]:
    """The texts of one `path:` part of a calibration spec, as calibration reads them."""
    return _path_texts(_path_of(part))


def _path_texts(path: Path) -> list[str]:
    if path.is_file():
        return _file_texts(path)
    texts, total = [], 0
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                    and not any(part.startswith(".") for part in p.relative_to(path).parts)):
        if total >= MAX_PATH_CHARS:
            break
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
    if not texts:
        raise TransMLAError(f"No text files under {path} (suffixes: {', '.join(sorted(TEXT_SUFFIXES))}).",
                            "point path: at a directory of source or text files, or at one file.")
    return texts


def _file_texts(path: Path) -> list[str]:
    """A JSONL file's rows' 'text' fields; any other file whole, as text (a directory's .jsonl files are not read:
    in a source tree they are data, not its text)."""
    if path.suffix.lower() == ".jsonl":
        return [r["text"] for r in read_jsonl(path, field="text")]
    return [path.read_text(encoding="utf-8", errors="replace")]


def calibration_corpora(name: str, data_dir_override=None, source: str | None = None,
                        revisions: dict[str, str] | None = None) -> list[list[str]]:
    """The texts of every part of a calibration data spec, in order. revisions: registry part -> hub
    commit to read it at (as for load_rows; a part not named: its pinned or newest commit)."""
    revisions = revisions or {}
    return [path_texts(p) if p.startswith(PATH_PREFIX)
            else load_texts(p, data_dir_override, source, revisions.get(p))
            for p in calibration_parts(name)]
