"""Restore-before-attention codecs: the lossless baselines ZipFusion compares against (§II-B, §V).

Both split a BF16 value ``s eeeeeeee mmmmmmm`` into its exponent and a *sign+mantissa byte*
``s mmmmmmm`` kept as it is, and code only the exponent; attention then needs the cache restored
into GPU memory first (:func:`decode_into`, once per layer into a shared buffer).

* :class:`SplitZip` (SplitZip-style, arXiv 2605.01708): a 4-bit code per value into a 16-entry
  exponent codebook calibrated offline on real KV (:meth:`SplitZip.calibrate`); values whose
  exponent is not in the codebook are *escapes*, stored per 1,024-value chunk as (position in the
  chunk, exponent). 12 bits per value plus 24 bits per escape and 32 bits per chunk.
* :class:`Huffman` (DFloat11-style, arXiv 2504.11651): a canonical Huffman code over the exponent
  byte, built per encoded tensor from its histogram and limited to ``max_len`` bits (so that the
  decode table has ``2**max_len`` entries and fits in shared memory). A chunk of
  ``lanes * per_lane`` values is coded as ``lanes`` independent bit streams (lane ``j`` holds the
  chunk's values ``t*lanes + j``); each chunk stores its start bit (int64) and each lane its bit
  count (int16), so GPU programs and lanes decode independently.

Layouts (values flattened in C order, padded with zeros to whole chunks; little-endian):

* ``sm``: uint8 ``[n_chunks * chunk]``, the sign+mantissa byte of each value;
* SplitZip: ``codes`` uint8 ``[n_chunks * chunk / 2]`` (value ``2i`` in the low nibble of byte
  ``i``, ``2i+1`` in the high one; escaped values carry code 0), ``book`` int32 ``[16]`` (code ->
  exponent), ``esc_indptr`` int32 ``[n_chunks + 1]`` (chunk ``c``'s escapes are
  ``esc_indptr[c]:esc_indptr[c+1]``), ``esc_pos`` int16 and ``esc_exp`` uint8 ``[n_escapes]``;
* Huffman: ``stream`` int32 words, bits LSB-first (a code's first bit is the lowest unread bit),
  two zero words of padding at the end; ``chunk_bits`` int64 ``[n_chunks]``, ``lane_bits`` int16
  ``[n_chunks, lanes]``; ``lut`` int16 ``[2**max_len]``: for every ``max_len``-bit window the
  symbol of the code it starts with ``| length << 8`` (length 0: no code starts so).

Common interface: ``codec.encode(kv) -> Encoded`` (any bf16 tensor, e.g. pages
``[..., head_dim]``), :func:`decode_into` (Triton kernel of :mod:`zipkv.kernels.restore`, no
allocation or host sync with ``validate=False``: usable per layer inside a CUDA graph), :func:`decode_reference` (plain
torch), :func:`validate_payload` (reads the payload: finds corruption; syncs), ``Encoded.bits_per_value``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from zipkv.kernels import restore  # (the kernels package picks Triton's interpreter without a GPU, before triton loads)

__all__ = ["CHUNK", "Encoded", "SplitZip", "Huffman", "decode_into", "decode", "decode_reference",
           "validate_payload", "bf16_split", "huffman_lengths", "canonical_codes"]

CHUNK = 1024
"""Default values per chunk: SplitZip's escape lists, a Huffman chunk's ``lanes * per_lane`` values. Both
codecs take another power of two (the CPU tests use small chunks to put every BF16 pattern at every position)."""


def bf16_split(x: torch.Tensor):
    """int32 exponent ``[n]`` and uint8 sign+mantissa byte ``[n]`` of the BF16 values of ``x``, flattened."""
    bits = x.contiguous().view(torch.int16).reshape(-1).to(torch.int32) & 0xFFFF
    return (bits >> 7) & 0xFF, (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)


def _join(exp: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """int16 BF16 patterns from int exponents and sign+mantissa bytes (the references' rebuild)."""
    s = sm.to(torch.int32)
    bits = ((s & 0x80) << 8) | (exp.to(torch.int32) << 7) | (s & 0x7F)
    return (bits - ((bits >> 15) << 16)).to(torch.int16)            # two's complement of the 16-bit pattern


def _check_kv(kv, name="kv"):
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"{name} must have dtype torch.bfloat16, got {kv.dtype}")
    if kv.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(kv.shape)}): expected at least one value")


