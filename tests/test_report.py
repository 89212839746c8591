"""zipkv.study.report: the glued figure output is the one myst-nb's own ``glue`` writes (so the book places it)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from zipkv.study import report


def _calls(monkeypatch, target, name):
    seen = []
    monkeypatch.setattr(target, name, lambda *a, **k: seen.append((a, k)))
    return seen


def test_glue_output_matches_myst_nb(monkeypatch):
    glue_mod = pytest.importorskip("myst_nb.ext.glue")
    import IPython.display

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    ours = _calls(monkeypatch, IPython.display, "display")
    report._glue("fig-x", fig)
    theirs = _calls(monkeypatch, glue_mod, "ipy_display")
    glue_mod.glue("fig-x", fig, display=False)
    plt.close(fig)
    assert len(ours) == len(theirs) == 1
    (a, k), (b, j) = ours[0], theirs[0]
    assert a[0].keys() == b[0].keys() and k == j
    assert a[0] and all(key.startswith("application/papermill.record/") for key in a[0])


def test_figure_rejects_a_bad_name():
    fig, _ = plt.subplots()
    with pytest.raises(ValueError, match="name="):
        report.figure(fig, "caption", name="1 bad")
    plt.close(fig)
