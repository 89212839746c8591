"""The study: everything that exists for the book, built on the library (:mod:`zipkv`) and never imported by it.

* :mod:`zipkv.study.experiments` -- the runs behind each chapter (sweeps, comparisons, the throughput runs);
* :mod:`zipkv.study.chapters` -- what each chapter shows: its tables, figures and verdict sentences;
* :mod:`zipkv.study.findings` -- the scorecard of both papers' claims;
* :mod:`zipkv.study.paper_values`, :mod:`zipkv.study.settings` -- the papers' numbers and settings, and this
  project's own targets, defined once;
* :mod:`zipkv.study.book`, :mod:`zipkv.study.committed`, :mod:`zipkv.study.report` -- the book pipeline
  (``python -m zipkv book``), committed results, and how a chapter shows a verdict or a figure.
"""
