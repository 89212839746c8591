"""zipkv.kernels.decode_attention: fused decode attention over a paged, partly compressed
cache vs the fp32 reference (unpack with zipkv.format, then fp32 attention).

On CPU the kernel runs under TRITON_INTERPRET=1 with its fp32 path (bf16 math is wrong in
the interpreter); tiny shapes keep the number of programs small."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from zipkv import format as fmt  # noqa: E402
from zipkv.kernels.decode_attention import (PagedKVCache, build_paged_cache,  # noqa: E402
                                            decode_attention, plan)
from zipkv.kernels.reference import decode_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(B, HKV, G, T, D, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, T, D, generator=g)
    v = torch.randn(B, HKV, T, D, generator=g)
    if outliers:  # make some blocks ineligible (exponent spread > 15)
        k[..., 16:20, 3] *= 3e4                    # page 1: one K block raw in either layout
        v[..., 33:34, -5] *= 1e-6                  # page 2: one V block raw
    q = torch.randn(B, HKV * G, D, generator=g)
    return q.to(torch.bfloat16).to(DEV), k.to(torch.bfloat16).to(DEV), v.to(torch.bfloat16).to(DEV)


def check(out, ref, tol_rms=1e-2, tol_max=3e-2):
    out = out.float()
    err = out - ref
    rel = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    mx = err.abs().max().item()
    msg = f"relative RMS error {rel:.3e}, max abs diff {mx:.3e}"
    assert torch.isfinite(out).all(), msg
    assert rel < tol_rms and mx < tol_max * max(1.0, ref.abs().max().item()), msg
    return rel, mx


CASES = [
    # B, HKV, G, T, D, seq_lens, k_layout, v_layout, splits, pages_per_tile, compress
    (1, 1, 1, 1, 32, None, "token", "token", 1, 1, "eligible"),              # 1 token
    (1, 2, 3, 15, 64, None, "channel", "token", 1, 1, "eligible"),           # 15: one partial page
    (1, 1, 4, 17, 128, None, "token", "channel", 1, 1, "eligible"),          # 17: full + 1
    (3, 2, 3, 50, 64, [1, 50, 33], "token", "token", 1, 2, 0.5),             # variable lengths, mixed
    (2, 1, 4, 64, 128, [64, 47], "channel", "channel", 3, 1, "eligible"),    # split-KV, full last page
    (2, 2, 1, 40, 256, [40, 16], "token", "channel", 2, 2, 0.5),             # d=256, G=1, split
    (2, 1, 8, 80, 64, [80, 2], "channel", "token", 4, 1, "none"),            # uncompressed, empty splits
]


@pytest.mark.parametrize("B,HKV,G,T,D,lens,kl,vl,splits,ppt,compress", CASES)
def test_matches_reference(B, HKV, G, T, D, lens, kl, vl, splits, ppt, compress):
    q, k, v = make_inputs(B, HKV, G, T, D, seed=T + D)
    cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout=kl, v_layout=vl, compress=compress,
                                             compact=(T % 2 == 0))
    out = decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    check(out, decode_attention_reference(q, cache, ip, idx, last))
    # and against plain attention on the original K/V (the cache is lossless)
    Ls = lens or [T] * B
    for b in range(B):
        kb = k[b, :, : Ls[b]].float().repeat_interleave(G, 0)
        vb = v[b, :, : Ls[b]].float().repeat_interleave(G, 0)
        s = torch.einsum("hd,htd->ht", q[b].float(), kb) / D ** 0.5
        check(out[b], torch.einsum("ht,htd->hd", s.softmax(-1), vb))


def poison_past_last_token(cache, indptr, indices, last_page_len):
    """Fill every raw last page's slots past ``last_page_len`` with inf, -inf and nan bf16 (in turn), as a
    serving engine's reused slot may hold any old bytes there. The last pages must be all raw."""
    pool = cache.pool.view(torch.bfloat16)
    bad = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.bfloat16, device=pool.device)
    nb = fmt.n_blocks(cache.head_dim)
    for b in range(indptr.numel() - 1):
        page, n = int(indices[int(indptr[b + 1]) - 1]), int(last_page_len[b])
        for kv, layout in enumerate((cache.k_layout, cache.v_layout)):
            at = torch.arange(nb)[:, None] * fmt.BLOCK_VALUES + fmt.raw_index(layout)   # raw bf16 index per position
            pos = fmt.from_blocks(at, layout, cache.head_dim)[n:].reshape(-1).to(pool.device)   # tokens >= n
            for h in range(cache.kv_heads):
                d = cache.desc[page, kv, h]
                assert not (d & 0x80).any(), "the last page must be raw"
                pool[int(d[0] >> 8) // 2 + pos] = bad[torch.arange(pos.numel(), device=pool.device) % 3]


@pytest.mark.parametrize("D", [64, 128])
def test_stale_bytes_past_the_last_token_are_never_read(D):
    """Odd last-page lengths (1, 2 and 1 tokens) with inf/nan bytes past them: the output equals the clean cache's."""
    q, k, v = make_inputs(3, 2, 3, 50, D, seed=5)
    cache, ip, idx, last = build_paged_cache(k, v, [1, 50, 33], compress=0.5)
    want = decode_attention(q, cache, ip, idx, last, num_splits=2)
    poison_past_last_token(cache, ip, idx, last)
    assert not torch.isfinite(cache.pool.view(torch.bfloat16).float()).all()
    got = decode_attention(q, cache, ip, idx, last, num_splits=2)
    assert torch.equal(got, want)
    check(decode_attention_reference(q, cache, ip, idx, last), want.float())


def test_mixed_cache_has_both_kinds_of_blocks():
    q, k, v = make_inputs(2, 2, 3, 50, 64, seed=1)
    for compress in ("eligible", 0.5):
        cache, *_ = build_paged_cache(k, v, [50, 40], compress=compress)
        st = cache.stats()
        assert 0.2 < st["frac_k"] < 0.9 and 0.2 < st["frac_v"] < 0.9, st
        assert st["used_bytes"] < st["raw_bytes"]
    # page-heads holding both kinds: a mask whose K page-heads alternate mixed / all-compressed / all-raw
    lens = [48]
    mask = torch.zeros(3, 2, 2, 2, dtype=torch.bool)
    mask[0, 0, :, 0] = True                                   # page 0: K mixed (both heads), V raw
    mask[1, :, :, :] = True                                   # page 1: K and V all compressed
    mask[2, 1, 0, :] = torch.tensor([True, False])            # page 2: V of head 0 mixed
    flat = torch.ones(1, 2, 48, 64, dtype=torch.bfloat16)    # every block eligible: the mask decides
    st = build_paged_cache(flat, flat, lens, compress=mask, shuffle=False)[0].stats()
    assert st["mixed_k"] == pytest.approx(2 / 6) and st["mixed_v"] == pytest.approx(1 / 6), st


def test_compression_is_lossless_end_to_end():
    """The same kernel code (the mixed specialisation, which takes any block of any layout) over
    compressed and uncompressed storage gives bit-identical outputs: the rebuilt values are the
    stored ones. (The routed specialisations tile the last page differently, so their outputs
    agree with these to rounding only; test_matches_reference covers them.)"""
    q, k, v = make_inputs(2, 2, 4, 70, 128, seed=2, outliers=False)
    outs = []
    for compress, kl, compact in (("none", "token", False), ("eligible", "token", False),
                                  ("eligible", "channel", True)):
        cache, ip, idx, last = build_paged_cache(k, v, [70, 37], k_layout=kl, v_layout=kl,
                                                 compress=compress, compact=compact)
        if compress == "eligible":
            assert cache.stats()["frac_k"] > 0.5
        outs.append(decode_attention(q, cache, ip, idx, last, num_splits=2, pages_per_tile=2, path="mixed"))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_softmax_scale_and_out():
    q, k, v = make_inputs(1, 1, 3, 20, 32, seed=4)
    cache, ip, idx, last = build_paged_cache(k, v)
    out = torch.empty_like(q)
    res = decode_attention(q, cache, ip, idx, last, softmax_scale=0.05, out=out)
    assert res.data_ptr() == out.data_ptr()
    check(out, decode_attention_reference(q, cache, ip, idx, last, softmax_scale=0.05))


@pytest.fixture(scope="module")
def small():
    q, k, v = make_inputs(2, 2, 2, 20, 64, seed=5)
    cache, ip, idx, last = build_paged_cache(k, v, [20, 9])
    return q, cache, ip, idx, last


def test_errors(small):
    q, cache, ip, idx, last = small
    call = decode_attention
    with pytest.raises(TypeError, match="q must have dtype torch.bfloat16, got torch.float32"):
        call(q.float(), cache, ip, idx, last)
    with pytest.raises(ValueError, match=r"q must have shape \[batch, q_heads, 64\].*got \(2, 4, 32\)"):
        call(q[..., :32].contiguous(), cache, ip, idx, last)
    with pytest.raises(ValueError, match="multiple of kv_heads=2"):
        call(q[:, :3].contiguous(), cache, ip, idx, last)
    with pytest.raises(ValueError, match="q must be contiguous"):
        call(q.transpose(0, 1).contiguous().transpose(0, 1), cache, ip, idx, last)
    with pytest.raises(TypeError, match="cache must be a PagedKVCache"):
        call(q, {"pool": cache.pool}, ip, idx, last)
    with pytest.raises(TypeError, match="indptr must have dtype torch.int32, got torch.int64"):
        call(q, cache, ip.long(), idx, last)
    with pytest.raises(ValueError, match=r"q: batch 2 does not match the page table: indptr has 2 entries"):
        call(q, cache, ip[:2].contiguous(), idx, last)
    with pytest.raises(ValueError, match=r"last_page_len \(batch = len\(indptr\) - 1\) must have shape \[1\]"):
        plan(ip[:2].contiguous(), idx, last, cache, 4)
    with pytest.raises(ValueError, match=r"q: batch 1 does not match the page table: indptr has 3 entries"):
        plan(ip, idx, last, cache, 4).run(q[:1].contiguous())
    with pytest.raises(ValueError, match="indptr must start at 0"):
        call(q, cache, torch.tensor([0, 2, 1], dtype=torch.int32, device=DEV), idx, last)
    with pytest.raises(ValueError, match="end at <= len"):
        call(q, cache, ip + torch.tensor([0, 0, 5], dtype=torch.int32, device=DEV), idx, last)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 3\).*got range \[0, 9\]"):
        call(q, cache, ip, torch.where(idx == idx[0], 9, idx), last)
    with pytest.raises(ValueError, match="indices must be contiguous"):
        call(q, cache, ip, torch.stack([idx, idx], 1)[:, 0], last)
    with pytest.raises(ValueError, match=r"last_page_len must lie in \[1, 16\]"):
        call(q, cache, ip, idx, last * 0)
    with pytest.raises(ValueError, match="cache.desc must be"):
        call(q, PagedKVCache(cache.pool, cache.desc[:, :, :, :1].contiguous(), 64), ip, idx, last)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        call(q, PagedKVCache(cache.pool, cache.desc, 96), ip, idx, last)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        call(q, cache, ip, idx, last, num_splits=0)
    with pytest.raises(ValueError, match="pages_per_tile must be an int >= 1 and a power of two"):
        call(q, cache, ip, idx, last, pages_per_tile=3)
    with pytest.raises(ValueError, match="launch must be a dict with keys from"):
        call(q, cache, ip, idx, last, launch={"warps": 4})
    for bad in (0, True, 2.0):                       # 0 became the default, True was kept, 2.0 crashed later
        with pytest.raises(ValueError, match=rf"pages_per_tile must be an int >= 1 and a power of two, got {bad!r}"):
            plan(ip, idx, last, cache, 4, pages_per_tile=bad)
    for key, bad in (("stages", 0), ("num_warps", 3), ("maxnreg", -1), ("programs_per_sm", 1.5)):
        with pytest.raises(ValueError, match=rf"launch\['{key}'\] must be an int"):
            plan(ip, idx, last, cache, 4, launch={key: bad})
    for bad in (float("nan"), float("inf"), 0.0, -0.125):
        with pytest.raises(ValueError, match=f"softmax_scale must be a finite positive number, got {bad!r}"):
            call(q, cache, ip, idx, last, softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None, got str"):
        call(q, cache, ip, idx, last, softmax_scale="0.1")
    with pytest.raises(ValueError, match="q_heads must be a positive multiple of kv_heads=2, got 3"):
        plan(ip, idx, last, cache, 3)


def test_the_reference_checks_its_inputs_as_plan_does(small):
    """The CPU error message sends users to the torch reference: before, it gave a plausible output for
    last_page_len 0 (the last page dropped), NaN for a NaN scale and a bare IndexError for indices past the pool."""
    q, cache, ip, idx, last = small
    ref = decode_attention_reference
    for args, kwargs, error, match in (
            ((q, cache, ip, idx, last * 0), {}, ValueError, r"last_page_len must lie in \[1, 16\]"),
            ((q, cache, ip, idx, last), dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite"),
            ((q, cache, ip, idx + 1000, last), {}, ValueError, r"indices must lie in \[0, 3\)"),
            ((q[:1], cache, ip, idx, last), {}, ValueError, "q: batch 1 does not match the page table"),
            ((q[..., :32], cache, ip, idx, last), {}, ValueError, r"q must have shape \[batch, q_heads, 64\]"),
            ((q, cache, ip.long(), idx, last), {}, TypeError, "indptr must have dtype torch.int32"),
            ((q.to(torch.int32), cache, ip, idx, last), {}, TypeError, "q must be a floating-point torch.Tensor")):
        with pytest.raises(error, match=match):
            ref(*args, **kwargs)
    assert torch.equal(ref(q, cache, ip, idx, last), ref(q, cache, ip, idx, last, validate=False))


def test_descriptor_past_the_pool_is_a_clear_error(small):
    """A block address past the pool (a kernel would read out of bounds) names the page, head and block."""
    q, cache, ip, idx, last = small
    page = int(idx[1])
    for addr, flag in ((cache.pool.numel(), 1 << 7), (cache.pool.numel() - 512, 0), (-256, 0), (100, 0)):
        desc = cache.desc.clone()
        desc[page, 1, 1, 1] = (addr << 8) | flag
        bad = PagedKVCache(cache.pool, desc, cache.head_dim)
        with pytest.raises(ValueError, match=f"cache.desc: page {page}, kv head 1, values block 1: .* does not lie "
                                             f"inside the pool of {cache.pool.numel()} bytes"):
            decode_attention(q, bad, ip, idx, last)


def test_build_errors():
    k = torch.zeros(1, 1, 20, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k must have dtype torch.bfloat16, got torch.float32"):
        build_paged_cache(k.float(), k)
    with pytest.raises(ValueError, match=r"v must have shape \[batch, kv_heads, T, head_dim\]"):
        build_paged_cache(k, k[0])
    with pytest.raises(ValueError, match="head_dim must be one of"):
        build_paged_cache(k[..., :48], k[..., :48])
    with pytest.raises(ValueError, match=r"seq_lens must hold 1 lengths in \[1, 20\]"):
        build_paged_cache(k, k, [21])
    with pytest.raises(ValueError, match="compress must be"):
        build_paged_cache(k, k, compress="all")
    for empty in (k[:0], k[:, :0], k[:, :, :0]):     # batch, kv_heads or tokens 0: torch's errors or a later crash
        with pytest.raises(ValueError, match=r"k must have shape \[batch, kv_heads, T, head_dim\] with batch, kv_heads"):
            build_paged_cache(empty, empty)
    with pytest.raises(TypeError, match=r"seq_lens must hold integer lengths, got \[17.9\]"):   # was cut to 17
        build_paged_cache(k, k, [17.9])
    cache, *_ = build_paged_cache(k, k, torch.tensor([17]), compress=np.float32(0.5))
    assert cache.num_pages == 2
    with pytest.raises(TypeError, match=r"seq_lens must be None or a sequence of 1 integer lengths .* got int 5"):
        build_paged_cache(k, k, 5)                                   # was "'int' object is not iterable"
    for seed, error in (("a", TypeError), (1.5, TypeError), (None, TypeError), (2**70, ValueError)):
        with pytest.raises(error, match=r"seed must (be an int|lie in)"):   # were torch's and Python's own errors
            build_paged_cache(k, k, seed=seed)


def test_cache_methods_check_their_page_ids_and_arguments():
    """``read_pages`` read page -1 as the last page and cut float ids to ints (silently other pages), ``seal``,
    ``meta`` and ``refresh`` failed with IndexError/AttributeError from inside torch."""
    k = torch.randn(1, 2, 40, 64).to(torch.bfloat16)
    cache, *_ = build_paged_cache(k, k)
    check = cache.check.clone()
    for bad, match in ((torch.tensor([-1]), r"page_ids must lie in \[0, 3\), got range \[-1, -1\]"),
                       (torch.tensor([3]), r"page_ids must lie in \[0, 3\)"),
                       (torch.tensor([0.0]), "page_ids must be a 1-D int32/int64 tensor, got torch.float32"),
                       ([0], "page_ids must be a 1-D int32/int64 tensor, got list")):
        with pytest.raises(ValueError, match=match):
            cache.read_pages(bad)
    assert cache.read_pages(torch.tensor([2, 2]))[0].shape == (2, 2, 16, 64)     # repeats are fine
    for bad, match in (([0], "pages must be a 1-D int32/int64 tensor"), (torch.tensor([9]), r"pages must lie in")):
        with pytest.raises(ValueError, match=match):
            cache.seal(bad)
    assert torch.equal(cache.check, check)
    for kv in (2, -1, "k"):
        with pytest.raises(ValueError, match=r"kv must be 0 \(keys\) or 1 \(values\), got"):
            cache.meta(kv)
    with pytest.raises(ValueError, match="pages must be None or a 1-D int32/int64 tensor of page ids, got list"):
        cache.refresh(pages=[0])


def _request_mask(lens, H, D, kinds):
    """compress mask [P, 2, H, nb] in logical page order: per request 'c' (all blocks),
    'r' (none) or 'm' (a fixed mix of blocks in every page)."""
    nb = 16 * D // 512
    rows = []
    for n, kind in zip(lens, kinds):
        pages = (n + 15) // 16
        if kind == "c":
            m = torch.ones(pages, 2, H, nb, dtype=torch.bool)
        elif kind == "r":
            m = torch.zeros(pages, 2, H, nb, dtype=torch.bool)
        else:
            m = (torch.arange(pages * 2 * H * nb) % 3 != 0).reshape(pages, 2, H, nb)
        rows.append(m)
    return torch.cat(rows)


@pytest.mark.parametrize("ppt,splits", [(1, 1), (2, 3), (4, 2)])
def test_routing_mixes_uniform_and_mixed_requests(ppt, splits):
    """One batch: all-compressed requests (partial and full last pages), an all-raw one, a
    mixed one and a one-page one; every (request, head) is routed to its own kernel."""
    lens = [70, 64, 50, 40, 9]
    kinds = ["c", "c", "r", "m", "c"]
    B, H, G, D = len(lens), 2, 3, 64
    q, k, v = make_inputs(B, H, G, max(lens), D, seed=11, outliers=False)
    mask = _request_mask(lens, H, D, kinds)
    cache, ip, idx, last = build_paged_cache(k, v, lens, compress=mask)
    assert cache.kind() == "mixed"
    pk = cache.page_kinds()
    assert set(torch.unique(pk).tolist()) == {0, 1, 2}
    ref = decode_attention_reference(q, cache, ip, idx, last)
    out = decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt)
    check(out, ref)
    out_m = decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt, path="mixed")
    check(out_m, ref)
    # same values; the split boundaries differ (the all-compressed kernel takes the last page
    # on its own), so fp32 rounding may differ by a bf16 ulp
    assert (out.float() - out_m.float()).abs().max() <= 1e-2


@pytest.mark.parametrize("compress,kind", [("eligible", "compressed"), ("none", "raw")])
def test_uniform_cache_single_launch(compress, kind):
    """Whole pages only (lengths multiples of 16): the cache is uniform and one
    specialised kernel runs, including splits whose tiles are partly past the end."""
    q, k, v = make_inputs(3, 2, 4, 80, 128, seed=12, outliers=False)
    k, v = [(x.float().sign() * (0.25 + x.float().abs() % 4)).to(torch.bfloat16) for x in (k, v)]
    lens = [80, 48, 16]                                 # every block eligible (|x| in [0.25, 4.25))
    cache, ip, idx, last = build_paged_cache(k, v, lens, compress=compress)
    assert cache.kind() == kind
    ref = decode_attention_reference(q, cache, ip, idx, last)
    for ppt, splits in ((1, 1), (2, 2), (4, 3)):
        out = decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt)
        check(out, ref)
        out_m = decode_attention(q, cache, ip, idx, last, num_splits=splits, pages_per_tile=ppt,
                                 path="mixed")
        assert (out.float() - out_m.float()).abs().max() <= 1e-2


