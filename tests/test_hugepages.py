"""runtime.hugepages: weights and decode caches moved into 2 MB pages keep their values, ties and
lifetime; where the kernel has no huge pages nothing moves and the reason is given."""

import gc

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from transmla.runtime import hugepages as hp
from transmla.runtime.throughput import cache_to_hugepages, decode_step, memory_bandwidth, static_copy

needs_thp = pytest.mark.skipif(not hp.supported(), reason="no transparent huge pages on this kernel")


def _tiny_llama(tied=True):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


@needs_thp
def test_empty_is_aligned_and_outlives_its_mapping_object():
    t = hp.empty((3, 1000, 1000), torch.float32)
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hp.HUGE == 0
    gc.collect()  # the mmap object has no other reference: the tensor must keep it mapped
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    # 12 MB written through an advised, aligned mapping: the kernel backs (most of) it with 2 MB pages
    assert hp.hugepage_bytes([t]) >= 4 * hp.HUGE
    x = torch.randn(7, 5, dtype=torch.float64)
    y = hp.copy(x)
    assert torch.equal(x, y) and y.dtype == torch.float64 and y.data_ptr() != x.data_ptr()


@needs_thp
def test_empty_many_lays_tensors_out_in_one_mapping():
    """empty_many: one 2 MB-aligned region, each tensor its own storage on a 64-byte line in the order
    given (no page each for small tensors); an empty shape is refused with the reason."""
    a, b, c = hp.empty_many([((3,), torch.float32), ((5, 7), torch.float64), ((1000, 600), torch.float32)])
    assert (a.shape, b.shape, c.shape) == ((3,), (5, 7), (1000, 600)) and b.dtype == torch.float64
    assert a.data_ptr() % hp.HUGE == 0
    assert b.data_ptr() - a.data_ptr() == 64 and c.data_ptr() - b.data_ptr() == 320  # 280 bytes, to a whole line
    assert len({t.untyped_storage().data_ptr() for t in (a, b, c)}) == 3 and a.storage_offset() == 0
    c.fill_(1.0)
    a.fill_(2.0)
    assert float(c.sum()) == c.numel() and float(a.sum()) == 6.0
    with pytest.raises(ValueError, match="at least one element"):
        hp.empty_many([((4,), torch.float32), ((0, 3), torch.float32)])
    with pytest.raises(ValueError, match="at least one element"):
        hp.empty((0,))


@needs_thp
def test_to_hugepages_keeps_the_model_bit_for_bit_and_its_ties():
    model = _tiny_llama(tied=True)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    report = hp.to_hugepages(model)
    assert report["reason"] is None and report["moved"] == len(params) + len(list(model.buffers()))
    assert report["bytes"] == sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    # one region: every tensor inside it, each on its own cache line, all Parameters the same objects
    ptrs = sorted(p.data_ptr() for p in model.parameters())
    assert ptrs[0] % hp.HUGE == 0 and all(p % hp.ALIGN == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < report["bytes"] + hp.ALIGN * len(ptrs)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    # each tensor its own storage inside the one mapping: nothing looks tied that is not
    assert all(p.storage_offset() == 0 for p in model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(params)


@needs_thp
def test_a_model_in_huge_pages_saves_and_loads_unchanged(tmp_path):
    """save_pretrained after the move writes every weight (tied ones once), and the reload is the same model."""
    model = _tiny_llama(tied=False)
    ref = {n: p.detach().clone() for n, p in model.state_dict().items()}
    hp.to_hugepages(model)
    model.save_pretrained(tmp_path)
    back = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert set(back.state_dict()) == set(ref)
    for n, t in back.state_dict().items():
        assert torch.equal(t, ref[n]), n


def test_nothing_moves_where_the_kernel_has_no_huge_pages(monkeypatch):
    monkeypatch.setattr(hp, "thp_mode", lambda: "never")
    model = _tiny_llama()
    ptrs = [p.data_ptr() for p in model.parameters()]
    report = hp.to_hugepages(model)
    assert report["moved"] == 0 and "never" in report["reason"]
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    with pytest.raises(RuntimeError, match="2 MB pages are not available"):
        hp.empty((4,))
    assert memory_bandwidth(nbytes=1 << 20, repeats=1, hugepages=True)["hugepages"] is False


@needs_thp
def test_static_cache_in_huge_pages_decodes_the_same():
    """The original's preallocated StaticCache moved into 2 MB pages gives the same logits step by step,
    and decode_step records which caches it moved (a growing DynamicCache: none)."""
    model = _tiny_llama(tied=False)
    ids = torch.randint(0, 97, (1, 12))
    B, steps = 3, 3
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        out = model(ids, past_key_values=dyn, use_cache=True)
        a = static_copy(dyn, model.config, B, 12 + steps)
        b = static_copy(dyn, model.config, B, 12 + steps)
        assert cache_to_hugepages(b) is True
        assert all(layer.keys.data_ptr() % hp.HUGE == 0 for layer in b.layers)
        assert cache_to_hugepages(DynamicCache(config=model.config)) is False
        x = y = out.logits[:, -1:].argmax(-1).repeat(B, 1)
        for _ in range(steps):
            la = model(x, past_key_values=a, use_cache=True).logits
            lb = model(y, past_key_values=b, use_cache=True).logits
            assert torch.equal(la, lb)
            x = y = la[:, -1:].argmax(-1)
    assert decode_step(model, "static", context=10, batch=2, steps=2, threads=1, hugepages=True)["cache_hugepages"] is True
    assert decode_step(model, "hf", context=10, batch=2, steps=2, threads=1, hugepages=True)["cache_hugepages"] is False
    assert decode_step(model, "static", context=10, batch=2, steps=2, threads=1)["cache_hugepages"] is False
    assert memory_bandwidth(nbytes=1 << 22, repeats=1, hugepages=True)["hugepages"] is True
