"""Multiple-choice log-likelihoods with each context encoded once.

lm-eval's HF backend scores every (context, choice) pair as its own sequence: a 4-choice question
encodes its context 4 times, and the output head and a full-vocabulary log-softmax run at every
context position although only the choice tokens are scored. Here the choices of one context are
packed behind it in one sequence,

    tokens     c_1 .. c_C | a_1 .. a_La | b_1 .. b_Lb | ...
    positions  0  .. C-1  | C .. C+La-1 | C .. C+Lb-1 | ...      (each choice restarts after the context)
    attention  causal in the context; each choice sees the context and its own earlier tokens

so the context is encoded once (MMLU, ARC, HellaSwag, OpenBookQA: 2-4x fewer tokens), and the
output head runs only at the positions that predict a choice token. The packed mask is a custom 4D
one, so attention is SDPA with an explicit mask; an MLA export's value head is narrower than its key
head, which sends that call to torch's slow "math" kernel on CPU, so the values are zero-padded to the
key width (`masked_padded_sdpa`: the same outputs after slicing, 3-4x faster attention). The log-likelihoods are those of
scoring each pair alone (the same attention, the same positions); tests compare them with lm-eval's.
A request whose context and choice do not fit the model's window goes to lm-eval's own path (which
truncates from the left).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from transmla.errors import TransMLAError
from transmla.method.diagnostics import use_recorded_latent_norm_eps

HEAD_ROWS = 512  # predicting positions per output-head call: 512 x 49,152 float32 logits = 100 MB (SmolLM2)
MASKED_PADDED_SDPA = "transmla_masked_padded_sdpa"


def masked_padded_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with the values zero-padded to the query/key head width where they are
    narrower (DeepSeek MLA: d_v < d_nope + d_rope), so a call with an explicit mask keeps torch's fused CPU
    kernel; padded output columns are sliced off (exact). query [b, h, t, e], value [b, h or g, t, d] ->
    ([b, t, h, d], weights)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dv = value.shape[-1]
    if dv >= query.shape[-1] or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query, key, F.pad(value, (0, query.shape[-1] - dv)), attention_mask,
                                          **kwargs)
    return out[..., :dv].contiguous(), weights


def use_masked_padded_sdpa(model):
    """Route a model's SDPA attention through masked_padded_sdpa (others, e.g. eager soft-capped layers, are kept)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(MASKED_PADDED_SDPA, masked_padded_sdpa)
        # without a mask function of its own transformers passes attention_mask=None for this name: lm-eval's own
        # path (requests too long to pack) then ran plain causal attention, past a sliding window (Mistral,
        # Gemma 3: log-likelihoods off by up to 4 nats, exit 0). A packed call's explicit 4D mask passes through.
        AttentionMaskInterface.register(MASKED_PADDED_SDPA, sdpa_mask)
        model.config._attn_implementation = MASKED_PADDED_SDPA
    return model


def mask_for(att: torch.Tensor, model) -> torch.Tensor:
    """The packed bool mask as the attention implementation reads it: SDPA takes a bool mask (True = attend);
    eager attention (Gemma 2's soft-capped layers) adds the mask to the scores, so it gets 0 / dtype-min."""
    if getattr(model.config, "_attn_implementation", None) in ("sdpa", MASKED_PADDED_SDPA):
        return att
    dtype = next(model.parameters()).dtype
    return torch.zeros(att.shape, dtype=dtype).masked_fill(~att, torch.finfo(dtype).min)