def test_page_kinds_of_stacked_caches_and_refresh_with_given_kinds():
    """page_kinds_of over several caches' descriptors stacked equals each cache's own kinds; refresh(kinds)
    takes them in place (the tensor a captured graph reads) and refuses kinds of another shape or dtype."""
    from zipkv.paged import page_kinds_of
    caches = []
    for seed, compress in ((14, "eligible"), (15, "none"), (16, "eligible")):
        _, k, v = make_inputs(2, 2, 1, 40, 64, seed=seed, outliers=seed == 16)
        caches.append(build_paged_cache(k, v, [40, 29], compress=compress)[0])
    stacked = page_kinds_of(torch.stack([c.desc for c in caches]))
    assert [c.page_kinds().tolist() for c in caches] == stacked.tolist()
    assert set(torch.unique(stacked).tolist()) >= {1, 2}
    target, source = caches[1], caches[0]
    held, version = target.page_kinds(), target.version
    target.refresh(stacked[0])
    assert target.page_kinds() is held and torch.equal(held, source.page_kinds()) and target.version == version + 1
    for bad in (stacked[0][:-1], stacked[0].to(torch.int32)):
        with pytest.raises(ValueError, match="kinds must be uint8"):
            target.refresh(bad)
    # only some pages changed: their kinds alone are written (given, or computed from desc)
    pages = torch.tensor([0, 3])
    assert not torch.equal(stacked[0][pages], stacked[1][pages])
    target.refresh(stacked[1][pages], pages=pages)
    want = source.page_kinds().clone()
    want[pages] = stacked[1][pages]
    assert torch.equal(held, want)
    target.refresh(stacked[0][pages], pages=pages)
    target.refresh(pages=pages)                          # computed from target's own descriptors: its kinds there
    assert torch.equal(held, want)
    with pytest.raises(ValueError, match=r"kinds must be uint8 \[2, 2\]"):
        target.refresh(stacked[1], pages=pages)


