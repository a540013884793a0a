"""Bad CLI input: one `transmla: error: ... Fix: ...` line and exit 2, before any weight is loaded or
materialised, leaving nothing behind. The loaders are replaced by functions that fail the test if called."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transmla.cli import main


class WeightsTouched(AssertionError):
    pass


def _touched(*a, **k):
    raise WeightsTouched("the model's weights were read before the input was checked")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Llama (4 heads of 16, 2 KV heads, hidden 64) with weights and tokenizer."""
    from conftest import _tiny_model

    out = tmp_path_factory.mktemp("llama")
    _tiny_model("llama", len(tiny_tokenizer)).save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def no_weights(monkeypatch):
    """Every way the commands reach a model's weights (load, materialise + hash, lm-eval) fails the test."""
    import transmla.evaluation.benchmarks as benchmarks
    import transmla.io.sources as sources

    for name in ("load_model", "materialize", "source_info", "fetch_model"):
        monkeypatch.setattr(sources, name, _touched)
    monkeypatch.setattr(benchmarks, "_run_hf", _touched)


@pytest.fixture
def work(tmp_path, tmp_path_factory):
    """(folder the command may write in, common flags): the cache lives elsewhere, so the folder's listing
    before and after tells whether anything was written."""
    return tmp_path, ["--cache-dir", str(tmp_path_factory.mktemp("cache"))]


def _listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else None for p in sorted(root.rglob("*"))}


def _refused(argv, capsys, root: Path, *words) -> str:
    """Run the CLI; assert exit 2, one error line naming `words` and a fix, no stdout, nothing written."""
    before = _listing(root)
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("transmla: error: ") and " Fix: " in lines[0], err
    for w in words:
        assert w in lines[0], lines[0]
    assert out == ""
    assert _listing(root) == before
    return lines[0]


@pytest.mark.parametrize("flags, named", [
    (["--refit"], "--[no-]refit"), (["--freqfold", "2"], "--freqfold"), (["--no-attention-aware"], "--[no-]attention-aware"),
    (["--paper", "--calibration", "parallel"], "--calibration, --paper"), (["--no-balance-kv", "--pca", "weights"],
                                                                           "--no-balance-kv, --pca"),
], ids=["refit", "freqfold", "attention-aware", "paper", "bkv-pca"])
def test_mha2mla_refuses_the_flags_it_would_drop(llama_dir, work, capsys, no_weights, flags, named):
    """MHA2MLA's steps are fixed; these flags were normalised away and the baseline ran as if they were not given."""
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--method", "mha2mla",
              "--kv-cache-ratio", "0.25", *flags, "--dry-run", *common], capsys, root,
             f"--method mha2mla takes no {named}", "drop them, or convert with --method transmla")


@pytest.mark.parametrize("flags, named", [
    (["--freqfold", "8"], "--freqfold"), (["--calibration", "sequential", "--refit"], "--calibration, --[no-]refit"),
    (["--rorope-metric", "query"], "--rorope-metric"), (["--paper"], "--paper"),
], ids=["freqfold", "calibration-refit", "metric", "paper"])
def test_lossless_refuses_the_mode_flags_it_would_drop(llama_dir, work, capsys, no_weights, flags, named):
    """Lossless normalises these away (exact either way): the run exited 0 and recorded freqfold 1, parallel, no
    refit, whatever was asked."""
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--lossless", *flags, "--dry-run",
              *common], capsys, root, f"--lossless takes no {named}", "drop them, or drop --lossless")
    for method in (["--lossless"], ["--method", "mha2mla", "--kv-cache-ratio", "0.25"]):  # 1 is what both use
        assert main(["convert", "--model", str(llama_dir), "--out", str(root / "o"), *method, "--freqfold", "1",
                     "--dry-run", *common]) == 0, capsys.readouterr().err


def test_mha2mla_takes_its_own_flags(llama_dir, work, capsys, no_weights):
    root, common = work
    rc = main(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--method", "mha2mla",
               "--kv-cache-ratio", "0.25", "--freqfold", "4", "--pca", "activations", "--dry-run", *common])
    assert rc == 0, capsys.readouterr().err


# 1. q_lora_rank against the model's dims (queries [h (d + R), D] = [4 (16 + R), 64]: at most 64)

def test_dry_run_refuses_impossible_q_lora_rank(llama_dir, work, capsys, no_weights):
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--q-lora-rank", "100000",
              "--dry-run", *common], capsys, root, "q_lora_rank=100000", "--q-lora-rank between 1 and 64")


