"""PG19 books and deterministic token windows.

Both papers evaluate on PG19 test-split books: KVSculpt (§5, setup) samples contexts of
N = 2048 tokens followed by 128 continuation tokens; ZipFusion's attention benchmarks use
captured KV caches. :func:`load_books` reads a folder laid out like ``shared/data/pg19``
(``<pg_id>.txt`` files plus ``manifest.json``) or, failing that, the PG19 test split through
the ``datasets`` library; :func:`windows` cuts token windows from them.
"""
from __future__ import annotations

import json
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FRONT_MATTER_CHARS = 2000
"""Characters skipped at the start of every book (title page, contents, transcriber notes)."""

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Book:
    pg_id: int
    title: str
    text: str


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``input_ids`` [context + continuation] from one book."""

    input_ids: torch.Tensor
    context: int
    continuation: int
    pg_id: int
    title: str
    char_offset: int

    @property
    def context_ids(self) -> torch.Tensor:
        """[context] token ids: the prompt whose KV cache is compressed."""
        return self.input_ids[: self.context]

    @property
    def continuation_ids(self) -> torch.Tensor:
        """[continuation] token ids teacher-forced after the context."""
        return self.input_ids[self.context :]


def default_books_dir() -> Path | None:
    """``$ZIPKV_PG19``, else ``../shared/data/pg19`` beside the repository when present."""
    env = os.environ.get("ZIPKV_PG19")
    if env:
        return Path(env)
    for candidate in (_REPO_ROOT.parent / "shared" / "data" / "pg19", _REPO_ROOT / "data" / "pg19"):
        if (candidate / "manifest.json").is_file():
            return candidate
    return None


def load_books(folder: str | os.PathLike | None = None, *, limit: int | None = None) -> list[Book]:
    """Books from ``folder`` (a ``manifest.json`` plus ``<pg_id>.txt`` files), in manifest order.

    ``folder=None`` uses :func:`default_books_dir`, else the PG19 test split from the
    ``datasets`` library (needs a network). ``limit`` keeps the first ``limit`` books.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1):
        raise ValueError(f"limit={limit!r}: expected None or an int ≥ 1 (the first books to keep)")
    if folder is None:
        folder = default_books_dir()
        if folder is None:
            return _load_books_from_datasets(limit)
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder={folder!r}: expected a path (str or os.PathLike) to a folder of PG19 books, or None")
    folder = Path(folder)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"folder={str(folder)!r} has no manifest.json: expected a folder of PG19 books laid out as "
            "<pg_id>.txt files plus manifest.json (a list of {pg_id, title, ...}). Point at one with "
            "load_books(folder=...) or the ZIPKV_PG19 environment variable."
        )
    books = []
    for pg_id, title in _read_manifest(manifest)[:limit]:
        path = folder / f"{pg_id}.txt"
        if not path.is_file():
            raise FileNotFoundError(f"manifest.json in {folder} lists pg_id={pg_id}, but {path} is missing")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} (pg_id={pg_id} in manifest.json) is not UTF-8 text ({err.reason} at byte "
                             f"{err.start}): expected a plain-text book in UTF-8") from None
        books.append(Book(pg_id, title, text))
    return books


def _read_manifest(path: Path) -> list[tuple[int, str]]:
    """``(pg_id, title)`` per entry of a ``manifest.json`` (a JSON list of objects with an integer
    ``pg_id`` and an optional string ``title``); a malformed file is a ``ValueError`` naming it."""
    expected = 'expected a JSON list of objects like {"pg_id": 10146, "title": "..."}'
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): {expected}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path} holds a JSON {type(entries).__name__}: {expected}")
    result = []
    for i, entry in enumerate(entries):
        pg_id = entry.get("pg_id") if isinstance(entry, dict) else None
        title = entry.get("title", "") if isinstance(entry, dict) else ""
        if isinstance(pg_id, str) and pg_id.isdigit():
            pg_id = int(pg_id)
        if isinstance(pg_id, bool) or not isinstance(pg_id, int) or not isinstance(title, str):
            raise ValueError(f"{path}: entry {i} is {entry!r}: {expected} (an integer pg_id, a string title)")
        result.append((pg_id, title))
    return result