@dataclass
class Encoded:
    """A tensor's encoding: device tensors (``data``) and host-side sizes that decoding trusts.

    ``codec``: ``"splitzip"`` or ``"huffman"``; ``shape``: the original shape; ``n_values``;
    ``n_chunks``; ``info``: codec sizes known without reading the device (SplitZip: ``n_escapes``;
    Huffman: ``total_bits``, ``lanes``, ``per_lane``, ``max_len``).
    """
    codec: str
    shape: tuple
    n_values: int
    n_chunks: int
    data: dict
    info: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor (payload and metadata)."""
        return sum(t.numel() * t.element_size() for t in self.data.values())

    @property
    def bits_per_value(self) -> float:
        """Stored bits per original value, metadata included (16 = no gain)."""
        return 8 * self.nbytes / self.n_values

    @property
    def device(self) -> torch.device:
        return self.data["sm"].device


# ----------------------------------------------------------------------------- SplitZip-style

class SplitZip:
    """SplitZip-style codec over a fixed 16-entry exponent codebook (see module docstring).

    codebook: up to 16 distinct exponents (0..255); code ``i`` means ``codebook[i]``. Build it with
    :meth:`calibrate` on KV the evaluation does not use. chunk: values per escape list (a power of two,
    16..32768).
    """
    name = "splitzip"

    def __init__(self, codebook, chunk: int = CHUNK):
        if not isinstance(chunk, int) or chunk < 16 or chunk > 1 << 15 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two in [16, 32768], got {chunk!r}")
        self.chunk = chunk
        book = [int(e) for e in (codebook.tolist() if isinstance(codebook, torch.Tensor) else codebook)]
        if not 1 <= len(book) <= 16 or len(set(book)) != len(book) or not all(0 <= e <= 255 for e in book):
            raise ValueError(f"codebook must hold 1..16 distinct exponents in [0, 255], got {book}")
        self.codebook = book

    @classmethod
    def calibrate(cls, samples, chunk: int = CHUNK) -> "SplitZip":
        """The 16 most frequent exponents of ``samples`` (a bf16 tensor or a list of them)."""
        samples = [samples] if isinstance(samples, torch.Tensor) else list(samples)
        hist = torch.zeros(256, dtype=torch.int64)
        for x in samples:
            _check_kv(x, "samples")
            hist += torch.bincount(bf16_split(x)[0].reshape(-1), minlength=256).cpu()
        order = torch.argsort(hist, descending=True, stable=True)[:16]
        return cls(order[hist[order] > 0].tolist() or [0], chunk)

    def encode(self, kv: torch.Tensor) -> Encoded:
        """Encode bf16 ``kv`` (any shape) on its device."""
        _check_kv(kv)
        n = kv.numel()
        size = self.chunk
        n_chunks = -(-n // size)
        exp, sm = bf16_split(kv)
        pad = n_chunks * size - n
        exp = torch.nn.functional.pad(exp, (0, pad), value=self.codebook[0])
        sm = torch.nn.functional.pad(sm, (0, pad))
        inverse = torch.full((256,), -1, dtype=torch.int32, device=kv.device)
        inverse[torch.tensor(self.codebook, device=kv.device)] = torch.arange(len(self.codebook), dtype=torch.int32,
                                                                              device=kv.device)
        code = inverse[exp]
        escaped = code < 0
        code = torch.where(escaped, 0, code)
        codes = (code[0::2] | (code[1::2] << 4)).to(torch.uint8)
        where = torch.nonzero(escaped).reshape(-1)
        counts = torch.bincount(where // size, minlength=n_chunks)
        esc_indptr = torch.zeros(n_chunks + 1, dtype=torch.int32, device=kv.device)
        esc_indptr[1:] = torch.cumsum(counts, 0)
        book = torch.zeros(16, dtype=torch.int32, device=kv.device)
        book[:len(self.codebook)] = torch.tensor(self.codebook, dtype=torch.int32, device=kv.device)
        data = dict(sm=sm, codes=codes, book=book, esc_indptr=esc_indptr,
                    esc_pos=(where % size).to(torch.int16), esc_exp=exp[where].to(torch.uint8))
        return Encoded("splitzip", tuple(kv.shape), n, n_chunks, data,
                       dict(chunk=size, n_escapes=int(where.numel()), n_codes=len(self.codebook),
                            book=book.tolist()))


def _splitzip_reference(enc: Encoded) -> torch.Tensor:
    d, size = enc.data, enc.info["chunk"]
    c = d["codes"].to(torch.int32)
    code = torch.stack([c & 15, c >> 4], -1).reshape(-1)
    exp = d["book"][code.long()]
    chunk = torch.repeat_interleave(torch.arange(enc.n_chunks, device=exp.device),
                                    (d["esc_indptr"][1:] - d["esc_indptr"][:-1]).long())
    exp[chunk * size + d["esc_pos"].long()] = d["esc_exp"].to(torch.int32)
    return _join(exp, d["sm"])[:enc.n_values]


def _splitzip_validate(enc: Encoded):
    d, n_codes, size = enc.data, enc.info["n_codes"], enc.info["chunk"]
    ind = d["esc_indptr"].long()
    if int(ind[0]) != 0 or bool((ind[1:] < ind[:-1]).any()) or int(ind[-1]) != enc.info["n_escapes"]:
        raise ValueError(f"esc_indptr must start at 0, not decrease and end at n_escapes={enc.info['n_escapes']}, "
                         f"got first {int(ind[0])}, last {int(ind[-1])}")
    pos = d["esc_pos"].long()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= size):
        raise ValueError(f"esc_pos must lie in [0, {size}) (position in its chunk), got range "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    chunk = torch.repeat_interleave(torch.arange(enc.n_chunks, device=pos.device), (ind[1:] - ind[:-1]))
    where = chunk * size + pos
    if where.numel() and int(where.max()) >= enc.n_values:
        raise ValueError(f"an escape points at value {int(where.max())}, past n_values={enc.n_values}")
    c = d["codes"].to(torch.int32)
    code = torch.stack([c & 15, c >> 4], -1).reshape(-1)[:enc.n_values].clone()
    code[where] = 0
    bad = torch.nonzero(code >= n_codes).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"code {int(code[i])} at value {i} is past the codebook of {n_codes} entries")


# ----------------------------------------------------------------------------- Huffman (DFloat11-style)

def huffman_lengths(hist, max_len: int) -> list[int]:
    """Code length per symbol (0 = absent) of a Huffman code for counts ``hist`` [256], no code longer than
    ``max_len``: optimal lengths, then the rarest over-long codes clipped and the Kraft sum restored by
    lengthening the rarest shorter codes (a standard length-limiting heuristic)."""
    hist = [int(h) for h in hist]
    present = [s for s in range(len(hist)) if hist[s] > 0]
    if len(present) > 1 << max_len:
        raise ValueError(f"{len(present)} symbols cannot have codes of at most {max_len} bits")
    lengths = [0] * len(hist)
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(hist[s], s, [s]) for s in present]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        for s in a[2] + b[2]:
            lengths[s] += 1
        heapq.heappush(heap, (a[0] + b[0], min(a[1], b[1]), a[2] + b[2]))
    lengths = [min(x, max_len) for x in lengths]
    kraft = sum(1 << (max_len - x) for x in lengths if x)             # in units of 2**-max_len
    by_rarity = sorted(present, key=lambda s: (hist[s], -s))
    while kraft > 1 << max_len:
        s = next(s for s in by_rarity if lengths[s] < max_len)
        kraft -= 1 << (max_len - lengths[s] - 1)
        lengths[s] += 1
    return lengths


def canonical_codes(lengths) -> list[int]:
    """Canonical code (MSB-first integer) per symbol, by (length, symbol); 0 for absent symbols."""
    codes, code, prev = [0] * len(lengths), 0, 0
    for length, s in sorted((x, s) for s, x in enumerate(lengths) if x):
        code <<= length - prev
        codes[s], prev = code, length
        code += 1
    return codes


def _reverse(code: int, length: int) -> int:
    return int(f"{code:0{length}b}"[::-1], 2) if length else 0


class Huffman:
    """DFloat11-style codec: canonical Huffman code over the exponent, built per encoded tensor.

    max_len: longest code (decode table of ``2**max_len`` entries); lanes, per_lane: a chunk is
    ``lanes`` bit streams of ``per_lane`` values (default 8 x 128 = :data:`CHUNK`).
    """
    name = "huffman"

    def __init__(self, max_len: int = 12, lanes: int = 8, per_lane: int = 128):
        if not 8 <= max_len <= 14:
            raise ValueError(f"max_len must lie in [8, 14] (256 symbols need 8 bits; the table must fit in "
                             f"shared memory), got {max_len}")
        chunk = lanes * per_lane
        if lanes < 1 or lanes & (lanes - 1) or per_lane < 1 or chunk & (chunk - 1) or chunk < 16:
            raise ValueError(f"lanes and lanes * per_lane must be powers of two (a chunk of >= 16 values), "
                             f"got lanes={lanes}, per_lane={per_lane}")
        if per_lane * max_len >= 1 << 15:
            raise ValueError(f"per_lane * max_len must fit in int16 lane bit counts, got {per_lane * max_len}")
        self.max_len, self.lanes, self.per_lane = max_len, lanes, per_lane

    def table(self, hist):
        """(lengths, codes, lut int16 [2**max_len]) of the code for exponent counts ``hist`` [256]."""
        lengths = huffman_lengths(hist, self.max_len)
        codes = canonical_codes(lengths)
        size = 1 << self.max_len
        lut = torch.zeros(size, dtype=torch.int32)
        for s, x in enumerate(lengths):
            if x:
                lut[_reverse(codes[s], x)::1 << x] = s | x << 8       # every window whose low x bits are the code
        return lengths, codes, lut.to(torch.int16)

    def encode(self, kv: torch.Tensor, hist=None) -> Encoded:
        """Encode bf16 ``kv`` (any shape) on its device. The code is built on the host from ``hist``
        (exponent counts [256], e.g. calibrated offline; every exponent of ``kv`` must have a count) or,
        by default, from ``kv``'s own histogram (DFloat11: one code per tensor)."""
        _check_kv(kv)
        dev, n = kv.device, kv.numel()
        size = self.lanes * self.per_lane
        n_chunks = -(-n // size)
        exp, sm = bf16_split(kv)
        pad = n_chunks * size - n
        exp = torch.nn.functional.pad(exp, (0, pad), value=int(exp[0]))
        sm = torch.nn.functional.pad(sm, (0, pad))
        own = torch.bincount(exp, minlength=256).cpu()
        if hist is None:
            hist = own
        elif not isinstance(hist, torch.Tensor) or hist.shape != (256,):
            raise ValueError(f"hist must be a tensor of 256 exponent counts, got {type(hist).__name__} "
                             f"{tuple(getattr(hist, 'shape', ()))}")
        elif bool(((own > 0) & (hist.cpu() <= 0)).any()):
            missing = torch.nonzero((own > 0) & (hist.cpu() <= 0)).reshape(-1)[:8].tolist()
            raise ValueError(f"hist has no count for exponents {missing} that kv holds: they would have no code")
        lengths, codes, lut = self.table(hist.cpu())
        rev = torch.tensor([_reverse(c, x) for c, x in zip(codes, lengths)], dtype=torch.int64, device=dev)
        length = torch.tensor(lengths, dtype=torch.int64, device=dev)
        # stream order: chunk, lane, then the lane's values t*lanes + lane
        e = exp.reshape(n_chunks, self.per_lane, self.lanes).transpose(1, 2).reshape(-1).long()
        bits, code = length[e], rev[e]
        end = torch.cumsum(bits, 0)
        start = end - bits
        total = int(end[-1])
        n_words = -(-total // 32) + 2
        words = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
        word, shifted = start >> 5, code << (start & 31)
        words.scatter_add_(0, word, shifted & 0xFFFFFFFF)               # codes never overlap: add = or
        words.scatter_add_(0, word + 1, shifted >> 32)
        words = words[:n_words]
        stream = (words - ((words >> 31) << 32)).to(torch.int32)        # the 32-bit words as int32
        lane_bits = bits.reshape(n_chunks, self.lanes, self.per_lane).sum(-1)
        chunk_bits = start.reshape(n_chunks, -1)[:, 0].contiguous()
        data = dict(sm=sm, stream=stream, chunk_bits=chunk_bits, lane_bits=lane_bits.to(torch.int16),
                    lut=lut.to(dev))
        return Encoded("huffman", tuple(kv.shape), n, n_chunks, data,
                       dict(chunk=size, total_bits=total, lanes=self.lanes, per_lane=self.per_lane, max_len=self.max_len))


def _huffman_walk(enc: Encoded):
    """Decode every lane in lock step (the kernel's algorithm in torch): exponents in value order, bits
    consumed per lane, and whether a window matched no code."""
    d, lanes, per_lane, max_len = enc.data, enc.info["lanes"], enc.info["per_lane"], enc.info["max_len"]
    words = d["stream"].long() & 0xFFFFFFFF
    lb = d["lane_bits"].long()
    start = (d["chunk_bits"][:, None] + torch.cumsum(lb, 1) - lb).reshape(-1)
    lut = d["lut"].long()
    pos = start.clone()
    exp = torch.empty(start.numel(), per_lane, dtype=torch.int64, device=start.device)
    invalid = torch.zeros(start.numel(), dtype=torch.bool, device=start.device)
    last = words.numel() - 1
    for t in range(per_lane):
        w = (pos >> 5).clamp(0, last)
        window = (words[w] | (words[(w + 1).clamp(max=last)] << 32)) >> (pos & 31)
        entry = lut[window & ((1 << max_len) - 1)]
        invalid |= (entry >> 8) == 0
        exp[:, t] = entry & 0xFF
        pos += entry >> 8
    exp = exp.reshape(enc.n_chunks, lanes, per_lane).transpose(1, 2).reshape(-1)
    return exp, pos - start, start, invalid


def _huffman_reference(enc: Encoded) -> torch.Tensor:
    exp = _huffman_walk(enc)[0]
    return _join(exp, enc.data["sm"])[:enc.n_values]


def _huffman_validate(enc: Encoded):
    d, lanes = enc.data, enc.info["lanes"]
    lb = d["lane_bits"].long()
    if bool((lb < 0).any()):
        raise ValueError("lane_bits holds negative bit counts")
    cb = d["chunk_bits"]
    ends = cb + lb.sum(1)
    if int(cb[0]) != 0 or bool((cb[1:] != ends[:-1]).any()):
        raise ValueError("chunk_bits must start at 0 and each chunk must start where the previous one's lanes end")
    if int(ends[-1]) != enc.info["total_bits"]:
        raise ValueError(f"the lanes hold {int(ends[-1])} bits, but the stream's header says {enc.info['total_bits']}")
    exp, used, start, invalid = _huffman_walk(enc)
    if bool(invalid.any()):
        i = int(torch.nonzero(invalid)[0])
        raise ValueError(f"chunk {i // lanes} lane {i % lanes}: a bit window matches no code of the table "
                         f"(a code past the codebook)")
    wrong = torch.nonzero(used != lb.reshape(-1)).reshape(-1)
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(f"chunk {i // lanes} lane {i % lanes}: decoding {enc.info['per_lane']} values used "
                         f"{int(used[i])} bits, but lane_bits says {int(lb.reshape(-1)[i])}")


# ----------------------------------------------------------------------------- common interface

_SIZES = {
    "splitzip": lambda e: dict(sm=(torch.uint8, e.n_chunks * e.info["chunk"]),
                               codes=(torch.uint8, e.n_chunks * e.info["chunk"] // 2),
                               book=(torch.int32, 16), esc_indptr=(torch.int32, e.n_chunks + 1),
                               esc_pos=(torch.int16, e.info["n_escapes"]), esc_exp=(torch.uint8, e.info["n_escapes"])),
    "huffman": lambda e: dict(sm=(torch.uint8, e.n_chunks * e.info["chunk"]),
                              stream=(torch.int32, -(-e.info["total_bits"] // 32) + 2),
                              chunk_bits=(torch.int64, e.n_chunks), lane_bits=(torch.int16, e.n_chunks * e.info["lanes"]),
                              lut=(torch.int16, 1 << e.info["max_len"])),
}


def _check_encoded(enc):
    """Sizes and dtypes against the host-side header (no device read)."""
    if not isinstance(enc, Encoded):
        raise TypeError(f"encoded must be a zipkv.codecs.Encoded, got {type(enc).__name__}")
    if enc.codec not in _SIZES:
        raise ValueError(f"encoded.codec must be one of {sorted(_SIZES)}, got {enc.codec!r}")
    chunk = enc.info.get("chunk", 0)
    if enc.n_chunks != -(-enc.n_values // max(chunk, 1)):
        raise ValueError(f"encoded.n_chunks={enc.n_chunks} does not match n_values={enc.n_values} "
                         f"({chunk}-value chunks)")
    for name, (dtype, n) in _SIZES[enc.codec](enc).items():
        t = enc.data.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"encoded.data[{name!r}] is missing")
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"encoded.data[{name!r}]: expected {n} contiguous {dtype} values for "
                             f"n_values={enc.n_values}, got {t.numel()} {t.dtype} (truncated or corrupted payload)")
        if t.device != enc.device:
            raise ValueError(f"encoded.data[{name!r}] is on {t.device}, the payload on {enc.device}")


def validate_payload(encoded: Encoded) -> Encoded:
    """Check the payload itself (escape lists, codes inside the codebook, Huffman streams that decode to
    exactly their declared bits); raise ``ValueError`` naming what is wrong. Reads the device (syncs)."""
    _check_encoded(encoded)
    (_splitzip_validate if encoded.codec == "splitzip" else _huffman_validate)(encoded)
    return encoded


def decode_reference(encoded: Encoded) -> torch.Tensor:
    """Plain-torch decode (the kernels' reference): bf16 tensor of ``encoded.shape``."""
    _check_encoded(encoded)
    bits = (_splitzip_reference if encoded.codec == "splitzip" else _huffman_reference)(encoded)
    return bits.view(torch.bfloat16).reshape(encoded.shape)


def decode_into(encoded: Encoded, out: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """Restore ``encoded`` into ``out`` with the Triton kernel; returns ``out``.

    out: contiguous bf16 with ``encoded.n_values`` values (any shape: e.g. a view of a shared
    restore buffer), on the payload's device. validate (default): :func:`validate_payload` reads the payload
    first (a sync; a corrupted payload raises ``ValueError``). Pass ``validate=False`` per layer inside decode
    steps and CUDA graphs: then only host-side sizes are checked, the launch allocates nothing and never syncs,
    and a corrupted payload gives wrong values (never an out-of-bounds access).
    """
    _check_encoded(encoded)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.numel() != encoded.n_values
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous bf16 tensor of {encoded.n_values} values, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    if out.device != encoded.device:
        raise ValueError(f"out is on {out.device}, the payload on {encoded.device}")
    if validate:
        validate_payload(encoded)
    d, out16 = encoded.data, out.view(torch.int16).reshape(-1)
    if encoded.codec == "splitzip":
        restore.splitzip_decode(d["sm"], d["codes"], encoded.info["book"], d["esc_indptr"], d["esc_pos"], d["esc_exp"], out16,
                                encoded.n_values, encoded.n_chunks, encoded.info["chunk"])
    else:
        i = encoded.info
        restore.huffman_decode(d["stream"], d["chunk_bits"], d["lane_bits"], d["lut"], d["sm"], out16,
                               encoded.n_values, encoded.n_chunks, i["lanes"], i["per_lane"], i["max_len"])
    return out


def decode(encoded: Encoded, *, validate: bool = True) -> torch.Tensor:
    """:func:`decode_into` a new bf16 tensor of ``encoded.shape`` (validated by default)."""
    out = torch.empty(encoded.shape, dtype=torch.bfloat16, device=encoded.device)
    return decode_into(encoded, out, validate=validate)