def test_kinds_refresh_after_compress_in_place():
    from zipkv.kernels.decode_attention import compress_cache_
    q, k, v = make_inputs(2, 1, 2, 40, 64, seed=13, outliers=False)
    lens = [40, 32]
    cache, ip, idx, last = build_paged_cache(k, v, lens, compress="none")
    assert cache.kind() == "raw"
    before = decode_attention(q, cache, ip, idx, last, pages_per_tile=2, path="mixed")
    before_auto = decode_attention(q, cache, ip, idx, last, pages_per_tile=2)
    full = torch.tensor([int(p) for b, n in enumerate(lens) for j, p in enumerate(idx[ip[b]: ip[b + 1]])
                         if (j + 1) * 16 <= n], dtype=torch.int32)
    compress_cache_(cache, full)
    assert cache.kind() == "mixed"                      # request 0's partial last page stays raw
    assert int((cache.page_kinds() == 1).sum()) == full.numel()
    after = decode_attention(q, cache, ip, idx, last, pages_per_tile=2, path="mixed")
    assert torch.equal(before, after), "same kernel code, same values: bit-identical"
    # routed specialisations (raw before, compressed + mixed after) tile differently: rounding only
    check(decode_attention(q, cache, ip, idx, last, pages_per_tile=2), before_auto.float())
    with pytest.raises(ValueError, match="path must be"):
        decode_attention(q, cache, ip, idx, last, path="fast")


