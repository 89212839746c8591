"""Restore-before-attention codecs (zipkv.codecs): bit-exact through encode -> Triton decode (interpreter on
the CPU) and the torch reference, for every BF16 pattern in every chunk position; bad payloads refused."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from zipkv import codecs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# Every pattern in every position needs 65,536 chunks: the CPU runs it with 64-value chunks (the kernels take
# the chunk size as a compile-time constant), the GPU with the default 1,024.
CHUNK = codecs.CHUNK if DEV == "cuda" else 64


def all_patterns_every_position(chunk=CHUNK) -> torch.Tensor:
    """bf16 [65536, chunk]: row r holds patterns r, r+1, ... (mod 2**16), so each of the chunk positions of a
    chunk (one row = one chunk) sees all 65,536 patterns, ±0, subnormals, inf and NaN payloads included."""
    r = torch.arange(65536, dtype=torch.int32)[:, None]
    p = torch.arange(chunk, dtype=torch.int32)[None, :]
    bits = (r + p) & 0xFFFF
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16).to(DEV)


def bits(x):
    return x.view(torch.int16)


def kv_like(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3).to(torch.bfloat16).to(DEV)


def roundtrip(enc, x, validate=True):
    ref = codecs.decode_reference(enc)
    out = codecs.decode(enc, validate=validate)                   # the Triton kernel
    assert torch.equal(bits(ref), bits(x)) and torch.equal(bits(out), bits(x))


def test_splitzip_all_patterns_every_position(splitzip_kernel):
    x = all_patterns_every_position()
    codec = codecs.SplitZip.calibrate(kv_like((64, 1024)), chunk=CHUNK)
    enc = codec.encode(x)
    assert enc.info["n_escapes"] == x.numel() * 240 // 256     # exponents outside the 16-entry codebook
    roundtrip(enc, x, validate=False)
    codecs.validate_payload(enc)


def test_huffman_all_patterns_every_position_with_longest_codes():
    x = all_patterns_every_position()
    hist = torch.tensor([2 ** 40 >> min(abs(e - 120), 40) for e in range(256)])   # skewed: long codes clipped
    codec = codecs.Huffman(lanes=8, per_lane=CHUNK // 8)
    lengths = codecs.huffman_lengths(hist, codec.max_len)
    assert max(lengths) == codec.max_len and min(x for x in lengths if x) <= 2 and all(lengths)
    roundtrip(codec.encode(x, hist=hist), x, validate=False)   # every exponent occurs: every code length decoded


def test_huffman_own_histogram_and_escapes_on_odd_sizes():
    for shape in [(1,), (3, 7, 64), (2, 3, 48, 128)]:
        x = kv_like(shape, seed=sum(shape))
        roundtrip(codecs.Huffman().encode(x), x)
        enc = codecs.SplitZip([126, 125, 124, 123]).encode(x)   # a 4-entry codebook: many escapes
        assert enc.info["n_escapes"] > 0
        roundtrip(enc, x)


@pytest.fixture(params=[(False, False), (True, False), (True, True)], ids=["per-value", "words", "words-early"])
def splitzip_kernel(request, monkeypatch):
    """Both SplitZip decode kernels: per value, and on 32-bit words (where n_values % 4 == 0 and out is aligned),
    the latter with its escapes loaded before or after the barrier."""
    from zipkv.kernels import restore
    words, early = request.param
    monkeypatch.setitem(restore.SPLITZIP_LAUNCH, "words", words)
    monkeypatch.setitem(restore.SPLITZIP_LAUNCH, "early_escapes", early)
    return words


def test_splitzip_word_and_value_kernels_agree(splitzip_kernel):
    x = kv_like((4, 300, 64))
    enc = codecs.SplitZip([126, 125, 124, 123, 122]).encode(x)
    buf = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device=DEV)
    for out in (buf[:-1], buf[1:]):             # 8-byte aligned; offset by 2 bytes (always per value)
        out.fill_(0)
        codecs.decode_into(enc, out)
        assert torch.equal(bits(out), bits(x).reshape(-1))


def test_bits_per_value_on_kv_like_data():
    x = kv_like((8, 4, 256, 64))
    sz = codecs.SplitZip.calibrate(kv_like((8, 4, 256, 64), seed=1)).encode(x)
    hf = codecs.Huffman().encode(x)
    assert 12 < sz.bits_per_value < 12.5 and hf.bits_per_value < sz.bits_per_value


def test_huffman_lengths_kraft_and_limit():
    g = torch.Generator().manual_seed(0)
    for n_symbols in (1, 2, 17, 256):
        hist = torch.zeros(256, dtype=torch.int64)
        hist[torch.randperm(256, generator=g)[:n_symbols]] = (2 ** torch.randint(0, 30, (n_symbols,), generator=g))
        lengths = codecs.huffman_lengths(hist, 12)
        assert all((x > 0) == (h > 0) for x, h in zip(lengths, hist.tolist()))
        assert max(lengths) <= 12 and sum(2.0 ** -x for x in lengths if x) <= 1.0


def corrupt(enc, **data):
    return codecs.Encoded(enc.codec, enc.shape, enc.n_values, enc.n_chunks, {**enc.data, **data}, dict(enc.info))


def test_truncated_payloads_are_refused():
    x = kv_like((4, 300, 64))
    for enc in (codecs.SplitZip.calibrate(x).encode(x), codecs.Huffman().encode(x)):
        name = "stream" if enc.codec == "huffman" else "codes"
        for key in ("sm", name):
            with pytest.raises(ValueError, match=f"data\\['{key}'\\].*truncated"):
                codecs.decode(corrupt(enc, **{key: enc.data[key][:-1]}))


def test_splitzip_code_past_the_codebook():
    x = kv_like((2, 512, 64))
    codec = codecs.SplitZip([127, 126, 125, 124, 123, 122])
    enc = codec.encode(x)
    codes = enc.data["codes"].clone()
    codes[5] = 0x9F                                             # codes 15 and 9 into a 6-entry codebook
    with pytest.raises(ValueError, match="past the codebook of 6 entries"):
        codecs.decode(corrupt(enc, codes=codes))
    pos = enc.data["esc_pos"].clone()
    pos[0] = 2000
    with pytest.raises(ValueError, match="esc_pos"):
        codecs.decode(corrupt(enc, esc_pos=pos))


def test_huffman_stream_that_ends_early_or_holds_no_code():
    x = kv_like((2, 512, 64))
    enc = codecs.Huffman().encode(x)
    short = enc.data["stream"][:-3]
    header = dict(enc.info, total_bits=32 * (short.numel() - 2))
    with pytest.raises(ValueError, match="lanes hold .* bits, but the stream's header says"):
        codecs.decode(codecs.Encoded(enc.codec, enc.shape, enc.n_values, enc.n_chunks, {**enc.data, "stream": short}, header))
    lane_bits = enc.data["lane_bits"].clone()
    lane_bits[1, 0] -= 1
    lane_bits[1, 1] += 1
    with pytest.raises(ValueError, match="chunk 1 lane 0: decoding 128 values used"):
        codecs.decode(corrupt(enc, lane_bits=lane_bits))
    one = codecs.Huffman().encode(torch.ones(4096, dtype=torch.bfloat16, device=DEV))   # one symbol: code '0' only
    with pytest.raises(ValueError, match="matches no code"):
        codecs.decode(corrupt(one, stream=one.data["stream"] | 1))


def test_corrupted_payload_without_validation_stays_in_bounds():
    x = kv_like((2, 512, 64))
    enc = codecs.Huffman().encode(x)
    out = torch.empty_like(x)
    bad = corrupt(enc, chunk_bits=enc.data["chunk_bits"] + (1 << 40), lane_bits=enc.data["lane_bits"] * 0 - 7)
    codecs.decode_into(bad, out, validate=False)                # clamped reads: garbage values, no fault
    with pytest.raises(ValueError, match="lane_bits holds negative bit counts"):
        codecs.decode_into(bad, out)                            # validated by default
    sz = codecs.SplitZip([127]).encode(x)
    bad = corrupt(sz, esc_pos=sz.data["esc_pos"] * 0 + 30000)
    codecs.decode_into(bad, out, validate=False)


def test_argument_errors():
    x = kv_like((2, 64))
    with pytest.raises(TypeError, match="bfloat16"):
        codecs.Huffman().encode(x.float())
    with pytest.raises(ValueError, match="codebook"):
        codecs.SplitZip(list(range(17)))
    with pytest.raises(ValueError, match="out must be a contiguous bf16 tensor of 128 values"):
        codecs.decode_into(codecs.Huffman().encode(x), torch.empty(3, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="no count for exponents"):
        codecs.Huffman().encode(x, hist=torch.zeros(256, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_into_is_cuda_graph_capturable():
    x = kv_like((32, 2048, 128))
    for enc in (codecs.SplitZip.calibrate(x).encode(x), codecs.Huffman().encode(x)):
        out = torch.zeros_like(x)
        codecs.decode_into(enc, out, validate=False)            # compile outside the capture
        out.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            codecs.decode_into(enc, out, validate=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(x))
