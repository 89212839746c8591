"""Pages in the escape format (:mod:`zipkv.escape`, every block compressible) in the byte pool: :class:`EscapePages`,
the :class:`~zipkv.memory.pages.Pages` of a :class:`~zipkv.memory.KVMemory` made with ``block_format="escape"``.

What changes against ZipFusion's format
---------------------------------------
* **Packing** (:func:`zipkv.escape.pack_slots`, or the Triton escape pack kernel on a GPU): every block of a full page
  is compressed (but one with more than 127 escapes), and each page-head's escape list -- exactly its entries, 2
  bytes each (the list sized per page) -- is written right after its blocks, in its own raw slot (a compressed block
  frees 256 bytes and lists at most 127 entries, so it always fits there).
* **Escape descriptors**: beside each layer's block descriptors ``desc[layer]`` an int64 tensor ``esc[layer]`` of the
  same shape, per block ``entry_address << 8 | zero << 7 | count`` (:func:`zipkv.escape.list_descriptors`): what a
  decode kernel reads beside the block descriptor, and :class:`zipkv.paged.PagedKVCache`'s ``escapes``. Raw pages:
  zeros.
* **Placement**: a page moved into a compressed chunk (or placed there packed, :meth:`place_packed`) takes its
  page-heads' blocks as before and, after its last page-head (values, last KV head), **one list for the whole page**:
  every page-head's entries back to back (keys then values, KV heads in order), rounded up to whole 256-byte units
  (:data:`~zipkv.memory.placement.UNIT`). The list units are part of the last page-head's units for
  :class:`~zipkv.memory.placement.Placement`, so capacity, admission and ``used_bytes`` count them exactly; a page
  compressed in place keeps its lists in its page-heads' raw slots.

Not supported yet: :meth:`export` (offload and transfer of escape pages); a packed request's checksums
(:meth:`pack`, :func:`zipkv.format.page_checksum`) cover its page-heads' blocks, not their escape lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zipkv import escape, format as fmt
from zipkv.memory.pages import Packed, Pages, to_device
from zipkv.memory.placement import UNIT

__all__ = ["EscapePages", "EscapePacked", "pack_slots_reference", "list_units"]


def pack_slots_reference(pool: torch.Tensor, offsets: torch.Tensor, head_dim: int, layout: str):
    """:func:`zipkv.escape.pack_slots` (the torch reference): ``(packed, second)``, uint8 ``[n, n_blocks]`` each."""
    return escape.pack_slots(pool, offsets, head_dim, layout)


def list_units(entries: torch.Tensor) -> torch.Tensor:
    """Units (256 bytes) of a page's escape list: ``entries`` int ``[...]`` entries of the page (all its page-heads)."""
    return (2 * entries + UNIT - 1) // UNIT


@dataclass
class EscapePacked(Packed):
    """A :class:`~zipkv.memory.pages.Packed` of escape-format pages: ``second`` per layer uint8 ``[n_pages, 2,
    kv_heads, n_blocks]``, each block's ``zero << 7 | count``; each page-head's list follows its blocks in its slot;
    ``head_units`` count the page's list (in whole units) in its last page-head."""
    second: list | None = None