@pytest.mark.parametrize("case, words", [("out", "exists and is not empty"), ("cal", "Unknown data set"),
                                         ("data_dir", "--data-dir"),
                                         # `transmla ppl` scores WikiText-2 test: a conversion fitted on it
                                         ("cal_test", "includes wikitext2-test, the set perplexity is measured on"),
                                         # and a path: part holding part of its file (before: calibrated on it, exit 0)
                                         ("cal_test_copy", "holds text of wikitext2-test, the set perplexity is")])
@pytest.mark.parametrize("dry", [True, False])
def test_convert_and_its_dry_run_refuse_the_same_inputs_before_any_work(llama_dir, work, capsys, no_weights, case,
                                                                        words, dry, tmp_path_factory):
    """The dry run says no where the run would: an --out in use, an unknown calibration set, a --data-dir
    without the calibration file (named with its flag; the run loaded the weights before finding it out)."""
    from transmla.io.data import local_path

    root, common = work
    copy = tmp_path_factory.mktemp("texts") / "notes.jsonl"  # 300 rows from the middle of WikiText-2 test
    copy.write_text("".join(local_path("wikitext2-test").read_text().splitlines(keepends=True)[2000:2300]))
    flags = {"out": [], "cal": ["--cal-dataset", "nonexist"], "data_dir": ["--data-dir", str(root / "nodata")],
             "cal_test": ["--cal-dataset", "wikitext2-train+wikitext2-test"],
             "cal_test_copy": ["--cal-dataset", f"wikitext2-train+path:{copy}"]}[case]
    out = root / "used"
    if case == "out":
        out.mkdir()
        (out / "x").write_text("x")
    _refused(["convert", "--model", str(llama_dir), "--out", str(out), "--qk-rope-dim", "8", *flags, *common]
             + (["--dry-run"] if dry else []), capsys, root, words)


def test_dry_run_accepts_possible_q_lora_rank(llama_dir, work, capsys, no_weights):
    root, common = work
    assert main(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--q-lora-rank", "64",
                 "--dry-run", *common]) == 0
    assert json.loads(capsys.readouterr().out)["kv_lora_rank"] > 0


@pytest.mark.parametrize("dry", [True, False])
def test_lossless_refuses_a_q_lora_rank_that_cuts_the_queries(llama_dir, work, capsys, no_weights, dry):
    """--lossless promises the original model; a q_lora_rank under the queries' rank (64 here) cut them and the
    export differed by 1e-3 in log-probs without a word. The full rank is exact (tests/test_convert.py) and passes."""
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--lossless", "--q-lora-rank", "48",
              *common] + (["--dry-run"] if dry else []), capsys, root, "--lossless with --q-lora-rank 48",
             "set it to 64")
    assert main(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--lossless", "--q-lora-rank", "64",
                 "--dry-run", *common]) == 0


@pytest.mark.parametrize("load", ["model", "layers"])
def test_convert_refuses_impossible_q_lora_rank_before_loading(llama_dir, work, capsys, no_weights, load):
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--q-lora-rank", "100000",
              "--load", load, *common], capsys, root, "--q-lora-rank between 1 and 64")


# 2. the KV budget, checked from the config before loading (as --dry-run does)

@pytest.mark.parametrize("load", ["model", "layers"])
@pytest.mark.parametrize("flags, words", [
    (["--kv-lora-rank", "100000"], ["kv_lora_rank=100000 is impossible", "kv_lora_rank between 1 and"]),
    (["--qk-rope-dim", "7"], ["qk_rope_head_dim=7 must be even"]),
])
def test_convert_refuses_impossible_budget_before_loading(llama_dir, work, capsys, no_weights, flags, words, load):
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), *flags, "--load", load, *common],
             capsys, root, *words)


# 3. output paths, checked before any work

def test_convert_refuses_out_under_a_file(llama_dir, work, capsys, no_weights):
    root, common = work
    (root / "afile").write_text("x")
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "afile" / "sub"), *common],
             capsys, root, "is a file", "--out")
    assert (root / "afile").read_text() == "x"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_convert_refuses_out_where_nothing_can_be_created(llama_dir, work, capsys, no_weights):
    """/proc's folders say writable to root by their mode bits, yet take no new file: the check tries one
    (a probe, removed at once) instead of reading the bits, and a run is refused before its work."""
    root, common = work
    _refused(["convert", "--model", str(llama_dir), "--out", "/proc/transmla-out", *common], capsys, root,
             "/proc/transmla-out cannot be created", "is not writable", "--out")