def test_a_plan_refuses_to_run_once_the_caches_page_count_changed():
    """A refresh after desc grew replaces the page-kinds tensor: a routed plan would read stale kinds (the raw path
    over pages compressed since), so it refuses; a new plan runs."""
    from zipkv.kernels.decode_attention import compress_cache_, plan
    q, k, v = make_inputs(2, 3, 1, 32, 64, seed=8, outliers=False)
    mask = torch.zeros(4, 2, 3, 2, dtype=torch.bool)
    mask[2:] = True                                          # request 0 raw, request 1 compressed: routed launches
    cache, ip, idx, last = build_paged_cache(k, v, compress=mask, shuffle=False)
    p = plan(ip, idx, last, cache, 3)
    assert len(p.launches) > 1
    p.run(q)
    grown = torch.full_like(cache.desc[:1], cache.pool.numel() << 8)   # one more page at the pool's end, raw
    cache.pool = torch.cat([cache.pool, torch.zeros(grown.numel() * 1024, dtype=torch.uint8, device=cache.pool.device)])
    cache.desc = torch.cat([cache.desc, grown]).contiguous()
    cache.refresh()
    compress_cache_(cache, idx[:2].long())
    with pytest.raises(ValueError, match="number of pages changed since this plan was made"):
        p.run(q)
    check(plan(ip, idx, last, cache, 3).run(q), _attention(q, k, v, [32, 32]))
    with pytest.raises(ValueError, match=f"k and v must be on one device, got k on {k.device} and v on meta"):
        build_paged_cache(k, v.to("meta"))


