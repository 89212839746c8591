"""The mma layouts' decode kernel (zipkv.kernels.decode_mma, Gluon) vs the fp32 reference.

Gluon has no interpreter, so the kernel cases need a CUDA GPU (skipped on the CPU, run on the
H200); the errors and the routing are checked everywhere. The format of the mma layouts and the
pack kernel are tested on the CPU in test_format.py and test_pack_kernel.py."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zipkv.kernels.decode_attention import _launches, build_paged_cache, decode_attention, plan  # noqa: E402
from zipkv.kernels.reference import decode_attention_reference  # noqa: E402
from test_decode_attention import check, poison_past_last_token  # noqa: E402  (the Triton kernel's tolerance)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="the Gluon kernel needs a CUDA GPU")


def make_inputs(B, HKV, G, T, seed=0, outliers=True, D=128):
    """q, k, v (bf16, head_dim D). K and V magnitudes span 2^-6 .. 2^2, so every block is compressible unless
    ``outliers`` puts values far outside (then those blocks stay raw: mixed pages)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.exp2(torch.rand(B, HKV, T, D, generator=g) * 8 - 6)
            * (torch.randint(0, 2, (B, HKV, T, D), generator=g) * 2 - 1) for _ in range(2))
    if outliers:
        k[..., 16:20, 3] *= 3e4
        v[..., 33:34, -5] *= 1e-6
    q = torch.randn(B, HKV * G, D, generator=g)
    return q.to(torch.bfloat16).to(DEV), k.to(torch.bfloat16).to(DEV), v.to(torch.bfloat16).to(DEV)


CASES = [
    # B, HKV, G, T, seq_lens, splits, compress, outliers
    (1, 1, 1, 1, None, None, "eligible", False),            # 1 token: the last page only
    (1, 2, 3, 15, None, 1, "eligible", False),              # 15: one partial page
    (1, 1, 4, 17, None, 1, "eligible", False),              # 17: one full page + 1 token
    (3, 2, 3, 50, [1, 50, 33], 2, 0.5, True),               # variable lengths, mixed pages: routed
    (2, 1, 4, 64, [64, 47], 3, "eligible", True),           # split-KV, full last page, some raw blocks
    (2, 2, 1, 40, [40, 16], 2, "none", False),              # all raw: the uncompressed pipeline, G = 1
    (2, 1, 8, 80, [80, 2], 4, "eligible", False),           # empty splits
    (3, 2, 4, 700, [700, 513, 64], None, "eligible", False),  # the all-compressed pipeline, default splits
    (2, 2, 4, 520, [520, 300], 5, "none", False),           # the all-raw pipeline
]


@needs_gpu
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("compress", ["none", 0.5])
def test_stale_bytes_past_the_last_token_are_never_read(D, compress):
    """A serving engine's last page holds old bytes past ``last_page_len`` (any bf16: inf, nan). Head_dim 64
    puts two tokens in a key row, and each query row multiplies the other token by 0: a stale inf beside a
    valid token would give that token a nan score (the likely cause of a wrong greedy token of the engine on
    the mma layouts, H200 at 8046826). Odd last-page lengths, all-raw and mixed caches, splits."""
    q, k, v = make_inputs(3, 2, 3, 50, seed=9, outliers=compress != "none", D=D)
    cache, ip, idx, last = build_paged_cache(k, v, [1, 50, 33], k_layout="k_mma", v_layout="v_mma", compress=compress)
    want = decode_attention(q, cache, ip, idx, last, num_splits=2)
    poison_past_last_token(cache, ip, idx, last)
    got = decode_attention(q, cache, ip, idx, last, num_splits=2)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


@needs_gpu
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("B,HKV,G,T,lens,splits,compress,outliers", CASES)
def test_matches_reference(B, HKV, G, T, lens, splits, compress, outliers, D):
    """Head_dim 128 (a page per operand tile) and 64 (a page pair per tile: odd page counts leave the
    pair's second page empty) against the fp32 reference, partial last pages, G = 1, 3, 4, 8."""
    q, k, v = make_inputs(B, HKV, G, T, seed=T + G, outliers=outliers, D=D)
    cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma",
                                             compress=compress, compact=(T % 2 == 0))
    out = decode_attention(q, cache, ip, idx, last, num_splits=splits)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    check(out, decode_attention_reference(q, cache, ip, idx, last))
    Ls = lens or [T] * B
    for b in range(B):                             # and plain attention on the original K/V
        kb = k[b, :, : Ls[b]].float().repeat_interleave(G, 0)
        vb = v[b, :, : Ls[b]].float().repeat_interleave(G, 0)
        s = torch.einsum("hd,htd->ht", q[b].float(), kb) / D ** 0.5
        check(out[b], torch.einsum("ht,htd->hd", s.softmax(-1), vb))
    # the mixed specialisation (any page, per-block select) gives the same attention
    check(decode_attention(q, cache, ip, idx, last, num_splits=splits, path="mixed"),
          decode_attention_reference(q, cache, ip, idx, last))


