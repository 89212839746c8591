"""Fault injection into the block format's metadata and payload (zipkv.format's "Validation and checksums").

Metadata: every single-bit flip of a flag, base, check byte or descriptor, and every relabelled layout, either
raises ``ValueError`` in validate mode or decodes bit-exactly the original values -- never different values.
``unpack(validate=True)`` runs on every layout at head_dim 64 and 128; the decode path is ``plan(validate=True)``
with the Triton kernel under ``TRITON_INTERPRET=1`` (token and channel layouts) and, for the mma layouts (whose
Gluon kernel needs a GPU), the checks ``plan`` runs (``check_values``) followed by the fp32 torch reference.
Payload: with checksums every single-bit flip is found."""
import functools
import os
import re
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, event, given, settings, strategies as st  # noqa: E402

from zipkv import format as F  # noqa: E402
from zipkv.kernels.decode_attention import build_paged_cache, compress_cache_, plan  # noqa: E402
from zipkv.kernels.inputs import check_values  # noqa: E402
from zipkv.kernels.reference import decode_attention_reference  # noqa: E402
from zipkv.paged import PagedKVCache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(layout, d) for d in (64, 128) for layout in F.layouts_for(d)]
KINDS = ("compressed", "raw", "mixed")
WINDOWS = (0, 1, 2, 30, 100, 116, 117, 127, 200, 239, 240, 241, 242, 247, 254)
"""Lowest exponents of the generated blocks: base 0, odd minima, bases up to and past NO_CARRY_BASE (240),
windows reaching exponent 255 (inf and NaN)."""
FAULTS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(x):
    return x.contiguous().view(torch.int16)


@functools.lru_cache(maxsize=None)
def packed_pages(layout: str, d: int, kind: str, seed: int):
    """3 pages x 2 heads of blocks whose exponents lie in 16-wide windows (compressible) or, in mixed pages, 20
    wide: ``(pages [3, 2, 16, d], payload, meta)``."""
    g = torch.Generator().manual_seed(seed)
    nb = F.n_blocks(d)
    shape = (3, 2, nb)
    lo = torch.tensor(WINDOWS)[torch.randint(len(WINDOWS), shape, generator=g)][..., None]
    width = 15 - (lo & 1)
    wide = (torch.rand(shape, generator=g) < 0.3)[..., None] & (kind == "mixed") & (lo < 200)
    width = torch.where(wide, torch.full_like(width, 20), width)
    e = (lo + (torch.rand(*shape, 512, generator=g) * (width + 1)).long()).clamp(max=255)
    e[..., :1] = lo
    e[..., 1:2] = (lo + width).clamp(max=255)
    s = torch.randint(0, 2, (*shape, 512), generator=g)
    f = torch.randint(0, 128, (*shape, 512), generator=g)
    blocks = ((s << 15) | (e << 7) | f).to(torch.int16).view(torch.bfloat16)
    pages = F.from_blocks(blocks, layout, d)
    enable = {"compressed": True, "raw": False, "mixed": torch.rand(shape, generator=g) < 0.7}[kind]
    payload, meta = F.pack(pages, layout, enable=enable)
    if kind == "compressed":
        assert bool(meta.compressed.all())
    if kind == "mixed":
        assert bool(meta.compressed.any()) and not bool(meta.compressed.all())
    return pages, payload, meta


def flipped(meta: F.PageMeta, field: str, at: tuple, bit: int) -> F.PageMeta:
    """``meta`` with one bit of one field flipped (``packed``: a bit of the kernels' metadata byte, read back with
    from_packed as a descriptor is) or its layout relabelled (``layout``: the ``bit``-th other layout)."""
    if field == "layout":
        others = [x for x in F.layouts_for(meta.head_dim) if x != meta.layout]
        return F.PageMeta(others[bit % len(others)], meta.head_dim, meta.compressed, meta.base, meta.check)
    if field == "compressed":
        comp = meta.compressed.clone()
        comp[at] = ~comp[at]
        return F.PageMeta(meta.layout, meta.head_dim, comp, meta.base, meta.check)
    if field == "packed":
        packed = meta.packed().clone()
        packed[at] ^= 1 << bit
        return F.PageMeta.from_packed(packed, meta.layout, meta.head_dim, meta.check)
    x = getattr(meta, field).clone()
    x[at] ^= 1 << bit
    return F.PageMeta(meta.layout, meta.head_dim, meta.compressed, *((x, meta.check) if field == "base" else (meta.base, x)))


