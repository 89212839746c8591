"""Offline look at the compiled kernels: registers, spills, shared memory, async copies.

Compiles a kernel with Triton's own compiler for a chosen GPU (default the H200: sm_90a)
on any machine -- no GPU needed -- and runs the ``ptxas`` bundled with Triton on its PTX
with ``-v`` to read what the assembler allocated. This is how the book can say *why* a
kernel variant is slow without a GPU run: a register count that halves occupancy, spills
(local-memory traffic), or a software pipeline that was not created (no ``cp.async``).

    >>> from zipkv.kernels import kernel_info as ki
    >>> ki.decode_attention_info(path="compressed", pages_per_tile=4, num_warps=4)
    {'kernel': '_decode_kernel', 'registers': ..., 'spill_stores': 0, ...}

Must run *without* ``TRITON_INTERPRET=1`` (the interpreter replaces the compiler); use a
fresh process, e.g. ``TRITON_INTERPRET=0 python -c "from zipkv.kernels import kernel_info as ki;
print(ki.table())"``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

from zipkv.kernels.occupancy import programs_per_sm

__all__ = ["compile_info", "decode_attention_info", "decode_mma_info", "pack_info", "table", "table_in_subprocess"]


def _ptxas() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptxas_usage(ptx: str, arch: str) -> dict:
    """Run the bundled ptxas -v on ``ptx``: registers, stack frame, spill bytes."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(), "-v", f"--gpu-name={arch}", src, "-o", dst],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"ptxas failed:\n{log}")

    def grab(pattern, default=0):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else default

    return dict(registers=grab(r"Used (\d+) registers"),
                stack_bytes=grab(r"(\d+) bytes stack frame"),
                spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"),
                ptxas_log=log)


