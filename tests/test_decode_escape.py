"""The fused decode kernel reading escape-format pages (zipkv.kernels.decode_escape, Gluon) and its plumbing.

On the CPU: the kernel's per-element arithmetic in torch (``operands_reference``: the base-128 rebuild, zero mode and
escape patches, as the kernel computes them) equals the exact scaled values (``scaled_reference`` and fp32) on every
bf16 pattern at every position; the attention reference reads escape pages as their raw values; the plan routes and
refuses; the kernel compiles offline. On a GPU (skipped on the CPU, like tests/test_decode_mma.py): escape pages give
the raw pages' bits through the kernel at the same split count (COMPRESSED, MIXED, two merge levels, a CUDA graph),
match the fp32 reference, and the engine's tokens equal ZipFusion's engine's."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zipkv import escape as E, format as F  # noqa: E402
from zipkv.kernels import decode_escape as DE  # noqa: E402
from zipkv.kernels.decode_attention import build_paged_cache, decode_attention, plan  # noqa: E402
from zipkv.kernels.reference import decode_attention_reference  # noqa: E402
from test_format_escape import FILLERS, pattern_blocks  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="the Gluon kernel needs a CUDA GPU")


def exact_scaled(bits: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 bits of ``x * 2^(128 - b)`` computed in fp64, rounded to bf16 once (exact wherever representable)."""
    x = bits.view(torch.bfloat16).double() * torch.exp2((128 - b.double()))[..., None]
    return x.to(torch.bfloat16).view(torch.int16)


