"""Temporary GPU tuning script for decode_attention_next (run on the device; deleted after)."""
import json, math, os, sys, time
import torch
T0 = time.time()
LIMIT = float(os.environ.get("TUNE_LIMIT", "230"))
from zipkv import bench
from zipkv.kernels import decode_attention_next as DA
OUT = os.environ.get("OUT", "/tmp")
res = []
def log(**kw):
    kw["t"] = round(time.time() - T0, 1)
    res.append(kw); print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/tune.json", "w"), indent=1)

timer = bench.ColdTimer()
B, HKV, HQ, D, CTX = 64, 8, 32, 128, 8192
gen = torch.Generator(device="cuda").manual_seed(0)
k, v = bench._compressible_kv(B, HKV, CTX, D, gen)
q = torch.randn(B, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
ref = bench._reference_attention(q, k, v)
caches = {}
for name, mode in (("C", "eligible"), ("U", "none")):
    cache, ip, idx, last = DA.build_paged_cache(k, v, compress=mode, seed=0)
    st = cache.stats()
    caches[name] = (cache, ip, idx, last, st["used_bytes"] + cache.desc.numel() * 8 + idx.numel() * 4)
log(stage="setup", kv_bytes={n: c[4] for n, c in caches.items()})
copy_bw = bench.copy_bandwidth(1 << 30, reps=5)
log(stage="copy_bw", tbps=copy_bw / 1e12)

def run(tag, cname, ppt, warps, splits, branch=True, stages=1, reps=15):
    if time.time() - T0 > LIMIT:
        return None
    cache, ip, idx, last, nbytes = caches[cname]
    DA._TUNE.update(stages=stages, num_warps=warps, branch=branch)
    fn = lambda: DA.decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt, validate=False)
    try:
        t1 = time.time()
        out = fn(); torch.cuda.synchronize()
        ct = time.time() - t1
        err = float((out.float() - ref).norm() / ref.norm())
        us = timer(fn, reps=reps)
        log(tag=tag, cache=cname, ppt=ppt, warps=warps, splits=splits, branch=branch, stages=stages,
            us=round(us, 1), tbps=round(nbytes / us / 1e6, 3), frac_roof=round(nbytes / (us * 1e-6) / copy_bw, 3),
            err=err, first_call_s=round(ct, 1))
        return us
    except Exception as e:
        log(tag=tag, cache=cname, ppt=ppt, warps=warps, splits=splits, error=repr(e)[:300])

V = [  # (ppt, warps, splits, branch, stages)
    (4, 4, 1, True, 1), (4, 4, 2, True, 1), (8, 4, 1, True, 1), (4, 8, 1, True, 1), (8, 8, 1, True, 1),
    (2, 4, 2, True, 1), (4, 4, 4, True, 1), (8, 8, 2, True, 1), (4, 4, 2, False, 2), (4, 4, 1, False, 1),
]
for (ppt, w, s, br, stg) in V:
    for cname in ("C", "U"):
        run("v", cname, ppt, w, s, br, stg)
# measured-mix style cache (random 80 % of blocks compressed) with the best compressed config
best = min((r for r in res if r.get("cache") == "C" and "us" in r), key=lambda r: r["us"], default=None)
if best and time.time() - T0 < LIMIT:
    cache, ip, idx, last = DA.build_paged_cache(k, v, compress=0.8, seed=0)
    st = cache.stats()
    caches["M"] = (cache, ip, idx, last, st["used_bytes"] + cache.desc.numel() * 8 + idx.numel() * 4)
    run("mix", "M", best["ppt"], best["warps"], best["splits"], best["branch"], best["stages"])
    del caches["M"], cache
# pack throughput, pages_per_program variants
from zipkv.kernels.pack import pack_pages
n_pages = (1 << 30) // (16 * D * 2)
pages = bench._compressible_kv(1, 1, n_pages * 16, D, gen)[0].reshape(n_pages, 16, D)
outb = torch.empty(n_pages, 32 * D, dtype=torch.uint8, device="cuda")
for ppp in (2, 4, 8, 16):
    if time.time() - T0 > LIMIT + 20:
        break
    pack_pages(pages, out=outb, pages_per_program=ppp)
    us = timer(lambda: pack_pages(pages, out=outb, pages_per_program=ppp), reps=10)
    log(tag="pack", ppp=ppp, us=round(us, 1), input_tbps=round((1 << 30) / us / 1e6, 3))
del pages, outb
# FlashInfer tensor-core anchor, same data
if time.time() - T0 < LIMIT + 30 and os.environ.get("NO_FI") is None:
    try:
        PAGE = 16
        kp = k.reshape(B, HKV, CTX // PAGE, PAGE, D).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, HKV, D).contiguous()
        vp = v.reshape(B, HKV, CTX // PAGE, PAGE, D).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, HKV, D).contiguous()
        ipf = torch.arange(B + 1, device="cuda", dtype=torch.int32) * (CTX // PAGE)
        idf = torch.arange(B * CTX // PAGE, device="cuda", dtype=torch.int32)
        lf = torch.full((B,), PAGE, device="cuda", dtype=torch.int32)
        runner = bench.FlashInferDecode(ipf, idf, lf, HQ, HKV, D, PAGE, True)
        o = runner(q, kp, vp)
        us = timer(lambda: runner(q, kp, vp), reps=15)
        log(tag="flashinfer_tc", us=round(us, 1), err=float((o.float() - ref).norm() / ref.norm()),
            tbps=round(2 * k.numel() * 2 / us / 1e6, 3))
    except Exception as e:
        log(tag="flashinfer_tc", error=repr(e)[:300])
print("TABLE")
for r in res:
    if "us" in r:
        print(r.get("tag"), r.get("cache", ""), r.get("ppt", ""), r.get("warps", ""), r.get("splits", ""), r.get("branch", ""),
              r.get("stages", ""), r["us"], r.get("tbps", r.get("input_tbps")), r.get("frac_roof", ""), r.get("err", ""))
