"""The chapter "zipkv among kvpress's presses": its display module on hand-made tables, and the task run's gate and
resume on a stand-in model (no kvpress, no model run)."""
import re
import types

import nbformat
import pandas as pd
import pytest
import torch

from zipkv.study import book
from zipkv.study.chapters import kvpress_presses as page
from zipkv.study.experiments import kvpress_presses as exp

SNAKE = re.compile(r"\b[a-z]{2,}_[a-z_]+\b|\.csv|\bbar\b|\bissue\b|\bnan\b")


def _kl(zipkv_factor=0.2, models=("SmolLM2-135M-Instruct", "gemma-3-270m-q4_k_m"), windows=3):
    """A KL table: presses at 1/f, zipkv at zipkv_factor × the best press, the others between."""
    rows = []
    base = {"knorm": 2.0, "tova": 1.0, "adakv_tova": 1.2, "kvzip": 1.5, "attention_matching": 0.5,
            "select_fit": 0.8, "select_fit_dense": 0.6, "kvsculpt": 0.7, "zipkv_press": 0.3}
    for model in models:
        for w in range(windows):
            for f in (0.5, 0.25, 0.125):
                for method, scale in {**base, "zipkv": zipkv_factor}.items():
                    if method == "kvsculpt" and w > 0:
                        continue
                    rows.append(dict(model=model, window=w, N=128, C=32, kept_fraction=f, method=method,
                                     kl=scale * (0.1 / f) * (1 + 0.1 * w), seconds=0.5 if scale > 0.9 else 20.0,
                                     kept=f, kvpress="0.5.5", transformers="5.2.0", note="", probe_tokens=32))
    return pd.DataFrame(rows)


def _task():
    rows = [dict(model="SmolLM2-135M-Instruct", kind="niah_single", length=256, method="none", kept_fraction=1.0,
                 prompts=100, correct=97, accuracy=0.97),
            dict(model="SmolLM2-135M-Instruct", kind="niah_multikey", length=256, method="none", kept_fraction=1.0,
                 prompts=100, correct=40, accuracy=0.40)]
    for f, z, t in ((0.25, 0.9, 0.6), (0.125, 0.7, 0.3)):
        rows.append(dict(model="SmolLM2-135M-Instruct", kind="niah_single", length=256, method="zipkv",
                         kept_fraction=f, prompts=10, correct=int(10 * z), accuracy=z))
        rows.append(dict(model="SmolLM2-135M-Instruct", kind="niah_single", length=256, method="tova",
                         kept_fraction=f, prompts=50, correct=int(50 * t), accuracy=t))
    return pd.DataFrame(rows)


def test_by_fraction_picks_the_best_press_and_the_ratio_to_it():
    f = page.by_fraction(_kl())
    assert set(f.best_press) == {"tova"} and f.ratio.round(6).eq(0.2).all() and f.lowest.all()
    assert f.windows.eq(3).all() and len(f) == 6
    s = page.stats(_kl())
    best_sf = s[s.method == "best_select_fit"]
    assert len(best_sf) == 6 and (best_sf.mean_kl == s[s.method == "select_fit_dense"].mean_kl.values).all()


def test_verdict_says_lowest_with_the_ratios_and_the_task_in_plain_words():
    text, kind = page.verdict(_kl(), _task())
    assert kind == "tip" and "lowest mean KL of every other method" in text and "both models" in text
    assert "0.2×" in text and "Fewer than the 20 windows" in text and "3 windows per model" in text
    assert "at kept 0.25 and 0.125: zipkv's distiller answers 90% and 70% (10 prompts), the best press 60% (TOVA) and 30% (TOVA) (50 prompts)" in text
    assert not SNAKE.search(text.replace("zipkv's", "")), text


def test_verdict_names_the_method_that_beats_zipkv_and_warns():
    text, kind = page.verdict(_kl(zipkv_factor=0.55), None)   # Attention Matching (0.5) is lower
    assert kind == "warning" and "below the best kvpress press" in text and "was not run here" in text
    assert "Attention Matching on Gemma-3-270M at kept 0.125, 0.25, 0.5 (0.91× zipkv's KL)" in text