def test_occupancy_from_compiled_resources():
    from zipkv.kernels.occupancy import H200_SM, programs_per_sm

    assert programs_per_sm(32, 1, 0) == H200_SM["programs"]              # block-count limit
    assert programs_per_sm(255, 4, 0) < programs_per_sm(168, 4, 0)      # registers bind
    half = H200_SM["shared_bytes"] // 2
    assert programs_per_sm(64, 4, half - H200_SM["reserved_per_block"]) == 2   # shared memory binds, 1 KB
    assert programs_per_sm(64, 4, half) == 1                                   # reserved per block included
    assert programs_per_sm(32, 32, 0) == H200_SM["threads"] // (32 * 32)  # threads bind


def _write_page(cache, page, k_page, v_page):
    """Overwrite the raw physical page ``page`` with K/V ``[kv_heads, 16, head_dim]`` (new tokens written
    into a request's last page, as a serving engine appends them)."""
    for kv, (x, layout) in enumerate(((k_page, cache.k_layout), (v_page, cache.v_layout))):
        payload, _ = fmt.pack(x, layout, enable=False)
        for h in range(cache.kv_heads):
            addr = int(cache.desc[page, kv, h, 0]) >> 8
            cache.pool[addr: addr + payload.shape[-1]] = payload[h]


