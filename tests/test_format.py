"""zipkv.format: the lossless 12-bit block format (ZipFusion §III-B), plain-torch reference."""
import pytest
import torch

from zipkv import format as F


def all_pattern_blocks() -> torch.Tensor:
    """int16 [65536, 512]: every BF16 bit pattern at every block position, each block
    inside one 16-exponent window [16w, 16w + 15] (so every block is compressible).
    Window w, block k, position p holds pattern (k + p) mod 4096 of the window."""
    w = torch.arange(16, dtype=torch.int32).repeat_interleave(4096)[:, None]
    k = (torch.arange(65536, dtype=torch.int32) % 4096)[:, None]
    idx = (k + torch.arange(512, dtype=torch.int32)) % 4096
    bits = ((idx >> 11) << 15) | ((16 * w + ((idx >> 7) & 15)) << 7) | (idx & 127)
    return bits.to(torch.int16)


def bits(x):
    return x.contiguous().view(torch.int16)


def random_pages(shape, d, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 16, d, generator=g) * torch.exp(spread * torch.randn(*shape, 1, 1, generator=g))
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("d", [64, 128])
def test_all_bit_patterns_every_position(d):
    blocks = all_pattern_blocks()
    nb = F.n_blocks(d)
    # every pattern appears at every position
    assert all(torch.unique(blocks[:, p].to(torch.int32) & 0xFFFF).numel() == 65536 for p in (0, 1, 255, 511))
    for layout in F.LAYOUTS:
        pages = F.from_blocks(blocks.view(torch.bfloat16).reshape(-1, nb, 512), layout, d)
        assert torch.equal(bits(F.to_blocks(pages, layout)).reshape(-1, 512), blocks)
        payload, meta = F.pack(pages, layout)
        assert bool(meta.compressed.all()), layout
        assert bool((meta.nbytes == nb * 768).all())
        assert bool((payload[:, nb * 768:] == 0).all())
        assert torch.equal(bits(F.unpack(payload, meta)), bits(pages)), layout


@pytest.mark.parametrize("d", [64, 128])
def test_all_bit_patterns_raw_blocks(d):
    """Ineligible blocks stay raw (their 1024 bytes unchanged) and round-trip."""
    i = torch.arange(65536, dtype=torch.int32)
    pats = ((i % 128) * 512 + i // 128).to(torch.int16)       # every block spans all exponents
    pages = pats.view(torch.bfloat16).reshape(-1, 16, d)
    for layout in F.LAYOUTS:
        payload, meta = F.pack(pages, layout)
        assert not bool(meta.compressed.any())
        stored = payload.view(-1, F.n_blocks(d), 1024).view(torch.int16)
        assert torch.equal(stored[..., F.raw_index(layout)], bits(F.to_blocks(pages, layout)))
        assert torch.equal(bits(F.unpack(payload, meta)), bits(pages))


def _block_with_exponents(emin, emax, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(emin, emax + 1, (n,), generator=g, dtype=torch.int32)
    e[0], e[1] = emin, emax
    s = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)
    f = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32)
    return ((s << 15) | (e << 7) | f).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("emin,emax,ok", [
    (100, 115, True), (101, 115, True), (100, 116, False), (101, 116, False), (3, 17, True),
    (2, 18, False), (0, 15, True), (240, 255, True), (239, 255, False), (120, 120, True)])
def test_eligibility_rule(emin, emax, ok):
    blk = _block_with_exponents(emin, emax)
    for layout in F.LAYOUTS:
        page = F.from_blocks(blk.reshape(1, 512).expand(4, 512), layout, 128)
        assert F.eligible(page, layout).tolist() == [ok] * 4
        payload, meta = F.pack(page, layout)
        assert meta.compressed.tolist() == [ok] * 4
        if ok:
            assert meta.base.tolist() == [emin & ~1] * 4
        else:
            stored = payload.view(4, 1024).view(torch.int16)
            assert torch.equal(stored[:, F.raw_index(layout)], bits(F.to_blocks(page, layout)))
        assert torch.equal(bits(F.unpack(payload, meta)), bits(page))