@pytest.mark.parametrize("argv, words", [
    (["eval", "--tasks", "piqa", "--limit", "2", "--seed", "-1"], ["--seed -1 is out of range"]),
    (["convert", "--out", "o", "--seed", str(2**64)], ["seed", "less than 4294967296"]),
], ids=["eval", "convert"])
def test_a_seed_numpy_cannot_take_is_refused_before_loading(llama_dir, work, capsys, no_weights, argv, words):
    root, common = work
    argv = [a if a != "o" else str(root / "o") for a in argv]
    _refused([argv[0], "--model", str(llama_dir), *argv[1:], *common], capsys, root, *words)


def test_the_output_check_leaves_no_probe_behind(tmp_path):
    from transmla.io.paths import check_output

    for kind in ("new_dir", "dir", "file", "new_file"):
        check_output(tmp_path / "a" / kind, kind)
        check_output(tmp_path / kind, kind)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("edit, words", [
    ({"num_hidden_layers": 4}, ["tensor(s) the config needs are not in the weights", "model.layers.2."]),
    ({"num_hidden_layers": 1}, ["the weights hold layers the config does not have", "model.layers.1."]),
    ({"tie_word_embeddings": False}, ["not in the weights (lm_head.weight)"]),
    ({"head_dim": 32}, ["do not have the shapes its config.json gives", "k_proj.weight: (32, 64) in the weights, (64, 64) by the config"]),
], ids=["more-layers", "fewer-layers", "untied-head", "head-dim"])
@pytest.mark.parametrize("load", ["model", "layers"])
def test_weights_that_do_not_match_the_config_are_refused(llama_dir, work, capsys, edit, words, load):
    """transformers loads such a folder anyway: a tensor the weights lack initialised at random (more layers,
    an untied lm_head), a layer the config lacks dropped; the conversion then ran on it and exited 0. The
    layer-streamed path reads tensors by name: it converted as far as the weights went, or cut the model short."""
    import shutil

    root, common = work
    bad = root.parent / f"{root.name}-model"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
    _refused_after_load(["convert", "--model", str(bad), "--out", str(root / "o"), "--cal-nsamples", "2",
                         "--cal-seqlen", "16", "--load", load, *common], capsys, root, *words,
                        "use the config.json that came with these weights")


def _refused_after_load(argv, capsys, root: Path, *words) -> None:
    """_refused for a command that gets as far as loading the weights: transformers' progress bar may precede
    the one error line."""
    before = _listing(root)
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.startswith("transmla: ")]
    assert rc == 2 and len(lines) == 1 and " Fix: " in lines[0] and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    assert out == "" and _listing(root) == before


@pytest.mark.parametrize("load", ["model", "layers"])
def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tiny_tokenizer, work, capsys, load):
    """Token ids past the embedding table were an IndexError in the first forward pass; the layer-streamed
    conversion instead read the bytes after the table as those rows and exited 0."""
    from conftest import _tiny_model

    root, common = work
    bad = root.parent / f"{root.name}-model"
    _tiny_model("llama", 256).save_pretrained(bad)  # the tokenizer has 512 tokens
    tiny_tokenizer.save_pretrained(bad)
    _refused_after_load(["convert", "--model", str(bad), "--out", str(root / "o"), "--cal-nsamples", "2",
                         "--cal-seqlen", "16", "--load", load, *common], capsys, root,
                        "token ids up to 511", "has 256 rows", "use the tokenizer that came with these weights")


