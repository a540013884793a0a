"""Calibration statistics, streamed in one forward pass.

For every layer we accumulate, in float64, the second moment and the mean of the attention input
x (the output of `input_layernorm`):

    xx[l] = sum_t x_t x_t^T   [D, D]      mean[l] = sum_t x_t   [D]      n = number of tokens

Every later step is a quadratic form of these: the key covariance per RoPE frequency group is
W_K E[x x^T] W_K^T (+ bias terms), the joint [k_nope; v] covariance, query norms, ... so no step
needs another forward pass, and memory is O(layers * D^2) however much data is used (the authors'
code keeps every q/k/v activation instead).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from transmla.errors import TransMLAError
from transmla.method.linalg import gram


def calibration_ids(tokenizer, texts: list[str], nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` random windows of `seqlen` tokens from the joined corpus (seeded). [nsamples, seqlen]"""
    ids = tokenizer("\n\n".join(t for t in texts if t.strip()), return_tensors="pt").input_ids[0]
    if ids.numel() < seqlen:
        raise TransMLAError(
            f"Calibration corpus has {ids.numel()} tokens, fewer than cal_seqlen={seqlen}.", "lower --cal-seqlen."
        )
    gen = torch.Generator().manual_seed(seed)
    # randint's bound is exclusive, so the last window start (numel - seqlen) is never drawn; the bound stays
    # as it is for longer corpora (any change redraws every window of every recorded conversion) and is only
    # lifted to 1 for a corpus of exactly seqlen tokens, whose one window starts at 0.
    starts = torch.randint(0, max(ids.numel() - seqlen, 1), (nsamples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


@dataclass
class LayerMoments:
    """What every conversion step of one layer needs from calibration: moments of its attention input.

    xx = E[x x^T] [D, D], mean = E[x] [D], float64. In `parallel` calibration they come from the
    original model (CalibrationStats); a layer-by-layer calibration produces them per layer instead.
    """

    xx: torch.Tensor
    mean: torch.Tensor

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"xx": self.xx, "mean": self.mean}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "LayerMoments":
        return cls(t["xx"], t["mean"])


class CalibrationStats:
    """Per-layer sums of x x^T and x over `n` tokens (float64)."""

    def __init__(self, xx: list[torch.Tensor], xsum: list[torch.Tensor], n: int):
        self.xx, self.xsum, self.n = xx, xsum, n

    def second_moment(self, layer: int) -> torch.Tensor:
        """E[x x^T], [D, D]."""
        return self.xx[layer] / self.n

    def mean(self, layer: int) -> torch.Tensor:
        """E[x], [D]."""
        return self.xsum[layer] / self.n

    def moments(self, layer: int) -> LayerMoments:
        return LayerMoments(self.second_moment(layer), self.mean(layer))

    @property
    def n_layers(self) -> int:
        return len(self.xx)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"n": torch.tensor([self.n], dtype=torch.int64)}
        for i, (a, b) in enumerate(zip(self.xx, self.xsum)):
            out[f"layers.{i}.xx"] = a
            out[f"layers.{i}.xsum"] = b
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "CalibrationStats":
        n_layers = sum(1 for k in t if k.endswith(".xx"))
        return cls(
            [t[f"layers.{i}.xx"] for i in range(n_layers)],
            [t[f"layers.{i}.xsum"] for i in range(n_layers)],
            int(t["n"].item()),
        )


@torch.no_grad()
def collect_stats(model, ids: torch.Tensor, batch_size: int = 8, progress: bool = True) -> CalibrationStats:
    """Run the decoder over `ids` [N, T] and accumulate per-layer statistics of the attention input."""
    layers = model.model.layers
    D = model.config.hidden_size
    xx = [torch.zeros(D, D, dtype=torch.float64) for _ in layers]
    xsum = [torch.zeros(D, dtype=torch.float64) for _ in layers]
    hooks = []

    def make_hook(i):
        def hook(_module, _inp, out):
            # One batch's products in float32 (a few thousand tokens: no precision issue, 3x faster
            # than float64 on CPU), accumulated across batches in float64.
            x = out.detach().reshape(-1, D).float()
            xx[i].add_(gram(x).cpu().double())
            xsum[i].add_(x.sum(0).cpu().double())

        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.input_layernorm.register_forward_hook(make_hook(i)))
    device = next(model.parameters()).device
    try:
        for s in tqdm(range(0, ids.shape[0], batch_size), desc="calibration", file=sys.stderr, disable=not progress):
            model.model(input_ids=ids[s : s + batch_size].to(device), use_cache=False)  # decoder only: no logits
    finally:
        for h in hooks:
            h.remove()
    return CalibrationStats(xx, xsum, ids.numel())


def mixed_calibration_ids(tokenizer, corpora: list[list[str]], nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """calibration_ids over several corpora, an equal share of the windows each (the first parts take
    the remainder); one corpus gives exactly calibration_ids. [nsamples, seqlen]"""
    if nsamples < len(corpora):
        raise TransMLAError(f"{nsamples} calibration windows cannot cover {len(corpora)} corpora.",
                            f"raise --cal-nsamples to at least {len(corpora)}.")
    counts = [nsamples // len(corpora) + (i < nsamples % len(corpora)) for i in range(len(corpora))]
    return torch.cat([calibration_ids(tokenizer, texts, n, seqlen, seed) for texts, n in zip(corpora, counts)])
