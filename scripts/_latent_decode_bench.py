import torch, time
import torch.nn.functional as F
from transmla.runtime import stream_gemm as s
t=time.time(); assert s.available(); print("build", time.time()-t)
def ref(q, lat, mask, scale, r):
    sc = torch.einsum("bhe,bte->bht", q.double(), lat.double()) * scale
    if mask is not None: sc = sc + mask.double().view(mask.shape[0], 1, -1)
    return (torch.softmax(sc, -1) @ lat[..., :r].double()).float()
g = torch.Generator().manual_seed(0)
for B, h, E, T, r in [(8, 9, 48, 4106, 32), (1, 9, 48, 7, 32), (2, 32, 576, 700, 512), (3, 5, 13, 300, 10), (2, 16, 40, 513, 33)]:
    q = torch.randn(B, h, E, generator=g); buf = torch.randn(B, T + 10, E, generator=g); lat = buf[:, :T]
    mask = torch.zeros(1, T); mask[:, -3:] = float("-inf")
    for mk in (None, mask, torch.where(torch.rand(B, T, generator=g) < 0.3, float("-inf"), 0.0)):
        got = s.latent_decode(q, lat, mk, 0.3, r); want = ref(q, lat, mk, 0.3, r)
        err = (got - want).abs().max().item()
        assert err < 1e-5 * max(1, want.abs().max().item()), (B, h, E, T, r, err)
print("correct")
B,h,E,T=8,9,48,4106
q=torch.randn(B,h,E); lats=[torch.randn(B,T,E) for _ in range(30)]; m=torch.zeros(1,T); m[:,-5:]=float('-inf')
for threads in (2,):
    torch.set_num_threads(threads)
    for name, fn in [("sdpa", lambda L: F.scaled_dot_product_attention(q.view(B,1,h,E), L.view(B,1,T,E), L.view(B,1,T,E), attn_mask=m.view(1,1,1,T), scale=0.1)),
                     ("kernel", lambda L: s.latent_decode(q, L, m, 0.1, 32))]:
        for L in lats[:3]: fn(L)
        best = 1e9
        for rep in range(5):
            t=time.perf_counter()
            for L in lats: fn(L)
            best = min(best, time.perf_counter()-t)
        print(threads, name, "30 layers ms", best*1e3)
L = lats[0]
for name, fn in [("sdpa", lambda L: F.scaled_dot_product_attention(q.view(B,1,h,E), L.view(B,1,T,E), L.view(B,1,T,E), attn_mask=m.view(1,1,1,T), scale=0.1)),
                 ("kernel", lambda L: s.latent_decode(q, L, m, 0.1, 32))]:
    for _ in range(3): fn(L)
    t=time.perf_counter()
    for _ in range(30): fn(L)
    print("hot", name, (time.perf_counter()-t)*1e3)
torch.set_num_threads(1)
t=time.perf_counter()
for _ in range(30): s.latent_decode(q, L, m, 0.1, 32)
print("hot 1 thread kernel", (time.perf_counter()-t)*1e3)
q1 = torch.randn(B, 8, E)
t=time.perf_counter()
for _ in range(30): s.latent_decode(q1, L, m, 0.1, 32)
print("hot 1 thread kernel 8 heads", (time.perf_counter()-t)*1e3)