def _rewrite_header(data: bytes, edit) -> bytes:
    """The safetensors file `data` with its JSON header edited (the tensor bytes kept: their offsets count from
    the end of the header)."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(edit(json.loads(data[8:8 + n]))).encode()
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


@pytest.mark.parametrize("damage, words", [
    (lambda b: b"", ["0 bytes, shorter than a header"]),
    (lambda b: b[: len(b) // 2], ["it ends inside model.layers."]),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], ["past the end of the file"]),
    (lambda b: b[:8] + b"\xff" * (len(b) - 8), ["its header is not JSON"]),
    (lambda b: _rewrite_header(b, lambda h: {**h, "model.norm.weight": {"dtype": "F32", "shape": [64]}}),
     ["its entry for model.norm.weight has no dtype, shape and data offsets"]),
    (lambda b: _rewrite_header(b, lambda h: {**h, "model.norm.weight": [1, 2]}), ["its entry for model.norm.weight"]),
], ids=["empty", "truncated", "header-length", "header-bytes", "entry-no-offsets", "entry-a-list"])
def test_a_damaged_weight_file_is_refused_layer_streamed(llama_dir, work, capsys, damage, words):
    """--load layers reads the safetensors header itself: an empty or cut file was a struct/JSON traceback."""
    import shutil

    root, common = work
    bad = root.parent / f"{root.name}-model"
    shutil.copytree(llama_dir, bad)
    (bad / "model.safetensors").write_bytes(damage((bad / "model.safetensors").read_bytes()))
    _refused_after_load(["convert", "--model", str(bad), "--out", str(root / "o"), "--cal-nsamples", "2",
                         "--cal-seqlen", "16", "--load", "layers", *common], capsys, root,
                        "is not a readable safetensors file", *words, "fetch the model again")


def test_an_added_token_past_the_table_loads(llama_dir, tiny_tokenizer, tmp_path):
    """Released text-only checkpoints carry added special tokens past their table (Gemma 3's <image_soft_token>):
    the check looks at the base vocabulary only."""
    import copy
    import shutil

    from transmla.io.sources import load_model

    d = tmp_path / "model"
    shutil.copytree(llama_dir, d)
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    assert tok.convert_tokens_to_ids("<image_soft_token>") == len(tiny_tokenizer)  # one past the 512-row table
    tok.save_pretrained(d)
    model, loaded = load_model(str(d))
    assert model.get_input_embeddings().num_embeddings == len(tiny_tokenizer) == len(loaded) - 1


def test_rows_past_a_lazy_table_are_refused(llama_dir):
    import torch

    from transmla.errors import TransMLAError
    from transmla.io.lazy import LazyCheckpoint

    ckpt = LazyCheckpoint(llama_dir)
    rows = ckpt.entries["model.embed_tokens.weight"][3][0]
    ok = ckpt.rows("model.embed_tokens.weight", torch.tensor([0, rows - 1]))
    assert ok.shape == (2, 64)
    with pytest.raises(TransMLAError, match=f"it has {rows} rows .a token id past the embedding table"):
        ckpt.rows("model.embed_tokens.weight", torch.tensor([3, rows]))


def test_a_truncated_weight_file_is_refused(llama_dir, work, capsys):
    import shutil

    root, common = work
    bad = root.parent / f"{root.name}-model"
    shutil.copytree(llama_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused_after_load(["ppl", "--model", str(bad), *common], capsys, root, "SafetensorError", "fetch the model again")


def test_convert_refuses_out_that_is_a_file(llama_dir, work, capsys, no_weights):
    root, common = work
    (root / "afile").write_text("x")
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "afile"), *common], capsys, root,
             "--out", "is a file, not a directory")


@pytest.mark.parametrize("argv", [["convert", "--dry-run"], ["convert"], ["ppl"], ["eval", "--tasks", "piqa"]],
                         ids=["dry-run", "convert", "ppl", "eval"])
def test_an_empty_out_is_refused(llama_dir, work, capsys, no_weights, monkeypatch, argv):
    """--out "" (an unset shell variable) resolved to the working directory, which an empty one let through."""
    root, common = work
    monkeypatch.chdir(root)  # empty: the old check passed it
    _refused([argv[0], "--model", str(llama_dir), "--out", "", *argv[1:], *common], capsys, root,
             "--out is empty (an unset shell variable?)", "give --out a")


@pytest.mark.parametrize("argv, flag", [
    (["finetune", "--corpora", "wikitext2-train", "--teacher", " "], "--teacher"),  # ran without a teacher
    (["ppl", "--data-dir", ""], "--data-dir"),  # the default data folder, without a word
    (["ppl", "--cache-dir", ""], "--cache-dir"),
    (["eval", "--tasks", "piqa", "--limits", ""], "--limits"),
], ids=["teacher", "data-dir", "cache-dir", "limits"])
def test_an_empty_option_is_refused(llama_dir, work, capsys, no_weights, argv, flag):
    root, common = work
    model = str(_mla_dir(root)) if argv[0] == "finetune" else str(llama_dir)
    out = ["--out", str(root / "o")] if argv[0] == "finetune" else []
    _refused([argv[0], "--model", model, *out, *common, *argv[1:]], capsys, root,  # after common: the last one counts
             f"{flag} is empty (an unset shell variable?)", f"give {flag} a value, or leave it out")


def test_ppl_refuses_out_that_is_a_directory(llama_dir, work, capsys, no_weights):
    root, common = work
    (root / "existing").mkdir()
    _refused(["ppl", "--model", str(llama_dir), "--out", str(root / "existing"), *common],
             capsys, root, "is a directory", "--out")


def test_eval_refuses_out_that_is_a_file(llama_dir, work, capsys, no_weights):
    root, common = work
    (root / "afile").write_text("x")
    _refused(["eval", "--model", str(llama_dir), "--tasks", "piqa", "--limit", "2", "--out", str(root / "afile"),
              *common], capsys, root, "is a file", "--out")


def test_finetune_refuses_out_under_a_file(work, capsys, no_weights):
    root, common = work
    (root / "afile").write_text("x")
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "afile" / "sub"),
              "--corpora", "wikitext2-train", *common], capsys, root, "is a file", "--out")


# 4, 5. eval's numbers

@pytest.mark.parametrize("flags, words", [(["--tasks", ","], "empty task list"),
                                          (["--tasks", "mmlu", "--num-fewshot", "-1"], "negative"),
                                          # lm-eval asserted after the model loaded: its traceback, exit 1
                                          (["--tasks", "mmlu", "--num-fewshot", "6"], "five questions per subject"),
                                          # 0 meant "every doc": an hours-long run where -1 was refused
                                          (["--limit", "0"], "--limit 0 must be a positive"),
                                          # scored twice (twice the time), reported once
                                          (["--tasks", "piqa,piqa"], "tasks names ['piqa'] more than once"),
                                          # ignored, yet recorded in results.json as if used
                                          (["--tasks", "piqa", "--limit", "4", "--limits", "mmlu=2"],
                                           "--limits names mmlu, which --tasks piqa does not run"),
                                          (["--tasks", "piqa", "--limit", "4", "--superset", "mmlu=10"],
                                           "--superset names mmlu"),
                                          # the last one won without a word
                                          (["--tasks", "piqa", "--limit", "4", "--limits", "piqa=2,piqa=3"],
                                           "names a benchmark more than once"),
                                          # HF's device map offloaded to ./offload: same scores, a stray folder
                                          (["--tasks", "piqa", "--limit", "2", "--parallelize"],
                                           "parallelize splits one model over the visible GPUs")])
def test_eval_refuses_no_tasks_and_negative_fewshot(llama_dir, work, capsys, no_weights, flags, words):
    root, common = work
    _refused(["eval", "--model", str(llama_dir), *flags, *common], capsys, root, words)


@pytest.mark.parametrize("cmd", ["convert", "ppl", "eval", "finetune"])
@pytest.mark.parametrize("device, words", [("foo", "not a torch device"), ("cuda:7", "no such CUDA device"),
                                           ("mps", "no mps device"), ("xpu", "no xpu device")])
def test_a_device_this_machine_lacks_is_refused_before_any_work(llama_dir, work, capsys, no_weights, cmd, device, words):
    root, common = work
    model = str(_mla_dir(root)) if cmd == "finetune" else str(llama_dir)
    _refused([cmd, "--model", model, "--out", str(root / "o"), "--device", device, *common], capsys, root, words, "--device")


@pytest.mark.parametrize("value", ["abc", "0", "-2", "auto:abc", "auto:0", "autox"])
def test_eval_refuses_bad_batch_size(llama_dir, work, capsys, no_weights, value):
    root, common = work
    _refused(["eval", "--model", str(llama_dir), "--batch-size", value, *common], capsys, root, "--batch-size")


def test_eval_blames_limit_not_superset(llama_dir, work, capsys, no_weights):
    root, common = work
    line = _refused(["eval", "--model", str(llama_dir), "--limit", "-3", *common], capsys, root, "--limit -3")
    assert "--superset" not in line


# 6. ppl window, finetune corpora and model type, checked before loading

@pytest.mark.parametrize("flags, words", [
    (["--seqlen", "0"], ["seqlen must be >= 2", "--seqlen"]),
    (["--seqlen", "64", "--max-tokens", "10"], ["fewer than one window", "--max-tokens"]),
])
def test_ppl_refuses_bad_window_before_loading(llama_dir, work, capsys, no_weights, flags, words):
    root, common = work
    _refused(["ppl", "--model", str(llama_dir), "--out", str(root / "r.json"), *flags, *common], capsys, root, *words)


def _mla_dir(root: Path) -> Path:
    """A directory a converted model would be, as far as its config.json tells (no weights: none may be read)."""
    d = root.parent / f"{root.name}-mla"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    return d


def test_finetune_refuses_unknown_corpus_before_loading(work, capsys, no_weights):
    root, common = work
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "nosuch", *common],
             capsys, root, "--corpora nosuch", "Unknown data set 'nosuch'", "wikitext2-train")


def test_finetune_names_the_flags_a_setting_it_would_drop_depends_on(work, capsys, no_weights):
    """The refusal of a setting the objective never reads named the fields (kd_weight) on the command line."""
    root, common = work
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "c4-demo",
              "--objective", "kd", "--kd-weight", "2", *common], capsys, root,
             "--kd-weight 2.0 is only read with --objective kd+lm", "see `transmla finetune --help`")


def test_finetune_refuses_a_corpus_named_twice_before_loading(work, capsys, no_weights):
    """Its documents were packed twice, so copies of training articles landed in the validation blocks."""
    root, common = work
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora",
              "c4-demo,wiki-demo,c4-demo", *common], capsys, root, "--corpora names ['c4-demo'] more than once")


@pytest.mark.parametrize("corpus, words", [("arc_easy", "is a benchmark"), ("wikitext2-test", "is an evaluation split")])
def test_finetune_refuses_a_benchmark_or_test_split_as_a_corpus_before_loading(work, capsys, no_weights, corpus, words):
    root, common = work
    line = _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora",
                     f"c4-demo,{corpus}", *common], capsys, root, f"--corpora {corpus}", words, "wikitext2-train")
    assert "wikitext2-test" not in line.split("Fix:")[1]  # offered, then refused as an evaluation split


def test_finetune_from_hub_corpora_needs_a_document_limit_and_streams_up_to_it(work, capsys, no_weights, monkeypatch):
    """TRANSMLA_DATA_SOURCE=hub: a document corpus (c4-demo is allenai/c4 en) without --max-documents is refused
    before anything loads (it was read with a plain load_dataset: the whole split, hundreds of GB); with it, the
    corpus is streamed and only N documents are taken."""
    from transmla.io import data

    root, common = work
    monkeypatch.setenv("TRANSMLA_DATA_SOURCE", "hub")
    calls = []

    class _Stop(Exception):
        pass

    class Stream(list):
        def take(self, n):
            calls.append(("take", n))
            return self[:n]

    def hub_dataset(s, revision, streaming=False):
        calls.append((s.hub_path, streaming))
        if not streaming:
            raise _Stop("a whole split was requested")
        return Stream({"text": f"doc {i}"} for i in range(10))

    monkeypatch.setattr(data, "_hub_dataset", hub_dataset)
    argv = ["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "c4-demo", *common]
    _refused(argv, capsys, root, "c4-demo on the hub is 'allenai/c4'", "--max-documents N")
    assert calls == []
    real = data.load_documents
    read = {}

    def load_documents(name, **kw):  # the real reader, then stop before the tokenizer and model load
        read[name] = real(name, **kw)
        raise _Stop

    monkeypatch.setattr(data, "load_documents", load_documents)
    with pytest.raises(_Stop):
        main(argv + ["--max-documents", "3"])
    assert read == {"c4-demo": ["doc 0", "doc 1", "doc 2"]}
    assert calls == [("allenai/c4", True), ("take", 3)]


def test_finetune_refuses_unconverted_model_before_loading(llama_dir, work, capsys, no_weights):
    root, common = work
    _refused(["finetune", "--model", str(llama_dir), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              *common], capsys, root, "model_type='llama'", "convert the model first")


def test_finetune_checks_pass_for_a_converted_model(work, no_weights):
    """The up-front checks let a converted model through: the next step is loading it."""
    root, common = work
    with pytest.raises(WeightsTouched):
        main(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              *common])


def test_dry_run_warns_of_calibration_windows_past_the_models_positions(llama_dir, work, capsys, no_weights):
    """--cal-seqlen past max_position_embeddings (512) is planned with one warning, before any weight loads."""
    root, common = work
    with pytest.warns(UserWarning, match=r"cal_seqlen 600 is longer than the model's max_position_embeddings"):
        assert main(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--cal-seqlen", "600",
                     "--dry-run", *common]) == 0


def test_finetune_refuses_a_split_the_corpora_cannot_give_before_loading(llama_dir, work, capsys, monkeypatch):
    """--val-tokens is checked against the corpora (read and split with the model's tokenizer alone) before any
    weight loads, and named as the flag, not as the params' finetune.val_tokens."""
    import shutil

    import transmla.io.sources as sources

    root, common = work
    student = _mla_dir(root)
    for f in llama_dir.iterdir():  # its tokenizer; the weights file is only a name (never read here)
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, student / f.name)
    (student / "model.safetensors").write_bytes(b"not read")
    data = root.parent / f"{root.name}-data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "c4_demo.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " + "words and more words " * 40}) + "\n" for i in range(6)))
    monkeypatch.setattr(sources, "load_model", _touched)
    argv = ["finetune", "--model", str(student), "--out", str(root / "ft"), "--corpora", "c4-demo",
            "--data-dir", str(data), "--seqlen", "32", *common]
    _refused([*argv, "--val-tokens", "100000000"], capsys, root, "--val-tokens 100000000", "leaves no training",
             "lower --val-tokens")
    # a block longer than the corpora blamed --val-tokens (its default 16384 then "left no training tokens")
    _refused([a if a != "32" else "100000000" for a in argv], capsys, root, "--seqlen 100000000", "fewer than two blocks",
             "lower --seqlen")
    _refused([*argv, "--val-tokens", "64", "--max-tokens", "100000000"], capsys, root, "--max-tokens 100000000",
             "lower --max-tokens to at most", "--epochs repeats them")
    with pytest.raises(WeightsTouched):  # a split the corpora give: the next step is loading the model
        main([*argv, "--val-tokens", "64", "--max-tokens", "512"])


@pytest.mark.parametrize("where", ["out", "inside"])
def test_finetune_refuses_a_work_dir_that_is_out_or_inside_it(work, capsys, no_weights, where):
    """--out is written as a whole at the end (and its earlier contents replaced): a --work-dir there would lose
    its checkpoints, or a user's files, to it."""
    root, common = work
    out = root / "ft"
    wd = out if where == "out" else out / "trainer"
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(out), "--work-dir", str(wd),
              "--corpora", "wikitext2-train", *common], capsys, root, "--work-dir", "is --out or inside it")


