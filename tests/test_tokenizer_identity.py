"""The tokenizer is part of a local model folder's identity (its nightly release id, the pipeline's cache
keys), and a folder whose tokenizer files cannot be read is refused before the model loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from transmla.errors import TransMLAError

_CONFIG = {  # a tiny grouped-query llama: judge_config takes it
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def _folder(root: Path) -> Path:
    """A model folder as check_model_dir and resolve see it (nothing here loads the weights' bytes)."""
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_CONFIG))
    (d / "model.safetensors").write_bytes(b"weights v1")
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d


# ------------------------------------------------------------------------------- tokenizer_hash in the library

def test_tokenizer_hash_values_are_unchanged(tmp_path):
    """The move keeps the values (they are in every recorded cache key): the same files hashed the same way."""
    import hashlib

    from transmla.io.sources import sha256_file, tokenizer_hash

    d = _folder(tmp_path)
    (d / "merges.txt").write_text("a b\n")
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt"):  # in TOKENIZER_HASH_FILES' order
        h.update(name.encode())
        h.update(sha256_file(d / name).encode())
    assert tokenizer_hash(d) == tokenizer_hash(str(d)) == h.hexdigest()


# ------------------------------------------------------------------------------- the local folder's release id

def test_tokenizer_hash_covers_every_file_that_can_be_the_tokenizer(tmp_path):
    """A folder whose tokenizer is a vocab.txt, tiktoken ranks or a sentencepiece file of another name:
    changing that file changes the hash (the cache keys and the release id)."""
    from transmla.io.sources import tokenizer_hash

    d = tmp_path / "m"
    d.mkdir()
    for name in ("vocab.txt", "cl100k.tiktoken", "spiece.model"):
        (d / name).write_text("one\n")
        before = tokenizer_hash(d)
        (d / name).write_text("two\n")
        assert tokenizer_hash(d) != before, name


def test_local_folder_release_id_covers_the_tokenizer(tmp_path):
    from flows.nightly import release_dir
    from transmla.io.releases import resolve
    from transmla.io.sources import content_hash

    d = _folder(tmp_path)
    first = resolve(str(d))
    assert first.refused is None and first.source == str(d)
    assert resolve(str(d)).release_id == first.release_id, "an unchanged folder keeps its release id"
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first.release_id)
    assert release_dir(first.release_id) == first.release_id.removeprefix("sha256:")[:12]

    weights = content_hash(d)
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"b": 0}}}))
    assert content_hash(d) == weights, "content_hash covers config + weights only (its values are recorded)"
    retok = resolve(str(d))
    assert retok.release_id != first.release_id, "a tokenizer-only update is a new release"
    assert resolve(str(d)).release_id == retok.release_id

    (d / "model.safetensors").write_bytes(b"weights v2")
    assert resolve(str(d)).release_id not in (first.release_id, retok.release_id), "new weights: a new release"


# ------------------------------------------------------------------------------- unreadable tokenizer files

def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])


_UNREADABLE = [  # (how the folder is broken, the file named, what the problem says)
    ("truncated tokenizer.json", "tokenizer.json", "Cannot read the tokenizer file .*JSONDecodeError"),
    ("empty tokenizer.json", "tokenizer.json", "is empty"),
    ("empty tokenizer_config.json", "tokenizer_config.json", "is empty"),
    ("corrupt tokenizer_config.json", "tokenizer_config.json", "Cannot read the tokenizer file .*JSONDecodeError"),
    ("not utf-8 vocab.json", "vocab.json", "Cannot read the tokenizer file .*UnicodeDecodeError"),
    ("corrupt special_tokens_map.json", "special_tokens_map.json", "Cannot read the tokenizer file"),
    ("corrupt added_tokens.json", "added_tokens.json", "Cannot read the tokenizer file"),
    ("tokenizer.json not an object", "tokenizer.json", "is not a JSON object"),
    ("dangling tokenizer.json", "tokenizer.json", "Cannot read the tokenizer file .*FileNotFoundError"),
    ("empty tokenizer.model", "tokenizer.model", "is empty"),
    ("empty cl100k.tiktoken", "cl100k.tiktoken", "is empty"),
    ("empty vocab.txt", "vocab.txt", "is empty"),
    ("empty merges.txt", "merges.txt", "is empty"),
]


def _break(d: Path, how: str) -> None:
    name = how.split()[-1]
    f = d / name
    if how.startswith("truncated"):
        _truncate(f)
    elif how.startswith("empty"):
        f.write_bytes(b"")
    elif how.startswith("corrupt"):
        f.write_text('{"eos_token": "<|endoftext|>", ')
    elif how.startswith("not utf-8"):
        f.write_bytes(b'{"\xff\xfe": 0}')
    elif how.endswith("not an object"):
        (d / "tokenizer.json").write_text("null")
    elif how.startswith("dangling"):
        f.unlink()
        f.symlink_to(d / "gone.json")


@pytest.mark.parametrize("how, name, problem", _UNREADABLE)
def test_unreadable_tokenizer_file_is_one_clear_error(tmp_path, how, name, problem):
    """check_model_dir (and so materialize, load_model's first step for a folder) refuses the folder, naming
    the file, before any weight is read."""
    from transmla.io.sources import check_model_dir, materialize

    d = _folder(tmp_path)
    for other in ("tokenizer.model", "cl100k.tiktoken", "vocab.txt", "merges.txt"):
        (d / other).write_bytes(b"x y\n")
    for other in ("vocab.json", "special_tokens_map.json", "added_tokens.json"):
        (d / other).write_text("{}")
    check_model_dir(d)  # whole, it passes
    _break(d, how)
    for call in (check_model_dir, lambda p: materialize(str(p))):
        with pytest.raises(TransMLAError, match=problem) as e:
            call(d)
        msg = str(e.value)
        assert str(d / name) in msg.split("Fix:")[0] and "\n" not in msg
        assert "tokenizer.save_pretrained(DIR)" in msg.split("Fix:")[1]


def test_saved_tokenizer_folder_passes(tiny_model_dir, tmp_path):
    """A folder written by save_pretrained (model and tokenizer) passes the check unchanged."""
    from transmla.io.sources import check_model_dir

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    check_model_dir(d)
    _truncate(d / "tokenizer.json")
    with pytest.raises(TransMLAError, match="tokenizer.json"):
        check_model_dir(d)