def _load_books_from_datasets(limit: int | None) -> list[Book]:
    hint = (
        "no PG19 books found: set ZIPKV_PG19 to a folder of <pg_id>.txt files with a manifest.json "
        "(the layout of shared/data/pg19), pass load_books(folder=...), or install `datasets` and "
        "allow network access to read the PG19 test split"
    )
    try:
        import datasets
    except ImportError as err:
        raise FileNotFoundError(hint) from err
    try:
        split = datasets.load_dataset("deepmind/pg19", split="test", streaming=True)
        books = []
        for row in split:
            # PG19 rows carry the Gutenberg address, e.g. .../ebooks/10146, not a pg_id column.
            digits = re.findall(r"\d+", row.get("url", ""))
            books.append(Book(int(digits[-1]) if digits else len(books), row.get("short_book_title", ""), row["text"]))
            if limit is not None and len(books) >= limit:
                break
    except Exception as err:  # network, hub or schema failure: say how to point at local books
        raise FileNotFoundError(f"{hint} (datasets failed: {err})") from err
    return books


def windows(
    tokenizer,
    books: list[Book],
    n: int,
    context: int = 2048,
    continuation: int = 128,
    seed: int = 0,
) -> list[Window]:
    """``n`` deterministic token windows of ``context + continuation`` tokens.

    Books are visited in a seeded random order, one window per book before any book is
    reused; each window starts at a seeded random character offset past the first
    :data:`FRONT_MATTER_CHARS` characters. The same arguments always give the same windows.
    """
    for name, value in (("n", n), ("context", context), ("continuation", continuation), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}={value!r}: expected an int")
    if not isinstance(books, (list, tuple)) or not all(isinstance(b, Book) for b in books):
        raise TypeError(f"books: expected a list of zipkv.data.Book (zipkv.data.load_books), got {type(books).__name__}")
    if n < 1:
        raise ValueError(f"n={n}: expected at least one window")
    if context < 1 or continuation < 0:
        raise ValueError(f"context={context}, continuation={continuation}: expected context ≥ 1 and continuation ≥ 0")
    if not books:
        raise ValueError("books is empty: expected at least one Book (see zipkv.data.load_books)")
    if seed < 0:
        raise ValueError(f"seed={seed}: expected an int ≥ 0")
    if not callable(tokenizer) or not hasattr(tokenizer, "encode"):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer (the second value of zipkv.models.load_model), "
                        f"got {type(tokenizer).__name__}")
    total = context + continuation
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(books))
    result = []
    for i in range(n):
        book = books[order[i % len(books)]]
        result.append(_window_from_book(tokenizer, book, total, context, rng))
    return result


def _window_from_book(tokenizer, book: Book, total: int, context: int, rng: np.random.Generator) -> Window:
    body = book.text[FRONT_MATTER_CHARS:]
    # Tokenize a slice, not the whole book: about 4 characters per token in English prose,
    # with generous slack; grow the slice if it falls short.
    need_chars = total * 8
    latest_start = max(0, len(body) - need_chars)
    start = int(rng.integers(0, latest_start + 1))
    while True:
        piece = body[start : start + need_chars]
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= total + 1:
            # Drop the first token: the slice may begin mid-word.
            ids = ids[1 : total + 1]
            break
        if start == 0 and start + need_chars >= len(body):
            raise ValueError(
                f"window of {total} tokens (context + continuation) is longer than book pg_id={book.pg_id} "
                f"({len(ids)} tokens after its first {FRONT_MATTER_CHARS} characters)"
            )
        need_chars *= 2
        start = min(start, max(0, len(body) - need_chars))
    return Window(torch.tensor(ids, dtype=torch.long), context, total - context, book.pg_id, book.title, start)
