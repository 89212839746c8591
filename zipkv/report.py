"""What a chapter shows its reader: a verdict admonition first, figures with numbered captions.

Every chapter notebook opens with :func:`verdict` (one to three sentences computed from the
chapter's numbers) and shows its figures through :func:`figure`. Markdown outputs are rendered
as MyST by the book (``nb_render_markdown_format: myst`` in ``_config.yml``).
"""
from __future__ import annotations


def _display_markdown(text: str) -> None:
    from IPython.display import Markdown, display

    display(Markdown(text))


def verdict(text: str, *, kind: str = "note", title: str = "Verdict") -> None:
    """Show ``text`` (MyST markdown, computed from the chapter's numbers) in an admonition box.

    ``kind`` is the admonition class: ``"tip"`` (reproduced / bar met), ``"warning"`` (short of it),
    ``"note"`` (neutral).
    """
    if kind not in ("note", "tip", "warning", "important"):
        raise ValueError(f"kind={kind!r}: expected one of 'note', 'tip', 'warning', 'important'")
    _display_markdown(f":::{{admonition}} {title}\n:class: {kind}\n{text}\n:::")


def figure(fig, caption: str, *, name: str) -> None:
    """Show a matplotlib ``fig`` with a caption below it; ``name`` labels it (e.g. ``"fig-latency"``).

    Axes must already carry labels with units; the caption says what is plotted and how spread is shown.
    """
    import matplotlib.pyplot as plt
    from IPython.display import display

    display(fig)
    plt.close(fig)
    _display_markdown(f"**Figure ({name}).** {caption}")