@FAULTS
@given(case=st.sampled_from(CASES), kind=st.sampled_from(KINDS), seed=st.integers(0, 2),
       field=st.sampled_from(["compressed", "base", "check", "packed", "layout"]),
       page=st.integers(0, 2), head=st.integers(0, 1), block=st.integers(0, 3), bit=st.integers(0, 7),
       trimmed=st.booleans())
def test_a_metadata_bit_flip_raises_or_decodes_the_original_values(case, kind, seed, field, page, head, block, bit,
                                                                   trimmed):
    layout, d = case
    pages, payload, meta = packed_pages(layout, d, kind, seed)
    bad = flipped(meta, field, (page, head, block % meta.n_blocks), bit)
    if trimmed:                                        # the payload cut to the bytes the pages use
        payload = payload[..., : int(meta.nbytes.max())]
    try:
        out = F.unpack(payload, bad, validate=True)
    except ValueError:
        event("raised")
        return
    event("decoded")
    assert torch.equal(bits(out), bits(pages)), (field, bit)


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), kind=st.sampled_from(KINDS), seed=st.integers(0, 2),
       field=st.sampled_from(["compressed", "base", "layout"]), page=st.integers(0, 2), head=st.integers(0, 1),
       block=st.integers(0, 3), bit=st.integers(1, 7))
def test_check_bytes_catch_what_the_structural_checks_miss(case, kind, seed, field, page, head, block, bit):
    """With check bytes every flipped flag, every base changed to another even value (also a raw block's) and
    every relabelled layout raises. Without them (check=None: the structural checks alone) such flips often decode
    wrong values silently (hypothesis's statistics, ``pytest --hypothesis-show-statistics``, count them)."""
    layout, d = case
    pages, payload, meta = packed_pages(layout, d, kind, seed)
    bad = flipped(meta, field, (page, head, block % meta.n_blocks), bit)
    with pytest.raises(ValueError):
        F.unpack(payload, bad)
    bare = F.PageMeta(bad.layout, d, bad.compressed, bad.base)
    try:
        same = torch.equal(bits(F.unpack(payload, bare)), bits(pages))
    except ValueError:
        same = None
    event({None: "structural: raised", True: "structural: decoded right", False: "structural: decoded WRONG"}[same])


def test_check_bytes_are_a_bijection_at_hamming_distance_4():
    """Per block the check byte is a bijection of the metadata byte (any change of it alone is caught); the 16 bits
    of (metadata byte, check byte) are at distance >= 4 (1-3 flipped bits caught); another layout or head_dim
    changes every check byte."""
    tables = {(lay, d): F._check_table(lay, d) for d in F.HEAD_DIMS for lay in F.layouts_for(d)}
    weight = torch.tensor([bin(i).count("1") for i in range(256)])
    m = torch.arange(256)
    for (lay, d), t in tables.items():
        for j in range(t.shape[0]):
            row = t[j].long()
            assert torch.unique(row).numel() == 256
            dist = weight[m[:, None] ^ m[None, :]] + weight[row[:, None] ^ row[None, :]]
            assert int((dist + 99 * torch.eye(256, dtype=torch.long)).min()) == 4, (lay, d, j)
    for (lay, d), t in tables.items():
        for (lay2, d2), t2 in tables.items():
            if (lay, d) != (lay2, d2) and t.shape == t2.shape:
                assert bool((t != t2).all()), (lay, lay2, d, d2)
    assert F._crc8(b"123456789") == 0xDF                # CRC-8/AUTOSAR's catalogue check value
    packed = torch.tensor([[0x80 | 58, 0x00, 0xFF, 0x81]], dtype=torch.uint8)
    want = [F._crc8(bytes((0, 4, j, int(packed[0, j])))) for j in range(4)]
    assert F.meta_check(packed, "token", 128).tolist() == [want]