@needs_gpu
def test_all_zero_blocks_and_softmax_scale():
    """A compressed all-zero block (base 0) decodes to zeros; a custom softmax scale is used."""
    q, k, v = make_inputs(2, 1, 4, 96, seed=3, outliers=False)
    k[:, :, 16:32] = 0
    v[:, :, 32:48] = 0
    cache, ip, idx, last = build_paged_cache(k, v, k_layout="k_mma", v_layout="v_mma")
    assert cache.stats()["frac_k"] == 1.0
    out = decode_attention(q, cache, ip, idx, last, softmax_scale=0.05)
    check(out, decode_attention_reference(q, cache, ip, idx, last, softmax_scale=0.05))


@needs_gpu
def test_uniform_cache_with_a_short_last_page():
    """A uniform all-compressed cache whose last pages hold fewer tokens than they store: the
    pipeline takes them and masks the rest."""
    q, k, v = make_inputs(3, 2, 4, 80, seed=4, outliers=False)
    cache, ip, idx, last = build_paged_cache(k, v, k_layout="k_mma", v_layout="v_mma")
    assert cache.kind() == "compressed"
    short = torch.tensor([16, 3, 9], dtype=torch.int32, device=DEV)
    for splits in (1, 2):
        check(decode_attention(q, cache, ip, idx, short, num_splits=splits),
              decode_attention_reference(q, cache, ip, idx, short))