def flushed(bits: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the kernel flushes to a signed zero: a bf16 subnormal, or a scaled exponent below 1."""
    e = (bits.to(torch.int32) >> 7) & 0xFF
    return ((e == 0) & ((bits.to(torch.int32) & 0x7F) != 0)) | ((e >= 1) & (e + 128 - b.to(torch.int32)[..., None] < 1))


@pytest.mark.parametrize("b", [0, 2, 100, 126, 128, 130, 200, 254])
def test_scaled_reference_is_the_exact_scaled_value_where_not_flushed(b):
    bits = torch.arange(65536, dtype=torch.int32)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    finite = ((bits.to(torch.int32) >> 7) & 0xFF) != 0xFF
    bb = torch.tensor(b)
    got, want = DE.scaled_reference(bits, bb), exact_scaled(bits, bb)
    fl = flushed(bits, bb) & finite
    keep = finite & ~fl & (((bits.to(torch.int32) >> 7) & 0xFF) + 128 - b <= 254)     # no overflow either
    assert torch.equal(got[keep], want[keep])
    assert bool((got[fl].to(torch.int32) & 0x7FFF == 0).all())                       # flushed: signed zeros
    assert torch.equal(got[fl] < 0, bits[fl] < 0)


@pytest.mark.parametrize("filler", FILLERS)
def test_the_kernels_operands_are_the_scaled_values_on_every_pattern(filler):
    """Every bf16 pattern at every position, packed (list sized per page) in the mma layouts: the operands the kernel
    builds -- base-128 rebuild, zero mode, escapes patched from low byte, sign and entry -- are scaled_reference of
    the original values in every compressed block (but those of base 0, whose scale the kernel sets to 0, as
    ZipFusion's kernel does)."""
    d = 64
    for layout in F.MMA_LAYOUTS + ("token",):
        pages = F.from_blocks(pattern_blocks(FILLERS[filler]).reshape(-1, 2, 512), layout, d)
        payload, escapes, meta = E.pack(pages, layout, capacity=E.PAGE)
        ops = DE.operands_reference(payload, escapes, meta)
        orig = F.to_blocks(pages, layout).contiguous().view(torch.int16)
        want = DE.scaled_reference(orig, meta.base)
        c = meta.compressed & (meta.base > 0)   # base 0: the kernel's per-token scale is 0 (ZipFusion's rule: exact for
        assert torch.equal(ops[c], want[c]), layout     # all-zero blocks, values below 2^-126 flushed), as before
        assert torch.equal(ops[~meta.compressed], orig[~meta.compressed])
        if filler == "huge":
            assert int(meta.count.sum()) > 0


def test_real_kv_like_values_flush_nothing():
    """On values like the embedded model's KV (a normal bulk, tiny outliers, exact zeros) nothing is flushed: the
    kernel's operands are exactly the scaled values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, 128, generator=g) * torch.exp(torch.randn(64, 1, 128, generator=g))
    x = torch.where(torch.rand(x.shape, generator=g) < 0.01, x * 1e-4, x)
    x[..., ::17] = 0.0
    pages = x.to(torch.bfloat16)
    payload, escapes, meta = E.pack(pages, "k_mma", capacity=E.PAGE)
    assert int(meta.count.sum()) > 0 and bool(meta.compressed.all())
    orig = F.to_blocks(pages, "k_mma").contiguous().view(torch.int16)
    assert not bool(flushed(orig, meta.base).any())
    assert torch.equal(DE.operands_reference(payload, escapes, meta), exact_scaled(orig, meta.base))


def _page_codes(D, page=0):
    """bf16 page [16, D] whose value at (token t, channel c) is the bit pattern ``4096 page + 128 t + c``."""
    return (torch.arange(16)[:, None] * 128 + torch.arange(D)[None, :] + 4096 * page).to(torch.int16).view(torch.bfloat16)


def _blocks(page, layout):
    return F.to_blocks(page[None], layout)[0].contiguous().view(torch.int16).long()


@pytest.mark.parametrize("D", [128, 64])
def test_the_kernels_element_positions_are_the_formats(D):
    """Where the kernel looks for a listed escape: the key A operand's (row t, column c) of half h is block position
    ``256 h + 64 (t % 4) + 16 ((c >> 1) & 3) + 2 (c >> 3) + (c & 1)`` of the row's block, a value chunk C's element
    (blk, m, r) position ``128 C + 16 m + r`` of block row blk -- through the same reshapes and permutes as the Gluon
    code (decode_mma._key_operand, _value_operands), against zipkv.format's k_mma / v_mma layouts; head_dim 64 a page
    pair per unit."""
    pages = [_page_codes(D, 0), _page_codes(D, 1)]
    kb = [_blocks(p, "k_mma") for p in pages]
    vb = [_blocks(p, "v_mma") for p in pages]

    def row_token(t, h):                       # (page, token) of half h of unit row t
        if D == 128:
            return 0, t
        return (t >> 2) & 1, 2 * (t % 4 + 4 * (t >> 3)) + h

    def key_block(t):                          # (page, block) of unit row t's key block (decode_mma._kdesc)
        return (0, t // 4) if D == 128 else ((t // 4) % 2, (t // 4) // 2)

    for h in (0, 1):
        for t in range(16):
            pg, j = key_block(t)
            page, tok = row_token(t, h)
            for c in range(64):
                p = 256 * h + 64 * (t % 4) + 16 * ((c >> 1) & 3) + 2 * (c >> 3) + (c & 1)
                ch = 64 * h + c if D == 128 else c
                assert int(kb[pg][j, p]) == 4096 * page + 128 * tok + ch
    vblock = (lambda blk: (0, blk)) if D == 128 else (lambda blk: (0 if blk < 2 else 1, blk % 2))   # _vdesc
    tiles = [torch.stack([torch.stack([vb[vblock(blk)[0]][vblock(blk)[1], 128 * C + 16 * m + torch.arange(16)]
                                       for m in range(8)]) for blk in range(4)]) for C in range(4)]
    v = torch.stack([torch.stack([tiles[0], tiles[1]], -1), torch.stack([tiles[2], tiles[3]], -1)], -1)
    v = v.reshape(2, 2, 8, 2, 2, 2, 2, 2, 2).permute(5, 0, 1, 6, 8, 7, 3, 4, 2).reshape(16, 128)
    halves = [v.permute(1, 0)] if D == 128 else list(v.reshape(16, 2, 64).permute(2, 0, 1).unbind(-1))
    for h, vt in enumerate(halves):            # V^T [channels, 16 token rows]
        for t in range(16):
            page, tok = row_token(t, h)
            want = 4096 * page + 128 * tok + torch.arange(vt.shape[0])
            assert torch.equal(vt[:, t], want), (h, t)


def _inputs(B, HKV, G, T, D, seed=0):
    """q, k, v (bf16): a bulk of magnitudes 2^-6 .. 2^2, one value in 200 about 2^-14 times as large (escapes), and
    whole zero channels in the keys (zero mode), as real KV holds them."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.exp2(torch.rand(B, HKV, T, D, generator=g) * 8 - 6)
            * (torch.randint(0, 2, (B, HKV, T, D), generator=g) * 2 - 1) for _ in range(2))
    for x in (k, v):
        x.mul_(torch.where(torch.rand(x.shape, generator=g) < 0.005, 2.0 ** -14, 1.0))
    k[..., 5] = 0.0
    k[..., 77 % D] = -0.0
    q = torch.randn(B, HKV * G, D, generator=g)
    return (t.to(torch.bfloat16).to(DEV) for t in (q, k, v))


def test_the_reference_reads_escape_pages_as_the_raw_pages():
    q, k, v = _inputs(3, 2, 3, 70, 64, seed=1)
    lens = [70, 33, 16]
    esc = build_paged_cache(k.cpu(), v.cpu(), lens, k_layout="k_mma", v_layout="v_mma", block_format="escape")
    raw = build_paged_cache(k.cpu(), v.cpu(), lens, k_layout="k_mma", v_layout="v_mma", compress="none")
    assert int((esc[0].escapes & 0x7F).sum()) > 0 and bool(((esc[0].escapes >> 7) & 1).any())
    assert torch.equal(decode_attention_reference(q.cpu(), *esc), decode_attention_reference(q.cpu(), *raw))


def test_plan_refuses_escape_pages_the_kernel_cannot_read():
    q, k, v = _inputs(1, 1, 2, 40, 64)
    cache, ip, idx, last = build_paged_cache(k.cpu(), v.cpu(), k_layout="token", v_layout="token", block_format="escape")
    with pytest.raises(ValueError, match="escape"):
        plan(ip, idx, last, cache, 2)
    with pytest.raises(ValueError, match="block_format"):
        build_paged_cache(k.cpu(), v.cpu(), block_format="huffman")
    with pytest.raises(ValueError, match="compress"):
        build_paged_cache(k.cpu(), v.cpu(), block_format="escape", compress=0.5)


@pytest.mark.skipif(CUDA, reason="on a GPU the kernel runs: the tests below")
def test_the_kernel_compiles_offline():
    """The Gluon kernel of escape pages compiles for sm_90a (no GPU needed): its resources, as the GPU run reads."""
    import subprocess
    import sys
    code = ("from zipkv.kernels import decode_escape as de; r = de.compile_info('compressed'); "
            "print(r['registers'], r['spill_stores'])")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    regs, spills = map(int, out.stdout.split()[-2:])
    assert 0 < regs <= 255


# ----------------------------------------------------------------------------- on the GPU

@needs_gpu
@pytest.mark.parametrize("D,G,split_counts", [(128, 4, (1, 3, 20)), (64, 3, (2,)), (128, 1, (2,)), (128, 8, (2,))])
def test_escape_pages_give_the_raw_pages_bits(D, G, split_counts):
    """Lossless through the kernel: escape pages (every full page compressed, escapes and zero mode patched in
    registers) and the same pages raw give bit-identical outputs at the same split count -- uniform all-compressed
    caches (COMPRESSED) and partial last pages (MIXED), one split, three, and twenty (two merge levels); G = 1, 3, 4,
    8 (few combinations: each is a compile of its own)."""
    lens = [16 * 40 + 7, 16 * 25, 16 * 33 + 1]
    q, k, v = _inputs(3, 2, G, max(lens), D, seed=D + G)
    full = [16 * (n // 16) for n in lens]
    for ls in (lens, full):
        esc = build_paged_cache(k, v, ls, k_layout="k_mma", v_layout="v_mma", block_format="escape")
        raw = build_paged_cache(k, v, ls, k_layout="k_mma", v_layout="v_mma", compress="none")
        assert int((esc[0].escapes & 0x7F).sum()) > 0
        assert esc[0].kind() == ("compressed" if ls is full else "mixed")
        for splits in split_counts:
            want = decode_attention(q, *raw, num_splits=splits)
            cache, ip, idx, last = esc
            p = plan(ip, idx, last, cache, q.shape[1], num_splits=splits)
            got = p.run(q)
            assert torch.equal(got, want), f"{ls is full and 'full' or 'partial'} pages, {splits} splits"
            assert torch.equal(p.run(q), got)
            if splits > 1:
                assert int(p._ws["counters"].count_nonzero()) == 0


@needs_gpu
@pytest.mark.parametrize("D", [128, 64])
def test_matches_the_fp32_reference(D):
    from test_decode_attention import check
    lens = [1, 50, 16 * 12 + 3]
    q, k, v = _inputs(3, 2, 4, max(lens), D, seed=7)
    cache, ip, idx, last = build_paged_cache(k, v, lens, k_layout="k_mma", v_layout="v_mma", block_format="escape",
                                             compact=True)
    check(decode_attention(q, cache, ip, idx, last, num_splits=2), decode_attention_reference(q, cache, ip, idx, last))


@needs_gpu
def test_escape_plan_in_a_cuda_graph():
    q, k, v = _inputs(2, 2, 4, 16 * 40, 128, seed=31)
    cache, ip, idx, last = build_paged_cache(k, v, [16 * 39 + 5, 16 * 30 + 2], k_layout="k_mma", v_layout="v_mma",
                                             block_format="escape")
    p = plan(ip, idx, last, cache, q.shape[1], num_splits=20)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.run(q, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(q, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, p.run(q))


@needs_gpu
def test_engine_with_escape_pages_gives_zipfusions_tokens():
    """The engine on the GPU (fused kernel, the escape pack kernel, CUDA graphs): escape pages give the greedy tokens
    of ZipFusion's pages at the same split count (lossless both)."""
    from conftest import tiny_llama
    from zipkv import Engine
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=64, seed=5).to("cuda", torch.bfloat16)
    prompts = [list(range(3, 90)), list(range(50, 61)), list(range(70, 75))]
    budget = 40 * model.config.num_hidden_layers * 2 * 2 * 32 * 64
    outs = {}
    for name, kw in (("escape", dict(block_format="escape")), ("zipfusion", {})):
        eng = Engine(model, budget, compress="all", pages_per_chunk=2, eos_token_id=None, num_splits=2, **kw)
        res = eng.generate(prompts, 24)
        outs[name] = res.outputs
        assert res.stats["frac_compressed_k"] > 0
    assert outs["escape"] == outs["zipfusion"]