def test_finetune_refuses_a_teacher_dtype_without_a_teacher(work, capsys, no_weights):
    """--teacher-dtype bfloat16 with no --teacher ran with nothing in bfloat16, exit 0."""
    root, common = work
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              "--teacher-dtype", "bfloat16", *common], capsys, root, "--teacher-dtype bfloat16 without --teacher")


def test_finetune_refuses_a_default_work_folder_that_is_a_file(work, capsys, no_weights):
    """The default work folder (.<out>.trainer beside --out) as a file: a FileExistsError traceback after the model
    had loaded; now one error before any weight, naming --work-dir."""
    root, common = work
    (root / ".ft.trainer").write_text("not a folder")
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              *common], capsys, root, ".ft.trainer (the default beside --out) is a file", "--work-dir DIR")


def test_finetune_refuses_a_missing_teacher_before_loading(work, capsys, no_weights):
    root, common = work
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              "--teacher", str(root / "no-such-teacher"), *common], capsys, root, "no-such-teacher")


def test_finetune_refuses_a_teacher_of_another_vocabulary_before_loading(llama_dir, work, capsys, no_weights):
    """The student's and the teacher's configs are compared before either loads; the same vocabulary passes."""
    root, common = work
    student = _mla_dir(root)
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    (student / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": vocab + 1}))
    argv = ["finetune", "--model", str(student), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
            "--teacher", str(llama_dir), *common]
    _refused(argv, capsys, root, f"teacher's vocabulary ({vocab} tokens)", f"student's ({vocab + 1})", "--teacher")
    (student / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": vocab}))
    with pytest.raises(WeightsTouched):
        main(argv)


def _student_with_tokenizer(root: Path, llama_dir: Path) -> Path:
    """_mla_dir with the tiny model's tokenizer and vocabulary size (no weights)."""
    import shutil

    d = _mla_dir(root)
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": vocab}))
    for f in llama_dir.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, d / "model.safetensors")  # a folder that passes the listing; never loaded
    return d


def test_finetune_refuses_a_teacher_whose_ids_mean_other_strings(llama_dir, work, capsys, monkeypatch):
    """Only the vocabulary sizes were compared: a teacher with another tokenizer of the same size distilled token
    id against token id (other strings) and exited 0."""
    import shutil

    import transmla.io.sources as sources

    monkeypatch.setattr(sources, "load_model", _touched)
    root, common = work
    student = _student_with_tokenizer(root, llama_dir)
    teacher = root.parent / f"{root.name}-teacher"
    shutil.copytree(llama_dir, teacher)
    tj = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (300, 301))  # two tokens swap ids: same size, other meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tj))
    argv = ["finetune", "--model", str(student), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
            "--max-tokens", "4096", "--val-tokens", "512", "--seqlen", "64", "--teacher", str(teacher), *common]
    _refused(argv, capsys, root, "The teacher's tokenizer is not the student's", "id 300", "--teacher")
    shutil.copy(llama_dir / "tokenizer.json", teacher / "tokenizer.json")  # the original's own tokenizer: it loads
    with pytest.raises(WeightsTouched):
        main(argv)


