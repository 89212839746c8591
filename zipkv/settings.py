"""Settings defined once: the papers' experimental settings and this project's own targets.

Notebooks, profiles' documentation and benchmarks import these names instead of retyping numbers.
*Paper settings* are the papers' own (``shared/papers/``); *project targets* are bars this project
set itself (issues), never the papers' claims — chapters label them as ours.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVSculptSetting:
    """KVSculpt §4: context N, retain zone m, synthetic queries, L-BFGS steps, continuation tokens."""

    context: int = 2048
    m: int = 256
    n_synthetic: int = 128
    steps: int = 100
    continuation: int = 128

    def matches(self, **params) -> bool:
        """True when every given parameter equals this setting's value (unknown names are ignored)."""
        mine = asdict(self)
        return all(mine[k] == v for k, v in params.items() if k in mine)


KVSCULPT_PAPER = KVSculptSetting()
"""The setting of KVSculpt's Tables 1–8 (N = 2048, m = 256, 128 synthetic queries, 100 L-BFGS steps)."""
