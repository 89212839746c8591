"""The memory manager with pages in the escape format (zipkv.memory.escape_pages, ``block_format="escape"``): the
state machine of tests/test_memory.py (every page and byte accounted, promises covered, every request's bytes
read back bit for bit -- here through the escape descriptors) and the placement of each page's escape list."""
import pytest
import torch
from hypothesis import HealthCheck, settings

from zipkv import escape as E, format as F
from zipkv.kernels.decode_attention import PagedKVCache
from zipkv.memory import UNIT, KVMemory
from zipkv.memory.escape_pages import list_units

from test_memory import L, MemoryMachine, _tokens

pytestmark = pytest.mark.usefixtures("one_thread")


class EscapeMemoryMachine(MemoryMachine):
    """tests/test_memory.py's machine, every page in the escape format: 'wide' tokens (exponents spread over 60
    binades) now compress with many escapes (a block with more than 127 of them stays raw)."""
    BLOCK_FORMAT = "escape"

    def _memory(self, budget, ppc):
        return KVMemory(L, self.HEADS, self.DIM, budget, pages_per_chunk=ppc, k_layout=self.LAYOUTS[0],
                        v_layout=self.LAYOUTS[1], block_format="escape")

    def _cache(self, l):
        return PagedKVCache(self.m.pool[: self.m.total_bytes], self.m.desc[l], self.DIM, *self.LAYOUTS,
                            escapes=self.m.esc[l])


class EscapeMmaMemoryMachine(EscapeMemoryMachine):
    HEADS, DIM, LAYOUTS = 2, 64, ("k_mma", "v_mma")


EscapeMemoryMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
EscapeMmaMemoryMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=40, deadline=None,
                                                    suppress_health_check=[HealthCheck.too_slow])
TestEscapeMemoryMachine = EscapeMemoryMachine.TestCase
TestEscapeMmaMemoryMachine = EscapeMmaMemoryMachine.TestCase


def _spread(gen, n, heads, dim):
    """bf16 [heads, n, dim]: normal values, a few (0.4 %) 2**-21 .. 2**-18 times as large: about two escapes per block (most
    blocks do not fit ZipFusion's window)."""
    x = torch.randn(heads, n, dim, generator=gen).abs() + 0.5
    small = torch.rand(heads, n, dim, generator=gen) < 0.004
    return (x * torch.where(small, torch.exp2(-torch.randint(18, 22, (heads, n, dim), generator=gen).float()), 1.0)).bfloat16()


def _kv(gen, n, heads, dim):
    return [(_spread(gen, n, heads, dim), _spread(gen, n, heads, dim)) for _ in range(L)]


def test_a_moved_page_keeps_one_list_after_its_last_page_head():
    """Every block compressed; each page's lists (all page-heads) lie back to back after its last page-head, in whole
    units counted in its bytes; the escape descriptors point there and the bytes read back."""
    heads, dim = 2, 64
    page = 2 * heads * F.page_bytes(dim)
    m = KVMemory(L, heads, dim, 24 * L * page, pages_per_chunk=4, k_layout="k_mma", v_layout="v_mma",
                 block_format="escape")
    gen = torch.Generator().manual_seed(0)
    kv = _kv(gen, 16 * 6 + 5, heads, dim)
    ids = m.admit_packed("a", m.pack(kv), 4)
    assert ids is not None and len(ids) == 7
    for l, (k, v) in enumerate(kv):
        m.write(l, "a", 96, k[:, 96:], v[:, 96:])
    for l in range(L):
        d, e = m.desc[l][ids[:6]], m.esc[l][ids[:6]]                 # [6, 2, H, nb]
        count = (e & 0x7F).sum((-1, -2, -3))
        assert bool(((d >> 7) & 1).bool().all()) and int(count.min()) > 0
        end = (d[:, 1, -1, -1] >> 8) + F.PACKED_BLOCK_BYTES           # after the last page-head's last block
        first = e[:, 0, 0, 0] >> 8
        assert torch.equal(first, end)
        units = 3 * F.n_blocks(dim) * 2 * heads + list_units(count)
        assert m.used_bytes(l) == UNIT * int(units.sum()) + m.page_bytes
        cache = PagedKVCache(m.pool[: m.total_bytes], m.desc[l], dim, "k_mma", "v_mma", escapes=m.esc[l])
        k, v = (x.permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :101] for x in cache.read_pages(torch.tensor(ids)))
        assert torch.equal(k.view(torch.int16), kv[l][0].view(torch.int16))
        assert torch.equal(v.view(torch.int16), kv[l][1].view(torch.int16))


def test_pages_filled_by_decode_compress_in_place_then_move_with_their_lists():
    heads, dim = 1, 128
    page = 2 * heads * F.page_bytes(dim)
    m = KVMemory(L, heads, dim, 12 * L * page, pages_per_chunk=2, block_format="escape")
    gen = torch.Generator().manual_seed(1)
    kv = _kv(gen, 80, heads, dim)
    m.admit("a", 80, 8)
    for l, (k, v) in enumerate(kv):
        m.write(l, "a", 0, k, v)
    out = m.compress()
    assert out["moved"] + out["in_place"] == 5 * L
    m.reads_done()
    for l in range(L):
        cache = PagedKVCache(m.pool[: m.total_bytes], m.desc[l], dim, "token", "token", escapes=m.esc[l])
        pages = torch.tensor(m.requests["a"].pages)
        k, v = (x.permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :80] for x in cache.read_pages(pages))
        assert torch.equal(k.view(torch.int16), kv[l][0].view(torch.int16))
        assert torch.equal(v.view(torch.int16), kv[l][1].view(torch.int16))
        assert bool(((m.desc[l][pages] >> 7) & 1).bool().all())       # every block compressed


def test_the_escape_format_fits_more_than_zipfusions_under_one_budget():
    """Wide-exponent tokens: ZipFusion's format keeps their blocks raw, the escape format compresses them."""
    heads, dim = 1, 64
    page = 2 * heads * F.page_bytes(dim)
    fits = {}
    for fmt_name in ("zipfusion", "escape"):
        m = KVMemory(L, heads, dim, 40 * L * page, pages_per_chunk=4, block_format=fmt_name)
        gen = torch.Generator().manual_seed(2)
        n = 0
        while True:
            x = [(_spread(gen, 64, heads, dim), _spread(gen, 64, heads, dim)) for _ in range(L)]
            if m.admit_packed(n, m.pack(x), 1) is None:
                break
            n += 1
        fits[fmt_name] = n
    assert fits["escape"] > fits["zipfusion"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_format"):
        KVMemory(1, 1, 64, 1 << 20, block_format="split")
    m = KVMemory(1, 1, 64, 1 << 20)
    assert m.esc is None
    e = KVMemory(1, 1, 64, 1 << 20, block_format="escape")
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(TypeError, match="EscapePacked"):
        e.admit_packed("a", m.pack(_kv(gen, 32, 1, 64)[:1]), 4)
    e.admit("b", 20, 4)
    with pytest.raises(NotImplementedError, match="escape"):
        e.export("b")
