"""zipkv.kernels.pack: the Triton pack kernel, bit-identical to zipkv.format.pack.

On CPU it runs under TRITON_INTERPRET=1 (few, large programs: the interpreter's cost is
per program)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zipkv import format as F  # noqa: E402
from zipkv.kernels.decode_attention import build_paged_cache, compress_cache_  # noqa: E402
from zipkv.kernels.pack import pack_into, pack_pages  # noqa: E402
from test_format import all_pattern_blocks, bits  # noqa: E402  (every BF16 pattern in every position)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_pages(n, d, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, d, generator=g) * torch.exp(spread * torch.randn(n, 1, 1, generator=g))
    return x.to(torch.bfloat16)


def assert_same(payload, meta, ref_payload, ref_meta):
    """Same metadata, and the same bytes in each page's used prefix (``nbytes``; the kernel leaves
    the rest of a slot as it was)."""
    assert torch.equal(meta.packed().cpu(), ref_meta.packed()), "metadata differs"
    used = torch.arange(payload.shape[-1]) < ref_meta.nbytes[..., None]
    diff = ((payload.cpu() != ref_payload) & used).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} payload bytes differ, first at {diff[:3].tolist()}"


@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_all_bit_patterns_every_position(layout):
    blocks = all_pattern_blocks()
    pages = F.from_blocks(blocks.view(torch.bfloat16).reshape(-1, 4, 512), layout, 128).contiguous()
    ref_payload, ref_meta = F.pack(pages, layout)
    payload, meta = pack_pages(pages.to(DEV), layout)
    assert bool(meta.compressed.all())
    assert_same(payload, meta, ref_payload, ref_meta)
    meta_cpu = F.PageMeta(layout, 128, meta.compressed.cpu(), meta.base.cpu())
    assert torch.equal(bits(F.unpack(payload.cpu(), meta_cpu)), bits(pages))


def test_all_bit_patterns_raw():
    i = torch.arange(65536, dtype=torch.int32)
    pages = ((i % 128) * 512 + i // 128).to(torch.int16).view(torch.bfloat16).reshape(-1, 16, 128)
    for layout in F.LAYOUTS:
        payload, meta = pack_pages(pages.to(DEV), layout)
        assert not bool(meta.compressed.any())
        assert_same(payload, meta, *F.pack(pages, layout))


@pytest.mark.parametrize("layout,d", [(lay, d) for d in F.HEAD_DIMS for lay in F.layouts_for(d)])
def test_random_mixed_pages(d, layout):
    pages = random_pages(5, d, seed=d)                  # 5 pages, 2 per program: a partial program
    pages[0, 3, 1] = float("inf")
    pages[2, 7, 0] = float("nan")
    ref_payload, ref_meta = F.pack(pages, layout)
    assert 0 < ref_meta.compressed.float().mean() < 1
    payload, meta = pack_pages(pages.to(DEV), layout, pages_per_program=2)
    assert_same(payload, meta, ref_payload, ref_meta)
    # in place: the pages' own memory becomes the payload
    buf = pages.to(DEV).clone()
    out = buf.view(torch.uint8).view(5, -1)
    payload2, meta2 = pack_pages(buf, layout, out=out, pages_per_program=4)
    assert payload2.data_ptr() == buf.data_ptr()
    assert_same(payload2, meta2, ref_payload, ref_meta)


def test_pack_into_offsets():
    """Scattered source and destination slots; bytes of a slot past the page's size are not written."""
    d, layout = 64, "channel"
    pages = random_pages(3, d, seed=7)
    pages[1, 0, 0] = 1e20                               # page 1, block 0: raw
    pb = F.page_bytes(d)
    src = torch.zeros(6 * pb // 2, dtype=torch.bfloat16)
    src_off = torch.tensor([4, 0, 2], dtype=torch.int64) * pb
    for i in range(3):
        src[src_off[i] // 2: src_off[i] // 2 + 16 * d] = pages[i].reshape(-1)
    dst = torch.full((4 * pb + 256,), 0xAB, dtype=torch.uint8, device=DEV)   # stale bytes
    dst_off = torch.tensor([3, 1, 0], dtype=torch.int64) * pb + 256
    meta = pack_into(src.to(DEV), src_off.to(DEV), dst, dst_off.to(DEV), d, layout)
    ref_payload, ref_meta = F.pack(pages, layout)
    assert 0 < ref_meta.compressed.float().mean() < 1
    assert torch.equal(meta.cpu(), ref_meta.packed())
    assert bool((dst[:256] == 0xAB).all())
    for i in range(3):
        n = int(ref_meta.nbytes[i])
        assert n < pb or i == 1
        assert torch.equal(dst[dst_off[i]: dst_off[i] + n].cpu(), ref_payload[i, :n])
        assert bool((dst[dst_off[i] + n: dst_off[i] + pb] == 0xAB).all())    # tail untouched


@pytest.mark.parametrize("k_layout,v_layout", [("token", "channel"), ("channel", "token"), ("k_mma", "v_mma")])
def test_compress_cache_in_place(k_layout, v_layout):
    """Compressing a raw cache in place gives the cache built compressed, byte for byte."""
    g = torch.Generator().manual_seed(3)
    d = 128 if k_layout in F.MMA_LAYOUTS else 64
    k = torch.randn(2, 2, 40, d, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 40, d, generator=g).to(torch.bfloat16)
    lens = [40, 33]
    ref, ip, idx, last = build_paged_cache(k, v, lens, k_layout=k_layout, v_layout=v_layout)
    raw, ip2, idx2, last2 = build_paged_cache(k, v, lens, k_layout=k_layout, v_layout=v_layout, compress="none")
    assert torch.equal(idx, idx2)
    full = torch.tensor([int(p) for b, n in enumerate(lens) for j, p in enumerate(idx[ip[b]: ip[b + 1]])
                         if (j + 1) * 16 <= n], dtype=torch.int32)
    assert full.numel() == 4                            # 40 tokens: 2 full pages, 33: 2 full
    raw = type(raw)(raw.pool.to(DEV), raw.desc.to(DEV), raw.head_dim, raw.k_layout, raw.v_layout)
    compress_cache_(raw, full.to(DEV), pages_per_program=2)
    assert torch.equal(raw.desc.cpu(), ref.desc)
    # every block's stored bytes equal (a slot's tail past its used size keeps the raw bytes)
    d = ref.desc
    size = torch.where(((d >> 7) & 1).bool(), 768, 1024)
    for addr, n in zip((d >> 8).flatten().tolist(), size.flatten().tolist()):
        assert torch.equal(raw.pool[addr: addr + n].cpu(), ref.pool[addr: addr + n])
    ka, va = raw.read_pages()
    kb, vb = ref.read_pages()
    assert torch.equal(bits(ka.cpu()), bits(kb)) and torch.equal(bits(va.cpu()), bits(vb))
    with pytest.raises(ValueError, match="must be raw"):
        compress_cache_(raw, full[:1].to(DEV))


def test_errors():
    pages = random_pages(2, 64).to(DEV)
    with pytest.raises(TypeError, match="pages must have dtype torch.bfloat16, got torch.float32"):
        pack_pages(pages.float())
    with pytest.raises(ValueError, match="head_dim must be one of"):
        pack_pages(torch.zeros(2, 16, 48, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match=r"pages must have shape \[N, 16, head_dim\]"):
        pack_pages(pages[0])
    with pytest.raises(ValueError, match="pages must be contiguous"):
        pack_pages(torch.zeros(2, 64, 16, dtype=torch.bfloat16, device=DEV).transpose(1, 2))
    with pytest.raises(ValueError, match="layout must be one of"):
        pack_pages(pages, "rows")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"pages_per_program must be a positive int or None, got {bad!r}"):
            pack_pages(pages, pages_per_program=bad)
    with pytest.raises(TypeError, match="out must have dtype torch.uint8"):
        pack_pages(pages, out=torch.empty(2, 2048, dtype=torch.int16, device=DEV))
    with pytest.raises(ValueError, match=r"out must have shape \[2, 2048\]"):
        pack_pages(pages, out=torch.empty(2, 1024, dtype=torch.uint8, device=DEV))
    buf = torch.empty(3 * 2048, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="partially overlaps"):
        pack_pages(buf[:4096].view(torch.bfloat16).view(2, 16, 64), out=buf[1024:5120].view(2, 2048))
    off = torch.tensor([0, 100], dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="multiples of 256"):
        pack_into(pages.view(-1), off, buf, off, 64)
    with pytest.raises(ValueError, match="multiples of 256"):
        pack_into(pages.view(-1), off * 0, buf, torch.tensor([0, 8192], device=DEV), 64)
    with pytest.raises(TypeError, match="src_offsets must have dtype torch.int64"):
        pack_into(pages.view(-1), off.int(), buf, off, 64)
    with pytest.raises(ValueError, match="src must be a contiguous 1-D buffer"):
        pack_into(pages, off, buf, off, 64)
    with pytest.raises(ValueError, match="'k_mma' layout is defined for head_dim 64 and 128 only, got head_dim 32"):
        pack_pages(pages.view(-1, 16, 32), "k_mma")
    with pytest.raises(ValueError, match="reads mma-layout pages only as all-raw packed slots"):
        pack_into(pages.view(-1), off * 0, buf, off * 0, 128, "v_mma")


def test_unaligned_buffer_is_refused():
    """The kernel moves 16-byte words: buffers must start 16-byte aligned."""
    d = 64
    pages = random_pages(1, d)
    pb = F.page_bytes(d)
    src = torch.zeros(pb + 16, dtype=torch.uint8, device=DEV)
    src[8: 8 + pb] = pages.view(torch.uint8).reshape(-1).to(DEV)
    off = torch.zeros(1, dtype=torch.int64, device=DEV)
    dst = torch.zeros(pb, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="16-byte aligned"):
        pack_into(src[8: 8 + pb], off, dst, off, d)
