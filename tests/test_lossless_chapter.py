"""zipkv.study.chapters.lossless: does the decode kernel read packed pages without changing a bit of its output (the
Triton kernel: under TRITON_INTERPRET=1 without a GPU, on the GPU otherwise; the Gluon kernel's case runs on the GPU in test_decode_mma.py), and
the chapter's sentences from its tables."""
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pandas as pd  # noqa: E402

from zipkv.study.chapters import lossless  # noqa: E402


def _capture(T=41, H=2, G=3, D=32, seed=0, outlier=False):
    """One fake capture of one layer: K/V magnitudes 2^-6 .. 2^2 (every block compressible); ``outlier`` makes
    the first page's key blocks too wide (raw) beside compressed ones."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.exp2(torch.rand(H, T, D, generator=g) * 8 - 6) * (torch.randint(0, 2, (H, T, D), generator=g) * 2 - 1)
            for _ in range(2))
    if outlier:
        k[:, 3, 0] = 3e4
    q = torch.randn(H * G, T, D, generator=g)
    device = "cuda" if torch.cuda.is_available() else "cpu"     # the interpreter runs only where there is no GPU
    layer = SimpleNamespace(**{name: t.bfloat16().to(device) for name, t in (("keys", k), ("values", v), ("queries", q))})
    return SimpleNamespace(layers=[layer, layer])


def test_the_triton_kernel_reads_packed_pages_into_the_raw_pages_bits():
    """The last token's queries over the tokens before it (two full pages and a partial one), packed and raw, at
    each split count: bit-identical outputs, every one; only the first ``kernel_layers`` layers."""
    reads = lossless.read_identity([_capture(), _capture(seed=1, outlier=True)], kernel_layers=1)
    assert set(reads.kernel) == {"triton"} and reads.layer.unique().tolist() == [0]
    assert reads.splits.tolist() == list(lossless.READ_SPLITS) * 2
    assert (reads.outputs == 6 * 32).all() and reads.identical.tolist() == reads.outputs.tolist()
    assert (reads.max_abs_diff == 0).all()
    assert reads.frac_compressed.iloc[0] > reads.frac_compressed.iloc[-1] > 0     # the outlier's raw blocks


def _tables(read_same=True, gen_same=True):
    reads = pd.DataFrame(dict(window=[0, 0, 1, 1], layer=[0] * 4, kernel=["gluon", "triton"] * 2,
                              path=["auto", "mixed"] * 2, splits=[1] * 4, frac_compressed=[0.8] * 4, outputs=[576] * 4,
                              identical=[576, 576, 576, 576 if read_same else 570], max_abs_diff=[0, 0, 0, 0 if read_same else 2e-3]))
    gens = pd.DataFrame(dict(comparison=["uncompressed, same kernel"] * 2 + ["uncompressed, Triton kernel"] * 2,
                             request=[0, 1, 0, 1], identical=[True, gen_same, True, False],
                             first_difference=[None, None if gen_same else 3, None, 7]))
    return reads, gens


def test_the_sentences_count_what_the_tables_hold():
    reads, gens = _tables()
    assert lossless.all_identical(reads, gens)            # the Triton kernel's difference is another summation order
    verdict = lossless.identity_verdict(reads, gens)
    assert verdict.startswith("The decode kernels (gluon and triton) read packed pages") and "**2,304 of 2,304**" in verdict and "**2 of 2** requests (uncompressed, same kernel)" in verdict
    text = lossless.identity_text(reads, gens, new_tokens=16)
    assert "the gluon kernel (routed by page kinds, 2 windows × 1 layer × splits 1)" in text
    assert "uncompressed, Triton kernel: 1 of 2 requests identical (the others first differ at new token 7)." in text
    assert "not identical" not in text


def test_a_changed_bit_is_reported():
    reads, gens = _tables(read_same=False)
    assert not lossless.all_identical(reads, gens)
    assert "**not identical**: largest difference 0.002" in lossless.identity_text(reads, gens, new_tokens=16)
    reads, gens = _tables(gen_same=False)
    assert not lossless.all_identical(reads, gens)
    assert "**1 of 2** requests" in lossless.identity_verdict(reads, gens)
    assert list(lossless.identity_table(reads, gens).check.unique()) == ["read", "generation"]