def compile_info(fn, signature: dict, constexprs: dict, *, num_warps: int = 4, num_stages: int = 1,
                 arch: int = 90, divisible: tuple = (), keep_asm: bool = False, **options) -> dict:
    """Compile the ``@triton.jit`` function ``fn`` for ``cuda:arch`` and report its resources.

    signature: argument name -> Triton type string (``"*bf16"``, ``"i32"``, ``"fp32"`` ...)
    for every non-constexpr argument; constexprs: name -> value. divisible: indices of
    arguments known to be multiples of 16 (pointers / ints), as the launcher would specialise.
    Returns registers per thread, spill stores/loads and stack bytes (ptxas), static+dynamic
    shared memory bytes, and counts read off the TTGIR/PTX: async copies (``cp.async``:
    Triton's software pipeline), shared-memory buffers, layout conversions, vector loads,
    mma instructions, barriers. With ``keep_asm`` the TTGIR and PTX are returned too.
    """
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes"):
        raise RuntimeError("compile_info needs the real compiler: run without TRITON_INTERPRET=1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in signature:
            sig[name] = signature[name]
        else:
            raise ValueError(f"no type for argument {name!r} of {fn.__name__}")
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn=fn, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    usage = _ptxas_usage(ptx, sm)
    info = dict(kernel=fn.__name__, arch=sm, num_warps=num_warps, num_stages=num_stages,
                registers=usage["registers"], spill_stores=usage["spill_stores"],
                spill_loads=usage["spill_loads"], stack_bytes=usage["stack_bytes"],
                shared_bytes=int(c.metadata.shared),
                async_copies_ttgir=ttgir.count("async_copy_global_to_local"),
                cp_async_ptx=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                smem_buffers=ttgir.count("ttg.local_alloc"),
                convert_layouts=ttgir.count("ttg.convert_layout"),
                ld_global_v4=len(re.findall(r"ld\.global[^ \n]*\.v4", ptx)),
                ld_global_v2=len(re.findall(r"ld\.global[^ \n]*\.v2", ptx)),
                ld_global=len(re.findall(r"ld\.global", ptx)),
                st_global=len(re.findall(r"st\.global", ptx)),
                mma=ptx.count("mma.sync"), wgmma=ptx.count("wgmma.mma_async"),
                barriers=ptx.count("bar.sync"), shuffles=ptx.count("shfl.sync"),
                ptx_instructions=len(re.findall(r"^\s+[a-z@][^\n]*;\s*$", ptx, re.M)))
    if keep_asm:
        info.update(ttgir=ttgir, ptx=ptx)
    return info


_DECODE_SIG = {"q_ptr": "*bf16", "pool_ptr": "*i32", "desc_ptr": "*i64", "indptr_ptr": "*i32",
               "indices_ptr": "*i32", "last_ptr": "*i32", "kind_ptr": "*u8", "out_ptr": "*bf16",
               "part_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}


def decode_attention_info(path: str = "compressed", *, q_heads: int = 32, kv_heads: int = 8,
                          head_dim: int = 128, pages_per_tile: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, splits: int = 2, route: bool = False,
                          k_layout: str = "token", v_layout: str = "token", arch: int = 90,
                          maxnreg: int | None = -1, gpu_name: str = "NVIDIA H200",
                          keep_asm: bool = False) -> dict:
    """Resources of one decode-attention specialisation (``path``: ``"compressed"``,
    ``"raw"`` or ``"mixed"``) at a given shape, compiled as :func:`decode_attention` would
    launch it on the GPU (bf16, tensor-core dots). Defaults: Llama-3.1-8B shapes, the
    launch options of the path on ``gpu_name`` (:func:`zipkv.kernels.decode_triton.launch_config`)."""
    import triton

    from zipkv import format as fmt
    from zipkv import paged
    from zipkv.kernels import decode_triton as dt

    p = paged.PAGE_KINDS.index(path)
    tune = dt.launch_config(path, gpu_name)
    pages_per_tile = tune["pages_per_tile"] if pages_per_tile is None else pages_per_tile
    G = q_heads // kv_heads
    cst = dict(HKV=kv_heads, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=head_dim,
               K_LAYOUT=fmt.LAYOUTS.index(k_layout), V_LAYOUT=fmt.LAYOUTS.index(v_layout),
               PPT=pages_per_tile, SPLITS=splits, FP32=False, PATH=p, ROUTE=route,
               STAGES=tune["stages"] if num_stages is None else num_stages)
    maxnreg = tune.get("maxnreg") if maxnreg == -1 else maxnreg
    info = compile_info(dt._decode_kernel, _DECODE_SIG, cst,
                        num_warps=tune["num_warps"] if num_warps is None else num_warps,
                        num_stages=cst["STAGES"], arch=arch, divisible=tuple(range(10)),
                        keep_asm=keep_asm, **({"maxnreg": maxnreg} if maxnreg else {}))
    info.update(path=path, pages_per_tile=pages_per_tile, head_dim=head_dim, route=route,
                maxnreg=maxnreg)
    return info


def pack_info(head_dim: int = 128, layout: str = "token", *, pages_per_program: int | None = None,
              num_warps: int | None = None, arch: int = 90, keep_asm: bool = False) -> dict:
    """Resources of the pack kernel as :func:`zipkv.kernels.pack.pack_into` launches it on
    the GPU (plain source pages)."""
    from zipkv import format as fmt
    from zipkv.kernels import pack as pk

    cst, warps = pk._launch_config(head_dim, pages_per_program, gpu=True)
    cst.update(D=head_dim, LAYOUT=fmt.LAYOUTS.index(layout), SRC_PACKED=False)
    sig = {"src_ptr": "*i32", "src_off_ptr": "*i64", "dst_ptr": "*i32", "dst_off_ptr": "*i64",
           "meta_ptr": "*u8", "n_pages": "i32"}
    info = compile_info(pk._pack_kernel, sig, cst, num_warps=num_warps or warps, arch=arch,
                        divisible=(0, 1, 2, 3, 4), keep_asm=keep_asm)
    info.update(head_dim=head_dim, layout=layout, **{k.lower(): v for k, v in cst.items()
                                                     if k not in ("D", "LAYOUT", "SRC_PACKED")})
    return info


def decode_mma_info(path: str = "compressed", *, q_heads: int = 32, kv_heads: int = 8, splits: int = 2,
                    slots: int | None = None, head_dim: int = 128, maxnreg: int | None = None, arch: int = 90,
                    gpu_name: str = "NVIDIA H200", keep_asm: bool = False) -> dict:
    """Resources of the Gluon decode kernel (:mod:`zipkv.kernels.decode_mma`, one warp): ``path`` a page
    kind of :data:`zipkv.paged.PAGE_KINDS` (``"compressed"``, ``"raw"`` or ``"mixed"``: its pipelined
    specialisation), ``slots`` ring slots and ``maxnreg`` (default: the path's launch options on ``gpu_name``,
    :func:`zipkv.kernels.decode_mma.launch_config`, as :func:`zipkv.kernels.decode_attention.plan` launches it)."""
    from zipkv import paged
    from zipkv.kernels import decode_mma as dm

    if path not in paged.PAGE_KINDS:
        raise ValueError(f"path must be one of {paged.PAGE_KINDS}, got {path!r}")
    sig = {"q_ptr": "*bf16", "pool_ptr": "*u8", "desc_ptr": "*i64", "indptr_ptr": "*i32", "indices_ptr": "*i32",
           "last_ptr": "*i32", "part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32",
           "qk_scale": "fp32"}
    tune = dm.launch_config(path, gpu_name, head_dim)
    stages = slots or tune["stages"]
    maxnreg = tune["maxnreg"] if maxnreg is None else maxnreg
    cst = dict(HKV=kv_heads, G=q_heads // kv_heads, SPLITS=splits, KIND=paged.PAGE_KINDS.index(path), SLOTS=stages,
               HD=head_dim, NQ=dm.query_columns(q_heads // kv_heads), **dm.merge_constants(splits))
    info = compile_info(dm._pipelined_kernel, sig, cst, num_warps=1, num_stages=stages, arch=arch,
                        divisible=tuple(range(9)), keep_asm=keep_asm, **({"maxnreg": maxnreg} if maxnreg else {}))
    info.update(path=path, head_dim=head_dim)
    return info


def table(configs=None):
    """A small pandas table of :func:`decode_attention_info` for the three paths at the
    benchmark shape (pages_per_tile 4 and 8), :func:`decode_mma_info` for the Gluon kernel's three
    and :func:`pack_info`."""
    import pandas as pd

    configs = configs or [dict(path=p, pages_per_tile=t) for p in ("compressed", "raw", "mixed")
                          for t in (4, 8)]
    rows = [decode_attention_info(**c) for c in configs]
    rows += [decode_mma_info(p) for p in ("compressed", "raw", "mixed")] + [pack_info()]
    cols = ["kernel", "path", "pages_per_tile", "num_warps", "num_stages", "registers", "spill_stores",
            "spill_loads", "stack_bytes", "shared_bytes", "cp_async_ptx", "ld_global_v4"]
    return pd.DataFrame(rows).reindex(columns=cols)


def table_in_subprocess(timeout: float = 600):
    """:func:`table` computed in a fresh Python process without the Triton interpreter, so it can be
    called from a session where ``TRITON_INTERPRET=1`` (CPU notebooks); adds ``programs_per_sm``."""
    import io
    import sys

    import pandas as pd

    env = dict(os.environ, TRITON_INTERPRET="0")
    code = "import sys; from zipkv.kernels.kernel_info import table; table().to_csv(sys.stdout, index=False)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the kernels offline failed:\n{done.stderr[-3000:]}")
    frame = pd.read_csv(io.StringIO(done.stdout))
    frame["programs_per_sm"] = [programs_per_sm(r, w, s) for r, w, s in
                                zip(frame.registers, frame.num_warps, frame.shared_bytes)]
    return frame
