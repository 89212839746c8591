"""zipkv inside other libraries' APIs, each an optional import that needs its library (``import zipkv`` never does):

* :mod:`zipkv.integrations.kvpress` -- zipkv's distiller as a press of NVIDIA's kvpress (:class:`ZipkvPress`), and
  kvpress's own presses scored by zipkv's KL protocol beside zipkv's distillers (:func:`kl_table`). kvpress pins
  ``transformers<5.3``: it runs in the environment ``make venv-kvpress`` builds (README, "zipkv and kvpress").
"""
