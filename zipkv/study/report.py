"""What a chapter shows its reader: a verdict admonition first, figures with numbered captions.

Every chapter notebook opens with :func:`verdict` (one to three sentences computed from the
chapter's numbers) and shows its figures through :func:`figure`. Each output carries two
renderings: MyST markdown for the book (``_config.yml`` renders markdown outputs as MyST and
ranks them above HTML) and plain HTML for JupyterLab, so the notebook reads well in both.
A figure is glued (myst-nb ``glue``) and placed by a ``{glue:figure}`` directive, which gives it
a numbered caption in the book and a ``name`` that prose can reference (``{numref}`name```).
"""
from __future__ import annotations

import base64
import html
import io
import re

VERDICT_KINDS = ("note", "tip", "warning", "important")


def _inline_html(text: str) -> str:
    """The few inline MyST marks verdicts and captions use (``**bold**``, ``*em*``, ```code```) as HTML."""
    out = html.escape(text, quote=False)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    out = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<i>\1</i>", out)
    out = re.sub(r"`(.+?)`", r"<code>\1</code>", out)
    return out


def _display(markdown: str, html_text: str) -> None:
    from IPython.display import display

    display({"text/markdown": markdown, "text/html": html_text, "text/plain": markdown}, raw=True)


def verdict(text: str, *, kind: str = "note", title: str = "Verdict") -> None:
    """Show ``text`` (MyST markdown, computed from the chapter's numbers) in an admonition box.

    ``kind`` is the admonition class: ``"tip"`` (reproduced / bar met), ``"warning"`` (short of it),
    ``"note"`` (neutral), ``"important"``.
    """
    if kind not in VERDICT_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(map(repr, VERDICT_KINDS))}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text={text!r}: expected a non-empty string (the verdict's sentences)")
    colour = {"tip": "#1b8a3a", "warning": "#c77700", "note": "#2a6db0", "important": "#7a3fb0"}[kind]
    _display(f":::{{admonition}} {title}\n:class: {kind}\n{text}\n:::",
             f'<div style="border-left:4px solid {colour};padding:0.4em 0.8em;margin:0.5em 0">'
             f"<b>{html.escape(title)}</b><br>{_inline_html(text)}</div>")


def figure(fig, caption: str, *, name: str) -> None:
    """Show a matplotlib ``fig`` with a numbered caption below it; ``name`` labels it (e.g. ``"fig-latency"``).

    Axes must already carry labels with units; the caption says what is plotted and how spread is
    shown. ``name`` must be unique within the book (letters, digits, ``-`` and ``_``).
    """
    import matplotlib.pyplot as plt

    if not re.fullmatch(r"[A-Za-z][\w-]*", name or ""):
        raise ValueError(f"name={name!r}: expected a label of letters, digits, '-' and '_', starting with a letter")
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError(f"caption={caption!r}: expected a non-empty string")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    _glue(name, fig)  # the book's copy of the image, placed by the directive below
    plt.close(fig)
    png = base64.b64encode(buffer.getvalue()).decode()
    _display(f"```{{glue:figure}} {name}\n:name: {name}\n\n{caption}\n```",
             f'<figure><img src="data:image/png;base64,{png}" style="max-width:100%">'
             f"<figcaption><b>Figure.</b> {_inline_html(caption)}</figcaption></figure>")


def _glue(name: str, obj) -> None:
    """Store ``obj``'s display data under ``name`` for myst-nb's ``glue:`` directives, hidden in the notebook.

    The output myst-nb's ``glue(name, obj, display=False)`` writes (a mime bundle prefixed
    ``application/papermill.record/`` with ``scrapbook`` metadata), written here so that executing a
    chapter needs IPython only: myst-nb's own function imports docutils and Sphinx.
    """
    from IPython.core.formatters import format_display_data
    from IPython.display import display

    prefix = "application/papermill.record/"
    bundle, metadata = format_display_data(obj)
    metadata["scrapbook"] = dict(name=name, mime_prefix=prefix)
    display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


def markdown(text: str) -> None:
    """Show MyST markdown prose computed by the notebook (rendered as MyST in the book)."""
    _display(text, f"<p>{_inline_html(text)}</p>")


def count(n: int, noun: str) -> str:
    """``"1 window"``, ``"3 windows"``: a count and its noun (plural by an s)."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def in_words(table):
    """``table`` (a DataFrame) with its column and index names as a reader reads them: a results table's column names
    (``uniform_kl``, ``vs_uniform``, ``paper per_layer_vs_uniform``) with spaces for underscores and KL capitalised."""
    import re

    def words(name):
        if not isinstance(name, str):
            return name
        return re.sub(r"\bkl\b", "KL", name.replace("_", " "))

    out = table.rename(columns=words)
    out.index.names = [words(n) for n in out.index.names]
    return out
