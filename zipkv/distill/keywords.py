"""Unknown keyword arguments of the distillers' entry points named with the nearest valid one, before any work."""
from __future__ import annotations

import difflib
import functools
import inspect

__all__ = ["suggest_keywords"]


def suggest_keywords(func):
    """Wrap ``func`` so that a keyword argument it does not take is a ``TypeError`` naming the nearest one it takes
    (``kvsculpt.compress(capture, 0.3, n_synthetics=64)``: "did you mean n_synthetic=?"), raised before ``func`` runs."""
    params = inspect.signature(func).parameters
    names = tuple(n for n, p in params.items() if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return func

    @functools.wraps(func)
    def checked(*args, **kwargs):
        for name in kwargs:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {near[0]}=?)" if near else ""
                raise TypeError(f"{func.__module__.rsplit('.', 1)[-1]}.{func.__name__}() got an unexpected keyword "
                                f"argument {name}={kwargs[name]!r}{hint}; it takes {sorted(names)}")
        return func(*args, **kwargs)
    return checked
