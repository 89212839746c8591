"""Triton kernels (one file per op) and their fp32 torch references (``reference.py``).

Launchers validate inputs and raise ``ValueError``/``TypeError``; kernels never see bad
input. On CPU the kernels run under ``TRITON_INTERPRET=1`` (set it before importing triton).
"""
