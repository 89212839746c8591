"""KVSculpt: KV-cache distillation into free key/value pairs, its baselines and its evaluation.

Paper: "KVSculpt" (``shared/papers/003_*``), §3–§5.1 and Appendix A.

* :mod:`.queries` — training queries per KV head (retain + synthetic future queries, §3.3).
* :mod:`.baselines` — the per-head problem and objective; Random, Attention Score, Select+Fit,
  Joint Optimization (§4).
* :mod:`.kvsculpt` — the L-BFGS + ridge solver (§3.4) and :func:`compress` for a whole cache.
* :mod:`.budget` — pilot-MSE budget allocation across layers and heads (§3.5).
* :mod:`.evaluate` — KL(full ‖ compressed) and hidden-state error with the compressed cache in the model.
"""
from .baselines import JointConfig, Problem, Solution
from .kvsculpt import METHODS, CompressedCache, SculptConfig, build_problems, compress, solve
from .queries import STRATEGIES, training_queries

__all__ = [
    "METHODS", "STRATEGIES", "CompressedCache", "JointConfig", "Problem", "SculptConfig", "Solution",
    "build_problems", "compress", "solve", "training_queries",
]