def _attention(q, k, v, lens):
    """fp32 attention of q over the first lens[b] tokens of contiguous K/V."""
    G = q.shape[1] // k.shape[1]
    out = []
    for b, n in enumerate(lens):
        kb = k[b, :, :n].float().repeat_interleave(G, 0)
        vb = v[b, :, :n].float().repeat_interleave(G, 0)
        s = torch.einsum("hd,htd->ht", q[b].float(), kb) / k.shape[-1] ** 0.5
        out.append(torch.einsum("ht,htd->hd", s.softmax(-1), vb))
    return torch.stack(out)


def test_plan_run_equals_decode_attention_and_sees_new_tokens():
    """plan/run gives decode_attention's bits; a run after tokens are written into a last page (and
    last_page_len raised in place) sees them."""
    q, k, v = make_inputs(2, 2, 3, 48, 64, seed=21)
    lens = [40, 21]
    cache, ip, idx, last = build_paged_cache(k, v, lens)
    p = plan(ip, idx, last, cache, q.shape[1], num_splits=2)
    assert p.kernel == "triton" and p.launches == [("compressed", True), ("raw", True), ("mixed", True)]
    out = p.run(q)
    assert torch.equal(out, decode_attention(q, cache, ip, idx, last, num_splits=2))
    check(out, _attention(q, k, v, lens))
    assert torch.equal(p.run(q, out=torch.empty_like(q)), out)
    _write_page(cache, int(idx[int(ip[1]) - 1]), k[0, :, 32:48], v[0, :, 32:48])
    last[0] = 13                                        # request 0: 45 tokens now
    check(p.run(q), _attention(q, k, v, [45, 21]))