class EscapePages(Pages):
    """:class:`~zipkv.memory.pages.Pages` whose full pages are packed in the escape format (module docstring).
    pack_slots: ``f(pool, offsets, head_dim, layout) -> (packed, second)`` (:func:`pack_slots_reference`'s
    contract)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._esc_all = torch.zeros_like(self._desc_all)
        self._esc = list(self._esc_all)
        self._entries = [dict() for _ in range(self.num_layers)]           # page id -> entries per page-head [2H]

    # ------------------------------------------------------------------ descriptors

    def flush_pages(self) -> None:
        ids = sorted({p for p, _ in self._new_rows})
        super().flush_pages()
        if ids:
            self._esc_all[:, to_device(torch.tensor(ids, dtype=torch.int64), self.device)] = 0

    @property
    def esc_all(self) -> torch.Tensor:
        """Every layer's escape descriptors, int64 ``[layers, pages, 2, kv_heads, blocks]``."""
        self.flush_pages()
        return self._esc_all

    @property
    def esc(self) -> list:
        """Per layer the escape descriptors int64 ``[pages, 2, kv_heads, blocks]`` (views of :attr:`esc_all`)."""
        self.flush_pages()
        return self._esc

    def free_pages(self, ids: list[int]) -> None:
        super().free_pages(ids)
        for p in ids:
            for e in self._entries:
                e.pop(p, None)

    def export(self, *args, **kwargs):
        raise NotImplementedError("KVMemory.export: escape-format pages do not leave the pool yet (their escape "
                                  "lists are not part of a Packed's checks)")

    # ------------------------------------------------------------------ compression

    def _pack_full(self, full) -> list:
        """Pack the raw slots of pages ``full`` in every layer in place (lists in the slots' tails), point their block
        and escape descriptors there; returns the units each page-head takes once moved, ``[layers][n][2][kv_heads]``
        (the page's list units in its last page-head), and records each page-head's entries."""
        n, H, L, nb = len(full), self.kv_heads, self.num_layers, fmt.n_blocks(self.head_dim)
        self._changed.update(full)
        idx = torch.tensor(full, dtype=torch.int64, device=self.device)
        d, e = self.desc_all, self._esc_all
        base = d[:, idx, :, :, 0] >> 8                                           # [L, n, 2, H]
        for kv in (0, 1):
            off = base[:, :, kv].reshape(-1).contiguous()
            packed, second = self._pack(self.pool, off, self.head_dim, self.layouts[kv])
            m = fmt.PageMeta.from_packed(packed, self.layouts[kv], self.head_dim)
            d[:, idx, kv] = (((off[:, None] + m.block_offsets()) << 8) | packed.to(torch.int64)).reshape(L, n, H, -1)
            e[:, idx, kv] = escape.list_descriptors(off + m.nbytes, second).reshape(L, n, H, -1)
        comp = ((d[:, idx] >> 7) & 1).sum(-1)                                    # [L, n, 2, H]
        entries = (e[:, idx] & 0x7F).sum(-1).reshape(L, n, 2 * H).cpu()          # one device read with the units
        hu = (nb * 4 - comp).reshape(L, n, 2 * H).cpu()
        hu[..., -1] += list_units(entries.sum(-1))
        for l in range(L):
            for i, p in enumerate(full):
                self._entries[l][p] = entries[l, i].tolist()
        return hu.reshape(L, n, 2, H).tolist()

    def _copy_lists(self, layers, ids, src_lists: torch.Tensor, dst_list: torch.Tensor, entries: torch.Tensor,
                    src_pool: torch.Tensor | None = None) -> None:
        """Copy each page's page-head lists (from ``src_lists`` int64 ``[n, 2H]`` byte addresses, ``entries`` int64
        ``[n, 2H]`` entries each, in ``src_pool`` or the pool) to one list per page at byte ``dst_list`` int64 ``[n]``,
        and point the pages' escape descriptors (``layers``, ``ids`` int64 ``[n]``) there."""
        n, H = entries.shape[0], self.kv_heads
        nbytes = 2 * entries                                                     # [n, 2H]
        dst_head = dst_list[:, None] + torch.cumsum(nbytes, -1) - nbytes         # [n, 2H] each head's list in the page's
        total = int(nbytes.sum())
        if total:
            rep = nbytes.reshape(-1)
            first = torch.cumsum(rep, 0) - rep
            k = torch.arange(total) - torch.repeat_interleave(first, rep)
            src = torch.repeat_interleave(src_lists.reshape(-1), rep) + k
            dst = torch.repeat_interleave(dst_head.reshape(-1), rep) + k
            pool = self.pool if src_pool is None else src_pool
            self.pool[dst.to(self.device)] = pool[src.to(self.device)]
        shift = ((dst_head - src_lists).reshape(n, 2, H, 1) << 8).to(self.device)
        self.esc_all[layers.to(self.device), ids.to(self.device)] += shift

    def _move(self, moves):
        """Move compressed pages (block units as :meth:`Pages._move`; the page-heads' lists, from their raw slots'
        tails, into one list after the page's last page-head), all in a few indexed copies."""
        n, H = len(moves), self.kv_heads
        entries = torch.tensor([self._entries[m[0]][m[1]] for m in moves], dtype=torch.int64)     # [n, 2H]
        lu = list_units(entries.sum(-1))
        blocks_only = []
        for (l, p, hu, src, dest), u in zip(moves, lu.tolist()):
            hb = [list(hu[0]), list(hu[1])]
            hb[1][-1] -= u
            blocks_only.append((l, p, hb, src, dest))
        hb = torch.tensor([m[2] for m in blocks_only], dtype=torch.int64).reshape(n, 2 * H)
        hu = torch.tensor([m[2] for m in moves], dtype=torch.int64).reshape(n, 2 * H)
        start = self._head_starts([m[4] for m in moves], hu)                      # [n, 2H] pool units (with lists)
        src = torch.tensor([m[3] for m in moves])
        head_src = src[:, None] * UNIT + torch.arange(2 * H) * self.slot_bytes  # [n, 2H] bytes
        src_lists = head_src + hb * UNIT
        dst_list = (start[:, -1] + hb[:, -1]) * UNIT
        layers = torch.tensor([m[0] for m in moves], dtype=torch.int64)
        ids = torch.tensor([m[1] for m in moves], dtype=torch.int64)
        # lists first (their sources are the raw slots the block copy leaves intact; sources and destinations are
        # disjoint: raw slots vs compressed extents)
        self._copy_lists(layers, ids, src_lists, dst_list, entries)
        super()._move(blocks_only)

    # ------------------------------------------------------------------ packed requests

    def pack(self, kv, *, checksum: bool = True) -> EscapePacked:
        """Pack a request's full pages outside the pool in the escape format (:meth:`Pages.pack`'s input and shapes):
        an :class:`EscapePacked` with check bytes and, with ``checksum``, each page-head's CRC-32 of its blocks' bytes
        (:func:`zipkv.format.page_checksum`; its escape list is not covered: module docstring)."""
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {type(checksum).__name__} {checksum!r}")
        if not isinstance(kv, (list, tuple)) or len(kv) != self.num_layers:
            raise ValueError(f"kv must hold one (k, v) pair per layer ({self.num_layers}), got "
                             f"{len(kv) if isinstance(kv, (list, tuple)) else type(kv).__name__}")
        for l, pair in enumerate(kv):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 \
                    or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in pair):
                raise ValueError(f"kv[{l}] must be a (k, v) pair of tensors [kv_heads, n, head_dim]")
        n_tok = kv[0][0].shape[1]
        n, H, sb, nb = n_tok // fmt.PAGE_TOKENS, self.kv_heads, self.slot_bytes, fmt.n_blocks(self.head_dim)
        slots, metas, seconds, head_units, tails, checks = [], [], [], [], [], []
        for k, v in kv:
            if k.shape != (H, n_tok, self.head_dim) or v.shape != k.shape:
                raise ValueError(f"kv: every layer's k and v must have shape {(H, n_tok, self.head_dim)}, got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")
            if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                raise TypeError(f"kv: k and v must be torch.bfloat16, got {k.dtype} and {v.dtype}")
            buf = torch.zeros(n * 2 * H * sb + sb, dtype=torch.uint8, device=self.device)
            view = buf[: n * 2 * H * sb].view(torch.bfloat16).view(n, 2, H, sb // 2)
            for i, x in enumerate((k, v)):
                x = x[:, : n * fmt.PAGE_TOKENS].to(self.device).reshape(H, n, fmt.PAGE_TOKENS * self.head_dim)
                view[:, i, :, self.write_index[i].reshape(-1)] = x.transpose(0, 1)
            off = (torch.arange(n * 2 * H, device=self.device) * sb).reshape(n, 2, H)
            meta = torch.zeros(n, 2, H, nb, dtype=torch.uint8, device=self.device)
            second = torch.zeros_like(meta)
            if n:
                for i in (0, 1):
                    b, s = self._pack(buf, off[:, i].reshape(-1).contiguous(), self.head_dim, self.layouts[i])
                    meta[:, i], second[:, i] = b.reshape(n, H, nb), s.reshape(n, H, nb)
            comp = (meta >> 7).to(torch.int64).sum(-1)                                         # [n, 2, H]
            hu = (nb * 4 - comp).reshape(n, 2 * H).cpu()
            hu[:, -1] += list_units((second & 0x7F).to(torch.int64).sum((-1, -2, -3)).cpu())
            head_units.append(hu.tolist())
            slots.append(buf[: n * 2 * H * sb].view(n, 2, H, sb))
            metas.append(meta)
            seconds.append(second)
            checks.append(torch.stack([fmt.meta_check(meta[:, i].contiguous(), self.layouts[i], self.head_dim)
                                       for i in (0, 1)], 1))
            tails.append((k[:, n * fmt.PAGE_TOKENS:], v[:, n * fmt.PAGE_TOKENS:]))
        checked = {}
        if "check" in Packed.__dataclass_fields__:              # a Packed that carries its checks
            sums = [self._checksums(sl, m) for sl, m in zip(slots, metas)] if checksum else None
            checked = dict(check=checks, checksum=sums)
        return EscapePacked(tokens=n_tok, n_pages=n, slots=slots, meta=metas, head_units=head_units, tail=tails,
                            second=seconds, **checked)

    def check_packed(self, packed) -> None:
        if not isinstance(packed, EscapePacked):
            raise TypeError(f"packed must come from this memory's pack (an EscapePacked, block_format='escape'), got "
                            f"{type(packed).__name__}")
        super().check_packed(packed)
        want = (packed.n_pages, 2, self.kv_heads, fmt.n_blocks(self.head_dim))
        if not isinstance(packed.second, list) or len(packed.second) != self.num_layers or any(
                not isinstance(s, torch.Tensor) or s.dtype != torch.uint8 or tuple(s.shape) != want
                for s in packed.second):
            raise ValueError(f"packed.second must hold one uint8 tensor {want} per layer ({self.num_layers})")

    def place_packed(self, packed: EscapePacked, outstanding: int) -> list[int]:
        """Place ``packed``'s full pages in compressed chunks of each layer (:meth:`Pages.place_packed`), each page's
        page-head lists gathered into one list after its last page-head; block and escape descriptors written."""
        n, H = packed.n_pages, self.kv_heads
        ids = [self._free_ids.pop() for _ in range(n)]
        slot_units = self.slot_bytes // UNIT
        for l in range(self.num_layers):
            pieces = self._alloc_packed(l, ids, packed.head_units[l], outstanding)
            if not n:
                continue
            meta, second = packed.meta[l], packed.second[l]
            hu = torch.tensor(packed.head_units[l], dtype=torch.int64)                   # [n, 2H] with the list
            entries = (second & 0x7F).to(torch.int64).sum(-1).reshape(n, 2 * H).cpu()
            hb = hu.clone()
            hb[:, -1] -= list_units(entries.sum(-1))
            start = self._head_starts(pieces, hu)                                       # [n, 2H] pool units
            u = torch.arange(slot_units)
            used = u < hb[..., None]
            src_u = ((torch.arange(n)[:, None, None] * 2 * H + torch.arange(2 * H)[None, :, None]) * slot_units + u)[used]
            dst_u = (start[..., None] + u)[used]
            units = self.pool[: self.total_bytes].view(-1, UNIT)
            units[dst_u.to(self.device)] = packed.slots[l].reshape(-1, UNIT)[src_u.to(self.device)]
            head = (start * UNIT).reshape(n, 2, H, 1).to(self.device)
            offsets = fmt.PageMeta.from_packed(meta, self.layouts[0], self.head_dim).block_offsets()
            rows = torch.tensor(ids, device=self.device)
            self.desc[l][rows] = ((head + offsets) << 8) | meta.to(torch.int64)
            # lists: in the packed slots after each page-head's blocks -> one list after the page's last page-head
            src_lists = (torch.arange(n * 2 * H).reshape(n, 2 * H) * self.slot_bytes) + hb * UNIT
            self.esc[l][rows] = escape.list_descriptors(
                (src_lists.reshape(n, 2, H)).to(self.device), second)
            self._copy_lists(torch.full((n,), l, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64), src_lists,
                             (start[:, -1] + hb[:, -1]) * UNIT, entries, src_pool=packed.slots[l].reshape(-1))
            for i, p in enumerate(ids):
                self._entries[l][p] = entries[i].tolist()
        self._changed.update(ids)
        return ids
