"""Code paths that run on a GPU, checked without one: fake CUDA tensors (torch's FakeTensorMode) stand in for a
model loaded with --device cuda, so a tensor that stays on the model's device where the CPU math needs it
fails here as it would on the GPU ("Expected all tensors to be on the same device")."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig, LlamaForCausalLM

from transmla.adapters import AttentionWeights, attention_weights


def _fake_cuda_attention(model):
    """Replace layer 0's attention projections by fake tensors on cuda (call inside the FakeTensorMode)."""
    attn = model.model.layers[0].self_attn
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        for name, p in list(lin.named_parameters()):
            setattr(lin, name, torch.nn.Parameter(torch.empty(p.shape, device="cuda"), requires_grad=False))
    return attn


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        attention_bias=True)).eval()


def test_layer_weights_of_a_gpu_model_come_to_the_cpu_math(tiny):
    """The per-layer math (RoRoPE, BKV PCA, refit) runs in float64 on the CPU beside the calibration statistics;
    attention_weights of a model on a GPU gives CPU float64 copies, not tensors left on the GPU."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        attn = _fake_cuda_attention(tiny)
        assert attn.q_proj.weight.device.type == "cuda"
        w = attention_weights(tiny, 0)
        tensors = [getattr(w, f.name) for f in dataclasses.fields(AttentionWeights)
                   if isinstance(getattr(w, f.name), torch.Tensor)]
        assert len(tensors) == 8  # four weights, four biases
        assert all(t.device.type == "cpu" and t.dtype == torch.float64 for t in tensors)


def test_refit_query_map_reads_a_gpu_q_proj_on_the_cpu(tiny, monkeypatch):
    """The refit's query map solves against the MLA query weights (CPU): the original q_proj of a GPU model
    comes over to the CPU first, and the map goes back to the model's device."""
    from transmla.pipeline import stream

    seen = []

    def query_map(mla_q, wq, h):
        seen.append((mla_q.device.type, wq.device.type))
        return torch.zeros(h, 2, 2, dtype=torch.float64)

    monkeypatch.setattr(stream, "query_map", query_map)
    with FakeTensorMode(allow_non_fake_inputs=True):
        attn = _fake_cuda_attention(tiny)
        attn.q_proj.bias = None
        A = stream.LayerStream._query_map(attn, {"q_proj.weight": torch.zeros(4 * 10, 32, dtype=torch.float64)},
                                          stream.MLAShapes(h=4, d=8, R=2, r=4, eps=1e-6, plan=(0,)))
        assert seen == [("cpu", "cpu")] and A.device.type == "cuda"