def test_wrong_layout_or_head_dim_is_named():
    pages, payload, meta = packed_pages("token", 128, "mixed", 0)
    for other in ("channel", "k_mma", "v_mma"):
        with pytest.raises(ValueError, match=rf"meta.layout is '{other}', but the check bytes of page \(0, 0\) were "
                                             r"written for the 'token' layout \(head_dim 128\)"):
            F.unpack(payload, F.PageMeta(other, 128, meta.compressed, meta.base, meta.check))
        with pytest.raises(ValueError, match=rf"meta.layout is '{other}'.*'token' layout"):
            F.unpack(payload, F.PageMeta.from_packed(meta.packed(), other, 128, meta.check))
    pages64, payload64, meta64 = packed_pages("channel", 64, "compressed", 0)
    with pytest.raises(ValueError, match=r"payload: last dim 4096 is longer than a page slot at meta.head_dim=64 "
                                         r"\(2048 bytes\).*another head_dim.*head_dim 128"):
        F.unpack(payload, F.PageMeta("channel", 64, meta64.compressed, meta64.base, meta64.check))
    with pytest.raises(ValueError, match=r"payload: last dim 2048 is shorter than the \d+ bytes meta describes "
                                         r"\(meta.head_dim=128"):
        F.unpack(payload64, meta)
    with pytest.raises(ValueError, match=r"PageMeta.compressed/PageMeta.base must have shape \[..., 4\] \(PageMeta.head_dim=128\)"):
        F.unpack(payload, F.PageMeta("token", 128, meta64.compressed, meta64.base, meta64.check))
    with pytest.raises(ValueError, match=r"PageMeta.check must be None or a uint8 tensor of shape \(3, 2, 4\)"):
        F.unpack(payload, F.PageMeta("token", 128, meta.compressed, meta.base, meta64.check))
    # the check byte names the block; the error says what it holds
    base = meta.base.clone()
    at = tuple(int(i) for i in (meta.compressed & (meta.base != 240)).nonzero()[0])
    base[at] = 240
    with pytest.raises(ValueError, match=rf"meta: page {re.escape(str(at[:2]))}, block {at[2]}: its metadata byte 0xf8 "
                                         r"\(compressed, base 240\) does not match its check byte"):
        F.unpack(payload, F.PageMeta("token", 128, meta.compressed, base, meta.check))
    assert torch.equal(bits(F.unpack(payload, meta, validate=False)), bits(pages))


def test_codes_that_never_name_the_base_are_refused():
    """Structural, payload against metadata: b is the block's lowest exponent rounded down to even, so some code of a
    compressed block has c & 7 == 0. Codes corrupted so that none has are refused (a changed base leaves the codes
    as they were: only the check byte finds that)."""
    pages, payload, meta = packed_pages("token", 64, "compressed", 1)
    page, head, j = (int(i) for i in (meta.base <= 232).nonzero()[0])
    bad = payload.clone()
    bad[page, head, 768 * j + 512: 768 * j + 768] |= 0x11      # the block's codes: every c & 7 >= 1
    with pytest.raises(ValueError, match=rf"compressed block \({page}, {head}, {j}\) has base {int(meta.base[page, head, j])}, "
                                         r"but no value of the block has exponent"):
        F.unpack(bad, meta)


# ----------------------------------------------------------------------------- payload checksums

@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), kind=st.sampled_from(KINDS), seed=st.integers(0, 2), page=st.integers(0, 2),
       head=st.integers(0, 1), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_with_checksums_every_payload_bit_flip_is_found(case, kind, seed, page, head, where, bit):
    layout, d = case
    pages, payload, meta = packed_pages(layout, d, kind, seed)
    checksum = F.page_checksum(payload, meta)
    used = int(meta.nbytes[page, head])
    assert int(checksum[page, head]) == zlib.crc32(bytes(payload[page, head, :used].tolist()))
    bad = payload.clone()
    bad[page, head, int(where * used)] ^= 1 << bit
    with pytest.raises(ValueError, match=rf"payload: page \({page}, {head}\) has CRC-32 0x[0-9a-f]{{8}}, but its "
                                         r"checksum is 0x[0-9a-f]{8}: its bytes changed"):
        F.verify_checksum(bad, checksum, meta)
    F.verify_checksum(payload, checksum, meta)
    tail = payload.clone()                             # past the used bytes: not part of the page
    tail[page, head, used:] ^= 0xFF
    F.verify_checksum(tail, checksum, meta)


def test_page_checksum_is_zlib_crc32():
    g = torch.Generator().manual_seed(3)
    for width in (1, 255, 1024, 4096):
        x = torch.randint(0, 256, (3, width), dtype=torch.uint8, generator=g)
        assert F.page_checksum(x).tolist() == [zlib.crc32(bytes(r.tolist())) for r in x]
    assert F.page_checksum(torch.zeros(2, 0, dtype=torch.uint8)).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"checksum must be an int64 tensor of shape \(3,\)"):
        F.verify_checksum(x, F.page_checksum(x).int())


# ----------------------------------------------------------------------------- the decode path

