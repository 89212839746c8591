"""Chapter "The lossless format" (ZipFusion Fig. 2, §III-B): one block bit by bit, stored bits per
value per layer, and the bit-exact round trip of a captured cache through the torch reference and
the Triton pack kernel; and whether the decode kernels read it without changing a bit (attention outputs, and the
engine's greedy tokens)."""
from __future__ import annotations

import pandas as pd
import torch

from zipkv import format as kvformat
from zipkv.study import report
from zipkv.kernels.pack import pack_pages


def block_bits(keys: torch.Tensor, layout: str, positions: int = 4) -> tuple[pd.DataFrame, str]:
    """The first ``positions`` values of block 0 of page 0 of KV head 0 of ``keys`` ``[H, T, d]``:
    bits, exponent, the low byte and the 4-bit code the format stores; and a sentence on the block."""
    page = kvformat.to_pages(keys)[0, 0]
    _, meta = kvformat.pack(page, layout)
    block = kvformat.to_blocks(page, layout)[0]
    bits = block.view(torch.int16).to(torch.int32) & 0xFFFF
    exponent = (bits >> 7) & 0xFF
    base, compressed = int(meta.base.flatten()[0]), bool(meta.compressed.flatten()[0])
    rows = []
    for p in range(positions):
        v = int(bits[p])
        code = ((v >> 15) << 3) | (((v >> 8) & 0x7F) - base // 2)  # sign, then the exponent's upper 7 bits minus b/2
        rows.append({"position": p, "value": repr(float(block[p])),  # exact: a BF16 value, no padding "bits": f"{v:016b}", "exponent": int(exponent[p]),
                     "low byte": f"{v & 0xFF:08b}", "4-bit code": f"{code:04b}" if compressed else "raw"})
    return pd.DataFrame(rows), (f"Layer 0, KV head 0, page 0, block 0 of the keys ({layout}-major): exponents "
                                f"{int(exponent.min())}…{int(exponent.max())}, base b = {base}, compressed: {compressed}; "
                                f"the page takes {int(meta.nbytes)} of {kvformat.page_bytes(page.shape[-1])} bytes.")


def _tensor(layer, tensor: str) -> torch.Tensor:
    return kvformat.to_pages(layer.keys if tensor == "K" else layer.values).contiguous()


def sizes(captures, k_layout: str, v_layout: str) -> pd.DataFrame:
    """Per layer and tensor over all captures: compressible blocks, stored bits per value (without and
    with the one metadata byte per block) and the packed size as a fraction of BF16."""
    rows = []
    for i in range(len(captures[0].layers)):
        for tensor, layout in (("K", k_layout), ("V", v_layout)):
            stats = [kvformat.cache_stats(_tensor(c.layers[i], tensor), layout) for c in captures]
            raw, packed = sum(s.raw_bytes for s in stats), sum(s.packed_bytes for s in stats)
            blocks = sum(s.n_blocks for s in stats)  # one metadata byte per block: flag << 7 | b >> 1
            rows.append({"layer": i, "tensor": tensor, "layout": layout,
                         "compressible_blocks": sum(s.n_compressed for s in stats) / blocks,
                         "bits_per_value": 16 * packed / raw, "bits_per_value_with_meta": 16 * (packed + blocks) / raw,
                         "size_fraction": packed / raw})
    return pd.DataFrame(rows)


def sizes_figure(table: pd.DataFrame):
    """Bits per value, metadata included, per layer for keys and values, beside the 12 bits of an all-compressed
    cache."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    for tensor, style in (("K", "-o"), ("V", "-s")):
        part = table[table.tensor == tensor]
        ax.plot(part.layer, part.bits_per_value_with_meta, style, ms=4, label=f"{tensor} ({part.layout.iloc[0]}-major)")
    ax.axhline(12, color="grey", ls="--", lw=0.8, label="every block compressed (12 bits)")
    ax.axhline(16, color="black", lw=0.8, label="raw BF16 (16 bits)")
    ax.set(xlabel="layer", ylabel="stored bits per value (incl. metadata)", ylim=(11, 16.5))
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def sizes_verdict(table: pd.DataFrame) -> str:
    """What the captured cache packs to, keys and values, against the format's floor (every block compressed)."""
    by = table.groupby("tensor").size_fraction.mean()
    return (f"The captured cache packs to **{100 * table.size_fraction.mean():.1f} %** of its BF16 size (keys "
            f"{100 * by['K']:.1f} %, values {100 * by['V']:.1f} %), against the format's floor of "
            f"{100 * kvformat.PACKED_BLOCK_BYTES / kvformat.RAW_BLOCK_BYTES:.0f} % when every block is compressible.")


def round_trip(captures, k_layout: str, v_layout: str, kernel_layers: int) -> tuple[dict, list]:
    """Pack and unpack every page of every layer with the torch reference, and the first ``kernel_layers``
    layers also with the Triton pack kernel (whose bytes must equal the reference's in each page's used
    prefix). Equality is ``torch.equal`` on int16 views. Returns ``(pages checked per path, mismatches)``."""
    checked, mismatches = {"reference": 0, "triton": 0}, []
    for c in captures:
        for i, layer in enumerate(c.layers):
            for tensor, layout in (("K", k_layout), ("V", v_layout)):
                pages = _tensor(layer, tensor)
                payload, meta = kvformat.pack(pages, layout)
                if not torch.equal(kvformat.unpack(payload, meta).view(torch.int16), pages.view(torch.int16)):
                    mismatches.append(("reference", i, tensor))
                checked["reference"] += pages[..., 0, 0].numel()
                if i < kernel_layers:
                    flat = pages.reshape(-1, *pages.shape[-2:])
                    k_payload, k_meta = pack_pages(flat, layout)
                    used = torch.arange(k_payload.shape[-1], device=k_payload.device) < k_meta.nbytes[:, None]
                    same = torch.equal(k_payload[used], payload.reshape(k_payload.shape)[used])
                    if not (same and torch.equal(kvformat.unpack(k_payload, k_meta).view(torch.int16),
                                                 flat.view(torch.int16))):
                        mismatches.append(("triton", i, tensor))
                    checked["triton"] += flat.shape[0]
    return checked, mismatches


READ_SPLITS = (1, 2)
"""Split-KV factors at which :func:`read_identity` compares (1: one program per request and head; 2: the
splits' partial outputs merged)."""

GENERATION_SPLITS = 2
"""The split-KV factor both engines of :func:`generation_identity` use on a GPU: one summation order for both."""

SAME_KERNEL, TRITON_KERNEL, REFERENCE = ("uncompressed, same kernel", "uncompressed, Triton kernel",
                                         "uncompressed, reference attention")
""":func:`generation_identity`'s comparisons: the uncompressed engine through ZipFusion's kernel and split count,
through the Triton kernel in the token layouts (another summation order), and (off the GPU) both through the torch
reference."""


def read_kernels(device, head_dim: int, group: int) -> list[tuple[str, str, str]]:
    """The decode kernels :func:`read_identity` runs on ``device``: ``(kernel, layout, path)`` -- the Triton kernel
    (token layouts, its mixed specialisation, which takes every page; on the CPU in Triton's interpreter) and, on
    CUDA at a head_dim and GQA group it takes, the Gluon kernel (mma layouts, routed by page kinds: a raw cache
    through its all-raw specialisation, a packed one through its mixed one)."""
    from zipkv.kernels import decode_mma

    kernels = [("triton", "token", "mixed")]
    if torch.device(device).type == "cuda" and head_dim in kvformat.MMA_HEAD_DIMS and group <= decode_mma.MAX_GROUP[head_dim]:
        kernels.insert(0, ("gluon", "mma", "auto"))
    return kernels


@torch.no_grad()
def read_identity(captures, kernel_layers: int) -> pd.DataFrame:
    """Does the fused decode kernel read the format without changing a bit of its output (§III-C)? Per capture,
    layer (the first ``kernel_layers``), kernel (:func:`read_kernels`) and split count (:data:`READ_SPLITS`): the
    captured queries of the window's last token ``[1, q_heads, d]`` attend to the captured cache of the tokens
    before it (a partial last page stays raw), stored once raw and once packed (every compressible block of the
    full pages), through the same kernel. Columns: window, layer, kernel, path, splits, frac_compressed (of the
    packed cache's K and V blocks), outputs (values compared), identical (bit-identical outputs), max_abs_diff."""
    from zipkv.kernels.decode_attention import build_paged_cache, decode_attention

    rows = []
    for w, c in enumerate(captures):
        for i, layer in enumerate(c.layers[:kernel_layers]):
            q = layer.queries[None, :, -1].contiguous()
            k, v = (t[None, :, :-1].contiguous() for t in (layer.keys, layer.values))
            for kernel, layout, path in read_kernels(q.device, k.shape[-1], q.shape[1] // k.shape[1]):
                kl, vl = ("k_mma", "v_mma") if layout == "mma" else ("token", "token")
                raw, packed = (build_paged_cache(k, v, k_layout=kl, v_layout=vl, compress=mode)
                               for mode in ("none", "eligible"))
                st = packed[0].stats()
                for splits in READ_SPLITS:
                    a, b = (decode_attention(q, *cache, num_splits=splits, path=path) for cache in (raw, packed))
                    rows.append(dict(window=w, layer=i, kernel=kernel, path=path, splits=splits,
                                     frac_compressed=(st["frac_k"] + st["frac_v"]) / 2, outputs=a.numel(),
                                     identical=int((a.view(torch.int16) == b.view(torch.int16)).sum()),
                                     max_abs_diff=float((a.float() - b.float()).abs().max())))
    return pd.DataFrame(rows)


def generation_identity(model, prompts, new_tokens: int) -> pd.DataFrame:
    """Greedy tokens of :class:`zipkv.engine.Engine` with every full page compressed (``compress="all"``) against the
    uncompressed engine, under a budget that holds every request at once (one batch composition, so the
    model's matrix products see the same batch in both). On CUDA two uncompressed engines: in the default layouts
    (the mma layouts), read by the same Gluon kernel with the same split count (:data:`GENERATION_SPLITS`) as
    ZipFusion -- and in the token layouts (the Triton kernel's all-raw path, its own split count: another summation
    order; the throughput chapter's uncompressed baseline). Elsewhere (the CPU, or a model the Gluon kernel does not
    take) both engines use the torch reference attention. One row per comparison and request: comparison, request,
    identical, first_difference (index of the first differing new token, or None)."""
    from zipkv.engine import Engine, kv_budget_for
    from zipkv.study.experiments.throughput import token_agreement

    from zipkv.models import ModelShape

    shape = ModelShape.from_config(model.config)
    kernels = read_kernels(next(model.parameters()).device, shape.head_dim, shape.group_size)
    budget = kv_budget_for(model.config, len(prompts), max(len(p) for p in prompts) + new_tokens)
    if kernels[0][0] == "gluon":
        zip_settings = dict(compress="all", num_splits=GENERATION_SPLITS)
        engines = {SAME_KERNEL: dict(compress="none", num_splits=GENERATION_SPLITS),
                   TRITON_KERNEL: dict(compress="none", k_layout="token", v_layout="token")}
    else:
        zip_settings = dict(compress="all", attention="reference")
        engines = {REFERENCE: dict(compress="none", attention="reference")}
    zip_tokens = Engine(model, budget, eos_token_id=None, **zip_settings).generate(prompts, new_tokens).outputs
    rows = []
    for name, settings in engines.items():
        other = Engine(model, budget, eos_token_id=None, **settings).generate(prompts, new_tokens).outputs
        for r, (z, o) in enumerate(zip(zip_tokens, other)):
            agree = token_agreement([z], [o])
            rows.append(dict(comparison=name, request=r, identical=bool(agree["identical"]),
                             first_difference=(agree["first_difference"] or [None])[0]))
    return pd.DataFrame(rows)


def identity_text(reads: pd.DataFrame, generations: pd.DataFrame, *, new_tokens: int) -> str:
    """The section's finding: bit-identical attention outputs per kernel, and identical greedy tokens per comparison."""
    parts = []
    for kernel, g in reads.groupby("kernel", sort=False):
        identical, outputs = int(g.identical.sum()), int(g.outputs.sum())
        how = "routed by page kinds" if g.path.iloc[0] == "auto" else "its mixed specialisation"
        splits = "/".join(map(str, sorted(g.splits.unique())))
        part = (f"the {kernel} kernel ({how}, {report.count(g.window.nunique(), 'window')} × "
                f"{report.count(g.layer.nunique(), 'layer')} × splits {splits}): {identical:,} of {outputs:,} outputs "
                "bit-identical")
        if identical != outputs:
            part += f" (**not identical**: largest difference {g.max_abs_diff.max():.3g})"
        parts.append(part)
    text = (f"Over packed pages (the captured cache, {100 * reads.frac_compressed.mean():.1f} % of its blocks "
            "compressed) and the same pages raw, " + "; ".join(parts) + ". ")
    gen = []
    for name, g in generations.groupby("comparison", sort=False):
        firsts = sorted(int(x) for x in g.first_difference.dropna())
        gen.append(f"{name}: {int(g.identical.sum())} of {len(g)} requests identical"
                   + (f" (the others first differ at new token {', '.join(map(str, firsts))})" if firsts else ""))
    return (text + f"Greedy generation of {new_tokens} tokens, ZipFusion (every full page compressed) against "
            + "; ".join(gen) + ".")


def identity_table(reads: pd.DataFrame, generations: pd.DataFrame) -> pd.DataFrame:
    """The two checks as one table, a row each: ``check`` "read" (:func:`read_identity`'s columns) or "generation"
    (:func:`generation_identity`'s)."""
    table = pd.concat([reads.assign(check="read"), generations.assign(check="generation")], ignore_index=True)
    counts = [c for c in table.columns if c in ("window", "layer", "splits", "outputs", "identical", "request",
                                                "first_difference")]
    return table.astype({c: "Int64" for c in counts})     # integers stay integers beside the other check's gaps


def _same_kernel(generations: pd.DataFrame) -> pd.DataFrame:
    """The comparisons whose two engines read through the same kernel (the Triton-kernel one may differ: another
    summation order)."""
    return generations[generations.comparison != TRITON_KERNEL]


def all_identical(reads: pd.DataFrame, generations: pd.DataFrame) -> bool:
    """Every output read bit-identically, and every request's tokens identical where both engines read through
    the same kernel."""
    same_kernel = _same_kernel(generations)
    return int(reads.identical.sum()) == int(reads.outputs.sum()) and bool(same_kernel.identical.all())


def identity_verdict(reads: pd.DataFrame, generations: pd.DataFrame) -> str:
    """One sentence for the chapter's verdict: the reads and the same-kernel generations."""
    same_kernel = _same_kernel(generations)
    kernels = reads.kernel.unique()
    subject = f"kernels ({' and '.join(kernels)}) read" if len(kernels) > 1 else f"kernel ({kernels[0]}) reads"
    return (f"The decode {subject} packed pages into **{int(reads.identical.sum()):,} of "
            f"{int(reads.outputs.sum()):,}** attention outputs bit-identical to the same pages raw, and the engine's "
            f"greedy tokens with every full page compressed equal the uncompressed cache's in "
            f"**{int(same_kernel.identical.sum())} of {len(same_kernel)}** requests ({same_kernel.comparison.iloc[0]}).")
