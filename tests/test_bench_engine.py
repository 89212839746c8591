"""zipkv.bench.engine: the decode-step breakdown (the GPU part runs in the throughput chapter)."""


def test_kernel_kind_sorts_a_step_s_kernels():
    from zipkv.bench.engine import kernel_kind
    names = {"_pipelined_kernel": "attention", "_decode_kernel": "attention", "_merge_kernel": "attention",
             "_splitzip_words_kernel": "restore", "_huffman_kernel": "restore",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_128x64": "gemm",
             "void at::native::index_put_kernel_impl": "kv_write", "triton_poi_fused_mul_0": "other"}
    assert {n: kernel_kind(n) for n in names} == names


def _profiled_rows():
    """The committed profile's rows with the engine's default scheduler (the overlapped steps), four of them."""
    import pandas as pd
    from zipkv.study.book import REPO_ROOT
    rows = pd.read_csv(REPO_ROOT / "results/paper/zipfusion_engine_profile.csv")
    return rows[rows.overlap].reset_index(drop=True) if "overlap" in rows else rows


def test_step_table_takes_a_separate_profile_when_the_run_has_none(tmp_path):
    from zipkv.study.chapters import throughput as chapter
    from zipkv.study.book import REPO_ROOT
    csv = REPO_ROOT / "results/paper/zipfusion_engine_profile.csv"
    import pandas as pd
    unprofiled = _profiled_rows().drop(columns=["replay_ms", "host_ms"])
    steps, note = chapter.step_table(unprofiled, csv)
    assert str(csv) in note and len(steps) == len(pd.read_csv(csv))
    kernels = steps[["attention_ms", "gemm_ms", "restore_ms", "kv_write_ms", "other_ms"]].sum(axis=1)
    assert ((steps.gaps_ms - (steps.replay_ms - kernels)).abs() < 1e-9).all()
    assert chapter.step_table(unprofiled, tmp_path / "absent.csv")[0].empty
    assert len(chapter.step_section(unprofiled, tmp_path / "absent.csv")) == 1


def test_step_text_states_the_measured_ratio():
    from zipkv.study.chapters import throughput as chapter
    steps, note = chapter.step_table(_profiled_rows())
    assert note == ""                                        # the rows carry their own breakdown
    u = steps[steps.method == "uncompressed"].sort_values("batch").iloc[-1]
    z = steps[steps.method == "zipfusion"].sort_values("batch").iloc[-1]
    assert f"= {z.batch / u.batch * u.step_ms / z.step_ms:.3f}×" in chapter.step_text(steps)


def test_step_text_says_how_fast_each_kernel_reads_its_bytes():
    from zipkv.study.chapters import throughput as chapter
    steps, _ = chapter.step_table(_profiled_rows())
    u = steps[steps.method == "uncompressed"].sort_values("batch").iloc[-1]
    z = steps[steps.method == "zipfusion"].sort_values("batch").iloc[-1]
    text = chapter.step_text(steps)
    raw_mb = (8192 + u.timed_steps + 1) * 2 * 8 * 128 * 2 / 1e6                # K and V of every cached token, bf16
    assert f"the uncompressed kernel reads {raw_mb:.1f} MB at " in text
    share = z.attention_us_per_request_layer / u.attention_us_per_request_layer
    assert f"in {share:.0%} of the raw kernel's time" in text
    packed_mb = float(text.split("ZipFusion's ")[-1].split(" MB")[0])
    assert packed_mb < raw_mb * z.stored_bits_per_value / 16 + 0.1


def test_idle_gaps_charge_each_wait_to_the_kernel_after_it():
    import pytest
    from zipkv.bench.engine import idle_gaps
    # two replays of a 3-kernel graph (ns): gemm, then a 2 µs wait before attention, then argmax overlapping it
    one = [("nvjet_gemm", 0, 1000), ("_pipelined_kernel", 3000, 9000), ("argmax", 8000, 9500)]
    kernels = one + [(n, a + 10_000, b + 10_000) for n, a, b in one]       # 500 ns between the replays
    out = idle_gaps(list(reversed(kernels)), replays=2)                    # any order
    assert out["gap_ms"]["attention"] == pytest.approx(2e-3)               # 2 µs per replay
    assert out["gap_ms"]["other"] == 0.0                                   # argmax overlaps: no wait
    assert out["gap_ms"]["gemm"] == pytest.approx(0.5e-3 / 2)              # the next replay's launch
    before, after, ms, count = out["top_gaps"][0]
    assert (before, after, count) == ("nvjet_gemm", "_pipelined_kernel", 1.0) and ms == pytest.approx(2e-3)
    assert idle_gaps([], replays=1)["top_gaps"] == []
    with pytest.raises(ValueError, match="replays"):
        idle_gaps(one, replays=0)