def pack_limit(model, max_length: int) -> int:
    """The longest packed sequence: a custom 4D mask replaces the model's own, so on a sliding-window model
    (Mistral, Gemma 2/3) a pack must fit in the window for every layer to see what the model would."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return min(max_length, window) if window else max_length


def shares_contexts(model) -> bool:
    """Whether the packed path scores `model` as its own forward would: it runs `model.model` and the output
    head with at most Gemma's final soft-capping, so only families whose head does nothing else qualify (the
    convertible ones, their MLA exports). Others (Granite's logits_scaling, Cohere's logit_scale, GPT-2's
    `transformer`) go through lm-eval's own path, which calls the whole model."""
    from transmla.adapters import SUPPORTED
    from transmla.models import MODEL_TYPES

    return getattr(model.config, "model_type", None) in {*SUPPORTED, *MODEL_TYPES, "deepseek_v3"}


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final logit soft-capping (Gemma 2/3's config.final_logit_softcapping): what the model's head applies."""
    return logits if not cap else cap * torch.tanh(logits / cap)


def pack(ctx: list[int], conts: list[list[int]]) -> tuple[list[int], list[int], torch.Tensor, list[tuple[list[int], list[int]]]]:
    """One packed sequence: (tokens, positions, attention [T, T] bool, per choice (positions whose
    output predicts its tokens, the tokens))."""
    C = len(ctx)
    tokens, pos = list(ctx), list(range(C))
    spans, targets = [], []
    for cont in conts:
        o = len(tokens)
        tokens += cont
        pos += range(C, C + len(cont))
        spans.append((o, len(cont)))
        targets.append(([C - 1] + list(range(o, o + len(cont) - 1)), cont))
    T = len(tokens)
    att = torch.zeros(T, T, dtype=torch.bool)
    att[:C, :C] = torch.ones(C, C, dtype=torch.bool).tril()
    for o, L in spans:
        att[o : o + L, :C] = True
        att[o : o + L, o : o + L] = torch.ones(L, L, dtype=torch.bool).tril()
    return tokens, pos, att, targets


class SharedContextLM(HFLM):
    """lm-eval's HFLM with `_loglikelihood_tokens` scoring the choices of each context in one packed sequence."""

    def __init__(self, *args, **kwargs):
        # lm-eval loads the checkpoint itself: as transmla.io.sources.load_model does, with this package's MLA
        # model types registered (Qwen3 / Gemma / Mixtral exports: otherwise only registered once another task
        # of the process had loaded a model), from safetensors only, and with the latent norms' recorded eps
        import transmla.models  # noqa: F401

        kwargs.setdefault("use_safetensors", True)
        super().__init__(*args, **kwargs)
        use_recorded_latent_norm_eps(self.model)
        use_masked_padded_sdpa(self.model)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        packs, alone = [], []  # packs: (context, [request indices])
        # a family the packed path would misread: every request goes lm-eval's own way, as one too long to pack
        limit = pack_limit(self.model, self.max_length) if shares_contexts(self.model) else 0
        for ctx, idx in groups.items():
            cur, size = [], len(ctx)
            for i in idx:
                L = len(requests[i][2])
                if len(ctx) + L > limit:
                    alone.append(i)
                    continue
                if cur and size + L > limit:
                    packs.append((list(ctx), cur))
                    cur, size = [], len(ctx)
                cur.append(i)
                size += L
            if cur:
                packs.append((list(ctx), cur))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        longest = max((len(requests[i][2]) for i in alone), default=0)
        if longest > self.max_length:  # lm-eval truncates the context from the left, never a choice: it asserts
            raise TransMLAError(f"a benchmark choice is {longest} tokens, longer than the model's context window "
                                f"({self.max_length} tokens): it cannot be scored.",
                                "evaluate a model with a longer context, or leave that benchmark out (--tasks).")
        if alone:
            for i, r in zip(alone, super()._loglikelihood_tokens([requests[i] for i in alone], disable_tqdm, override_bs)):
                out[i] = r
        packs.sort(key=lambda p: -(len(p[0]) + sum(len(requests[i][2]) for i in p[1])))
        bs = self.batch_size if isinstance(self.batch_size, int) else override_bs
        if bs is None and packs:  # "auto" (read as 8 before): lm-eval's detection at the longest pack's length, as
            ctx, idx = packs[0]  # its own path detects at its longest request's (packs are sorted longest first)
            bs = self._detect_batch_size([(None, ctx, [t for i in idx for t in requests[i][2]])])
        head = self.model.get_output_embeddings()
        bar = tqdm(total=len(requests) - len(alone), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests (shared contexts)")
        for s in range(0, len(packs), bs):
            batch = [pack(ctx, [requests[i][2] for i in idx]) for ctx, idx in packs[s : s + bs]]
            T = max(len(b[0]) for b in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            pos = torch.zeros(len(batch), T, dtype=torch.long)
            att = torch.eye(T, dtype=torch.bool).repeat(len(batch), 1, 1, 1)  # padding rows see themselves
            for b, (tok, p, a, _) in enumerate(batch):
                n = len(tok)
                ids[b, :n], pos[b, :n] = torch.tensor(tok), torch.tensor(p)
                att[b, 0, :n, :n] = a
            with torch.no_grad():
                h = self.model.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device),
                                     attention_mask=mask_for(att, self.model).to(self.device),
                                     use_cache=False).last_hidden_state
                choices = [(i, b, where, cont) for b, (_, idx) in enumerate(packs[s : s + bs])
                           for i, (where, cont) in zip(idx, batch[b][3])]
                for i, ll, greedy in self._score_choices(h, head, choices):
                    out[i] = (ll, greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
                    bar.update(1)
        bar.close()
        return out

    def _score_choices(self, h: torch.Tensor, head, choices, rows: int = HEAD_ROWS):
        """(request index, log-likelihood, greedy) of every choice of a batch. h [B, T, D]: the batch's
        final hidden states; choices: (request index, batch row, positions predicting its tokens, the tokens).
        The output head runs once over all the batch's predicting positions, `rows` at a time: one call per
        choice reads the whole head (vocab x D) for a few rows each time (SmolLM2-135M, 1,420 documents of the
        six benchmarks: 408 s of scoring with a call per choice, 342 s with one per batch)."""
        b_idx = torch.tensor([b for _, b, where, _ in choices for _ in where], device=h.device)
        t_idx = torch.tensor([t for _, _, where, _ in choices for t in where], device=h.device)
        tgt = torch.tensor([t for _, _, _, cont in choices for t in cont], device=h.device)
        sel = h[b_idx, t_idx]  # [P, D]
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        tok_lp, hit = [], []
        for a in range(0, len(tgt), rows):
            logp = F.log_softmax(softcapped(head(sel[a : a + rows]), cap).to(self.softmax_dtype), -1)  # [rows, V]
            tok_lp.append(logp.gather(1, tgt[a : a + rows, None])[:, 0])
            hit.append(logp.argmax(-1) == tgt[a : a + rows])
        lens = [len(cont) for *_, cont in choices]
        for (i, *_), lp, g in zip(choices, torch.cat(tok_lp).split(lens), torch.cat(hit).split(lens)):
            yield i, float(lp.sum()), bool(g.all())
