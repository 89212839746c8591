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

Page kinds (:data:`PAGE_KINDS`, the values of :meth:`PagedKVCache.page_kinds`, one byte per
(page, kv head)): :data:`MIXED` (0), :data:`COMPRESSED` (1: every K and V block compressed),
:data:`RAW` (2: every block raw). The decode kernels' specialisations use the same numbers.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from zipkv import format as fmt

__all__ = ["PagedKVCache", "build_paged_cache", "compress_cache_", "physical_page_ids", "page_kinds_of",
           "PAGE_KINDS", "MIXED", "COMPRESSED", "RAW",
           "check_cache", "check_layouts", "check_descriptors"]

MIXED, COMPRESSED, RAW = 0, 1, 2
PAGE_KINDS = ("mixed", "compressed", "raw")
"""Names of the page kinds, indexed by their value in :meth:`PagedKVCache.page_kinds`."""


@dataclass
class PagedKVCache:
    """Paged KV cache whose page-heads may be compressed per block (see module docstring).

    pool: uint8 ``[pool_bytes]``; desc: int64 ``[num_pages, 2, kv_heads, n_blocks]``.
    """
    pool: torch.Tensor
    desc: torch.Tensor
    head_dim: int
    k_layout: str = "token"
    v_layout: str = "token"
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
        """Metadata of keys (kv=0) or values (kv=1): PageMeta ``[num_pages, kv_heads, n_blocks]``."""
        d = self.desc[:, kv]
        return fmt.PageMeta.from_packed((d & 0xFF).to(torch.uint8),
                                        (self.k_layout, self.v_layout)[kv], self.head_dim)

    def slot_offsets(self) -> torch.Tensor:
        """int64 ``[num_pages, 2, kv_heads]``: byte address of each page-head slot."""
        return self.desc[..., 0] >> 8

    def read_pages(self, page_ids: torch.Tensor | None = None):
        """Decode pages with ``zipkv.format.unpack``: ``(k, v)``, each bf16
        ``[len(page_ids), kv_heads, 16, head_dim]`` (all pages by default)."""
        ids = torch.arange(self.num_pages, device=self.desc.device) if page_ids is None else page_ids.long()
        pb = fmt.page_bytes(self.head_dim)
        off = self.slot_offsets()[ids]                                   # [n, 2, H]
        padded = torch.cat([self.pool, self.pool.new_zeros(pb)])        # compact slots may end early
        idx = off[..., None] + torch.arange(pb, device=off.device)
        slots = padded[idx]                                              # [n, 2, H, pb]
        out = []
        for kv in (0, 1):
            m = self.meta(kv)[ids]
            out.append(fmt.unpack(slots[:, kv], m))
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
        several caches' descriptors at once); None: computed here."""
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
        raw = 2 * self.num_pages * self.kv_heads * fmt.page_bytes(self.head_dim)

        def mixed(m):
            return float((m.compressed.any(-1) & ~m.compressed.all(-1)).float().mean())

        return dict(pool_bytes=self.pool.numel(), used_bytes=used, raw_bytes=raw,
                    frac_k=float(mk.compressed.float().mean()), frac_v=float(mv.compressed.float().mean()),
                    mixed_k=mixed(mk), mixed_v=mixed(mv))


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


