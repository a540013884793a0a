"""KV budget -> MLA shapes: which RoPE frequencies are kept and the latent rank."""

from __future__ import annotations

from dataclasses import dataclass

from transmla.adapters import GQASpec
from transmla.config import ConvertOptions
from transmla.errors import TransMLAError
from transmla.method.rope import lossless_plan, standard_plan
from transmla.method.rorope import validate_freqfold


@dataclass(frozen=True)
class Budget:
    """Resolved MLA shapes: RoPE plan (frequency index of each RoPE pair) and kv_lora_rank."""

    plan: tuple[int, ...]
    kv_lora_rank: int
    original_kv: int  # values cached per token per layer by the GQA model: 2 g d
    key_scales: int = 0  # QK-norm models (Qwen3, Gemma 3): one cached key scale per token and KV head, g

    @classmethod
    def of(cls, spec, plan, kv_lora_rank: int) -> "Budget":
        """The budget of `spec`'s model with this RoPE plan and rank: its original cache (2 g d) and, for a
        QK-norm model, the key scales it caches beside the latent (what every record's ratio counts)."""
        return cls(tuple(plan), kv_lora_rank, 2 * spec.g * spec.d, spec.g if spec.qk_norm else 0)

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.plan)

    @property
    def mla_kv(self) -> int:
        """Width of the compressed key/value row kv_a_proj_with_mqa writes: r + R."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def cached_kv(self) -> int:
        """Values the MLA layer caches per token: r + R, plus the key scales of a QK-norm model."""
        return self.mla_kv + self.key_scales

    @property
    def ratio(self) -> float:
        return self.cached_kv / self.original_kv


def check_mode(spec: GQASpec, o: ConvertOptions) -> None:
    """Refuse mode x architecture pairs the converter cannot run yet."""
    n = o.normalized()
    if n.calibration == "two_pass" and spec.qk_norm:
        raise TransMLAError("The two-pass mode's RoPE-dropped layers are not built for QK-norm models.",
                            "use --calibration sequential (the default) or parallel.")
    if spec.qk_norm and o.q_lora_rank is not None:
        raise TransMLAError("--q-lora-rank cannot be combined with the QK-norm of Qwen3 or Gemma 3 (its q-LoRA path "
                            "holds the query norm).",
                            "drop --q-lora-rank.")


def _largest_rope_dim(d: int, cap: float) -> int | None:
    """The largest RoPE dim d/c (c divides d, even) not above cap; None when none is."""
    options = [d // c for c in range(1, d + 1) if d % c == 0 and (d // c) % 2 == 0 and d // c <= cap]
    return max(options, default=None)


def resolve_budget(spec: GQASpec, o: ConvertOptions) -> Budget:
    """Pick RoPE dim and rank from the options; one clear error for anything impossible.

    --kv-cache-ratio X: budget B = round(X * 2 g d) values per token; RoPE dim R = the largest d/c
    (c | d, R even) with R <= min(d/2, B/2), rank = B - R. This reproduces the paper's settings
    (Llama-2-7B 92.97%: R=64, r=512; SmolLM2 68.75%: R=32, r=88; 87.5%: R=16, r=32) and gives models with
    few KV heads the RoPE they need: Qwen2.5-0.5B (g=2) gets 32 + 48 at 68.75% and 16 + 16 at 87.5%
    (measured far better than 16 + 64 and 8 + 24 with B/3: WikiText-2 -30% and -60%, quick protocol).
    """
    g, d = spec.g, spec.d
    L = g * d
    if d % 2:  # RoPE rotates (real, imaginary) pairs of head dims: the method has nothing to pair otherwise
        raise TransMLAError(f"head_dim={d} is odd: RoPE needs an even head dim, so this config cannot be a RoPE model's.",
                            "check head_dim (or hidden_size / num_attention_heads) in the source's config.json.")
    # the normalized freqfold: MHA2MLA and lossless mode ignore the one asked for (and set 1)
    validate_freqfold(o.normalized().freqfold, d)
    check_mode(spec, o)
    if o.lossless:  # ConvertOptions refuses lossless with any budget option
        return Budget.of(spec, lossless_plan(d, g), L)
    R = o.qk_rope_dim
    r = o.kv_lora_rank
    if o.kv_cache_ratio is not None or (R is None and r is None):
        ratio = 0.25 if o.kv_cache_ratio is None else o.kv_cache_ratio
        B = round(ratio * 2 * L)
        if R is None:
            R = _largest_rope_dim(d, min(d // 2, B / 2))
            if R is None:
                raise TransMLAError(f"kv_cache_ratio={ratio} leaves {B} values per token: too few for any RoPE dim.",
                                    "raise --kv-cache-ratio.")
        elif R >= B:  # the RoPE dims alone fill the budget: no room for a latent
            raise TransMLAError(f"kv_cache_ratio={ratio} means {B} cached values per token, and qk_rope_dim={R} "
                                "leaves none for the latent.",
                                f"lower --qk-rope-dim below {B} (or drop it) or raise --kv-cache-ratio.")
        if r is None:
            r = B - R
        elif R + r != B:  # an explicit rank that disagrees with the ratio's budget: neither may win silently
            picked = "" if o.qk_rope_dim is not None else " (the ratio's pick)"
            raise TransMLAError(
                f"kv_cache_ratio={ratio} means {B} cached values per token, but qk_rope_dim={R}{picked} + "
                f"kv_lora_rank={r} = {R + r}.",
                f"give either --kv-cache-ratio or --kv-lora-rank, not both (with the ratio and qk_rope_dim={R}, "
                f"kv_lora_rank is {B - R}).",
            )
    elif R is None:  # half the head dim, or the largest RoPE dim a head of this size can have under it
        R = _largest_rope_dim(d, d // 2)
        if R is None:
            raise TransMLAError(f"head_dim={d} has no RoPE dim to keep.", "check head_dim in the source's config.json.")
    elif r is None:
        r = 2 * L - R  # full rank: only RoPE is dropped
    plan = standard_plan(d, R)
    if not 1 <= r <= 2 * L - R:
        raise TransMLAError(
            f"kv_lora_rank={r} is impossible for this model: with qk_rope_head_dim={R} the NoPE keys and values "
            f"span at most 2*g*d - R = {2 * L - R} dims.",
            f"choose kv_lora_rank between 1 and {2 * L - R}.",
        )
    return Budget.of(spec, plan, r)  # a QK-norm model's key scales are cached too: in the ratio, not in r + R