@pytest.mark.parametrize("how", ["same-folder", "copy"])
def test_finetune_refuses_the_student_as_its_own_teacher(llama_dir, work, capsys, monkeypatch, how):
    """The student as teacher trained on a KL of 0 and exited 0 (val_kd_before 1.8e-08)."""
    import shutil

    import transmla.io.sources as sources

    monkeypatch.setattr(sources, "load_model", _touched)
    root, common = work
    student = _student_with_tokenizer(root, llama_dir)
    teacher = student
    if how == "copy":
        teacher = root.parent / f"{root.name}-copy"
        shutil.copytree(student, teacher)
    _refused(["finetune", "--model", str(student), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              "--max-tokens", "4096", "--val-tokens", "512", "--seqlen", "64", "--teacher", str(teacher), *common],
             capsys, root, "is the student itself", "--teacher")


def test_finetune_refuses_a_teacher_of_an_unsupported_architecture_before_loading(work, capsys, no_weights):
    """A GPT-2 teacher loaded and failed mid-training ('GPT2LMHeadModel' object has no attribute 'model')."""
    root, common = work
    teacher = root.parent / f"{root.name}-gpt2"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _refused(["finetune", "--model", str(_mla_dir(root)), "--out", str(root / "ft"), "--corpora", "wikitext2-train",
              "--teacher", str(teacher), *common], capsys, root, "teacher's architecture 'gpt2'")


