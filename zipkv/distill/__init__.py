"""KVSculpt: KV-cache distillation into free key/value pairs, its baselines and its evaluation.

Paper: "KVSculpt" (``shared/papers/003_*``), §3–§5.1 and Appendix A.

* :mod:`.queries` — training queries per KV head (retain + synthetic future queries, §3.3).
* :mod:`.problem` — the per-head problem, the §3.2 objective, the V-step, the solver types.
* :mod:`.baselines` — Random, Attention Score, Select+Fit, Joint Optimization (§4), batched;
  :mod:`.reference` — their one-problem-at-a-time references.
* :mod:`.kvsculpt` — the L-BFGS + ridge solver (§3.4) and :func:`compress` for a whole cache;
  :mod:`.batched` — the same solver on all problems at once.
* :mod:`.budget` — pilot-MSE budget allocation across layers and heads (§3.5).
* :mod:`.evaluate` — KL(full ‖ compressed) and hidden-state error with the compressed cache in the model
  (through :class:`zipkv.cache.DistilledCache`, the cache ``model.generate`` takes).
* :mod:`.analysis` — the experiment loops of the analysis chapters (Tables 3–8, App. B, §3.3, §6);
  :mod:`.kl_sources` — where the KL comes from, layer by layer.

Beyond the paper: :mod:`.generalise` — zipkv's own distiller (a per-key logit bias, trained on held-apart
queries); :mod:`.attention_matching` — Attention Matching, the other published distiller; :mod:`.bias` —
caches whose pairs carry a logit bias, and their KL; :mod:`.beyond` — the comparison of them all;
:mod:`.second_model` — the same comparison on a second model, one window at a time.
"""
from .baselines import JointConfig
from .kvsculpt import METHODS, CompressedCache, build_problems, compress, solve
from .problem import Problem, SculptConfig, Solution, Solver
from .queries import STRATEGIES, training_queries

__all__ = [
    "METHODS", "STRATEGIES", "CompressedCache", "JointConfig", "Problem", "SculptConfig", "Solution", "Solver",
    "build_problems", "compress", "solve", "training_queries",
]