def test_plan_after_compression_in_place():
    """A plan of a uniform (all-raw) cache refuses to run once pages are compressed; a plan that routes on
    the device (routing='device') reads the new page kinds."""
    from zipkv.kernels.decode_attention import compress_cache_

    q, k, v = make_inputs(2, 1, 2, 32, 64, seed=22, outliers=False)
    cache, ip, idx, last = build_paged_cache(k, v, compress="none")
    fixed = plan(ip, idx, last, cache, q.shape[1])
    routed = plan(ip, idx, last, cache, q.shape[1], routing="device")
    assert fixed.launches == [("raw", False)] and len(routed.launches) == 3
    check(routed.run(q), _attention(q, k, v, [32, 32]))
    compress_cache_(cache, idx[::2].contiguous())
    assert cache.kind() == "mixed"
    with pytest.raises(ValueError, match="page kinds changed since this plan"):
        fixed.run(q)
    check(routed.run(q), _attention(q, k, v, [32, 32]))
    with pytest.raises(ValueError, match="routing must be one of"):
        plan(ip, idx, last, cache, q.shape[1], routing="host")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("layouts,D", [(("token", "token"), 128), (("k_mma", "v_mma"), 128), (("k_mma", "v_mma"), 64)])
def test_run_in_a_cuda_graph(layouts, D):
    """plan.run captured in a CUDA graph equals eager; a replay after new tokens are written into the
    last page (last_page_len raised in place) sees them. Both kernels (the Gluon one at head_dim 128 and
    64), uniform and routed caches."""
    for compress, lens in (("eligible", [48, 48, 48]), (0.5, [40, 21, 48])):
        q, k, v = make_inputs(3, 2, 4, 48, D, seed=23, outliers=False)
        if compress == "eligible":                          # |x| in [0.25, 4.25): every block eligible
            k, v = [(x.float().sign() * (0.25 + x.float().abs() % 4)).to(torch.bfloat16) for x in (k, v)]
        cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout=layouts[0], v_layout=layouts[1],
                                                 compress=compress)
        if compress == "eligible":                          # uniform: make room in the last pages
            last.fill_(5)
            lens = [37, 37, 37]
            for b in range(3):
                page = int(idx[int(ip[b + 1]) - 1])
                assert cache.page_kinds()[page].tolist() == [1, 1]
        p = plan(ip, idx, last, cache, q.shape[1], num_splits=2)
        out = torch.empty_like(q)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p.run(q, out)                                  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            p.run(q, out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, p.run(q))
        check(out, _attention(q, k, v, lens))
        if compress != "eligible":                          # a raw partial last page takes new tokens
            _write_page(cache, int(idx[int(ip[2]) - 1]), k[1, :, 16:32], v[1, :, 16:32])
            last[1] = 12
            lens = [40, 28, 48]
        else:                                              # the compressed last pages hold 16 tokens already
            last.fill_(16)
            lens = [48, 48, 48]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, p.run(q))
        check(out, _attention(q, k, v, lens))


def test_split_count_fills_the_waves():
    """The Triton kernel's default split-KV factor: enough programs for the slots, then well-filled waves."""
    from zipkv.kernels.decode_attention import split_count
    assert split_count(368, 264, 64) == 2      # Llama-8B shape, batch 46: 70 % of the last wave with 1, 93 % with 2
    assert split_count(512, 264, 64) == 1      # batch 64: 97 % already
    assert split_count(256, 264, 64) == 2      # batch 32: 256 programs do not fill 264 slots
    assert split_count(456, 264, 64) == 4      # batch 57: 86 % with 1-3 splits, 99 % with 4
    assert split_count(464, 264, 64) == 1      # batch 58: 88 % with any of 1-4: the fewest
    assert split_count(368, 264, 1) == 1       # never more splits than tiles
    assert split_count(8, 264, 64) == 33       # batch 1: one wave of 33 splits
    assert split_count(368, 264, 64, fill_waves=False) == 1     # the Gluon kernel: enough programs, no more


