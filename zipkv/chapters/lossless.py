"""Chapter "The lossless format" (ZipFusion Fig. 2, §III-B): one block bit by bit, stored bits per
value per layer, and the bit-exact round trip of a captured cache through the torch reference and
the Triton pack kernel."""
from __future__ import annotations

import pandas as pd
import torch

from zipkv import format as kvformat
from zipkv.kernels.pack import pack_pages  # first: on a CPU it sets TRITON_INTERPRET before Triton loads


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
        rows.append({"position": p, "value": float(block[p]), "bits": f"{v:016b}", "exponent": int(exponent[p]),
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