def test_step_text_says_where_the_idle_time_sits():
    from zipkv.study.chapters import throughput as chapter
    rows = _profiled_rows().drop(columns=["launch_ms"], errors="ignore")      # added below
    rows[[c for c in rows.columns if c.startswith("gap_before_")]] = 0.0
    rows["gap_before_attention_ms"] = [0.1, 0.2, 0.3, 0.9]
    rows["gap_before_gemm_ms"] = [0.05, 0.05, 0.05, 0.4]
    steps, _ = chapter.step_table(rows)
    text = chapter.step_text(steps)
    z = steps[steps.method == "zipfusion"].sort_values("batch").iloc[-1]
    assert f"ZipFusion at batch {z.batch} 0.90 ms before attention kernels, 0.40 ms before gemm kernels" in text
    assert f"({0.9 + 0.4:.2f} ms between kernels in all)" in text
    short = {m: r.gaps_ms - r.gap_before_attention_ms - r.gap_before_gemm_ms for m, r in
             ((m, steps[steps.method == m].sort_values("batch").iloc[-1]) for m in ("uncompressed", "zipfusion"))}
    for m, ms in short.items():                                  # replay idle time the profiled gaps do not cover
        assert (f"{m} {ms:.2f} ms" in text) == (ms > 0.1), (m, ms)
    assert "gap_before" not in chapter.step_text(chapter.step_table(_profiled_rows())[0])
    assert "does not place" in text or not any(ms > 0.1 for ms in short.values())
    rows["launch_ms"] = [0.11, 0.12, 0.13, 1.14]                # the host's graph launch, measured with the replays
    steps, _ = chapter.step_table(rows)
    text = chapter.step_text(steps)
    u = steps[steps.method == "uncompressed"].sort_values("batch").iloc[-1]
    said = f"the host takes {u.launch_ms:.2f} ms (uncompressed) and 1.14 ms (ZipFusion) to launch each timed replay"
    assert (said in text) == any(ms > 0.1 for ms in short.values()) and "does not place" not in text


def test_step_text_reads_the_overlapped_rows_and_says_what_the_sequential_ones_take():
    import pandas as pd
    from zipkv.study.chapters import throughput as chapter
    rows = _profiled_rows()
    seq = rows.assign(step_ms=rows.step_ms + [1.0, 2.0, 3.0, 4.0], overlap=False)
    steps, _ = chapter.step_table(pd.concat([rows.assign(overlap=True), seq], ignore_index=True))
    text = chapter.step_text(steps)
    assert text.startswith(chapter.step_text(chapter.step_table(rows)[0]))     # the overlapped rows, as before
    last = lambda t, m: t[t.method == m].sort_values("batch").iloc[-1]                # noqa: E731
    su, sz = last(seq, "uncompressed"), last(seq, "zipfusion")
    assert f"takes {su.step_ms:.1f} ms uncompressed and {sz.step_ms:.1f} ms ZipFusion " \
           f"({sz.batch / su.batch * su.step_ms / sz.step_ms:.3f}× tokens/s)" in text
    assert "overlap=False" not in chapter.step_text(chapter.step_table(rows.assign(overlap=True))[0])


def test_step_text_says_which_way_the_idle_time_moves_with_the_batch():
    """The idle time between kernels is said to grow or shrink as the rows show: the same rows with 5 ms more
    idle time at each method's largest batch, then at its smallest."""
    from zipkv.study.chapters import throughput as chapter
    rows = _profiled_rows()
    largest = rows.batch == rows.groupby("method").batch.transform("max")
    for at, word in ((largest, "grows"), (~largest, "shrinks")):
        steps, _ = chapter.step_table(rows.assign(replay_ms=rows.replay_ms + 5.0 * at))
        assert f"idle time between the graph's kernels {word} with the batch" in chapter.step_text(steps)
    assert chapter._trend(1.0, 2.0, 1.0, 3.0) == "grows" and chapter._trend(2.0, 1.0, 1.0, 3.0) == "changes"
    assert [chapter._moves(r) for r in (1.1, 0.97, 1.001)] == ["grows 1.10×", "shrinks to 0.97×", "stays (1.00×)"]