def _kv(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
    k, v = [(x.sign() * (0.25 + x.abs() % 4)).to(torch.bfloat16) for x in (k, v)]   # every block compressible
    q = torch.randn(B, 2 * H, D, generator=g).to(torch.bfloat16)
    return q.to(DEV), k.to(DEV), v.to(DEV)


DECODE_CASES = [(kl, vl, d) for d in (64, 128) for kl, vl in
                (("token", "token"), ("channel", "token"), ("token", "channel"), ("k_mma", "v_mma"))]
PLANNED = 2                                            # requests the plan covers; request 2's pages are not read


@functools.lru_cache(maxsize=None)
def decode_case(kl, vl, d, kind, seed):
    """A cache of 3 requests (lengths 40, 33, 32: partial last pages stay raw), the page table of the first two
    (``PLANNED``; request 2's pages are in ``indices`` past ``indptr[-1]``) and their queries."""
    q, k, v = _kv(3, 2, 40, d, seed)
    compress = {"compressed": "eligible", "raw": "none", "mixed": 0.5}[kind]
    cache, ip, idx, last = build_paged_cache(k, v, [40, 33, 32], k_layout=kl, v_layout=vl, compress=compress,
                                             compact=seed % 2 == 1, seed=seed)
    return cache, (ip[: PLANNED + 1].contiguous(), idx, last[:PLANNED].contiguous()), q[:PLANNED].contiguous()


@functools.lru_cache(maxsize=None)
def decoded(kl, vl, d, kind, seed):
    """The intact cache's output for :func:`decode_case`."""
    cache, table, q = decode_case(kl, vl, d, kind, seed)
    return _decode(cache, *table, q)


def _decode(cache, ip, idx, last, q):
    """The decode path in validate mode: plan + run (Triton kernel), or for the mma layouts on a CPU the checks
    plan runs, then the torch reference."""
    if cache.k_layout in F.MMA_LAYOUTS and DEV == "cpu":
        check_values(cache, ip, idx, last)
        return decode_attention_reference(q, cache, ip, idx, last, validate=False)
    return plan(ip, idx, last, cache, q.shape[1], validate=True, path="mixed").run(q)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(DECODE_CASES), kind=st.sampled_from(KINDS), seed=st.integers(0, 1),
       unused=st.sampled_from(range(10)), pick=st.integers(0, 10 ** 6), check_byte=st.integers(0, 7),
       bit=st.integers(0, 63))
