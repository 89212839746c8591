"""Where zipkv's per-layer fit spends its time at Llama-3.1-8B's shape and N = 32,768 (random inputs), and the probe."""
import time

import torch

from zipkv.distill import generalise as G


def timed(name, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"{name:28s} {time.perf_counter() - t0:7.3f} s", flush=True)
    return out


torch.manual_seed(0)
dev = "cuda"
P, N, d, m = 8, 32768, 128, 256
k = round(0.3 * N) - m
keys = torch.randn(P, N, d, device=dev)
values = torch.randn(P, N, d, device=dev)
train = torch.randn(P, 8192, d, device=dev)
val = torch.randn(P, 2048, d, device=dev)
cfg = G.ZipkvConfig()
for rep in range(2):
    print("rep", rep)
    _, _, t, a_old, scale = timed("layer_targets", lambda: G.layer_targets(keys, values, train, m, k, None, torch.float32, None))
    imp = timed("importance+topk", lambda: torch.topk(a_old.mean(dim=1), k, dim=1).indices.sort(dim=1).values)
    del a_old
    g = imp[..., None].expand(-1, -1, d)
    kc, vsel = keys.gather(1, g), values.gather(1, g)
    bias = timed("mass_bias", lambda: G.mass_bias(t, imp, cfg.mass_ridge, cfg.bias_bound))
    cands = timed("anchored_values", lambda: G.anchored_values(t, kc, bias, vsel, values[:, N - m:], cfg.value_ridges))
    v = timed("validation targets", lambda: G.HeadTargets.of(val, keys, values, m, scale))
    timed("objectives", lambda: torch.stack([sum(G.objective(v, kc, vc, bias, values[:, N - m:])) for vc in cands]))
    timed("distil_layer (all)", lambda: G.distil_layer(keys, values, train, val, m, k, cfg))
    timed("distil_layer, 1 head", lambda: G.distil_layer(keys[:1], values[:1], train[:1], val[:1], m, k, cfg))
    gram = torch.randn(P, k, k, device=dev, dtype=torch.float64)
    gram = gram @ gram.transpose(1, 2) + k * torch.eye(k, device=dev, dtype=torch.float64)
    rhs = torch.randn(P, k, d, device=dev, dtype=torch.float64)
    timed("cholesky fp64 [8, k, k]", lambda: torch.linalg.cholesky_ex(gram))
    timed("_spd_solve fp64 (d rhs)", lambda: G._spd_solve(gram, rhs))
    g32 = gram.float()
    timed("cholesky fp32 [8, k, k]", lambda: torch.linalg.cholesky_ex(g32))
    a = torch.randn(P, 8192, k, device=dev, dtype=torch.float64)
    timed("gram a^T a fp64", lambda: torch.bmm(a.transpose(1, 2), a))
    a32 = a.float()
    timed("gram a^T a fp32", lambda: torch.bmm(a32.transpose(1, 2), a32))
    del gram, rhs, g32, a, a32, t, v, cands, bias, kc, vsel
    torch.cuda.empty_cache()

from zipkv import models  # noqa: E402

model = models.random_model("smollm2-135m")
model.set_attn_implementation("sdpa")
ids = torch.randint(0, 49152, (2048,))
cap = timed("capture smollm 2K", lambda: models.capture(model, ids))
for rep in range(2):
    import cProfile, pstats
    pr = cProfile.Profile()
    pr.enable()
    timed("sample_probe smollm 2K", lambda: G.sample_probe(model, cap, ids, 64))
    pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(14)
