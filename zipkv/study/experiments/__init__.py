"""The experiments behind the book's chapters: each runs the library on the study's windows and settings and returns
tables (what a chapter shows of them is :mod:`zipkv.study.chapters`)."""
