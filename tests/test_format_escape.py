"""zipkv.escape: ZipFusion's 12-bit block plus a per-page escape list, plain-torch reference."""
import dataclasses

import pytest
import torch

from zipkv import escape as E
from zipkv import format as F

FILLERS = {"huge": 0x7F00, "one": 0x3F80, "smallest normal": 0x0080}   # pairs 127 (no zero mode), 63, 0


def bits(x):
    return x.contiguous().view(torch.int16)


def as_bf16(ints):
    ints = ints.to(torch.int32) & 0xFFFF
    return torch.where(ints >= 1 << 15, ints - (1 << 16), ints).to(torch.int16).view(torch.bfloat16)


def pattern_blocks(filler: int) -> torch.Tensor:
    """bf16 [1024, 512]: all 65,536 patterns, 64 per block among 448 copies of ``filler``; pattern ``i`` sits at
    position ``8 * (i % 64) + (i // 64) % 8`` of block ``i // 64``, so the patterns cover all 512 positions."""
    i = torch.arange(65536)
    blocks = torch.full((1024, 512), filler, dtype=torch.int32)
    blocks[i // 64, 8 * (i % 64) + (i // 64) % 8] = i.to(torch.int32)
    return as_bf16(blocks)


def random_pages(shape, d, seed=0, spread=4.0, zeros=0.0, tail=1.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 16, d, generator=g) * torch.exp(spread * torch.randn(*shape, 1, 1, generator=g))
    x = x * torch.exp(tail * torch.randn(*shape, 16, d, generator=g))        # a tail of tiny values: escapes
    x = torch.where(torch.rand(*shape, 16, d, generator=g) < zeros, torch.zeros_like(x), x)
    return x.to(torch.bfloat16)


def round_trip(pages, layout, capacity=None):
    payload, escapes, meta = E.pack(pages, layout, capacity=capacity)
    assert torch.equal(bits(E.unpack(payload, escapes, meta)), bits(pages))
    return payload, escapes, meta


@pytest.mark.parametrize("filler", FILLERS)
@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_all_bit_patterns_every_position_through_every_path(filler, layout):
    """Every BF16 pattern (±0, subnormals, inf, NaN payloads) at every position: coded directly, listed as an
    escape, coded as pair 0 in zero mode, or in a raw block, bit for bit."""
    d = 64
    blocks = pattern_blocks(FILLERS[filler])
    pages = F.from_blocks(blocks.reshape(-1, 2, 512), layout, d)
    payload, escapes, meta = round_trip(pages, layout, capacity=2 * E.MAX_BLOCK_ESCAPES)
    count = E.escape_counts(pages, layout)
    assert int(meta.count.sum()) == int(count[meta.compressed].sum())
    if filler == "huge":       # every pattern below pair 120 is an escape, zeros included; the rest coded directly
        assert bool(meta.compressed.all()) and not bool(meta.zero.any())
        assert int(meta.count.sum()) == int(((torch.arange(65536) >> 8) & 0x7F).lt(120).sum())
    if filler == "one":        # zero mode codes pair 0; blocks with a pattern above 1.0 are raw (448 escapes)
        assert bool(meta.zero.any()) and not bool(meta.compressed.all()) and bool(meta.compressed.any())


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_random_pages_every_layout_and_capacity(d):
    pages = random_pages((3, 5), d, seed=d, zeros=0.02)
    for layout in F.layouts_for(d):
        for capacity in (0, 1, None, 64):
            payload, escapes, meta = round_trip(pages, layout, capacity)
            nb = F.n_blocks(d)
            assert escapes.shape == (3, 5, E.PER_BLOCK * nb if capacity is None else capacity)
            assert payload.shape == (3, 5, 32 * d)
            used = meta.count.sum(-1, dtype=torch.int64)
            assert bool((escapes.to(torch.int32)[..., :] == -1).sum(-1).eq(escapes.shape[-1] - used).all())


@pytest.mark.parametrize("filler", FILLERS)
def test_all_bit_patterns_with_the_list_sized_per_page(filler):
    """The stored format (capacity=PAGE): every pattern at every position, every layout, bit for bit; no page-head
    overflows, only blocks with more than 127 escapes stay raw; nbytes counts each page-head's own entries."""
    d = 64
    for layout in F.LAYOUTS:
        pages = F.from_blocks(pattern_blocks(FILLERS[filler]).reshape(-1, 2, 512), layout, d)
        payload, escapes, meta = round_trip(pages, layout, capacity=E.PAGE)
        count = E.escape_counts(pages, layout)
        assert meta.per_page and torch.equal(meta.compressed, count <= E.MAX_BLOCK_ESCAPES)
        assert escapes.shape[-1] == int(meta.count.sum(-1).max())
        assert torch.equal(meta.nbytes, meta.page_meta().nbytes + 2 * meta.count.sum(-1, dtype=torch.int64))
        assert meta[3:5].per_page


def test_list_sized_per_page_keeps_every_block_a_fixed_area_drops():
    d = 128
    blocks = torch.full((1, 4, 512), 0x3F80, dtype=torch.int32)
    for j, n in enumerate((127, 128, 3, 3)):
        blocks[0, j, 512 - n:] = 0x3000
    pages = F.from_blocks(as_bf16(blocks), "token", d)
    _, escapes, meta = round_trip(pages, "token", capacity=E.PAGE)
    assert meta.compressed.tolist() == [[True, False, True, True]] and escapes.shape == (1, 133)
    assert int(meta.nbytes) == 1024 + 3 * 768 + 2 * 133
    with pytest.raises(TypeError, match="'page'"):
        E.pack(pages, "token", capacity="pages")


def test_no_escape_page_is_zipfusions_page_byte_for_byte():
    g = torch.Generator().manual_seed(5)
    pages = ((torch.rand(4, 16, 128, generator=g) + 0.01) * 100).to(torch.bfloat16)   # every block fits its window
    payload, meta = F.pack(pages, "token")
    assert bool(meta.compressed.all())
    payload_e, escapes, meta_e = round_trip(pages, "token")
    assert torch.equal(payload_e, payload) and torch.equal(meta_e.base, meta.base)
    assert not bool(meta_e.count.any()) and bool((escapes == E.UNUSED).all())


def test_worst_case_escape_counts_and_overflow_rule():
    """127 escapes fit a block, 128 make it raw; a full page-head drops its blocks with the most escapes first,
    the lower block first on ties, until the rest fit; nothing is lost either way."""
    d = 128                                               # 4 blocks per page-head
    blocks = torch.full((1, 4, 512), 0x3F80, dtype=torch.int32)      # 1.0: pair 63
    for j, n in enumerate((127, 128, 3, 3)):
        blocks[0, j, 512 - n:] = 0x3000                  # pair 48: below the window, not zero
    pages = F.from_blocks(as_bf16(blocks), "token", d)
    assert E.escape_counts(pages, "token").tolist() == [[127, 128, 3, 3]]
    _, _, meta = round_trip(pages, "token", capacity=1000)
    assert meta.compressed.tolist() == [[True, False, True, True]] and meta.count.tolist() == [[127, 0, 3, 3]]
    _, _, meta = round_trip(pages, "token", capacity=5)
    assert meta.compressed.tolist() == [[False, False, False, True]]
    _, _, meta = round_trip(pages, "token", capacity=0)
    assert not bool(meta.compressed.any())
    _, _, meta = round_trip(pages, "token", capacity=6)
    assert meta.compressed.tolist() == [[False, False, True, True]] and int(meta.nbytes) == 2 * 1024 + 2 * 768 + 12


def test_zero_mode_codes_zeros_without_escapes():
    x = random_pages((2,), 64, spread=0.0, tail=0.3)
    x[..., ::4] = 0.0                                     # whole channels of zeros, as Gemma-3's keys hold
    x[..., 1::8] = -0.0
    payload, escapes, meta = round_trip(x, "token")
    assert bool(meta.zero.all()) and int(meta.count.sum()) <= int(E.escape_counts(x, "token").sum())
    assert int(meta.count.sum()) < 512 // 4


@pytest.mark.parametrize("field,value,says", [
    ("count", lambda m: m.count ^ 1, "check byte"),
    ("base", lambda m: m.base ^ 2, "check byte"),
    ("zero", lambda m: ~m.zero, "check byte"),
    ("compressed", lambda m: ~m.compressed, "check byte"),
    ("layout", lambda m: "channel", "check byte"),
])
def test_corrupted_metadata_is_caught(field, value, says):
    pages = random_pages((3,), 64, seed=1, zeros=0.02)
    payload, escapes, meta = E.pack(pages, "token", capacity=16)
    bad = dataclasses.replace(meta, **{field: value(meta)})
    with pytest.raises(ValueError, match=says):
        E.unpack(payload, escapes, bad)


def test_corrupted_list_is_caught():
    pages = random_pages((3,), 64, seed=2)
    payload, escapes, meta = E.pack(pages, "token", capacity=16)
    n = int(meta.count[0].sum())
    assert n >= 2, "the test needs a page-head with two escapes"
    checks = {
        "past the": lambda e: e[0].__setitem__(n, 5),                              # a stale entry
        "ascend": lambda e: e[0].__setitem__(1, e[0, 0]) if meta.count[0, 0] >= 2 else e[0].__setitem__(
            slice(0, 2), e[0, :2].flip(0)),
        "codes": lambda e: e[0].__setitem__(0, (e[0, 0].to(torch.int32) | 0x7F).to(torch.int16)),  # pair 127
    }
    ran = []
    for says, corrupt in checks.items():
        e = escapes.clone()
        corrupt(e)
        if torch.equal(e, escapes):
            continue
        ran.append(says)
        with pytest.raises(ValueError, match=says):
            E.unpack(payload, e, meta)
        E.unpack(payload, e, meta, validate=False)                               # decodes what it is told
    assert len(ran) == 3, ran
    sealed = dataclasses.replace(meta, count=meta.count.clone())
    sealed.count[0, 0] += 1
    with pytest.raises(ValueError):
        E.unpack(payload, escapes, sealed.sealed())


def test_count_past_capacity_and_on_raw_blocks():
    pages = random_pages((2,), 64, seed=3, tail=0.3)
    payload, escapes, meta = E.pack(pages, "token", capacity=4)
    assert bool(meta.compressed.all())
    over = dataclasses.replace(meta, count=torch.full_like(meta.count, 3)).sealed()
    with pytest.raises(ValueError, match="more than its capacity"):
        E.unpack(payload, escapes, over)
    raw = dataclasses.replace(meta, compressed=torch.zeros_like(meta.compressed), base=torch.zeros_like(meta.base),
                              count=torch.ones_like(meta.count), zero=torch.zeros_like(meta.zero)).sealed()
    with pytest.raises(ValueError, match="a raw block has neither"):
        E.unpack(payload, escapes, raw)


def test_bad_input_names_the_argument():
    pages = random_pages((2,), 64)
    with pytest.raises(TypeError, match="pages"):
        E.pack(pages.float(), "token")
    with pytest.raises(ValueError, match="layout"):
        E.pack(pages, "rows")
    with pytest.raises(TypeError, match="capacity"):
        E.pack(pages, "token", capacity=2.5)
    with pytest.raises(ValueError, match="capacity"):
        E.pack(pages, "token", capacity=-1)
    payload, escapes, meta = E.pack(pages, "token")
    with pytest.raises(ValueError, match="escapes"):
        E.unpack(payload, escapes[..., :-1], meta)
    with pytest.raises(ValueError, match="escapes"):
        E.unpack(payload, escapes.to(torch.int32), meta)
    with pytest.raises(TypeError, match="meta"):
        E.unpack(payload, escapes, meta.page_meta())
    with pytest.raises(TypeError, match="payload"):
        E.unpack(payload.to(torch.int16), escapes, meta)
    with pytest.raises(TypeError, match="captures"):
        E.survey([])
    with pytest.raises(ValueError, match="per_block"):
        E.survey([object()], per_block=(-1,))


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class _Capture:
    def __init__(self, layers):
        self.layers = layers


def test_survey_counts_what_pack_lists():
    """The survey's count for the format (top anchor, unbounded list) is the escapes pack lists, per layer and
    tensor; ZipFusion's raw blocks are its ineligible ones; bits per value follow the stored bytes."""
    g = torch.Generator().manual_seed(4)
    layers = []
    for i in range(2):
        k = random_pages((2,), 64, seed=10 + i, zeros=0.05).reshape(2 * 16, 64).reshape(2, 16, 64)
        v = random_pages((2,), 64, seed=20 + i).reshape(2, 16, 64)
        k = torch.cat([k, k[:, :5]], 1)                    # a partial last page: left out
        layers.append(_Layer(k, v))
    df = E.survey([_Capture(layers)], per_block=(1, 64), model="toy")
    for i, layer in enumerate(layers):
        for tensor, x in (("K", layer.keys[:, :16]), ("V", layer.values)):
            pages = x.reshape(2, 1, 16, 64)
            rows = df[(df.layer == i) & (df.tensor == tensor)].set_index(["layout", "anchor", "capacity"])
            big = rows.loc[("escape+zero", "top", 128)]
            _, _, meta = E.pack(pages, "token", capacity=128)
            assert int(big.escapes) == int(meta.count.sum()) and int(big.raw_blocks) == int((~meta.compressed).sum())
            assert int(rows.loc[("escape+zero", "top", 0)].escapes) == int(E.escape_counts(pages, "token").sum())
            assert int(rows.loc[("zipfusion", "min", 0)].raw_blocks) == int((~F.eligible(pages, "token")).sum())
            stored = 8 * (int(meta.nbytes.sum())) + E.META_BITS * meta.count.numel()
            assert big.bits_per_value == pytest.approx(stored / (pages.numel()))
            assert int(rows.loc[("escape+zero", "top", 0)].blocks) == 4