def test_byte_order_of_a_compressed_block():
    """Spell out the documented byte order for one block, value by value."""
    blk = _block_with_exponents(118, 131, seed=3)
    page = F.from_blocks(blk.reshape(1, 512).expand(4, 512).contiguous(), "token", 128)
    payload, meta = F.pack(page, "token")
    x = (bits(blk).to(torch.int32) & 0xFFFF).tolist()
    b = meta.base[0].item()
    assert b == 118
    code = [((v >> 15) << 3) | (((v >> 8) & 0x7F) - b // 2) for v in x]
    pl = payload[:768].tolist()
    assert pl[:512] == [v & 0xFF for v in x]
    assert pl[512:768] == [code[8 * m + k] | (code[8 * m + 4 + k] << 4) for m in range(64) for k in range(4)]
    assert meta.packed()[0].item() == 0x80 | 59


def test_block_offsets_and_mixed_page():
    """Blocks are stored back to back: raw 1024 bytes, compressed 768."""
    good = _block_with_exponents(120, 130)
    bad = _block_with_exponents(100, 130, seed=1)
    blocks = torch.stack([bad, good, bad, good])
    for layout in F.LAYOUTS:
        page = F.from_blocks(blocks, layout, 128)
        payload, meta = F.pack(page, layout)
        assert meta.compressed.tolist() == [False, True, False, True]
        assert meta.block_offsets().tolist() == [0, 1024, 1792, 2816]
        assert int(meta.nbytes) == 3584
        at = F.raw_index(layout)
        assert torch.equal(payload[:1024].view(torch.int16)[at], bits(bad))
        assert torch.equal(payload[1792:2816].view(torch.int16)[at], bits(bad))
        assert bool((payload[3584:] == 0).all())
        assert torch.equal(bits(F.unpack(payload, meta)), bits(page))
        # a payload trimmed to the used bytes unpacks too
        assert torch.equal(bits(F.unpack(payload[: int(meta.nbytes)], meta)), bits(page))


@pytest.mark.parametrize("layout,d", [(lay, d) for d in F.HEAD_DIMS for lay in F.layouts_for(d)])
def test_roundtrip_random(d, layout):
    pages = random_pages((3, 5), d, seed=d)
    pages[0, 0, 3, 1] = float("inf")
    pages[1, 2, 7, 0] = float("nan")
    pages[2, 1, 0, 0] = -0.0
    payload, meta = F.pack(pages, layout)
    assert payload.shape == (3, 5, 32 * d) and meta.compressed.shape == (3, 5, F.n_blocks(d))
    assert 0 < meta.compressed.float().mean() < 1
    assert torch.equal(meta.compressed, F.eligible(pages, layout))
    assert torch.equal(bits(F.unpack(payload, meta)), bits(pages))
    # metadata bytes round-trip
    m2 = F.PageMeta.from_packed(meta.packed(), layout, d)
    assert torch.equal(m2.compressed, meta.compressed) and torch.equal(m2.base, meta.base)
    # single page (no leading dims)
    p1, m1 = F.pack(pages[1, 3], layout)
    assert torch.equal(p1, payload[1, 3]) and torch.equal(bits(F.unpack(p1, m1)), bits(pages[1, 3]))


@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_enable_mask_and_switch_off(layout):
    g = torch.Generator().manual_seed(1)
    d = 128 if layout in F.MMA_LAYOUTS else 64
    pages = ((torch.rand(6, 16, d, generator=g) + 1) * (torch.randint(0, 2, (6, 16, d), generator=g) * 2 - 1)).to(torch.bfloat16)
    elig = F.eligible(pages, layout)
    assert bool(elig.all())
    mask = torch.tensor([[True, False] * (d // 64), [False, True] * (d // 64)] * 3)
    _, meta = F.pack(pages, layout, enable=mask)
    assert torch.equal(meta.compressed, mask)
    off, meta0 = F.pack(pages, layout, enable=False)
    assert not bool(meta0.compressed.any())
    assert torch.equal(bits(F.unpack(off, meta0)), bits(pages))
    if layout == "token":  # an all-raw token-layout page is the plain page
        assert torch.equal(off.view(6, 16, d, 2), bits(pages).view(torch.uint8).view(6, 16, d, 2))


def test_layout_arrangement():
    d = 64
    idx = torch.arange(16 * d, dtype=torch.int16).reshape(16, d)
    page = idx.view(torch.bfloat16)
    tb = bits(F.to_blocks(page, "token"))
    assert torch.equal(tb[1, :d], idx[8])                             # block 1 starts at token 8
    cb = bits(F.to_blocks(page, "channel"))
    assert torch.equal(cb[1, :32], idx[0, 32:64])                     # block 1 = channels 32..63
    assert torch.equal(cb[0, 32:64], idx[1, :32])
    for layout in F.layouts_for(d):
        assert torch.equal(F.from_blocks(F.to_blocks(page, layout), layout, d), page)


def test_raw_piece_order():
    """A raw block's 16-byte pieces: in position order for the token and channel layouts; for the mma layouts
    the piece a lane copies for ring tile u sits where a compressed block's bytes for that lane and tile do
    (keys 256u + 16l, values 128u + 16m) and holds values that lane's compressed low-byte run holds."""
    for layout in ("token", "channel"):
        assert torch.equal(F.raw_index(layout), torch.arange(512))
    for layout, lanes, tile_bytes, run_bytes in (("k_mma", 16, 256, 256), ("v_mma", 8, 128, 128)):
        at = F.raw_index(layout)
        assert sorted(at.tolist()) == list(range(512))
        where = torch.empty(512, dtype=torch.int64)
        where[at] = torch.arange(512)                                   # bf16 index -> position stored there
        for u in range(1024 // tile_bytes):
            for lane in range(lanes):
                q0 = (tile_bytes * u + 16 * lane) // 2
                pos = where[q0: q0 + 8]
                low = run_bytes * (u // 2) + 16 * lane                   # the lane's low bytes in half / chunk u // 2
                assert torch.equal(pos, torch.arange(low + 8 * (u % 2), low + 8 * (u % 2) + 8)), (layout, u, lane)


def test_mma_layout_arrangement():
    """Spot checks of the documented mma positions, and the code pairing (values i, i + 256)."""
    idx = torch.arange(16 * 128, dtype=torch.int16).reshape(16, 128)
    kb = bits(F.to_blocks(idx.view(torch.bfloat16), "k_mma"))[1]         # block 1 = tokens 4..7
    tc = [(t, c) for t, c in ((4, 0), (4, 1), (4, 8), (4, 16), (4, 2), (5, 0), (4, 64))]
    assert kb[[0, 1, 2, 4, 16, 64, 256]].tolist() == [t * 128 + c for t, c in tc]
    vb = bits(F.to_blocks(idx.view(torch.bfloat16), "v_mma"))[1]         # block 1 = tokens 2, 3, 10, 11
    tc = [(2, 0), (3, 0), (10, 0), (2, 8), (2, 1), (2, 32), (2, 64)]
    assert vb[[0, 1, 2, 4, 16, 128, 256]].tolist() == [t * 128 + c for t, c in tc]
    idx64 = torch.arange(16 * 64, dtype=torch.int16).reshape(16, 64)   # head_dim 64: half an operand tile per page
    kb = bits(F.to_blocks(idx64.view(torch.bfloat16), "k_mma"))[1]       # block 1 = tokens 8..15
    tc = [(8, 0), (8, 1), (8, 8), (8, 16), (8, 2), (10, 0), (9, 0)]       # 128-channel rows = token pairs
    assert kb[[0, 1, 2, 4, 16, 64, 256]].tolist() == [t * 64 + c for t, c in tc]
    vb = bits(F.to_blocks(idx64.view(torch.bfloat16), "v_mma"))[1]       # block 1 = tokens 4..7, 12..15
    tc = [(4, 0), (6, 0), (12, 0), (4, 8), (4, 1), (4, 32), (5, 0)]
    assert vb[[0, 1, 2, 4, 16, 128, 256]].tolist() == [t * 64 + c for t, c in tc]
    spread = torch.ones(16, 64)
    spread[4], spread[5] = 2.0 ** -10, 2.0 ** 10                       # tokens 4, 5: 20 exponents apart
    for layout, ok in (("k_mma", [False, True]), ("v_mma", [True, False])):
        assert sorted(F.mma_index(layout, head_dim=64).reshape(-1).tolist()) == list(range(1024))
        assert F.eligible(spread.to(torch.bfloat16), layout).tolist() == ok
        assert F.pack(spread.to(torch.bfloat16), layout)[1].compressed.tolist() == ok
    for layout in F.MMA_LAYOUTS:
        assert sorted(F.mma_index(layout).reshape(-1).tolist()) == list(range(2048))
        blk = _block_with_exponents(118, 131, seed=5)
        page = F.from_blocks(blk.reshape(1, 512).expand(4, 512).contiguous(), layout, 128)
        payload, meta = F.pack(page, layout)
        x = (bits(blk).to(torch.int32) & 0xFFFF).tolist()
        code = [((v >> 15) << 3) | (((v >> 8) & 0x7F) - 59) for v in x]
        assert payload[:512].tolist() == [v & 0xFF for v in x]
        assert payload[512:768].tolist() == [code[i] | (code[i + 256] << 4) for i in range(256)]


def test_cache_stats_and_to_pages():
    x = random_pages((2, 16), 128, seed=5, spread=1.0).reshape(2, 256, 128)
    x = torch.cat([x, x[:, :5]], 1)                                   # 261 tokens: a partial page
    pages = F.to_pages(x)
    assert pages.shape == (2, 16, 16, 128)
    for layout in F.LAYOUTS:
        st = F.cache_stats(pages, layout)
        n = int(F.eligible(pages, layout).sum())
        assert (st.n_pages, st.n_blocks, st.n_compressed) == (32, 128, n)
        assert st.raw_bytes == 128 * 1024 and st.packed_bytes == 128 * 1024 - 256 * n
        assert st.frac_blocks == pytest.approx(n / 128)
        assert st.bits_per_value == pytest.approx(16 - 4 * n / 128)    # each compressed block: 12 of 16 bits
        _, meta = F.pack(pages, layout)
        assert int(meta.nbytes.sum()) == st.packed_bytes


def test_errors():
    good = random_pages((2,), 64)
    with pytest.raises(TypeError, match="pages.*bfloat16.*float32"):
        F.pack(good.float())
    with pytest.raises(TypeError, match="pages must be a torch.Tensor"):
        F.eligible([1, 2, 3])
    with pytest.raises(TypeError, match=r"head_dim must be an int, one of .* got str '64'"):
        F.page_bytes("64")                                   # was a ValueError saying "got 64"
    with pytest.raises(ValueError, match=r"head_dim must be one of.*got 96"):
        F.pack(torch.zeros(16, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"pages must have shape \[..., 16, head_dim\], got \(2, 15, 64\)"):
        F.eligible(good[:, :15])
    with pytest.raises(ValueError, match="layout must be one of"):
        F.pack(good, "row")
    payload, meta = F.pack(good)
    with pytest.raises(TypeError, match="payload must be a uint8"):
        F.unpack(payload.to(torch.int16), meta)
    with pytest.raises(TypeError, match="meta must be a PageMeta"):
        F.unpack(payload, None)
    with pytest.raises(ValueError, match="payload must have shape"):
        F.unpack(payload[:1], meta)
    with pytest.raises(ValueError, match="shorter than"):
        F.unpack(payload[:, :100], meta)
    with pytest.raises(ValueError, match="enable must be a bool tensor"):
        F.pack(good, enable=torch.ones(3, 2, dtype=torch.bool))
    for bad in ([False, False], None, "yes"):       # read as one truth value, these packed every block or none
        with pytest.raises(TypeError, match=r"enable must be a bool or a bool tensor \[..., n_blocks\], got"):
            F.pack(good, enable=bad)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        F.n_blocks(48)
    for layout in F.MMA_LAYOUTS:
        with pytest.raises(ValueError, match=f"the '{layout}' layout is defined for head_dim 64 and 128 only, got "
                                             "head_dim 32"):
            F.pack(random_pages((2,), 32), layout)
    with pytest.raises(ValueError, match="head_dim 64 and 128 only, got head_dim 256"):
        F.PageMeta.from_packed(torch.zeros(8, dtype=torch.uint8), "v_mma", 256)


@pytest.mark.parametrize("base", [101, 255])
def test_unpack_rejects_an_odd_base(base):
    """A compressed block's base is its lowest exponent rounded down to even: an odd one is impossible."""
    page = F.from_blocks(_block_with_exponents(100, 115).reshape(1, 512).expand(4, 512), "token", 128)
    payload, meta = F.pack(page)
    bad_base = meta.base.clone()
    bad_base[2] = base
    with pytest.raises(ValueError, match=rf"meta.base: compressed block \(2,\) has base {base}; .*is even"):
        F.unpack(payload, F.PageMeta("token", 128, meta.compressed, bad_base))
    # The same base on a raw block is ignored (raw blocks carry no base).
    raw = meta.compressed.clone()
    raw[2] = False
    payload = F.pack(page, enable=raw)[0]
    assert torch.equal(bits(F.unpack(payload, F.PageMeta("token", 128, raw, bad_base))), bits(page))


@pytest.mark.parametrize("base", [242, 250, 254])
def test_unpack_rejects_a_base_whose_codes_pass_exponent_255(base):
    """Above 240 a base is legal only with codes that keep every exponent <= 255 (what pack writes);
    the codes of a block packed with base 100 reach e >> 1 = b/2 + 7 > 127 and would flip sign bits."""
    for layout in ("token", "channel", "k_mma", "v_mma"):
        page = F.from_blocks(_block_with_exponents(100, 115).reshape(1, 512).expand(4, 512), layout, 128)
        payload, meta = F.pack(page, layout)
        bad_base = meta.base.clone()
        bad_base[1] = base
        with pytest.raises(ValueError, match=rf"compressed block \(1,\) has base {base}, but its codes name exponents above 255"):
            F.unpack(payload, F.PageMeta(layout, 128, meta.compressed, bad_base))


def test_bases_above_240_round_trip():
    """pack writes bases 242..254 for blocks whose exponents all lie in [242, 255]; they stay legal."""
    for emin in (242, 247, 254):
        page = F.from_blocks(_block_with_exponents(emin, 255).reshape(1, 512).expand(4, 512), "token", 128)
        payload, meta = F.pack(page)
        assert meta.base.tolist() == [emin & ~1] * 4
        assert torch.equal(bits(F.unpack(payload, meta)), bits(page))


def test_unpack_rejects_the_metadata_byte_0xff_on_a_low_block():
    """0xFF = compressed, base 254: from_packed reads it; with codes of a block packed at base ~100 it is refused."""
    payload, meta = F.pack(random_pages((1,), 128, spread=0.0))
    assert bool(meta.compressed[0, 0])
    packed = meta.packed().clone()
    packed[0, 0] = 0xFF
    with pytest.raises(ValueError, match="has base 254, but its codes"):
        F.unpack(payload, F.PageMeta.from_packed(packed, "token", 128))
    with pytest.raises(TypeError, match="PageMeta.base must be a uint8"):
        F.unpack(payload, F.PageMeta("token", 128, meta.compressed, meta.base.to(torch.int32)))


def test_format_benchmark_times_every_layout_beside_its_anchor():
    """The speed of eligible/pack/unpack is a benchmark (python -m zipkv bench format), not a wall-clock test."""
    from zipkv.bench.format import format_benchmark

    table = format_benchmark(head_dim=128, n_values=16 * 128 * 8, reps=1)
    assert table.op.tolist() == ["amax over the same bytes (anchor)", *[f"eligible ({l})" for l in F.LAYOUTS],
                                 "pack (token)", "unpack (token)"]
    assert (table.seconds > 0).all()
    with pytest.raises(ValueError, match="n_values=10"):
        format_benchmark(n_values=10)


def test_mma_layouts_at_head_dim_64_are_half_tiles():
    """The Gluon kernel reads a head_dim-64 page pair (A, B) as one head_dim-128 operand tile: key blocks
    (A0, B0, A1, B1), value blocks (A0, A1, B0, B1). Reassembled in that order, the pair's blocks are the
    head_dim-128 layout of the tile whose row r holds tokens 2l, 2l + 1 (l = r % 4 + 4 (r >> 3)) of A
    where (r >> 2) & 1 == 0, else of B."""
    a, b = random_pages((2,), 64, seed=9)
    for layout, order in (("k_mma", [(a, 0), (b, 0), (a, 1), (b, 1)]), ("v_mma", [(a, 0), (a, 1), (b, 0), (b, 1)])):
        tile = F.from_blocks(torch.stack([F.to_blocks(p, layout)[j] for p, j in order]), layout, 128)
        rows = torch.arange(16)
        l = rows % 4 + 4 * (rows >> 3)
        src = torch.where((((rows >> 2) & 1) == 0)[:, None, None], a[None], b[None])    # [16, 16, 64]
        want = torch.cat([src[rows, 2 * l], src[rows, 2 * l + 1]], -1)
        assert torch.equal(bits(tile), bits(want)), layout


def test_mma_index_is_only_for_the_mma_layouts():
    """``mma_index("token")`` returned the v_mma index: a silently wrong arrangement for a layout that has none."""
    for layout in ("token", "channel"):
        with pytest.raises(ValueError, match=rf"layout must be one of the mma layouts .* got '{layout}'"):
            F.mma_index(layout)
    assert F.mma_index("k_mma").shape == (4, 512)


def test_malformed_arguments_are_named_before_they_are_used():
    """Arguments that are not tensors, or metadata of another head_dim, were used before they were checked: an
    AttributeError from ``meta.compressed.shape`` or ``payload.shape``, a message naming ``head_dim`` for
    ``meta.head_dim`` or ``layout`` for ``meta.layout``, a float ``compressed`` sealed with check bytes."""
    import numpy as np

    good = random_pages((3,), 64)
    payload, meta = F.pack(good)
    for validate in (True, False):
        with pytest.raises(TypeError, match="PageMeta.compressed must be a bool tensor, got <class 'list'>"):
            F.unpack(payload, F.PageMeta("token", 64, [True, False], meta.base), validate=validate)
        with pytest.raises(ValueError, match=r"PageMeta.head_dim: head_dim must be one of .* got 48"):
            F.unpack(payload, F.PageMeta("token", 48, meta.compressed, meta.base), validate=validate)
        with pytest.raises(ValueError, match="PageMeta.layout must be one of .* got 'row'"):
            F.unpack(payload, F.PageMeta("row", 64, meta.compressed, meta.base), validate=validate)
    sums = F.page_checksum(payload, meta)
    for bad in (payload.tolist(), None):
        with pytest.raises(TypeError, match=r"payload must be a uint8 tensor \[..., L\] .* got (list|NoneType)"):
            F.verify_checksum(bad, sums, meta)
    with pytest.raises(TypeError, match=r"got torch.uint8 tensor of shape \(\)"):
        F.page_checksum(torch.tensor(5, dtype=torch.uint8))         # was "must be a uint8 tensor, got torch.uint8"
    with pytest.raises(TypeError, match=r"blocks must be a torch.Tensor \[..., 2, 512\], got list"):
        F.from_blocks([[0.0] * 512] * 2, "token", 64)
    with pytest.raises(TypeError, match="PageMeta.compressed must be a bool tensor, got torch.float32"):
        F.PageMeta("token", 64, meta.compressed.float(), meta.base).sealed()
    with pytest.raises(IndexError, match=r"PageMeta\[10\]: the metadata holds pages \(3,\)"):
        meta[10]
    assert not bool(F.pack(good, enable=np.bool_(False))[1].compressed.any())   # numpy's bool: "got bool" before
    assert torch.equal(bits(F.unpack(*F.pack(good, enable=np.bool_(True)))), bits(good))