def test_tables_and_texts_use_labels_not_ids():
    t = _kl()
    compact = page.compact_table(t)
    assert list(compact.columns)[:2] == ["zipkv's distiller", "best press"]
    assert compact["best press"].str.startswith("TOVA").all()
    every = page.every_method(t)
    assert "AdaKV + TOVA" in every.index.get_level_values("method")
    assert "Select+Fit (N queries)" in page.seconds(t).index
    for text in (page.caption(t), page.cited(), page.task_text(_task()), page.bias_text(t), page.setting_line(t)):
        assert not SNAKE.search(text), text
    assert "left out" in page.task_text(_task()) and "fewer prompts" in page.task_text(_task())
    assert "3.33× at 0.5" not in page.bias_text(t) and "1.50× at 0.5" in page.bias_text(t)
    table = page.task_table(_task())
    assert table.columns[0] == "all" and table.loc[("SmolLM2-135M-Instruct", "one needle", 256, "zipkv's distiller"),
                                                   "0.25 (4×)"] == "90% (9/10)"


def test_figure_is_log_log_with_labelled_axes():
    fig = page.figure(_kl())
    for ax in fig.axes:
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log" and "kept" in ax.get_xlabel()
    assert "nats per token" in fig.axes[0].get_ylabel()
    assert "best kvpress press" in [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]


def test_task_run_gates_on_the_uncompressed_accuracy_and_resumes(tmp_path, monkeypatch):
    from zipkv import models, tasks

    calls = []
    monkeypatch.setattr(models, "model_shape", lambda model: types.SimpleNamespace(name="tiny"))
    monkeypatch.setattr(tasks, "make_tasks", lambda tok, books, n, length, kind, seed=0: [kind] * n)

    def accuracy(model, tokenizer, made, compress=None, max_new_tokens=40):
        calls.append((made[0], len(made), compress is None))
        right = made[0] == "niah_single"
        return pd.DataFrame({"correct": [right] * len(made)})
    monkeypatch.setattr(tasks, "accuracy", accuracy)

    def greedy_replies(model, tokenizer, made, compress=None, max_new_tokens=128):
        calls.append(("replies", len(made), compress is None))
        return [torch.tensor([1, 2, 3, 4] if compress is None else [1, 2, 9, 4])] * len(made)
    monkeypatch.setattr(tasks, "greedy_replies", greedy_replies)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[]))
    out = tmp_path / "task.csv"
    run = lambda: exp.measure_task(model, None, [], [("niah_single", 64), ("niah_multikey", 64)],  # noqa: E731
                                   ["tova", "zipkv"], (0.25,), prompts=6, method_prompts={"zipkv": 2}, out=out,
                                   agreement_tokens=4)
    table = run()
    assert calls == [("niah_single", 6, True), ("niah_single", 6, False), ("niah_single", 2, False),
                     ("niah_multikey", 6, True),                         # the multikey setting failed the gate:
                     ("replies", 6, True), ("replies", 6, False),    # agreement instead (the uncompressed
                     ("replies", 2, False)]                          # replies once each)
    assert list(table.method) == ["none", "tova", "zipkv", "none", "tova", "zipkv"]
    assert list(table.prompts) == [6, 6, 2, 6, 6, 2]
    assert table.gate_passed.tolist() == [True, True, True, False, False, False]
    assert table.agreement.tolist()[4:] == [0.5, 0.5] and table.accuracy.isna().tolist()[3:] == [False, True, True]
    assert {"device", "date", "commit"} <= set(table.columns)
    calls.clear()
    again = run()                                                      # everything is in the CSV: nothing reruns
    assert calls == [] and len(again) == 6


def test_the_notebook_is_thin_and_its_prose_plain():
    source = book.notebook_sources()["kvpress_presses"]
    nb = nbformat.read(source, as_version=4)
    code = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines() if line.strip()]
    assert len(code) <= 60
    assert {"from_results", "results_csv", "committed_csv"} <= set(book.declared_parameters(source))
    prose = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert not SNAKE.search(prose)
    assert "kvpress_presses" in {j.name for j in book.plan("quick")} and "kvpress_presses" in \
        {j.name for j in book.plan("paper")}


def test_press_labels_cover_kvpress_presses_of_the_integration():
    from zipkv.integrations import kvpress as integration

    assert set(integration.PRESSES) == set(page.PRESS_LABELS)
    assert set(integration.ZIPKV_METHODS) == set(page.OURS) - {exp.RECONSTRUCTION} == set(exp.ZIPKV_SIDE)
    with pytest.raises(KeyError):
        page.PRESS_LABELS["adakv_tova"]