@needs_gpu
def test_fused_merge_leaves_its_counters_at_zero():
    """A uniform cache's launch merges its splits itself (the last split of each request and head
    to arrive): repeated runs of one plan and a run on another stream give the same bits, and the
    plan's arrival counters are back at zero after each."""
    q, k, v = make_inputs(4, 2, 4, 304, seed=5, outliers=False)
    cache, ip, idx, _ = build_paged_cache(k, v, [304, 32, 256, 144], k_layout="k_mma", v_layout="v_mma")
    assert cache.kind() == "compressed"
    last = torch.tensor([16, 1, 7, 16], dtype=torch.int32, device=DEV)
    p = plan(ip, idx, last, cache, q.shape[1], num_splits=7)
    first = p.run(q)
    check(first, decode_attention_reference(q, cache, ip, idx, last))
    for _ in range(3):
        assert torch.equal(p.run(q), first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = p.run(q)
    side.synchronize()
    assert torch.equal(other, first)
    assert torch.equal(decode_attention(q, cache, ip, idx, last, num_splits=7), first)
    assert int(p._ws["counters"].count_nonzero()) == 0


def test_plan_routes_by_page_kinds():
    q, k, v = make_inputs(2, 1, 2, 48, seed=1, outliers=False)
    for compress, launches in (("eligible", [(1, False)]), ("none", [(2, False)]), (0.5, [(0, False)])):
        cache, *_ = build_paged_cache(k, v, k_layout="k_mma", v_layout="v_mma", compress=compress)
        assert _launches(cache, "auto", "auto") == launches
        assert _launches(cache, "auto", "device") == [(0, False)]
        assert _launches(cache, "mixed", "auto") == [(0, False)]


def test_errors():
    q, k, v = make_inputs(1, 1, 2, 20, seed=2)
    cache, ip, idx, last = build_paged_cache(k, v, k_layout="k_mma", v_layout="v_mma")
    if not CUDA:
        with pytest.raises(ValueError, match="needs a CUDA GPU.*use the 'token' layouts"):
            decode_attention(q, cache, ip, idx, last)
    with pytest.raises(ValueError, match="the 'k_mma' layout is defined for head_dim 64 and 128 only, got head_dim 32"):
        build_paged_cache(k[..., :32].contiguous(), v[..., :32].contiguous(), k_layout="k_mma", v_layout="v_mma")
    with pytest.raises(ValueError, match="the mma layouts go together"):
        build_paged_cache(k, v, k_layout="k_mma", v_layout="token")
    if CUDA:
        q17, k17, v17 = make_inputs(1, 1, 17, 20, seed=2)
        c17, ip17, idx17, last17 = build_paged_cache(k17, v17, k_layout="k_mma", v_layout="v_mma")
        with pytest.raises(ValueError, match="at most 16 query heads per KV head at head_dim 128, got 17"):
            decode_attention(q17, c17, ip17, idx17, last17)
        q9, k9, v9 = make_inputs(1, 1, 17, 20, seed=2, D=64)
        c9, ip9, idx9, last9 = build_paged_cache(k9, v9, k_layout="k_mma", v_layout="v_mma")
        with pytest.raises(ValueError, match="at most 16 query heads per KV head at head_dim 64, got 17"):
            decode_attention(q9, c9, ip9, idx9, last9)


def _block_combinations(lens, kv_heads, n_blocks=4):
    """compress mask [pages, 2, kv_heads, n_blocks] (logical order) whose page i has the K/V block kinds
    of the bits of i (every one of the 2^(2 n_blocks) combinations, one raw block in a compressed page
    and the reverse included), head h > 0 the complement of head h - 1."""
    pages = sum((n + 15) // 16 for n in lens)
    bits = torch.arange(pages)[:, None] >> torch.arange(2 * n_blocks)[None, :] & 1
    head = bits.bool().reshape(pages, 2, 1, n_blocks)
    return torch.cat([head if h % 2 == 0 else ~head for h in range(kv_heads)], dim=2)


@needs_gpu
@pytest.mark.parametrize("G,D", [(1, 128), (3, 128), (4, 128), (8, 128), (16, 128), (1, 64), (3, 64), (4, 64), (8, 64),
                                 (12, 64)])
def test_mixed_pages_every_block_combination(G, D):
    """The MIXED specialisation on pages with every combination of compressed and raw K/V blocks, partial
    last pages (raw) and full ones, splits and no splits, against the fp32 reference; head_dim 64 pairs
    pages, so its 16-row tiles mix two pages' combinations."""
    lens = [16 * 70 + 5, 16 * 60, 16 * 80 + 11, 16 * 46 + 1]          # 259 pages: every combination of 8 bits
    q, k, v = make_inputs(4, 2, G, max(lens), seed=G, outliers=False, D=D)
    cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma",
                                             compress=_block_combinations(lens, 2, D // 32), compact=True)
    assert cache.kind() == "mixed"
    p = plan(ip, idx, last, cache, q.shape[1])
    assert p.launches == [("mixed", False)]
    ref = decode_attention_reference(q, cache, ip, idx, last)
    for splits in (1, 3, None):
        check(decode_attention(q, cache, ip, idx, last, num_splits=splits), ref)
    check(p.run(q), ref)
    # the same pages all compressed / all raw through the mixed specialisation agree with the uniform ones
    for compress in ("eligible", "none"):
        uni, ip2, idx2, last2 = build_paged_cache(k, v, [16 * 70, 16 * 60, 16 * 80, 16 * 46], k_layout="k_mma",
                                                  v_layout="v_mma", compress=compress)
        ref2 = decode_attention_reference(q, uni, ip2, idx2, last2)
        check(decode_attention(q, uni, ip2, idx2, last2, num_splits=2, path="mixed"), ref2)
        check(decode_attention(q, uni, ip2, idx2, last2, num_splits=2), ref2)


@needs_gpu
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("G", [1, 3, 8])
def test_packed_pages_give_the_raw_pages_bits(D, G):
    """Lossless through the kernel: the same data packed (every eligible block, or half of them; mixed pages, wide
    blocks raw) and raw, at the same split count, give bit-identical outputs through every specialisation --
    COMPRESSED, MIXED and RAW. The rebuild fixes the exponent base at 128 and the kernel undoes it with a power of
    two per token on the scores and on P, which commutes with every rounding in normal range ("The lossless format"
    checks the same on the embedded model's captured KV, every layer)."""
    lens = [16 * 40 + 7, 16 * 25, 16 * 33 + 1]
    q, k, v = make_inputs(3, 2, G, max(lens), seed=D + G, outliers=False, D=D)
    k[:, :, 16 * 3 + 5, 7] *= 3e4                          # two raw blocks in otherwise compressible pages
    v[:, :, 16 * 9 + 2, 1] *= 1e-6
    raw = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", compress="none")
    full = [16 * (n // 16) for n in lens]
    q2, k2, v2 = make_inputs(3, 2, G, max(lens), seed=D + G, outliers=False, D=D)
    for splits in (1, 3):
        want = decode_attention(q, *raw, num_splits=splits)
        for compress in ("eligible", 0.5):
            packed = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", compress=compress)
            assert packed[0].kind() == "mixed"
            for path in ("auto", "mixed"):
                assert torch.equal(decode_attention(q, *packed, num_splits=splits, path=path), want)
        # a uniform all-compressed cache (full pages, no wide block) against the same pages raw: COMPRESSED vs RAW
        packed = build_paged_cache(k2, v2, full, k_layout="k_mma", v_layout="v_mma")
        plain = build_paged_cache(k2, v2, full, k_layout="k_mma", v_layout="v_mma", compress="none")
        assert packed[0].kind() == "compressed" and plain[0].kind() == "raw"
        assert torch.equal(decode_attention(q2, *packed, num_splits=splits), decode_attention(q2, *plain, num_splits=splits))


@needs_gpu
@pytest.mark.parametrize("D,G,split_counts", [(128, 1, (17, 41)), (128, 4, (17, 30, 41)), (64, 1, (17, 21)),
                                              (64, 4, (17, 21)), (128, 3, (17,)), (128, 8, (17,))])
def test_many_splits_merge_in_two_levels(D, G, split_counts):
    """More than 16 splits merge in two levels (groups of ceil(sqrt(splits)) splits, then the groups): the output
    matches the fp32 reference for every page kind, packed pages give the raw pages' bits at the same split count,
    repeated runs give the same bits, and every arrival counter is back at zero -- up to one split per unit (the
    page count: the shorter requests' splits are empty), partial last pages."""
    lens = [16 * 40 + 7, 16 * 25, 16 * 33 + 1]
    q, k, v = make_inputs(3, 2, G, max(lens), seed=D + G, outliers=True, D=D)
    ref = None
    for splits in split_counts:
        raw = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", compress="none")
        want = decode_attention(q, *raw, num_splits=splits)
        if ref is None:
            ref = decode_attention_reference(q, *raw)
        check(want, ref)
        for compress in ("eligible", 0.5):
            packed = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", compress=compress)
            cache, ip, idx, last = packed
            p = plan(ip, idx, last, cache, q.shape[1], num_splits=splits)
            first = p.run(q)
            assert torch.equal(first, want), f"{compress} pages at {splits} splits differ from raw pages"
            assert torch.equal(p.run(q), first)
            assert int(p._ws["counters"].count_nonzero()) == 0
        # a uniform all-compressed cache (full pages, no wide block): the COMPRESSED specialisation vs RAW
        full = [16 * (n // 16) for n in lens]
        q2, k2, v2 = make_inputs(3, 2, G, max(lens), seed=D + G + 1, outliers=False, D=D)
        packed = build_paged_cache(k2, v2, full, k_layout="k_mma", v_layout="v_mma")
        plain = build_paged_cache(k2, v2, full, k_layout="k_mma", v_layout="v_mma", compress="none")
        assert packed[0].kind() == "compressed"
        assert torch.equal(decode_attention(q2, *packed, num_splits=splits),
                           decode_attention(q2, *plain, num_splits=splits))


@needs_gpu
def test_many_splits_in_a_cuda_graph():
    """A plan of 20 splits (two merge levels) captured in a CUDA graph equals eager, and a replay after new tokens
    are written into the raw partial last page (last_page_len raised in place) sees them."""
    from test_decode_attention import _attention, _write_page
    q, k, v = make_inputs(2, 2, 4, 16 * 40, seed=31, outliers=True)
    lens = [16 * 39 + 5, 16 * 30 + 2]
    cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", compress=0.5)
    p = plan(ip, idx, last, cache, q.shape[1], num_splits=20)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.run(q, out)                                      # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(q, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, p.run(q))
    check(out, _attention(q, k, v, lens))
    _write_page(cache, int(idx[int(ip[1]) - 1]), k[0, :, 16 * 39:16 * 40], v[0, :, 16 * 39:16 * 40])
    last[0] = 11
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, p.run(q))
    check(out, _attention(q, k, v, [16 * 39 + 11, lens[1]]))
    assert int(p._ws["counters"].count_nonzero()) == 0
