"""The chunked recovery losses (training.distill) against the direct full-logits computation."""

import pytest
import torch
import torch.nn.functional as F

from transmla.training.distill import recovery_loss


def _case(seed=0, B=2, T=7, D=5, V=11):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    th = torch.randn(B, T, 3, generator=g, dtype=torch.float64)
    tw = torch.randn(V, 3, generator=g, dtype=torch.float64)
    return h, w, ids, th, tw


def _direct(h, w, ids, th, tw, tau, cap=None, t_cap=None):
    s = (h[:, :-1] @ w.T).reshape(-1, w.shape[0]).double()
    t = (th[:, :-1] @ tw.T).reshape(-1, w.shape[0])
    s = s if cap is None else cap * torch.tanh(s / cap)  # final logit soft-capping (Gemma 2)
    t = t if t_cap is None else t_cap * torch.tanh(t / t_cap)
    lm = F.cross_entropy(s, ids[:, 1:].reshape(-1))
    p = F.softmax(t / tau, -1)
    kd = (p * (p.log() - F.log_softmax(s / tau, -1))).sum(-1).mean() * tau**2
    return lm, kd


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("objective", ["lm", "kd", "kd+lm"])
@pytest.mark.parametrize("caps", [(None, None), (1.5, 2.5)], ids=["plain", "softcap"])
def test_chunked_losses_and_gradients_match_full_logits(chunk, objective, caps):
    h, w, ids, th, tw = _case()
    tau = 2.0
    loss, parts = recovery_loss(h, w, ids, objective, th, tw, tau=tau, kd_weight=0.5, chunk=chunk,
                                softcap=caps[0], teacher_softcap=caps[1])
    gh, gw = torch.autograd.grad(loss, (h, w))
    lm, kd = _direct(h, w, ids, th, tw, tau, *caps)
    ref = {"lm": lm, "kd": kd, "kd+lm": 0.5 * kd + lm}[objective]
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(loss.double(), ref, atol=1e-5)
    assert parts["lm"] == pytest.approx(lm.item(), abs=1e-5)
    assert (parts["kd"] is None) == (objective == "lm")
    assert torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


def test_kd_is_zero_with_no_gradient_when_student_is_teacher():
    h, w, ids, _, _ = _case()
    teacher_h, teacher_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss, _ = recovery_loss(h, w, ids, "kd", teacher_h, teacher_w, tau=1.5, chunk=3)
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert h.grad.abs().max() < 1e-6 and w.grad.abs().max() < 1e-6
    assert teacher_h.grad is None and teacher_w.grad is None  # the teacher is never trained


def test_kd_objective_needs_a_teacher():
    h, w, ids, _, _ = _case()
    with pytest.raises(ValueError, match="teacher"):
        recovery_loss(h, w, ids, "kd")
    with pytest.raises(ValueError, match="objective"):
        recovery_loss(h, w, ids, "mse")


@pytest.mark.parametrize("objective", ["lm", "kd+lm"])
def test_gradients_scale_with_the_outer_loss_and_skip_a_frozen_head(objective):
    # the gradients are taken to h and w in the forward pass (_FusedHeadLoss): backward must still scale
    # them by the incoming gradient (Trainer divides by grad_accum; other terms add to the loss) and give
    # none to a head that is not trained (finetune mode "attention")
    h, w, ids, th, tw = _case(seed=3)
    w.requires_grad_(False)
    loss, _ = recovery_loss(h, w, ids, objective, th, tw, tau=1.0, chunk=4)
    (gh,) = torch.autograd.grad(0.25 * loss + (h**2).sum(), (h,))
    lm, kd = _direct(h, w, ids, th, tw, 1.0)
    ref = lm if objective == "lm" else kd + lm
    (rh,) = torch.autograd.grad(0.25 * ref + (h**2).sum(), (h,))
    assert torch.allclose(gh, rh, atol=1e-6)


def test_cpu_chunks_keep_logits_under_the_mmap_threshold():
    from transmla.training.distill import CPU_CHUNK_BYTES, chunk_positions

    for vocab in (49_152, 151_936, 11):
        c = chunk_positions(1024, vocab, "cpu")
        assert c % 16 == 0 or c == 1024
        assert c * vocab * 4 <= CPU_CHUNK_BYTES or c == 16
        assert c == 1024 or (c + 16) * vocab * 4 > CPU_CHUNK_BYTES  # the largest such multiple of 16
    assert chunk_positions(1024, 11, "cpu") == 1024 and chunk_positions(8, 49_152, "cpu") == 8  # a ceiling
    assert chunk_positions(1024, 151_936, "cuda") == 1024  # the caching allocator has no such cost
