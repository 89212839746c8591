"""Decode attention over a paged, partly compressed KV cache, in FlashInfer's plan/run split
(ZipFusion §III-C).

* :func:`plan` ``(indptr, indices, last_page_len, cache, q_heads, ...)`` does every host-side step
  once per batch layout: validation (the page table's values and every used block descriptor, with
  ``validate=True``: one device sync), the kernel (from the cache's layouts), routing by page kind,
  the split count, the launch options and the workspace. It returns a :class:`DecodePlan`.
* :meth:`DecodePlan.run` ``(q, out=None)`` only launches: no host sync, no allocation (unless ``out``
  is None), so it can be captured in a CUDA graph. A plan stays valid while its page table and the
  cache's number of pages are unchanged (it refuses to run over a cache grown since): new tokens
  written into a request's last page (and ``last_page_len`` raised in place, up to 16) and pages
  compressed in place by :func:`zipkv.paged.compress_cache_` are seen by the next run or graph replay, because the kernels read the pool, the descriptors and the page kinds
  (updated in place) when they run. The one host-side decision that depends on the cache's contents
  is a single specialised launch for a *uniform* cache (every page all-compressed or all-raw); such
  a plan refuses to run once the cache's page kinds have been recomputed (``cache.version``), and
  ``routing="device"`` makes every plan route on the device instead (valid whatever gets compressed).
* :func:`decode_attention` is the one-call convenience: ``plan(...).run(q, out)``.

Checked and unchecked mode. ``plan(..., validate=True)`` (the default) reads the page table and every used
block descriptor once (one device sync) and rejects what the kernels cannot read safely or correctly: page ids
outside the cache, bad ``indptr``/``last_page_len``, blocks outside the pool, descriptors that do not match their
check bytes or do not lie back to back, page-heads that overlap (``zipkv.format``'s "Validation and checksums"
says what is and is not detected). Its runs then refuse (``ValueError``) to launch once ``indptr``, ``indices`` or
``cache.desc`` were written since -- by torch in place, seen through the tensors' version counters, read on the
host: no sync, nothing added to a captured CUDA graph -- unless ``cache.refresh()`` announced the descriptor change
(:func:`zipkv.paged.compress_cache_` does); ``last_page_len`` may be raised in place (up to 16: other values
written after ``plan`` are not seen, and are undefined behaviour). A graph replay does
not run Python, so it checks nothing: only the eager run and the capture do. Writes that bypass torch's version
counters (a kernel writing through a raw pointer, DLPack or numpy aliases, tensors made under
``torch.inference_mode``) are not seen. ``plan(..., validate=False)`` reads nothing and watches nothing (a serving
engine that rewrites its static page table in place between steps): **a bad page table or descriptor is then
undefined behaviour**, as in FlashInfer, whose kernels do not check page tables either -- the kernels read out of
bounds: the process may crash (a CUDA illegal address, a segfault in the interpreter), or the output be NaN or
silently wrong. :meth:`DecodePlan.validate` checks a plan's current table at a moment of the caller's choosing.

Kernels (:data:`KERNELS`): the Triton kernel (:mod:`zipkv.kernels.decode_triton`; token and channel
layouts, any head_dim, runs under ``TRITON_INTERPRET=1`` on the CPU) and the Gluon kernel
(:mod:`zipkv.kernels.decode_mma`; the mma layouts, CUDA only). Specialisations and routing use the
page kinds of :mod:`zipkv.paged` (:data:`zipkv.paged.PAGE_KINDS`).

The cache and its builders live in :mod:`zipkv.paged`; they are re-exported here.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from zipkv import format as fmt
from zipkv import paged
from zipkv.kernels import check_launchable, decode_mma, decode_triton
from zipkv.kernels.inputs import batch_mismatch, check_page_table, check_scale, check_values
from zipkv.kernels.decode_mma import MMA_LAUNCH
from zipkv.kernels.decode_triton import DEFAULT_LAUNCH, LAUNCH_KEYS, launch_config
from zipkv.kernels.tuning import TUNING_FILE
from zipkv.paged import PagedKVCache, build_paged_cache, compress_cache_, physical_page_ids

__all__ = ["plan", "split_count", "gluon_split_count", "DecodePlan", "decode_attention", "KERNELS", "PagedKVCache",
           "build_paged_cache", "compress_cache_", "physical_page_ids", "launch_config", "DEFAULT_LAUNCH", "LAUNCH_KEYS",
           "TUNING_FILE", "MMA_LAUNCH"]

KERNELS = ("triton", "gluon")
"""The decode kernels: ``"triton"`` (token/channel layouts) and ``"gluon"`` (the mma layouts)."""
ROUTINGS = ("auto", "device")


def kernel_for(cache: PagedKVCache) -> str:
    """Which kernel of :data:`KERNELS` reads ``cache``: the Gluon kernel for the mma layouts."""
    return "gluon" if cache.k_layout in fmt.MMA_LAYOUTS else "triton"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes")


def _launches(cache, path: str, routing: str):
    """Kernel launches of a plan: list of ``(page kind, routed)``. A uniform cache: one launch of its
    kind's specialisation. Otherwise the Gluon kernel's MIXED specialisation takes every page in one
    launch; the Triton kernel makes three routed launches (each program first classifies its (request,
    kv head) from the page kinds and works only if the class is its own)."""
    if path not in ("auto", "mixed"):
        raise ValueError(f"path must be 'auto' or 'mixed', got {path!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    pipelined = (cache.k_layout, cache.v_layout) in (("token", "token"), fmt.MMA_LAYOUTS)
    if path == "mixed" or not pipelined:
        return [(paged.MIXED, False)]
    kind = cache.kind() if routing == "auto" else "mixed"
    if kind == "compressed":
        return [(paged.COMPRESSED, False)]
    if kind == "raw":
        return [(paged.RAW, False)]
    if kernel_for(cache) == "gluon":
        return [(paged.MIXED, False)]
    return [(paged.COMPRESSED, True), (paged.RAW, True), (paged.MIXED, True)]


@dataclass
class DecodePlan:
    """What :func:`plan` worked out for one batch layout; :meth:`run` launches it.

    ``kernel`` (of :data:`KERNELS`), ``launches`` (``(page kind name, routed)`` per launch),
    ``num_splits``, ``softmax_scale``, ``configs`` (launch options per launch) and the workspace.
    """
    cache: PagedKVCache = field(repr=False)
    indptr: torch.Tensor = field(repr=False)
    indices: torch.Tensor = field(repr=False)
    last_page_len: torch.Tensor = field(repr=False)
    q_heads: int
    kernel: str
    num_splits: int
    softmax_scale: float
    configs: list
    _launches: list = field(repr=False)
    _kinds: torch.Tensor = field(repr=False)
    _ws: dict = field(repr=False)
    _kinds_version: int | None = field(repr=False)
    _fp32: bool = field(repr=False)
    _interp: bool = field(repr=False)
    _watched: tuple | None = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return self.indptr.shape[0] - 1

    @property
    def launches(self) -> list:
        return [(paged.PAGE_KINDS[k], routed) for k, routed in self._launches]

    def validate(self) -> "DecodePlan":
        """Check this plan's page table and the descriptors of its pages as they are now, as ``plan(...,
        validate=True)`` does (one device sync; not inside a CUDA graph capture), and from now on refuse to run
        once they are written (module docstring). ``ValueError`` naming what is wrong."""
        paged.check_cache(self.cache)
        check_values(self.cache, self.indptr, self.indices, self.last_page_len)
        self._watched = _watch(self.indptr, self.indices, self.cache)
        return self

    def run(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` (bf16 ``[batch, q_heads, head_dim]``) over the planned cache into ``out``
        (bf16, same shape; allocated if None). Launches only: no host sync. A plan made with ``validate=True``
        first compares the version counters of ``indptr``, ``indices`` and ``cache.desc`` with those it
        recorded (host integers) and raises ``ValueError`` if they were written since (module docstring); with
        ``validate=False`` a bad page table is undefined behaviour."""
        cache = self.cache
        shape = (self.batch, self.q_heads, cache.head_dim)
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dtype != torch.bfloat16:
            raise TypeError(f"q must have dtype torch.bfloat16, got {q.dtype}")
        if q.dim() == 3 and q.shape[0] != shape[0]:
            raise ValueError(batch_mismatch(q.shape[0], self.batch + 1))
        if tuple(q.shape) != shape:
            raise ValueError(f"q must have shape [batch, q_heads, head_dim] = {list(shape)} (the plan's), "
                             f"got {tuple(q.shape)}")
        if not q.is_contiguous():
            raise ValueError(f"q must be contiguous, got stride {q.stride()} for shape {tuple(q.shape)}")
        if q.device != cache.pool.device:
            raise ValueError(f"q is on {q.device}, the cache on {cache.pool.device}")
        if out is None:
            out = torch.empty_like(q)
        elif (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != q.shape
              or not out.is_contiguous() or out.device != q.device):
            got = (f"{'a contiguous' if out.is_contiguous() else 'a non-contiguous'} {out.dtype} tensor "
                   f"{tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"out must be a contiguous bf16 tensor {tuple(q.shape)} on {q.device}, got {got}")
        if self._kinds_version is not None and cache.version != self._kinds_version:
            raise ValueError("the cache's page kinds changed since this plan chose its single specialised launch "
                             "(a uniform cache): plan again, or plan with routing='device'")
        if not cache.holds_kinds(self._kinds):
            raise ValueError("the cache's number of pages changed since this plan was made (its page kinds were "
                             "recomputed into a new tensor): plan again")
        if self._watched is not None:
            self._watched = _check_watched(self._watched, self.indptr, self.indices, cache)
        if self.batch == 0:
            return out
        qk_scale = self.softmax_scale * math.log2(math.e)
        if self.kernel == "gluon":
            if cache.escapes is not None:            # pages in the escape format: the variant that reads the lists
                from zipkv.kernels import decode_escape
                return decode_escape.launch(q, cache, self.indptr, self.indices, self.last_page_len, self._launches,
                                            self.num_splits, qk_scale, out, self._ws, self.configs[0]["stages"],
                                            self.configs[0].get("maxnreg") or 0)
            return decode_mma.launch(q, cache, self.indptr, self.indices, self.last_page_len, self._launches,
                                     self.num_splits, qk_scale, out, self._ws, self.configs[0]["stages"],
                                     self.configs[0].get("maxnreg") or 0)
        return decode_triton.launch(q, cache, self.indptr, self.indices, self.last_page_len, self._kinds,
                                    self._launches, self.configs, self.num_splits, qk_scale, out, self._ws,
                                    self._fp32, self._interp)


WAVE_FILL = 0.9
"""Least share of the resident program slots that the Triton kernel's last wave should fill, and of the wanted
program slots that the Gluon kernel's split count should fill before more splits are weighed (:func:`split_count`)."""
GLUON_EXTRA_SPLITS = 2
"""Split counts past ``ceil(slots / programs)`` that :func:`split_count` weighs for the Gluon kernel when too few
programs would run."""
FEW_REQUESTS_PROGRAMS_PER_SM = 8
"""With fewer (request, KV head) pairs than SMs (few requests), the Gluon kernel's split count targets at most this
many programs per SM, whatever its specialisation's tuned target: there the split count alone sets the program count,
and past ~8 one-warp programs per SM more, shorter splits only cost (H200 at 55b3dff, two-level merge, Llama-3.1-8B
shape, 32768 tokens, measured mix: 1 request at 64 splits, 512 programs, 39.7 us; at 214, the tuned 16 per SM capped
at the 13 resident, 53.0 us; 4 requests at 32 splits, 1,024 programs, 109.6 us; at 53, 158.1 us; at 64, 138.2 us;
the all-compressed path at its tuned 8 per SM within 2 % of the best of 16/32/64 splits at both;
``results/paper/zipfusion_kernel_merge_tree_ab.csv``)."""


def split_count(programs: int, slots: int, max_splits: int, *, fill_waves: bool = True,
                resident: int | None = None) -> int:
    """The default split-KV factor for ``programs`` (request, KV head) pairs on ``slots`` programs
    (``programs_per_sm`` x SMs), at most ``max_splits`` (tiles per request): first enough splits to fill the slots,
    ``ceil(slots / programs)``; then (``fill_waves``: the Triton kernel, whose ``programs_per_sm`` is what is
    resident) up to three more, the first whose waves are at least :data:`WAVE_FILL` full (all programs do equal
    work, so a part-filled last wave costs a whole one), else the fullest. At Llama-8B's 8 KV heads and batch 46,
    368 programs on the H200's 264 slots fill 1.39 waves with one split and 2.79 with two. The Gluon kernel's
    one-warp programs are resident many more to an SM: ``fill_waves=False``, and with ``resident`` (programs the
    GPU holds at once) the split count in 1..base with the fewest waves per split, the fewest splits of equals:
    a second, part-filled wave of one-warp programs runs at a fraction of the bandwidth (H200 at 580390f, batch
    96 x 8 KV heads, 2 splits: 1,536 programs on 1,320 resident, 10 per SM, the mixed and raw specialisations
    0.85x and 0.73x FlashInfer; the all-compressed one, 13 per SM, 1.30x). Where that choice fills less than
    :data:`WAVE_FILL` of ``slots``, up to :data:`GLUON_EXTRA_SPLITS` more splits are weighed the same way: too
    few programs leave bandwidth unused (H200 at 20edefd, measured mix, 8192 tokens: batch 96, one split, 768
    programs, 654 us; three splits, 2,304 programs, 602 us), while more splits past a filled choice were slower
    (batch 32: 4 splits 210 us, 5 splits 261 us; batch 57: 2 splits 375 us, 5 splits 421 us)."""
    base = max(1, min(max_splits, math.ceil(slots / programs)))
    if not fill_waves:
        if resident is None:
            return base

        def best(most):
            return min(range(1, most + 1), key=lambda s: (Fraction(math.ceil(programs * s / resident), s), s))
        first = best(base)
        if programs * first >= WAVE_FILL * slots:
            return first
        return best(min(max_splits, base + GLUON_EXTRA_SPLITS))

    def fill(s):
        return round(programs * s / (slots * math.ceil(programs * s / slots)), 9)     # equal fills compare equal
    tried = range(base, min(max_splits, base + 3) + 1)
    return next((s for s in tried if fill(s) >= WAVE_FILL), max(tried, key=lambda s: (fill(s), -s)))


def gluon_split_count(kind: int, head_dim: int, programs: int, pages: int, gpu_name: str | None, sms: int,
                      shared_per_sm: int | None = None, launch: dict | None = None, group: int = 1) -> int:
    """The Gluon kernel's default split-KV factor, what :func:`plan` takes: :func:`split_count` for ``programs``
    (request, KV head) pairs of about ``pages`` pages each (one operand tile per page, per two at head_dim 64),
    launching the specialisation ``kind`` (an index of :data:`zipkv.paged.PAGE_KINDS`) with its launch options on
    ``gpu_name`` (tuned, :func:`zipkv.kernels.decode_mma.launch_config`, under ``launch``'s overrides; its
    ``programs_per_sm`` target at most the programs an SM holds) and ``sms``
    SMs of ``shared_per_sm`` bytes of shared memory (default the H200's), ``group`` query heads per KV head."""
    cfg = {**decode_mma.launch_config(paged.PAGE_KINDS[kind], gpu_name, head_dim), **(launch or {})}
    tiles = max(1, pages // (2 if head_dim == 64 else 1))
    per_sm = decode_mma.resident_per_sm(kind, cfg["stages"], shared_per_sm, group)
    # No more wanted slots than the SM holds: a wider target only adds splits that start a second wave
    # (H200 at ec5d2c1, measured mix at 8192 x 57, target 16 per SM with 13 resident: 7 splits; the sweep's
    # fastest, 3 splits, is what the capped target gives).
    target = min(cfg["programs_per_sm"], per_sm)
    if programs < sms:
        target = min(target, FEW_REQUESTS_PROGRAMS_PER_SM)
    return split_count(programs, target * sms, tiles, fill_waves=False, resident=per_sm * sms)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place torch op on it or a view of it), None where it has
    none (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _watch(indptr, indices, cache) -> tuple:
    """What a checked plan compares in :meth:`DecodePlan.run`: versions of the page table and the descriptors."""
    return (_version(indptr), _version(indices), cache.desc, _version(cache.desc), cache.version)


def _check_watched(watched, indptr, indices, cache) -> tuple:
    """ValueError if what :func:`_watch` recorded was written since; returns the record to keep (the descriptors
    as they are after a ``cache.refresh()``, which announces their changes)."""
    ip, idx, desc, desc_v, cache_v = watched
    for name, t, v in (("indptr", indptr, ip), ("indices", indices, idx)):
        if v is not None and _version(t) != v:
            raise ValueError(f"{name} was written since plan(..., validate=True) checked it ({name}._version {v} -> "
                             f"{_version(t)}): plan again, or call plan.validate(); a page table rewritten in place "
                             f"between runs needs plan(..., validate=False), which trusts it")
    if cache.version != cache_v:
        return (ip, idx, cache.desc, _version(cache.desc), cache.version)
    if cache.desc is not desc:
        raise ValueError("cache.desc was replaced since plan(..., validate=True) checked it, and cache.refresh() was "
                         "not called: plan again, or call plan.validate()")
    if desc_v is not None and _version(desc) != desc_v:
        raise ValueError(f"cache.desc was written since plan(..., validate=True) checked it (cache.desc._version "
                         f"{desc_v} -> {_version(desc)}) and cache.refresh() was not called: plan again, call "
                         f"plan.validate(), or cache.refresh() after changing descriptors on purpose")
    return watched


MAX_EMPTY_SPLITS = 64
"""The largest ``num_splits`` :func:`plan` takes beyond the page table's page count (splits past it are empty)."""


def plan(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, cache: PagedKVCache,
         q_heads: int, *, softmax_scale: float | None = None, num_splits: int | None = None,
         pages_per_tile: int | None = None, validate: bool = True, path: str = "auto",
         routing: str = "auto", launch: dict | None = None) -> DecodePlan:
    """Plan decode attention (one new token per request) for one batch layout.

    Page table in FlashInfer's CSR form (int32, on the cache's device; every request has >= 1 page):
    ``indptr [batch + 1]``, ``indices [nnz_pages]``, ``last_page_len [batch]`` in 1..16.
    q_heads: query heads (a multiple of ``cache.kv_heads``; query head ``i`` reads KV head
    ``i // (q_heads / kv_heads)``). softmax_scale: default ``1/sqrt(head_dim)``. num_splits: split-KV
    factor (default on the GPU: about ``programs_per_sm`` programs per SM, for the Triton kernel in well-filled
    waves, for the Gluon kernel without a part-filled second wave of resident programs (:func:`split_count`);
    1 on the CPU).
    pages_per_tile: pages per inner tile of the Triton kernel (default its launch option on the GPU, 1
    interpreting). validate: also check the page table's values and every used block descriptor (one
    device sync: page ids in range, blocks inside the pool, back to back, matching their check bytes, no
    overlapping page-heads; ``zipkv.format``'s "Validation and checksums"), and make the plan's runs refuse to
    launch once ``indptr``, ``indices`` or ``cache.desc`` were written since (module docstring). The structure
    (types, shapes, devices) is always checked. ``validate=False`` reads and watches nothing: **a bad page table
    or descriptor (a page id of -1 or past the pool, ``indices`` changed to such, a corrupted descriptor) is then
    undefined behaviour** -- an out-of-bounds read that may crash the process, or NaN or wrong outputs -- as in
    FlashInfer; use it where the caller builds the table itself (a serving engine), and
    :meth:`DecodePlan.validate` to check it when in doubt.
    path: ``"auto"`` routes each (request, kv head) to a specialisation -- all-compressed (every page but
    the last all-compressed, K and V), all-raw, or mixed -- from the cache's page kinds: a uniform cache
    gets one launch of its specialisation; otherwise the Gluon kernel one launch of its mixed
    specialisation (any page), the Triton kernel three routed launches. ``"mixed"`` sends everything
    through the mixed specialisation; channel layouts always use it. routing: ``"auto"`` as above,
    ``"device"`` never the single uniform launch (the plan stays valid whatever gets compressed).
    launch: overrides of the launch options (keys :data:`LAUNCH_KEYS`) over the GPU's tuned ones
    (:mod:`zipkv.kernels.tuning`); the Gluon kernel reads ``programs_per_sm``, ``stages`` (its ring slots)
    and ``maxnreg`` only, default :data:`MMA_LAUNCH` (:func:`zipkv.kernels.decode_mma.launch_config`).
    """
    paged.check_cache(cache)
    D, HKV = cache.head_dim, cache.kv_heads
    if isinstance(q_heads, bool) or not isinstance(q_heads, numbers.Integral) or q_heads <= 0 or q_heads % HKV:
        raise ValueError(f"q_heads must be a positive multiple of kv_heads={HKV}, got {q_heads!r}")
    B = check_page_table(cache, indptr, indices, last_page_len)
    device = cache.pool.device
    scale = check_scale(softmax_scale, D)
    if launch is not None and (not isinstance(launch, dict) or set(launch) - set(LAUNCH_KEYS)):
        raise ValueError(f"launch must be a dict with keys from {LAUNCH_KEYS}, got {launch!r}")
    given = [(f"launch[{k!r}]", k, x) for k, x in (launch or {}).items()]
    for label, name, x in given + ([("pages_per_tile", "pages_per_tile", pages_per_tile)] if pages_per_tile is not None else []):
        least, power_of_two = (0, False) if name == "maxnreg" else (1, name in ("num_warps", "pages_per_tile"))
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < least or (power_of_two and x & (x - 1)):
            raise ValueError(f"{label} must be an int >= {least}{' and a power of two' if power_of_two else ''}"
                             f"{' (0: no register cap)' if name == 'maxnreg' else ''}, got {x!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be >= 1, got {num_splits!r}")
    fmt._check_flag(validate, "validate")
    if validate and B:
        check_values(cache, indptr, indices, last_page_len)
    interp = _interpreting()
    gpu = device.type == "cuda" and not interp
    launches = _launches(cache, path, routing)
    kernel = kernel_for(cache)
    if cache.escapes is not None and kernel != "gluon":
        raise ValueError(f"cache.escapes is set (pages in the escape format, zipkv.escape): the fused kernel that reads "
                         f"escape lists is the Gluon kernel of the mma layouts (k_mma/v_mma, a CUDA GPU); this cache "
                         f"has the layouts {(cache.k_layout, cache.v_layout)} -- use the mma layouts, or "
                         f"zipkv.kernels.reference.decode_attention_reference")
    gpu_name = torch.cuda.get_device_name(device) if gpu else None
    if kernel == "gluon":
        configs = [{**decode_mma.launch_config(paged.PAGE_KINDS[launches[0][0]], gpu_name, D), **(launch or {})}]
        if not gpu:
            raise ValueError(f"the k_mma/v_mma layouts are decoded by a Gluon kernel that needs a CUDA GPU "
                             f"(the cache is on {device}{', TRITON_INTERPRET=1' if interp else ''}); "
                             f"use the 'token' layouts on the CPU")
        if q_heads // HKV > decode_mma.MAX_GROUP[D]:
            raise ValueError(f"q_heads: the mma-layout kernel takes at most {decode_mma.MAX_GROUP[D]} query heads per "
                             f"KV head at head_dim {D}, got {q_heads // HKV} ({q_heads} q heads, {HKV} kv heads)")
        if configs[0]["stages"] < 2:
            raise ValueError(f"launch['stages'] (ring slots of the mma-layout kernel) must be >= 2, "
                             f"got {configs[0]['stages']}")
        ppt = 1
    else:
        check_launchable(decode_triton._decode_kernel, device, "the cache")
        configs = []
        for kind, _ in launches:
            cfg = {**launch_config(paged.PAGE_KINDS[kind], gpu_name), **(launch or {})}
            cfg["pages_per_tile"] = pages_per_tile or (1 if interp else cfg["pages_per_tile"])
            if cfg["pages_per_tile"] < 1 or cfg["pages_per_tile"] & (cfg["pages_per_tile"] - 1):
                raise ValueError(f"pages_per_tile must be a power of two >= 1, got {cfg['pages_per_tile']}")
            configs.append(cfg)
        ppt = configs[0]["pages_per_tile"]
    if num_splits is None:
        if gpu and B:
            props = torch.cuda.get_device_properties(device)
            sms = props.multi_processor_count
            if kernel == "gluon":
                num_splits = gluon_split_count(launches[0][0], D, B * HKV, indices.numel() // B, gpu_name, sms,
                                               getattr(props, "shared_memory_per_multiprocessor", None), launch,
                                               q_heads // HKV)
            else:
                num_splits = split_count(B * HKV, configs[0]["programs_per_sm"] * sms,
                                         max(1, indices.numel() // B // ppt))
        else:
            num_splits = 1
    elif num_splits > max(MAX_EMPTY_SPLITS, indices.numel()):
        # a split past the page count reads nothing but still takes a partial result in the workspace
        raise ValueError(f"num_splits must be at most max({MAX_EMPTY_SPLITS}, the page table's {indices.numel()} pages), "
                         f"got {num_splits}")
    kinds = cache.page_kinds()
    fp32 = not gpu
    if kernel == "gluon":
        ws = decode_mma.workspace(B, q_heads, HKV, num_splits, device, D)
    else:
        ws = decode_triton.workspace(B, q_heads, D, num_splits, fp32, device)
    uniform = len(launches) == 1 and launches[0][0] != paged.MIXED
    return DecodePlan(cache, indptr, indices, last_page_len, int(q_heads), kernel, int(num_splits), scale, configs,
                      launches, kinds, ws, cache.version if uniform else None, fp32, interp,
                      _watch(indptr, indices, cache) if validate else None)


def decode_attention(q: torch.Tensor, cache: PagedKVCache, indptr: torch.Tensor,
                     indices: torch.Tensor, last_page_len: torch.Tensor, *,
                     softmax_scale: float | None = None, num_splits: int | None = None,
                     pages_per_tile: int | None = None, out: torch.Tensor | None = None,
                     validate: bool = True, path: str = "auto", launch: dict | None = None) -> torch.Tensor:
    """Decode attention of one new token per request over a paged, partly compressed cache, in one
    call: :func:`plan` then :meth:`DecodePlan.run` (same arguments; ``q`` bf16 ``[batch, q_heads,
    head_dim]``). For repeated steps over one batch layout (and CUDA graphs), plan once and run.
    validate (default): check the page table and the used descriptors first (one device sync; :func:`plan`);
    ``validate=False``: a bad page table or descriptor is undefined behaviour (a crash, NaN or wrong output).
    Returns bf16 ``[batch, q_heads, head_dim]``."""
    paged.check_cache(cache)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must have dtype torch.bfloat16, got {q.dtype}")
    D, HKV = cache.head_dim, cache.kv_heads
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % HKV or q.shape[1] == 0:
        raise ValueError(f"q must have shape [batch, q_heads, {D}] with q_heads a multiple of "
                         f"kv_heads={HKV}, got {tuple(q.shape)}")
    if isinstance(indptr, torch.Tensor) and indptr.dim() == 1 and indptr.shape[0] != q.shape[0] + 1:
        raise ValueError(batch_mismatch(q.shape[0], indptr.shape[0]))
    return plan(indptr, indices, last_page_len, cache, q.shape[1], softmax_scale=softmax_scale, num_splits=num_splits,
                pages_per_tile=pages_per_tile, validate=validate, path=path, launch=launch).run(q, out)
