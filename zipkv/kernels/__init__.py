"""Triton kernels (one file per op), the Gluon decode kernel of the mma layouts
(``decode_mma.py``, CUDA only) and their fp32 torch references (``reference.py``).

Launchers validate inputs and raise ``ValueError``/``TypeError``; kernels never see bad input.
Where a launcher takes ``validate=False`` (:func:`~zipkv.kernels.decode_attention.plan`,
:func:`~zipkv.kernels.pack.pack_into`) it skips reading the values of its index inputs (page tables,
descriptors, offsets): bad ones are then **undefined behaviour** -- the kernels read and write out of bounds,
which may crash the process or give NaN or silently wrong results (FlashInfer's kernels make the same
contract). Keep ``validate=True`` unless the caller built those tensors itself.

**On a CPU** the Triton kernels run only in Triton's interpreter, which Triton chooses from the
environment variable ``TRITON_INTERPRET=1`` when a kernel module is imported. Importing zipkv
never sets it (a library does not change its user's environment); set it yourself before the
first ``import zipkv.kernels.…``::

    TRITON_INTERPRET=1 python my_script.py        # a script
    %env TRITON_INTERPRET=1                       # first cell of a notebook (before any zipkv import)

The test suite (``tests/conftest.py``), ``python -m zipkv book`` (for the notebooks it runs) and the
Jupyter kernel that ``make venv`` installs on a machine without a GPU set it for you. A launch on
CPU tensors without it is a ``ValueError`` that says so. In the interpreter bf16 arithmetic is wrong
(integer ops and fp32 dots are exact), so the launchers take fp32 paths there. Gluon has no
interpreter: the mma-layout kernel needs a CUDA GPU.
"""


def interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter: it was
    decorated while ``TRITON_INTERPRET=1`` was set."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, device, name: str) -> None:
    """Raise ``ValueError`` unless ``kernel`` can run on ``device`` (that of the argument ``name``):
    a CUDA GPU, or any device once the kernel runs in the interpreter."""
    if getattr(device, "type", str(device)) == "cuda" or interpreted(kernel):
        return
    raise ValueError(
        f"{name} is on {device}: zipkv's Triton kernels run on a CUDA GPU, or on the CPU in Triton's interpreter, "
        "which must be chosen before the kernels are imported: start Python with TRITON_INTERPRET=1 (or run "
        "%env TRITON_INTERPRET=1 first in a notebook), or use the torch references in zipkv.kernels.reference")