@pytest.mark.parametrize("cmd, flag", [("finetune", "--lr"), ("finetune", "--epochs"), ("convert", "--latent-norm-eps")])
def test_an_infinite_number_is_refused_before_any_work(llama_dir, work, capsys, no_weights, cmd, flag):
    """inf passed every gt=0 check: --lr inf trained to NaN weights and exited 0, --epochs inf overflowed after
    loading, --latent-norm-eps inf failed the conversion as 'degenerate statistics'."""
    root, common = work
    model = str(_mla_dir(root)) if cmd == "finetune" else str(llama_dir)
    extra = ["--corpora", "wikitext2-train"] if cmd == "finetune" else []
    _refused([cmd, "--model", model, "--out", str(root / "o"), flag, "inf", *extra, *common], capsys, root,
             "finite number", f"{flag}: ", f"pass a valid {flag} (see `transmla {cmd} --help`)")  # the flag, not the field


def test_ppl_refuses_missing_data_before_loading(llama_dir, work, capsys, no_weights):
    """The WikiText-2 file was first read after the model had loaded (minutes for a large one)."""
    root, common = work
    _refused(["ppl", "--model", str(llama_dir), "--out", str(root / "r.json"), *common[:2], "--data-dir",
              str(root / "no-data")], capsys, root, "no-data")


@pytest.mark.parametrize("content", ["", "  \n", '{"text": "a"}\n{"text": 3}\n'])
def test_convert_refuses_an_empty_or_broken_calibration_path_before_loading(llama_dir, work, capsys, no_weights, content,
                                                                            tmp_path_factory):
    """A path: calibration part was read only after the model loaded; an empty one then failed with the fix
    'lower --cal-seqlen'."""
    root, common = work
    f = tmp_path_factory.mktemp("cal") / "cal.jsonl"
    f.write_text(content)
    words = ["has no string 'text'"] if content.startswith("{") else ["holds no text", "path:"]
    _refused(["convert", "--model", str(llama_dir), "--out", str(root / "o"), "--cal-dataset", f"path:{f}", *common],
             capsys, root, *words)


def test_the_cli_starts_without_torch():
    """`transmla --help`, an argument error or a dry run answer before torch loads (seconds of start-up): a
    loader module's top-level import of the torch-backed io.lazy made every command load it."""
    import subprocess
    import sys

    code = "import sys, transmla.cli, transmla.io.sources; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
