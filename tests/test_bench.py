"""The CPU-checkable parts of the GPU benchmarks (the timings themselves run on the device)."""
import pandas as pd
import pytest
import torch

from zipkv import bench


def test_measured_fraction_reads_the_first_chapter_table(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame({"layer": [0, 1], "K_token": [0.5, 0.7], "K_channel": [0.0, 0.0],
                  "V_token": [0.9, 1.0], "V_channel": [0.0, 0.0]}).to_csv(path, index=False)
    assert bench.measured_compressible_fraction(path) == pytest.approx({"K": 0.6, "V": 0.95})
    assert bench.measured_compressible_fraction(path, "channel") == {"K": 0.0, "V": 0.0}


def test_mix_mask_compresses_the_requested_fraction_of_k_and_v_blocks():
    mask = bench._mix_mask(batch=4, kv_heads=8, ctx=1024, head_dim=128, fraction={"K": 0.2, "V": 0.9}, seed=0)
    assert mask.shape == (4 * 1024 // 16, 2, 8, 4) and mask.dtype == torch.bool
    assert mask[:, 0].float().mean().item() == pytest.approx(0.2, abs=0.02)
    assert mask[:, 1].float().mean().item() == pytest.approx(0.9, abs=0.02)


def test_unknown_shape_or_method_is_a_clear_error():
    with pytest.raises(ValueError, match="shape='gpt5'"):
        bench.attention_benchmark("gpt5")
    with pytest.raises(ValueError, match="unknown"):
        bench.attention_benchmark(methods=("zipkv_compressed", "vllm"))
