"""The chapter "On the paper's card" (ZipFusion's Fig. 4 and Fig. 5 on an H100): its claims are the findings page's,
each paired with the H200 chapter's value of the same claim; the tokens/s gain is taken over the faster uncompressed
engine; the measurement refuses any other GPU before it starts."""
import pandas as pd
import pytest

from zipkv.study import findings
from zipkv.study.chapters import paper_card
from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL

POINTS = [(2048, 32), (2048, 64), (2048, 96), (8192, 32), (8192, 64), (8192, 96)]


def _latency(mix_speedup: float, mix_us: float) -> pd.DataFrame:
    """A latency table of the Fig. 4 points (the chapter's columns that the claims read): FlashInfer TC and our
    compressed kernel on both kinds of data."""
    rows = []
    for ctx, batch in POINTS:
        for kv_data, method, speedup, us in (("any", "flashinfer_tc", 1.0, 700.0),
                                             ("measured mix", "zipkv_compressed", mix_speedup, mix_us),
                                             ("all compressible", "zipkv_compressed", mix_speedup + 0.05, mix_us - 30)):
            rows.append(dict(shape="llama3.1-8b", ctx=ctx, batch=batch, kv_data=kv_data, method=method,
                             latency_us=us, speedup_vs_flashinfer_tc=speedup))
    return pd.DataFrame(rows)


def _throughput(token46: float, mma46: float, zf57: float, token32: float, zf32: float) -> pd.DataFrame:
    return pd.DataFrame([
        dict(model=THROUGHPUT_PAPER_MODEL, method="uncompressed", batch=32, max_batch=46, tokens_per_s=token32),
        dict(model=THROUGHPUT_PAPER_MODEL, method="uncompressed", batch=46, max_batch=46, tokens_per_s=token46),
        dict(model=THROUGHPUT_PAPER_MODEL, method="zipfusion", batch=32, max_batch=57, tokens_per_s=zf32),
        dict(model=THROUGHPUT_PAPER_MODEL, method="zipfusion", batch=57, max_batch=57, tokens_per_s=zf57),
        dict(model=THROUGHPUT_MMA_BASELINE_MODEL, method="uncompressed", batch=46, max_batch=46, tokens_per_s=mma46)])


def test_every_claim_of_the_chapter_has_one_partner_claim_on_the_h200():
    """Each findings claim of this chapter matches exactly one of its pairs, whose H200 chapter has exactly one claim
    starting with the pair's text: a renamed claim breaks the chapter's table here, not on the page."""
    mine = [c for c in findings.CLAIMS if c.chapter == paper_card.STEM]
    assert len(mine) == len(paper_card.PAIRS)
    for claim in mine:
        pairs = [p for p in paper_card.PAIRS if claim.claim.startswith(p[0])]
        assert len(pairs) == 1, claim.claim
        _, _, chapter, start = pairs[0]
        assert len([c for c in findings.CLAIMS if c.chapter == chapter and c.claim.startswith(start)]) == 1, start


def test_the_claims_table_judges_the_gain_over_the_faster_uncompressed_engine(tmp_path):
    """Synthetic tables of both cards: the tokens/s gain at the largest batches is taken over the mma-layout engine
    where it is the faster (1,375 / 1,100 = +25.0 %, reproduced; over the token layouts +37.5 %, shown), the gain at
    batch 32 over the token layouts (+10.0 %, not reproduced); each row carries the H200 chapter's value."""
    _latency(1.24, 600.0).to_csv(tmp_path / f"{paper_card.STEM}.csv", index=False)
    _throughput(1000.0, 1100.0, 1375.0, 1000.0, 1100.0).to_csv(tmp_path / f"{paper_card.THROUGHPUT_SIDE}.csv",
                                                              index=False)
    _latency(1.19, 400.0).to_csv(tmp_path / "zipfusion_attention_latency.csv", index=False)
    _throughput(1000.0, 1010.0, 1200.0, 1000.0, 1120.0).to_csv(tmp_path / "zipfusion_throughput.csv", index=False)
    table = paper_card.claims(tmp_path)
    assert table.held.tolist() == [True, True, True, False]
    assert table["ours, H100"][2].startswith("25.0% (1,375 tokens/s at batch 57 over 1,100 at batch 46, tensor-core layout")
    assert "over the token layout's 1,000: 37.5%" in table["ours, H100"][2]
    assert table["ours, H100"][3].startswith("10.0% (1,100 tokens/s at batch 32 over 1,000")
    assert table["ours, H200"].tolist()[0] == "1.190–1.190× (6 points, H200) [not reproduced]"
    assert table["ours, H200"].tolist()[2] == "20.0% [not reproduced]"
    text, kind = paper_card.verdict(table)
    assert "**3 of 4**" in text and kind == "warning"
    assert "same claims read 1.190–1.190×; FlashInfer TC 700.0 µs → ours 400.0 µs; 20.0%; 12.0%." in text


def test_the_gain_at_the_largest_batches_is_the_batch_ratio_times_the_step_ratio():
    rows = _throughput(1700.0, 1880.0, 2340.0, 1680.0, 1900.0).assign(
        step_ms=[19.0, 27.0, 16.8, 24.36, 24.4], attention_ms=[11.8, 19.6, 9.5, 17.0, 17.1], sm_clock_mhz=1980.0,
        frac_power_capped=0.0, power_w=[560, 540, 570, 600, 530])
    text = paper_card.throughput_text(rows)
    assert "holds 57 requests where uncompressed holds 46 (1.239×)" in text
    assert "tokens/s gains 1.239 × 1.002 = 1.245×" in text        # 57/46 × 24.40/24.36; 2340/1880 = 1.245
    assert "over it the gain is 1.376×" in text                     # 2340 / 1700


def test_measuring_on_another_gpu_is_an_error_before_anything_runs(tmp_path):
    with pytest.raises(RuntimeError, match=r"measures on an H100; this machine has 'NVIDIA H200'"):
        paper_card.measure(tmp_path / "absent.csv", tmp_path, device_name="NVIDIA H200")
    assert list(tmp_path.iterdir()) == []


def test_the_throughput_chapter_quotes_the_card_where_its_run_is_committed(tmp_path):
    """The H200 chapter's paragraph on the paper's card: ZipFusion's step and tokens/s against the mma-layout
    engine's, from the card's committed Fig. 5 rows beside the chapter's table; nothing before the card has run."""
    from zipkv.study.chapters import throughput as chapter

    committed = tmp_path / "zipfusion_throughput.csv"
    assert chapter.card_text(committed) == ""
    _throughput(1700.0, 1880.0, 2340.0, 1680.0, 1900.0).assign(
        step_ms=[19.0, 27.0, 16.8, 24.36, 24.4], sm_clock_mhz=[1980.0] * 4 + [1965.0], frac_power_capped=0.0,
        date="2026-12-05 19:46 UTC").to_csv(tmp_path / f"{paper_card.THROUGHPUT_SIDE}.csv", index=False)
    text = chapter.card_text(committed)
    assert "ZipFusion's 57 requests take a 24.36 ms step against 24.40 ms for 46 uncompressed ones" in text
    assert "1.245× the tokens/s, against a batch ratio of 1.239×" in text and "1965 MHz for the mma-layout" in text
