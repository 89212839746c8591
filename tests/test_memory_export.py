"""Pages that leave the memory manager's pool (zipkv.memory's "Pages that leave the pool").

``KVMemory.export`` copies a running request's pages out with check bytes and CRC-32s, ``admit_packed`` takes them
back: bit-exact after a round trip (through another memory too), and every single-bit flip of the exported
payload or metadata is a ``ValueError`` naming the layer before anything is allocated -- or, for bytes that are not
part of a page, changes nothing. Without checksums a payload flip goes through (documented)."""
import dataclasses

import pytest
import torch

from zipkv import format as fmt
from zipkv.memory import KVMemory
from zipkv.memory.pages import Packed
from zipkv.paged import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

L, H, D, PROMPT = 2, 2, 64, 40


def _kv(gen, n):
    """Per layer (k, v) bf16 [H, n, D]: compressible blocks, and some spread wide enough to stay raw."""
    out = []
    for _ in range(L):
        k = torch.randn(H, n, D, generator=gen)
        v = torch.randn(H, n, D, generator=gen) * torch.exp2(torch.randint(-40, 40, (H, n, 1), generator=gen).float())
        out.append((k.bfloat16(), v.bfloat16()))
    return out


def _memory(layouts=("token", "token")):
    page = 2 * H * fmt.page_bytes(D)
    return KVMemory(L, H, D, 40 * L * page, pages_per_chunk=2, k_layout=layouts[0], v_layout=layouts[1])


def _running(layouts=("token", "token"), seed=0):
    """A memory with request "a" (PROMPT tokens written, full pages compressed) and its KV."""
    m = _memory(layouts)
    kv = _kv(torch.Generator().manual_seed(seed), PROMPT)
    assert m.admit("a", PROMPT, 8) is not None
    for l, (k, v) in enumerate(kv):
        m.write(l, "a", 0, k, v)
    m.compress()
    m.reads_done()
    return m, kv


def _read(m, rid):
    """Per layer (k, v) bf16 [H, cache_len, D] of ``rid``, decoded from the pool."""
    ids = torch.tensor(m.requests[rid].pages)
    n = m.cache_len(rid)
    out = []
    for l in range(L):
        k, v = PagedKVCache(m.pool, m.desc[l], D, *m.layouts).read_pages(ids)
        out.append(tuple(x.transpose(0, 1).reshape(H, -1, D)[:, :n] for x in (k, v)))
    return out


def _admit(m, rid, packed, **kw):
    ids = m.admit_packed(rid, packed, 8, **kw)
    assert ids is not None
    for l, (k, v) in enumerate(packed.tail):
        if k.shape[1]:
            m.write(l, rid, packed.n_pages * fmt.PAGE_TOKENS, k, v)
    return ids


def _same(a, b):
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("layouts", [("token", "token"), ("channel", "token"), ("k_mma", "v_mma"), ("channel", "v_mma")])
def test_export_then_admit_packed_reads_back_bit_exact_here_and_in_another_memory(layouts):
    m, kv = _running(layouts)
    before = _read(m, "a")
    assert _same(before, kv)
    packed = m.export("a")
    assert packed.checksum is not None and packed.check is not None and packed.n_pages == PROMPT // 16
    assert any(bool((meta >> 7).any()) and not bool((meta >> 7).all()) for meta in packed.meta)   # mixed pages
    assert _same(_read(m, "a"), before)                               # exporting changes nothing
    m.free("a")
    m.reads_done()
    _admit(m, "b", packed)
    assert _same(_read(m, "b"), kv)
    other = _memory(layouts)                                          # transfer: another memory of the same shape
    _admit(other, "c", packed)
    assert _same(_read(other, "c"), kv)


def _flip(packed: Packed, field: str, layer: int, flat: int, bit: int) -> Packed:
    """``packed`` with one bit of ``field``'s tensor of ``layer`` flipped (a copy)."""
    per_layer = [t.clone() for t in getattr(packed, field)]
    t = per_layer[layer].view(-1)
    if t.dtype == torch.int64:
        t[flat] ^= 1 << bit
    else:
        t[flat] ^= 1 << (bit % 8)
    return dataclasses.replace(packed, **{field: per_layer})