def test_plan_validate_raises_or_decodes_the_original_values(case, kind, seed, unused, pick, check_byte, bit):
    """One flipped bit of a block descriptor (any of its 64: address, flag, base) or of its check byte, in a page
    the plan reads (or, one time in ten, one it does not read): plan(validate=True) raises, or the run returns
    exactly the original output."""
    cache, (ip, idx, last), q = decode_case(*case, kind, seed)
    planned = idx[: int(ip[-1])]
    reference = case[0] in F.MMA_LAYOUTS and DEV == "cpu"     # the reference unpacks every page: used ones only
    in_plan = unused != 0 or reference
    pool_ids = planned if in_plan else idx[int(ip[-1]):]
    page = int(pool_ids[pick % pool_ids.numel()])
    kv, h, j = (pick // 7) % 2, (pick // 17) % cache.kv_heads, (pick // 37) % cache.n_blocks
    desc, check = cache.desc.clone(), cache.check.clone()
    if check_byte == 0:
        check[page, kv, h, j] ^= 1 << (bit % 8)
    else:
        desc[page, kv, h, j] ^= 1 << bit
    bad = PagedKVCache(cache.pool, desc, cache.head_dim, cache.k_layout, cache.v_layout, check)
    try:
        out = _decode(bad, ip, idx, last, q)
    except ValueError as e:
        assert in_plan, f"a flip in a page the plan does not read raised: {e}"
        assert "cache." in str(e) and "page" in str(e) or "layout" in str(e), e
        event("raised")
        return
    event("decoded")
    assert torch.equal(out, decoded(*case, kind, seed))


def test_every_descriptor_bit_flip_of_one_cache_raises():
    """Exhaustively, for one mixed cache: each of the 64 bits of every block descriptor the plan reads, and each bit
    of its check byte, flipped alone: plan's checks raise every time (the property test above samples all
    configurations; this one leaves no flip out)."""
    cache, (ip, idx, last), q = decode_case("channel", "token", 64, "mixed", 1)
    for page in idx[: int(ip[-1])].tolist():
        for kv in (0, 1):
            for h in range(cache.kv_heads):
                for j in range(cache.n_blocks):
                    for bit in range(72):
                        desc, check = cache.desc.clone(), cache.check.clone()
                        if bit < 64:
                            desc[page, kv, h, j] ^= 1 << bit
                        else:
                            check[page, kv, h, j] ^= 1 << (bit - 64)
                        with pytest.raises(ValueError, match=rf"cache\.desc: page {page}, kv head \d, (keys|values) "
                                                             r"block \d"):
                            check_values(PagedKVCache(cache.pool, desc, 64, "channel", "token", check), ip, idx, last)


@pytest.mark.parametrize("kl,vl,d", DECODE_CASES)
def test_the_brief_faults_on_the_decode_path(kl, vl, d):
    """The injector's findings: a cleared compressed flag (the raw block would overlap the next one) and a changed
    base were accepted by plan(validate=True); both raise now, naming page, head and block, with and without check
    bytes where the structure shows it."""
    cache, (ip, idx, last), q = decode_case(kl, vl, d, "compressed", 0)
    page = int(idx[0])
    for change, bare in ((lambda x: x & ~0x80, rf"page {page}, kv head 0, values block 0: a raw block with base bits"),
                         (lambda x: x & ~0xFF, rf"page {page}, kv head 0, values block 1 starts at byte \d+, but "
                                               r"block 0 \(raw, 1024 bytes"),
                         (lambda x: (x & ~0x7F) | ((x & 0x7F) + 3), None)):
        desc = cache.desc.clone()
        desc[page, 1, 0, 0] = change(desc[page, 1, 0, 0])
        bad = PagedKVCache(cache.pool, desc, d, kl, vl, cache.check)
        with pytest.raises(ValueError, match=rf"cache.desc: page {page}, kv head 0, values block 0: its metadata byte"):
            _decode(bad, ip, idx, last, q)
        if bare:                                       # structure alone: the flag's bits, or where block 1 starts
            with pytest.raises(ValueError, match=bare):
                _decode(PagedKVCache(cache.pool, desc, d, kl, vl), ip, idx, last, q)
    wrong = "channel" if kl == "token" else "token"
    if kl not in F.MMA_LAYOUTS:
        with pytest.raises(ValueError, match=rf"cache.k_layout is '{wrong}', but the check bytes of page \d+, kv head "
                                             rf"\d, keys were written for the '{kl}' layout"):
            _decode(PagedKVCache(cache.pool, cache.desc, d, wrong, vl, cache.check), ip, idx, last, q)
    other = cache.desc.clone()                          # two pages pointing at the same bytes
    other[int(idx[1])] = other[page]
    with pytest.raises(ValueError, match=r"overlaps page \d+, kv head \d, (keys|values).*share pool bytes"):
        _decode(PagedKVCache(cache.pool, other, d, kl, vl), ip, idx, last, q)


# ----------------------------------------------------------------------------- a plan's page table after plan

def test_a_checked_plan_refuses_to_run_once_its_page_table_was_written():
    cache, (ip, idx, last), q = decode_case("token", "token", 64, "mixed", 0)
    want = decoded("token", "token", 64, "mixed", 0)
    ip, idx, last = ip.clone(), idx.clone(), last.clone()
    p = plan(ip, idx, last, cache, q.shape[1], path="mixed")
    assert torch.equal(p.run(q), want)
    last[0] = 16                                          # documented: last_page_len may be raised in place
    p.run(q)
    last[0] = 8
    idx[0] = -1                                           # would read before the descriptors: undefined behaviour
    with pytest.raises(ValueError, match=r"indices was written since plan\(..., validate=True\) checked it "
                                         r"\(indices._version 0 -> 1\): plan again, or call plan.validate\(\)"):
        p.run(q)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 8\)"):
        p.validate()
    idx.copy_(decode_case("token", "token", 64, "mixed", 0)[1][1])         # the intact table
    assert torch.equal(p.validate().run(q), want)          # checked again: runs
    ip[1] = ip[1]
    with pytest.raises(ValueError, match="indptr was written since"):
        p.run(q)
    unchecked = plan(ip, idx, last, cache, q.shape[1], path="mixed", validate=False)
    idx[:] = idx.flip(0)                                   # a valid rewrite: an unchecked plan trusts the table
    assert torch.equal(unchecked.run(q), plan(ip, idx, last, cache, q.shape[1], path="mixed").run(q))


