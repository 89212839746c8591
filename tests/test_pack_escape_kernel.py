"""zipkv.kernels.pack_escape: the escape format's Triton pack kernel, bit-identical to zipkv.escape.pack_slots (blocks,
each page-head's list after them, metadata and second bytes). On the CPU under TRITON_INTERPRET=1 (integer ops
only); on a GPU the same tests run on the device."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zipkv import escape as E, format as F  # noqa: E402
from zipkv.kernels import pack_escape as K  # noqa: E402
from test_format_escape import FILLERS, pattern_blocks, random_pages  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _raw_pool(pages, layout):
    """A pool of raw slots of ``pages`` [n, 16, d] (with one slot of padding) and their offsets."""
    n, d = pages.shape[0], pages.shape[-1]
    pb = F.page_bytes(d)
    payload, _ = F.pack(pages, layout, enable=torch.zeros(n, F.n_blocks(d), dtype=torch.bool))
    return torch.cat([payload.reshape(-1), torch.zeros(pb, dtype=torch.uint8)]), torch.arange(n) * pb


def _assert_kernel_is_reference(pages, layout):
    d = pages.shape[-1]
    pb = F.page_bytes(d)
    pool, off = _raw_pool(pages, layout)
    ref = pool.clone()
    want_packed, want_second = E.pack_slots(ref, off, d, layout)
    got_pool, got_off = pool.to(DEV), off.to(DEV)
    packed, second = K.pack_slots(got_pool, got_off, d, layout)
    assert torch.equal(packed.cpu(), want_packed) and torch.equal(second.cpu(), want_second)
    used = F.PageMeta.from_packed(want_packed, layout, d).nbytes + 2 * (want_second & 0x7F).long().sum(-1)
    k = torch.arange(pb)
    mask = k[None] < used[:, None]                 # the blocks and the list; the slot's rest is not part of it
    idx = off[:, None] + k
    diff = ((got_pool.cpu()[idx] != ref[idx]) & mask).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"
    return want_second


@pytest.mark.parametrize("filler", FILLERS)
@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_all_bit_patterns_every_position(filler, layout):
    """Every BF16 pattern at every position: coded, escaped, coded as pair 0 in zero mode, or raw (more than 127)."""
    pages = F.from_blocks(pattern_blocks(FILLERS[filler]).reshape(-1, 2, 512), layout, 64).contiguous()
    second = _assert_kernel_is_reference(pages, layout)
    if filler == "huge":
        assert int((second & 0x7F).sum()) > 0


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_random_pages_every_layout(d):
    pages = random_pages((7,), d, seed=d, zeros=0.03).contiguous()
    for layout in F.layouts_for(d):
        _assert_kernel_is_reference(pages, layout)


def test_pack_pages_from_plain_pages_round_trips():
    d = 64
    pages = random_pages((9,), d, seed=4, zeros=0.02).contiguous()
    for layout in F.layouts_for(d):
        payload, packed, second = K.pack_pages(pages.to(DEV), layout, pages_per_program=2)
        m = F.PageMeta.from_packed(packed.cpu(), layout, d)
        esc = E.list_descriptors(torch.arange(9) * F.page_bytes(d) + m.nbytes, second.cpu())
        lists, count, zero = E.read_lists(payload.cpu().reshape(-1), esc)
        em = E.EscapeMeta(layout, d, lists.shape[-1], m.compressed, m.base, count, zero, per_page=True)
        back = E.unpack(payload.cpu(), lists, em)
        assert torch.equal(back.view(torch.int16), pages.view(torch.int16))


def test_the_memory_packs_with_the_kernel_as_with_the_reference():
    """KVMemory(block_format="escape") with the kernel as its packer: the same descriptors and bytes."""
    from zipkv.memory import KVMemory
    L, H, d = 2, 2, 64
    g = torch.Generator().manual_seed(0)
    kv = [tuple(random_pages((H,), d, seed=10 * l + i, zeros=0.02).reshape(H, 16, d).repeat(1, 3, 1)
                for i in range(2)) for l in range(L)]
    mems = [KVMemory(L, H, d, 64 * L * 2 * H * F.page_bytes(d), pages_per_chunk=2, block_format="escape",
                     device=DEV, pack_slots=p) for p in (None, K.pack_slots)]
    for m in mems:
        m.admit("a", 48, 4)
        for l, (k, v) in enumerate(kv):
            m.write(l, "a", 0, k.to(DEV), v.to(DEV))
        m.compress()
    assert torch.equal(mems[0].desc_all.cpu(), mems[1].desc_all.cpu())
    assert torch.equal(mems[0].pages.esc_all.cpu(), mems[1].pages.esc_all.cpu())
    from zipkv.paged import PagedKVCache
    pages = torch.tensor(mems[1].requests["a"].pages)
    for l in range(L):                          # the bytes read back (past a page's bytes the slots may differ)
        got = [PagedKVCache(m.pool[: m.total_bytes].cpu(), m.desc[l].cpu(), d, escapes=m.esc[l].cpu()).read_pages(pages)
               for m in mems]
        for x, y, want in zip(*got, kv[l]):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
            assert torch.equal(x.permute(1, 0, 2, 3).reshape(H, -1, d).view(torch.int16), want.view(torch.int16))
    del g


def test_bad_input_is_named():
    pool = torch.zeros(4096 + 2048, dtype=torch.uint8)
    off = torch.tensor([0, 2048])
    with pytest.raises(ValueError, match="dst_offsets"):
        K.pack_into(pool, off, pool, off + 8, 64, "token", src_packed=True)
    with pytest.raises(TypeError, match="src_offsets"):
        K.pack_into(pool, off.int(), pool, off, 64, "token", src_packed=True)
    with pytest.raises(ValueError, match="src_packed"):
        K.pack_into(pool, off, pool, off, 64, "k_mma")
    with pytest.raises(ValueError, match="layout"):
        K.pack_into(pool, off, pool, off, 64, "rows", src_packed=True)