def test_kl_run_skips_what_its_csv_holds_and_keeps_slow_methods_to_the_first_windows(tmp_path, monkeypatch):
    from zipkv import models
    from zipkv.integrations import kvpress as integration

    calls = []

    def kl_table(model, windows, fractions, methods, **settings):
        calls.append((settings["seed"], list(methods)))
        return pd.DataFrame([dict(model="tiny", window=0, N=8, C=2, kept_fraction=f, method=m, kl=0.1, seconds=1.0,
                                  kept=f, kvpress="0.5.5", transformers="5.2.0", note="")
                             for f in fractions for m in methods])
    monkeypatch.setattr(integration, "kl_table", kl_table)
    monkeypatch.setattr(models, "model_shape", lambda model: types.SimpleNamespace(name="tiny"))
    out = tmp_path / "kl.csv"
    table = exp.measure_kl(None, None, ["w0", "w1"], [0.5, 0.25], ["knorm", "kvsculpt"], slow_windows=1, out=out)
    assert calls == [(0, ["knorm", "kvsculpt"]), (1, ["knorm"])]
    assert sorted(table.groupby("window").size().tolist()) == [2, 4] and (table.window.tolist()[-1] == 1)
    calls.clear()
    more = exp.measure_kl(None, None, ["w0", "w1", "w2"], [0.5, 0.25], ["knorm", "zipkv"], out=out)
    assert calls == [(0, ["zipkv"]), (1, ["zipkv"]), (2, ["knorm", "zipkv"])]    # only what the CSV lacks
    assert len(more) == len(pd.read_csv(out)) == 6 + 2 + 2 + 4


def test_replies_count_the_leading_digits_right(monkeypatch):
    from zipkv import models, tasks

    monkeypatch.setattr(models, "model_shape", lambda model: types.SimpleNamespace(name="tiny"))
    made = [tasks.Task("niah_single", 64, 0.5, "text", "question?", ("9736685",)),
            tasks.Task("niah_single", 64, 0.5, "text", "question?", ("3315698",))]
    monkeypatch.setattr(tasks, "make_tasks", lambda *args, **kw: made)
    answers = {"zipkv": ["The number is 973.", "I do not know."], "kvzip": ["It is 9736685.", "3315698"]}
    monkeypatch.setattr(tasks, "accuracy", lambda model, tok, made, compress, max_new_tokens: pd.DataFrame(
        {"reply": answers.pop(next(iter(answers)))}))
    monkeypatch.setattr(exp, "compressor", lambda *args, **kw: None)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[]))
    table = exp.replies(model, None, [], ["zipkv", "kvzip"], 0.25, prompts=2)
    assert table.leading_digits.tolist() == [3, 0, 7, 7] and table.number.tolist() == ["973", "", "9736685", "3315698"]
    text = page.replies_text(table)
    assert "zipkv's distiller 1.5 of 7 digits right on average, 0 of 2 numbers whole" in text
    assert "KVzip 7.0 of 7 digits right on average, 2 of 2 numbers whole" in text and "973 for 9736685" in text
    assert not SNAKE.search(text)


def test_retention_text_says_per_method_how_many_heads_hold_the_number():
    rows = []
    for prompt in range(2):
        for method, digit, every in (("kvzip", 0.24, 14), ("zipkv", 0.05, 0), ("zipkv_reconstruction", 0.12, 4)):
            rows.append(dict(model="SmolLM2-135M-Instruct", kind="niah_single", length=256, method=method,
                             kept_fraction=0.25, prompt=prompt, digits=7, heads=90, digit_kept=digit,
                             first_digit_kept=digit, heads_with_every_digit=every + prompt, context_kept=0.25))
    rows.append({**rows[1], "prompt": 2, "digit_kept": 1.0, "heads_with_every_digit": 90})   # in the verbatim tail
    text = page.retention_text(pd.DataFrame(rows))
    assert "3 prompts, SmolLM2-135M-Instruct, 90 KV heads, a 7-digit number" in text
    assert "KVzip 24% (14.5 with every digit)" in text and "zipkv's distiller 5% (1 with every digit)" in text
    assert "zipkv's distiller, re-reading probe 12% (4.5 with every digit)" in text
    assert "In 1 of the prompts the number lay in the context's last tokens" in text
    assert not SNAKE.search(text) and page.retention_text(None) == ""


