"""Triton kernels (one file per op), the Gluon decode kernel of the mma layouts
(``decode_mma.py``, CUDA only) and their fp32 torch references (``reference.py``).

Launchers validate inputs and raise ``ValueError``/``TypeError``; kernels never see bad
input. On CPU the Triton kernels run under ``TRITON_INTERPRET=1``, set here when no GPU is
present and triton is not imported yet (Gluon has no interpreter).
"""

import os as _os
import sys as _sys

import torch as _torch

if "triton" not in _sys.modules and not _torch.cuda.is_available():
    # Without a GPU, Triton kernels only run in its interpreter, which must be chosen before import.
    _os.environ.setdefault("TRITON_INTERPRET", "1")
