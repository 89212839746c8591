"""The CPU-checkable parts of the GPU benchmarks (the timings themselves run on the device)."""
import pandas as pd
import pytest
import torch

from zipkv import bench, models
from zipkv.bench import attention, baselines


def test_measured_fraction_reads_the_first_chapter_table(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame({"layer": [0, 1], "K_token": [0.5, 0.7], "K_channel": [0.0, 0.0],
                  "V_token": [0.9, 1.0], "V_channel": [0.0, 0.0]}).to_csv(path, index=False)
    assert bench.measured_compressible_fraction(path) == pytest.approx({"K": 0.6, "V": 0.95})
    assert bench.measured_compressible_fraction(path, "channel") == {"K": 0.0, "V": 0.0}


def test_mix_mask_compresses_the_requested_fraction_of_k_and_v_blocks():
    mask = attention.mix_mask(batch=4, kv_heads=8, ctx=1024, head_dim=128, fraction={"K": 0.2, "V": 0.9}, seed=0)
    assert mask.shape == (4 * 1024 // 16, 2, 8, 4) and mask.dtype == torch.bool
    assert mask[:, 0].float().mean().item() == pytest.approx(0.2, abs=0.02)
    assert mask[:, 1].float().mean().item() == pytest.approx(0.9, abs=0.02)


def test_flashinfer_pages_share_zipkv_page_table():
    """FlashInfer's NHD pages sit at the physical ids of build_paged_cache's page table."""
    from zipkv.paged import build_paged_cache, physical_page_ids

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 48, 64, generator=gen).to(torch.bfloat16)
    _, _, indices, _ = build_paged_cache(k, k, seed=5)
    physical = physical_page_ids(6, seed=5)
    assert torch.equal(indices.long(), physical) and not torch.equal(physical, torch.arange(6))
    pages = baselines.nhd_pages(k, physical)                       # [6, 16, 3, 64]
    for logical, (b, j) in enumerate((b, j) for b in range(2) for j in range(3)):
        assert torch.equal(pages[physical[logical]], k[b, :, 16 * j:16 * (j + 1)].transpose(0, 1))


def test_paged_table_is_build_paged_caches_table_in_flashinfers_layout():
    """paged_table: build_paged_cache's CSR table (same seed, shuffled or not) and the pages at its physical ids."""
    from zipkv.paged import build_paged_cache

    k = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    v = k.flip(-1)
    for shuffle in (True, False):
        indptr, indices, last, kp, vp = baselines.paged_table(k, v, seed=5, shuffle=shuffle)
        _, zindptr, zindices, zlast = build_paged_cache(k, v, seed=5, shuffle=shuffle)
        assert all(torch.equal(a, b.to(a.dtype)) for a, b in ((indptr, zindptr), (indices, zindices), (last, zlast)))
        assert indices.dtype == torch.int32 and torch.equal(kp, baselines.nhd_pages(k, indices.long()))
        assert torch.equal(vp[indices[4].long()], v[1, :, 16:32].transpose(0, 1))     # request 1's second page
    with pytest.raises(ValueError, match="whole pages of 16 tokens, got T=40"):
        baselines.paged_table(k[:, :, :40], v[:, :, :40])


def test_unknown_shape_or_method_is_a_clear_error():
    with pytest.raises(ValueError, match="shape='gpt5'"):
        bench.attention_benchmark("gpt5")
    with pytest.raises(ValueError, match="unknown"):
        bench.attention_benchmark(methods=("zipkv_compressed", "vllm"))


def test_tuned_launch_options_are_stored_per_gpu_and_read_back(tmp_path, monkeypatch):
    from zipkv.kernels import decode_triton as da
    from zipkv.kernels import tuning

    file = tmp_path / "tuning.json"
    monkeypatch.setattr(tuning, "TUNING_FILE", file)
    assert da.launch_config("compressed", "GPU X") == da.DEFAULT_LAUNCH  # no file yet
    rows = [dict(path=p, pages_per_tile=ppt, num_warps=4, stages=3, maxnreg=0, programs_per_sm=2,
                 latency_us=us, device="GPU X") for p, ppt, us in
            [("compressed", 2, 5.0), ("compressed", 8, 4.0), ("raw", 4, 6.0), ("raw", 2, float("nan"))]]
    table = pd.DataFrame(rows)
    table["best"] = [False, True, True, False]
    entry = bench.write_tuning(table, file)
    assert entry["compressed"]["pages_per_tile"] == 8 and entry["raw"]["pages_per_tile"] == 4
    assert da.launch_config("compressed", "GPU X") == {**da.DEFAULT_LAUNCH, **entry["compressed"]}
    assert da.launch_config("mixed", "GPU X") == da.DEFAULT_LAUNCH  # not tuned: defaults
    assert da.launch_config("compressed", "GPU Y") == da.DEFAULT_LAUNCH  # another GPU model
    with pytest.raises(ValueError, match="path must be one of"):
        da.launch_config("fast")


def test_tuning_keeps_the_configuration_its_confirming_rounds_find_fastest():
    """A sweep's single medians pick the finalists; the rounds that time them again pick the best (a path
    without rounds falls back to its sweep, a path with no timed row has none)."""
    nan = float("nan")
    table = pd.DataFrame([dict(path="mixed", programs_per_sm=6, latency_us=85.6, confirm_us=89.7),
                          dict(path="mixed", programs_per_sm=12, latency_us=86.2, confirm_us=86.1),
                          dict(path="mixed", programs_per_sm=4, latency_us=117.2, confirm_us=nan),
                          dict(path="raw", programs_per_sm=6, latency_us=100.2, confirm_us=nan),
                          dict(path="raw", programs_per_sm=7, latency_us=100.1, confirm_us=nan),
                          dict(path="compressed", programs_per_sm=6, latency_us=nan, confirm_us=nan)])
    best = bench.choose_best(table)
    assert best[best.best].set_index("path").programs_per_sm.to_dict() == {"mixed": 12, "raw": 7}
    assert "best" not in table


def test_gluon_options_are_stored_per_head_dim_beside_the_triton_ones(tmp_path, monkeypatch):
    from zipkv.kernels import decode_mma, decode_triton, tuning

    file = tmp_path / "tuning.json"
    monkeypatch.setattr(tuning, "TUNING_FILE", file)
    triton_rows = pd.DataFrame([dict(path="raw", pages_per_tile=8, num_warps=4, stages=4, maxnreg=0, programs_per_sm=2,
                                     latency_us=1.0, best=True, device="GPU X")])
    bench.write_tuning(triton_rows, file)
    gluon_rows = pd.DataFrame([dict(kernel="gluon", path=p, programs_per_sm=8, stages=2, maxnreg=n, latency_us=us,
                                    best=b, head_dim=128, device="GPU X")
                               for p, n, us, b in [("mixed", 0, 5.0, False), ("mixed", 200, 4.0, True),
                                                   ("compressed", 0, 3.0, True)]])
    stored = bench.write_tuning(gluon_rows, file)
    assert stored["mixed"] == dict(programs_per_sm=8, stages=2, maxnreg=200)
    assert decode_mma.launch_config("mixed", "GPU X", 128) == {**decode_mma.MMA_LAUNCH, **stored["mixed"]}
    assert decode_mma.launch_config("mixed", "GPU X", 64) == decode_mma.MMA_LAUNCH      # not tuned at head_dim 64
    assert decode_mma.launch_config("raw", "GPU X", 128) == decode_mma.MMA_LAUNCH
    assert decode_mma.launch_config("mixed", None, 128) == decode_mma.MMA_LAUNCH          # not on a GPU
    # the Triton kernel's entry survived the Gluon write, and a second Triton write keeps the Gluon one
    assert decode_triton.launch_config("raw", "GPU X")["pages_per_tile"] == 8
    bench.write_tuning(triton_rows.assign(pages_per_tile=4), file)
    assert decode_triton.launch_config("raw", "GPU X")["pages_per_tile"] == 4
    assert decode_mma.launch_config("mixed", "GPU X", 128)["maxnreg"] == 200
    with pytest.raises(ValueError, match="head_dim"):
        tuning.tuned("GPU X", "mixed", kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        tuning.tuned("GPU X", "mixed", kernel="cuda")
    with pytest.raises(ValueError, match="path must be one of"):
        decode_mma.launch_config("fast")


def test_attention_shapes_are_the_models_shapes():
    """The benchmark's shapes are the model table's (no private copy), and the kernels timed at a head_dim are
    the ones whose layouts exist there."""
    assert bench.ATTENTION_SHAPES["llama3.1-8b"] is models.PAPER_MODELS["Llama-3.1-8B-Instruct"]
    assert bench.ATTENTION_SHAPES["smollm2-135m"] is models.EMBEDDED_SHAPE
    assert models.EMBEDDED_SHAPE.group_size == 3 and models.EMBEDDED_SHAPE.head_dim == 64
    assert attention.kernels_for(128) == ["gluon", "triton"]
    assert attention.kernels_for(64) == ["gluon", "triton"]          # SmolLM2's shape on the mma layouts too
    assert attention.kernels_for(32) == ["triton"]


def test_the_module_layout_keeps_the_old_names():
    """``python -m zipkv bench`` and the chapters call these through ``zipkv.bench``."""
    for name in ("attention_benchmark", "pack_benchmark", "measured_compressible_fraction", "tune_decode_attention",
                 "write_tuning", "nsight_report", "nsight_targets", "ColdTimer", "copy_bandwidth"):
        assert callable(getattr(bench, name)), name


def test_the_ncu_mix_target_reads_the_committed_mix():
    """``bench ncu`` profiles the Gluon kernel's MIXED path on the first chapter's measured mix: that table is
    committed and gives fractions strictly between all and nothing."""
    from zipkv.bench import nsight
    from zipkv.study.book import REPO_ROOT
    frac = bench.measured_compressible_fraction(REPO_ROOT / nsight.MIX_CSV)
    assert all(0.0 < f < 1.0 for f in frac.values()), frac


def test_an_ncu_report_is_read_by_the_targets_its_header_names():
    """A report parses by the names its header lists, in order; an older report that holds fewer kernels (one
    block and its name removed) parses by its own header, and one without that header line is held to the
    targets given."""
    import re
    from zipkv.study import nsight_report
    from zipkv.bench import nsight
    from zipkv.study.book import REPO_ROOT
    text = (REPO_ROOT / "results/paper/zipfusion_decode_ncu.txt").read_text()
    named = nsight_report.report_targets(text)
    got = nsight_report.parse(text, nsight.NCU_TARGETS, nsight.NCU_KERNELS, nsight.NCU_STALLS)
    blocks = re.split(rf"\n  (?={' |'.join(nsight.NCU_KERNELS)} )", text)
    assert list(got.metrics.columns) == named and len(named) == len(blocks) - 1 >= 2
    header = next(x for x in text.splitlines() if x.startswith("# kernels, in order: "))
    older = named[:1] + named[2:]
    old_header = header.replace("; ".join(named), "; ".join(older))
    old_text = "\n  ".join([blocks[0].replace(header, old_header)] + blocks[1:2] + blocks[3:])
    old = nsight_report.parse(old_text, nsight.NCU_TARGETS, nsight.NCU_KERNELS, nsight.NCU_STALLS)
    assert list(old.metrics.columns) == older
    assert old.metrics[named[2]].equals(got.metrics[named[2]])
    headless = "\n".join(x for x in old_text.splitlines() if not x.startswith("# kernels, in order: "))
    assert nsight_report.report_targets(headless) is None
    with pytest.raises(ValueError, match=f"report has {len(older)} kernel blocks, expected {len(nsight.NCU_TARGETS)}"):
        nsight_report.parse(headless, nsight.NCU_TARGETS, nsight.NCU_KERNELS, nsight.NCU_STALLS)


def test_gpu_samples_are_parsed_and_summarised_over_the_window_asked_for(monkeypatch):
    from zipkv.bench import power
    assert power.parse_sample("1980, 639.48, 0x0000000000000000") == (1980.0, 639.48, 0)
    assert power.parse_sample("1725, 695.95, 0x0000000000000004") == (1725.0, 695.95, 4)
    assert power.parse_sample("clocks.current.sm [MHz], power.draw [W], x") is None
    assert power.parse_sample("[N/A], 80.0, 0x0") is None
    s = power.summarize([(1980.0, 600.0, 0), (1725.0, 700.0, 4), (1900.0, 690.0, 4 | 1)])
    assert s == dict(sm_clock_mhz=1900.0, power_w=690.0, power_w_max=700.0, frac_power_capped=2 / 3)
    assert all(v != v for v in power.summarize([]).values())
    mon = power.GpuMonitor()
    mon.samples = [(10.0, (1980.0, 600.0, 0)), (19.5, (1700.0, 700.0, 4)), (20.0, (1750.0, 698.0, 4))]
    mon.end = 20.0
    assert mon.summary(1.0) == dict(sm_clock_mhz=1725.0, power_w=699.0, power_w_max=700.0, frac_power_capped=1.0)
    assert mon.summary()["frac_power_capped"] == 2 / 3
    monkeypatch.setattr(power.shutil, "which", lambda name: None)
    with power.GpuMonitor() as mon:                                 # no nvidia-smi: nothing sampled, NaNs
        pass
    assert not mon.available and all(v != v for v in mon.summary().values())
    for bad in (dict(index=-1), dict(index=True), dict(interval_ms=5)):
        with pytest.raises(ValueError, match="must be"):
            power.GpuMonitor(**bad)