def test_kept_positions_finds_the_keys_a_distilled_cache_still_holds():
    """zipkv keeps the keys it selects as they are: a position counts as kept in a head exactly where its key is
    among that head's valid cached keys."""
    import torch

    from zipkv.cache import DistilledCache, DistilledLayer

    torch.manual_seed(0)
    keys = torch.randn(2, 6, 4)                                   # [H, N, d] captured
    capture = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=keys)])
    held = torch.zeros(1, 2, 3, 4)
    held[0, 0] = keys[0, [0, 2, 5]]
    held[0, 1, :2] = keys[1, [2, 3]]
    held[0, 1, 2] = keys[1, 4] + 0.5                              # a fitted key, not the original
    valid = torch.tensor([[[True, True, True], [True, True, True]]])
    cache = DistilledCache([DistilledLayer(held, held.clone(), valid)], n_context=6)
    kept = exp._kept_positions(cache, capture, [2, 4, 5], model=None)
    assert kept[0].tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("first,held_out", [(None, False), (page.REREADING_CHOSEN_ON - 5, False),
                                            (page.REREADING_CHOSEN_ON, True)])
def test_the_rereading_rows_say_whether_they_are_held_out(first, held_out):
    row = dict(model="SmolLM2-135M-Instruct", kind="niah_single", length=256, method="zipkv_reconstruction",
               kept_fraction=0.25, prompts=30, correct=27, accuracy=0.9, seconds=160.0)
    if first is not None:
        row["first_prompt"] = first
    text = page.task_text(pd.concat([_task(), pd.DataFrame([row])], ignore_index=True))
    assert "27 of 30 at kept 0.25 (SmolLM2-135M-Instruct; the best press 60%)" in text
    assert ("was chosen: a held-out measurement" in text) == held_out and ("not a held-out" in text) == (not held_out)


def test_rows_with_a_new_column_are_appended_without_misaligning_the_csv(tmp_path):
    out = tmp_path / "t.csv"
    exp._append(out, pd.DataFrame([dict(method="a", prompts=3)]), [])
    exp._append(out, pd.DataFrame([dict(method="b", first_prompt=20, prompts=30)]), [])
    exp._append(out, pd.DataFrame([dict(method="c", first_prompt=0, prompts=5)]), [])
    t = pd.read_csv(out)
    assert t.method.tolist() == ["a", "b", "c"] and t.prompts.tolist() == [3, 30, 5]
    assert t.first_prompt.isna().tolist() == [True, False, False] and t.first_prompt.iloc[1] == 20


def test_a_first_prompt_past_the_prompts_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"first_prompt=\{'zipkv': 6\}: expected prompt indices in \[0, 6\)"):
        exp.measure_task(None, None, [], [("niah_single", 64)], ["zipkv"], prompts=6, first_prompt={"zipkv": 6})


def test_a_model_below_the_gate_is_scored_by_agreement_in_the_text_and_the_table():
    """A setting the uncompressed model does not solve gets agreement rows (no accuracy): the text says so, gives
    zipkv's and the best press's agreement per kept fraction, and the table shows them; the solved setting's
    accuracy sentences are unchanged."""
    base = dict(kind="niah_single", length=512, kvpress="0.5.5", transformers="5.2.0")
    task = pd.DataFrame([
        dict(model="SmolLM2-135M-Instruct", method="none", kept_fraction=1.0, prompts=100, correct=96, accuracy=0.96),
        dict(model="SmolLM2-135M-Instruct", method="zipkv", kept_fraction=0.25, prompts=8, correct=0, accuracy=0.0),
        dict(model="SmolLM2-135M-Instruct", method="tova", kept_fraction=0.25, prompts=30, correct=3, accuracy=0.1),
        dict(model="gemma-3-270m-q4_k_m", method="none", kept_fraction=1.0, prompts=100, correct=8, accuracy=0.08),
        dict(model="gemma-3-270m-q4_k_m", method="zipkv", kept_fraction=0.25, prompts=30, agreement=0.41,
             agreement_tokens=128),
        dict(model="gemma-3-270m-q4_k_m", method="tova", kept_fraction=0.25, prompts=30, agreement=0.35,
             agreement_tokens=128),
        dict(model="gemma-3-270m-q4_k_m", method="snapkv", kept_fraction=0.25, prompts=30, agreement=0.2,
             agreement_tokens=128),
    ]).assign(**base)
    text = page.task_text(task)
    assert "8% of 100 prompts (below 80 %: scored by agreement instead)" in text
    assert "first 128 reply tokens" in text and "41% (30 prompts)" in text and "(TOVA) 35% (30 prompts)" in text
    assert "answers 0% of 8 prompts, the best press (TOVA) 10% of 30" in text
    table = page.task_table(task)
    assert "41% agree (30)" in table.to_string() and "0% (0/8)" in table.to_string()
    assert page.agreement_text(task.dropna(subset=["accuracy"])) == ""