def test_every_single_bit_flip_in_transit_is_refused_before_allocation_or_changes_nothing():
    m, kv = _running()
    packed = m.export("a")
    m.free("a")
    m.reads_done()
    g = torch.Generator().manual_seed(1)
    state = (m.capacity_pages(), m.used_bytes(), dict(m.requests))
    raised = kept = 0
    for trial in range(120):
        field = ("slots", "slots", "slots", "meta", "check", "checksum")[trial % 6]
        layer = trial % L
        t = getattr(packed, field)[layer]
        flat, bit = int(torch.randint(t.numel(), (), generator=g)), int(torch.randint(32, (), generator=g))
        if field == "slots":                                          # half the payload flips inside used bytes
            n, kvi, h = (int(x) for x in torch.unravel_index(torch.tensor(flat // t.shape[-1]), t.shape[:-1]))
            used = int(fmt.PageMeta.from_packed(packed.meta[layer][n, kvi, h], m.layouts[kvi], D).nbytes)
            if trial % 2:
                flat = flat // t.shape[-1] * t.shape[-1] + flat % used
        bad = _flip(packed, field, layer, flat, bit)
        try:
            _admit(m, f"r{trial}", bad)
        except ValueError as e:
            assert f"layer {layer}" in str(e), e
            assert (m.capacity_pages(), m.used_bytes(), dict(m.requests)) == state
            raised += 1
            continue
        assert _same(_read(m, f"r{trial}"), kv), (field, layer, flat, bit)     # a byte past a page's end
        kept += 1
        m.free(f"r{trial}")
        m.reads_done()
    assert raised > 80 and kept > 0


def test_pack_carries_checksums_and_without_them_a_payload_flip_goes_through():
    m = _memory()
    kv = _kv(torch.Generator().manual_seed(2), PROMPT)
    packed = m.pack(kv)
    bad = _flip(packed, "slots", 1, 5, 3)                             # byte 5 of layer 1's first key page-head
    with pytest.raises(ValueError, match=r"packed, layer 1, keys \(\[page, kv head\]\): page \(0, 0\) has CRC-32"):
        m.admit_packed("x", bad, 8)
    assert not m.requests
    plain = m.pack(kv, checksum=False)
    assert plain.checksum is None
    _admit(m, "y", _flip(plain, "slots", 1, 5, 3))                    # not detected: what the docstring says
    assert not _same(_read(m, "y"), kv)
    m.free("y")
    with pytest.raises(ValueError, match=r"packed, layer 0, keys.*block 0"):   # check bytes still catch metadata flips
        m.admit_packed("z", _flip(plain, "meta", 0, 0, 0), 8)
    _admit(m, "w", _flip(plain, "meta", 0, 0, 0), validate=False)   # validate=False: shapes only


def test_bad_export_and_packed_arguments_are_named():
    m, _ = _running()
    with pytest.raises(ValueError, match="unknown request 'nope'"):
        m.export("nope")
    with pytest.raises(TypeError, match="checksum must be True or False"):
        m.export("a", checksum="yes")
    with pytest.raises(TypeError, match="validate must be True or False"):
        m.admit_packed("q", m.export("a"), 8, validate=1)
    packed = m.export("a")
    short = dataclasses.replace(packed, checksum=packed.checksum[:1])
    with pytest.raises(ValueError, match=r"packed.checksum must hold one entry per layer \(2\), got 1"):
        m.admit_packed("q", short, 8)
    wrong = dataclasses.replace(packed, check=[c.long() for c in packed.check])
    with pytest.raises(ValueError, match=r"packed.check\[0\] must be a torch.uint8 tensor"):
        m.admit_packed("q", wrong, 8)
    with pytest.raises(ValueError, match=r"packed.meta\[0\] must be .* packed by another memory"):
        KVMemory(L, 1, D, 10 ** 6, pages_per_chunk=2).admit_packed("q", packed, 8)


def test_a_packed_whose_counts_or_tail_disagree_is_refused_before_allocation():
    """Before: ``tokens=3`` with two full pages was admitted (a request of 3 tokens holding 32)."""
    m, _ = _running()
    packed = m.export("a")
    with pytest.raises(ValueError, match=r"packed.tokens and packed.n_pages must be ints with n_pages = tokens // 16 "
                                         r"\(its full pages\), got tokens=3, n_pages=2"):
        m.admit_packed("t", dataclasses.replace(packed, tokens=3), 8)
    with pytest.raises(ValueError, match=r"got tokens='40'"):
        m.admit_packed("t", dataclasses.replace(packed, tokens="40"), 8)
    short = [(k[:, :3], v) for k, v in packed.tail]
    with pytest.raises(ValueError, match=r"packed.tail\[0\] must be \(k, v\), bf16 tensors of shape \(2, 8, 64\)"):
        m.admit_packed("t", dataclasses.replace(packed, tail=short), 8)
    assert list(m.requests) == ["a"]
