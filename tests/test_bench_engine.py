"""zipkv.bench.engine: the decode-step breakdown (the GPU part runs in the throughput chapter)."""


def test_kernel_kind_sorts_a_step_s_kernels():
    from zipkv.bench.engine import kernel_kind
    names = {"_pipelined_kernel": "attention", "_decode_kernel": "attention", "_merge_kernel": "attention",
             "_splitzip_words_kernel": "restore", "_huffman_kernel": "restore",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_128x64": "gemm",
             "void at::native::index_put_kernel_impl": "kv_write", "triton_poi_fused_mul_0": "other"}
    assert {n: kernel_kind(n) for n in names} == names


def _profiled_rows():
    import pandas as pd
    from zipkv.book import REPO_ROOT
    return pd.read_csv(REPO_ROOT / "results/paper/zipfusion_engine_profile.csv")


def test_step_table_takes_a_separate_profile_when_the_run_has_none(tmp_path):
    from zipkv import throughput
    from zipkv.book import REPO_ROOT
    csv = REPO_ROOT / "results/paper/zipfusion_engine_profile.csv"
    unprofiled = _profiled_rows().drop(columns=["replay_ms", "host_ms"])
    steps, note = throughput.step_table(unprofiled, csv)
    assert str(csv) in note and len(steps) == len(unprofiled)
    kernels = steps[["attention_ms", "gemm_ms", "restore_ms", "kv_write_ms", "other_ms"]].sum(axis=1)
    assert ((steps.gaps_ms - (steps.replay_ms - kernels)).abs() < 1e-9).all()
    assert throughput.step_table(unprofiled, tmp_path / "absent.csv")[0].empty
    assert len(throughput.step_section(unprofiled, tmp_path / "absent.csv")) == 1


def test_step_text_states_the_measured_ratio():
    from zipkv import throughput
    steps, note = throughput.step_table(_profiled_rows())
    assert note == ""                                        # the rows carry their own breakdown
    u = steps[steps.method == "uncompressed"].sort_values("batch").iloc[-1]
    z = steps[steps.method == "zipfusion"].sort_values("batch").iloc[-1]
    assert f"= {z.batch / u.batch * u.step_ms / z.step_ms:.3f}×" in throughput.step_text(steps)