def check_cache(cache):
    """TypeError/ValueError unless ``cache`` is a well-formed :class:`PagedKVCache` (types, shapes,
    alignment; no device sync)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    fmt._check_head_dim(cache.head_dim, "cache.head_dim")
    check_layouts(cache.k_layout, cache.v_layout, cache.head_dim, "cache.")
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


def check_descriptors(cache, page_ids: torch.Tensor):
    """ValueError naming the first page, KV head and block of ``page_ids`` (physical ids) whose block
    does not lie inside ``cache.pool`` at a multiple of 256 bytes (one device sync): a kernel would read
    past the pool."""
    if page_ids.numel() == 0:
        return
    d = cache.desc[page_ids.long()]                                    # [n, 2, H, nb]
    addr = d >> 8
    size = torch.where(((d >> 7) & 1).bool(), fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES)
    bad = (addr < 0) | (addr % 256 != 0) | (addr + size > cache.pool.numel())
    if bool(bad.any()):
        i, kv, h, j = (int(x) for x in bad.nonzero()[0])
        kind = "compressed" if size[i, kv, h, j] == fmt.PACKED_BLOCK_BYTES else "raw"
        raise ValueError(
            f"cache.desc: page {int(page_ids[i])}, kv head {h}, {('keys', 'values')[kv]} block {j}: a {kind} block "
            f"at byte address {int(addr[i, kv, h, j])} ({int(size[i, kv, h, j])} bytes) does not lie inside the pool "
            f"of {cache.pool.numel()} bytes at a multiple of 256")


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
                      seed: int = 0):
    """Build a :class:`PagedKVCache` and its CSR page table from contiguous K/V.

    k, v: bf16 ``[batch, kv_heads, T, head_dim]``; seq_lens: ``[batch]`` ints in 1..T
    (default T): request ``b`` uses its first ``seq_lens[b]`` tokens. Full pages are packed
    with ``zipkv.format.pack`` (partial last pages stay raw). compress: ``"eligible"``
    (every eligible block), ``"none"`` (all raw: the uncompressed baseline), a float ``f``
    (a seeded random fraction ``f`` of the eligible blocks), or a bool tensor
    ``[num_pages, 2, kv_heads, n_blocks]`` in logical page order (forcing the mix).
    shuffle: random physical page ids; compact: slots back to back at their packed size.
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
    enable = enable & full[:, None, None, None]
    pb = fmt.page_bytes(D)
    payload = torch.empty(P, 2, H, pb, dtype=torch.uint8, device=dev)
    packed = torch.empty(P, 2, H, nb, dtype=torch.uint8, device=dev)
    for kv, lay in ((0, k_layout), (1, v_layout)):
        pl, m = fmt.pack(pages[:, kv], lay, enable=enable[:, kv])
        payload[:, kv], packed[:, kv] = pl, m.packed()
    perm = physical_page_ids(P, seed, shuffle).to(dev)                 # logical page i -> physical id perm[i]
    phys_payload = torch.empty_like(payload)
    phys_payload[perm] = payload
    phys_packed = torch.empty_like(packed)
    phys_packed[perm] = packed
    comp = (phys_packed >> 7).bool()
    size = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).to(torch.int64)
    blk_off = torch.cumsum(size, -1) - size                            # inside the slot
    if compact:
        used = size.sum(-1).reshape(-1)                                # [P*2*H]
        slot = (torch.cumsum(used, 0) - used).reshape(P, 2, H)
        units = torch.arange(pb // 256, device=dev) < (used // 256)[:, None]
        pool = phys_payload.reshape(-1, pb // 256, 256)[units].reshape(-1)
    else:
        slot = torch.arange(P * 2 * H, device=dev, dtype=torch.int64).reshape(P, 2, H) * pb
        pool = phys_payload.reshape(-1)
    desc = ((slot[..., None] + blk_off) << 8) | phys_packed.to(torch.int64)
    indptr = torch.tensor([0] + npg, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    last = torch.tensor([x - T16 * (n - 1) for x, n in zip(lens, npg)], dtype=torch.int32, device=dev)
    cache = PagedKVCache(pool.contiguous(), desc.contiguous(), D, k_layout, v_layout)
    return cache, indptr, perm.to(torch.int32), last


def compress_cache_(cache: PagedKVCache, page_ids: torch.Tensor, *,
                    pages_per_program: int | None = None) -> PagedKVCache:
    """Compress raw full pages of ``cache`` in place with the Triton pack kernel
    (ZipFusion §III-D: the page id stays, its slot shrinks to a prefix). page_ids: int
    ``[n]`` physical ids whose page-heads are all raw; their descriptors are updated."""
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
    return cache.refresh()