def test_a_checked_plan_refuses_descriptors_written_without_refresh():
    q, k, v = _kv(2, 2, 48, 64, 4)
    cache, ip, idx, last = build_paged_cache(k, v, [48, 40], compress="none")
    p = plan(ip, idx, last, cache, q.shape[1], routing="device")
    before = p.run(q)
    cache.desc[int(idx[0])] = cache.desc[int(idx[0])]      # an in-place write, unannounced
    with pytest.raises(ValueError, match=r"cache.desc was written since plan\(..., validate=True\) checked it .* "
                                         r"cache.refresh\(\) was not called"):
        p.run(q)
    cache.refresh()
    assert torch.equal(p.run(q), before)
    compress_cache_(cache, idx[:2].contiguous())          # refreshes: the plan reads the new descriptors
    assert (p.run(q).float() - before.float()).abs().max() <= 1e-2
    check_values(cache, ip, idx, last)                    # compress_cache_ sealed the pages it compressed
    cache.desc = cache.desc.clone()
    with pytest.raises(ValueError, match="cache.desc was replaced since"):
        p.run(q)
    with torch.inference_mode():                          # inference tensors have no version counter: not watched
        ip2, idx2, last2 = ip.clone(), idx.clone(), last.clone()
    p2 = plan(ip2, idx2, last2, cache, q.shape[1], routing="device")
    with torch.inference_mode():
        idx2[0] = idx2[0]
    p2.run(q)


# ----------------------------------------------------------------------------- pages leaving the pool

def test_export_import_round_trip_and_corruption_in_transit():
    q, k, v = _kv(2, 2, 48, 128, 6)
    src, ip, idx, last = build_paged_cache(k, v, [48, 40], compress=0.5, compact=True)
    dst, ip2, idx2, last2 = build_paged_cache(k.flip(2), v.flip(2), [48, 40], compress="none", seed=1)
    ids = idx[:3].contiguous()
    out = src.export_pages(ids)
    assert out.payload.shape == (3, 2, 2, 4096) and out.checksum.shape == (3, 2, 2)
    assert out.to("cpu").checksum.tolist() == [[[zlib.crc32(bytes(out.payload[i, kv, h, : int(out.meta(kv).nbytes[i, h])]
                                                                   .tolist())) for h in range(2)] for kv in range(2)]
                                               for i in range(3)]
    into = idx2[3:6].contiguous()
    dst.import_pages(out, into)
    want_k, want_v = src.read_pages(ids)
    got_k, got_v = dst.read_pages(into)
    assert torch.equal(bits(got_k), bits(want_k)) and torch.equal(bits(got_v), bits(want_v))
    check_values(dst, ip2, idx2, last2)                    # descriptors, check bytes and kinds consistent
    assert torch.equal(dst.page_kinds()[into.long()], src.page_kinds()[ids.long()])
    for what in ("payload", "packed", "check"):
        t = getattr(out, what).clone()
        t[1, 1, 0, 5 if what == "payload" else 1] ^= 0x10
        bad = type(out)(**{**out.__dict__, what: t})
        with pytest.raises(ValueError, match=r"pages \(values.*page \(1, 0\)"):
            dst.import_pages(bad, into)
    with pytest.raises(ValueError, match=r"pages.k_layout is 'token', this cache's k_layout 'channel'"):
        PagedKVCache(dst.pool, dst.desc, 128, "channel", "token").import_pages(out, into)
    pool, desc = dst.pool.clone(), dst.desc.clone()
    for what, value, match in (("check", None, r"pages.check must be a torch.uint8 tensor of shape \(3, 2, 2, 4\), "
                                                r"got NoneType"),
                               ("packed", out.packed.tolist(), r"pages.packed must be a uint8 tensor \[n, 2, kv_heads, 4\]"),
                               ("payload", out.payload[..., :100], r"pages.payload must be a torch.uint8 tensor of "
                                                                   r"shape \(3, 2, 2, 4096\), got torch.uint8 \(3, 2, 2, 100\)")):
        bad = type(out)(**{**out.__dict__, what: value})
        for validate in (True, False):      # the fields' types and shapes are checked either way (were raw errors)
            with pytest.raises(ValueError, match=match):
                dst.import_pages(bad, into, validate=validate)
    assert torch.equal(dst.pool, pool) and torch.equal(dst.desc, desc)
    compressed = idx[:1].contiguous() if bool(((src.desc[int(idx[0])] >> 7) & 1).any()) else None
    if compressed is not None:
        raw = dst.export_pages(idx2[:1].contiguous())
        with pytest.raises(ValueError, match=r"spans \d+ bytes, the imported page-head needs 4096"):
            src.import_pages(raw, compressed)
