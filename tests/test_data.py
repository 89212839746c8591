import json

import pytest
import torch

from zipkv import data


@pytest.fixture(scope="module")
def books():
    return data.load_books()


def _write_books(folder, texts):
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps([{"pg_id": i, "title": f"book {i}"} for i in range(len(texts))]))
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text)
    return folder


def test_default_folder_has_the_manifest_books(books):
    manifest = json.loads((data.default_books_dir() / "manifest.json").read_text())
    assert [b.pg_id for b in books] == [m["pg_id"] for m in manifest]
    assert all(len(b.text) == m["n_chars"] for b, m in zip(books, manifest))


def test_windows_are_deterministic(tokenizer, books):
    first = data.windows(tokenizer, books[:6], 4, context=64, continuation=16, seed=3)
    again = data.windows(tokenizer, books[:6], 4, context=64, continuation=16, seed=3)
    other = data.windows(tokenizer, books[:6], 4, context=64, continuation=16, seed=4)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again))
    assert any(not torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, other))
    for w in first:
        assert w.input_ids.shape == (80,) and w.context_ids.shape == (64,) and w.continuation_ids.shape == (16,)


def test_one_window_per_book_before_reuse(tokenizer, books):
    ws = data.windows(tokenizer, books[:3], 5, context=32, continuation=8, seed=0)
    ids = [w.pg_id for w in ws]
    assert sorted(ids[:3]) == sorted(b.pg_id for b in books[:3])
    assert ids[3:] == ids[:2]


def test_windows_skip_front_matter(tokenizer, tmp_path):
    marker = "FRONTMATTER " * (data.FRONT_MATTER_CHARS // 12 + 1)
    folder = _write_books(tmp_path / "b", [marker[: data.FRONT_MATTER_CHARS] + "plain words follow here. " * 400])
    (w,) = data.windows(tokenizer, data.load_books(folder), 1, context=100, continuation=10)
    assert "FRONT" not in tokenizer.decode(w.input_ids)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        data.load_books(tmp_path / "nowhere")


def test_window_longer_than_book_is_a_clear_error(tokenizer, tmp_path):
    folder = _write_books(tmp_path / "short", ["x" * data.FRONT_MATTER_CHARS + "a short book. " * 20])
    with pytest.raises(ValueError, match="longer than book pg_id=0"):
        data.windows(tokenizer, data.load_books(folder), 1, context=2048, continuation=128)


def test_bad_window_arguments(tokenizer, books):
    with pytest.raises(ValueError, match="n=0"):
        data.windows(tokenizer, books, 0)
    with pytest.raises(ValueError, match="books is empty"):
        data.windows(tokenizer, [], 1)
    with pytest.raises(ValueError, match="seed=-1: expected an int ≥ 0"):
        data.windows(tokenizer, books, 1, context=16, seed=-1)
    for bad in (None, "not a tokenizer"):
        with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
            data.windows(bad, books, 1, context=16)
    with pytest.raises(TypeError, match="folder=5: expected a path"):
        data.load_books(5)


def test_no_books_anywhere_is_one_clear_error(monkeypatch):
    import sys

    monkeypatch.setattr(data, "default_books_dir", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(FileNotFoundError, match="ZIPKV_PG19"):
        data.load_books()


def test_books_from_the_datasets_library(monkeypatch):
    import sys
    import types

    rows = [{"short_book_title": "A", "url": "http://www.gutenberg.org/ebooks/10146", "text": "alpha " * 10},
            {"short_book_title": "B", "url": "http://www.gutenberg.org/ebooks/77", "text": "beta " * 10}]
    fake = types.SimpleNamespace(load_dataset=lambda name, split, streaming: iter(rows))
    monkeypatch.setattr(data, "default_books_dir", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    books = data.load_books(limit=1)
    assert [(b.pg_id, b.title) for b in books] == [(10146, "A")]


@pytest.mark.parametrize("manifest, says", [
    ('[{"pg_id": 1, "title": "a"},', "is not valid JSON"),
    ('{"pg_id": 1}', "holds a JSON dict"),
    ('[{"title": "no id"}]', r"entry 0 is \{'title': 'no id'\}"),
    ('[{"pg_id": 1}, {"pg_id": "x1"}]', "entry 1 is"),
    ('[{"pg_id": 1, "title": 7}]', "entry 0 is"),
    ('[3]', "entry 0 is 3"),
])
def test_malformed_manifest_names_the_file(tmp_path, manifest, says):
    folder = _write_books(tmp_path / "b", ["some text"])
    (folder / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match=rf"{folder / 'manifest.json'}.*{says}"):
        data.load_books(folder)


def test_a_book_that_is_not_utf8_names_its_file(tmp_path):
    """A Latin-1 book was Python's UnicodeDecodeError, naming neither the file nor the book."""
    folder = _write_books(tmp_path / "b", ["some text"])
    (folder / "0.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{folder / '0.txt'} \(pg_id=0 in manifest.json\) is not UTF-8 text"):
        data.load_books(folder)


def test_manifest_pg_ids_may_be_digit_strings(tmp_path):
    folder = _write_books(tmp_path / "b", ["some text"])
    (folder / "manifest.json").write_text('[{"pg_id": "0"}]')
    (book,) = data.load_books(folder)
    assert (book.pg_id, book.title, book.text) == (0, "", "some text")


def test_window_and_book_arguments_are_checked():
    from zipkv import data

    books = data.load_books(limit=2)
    for kwargs, err, match in ((dict(n=1.5), TypeError, "n=1.5: expected an int"),
                               (dict(n=1, context=64.0), TypeError, "context=64.0"),
                               (dict(n=1, context=True), TypeError, "context=True")):
        with pytest.raises(err, match=match):
            data.windows(None, books, **kwargs)
    with pytest.raises(TypeError, match="books: expected a list of zipkv.data.Book"):
        data.windows(None, books[0], 1)
    with pytest.raises(ValueError, match="limit=-1: expected None or an int ≥ 1"):
        data.load_books(limit=-1)
