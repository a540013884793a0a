"""Layer-by-layer calibration: the calibration set's hidden states pushed through the model one layer at a time.

    h_0 = the first decoder layer's input                         [N, T, D] float32, kept in batches
    for l in layers:
        x_l = input_layernorm_l(h_l)  -> moments(l)               E[x x^T], E[x] for every conversion step
        (optional) refit_moments(l, mla) -> least-squares refit  (method.refit)
        h_{l+1} = decoder layer l with `attention` in place of its self-attention

`attention` is the converted MLA layer (sequential calibration: every layer is calibrated on the
activations of the model the user will run), the RoPE-dropped full-rank layer (the authors' second
pass) or None (the original layer: parallel statistics, used for a refit on the original model).
Cost: about one forward pass plus a layernorm per layer; memory: the hidden states plus O(D^2) per
layer, never any q/k/v activation of more than one batch.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from transmla.errors import TransMLAError
from transmla.method.calibration import LayerMoments
from transmla.method.linalg import gram
from transmla.method.mla import MLALayer
from transmla.method.refit import RefitMoments, head_blocks
from transmla.method.rope import rope_attention_scaling
from transmla.runtime.memory import trim_heap


class _Stop(Exception):
    pass


@dataclass
class MLAShapes:
    """h heads, NoPE/value head dim d, RoPE dim R, rank r, latent RMSNorm eps; RoPE frequencies `plan`."""

    h: int
    d: int
    R: int
    r: int
    eps: float
    plan: tuple[int, ...]
    qk_norm_eps: float | None = None  # Qwen3's QK-norm (method.qknorm): per-head query norm + key scales


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE (pairs (2p, 2p+1)), output in half-split order as transformers does;
    cos, sin [B, 1, T, R/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def mla_attention(x: torch.Tensor, layer: dict[str, torch.Tensor], s: MLAShapes, cos: torch.Tensor,
                  sin: torch.Tensor, scale: float | None = None, window: int | None = None,
                  softcap: float | None = None, rope_scale: float = 1.0) -> torch.Tensor:
    """Causal DeepseekV3Attention over x [B, T, D] in absorbed form (the same scores and outputs as the
    stock module; transmla.runtime.absorb). layer: MLALayer.to_tensors() in x's dtype; cos/sin
    [B, T, d] of the original model's RoPE (rotate_half layout). scale: the softmax scale (default
    (d + R)^-1/2, DeepSeek's); window: a sliding layer's window (keys t - u < window); softcap: Gemma 2's
    attention logit soft-capping; rope_scale: the factor cos/sin carry (method.rope.rope_attention_scaling),
    taken out of them (the caller puts its square on `scale`). Returns [B, T, D]."""
    return _output(attention_latents(x, layer, s, cos, sin, scale, window, softcap, rope_scale=rope_scale), layer, s)


def attention_latents(x: torch.Tensor, layer: dict[str, torch.Tensor], s: MLAShapes, cos: torch.Tensor,
                      sin: torch.Tensor, scale: float | None = None, window: int | None = None,
                      softcap: float | None = None, q: torch.Tensor | None = None,
                      rope_scale: float = 1.0) -> torch.Tensor:
    """z [B, h, T, r]: each head's attention-weighted latent sum_t p_t c_t (mla_attention before W_UV and
    o_proj; all the refit needs). q [B, T, h (d + R)]: the layer's q_proj(x) when the caller has it
    (a plain q_proj only)."""
    B, T, _ = x.shape
    h, d, R, r = s.h, s.d, s.R, s.r
    key_scale = None
    if q is not None:
        if "q_proj.weight" not in layer:
            raise ValueError("a precomputed query needs an MLA layer with a plain q_proj")
    elif "q_proj.weight" in layer:
        q = x @ layer["q_proj.weight"].T
    elif "k_norm_proj.weight" in layer:  # QK-norm: per-head query norm, one key scale per token and KV head
        dq = layer["q_a_layernorm.weight"].shape[0]
        qa = (x @ layer["q_a_proj.weight"].T).unflatten(-1, (-1, dq))
        q = _rms(qa, layer["q_a_layernorm.weight"], s.qk_norm_eps).flatten(-2) @ layer["q_b_proj.weight"].T
        k = (x @ layer["k_norm_proj.weight"].T).unflatten(-1, (-1, dq))  # [B, T, g, d]
        rho = torch.rsqrt(k.pow(2).mean(-1) + s.qk_norm_eps)  # [B, T, g]
        key_scale = rho.repeat_interleave(h // rho.shape[-1], -1).transpose(1, 2)  # [B, h, T]
    else:
        qa = x @ layer["q_a_proj.weight"].T
        if "q_a_proj.bias" in layer:
            qa = qa + layer["q_a_proj.bias"]
        q = _rms(qa, layer["q_a_layernorm.weight"], s.eps) @ layer["q_b_proj.weight"].T
    q = q.view(B, T, h, d + R).transpose(1, 2)
    q_nope, q_rot = q[..., :d], q[..., d:]
    kv = x @ layer["kv_a_proj_with_mqa.weight"].T
    if "kv_a_proj_with_mqa.bias" in layer:
        kv = kv + layer["kv_a_proj_with_mqa.bias"]
    c = _rms(kv[..., :r], layer["kv_a_layernorm.weight"], s.eps)[:, None]  # [B, 1, T, r]
    k_rot = kv[..., r:][:, None]
    idx = torch.tensor(s.plan, dtype=torch.long, device=x.device)
    cp, sp = cos[..., idx][:, None], sin[..., idx][:, None]
    if rope_scale != 1.0:
        cp, sp = cp / rope_scale, sp / rope_scale
    q_rot, k_rot = _rope_interleaved(q_rot, cp, sp), _rope_interleaved(k_rot, cp, sp)
    w_uk = layer["kv_b_proj.weight"].view(h, 2 * d, r)[:, :d]
    q_abs = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)
    return shared_key_attention(torch.cat([q_abs, q_rot], -1), torch.cat([c, k_rot], -1)[:, 0], c[:, 0],
                                1 / math.sqrt(d + R) if scale is None else scale, key_scale=key_scale, window=window,
                                softcap=softcap)


def shared_key_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                         max_scores: int = 1 << 25, key_scale: torch.Tensor | None = None,
                         window: int | None = None, block: int = 64, softcap: float | None = None) -> torch.Tensor:
    """Causal softmax(scale q key^T) value with one key/value shared by every head (MLA's latent head).

    q [B, h, T, e], key [B, T, e], value [B, T, r] -> [B, h, T, r]; key_scale [B, h, T] (optional)
    multiplies the scores of head j on key t (Qwen3's key norm); window (optional) limits each query to
    its last `window` keys (a sliding layer); softcap (optional) maps every score s to softcap tanh(s /
    softcap) before the mask (Gemma 2). The heads are folded into the query
    rows of one batched matmul: SDPA would need the key expanded to every head, a copy per head (a third
    of the conversion's attention time on SmolLM2). Queries go in blocks of `block` rows that score only
    the keys up to the block's end (from its window start), so the masked upper triangle is barely
    computed: about half the score and softmax work of full T x T scores. Heads go in chunks whose
    scores hold at most `max_scores` floats (long calibration windows stay in bounded memory).
    """
    B, h, T, e = q.shape
    out = torch.empty(B, h, T, value.shape[-1], dtype=q.dtype, device=q.device)
    kt = key.transpose(1, 2)  # [B, e, T]
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        u0 = 0 if window is None else max(0, t0 - window + 1)  # the block's first visible key
        nq, nk = t1 - t0, t1 - u0
        # query t0+i sees key u0+j iff u0+j <= t0+i (and, sliding, t0+i - (u0+j) < window)
        mask = torch.full((nq, nk), float("-inf"), dtype=q.dtype, device=q.device).triu(t0 - u0 + 1)
        if window is not None:
            mask = mask + torch.full((nq, nk), float("-inf"), dtype=q.dtype, device=q.device).tril(t0 - u0 - window)
        k = max(1, min(h, max_scores // (B * nq * nk)))
        for a in range(0, h, k):
            n = min(k, h - a)
            s = torch.bmm(q[:, a : a + n, t0:t1].reshape(B, n * nq, e), kt[:, :, u0:t1]).mul_(scale)
            s = s.view(B, n, nq, nk)
            if key_scale is not None:
                s.mul_(key_scale[:, a : a + n, None, u0:t1])
            if softcap is not None:
                s = s.div_(softcap).tanh_().mul_(softcap)
            s.add_(mask)
            p = torch.softmax(s, -1).view(B, n * nq, nk)
            out[:, a : a + n, t0:t1] = torch.bmm(p, value[:, u0:t1]).view(B, n, nq, -1)
    return out


def _output(z: torch.Tensor, layer: dict[str, torch.Tensor], s: MLAShapes) -> torch.Tensor:
    """o_proj(W_UV z): the attention output from the attention-weighted latents z [B, h, T, r]. [B, T, D]"""
    B, _, T, _ = z.shape
    w_uv = layer["kv_b_proj.weight"].view(s.h, 2 * s.d, s.r)[:, s.d :]
    out = torch.einsum("bhtr,hdr->bthd", z, w_uv).reshape(B, T, s.h * s.d) @ layer["o_proj.weight"].T
    return out + layer["o_proj.bias"] if "o_proj.bias" in layer else out


def _scores(layer: dict[str, torch.Tensor], s: MLAShapes) -> list[torch.Tensor]:
    """The weights z depends on: queries, kv_a (+ norm) and W_UK."""
    keep = [v for k, v in sorted(layer.items()) if k.startswith(("q_", "kv_a", "k_norm"))]
    return keep + [layer["kv_b_proj.weight"].view(s.h, 2 * s.d, s.r)[:, : s.d]]


def query_map(mla_q: torch.Tensor, wq: torch.Tensor, h: int, tol: float = 1e-6) -> torch.Tensor | None:
    """A [h, e, d] such that the MLA q_proj's head i (mla_q [h e, D]) is A_i times the original q_proj's
    head i (wq [h d, D]), or None when no per-head map reproduces it (relative error above `tol`).

    TransMLA's query is the original head's query scaled and RoRoPE-rotated (method.mla.query_weights),
    so the refit's pass derives it from the original attention's own q_proj output: h e d multiply-adds
    per token instead of h e D (on SmolLM2 9 x 96 x 64 instead of 864 x 576, ~6% of a conversion)."""
    D = wq.shape[1]
    if mla_q.shape[1] != D or mla_q.shape[0] % h or wq.shape[0] % h:
        return None
    W = wq.double().view(h, -1, D).transpose(1, 2)  # [h, D, d]
    M = mla_q.double().view(h, -1, D).transpose(1, 2)  # [h, D, e]
    # gelsd (SVD): the default gelsy (QR with column pivoting; MKL here) rounds differently call to call on
    # the same input, and the sequential refit amplified that into another 68.75% conversion on every run
    At = torch.linalg.lstsq(W, M, driver="gelsd").solution  # [h, d, e]: W_i At_i = M_i
    err = torch.linalg.matrix_norm(W @ At - M) / torch.linalg.matrix_norm(M).clamp_min(1e-300)
    return At.transpose(1, 2).contiguous() if bool((err <= tol).all()) else None


class _Attention(nn.Module):
    """Stands in for a decoder layer's self-attention while the stream passes through it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, hidden_states, position_embeddings=None, **_):
        return self.fn(hidden_states, position_embeddings), None


class LayerStream:
    """The calibration hidden states at the current layer, in batches of `batch_size` windows."""

    def __init__(self, model, ids: torch.Tensor, batch_size: int = 8, progress: bool = True):
        cfg = model.config
        self.model, self.layers = model, model.model.layers
        # each layer type (full / sliding attention: Gemma 3) has its own mask and RoPE, passed by the model
        self.types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(self.layers))
        if set(self.types) - {"full_attention", "sliding_attention"}:
            raise TransMLAError(f"layer-by-layer calibration does not know the layer types {set(self.types)}.",
                                "use `calibration: parallel` and no refit for this model.")
        firsts = {t: self.types.index(t) for t in dict.fromkeys(self.types)}  # first layer of each type
        self.device = next(model.parameters()).device
        self.n, self.layer, self.progress = ids.numel(), 0, progress
        self.h: list[torch.Tensor] = []
        self.kwargs: list[dict[str, dict]] = []  # per batch: layer type -> the decoder layer's keyword arguments
        self._z = None  # (layer, the weights z depends on, z per batch) from refit_moments

        def grab(layer_type, last):
            def hook(_module, args, kwargs):
                hs = args[0] if args else kwargs.get("hidden_states")
                if not self.kwargs or len(self.kwargs[-1]) == len(firsts):
                    self.h.append(hs.detach().float())
                    self.kwargs.append({})
                self.kwargs[-1][layer_type] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                if last:
                    raise _Stop
            return hook

        stop = max(firsts.values())
        hooks = [self.layers[i].register_forward_pre_hook(grab(t, i == stop), with_kwargs=True) for t, i in firsts.items()]
        try:
            with torch.no_grad():
                for s in range(0, ids.shape[0], batch_size):
                    try:
                        model.model(input_ids=ids[s : s + batch_size].to(self.device), use_cache=False)
                    except _Stop:
                        pass
        finally:
            for hook in hooks:
                hook.remove()

    def _kw(self, b: int, layer: int) -> dict:
        """Decoder layer `layer`'s keyword arguments for batch b (its type's mask and RoPE)."""
        return self.kwargs[b][self.types[layer]]

    @staticmethod
    def _sim(attn, s: MLAShapes) -> dict:
        """The MLA simulation's softmax scale, window and soft-capping for a layer whose original attention is `attn`."""
        scaling = getattr(attn, "scaling", None)
        scale = None if scaling is None or scaling == s.d**-0.5 else scaling * math.sqrt(s.d / (s.d + s.R))
        # YaRN / LongRoPE's attention factor: on every score dimension, as the exported Gemma layers put it
        m = rope_attention_scaling(attn.config, getattr(attn, "layer_type", None)) if hasattr(attn, "config") else 1.0
        if m != 1.0:
            scale = (scale if scale is not None else (s.d + s.R) ** -0.5) * m * m
        return {"scale": scale, "window": getattr(attn, "sliding_window", None),
                "softcap": getattr(attn, "attn_logit_softcapping", None), "rope_scale": m}

    @staticmethod
    def _query_map(attn, w: dict[str, torch.Tensor], s: MLAShapes) -> torch.Tensor | None:
        """query_map for a layer whose original attention has a plain, bias-free q_proj and whose MLA
        query is a per-head map of it (None otherwise: the MLA query is computed from x)."""
        qp = getattr(attn, "q_proj", None)
        if "q_proj.weight" not in w or not isinstance(qp, nn.Linear) or qp.bias is not None:
            return None
        A = query_map(w["q_proj.weight"], qp.weight.detach().cpu(), s.h)  # the MLA weights are on the CPU
        return None if A is None else A.to(qp.weight)

    def _bar(self, what: str):
        return tqdm(range(len(self.h)), desc=f"{what} layer {self.layer}", file=sys.stderr, leave=False,
                    disable=not self.progress)

    @torch.no_grad()
    def moments(self, layer: int) -> LayerMoments:
        """E[x x^T], E[x] of layer `layer`'s attention input over the stream (float64)."""
        self._check(layer)
        ln = self.layers[layer].input_layernorm
        D = self.h[0].shape[-1]
        xx = torch.zeros(D, D, dtype=torch.float64)
        xs = torch.zeros(D, dtype=torch.float64)
        for b in self._bar("moments"):
            x = ln(self.h[b]).reshape(-1, D).float()
            xx += gram(x).cpu().double()
            xs += x.sum(0).cpu().double()
        trim_heap()  # each step's freed activations fragment the heap (runtime.memory)
        return LayerMoments(xx / self.n, xs / self.n)

    @torch.no_grad()
    def refit_moments(self, layer: int, mla: MLALayer, s: MLAShapes, value_bias: torch.Tensor | None,
                      max_dim: int) -> list[RefitMoments]:
        """Second moments of Z (the converted layer's attention-weighted latents z_i = sum_t p_t c_t, heads
        stacked) and cross moments with Y (the original layer's attention output before its bias, value bias
        removed), on the stream's inputs, per block of heads (method.refit.head_blocks)."""
        self._check(layer)
        dec = self.layers[layer]
        exact = mla.to_tensors()
        w = {k: v.to(self.h[0].dtype).to(self.device) for k, v in exact.items()}
        wo = dec.self_attn.o_proj.weight.detach().to(self.h[0].dtype).view(-1, s.h, s.d)  # [D, h, d]
        blocks = head_blocks(s.h, s.r, max_dim)
        D = wo.shape[0]
        # Y_j = W_O,H y_H is never formed per batch: E[y_H Z^T] and E[y_H y_H^T] (|H| d wide, not D) are
        # mapped through W_O,H once at the end, which saves the [tokens, D] projection of every batch.
        zz = [torch.zeros(len(b) * s.r, len(b) * s.r, dtype=torch.float64) for b in blocks]
        yzh = [torch.zeros(len(b) * s.d, len(b) * s.r, dtype=torch.float64) for b in blocks]
        yyh = [torch.zeros(len(b) * s.d, len(b) * s.d, dtype=torch.float64) for b in blocks]
        captured = []
        keep = s.h * s.r <= 2 * self.h[0].shape[-1]  # z no larger than 2 hidden states: keep it for advance()
        # allocated before any batch's temporaries, so kept latents do not pin the heap between them
        zs = [torch.empty(h.shape[0], s.h, h.shape[1], s.r, dtype=h.dtype, device=h.device) for h in self.h] if keep else []

        def grab(_m, a):  # o_proj's input is all the refit needs: skip o_proj itself
            captured.append(a[0])
            raise _Stop

        queries = []
        qmap = self._query_map(dec.self_attn, exact, s)
        sim = self._sim(dec.self_attn, s)
        hooks = [dec.self_attn.o_proj.register_forward_pre_hook(grab)]
        if qmap is not None:
            hooks.append(dec.self_attn.q_proj.register_forward_hook(lambda _m, _a, out: queries.append(out)))
        try:
            for b in self._bar("refit"):
                x = dec.input_layernorm(self.h[b])
                kw = self._kw(b, layer)
                captured.clear()
                queries.clear()
                try:
                    dec.self_attn(hidden_states=x, **kw)
                except _Stop:
                    pass
                B, T, _ = x.shape
                y = captured[0].view(B * T, s.h, s.d)
                if value_bias is not None:
                    y = y - value_bias.view(1, s.h, s.d).to(y)
                cos, sin = kw["position_embeddings"]
                q = None
                if qmap is not None:  # the MLA query from the original one: [B, T, h d] -> [B, T, h (d + R)]
                    q = torch.einsum("bthd,hed->bthe", queries[0].view(B, T, s.h, -1), qmap).reshape(B, T, -1)
                z = attention_latents(x, w, s, cos, sin, **sim, q=q)  # [B, h, T, r]
                Z = z.permute(0, 2, 1, 3).reshape(B * T, s.h * s.r)
                for j, heads in enumerate(blocks):
                    Zj = Z[:, heads.start * s.r : heads.stop * s.r]
                    yj = y[:, heads.start : heads.stop].reshape(B * T, -1)
                    zz[j] += gram(Zj).cpu().double()
                    yzh[j] += (yj.T @ Zj).cpu().double()
                    yyh[j] += gram(yj).cpu().double()
                if keep:
                    zs[b].copy_(z)
        finally:
            for hook in hooks:
                hook.remove()
        self._z = (layer, _scores(w, s), zs) if keep else None
        trim_heap()
        out = []
        for hb, a, c, e in zip(blocks, zz, yzh, yyh):
            W = wo[:, hb.start : hb.stop].reshape(D, -1).double().cpu()  # W_O,H [D, |H| d]
            out.append(RefitMoments(hb, a / self.n, W @ c / self.n, float(((W @ e) * W).sum()) / self.n))
        return out

    @torch.no_grad()
    def advance(self, layer: int, mla: MLALayer | None, s: MLAShapes | None = None) -> None:
        """h <- decoder layer `layer`(h), with the MLA attention `mla` in place of the original one (None: original)."""
        self._check(layer)
        dec = self.layers[layer]
        original = dec.self_attn
        if mla is not None:
            w = {k: v.to(self.h[0].dtype).to(self.device) for k, v in mla.to_tensors().items()}
            z = self._z
            if z is not None and z[0] == layer and all(torch.equal(a, b) for a, b in zip(z[1], _scores(w, s))):
                # the refit changed W_UV and o_proj only: the attention-weighted latents of refit_moments still hold
                dec.self_attn = _Attention(lambda x, pe: _output(z[2][b], w, s))  # b: the batch below
            else:
                sim = self._sim(original, s)
                dec.self_attn = _Attention(lambda x, pe: mla_attention(x, w, s, *pe, **sim))
        self._z = None
        try:
            for b in self._bar("advance"):
                out = dec(self.h[b], **self._kw(b, layer))
                # in place: a new tensor per batch would pin the heap between the batch's freed temporaries
                self.h[b].copy_(out[0] if isinstance(out, tuple) else out)
        finally:
            dec.self_attn = original
        trim_heap()
        self.layer += 1

    def _check(self, layer: int) -> None:
        if layer != self.layer:
            raise RuntimeError(f"the stream is at layer {self.layer}, not {layer}")