def test_split_count_of_the_gluon_kernel_fills_its_resident_waves():
    """The Gluon kernel's split count with the programs the GPU holds at once: the fewest waves per split among
    1 .. ceil(slots / programs), the fewest splits of equals -- no second, part-filled wave where fewer splits fill
    one as well --, and only where that leaves the wanted slots under-filled, up to two more splits (Llama-8B shape,
    8 KV heads, H200's 132 SMs, 7 programs per SM wanted, 10 or 12 resident)."""
    from zipkv.kernels.decode_attention import split_count
    slots = 7 * 132
    assert split_count(96 * 8, slots, 512, fill_waves=False) == 2                    # without residency
    # batch 96: 1 or 2 splits take a wave per split, and one split's 768 programs leave the slots under-filled
    assert split_count(96 * 8, slots, 512, fill_waves=False, resident=10 * 132) == 3
    assert split_count(96 * 8, slots, 2, fill_waves=False, resident=10 * 132) == 1     # never more than tiles
    assert split_count(96 * 8, slots, 512, fill_waves=False, resident=12 * 132) == 2   # 1,536 fit in one wave
    assert split_count(64 * 8, slots, 512, fill_waves=False, resident=10 * 132) == 2   # 1,024 fit
    assert split_count(57 * 8, slots, 512, fill_waves=False, resident=10 * 132) == 2   # 912 fill 99 % of the slots
    assert split_count(32 * 8, slots, 512, fill_waves=False, resident=10 * 132) == 4   # 1,024 fit; 5 are not weighed
    assert split_count(32 * 8, slots, 2, fill_waves=False, resident=10 * 132) == 2     # never more than tiles


def test_gluon_kernel_resources_match_the_residency_model():
    """The plan's model of the Gluon kernel's residency (decode_mma.shared_bytes, MAX_REGISTERS) against the
    kernel as Triton compiles it for sm_90a (offline, in a process without the interpreter)."""
    import json
    import subprocess
    import sys

    code = ("import json; from zipkv.kernels import kernel_info as ki; "     # Llama-8B's and SmolLM2's shapes
            "print(json.dumps([ki.decode_mma_info(p, head_dim=d, slots=s, q_heads=hq, kv_heads=hkv) "
            "| {'slots': s, 'q_heads': hq, 'kv_heads': hkv} "
            "for p in ('compressed', 'raw', 'mixed') for d, hq, hkv, s in ((128, 32, 8, 2), (64, 9, 3, 2), "
            "(128, 32, 8, 3), (128, 128, 8, 2), (64, 128, 8, 2))], default=str))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from zipkv import paged
    from zipkv.kernels import decode_mma
    for info in json.loads(done.stdout.splitlines()[-1]):
        kind = paged.PAGE_KINDS.index(info["path"])
        assert info["shared_bytes"] == decode_mma.shared_bytes(kind, info["slots"]), info
        bound = decode_mma.MAX_REGISTERS[decode_mma.query_columns(info["q_heads"] // info["kv_heads"])]
        assert info["registers"] <= bound and info["spill_stores"] == 0, info


def test_few_requests_cap_the_gluon_split_count():
    """With fewer (request, KV head) pairs than SMs the Gluon kernel's splits target at most 8 programs per SM
    (the mixed path's tuned 16 per SM had given 214 splits for one request, 1.3x slower than 64 on the H200);
    from 132 pairs up (the paper's grid: batch 32 x 8 KV heads and more) the tuned target is unchanged."""
    from zipkv import paged
    from zipkv.kernels.decode_attention import FEW_REQUESTS_PROGRAMS_PER_SM, gluon_split_count
    mixed, compressed = paged.PAGE_KINDS.index("mixed"), paged.PAGE_KINDS.index("compressed")

    def splits(kind, pairs, pages=2048):
        return gluon_split_count(kind, 128, pairs, pages, "NVIDIA H200", 132, group=4)
    assert FEW_REQUESTS_PROGRAMS_PER_SM == 8
    assert splits(mixed, 8) == splits(compressed, 8) == 132          # 1 request x 8 KV heads: 1,056 programs
    assert splits(mixed, 32) == splits(compressed, 32) == 33         # 4 requests
    assert splits(mixed, 8, pages=40) == 40                          # never more splits than pages
    assert splits(mixed, 256) == 6                                    # batch 32: the tuned 16 (13 resident) per SM
    assert splits(mixed, 256) * 256 > FEW_REQUESTS_PROGRAMS_PER_SM * 132
