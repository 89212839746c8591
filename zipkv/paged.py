"""The paged, partly compressed KV cache that the fused decode kernels read (ZipFusion §III-C, §III-D).

Physical storage (:class:`PagedKVCache`)
----------------------------------------
* ``pool``: one uint8 byte pool. Each *page-head* (16 tokens × head_dim of one KV head,
  keys or values) is a slot laid out exactly as :func:`zipkv.format.pack` writes it:
  its blocks back to back, 768 bytes per compressed block, 1024 per raw block.
* ``desc``: int64 ``[num_pages, 2, kv_heads, n_blocks]`` block descriptors (index 0 of
  dim 1 = keys, 1 = values): ``desc = byte_address << 8 | flag << 7 | b >> 1``, i.e. the
  block's absolute byte address in ``pool`` (a multiple of 256), its compressed flag and
  its exponent base. One 8-byte load per block gives everything needed to decode it, and
  slots may sit anywhere (fixed slots, or packed back to back: ``compact=True``), so a
  memory manager can move pages without touching the page table.
* Page table: FlashInfer's CSR form, page size ``zipkv.format.PAGE_TOKENS`` (16): ``indptr`` int32
  ``[batch + 1]``, ``indices`` int32 ``[nnz_pages]`` (physical page ids), ``last_page_len`` int32
  ``[batch]`` in 1..16. A partial last page stays raw.
* Keys use ``k_layout``, values ``v_layout`` (see ``zipkv.format``); with the token layout a raw
  page is the plain row-major ``[16, head_dim]`` bf16 page.
* ``check`` (optional; the kernels never read it): uint8 ``[num_pages, 2, kv_heads, n_blocks]``, each
  block's check byte (:func:`zipkv.format.meta_check` of its descriptor's low byte). It does not cover
  addresses, so moving a slot keeps it; whoever changes a block's flag or base writes it
  (:func:`build_paged_cache`, :func:`compress_cache_` and :meth:`PagedKVCache.import_pages` do;
  :meth:`PagedKVCache.seal` after a change by hand). ``None``: descriptors get the structural checks only.
* ``escapes`` (optional; pages in :mod:`zipkv.escape`'s format, every block compressible): int64 ``[num_pages, 2,
  kv_heads, n_blocks]``, per block ``entry_address << 8 | zero << 7 | count``
  (:func:`zipkv.escape.list_descriptors`): the byte address in ``pool`` of the block's first escape entry (2 bytes
  each, little-endian ``p << 7 | e >> 1``), its zero mode and its escape count. ``desc`` keeps ZipFusion's meaning
  (address, flag, base), so a page-head without escapes and zero mode reads as ZipFusion's; raw blocks have count 0
  and no zero mode. ``None``: ZipFusion's format. Where each page's list lives is the writer's choice (its own slot's
  tail after :func:`build_paged_cache`; after the page's last page-head in :mod:`zipkv.memory`).

Validation (``plan(..., validate=True)``, :func:`check_descriptors`, :meth:`PagedKVCache.read_pages`): see
``zipkv.format``'s "Validation and checksums"; pages that leave the pool travel with CRC-32 checksums
(:meth:`PagedKVCache.export_pages`, :meth:`PagedKVCache.import_pages`).

Page kinds (:data:`PAGE_KINDS`, the values of :meth:`PagedKVCache.page_kinds`, one byte per
(page, kv head)): :data:`MIXED` (0), :data:`COMPRESSED` (1: every K and V block compressed),
:data:`RAW` (2: every block raw). The decode kernels' specialisations use the same numbers.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

import torch

from zipkv import format as fmt

__all__ = ["PagedKVCache", "PageExport", "build_paged_cache", "compress_cache_", "physical_page_ids", "page_kinds_of",
           "PAGE_KINDS", "MIXED", "COMPRESSED", "RAW",
           "check_cache", "check_layouts", "check_descriptors"]

MIXED, COMPRESSED, RAW = 0, 1, 2
PAGE_KINDS = ("mixed", "compressed", "raw")
"""Names of the page kinds, indexed by their value in :meth:`PagedKVCache.page_kinds`."""


@dataclass
class PagedKVCache:
    """Paged KV cache whose page-heads may be compressed per block (see module docstring).

    pool: uint8 ``[pool_bytes]``; desc: int64 ``[num_pages, 2, kv_heads, n_blocks]``; check: uint8
    ``[num_pages, 2, kv_heads, n_blocks]`` check bytes of the descriptors, or None; escapes: int64 ``[num_pages, 2,
    kv_heads, n_blocks]`` escape descriptors (the escape format), or None (ZipFusion's).
    """
    pool: torch.Tensor
    desc: torch.Tensor
    head_dim: int
    k_layout: str = "token"
    v_layout: str = "token"
    check: torch.Tensor | None = None
    escapes: torch.Tensor | None = None
    _kinds: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _version: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def num_pages(self) -> int:
        return self.desc.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.desc.shape[2]

    @property
    def n_blocks(self) -> int:
        return fmt.n_blocks(self.head_dim)

    def meta(self, kv: int) -> fmt.PageMeta:
        """Metadata of keys (kv=0) or values (kv=1): PageMeta ``[num_pages, kv_heads, n_blocks]`` (with the
        check bytes where the cache has them)."""
        if kv not in (0, 1) or isinstance(kv, bool):
            raise ValueError(f"kv must be 0 (keys) or 1 (values), got {kv!r}")
        d = self.desc[:, kv]
        return fmt.PageMeta.from_packed((d & 0xFF).to(torch.uint8), (self.k_layout, self.v_layout)[kv], self.head_dim,
                                        None if self.check is None else self.check[:, kv])

    def seal(self, pages: torch.Tensor | None = None) -> "PagedKVCache":
        """Write the check bytes of ``pages`` (int64 ids; None: every page, creating :attr:`check` if the cache has
        none) from their descriptors as they are now: after changing flags or bases by hand. Sealing blesses what
        is there, so seal only descriptors known to be right."""
        if pages is None:
            self.check = descriptor_checks(self.desc, self.k_layout, self.v_layout, self.head_dim)
        elif self.check is None:
            raise ValueError("seal(pages): the cache has no check bytes yet; seal() every page first")
        else:
            ids = _page_ids(self, pages, distinct=False, name="pages")
            self.check[ids] = descriptor_checks(self.desc[ids], self.k_layout, self.v_layout, self.head_dim)
        return self

    def slot_offsets(self) -> torch.Tensor:
        """int64 ``[num_pages, 2, kv_heads]``: byte address of each page-head slot."""
        return self.desc[..., 0] >> 8

    def read_pages(self, page_ids: torch.Tensor | None = None, *, validate: bool = True):
        """Decode pages with ``zipkv.format.unpack`` (``validate`` passed on): ``(k, v)``, each bf16
        ``[len(page_ids), kv_heads, 16, head_dim]`` (all pages by default)."""
        fmt._check_flag(validate, "validate")
        ids = (torch.arange(self.num_pages, device=self.desc.device) if page_ids is None
               else _page_ids(self, page_ids, distinct=False))
        pb, size = fmt.page_bytes(self.head_dim), self.pool.numel()
        d = self.desc[ids]                                               # [n, 2, H, nb]: only the pages read
        idx = (d[..., 0] >> 8)[..., None] + torch.arange(pb, device=d.device)
        # a compact slot may end early, near the pool's end: bytes past the pool read as zeros (without copying it)
        slots = torch.where(idx < size, self.pool[idx.clamp(max=size - 1)], 0)                    # [n, 2, H, pb]
        out = []
        for kv, layout in ((0, self.k_layout), (1, self.v_layout)):
            m = fmt.PageMeta.from_packed((d[:, kv] & 0xFF).to(torch.uint8), layout, self.head_dim,
                                         None if self.check is None else self.check[ids, kv])
            if self.escapes is None:
                out.append(fmt.unpack(slots[:, kv], m, validate=validate))
                continue
            from zipkv import escape                     # escape imports format only: no import circle
            if validate:
                fmt.check_meta(m)
            lists, count, zero = escape.read_lists(self.pool, self.escapes[ids, kv])
            em = escape.EscapeMeta(layout, self.head_dim, lists.shape[-1], m.compressed, m.base, count, zero,
                                   per_page=True)
            out.append(escape.unpack(slots[:, kv], lists, em, validate=validate))
        return out[0], out[1]

    def page_kinds(self) -> torch.Tensor:
        """uint8 ``[num_pages, kv_heads]``: :data:`COMPRESSED` where every K and V block of the
        page-head is compressed, :data:`RAW` where every one is raw, :data:`MIXED` otherwise (what
        the decode kernels route on). Cached; :func:`compress_cache_` refreshes it in place (the
        same tensor: a captured CUDA graph reads the new kinds), and code that edits ``desc`` by
        hand must call :meth:`refresh`."""
        return self._kind_info()[0]

    def kind(self) -> str:
        """``"compressed"`` (every page-head all-compressed), ``"raw"`` (every one raw) or
        ``"mixed"``; computed once (one device sync) and cached like :meth:`page_kinds`."""
        info = self._kind_info()
        if info[1] is None:
            present = frozenset(torch.unique(info[0]).tolist())
            k = {frozenset({COMPRESSED}): "compressed", frozenset({RAW}): "raw"}.get(present, "mixed")
            self._kinds = info = (info[0], k)
        return info[1]

    @property
    def version(self) -> int:
        """Counts :meth:`refresh` calls (page kinds recomputed): a decode plan made from the page
        kinds records it and refuses to run once it has changed."""
        return self._version

    def holds_kinds(self, kinds: torch.Tensor) -> bool:
        """Whether ``kinds`` (a plan's :meth:`page_kinds`) is still this cache's page-kinds tensor: a :meth:`refresh`
        after ``desc`` changed its number of pages replaces the tensor, and a plan that routes on the old one would
        read stale kinds."""
        return self._kinds is not None and self._kinds[0] is kinds

    def refresh(self, kinds: torch.Tensor | None = None, pages: torch.Tensor | None = None) -> "PagedKVCache":
        """Recompute the cached page kinds (after editing ``desc`` by hand), in place. pages: int64 ids of the
        only pages whose descriptors changed (None: any may have). kinds: their new kinds, uint8
        ``[len(pages) or num_pages, kv_heads]``, where the caller computed them (:func:`page_kinds_of` over
        several caches' descriptors at once); None: computed here. Check bytes (:attr:`check`) are not
        rewritten -- :meth:`seal` the pages whose flags or bases were changed by hand -- except that after ``desc``
        grew the new pages' are sealed (and a shrunk cache's dropped)."""
        if pages is not None and (not isinstance(pages, torch.Tensor) or pages.dim() != 1
                                  or pages.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"pages must be None or a 1-D int32/int64 tensor of page ids, got "
                             f"{getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}")
        if self.check is not None and self.check.shape != self.desc.shape:
            self._resize_check()
        shape = self._kind_shape() if pages is None else (pages.numel(), self.kv_heads)
        if kinds is not None and (tuple(kinds.shape) != tuple(shape) or kinds.dtype != torch.uint8):
            raise ValueError(f"kinds must be uint8 {list(shape)}, got {kinds.dtype} {list(kinds.shape)}")
        if self._kinds is not None and self._kinds[0].shape == self._kind_shape():
            if pages is None:
                self._kinds[0].copy_(page_kinds_of(self.desc) if kinds is None else kinds)
            else:
                self._kinds[0][pages] = page_kinds_of(self.desc[pages]) if kinds is None else kinds
            self._kinds = (self._kinds[0], None)
        else:
            self._kinds = None
        self._version += 1
        return self

    def _resize_check(self):
        """After ``desc`` grew or shrank: keep the check bytes of the pages still there, seal the new ones."""
        old, n = self.check, self.num_pages
        if old.shape[1:] != self.desc.shape[1:]:
            self.seal()
            return
        keep = min(old.shape[0], n)
        check = torch.empty(self.desc.shape, dtype=torch.uint8, device=self.desc.device)
        check[:keep] = old[:keep]
        check[keep:] = descriptor_checks(self.desc[keep:], self.k_layout, self.v_layout, self.head_dim)
        self.check = check

    def export_pages(self, page_ids: torch.Tensor, *, checksum: bool = True, validate: bool = True) -> "PageExport":
        """Copy pages out of the pool (offload, transfer): a :class:`PageExport` of their page-heads' bytes,
        descriptor bytes, check bytes (this cache's, or computed now where it has none) and, with ``checksum``,
        each page-head's CRC-32 (:func:`zipkv.format.page_checksum`, on the pool's device). page_ids: 1-D int
        ``[n]`` physical ids. validate: check their descriptors first (:func:`check_descriptors`, one sync)."""
        fmt._check_flag(checksum, "checksum")
        fmt._check_flag(validate, "validate")
        check_cache(self)
        _no_escapes(self, "export_pages")
        ids = _page_ids(self, page_ids)
        if validate:
            check_descriptors(self, ids)
        pb = fmt.page_bytes(self.head_dim)
        d = self.desc[ids]                                               # [n, 2, H, nb]
        packed = (d & 0xFF).to(torch.uint8)
        size = torch.where(((d >> 7) & 1).bool(), fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).sum(-1)
        at = torch.arange(pb, device=d.device)
        idx = ((d[..., 0] >> 8)[..., None] + at).clamp(0, self.pool.numel() - 1)
        payload = torch.where(at < size[..., None], self.pool[idx], 0).to(torch.uint8)
        check = (self.check[ids] if self.check is not None
                 else descriptor_checks(d, self.k_layout, self.v_layout, self.head_dim)).clone()
        out = PageExport(self.head_dim, self.k_layout, self.v_layout, payload, packed, check)
        if not checksum:
            return out
        sums = torch.stack([fmt.page_checksum(payload[:, kv], out.meta(kv)) for kv in (0, 1)], 1)
        return dataclasses.replace(out, checksum=sums)

    def import_pages(self, pages: "PageExport", page_ids: torch.Tensor, *, validate: bool = True) -> "PagedKVCache":
        """Write exported page-heads into pages ``page_ids`` (1-D int ``[n]``, distinct physical ids) of this cache,
        in place: each page-head's bytes at the start of its current slot, its descriptors and check bytes
        rewritten (check bytes only where this cache keeps them), the page kinds refreshed. Every destination
        page-head must span at least the bytes it receives (raw pages do: a full slot). validate: first verify
        ``pages`` (check bytes, and checksums where present: ``ValueError`` naming the page) and the destination
        descriptors (one sync each)."""
        fmt._check_flag(validate, "validate")
        check_cache(self)
        _no_escapes(self, "import_pages")
        if not isinstance(pages, PageExport):
            raise TypeError(f"pages must be a PageExport (PagedKVCache.export_pages), got {type(pages).__name__}")
        for name, theirs, ours in (("head_dim", pages.head_dim, self.head_dim),
                                   ("k_layout", pages.k_layout, self.k_layout),
                                   ("v_layout", pages.v_layout, self.v_layout)):
            if theirs != ours:
                raise ValueError(f"pages.{name} is {theirs!r}, this cache's {name} {ours!r}: pages of another format")
        pages.check_structure()
        ids = _page_ids(self, page_ids)
        want = (ids.numel(), 2, self.kv_heads, self.n_blocks)
        if tuple(pages.packed.shape) != want:
            raise ValueError(f"pages hold metadata {tuple(pages.packed.shape)} [pages, 2, kv_heads, n_blocks]; page_ids and "
                             f"this cache need {want}")
        if validate:
            pages.verify()
            check_descriptors(self, ids)
        dev = self.desc.device
        pages = pages.to(dev)
        d = self.desc[ids]
        have = torch.where(((d >> 7) & 1).bool(), fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).sum(-1)
        comp = (pages.packed >> 7).bool()
        need = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).sum(-1)
        short = need > have
        if bool(short.any()):
            i, kv, h = (int(x) for x in short.nonzero()[0])
            raise ValueError(f"page_ids: page {int(ids[i])}, kv head {h}, {('keys', 'values')[kv]} spans {int(have[i, kv, h])} "
                             f"bytes, the imported page-head needs {int(need[i, kv, h])}: import into pages with room "
                             f"(raw pages span a full slot)")
        start = d[..., 0] >> 8                                           # [n, 2, H]
        at = torch.arange(fmt.page_bytes(self.head_dim), device=dev)
        keep = at < need[..., None]
        self.pool[(start[..., None] + at)[keep]] = pages.payload[keep]
        size = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).to(torch.int64)
        offsets = torch.cumsum(size, -1) - size
        self.desc[ids] = ((start[..., None] + offsets) << 8) | pages.packed.to(torch.int64)
        if self.check is not None:
            self.check[ids] = pages.check
        return self.refresh(pages=ids)

    def _kind_shape(self):
        return self.desc.shape[:1] + self.desc.shape[2:3]

    def _kind_info(self):
        if self._kinds is None or self._kinds[0].shape != self._kind_shape():
            self._kinds = (page_kinds_of(self.desc), None)
        return self._kinds

    def stats(self) -> dict:
        """Pool bytes in use vs. raw, compressed block fractions for K and V, and the fractions of K and V
        page-heads that hold both compressed and raw blocks (``mixed_k``, ``mixed_v``)."""
        mk, mv = self.meta(0), self.meta(1)
        used = int(mk.nbytes.sum() + mv.nbytes.sum())
        if self.escapes is not None:                    # the escape lists' bytes
            used += 2 * int((self.escapes & 0x7F).sum())
        raw = 2 * self.num_pages * self.kv_heads * fmt.page_bytes(self.head_dim)

        def mixed(m):
            return float((m.compressed.any(-1) & ~m.compressed.all(-1)).float().mean())

        return dict(pool_bytes=self.pool.numel(), used_bytes=used, raw_bytes=raw,
                    frac_k=float(mk.compressed.float().mean()), frac_v=float(mv.compressed.float().mean()),
                    mixed_k=mixed(mk), mixed_v=mixed(mv))


@dataclass(frozen=True)
class PageExport:
    """Page-heads copied out of a :class:`PagedKVCache` (:meth:`PagedKVCache.export_pages`), self-checking:
    payload uint8 ``[n, 2, kv_heads, 32 * head_dim]`` (each page-head's bytes from the start of its row, zeros
    past them), packed uint8 ``[n, 2, kv_heads, n_blocks]`` (descriptor bytes ``flag << 7 | b >> 1``), check
    uint8 (same shape; :func:`zipkv.format.meta_check`) and checksum int64 ``[n, 2, kv_heads]`` (CRC-32 of each
    page-head's used bytes, :func:`zipkv.format.page_checksum`) or None."""
    head_dim: int
    k_layout: str
    v_layout: str
    payload: torch.Tensor
    packed: torch.Tensor
    check: torch.Tensor
    checksum: torch.Tensor | None = None

    def check_structure(self) -> "PageExport":
        """``TypeError``/``ValueError`` naming the field unless every field has its type, dtype and shape (reads no
        values: what ``import_pages(..., validate=False)`` still checks)."""
        fmt._check_head_dim(self.head_dim, "pages.head_dim")
        check_layouts(self.k_layout, self.v_layout, self.head_dim, "pages.")
        p = self.packed
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 4 or p.shape[1] != 2 \
                or p.shape[3] != fmt.n_blocks(self.head_dim):
            raise ValueError(f"pages.packed must be a uint8 tensor [n, 2, kv_heads, {fmt.n_blocks(self.head_dim)}], got "
                             f"{getattr(p, 'dtype', type(p).__name__)} {tuple(getattr(p, 'shape', ()))}")
        want = {"payload": (torch.uint8, (*p.shape[:3], fmt.page_bytes(self.head_dim))),
                "check": (torch.uint8, tuple(p.shape)), "checksum": (torch.int64, tuple(p.shape[:3]))}
        for name, (dtype, shape) in want.items():
            t = getattr(self, name)
            if t is None and name == "checksum":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"pages.{name} must be a {dtype} tensor of shape {shape}"
                                 f"{' or None' if name == 'checksum' else ''}, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        return self

    def meta(self, kv: int) -> fmt.PageMeta:
        """Keys' (0) or values' (1) metadata, PageMeta ``[n, kv_heads, n_blocks]`` with its check bytes."""
        return fmt.PageMeta.from_packed(self.packed[:, kv], (self.k_layout, self.v_layout)[kv], self.head_dim,
                                        self.check[:, kv])

    def verify(self) -> "PageExport":
        """``ValueError`` naming the page unless every metadata byte matches its check byte and (where taken) every
        page-head's bytes their checksum (one device sync per check)."""
        self.check_structure()
        for kv, name in ((0, "keys"), (1, "values")):
            m = self.meta(kv)
            fmt.check_meta(m, f"pages ({name})")
            fmt._check_against(m, self.packed[:, kv], f"pages ({name})")     # raw blocks' base bits too
            want = (m.compressed.shape[0], 2, *m.compressed.shape[1:-1], fmt.page_bytes(self.head_dim))
            if tuple(self.payload.shape) != want:
                raise ValueError(f"pages.payload must have shape {want}, got {tuple(self.payload.shape)}")
            if self.checksum is not None:
                fmt.verify_checksum(self.payload[:, kv], self.checksum[:, kv], m, f"pages ({name}, [page, kv head])")
        return self

    def pages(self, *, validate: bool = True):
        """Decode: ``(k, v)``, each bf16 ``[n, kv_heads, 16, head_dim]`` (:func:`zipkv.format.unpack`; validate:
        :meth:`verify` first)."""
        if validate:
            self.verify()
        return tuple(fmt.unpack(self.payload[:, kv], self.meta(kv), validate=validate) for kv in (0, 1))

    def to(self, device) -> "PageExport":
        """The same pages on ``device``."""
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device={device!r}: expected a torch device such as 'cpu' or 'cuda'") from None
        moved = (None if t is None else t.to(device) for t in (self.payload, self.packed, self.check, self.checksum))
        return PageExport(self.head_dim, self.k_layout, self.v_layout, *moved)


def descriptor_checks(desc: torch.Tensor, k_layout: str, v_layout: str, head_dim: int) -> torch.Tensor:
    """Check bytes of block descriptors int64 ``[..., 2, kv_heads, n_blocks]`` (:func:`zipkv.format.meta_check` of
    each low byte, keys with ``k_layout``, values with ``v_layout``): uint8, same shape."""
    low = (desc & 0xFF).to(torch.uint8)
    return torch.stack([fmt.meta_check(low[..., kv, :, :], lay, head_dim)
                        for kv, lay in ((0, k_layout), (1, v_layout))], -3)


def _no_escapes(cache, what: str) -> None:
    if cache.escapes is not None:
        raise NotImplementedError(f"{what}: pages in the escape format (cache.escapes set) do not travel yet (their "
                                  "escape lists are not part of a PageExport); read them with read_pages")


def _page_ids(cache, page_ids, *, distinct: bool = True, name: str = "page_ids") -> torch.Tensor:
    """``page_ids`` as int64 on the cache's device: 1-D, in ``[0, num_pages)``, distinct where ``distinct`` (syncs)."""
    if not isinstance(page_ids, torch.Tensor) or page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {getattr(page_ids, 'dtype', type(page_ids).__name__)} "
                         f"{tuple(getattr(page_ids, 'shape', ()))}")
    ids = page_ids.long().to(cache.desc.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.num_pages):
        raise ValueError(f"{name} must lie in [0, {cache.num_pages}), got range [{int(ids.min())}, {int(ids.max())}]")
    if distinct and ids.unique().numel() != ids.numel():
        raise ValueError(f"{name} must not repeat")
    return ids


def page_kinds_of(desc: torch.Tensor) -> torch.Tensor:
    """Page kinds (:meth:`PagedKVCache.page_kinds`) of block descriptors int64 ``[..., num_pages, 2, kv_heads,
    n_blocks]`` -- one cache's, or several caches' stacked: uint8 ``[..., num_pages, kv_heads]``."""
    comp = ((desc >> 7) & 1).bool()
    allc = comp.all(-1).all(-2)
    allr = (~comp).all(-1).all(-2)
    return torch.where(allc, COMPRESSED, torch.where(allr, RAW, MIXED)).to(torch.uint8).contiguous()


def check_layouts(k_layout, v_layout, head_dim, prefix=""):
    """ValueError unless ``k_layout``/``v_layout`` are layouts of ``zipkv.format`` defined at ``head_dim``
    and the mma layouts come as the pair (``"k_mma"``, ``"v_mma"``)."""
    fmt._check_layout(k_layout, f"{prefix}k_layout")
    fmt._check_layout(v_layout, f"{prefix}v_layout")
    fmt._check_layout_head_dim(k_layout, head_dim, f"{prefix}k_layout")
    fmt._check_layout_head_dim(v_layout, head_dim, f"{prefix}v_layout")
    if (k_layout in fmt.MMA_LAYOUTS or v_layout in fmt.MMA_LAYOUTS) and (k_layout, v_layout) != fmt.MMA_LAYOUTS:
        raise ValueError(f"{prefix}k_layout/v_layout: the mma layouts go together (k_layout={fmt.MMA_LAYOUTS[0]!r}, "
                         f"v_layout={fmt.MMA_LAYOUTS[1]!r}), got k_layout={k_layout!r}, v_layout={v_layout!r}")


def check_cache(cache, *, kernel_layouts: bool = True):
    """TypeError/ValueError unless ``cache`` is a well-formed :class:`PagedKVCache` (types, shapes,
    alignment; no device sync). kernel_layouts: its layouts must be a pair a decode kernel reads
    (:func:`check_layouts`); False: any layouts defined at its head_dim (what ``zipkv.format.unpack`` decodes)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    fmt._check_head_dim(cache.head_dim, "cache.head_dim")
    if kernel_layouts:
        check_layouts(cache.k_layout, cache.v_layout, cache.head_dim, "cache.")
    else:
        for name, layout in (("cache.k_layout", cache.k_layout), ("cache.v_layout", cache.v_layout)):
            fmt._check_layout_head_dim(fmt._check_layout(layout, name), cache.head_dim, name)
    p, d = cache.pool, cache.desc
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
        raise TypeError(f"cache.pool must be a contiguous 1-D uint8 tensor, got "
                        f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
    if p.numel() % 4 or p.data_ptr() % 16:
        raise ValueError(f"cache.pool must be 16-byte aligned with a size multiple of 4, got {p.numel()} bytes "
                         f"at address {p.data_ptr():#x}")
    nb = fmt.n_blocks(cache.head_dim)
    if (not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or d.dim() != 4
            or d.shape[1] != 2 or d.shape[3] != nb or not d.is_contiguous()):
        raise ValueError(f"cache.desc must be a contiguous int64 tensor [num_pages, 2, kv_heads, {nb}], got "
                         f"{getattr(d, 'dtype', type(d))} {tuple(getattr(d, 'shape', ()))}")
    if d.device != p.device:
        raise ValueError(f"cache.desc is on {d.device}, cache.pool on {p.device}: they must share a device")
    e = cache.escapes
    if e is not None and (not isinstance(e, torch.Tensor) or e.dtype != torch.int64 or e.shape != d.shape
                          or e.device != d.device):
        raise ValueError(f"cache.escapes must be None or an int64 tensor of desc's shape {tuple(d.shape)} on {d.device} "
                         f"(the escape format's descriptors), got {getattr(e, 'dtype', type(e).__name__)} "
                         f"{tuple(getattr(e, 'shape', ()))} on {getattr(e, 'device', None)}")
    c = cache.check
    if c is not None and (not isinstance(c, torch.Tensor) or c.dtype != torch.uint8 or c.shape != d.shape
                          or c.device != d.device):
        raise ValueError(f"cache.check must be None or a uint8 tensor of desc's shape {tuple(d.shape)} on {d.device}, got "
                         f"{getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))} on "
                         f"{getattr(c, 'device', None)} (after growing desc, call cache.refresh())")


def check_descriptors(cache, page_ids: torch.Tensor):
    """ValueError naming the page, KV head and block of ``page_ids`` (physical ids, repeats allowed) whose
    descriptor is wrong (one device sync), first of: a block that does not lie inside ``cache.pool`` at a multiple of
    256 bytes (a kernel would read past the pool); a metadata byte that does not match its check byte in
    ``cache.check`` (a corrupted flag or base, or a cache whose layout is not the one the check bytes were written
    for); a raw block with base bits set; a block that does not start where the page-head's previous block ends
    (a page-head's blocks lie back to back, in order: a flipped flag or address bit); two page-heads sharing pool
    bytes. What this cannot see: ``zipkv.format``'s docstring, "Validation and checksums"."""
    if page_ids.numel() == 0:
        return
    ids = page_ids.long()
    d = cache.desc[ids]                                                # [n, 2, H, nb]
    addr = d >> 8
    comp = ((d >> 7) & 1).bool()
    size = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES)
    outside = (addr < 0) | (addr % 256 != 0) | (addr + size > cache.pool.numel())
    raw_bits = ~comp & ((d & 0x7F) != 0)
    gap = torch.zeros_like(comp)
    gap[..., 1:] = addr[..., 1:] != addr[..., :-1] + size[..., :-1]
    checked = cache.check is not None
    bad_check = (descriptor_checks(d, cache.k_layout, cache.v_layout, cache.head_dim) != cache.check[ids]
                 if checked else torch.zeros_like(comp))
    start, end = addr[..., 0].reshape(-1), (addr[..., -1] + size[..., -1]).reshape(-1)
    heads = cache.kv_heads
    key = (ids[:, None, None] * 2 * heads + torch.arange(2 * heads, device=d.device).reshape(2, heads)).reshape(-1)
    order = torch.argsort(start, stable=True)
    s_start, s_end, s_key = start[order], end[order], key[order]
    overlap = (s_start[1:] < s_end[:-1]) & (s_key[1:] != s_key[:-1])
    found = torch.stack([outside.any(), bad_check.any(), raw_bits.any(), gap.any(), overlap.any()]).tolist()
    if not any(found):
        return

    def head(i, kv, h):
        return f"page {int(ids[i])}, kv head {h}, {('keys', 'values')[kv]}"

    def block(i, kv, h, j):
        return f"{head(i, kv, h)} block {j}"

    def kind(i, kv, h, j):
        return "compressed" if bool(comp[i, kv, h, j]) else "raw"

    if found[0]:
        i, kv, h, j = _first(outside)
        raise ValueError(
            f"cache.desc: {block(i, kv, h, j)}: a {kind(i, kv, h, j)} block at byte address {int(addr[i, kv, h, j])} "
            f"({int(size[i, kv, h, j])} bytes) does not lie inside the pool of {cache.pool.numel()} bytes at a multiple "
            f"of 256")
    if found[1]:
        for kv, layout in ((0, cache.k_layout), (1, cache.v_layout)):
            meta = fmt.PageMeta(layout, cache.head_dim, comp[:, kv], torch.zeros_like(comp[:, kv], dtype=torch.uint8),
                                cache.check[ids][:, kv])
            fmt._check_against(meta, (d[:, kv] & 0xFF).to(torch.uint8), "cache.desc",
                               lambda at, kv=kv: head(at[0], kv, at[1]), f"cache.{'kv'[kv]}_layout")
    if found[2]:
        i, kv, h, j = _first(raw_bits)
        raise ValueError(f"cache.desc: {block(i, kv, h, j)}: a raw block with base bits "
                         f"{int(d[i, kv, h, j] & 0x7F):#04x} (a raw block's are 0): the descriptor is corrupted")
    if found[3]:
        i, kv, h, j = _first(gap)
        raise ValueError(
            f"cache.desc: {block(i, kv, h, j)} starts at byte {int(addr[i, kv, h, j])}, but block {j - 1} "
            f"({kind(i, kv, h, j - 1)}, {int(size[i, kv, h, j - 1])} bytes at {int(addr[i, kv, h, j - 1])}) ends at "
            f"{int(addr[i, kv, h, j - 1] + size[i, kv, h, j - 1])}: a page-head's blocks lie back to back in order "
            f"(a flipped flag or address bit?)")
    n = int(overlap.nonzero()[0, 0])

    def named(x):
        k = int(s_key[x])
        return f"{head(int((ids == k // (2 * heads)).nonzero()[0, 0]), k // heads % 2, k % heads)} " \
               f"(bytes [{int(s_start[x])}, {int(s_end[x])}))"
    raise ValueError(f"cache.desc: {named(n + 1)} overlaps {named(n)}: two page-heads share pool bytes")


def _first(mask: torch.Tensor) -> tuple:
    return tuple(int(x) for x in mask.nonzero()[0])


def _check_kv(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must have dtype torch.bfloat16, got {x.dtype}")
    if x.dim() != 4 or min(x.shape[:3]) < 1:
        raise ValueError(f"{name} must have shape [batch, kv_heads, T, head_dim] with batch, kv_heads and T >= 1, "
                         f"got {tuple(x.shape)}")
    fmt._check_head_dim(x.shape[-1], f"{name} (shape {tuple(x.shape)})")


def physical_page_ids(num_pages: int, seed: int = 0, shuffle: bool = True) -> torch.Tensor:
    """int64 ``[num_pages]``: the physical page id of each logical page (requests' pages in order) in
    :func:`build_paged_cache`'s caches -- a seeded random permutation, as a serving engine's page pool
    hands pages out (``shuffle``), or the identity. The benchmark gives FlashInfer the same page table."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)


def build_paged_cache(k: torch.Tensor, v: torch.Tensor, seq_lens=None, *,
                      k_layout: str = "token", v_layout: str = "token",
                      compress="eligible", shuffle: bool = True, compact: bool = False,
                      seed: int = 0, block_format: str = "zipfusion"):
    """Build a :class:`PagedKVCache` and its CSR page table from contiguous K/V.

    k, v: bf16 ``[batch, kv_heads, T, head_dim]``; seq_lens: ``[batch]`` ints in 1..T
    (default T): request ``b`` uses its first ``seq_lens[b]`` tokens. Full pages are packed
    with ``zipkv.format.pack`` (partial last pages stay raw). compress: ``"eligible"``
    (every eligible block), ``"none"`` (all raw: the uncompressed baseline), a float ``f``
    (a seeded random fraction ``f`` of the eligible blocks), or a bool tensor
    ``[num_pages, 2, kv_heads, n_blocks]`` in logical page order (forcing the mix).
    shuffle: random physical page ids; compact: slots back to back at their packed size.
    The cache carries its descriptors' check bytes (``cache.check``). block_format: ``"zipfusion"`` (§III-B) or
    ``"escape"`` (:mod:`zipkv.escape`, the list sized per page: every block of a full page compressed, each
    page-head's list after its blocks in its slot, ``cache.escapes`` set; compress ``"eligible"`` or ``"none"``,
    a bool mask: the full page-heads it marks wholly (any block) packed).
    Returns ``(cache, indptr, indices, last_page_len)`` on k's device.
    """
    _check_kv(k, "k")
    _check_kv(v, "v")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.device != v.device:
        raise ValueError(f"k and v must be on one device, got k on {k.device} and v on {v.device}")
    B, H, T, D = k.shape
    check_layouts(k_layout, v_layout, D)
    dev = k.device
    fmt._check_flag(shuffle, "shuffle")
    fmt._check_flag(compact, "compact")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -2 ** 63 <= seed < 2 ** 64 - 1:
        raise ValueError(f"seed must lie in [-2**63, 2**64 - 1) (torch.Generator's seeds), got {seed}")
    if seq_lens is not None and (isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__len__")
                                 or getattr(seq_lens, "ndim", 1) != 1):
        raise TypeError(f"seq_lens must be None or a sequence of {B} integer lengths (a list or a 1-D tensor), got "
                        f"{type(seq_lens).__name__} {seq_lens!r}")
    lens = [T] * B if seq_lens is None else (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens))
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in lens):
        raise TypeError(f"seq_lens must hold integer lengths, got {lens}")
    if len(lens) != B or any(not 1 <= x <= T for x in lens):
        raise ValueError(f"seq_lens must hold {B} lengths in [1, {T}], got {lens}")
    T16 = fmt.PAGE_TOKENS
    npg = [-(-x // T16) for x in lens]
    P = sum(npg)
    pages, full = [], []
    for b in range(B):
        n = npg[b] * T16
        kv = torch.stack([k[b, :, :lens[b]], v[b, :, :lens[b]]])        # [2, H, L, D]
        kv = torch.nn.functional.pad(kv, (0, 0, 0, n - lens[b]))
        pages.append(kv.reshape(2, H, npg[b], T16, D).permute(2, 0, 1, 3, 4))
        full.append(torch.arange(npg[b]) < lens[b] // T16)
    pages = torch.cat(pages).contiguous()                              # [P, 2, H, 16, D] logical
    full = torch.cat(full).to(dev)
    nb = fmt.n_blocks(D)
    if isinstance(compress, torch.Tensor):
        if compress.dtype != torch.bool or compress.shape != (P, 2, H, nb):
            raise ValueError(f"compress mask must be bool [{P}, 2, {H}, {nb}], got {compress.dtype} {tuple(compress.shape)}")
        enable = compress.to(dev)
    elif compress == "eligible":
        enable = torch.ones(P, 2, H, nb, dtype=torch.bool, device=dev)
    elif compress == "none":
        enable = torch.zeros(P, 2, H, nb, dtype=torch.bool, device=dev)
    elif isinstance(compress, numbers.Real) and not isinstance(compress, numbers.Integral) and 0.0 <= compress <= 1.0:
        gen = torch.Generator().manual_seed(seed)
        enable = (torch.rand(P, 2, H, nb, generator=gen) < compress).to(dev)
    else:
        raise ValueError(f"compress must be 'eligible', 'none', a float in [0, 1] or a bool mask, got {compress!r}")
    if block_format not in ("zipfusion", "escape"):
        raise ValueError(f"block_format must be 'zipfusion' or 'escape', got {block_format!r}")
    if block_format == "escape" and not (isinstance(compress, torch.Tensor) or compress in ("eligible", "none")):
        raise ValueError(f"block_format='escape' takes compress 'eligible', 'none' or a bool mask, got {compress!r}")
    enable = enable & full[:, None, None, None]
    pb = fmt.page_bytes(D)
    payload = torch.empty(P, 2, H, pb, dtype=torch.uint8, device=dev)
    packed = torch.empty(P, 2, H, nb, dtype=torch.uint8, device=dev)
    check = torch.empty_like(packed)
    second = torch.zeros_like(packed)                                  # escape format: zero << 7 | count
    for kv, lay in ((0, k_layout), (1, v_layout)):
        pl, m = fmt.pack(pages[:, kv], lay, enable=enable[:, kv] if block_format == "zipfusion" else
                         torch.zeros_like(enable[:, kv]))
        payload[:, kv], packed[:, kv] = pl, m.packed()
        if block_format == "escape":
            from zipkv import escape                  # escape imports format only: no import circle
            heads = enable[:, kv].any(-1)                                # [P, H] page-heads packed
            if bool(heads.any()):
                flat = payload[:, kv][heads]                                # [n, pb] raw slots
                pool = torch.cat([flat.reshape(-1), flat.new_zeros(pb)])
                if dev.type == "cuda":                 # the Triton escape pack kernel (bit-identical to the reference)
                    from zipkv.kernels.pack_escape import pack_slots
                else:
                    pack_slots = escape.pack_slots
                b, sec = pack_slots(pool, torch.arange(flat.shape[0], device=dev) * pb, D, lay)
                payload[:, kv][heads] = pool[: flat.numel()].reshape(-1, pb)
                packed[:, kv][heads], second[:, kv][heads] = b, sec
        check[:, kv] = fmt.meta_check(packed[:, kv].contiguous(), lay, D)
    perm = physical_page_ids(P, seed, shuffle).to(dev)                 # logical page i -> physical id perm[i]
    phys_payload = torch.empty_like(payload)
    phys_payload[perm] = payload
    phys_packed = torch.empty_like(packed)
    phys_packed[perm] = packed
    phys_check = torch.empty_like(check)
    phys_check[perm] = check
    phys_second = torch.empty_like(second)
    phys_second[perm] = second
    comp = (phys_packed >> 7).bool()
    size = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).to(torch.int64)
    blk_off = torch.cumsum(size, -1) - size                            # inside the slot
    lists = 2 * (phys_second & 0x7F).to(torch.int64).sum(-1)           # [P, 2, H] escape list bytes (0: ZipFusion)
    if compact:
        used = (size.sum(-1) + (lists + 255) // 256 * 256).reshape(-1)  # [P*2*H], the list in whole 256-byte units
        slot = (torch.cumsum(used, 0) - used).reshape(P, 2, H)
        units = torch.arange(pb // 256, device=dev) < (used // 256)[:, None]
        pool = phys_payload.reshape(-1, pb // 256, 256)[units].reshape(-1)
    else:
        slot = torch.arange(P * 2 * H, device=dev, dtype=torch.int64).reshape(P, 2, H) * pb
        pool = phys_payload.reshape(-1)
    desc = ((slot[..., None] + blk_off) << 8) | phys_packed.to(torch.int64)
    indptr = torch.tensor([0] + npg, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    last = torch.tensor([x - T16 * (n - 1) for x, n in zip(lens, npg)], dtype=torch.int32, device=dev)
    escapes = None
    if block_format == "escape":
        from zipkv import escape
        escapes = escape.list_descriptors(slot + size.sum(-1), phys_second).contiguous()
    cache = PagedKVCache(pool.contiguous(), desc.contiguous(), D, k_layout, v_layout, phys_check, escapes)
    return cache, indptr, perm.to(torch.int32), last


def compress_cache_(cache: PagedKVCache, page_ids: torch.Tensor, *,
                    pages_per_program: int | None = None) -> PagedKVCache:
    """Compress raw full pages of ``cache`` in place with the Triton pack kernel
    (ZipFusion §III-D: the page id stays, its slot shrinks to a prefix). page_ids: int
    ``[n]`` physical ids whose page-heads are all raw; their descriptors (and check bytes) are updated."""
    from zipkv.kernels.pack import pack_into

    check_cache(cache)
    if not isinstance(page_ids, torch.Tensor) or page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_ids must be a 1-D int32/int64 tensor, got {getattr(page_ids, 'dtype', type(page_ids))} "
                         f"{tuple(getattr(page_ids, 'shape', ()))}")
    ids = page_ids.long().to(cache.desc.device)
    if ids.numel() == 0:
        return cache
    if int(ids.min()) < 0 or int(ids.max()) >= cache.num_pages:
        raise ValueError(f"page_ids must lie in [0, {cache.num_pages}), got range [{int(ids.min())}, {int(ids.max())}]")
    if ids.unique().numel() != ids.numel():
        raise ValueError("page_ids must not repeat")
    check_descriptors(cache, ids)
    d = cache.desc[ids]                                                # [n, 2, H, nb]
    slot = d[..., :1] >> 8
    raw_contig = (d >> 8) == slot + fmt.RAW_BLOCK_BYTES * torch.arange(cache.n_blocks, device=d.device)
    if bool(((d >> 7) & 1).any()) or not bool(raw_contig.all()):
        raise ValueError("compress_cache_: every page-head of page_ids must be raw (not yet compressed)")
    for kv, lay in ((0, cache.k_layout), (1, cache.v_layout)):
        off = slot[:, kv, :, 0].reshape(-1).contiguous()
        meta = pack_into(cache.pool, off, cache.pool, off, cache.head_dim, lay, src_packed=True,
                         pages_per_program=pages_per_program)
        m = fmt.PageMeta.from_packed(meta, lay, cache.head_dim)
        new = ((off[:, None] + m.block_offsets()) << 8) | meta.to(torch.int64)
        cache.desc[ids, kv] = new.reshape(ids.numel(), cache.kv_heads, cache.n_blocks)
        if cache.check is not None:
            cache.check[ids, kv] = fmt.meta_check(meta, lay, cache.head_dim).reshape(ids.numel(), cache.kv_heads, -1)
    return cache.refresh()


