"""The FP8 KV-cache comparison (zipkv.bench.kv_fp8): e4m3 storage as the engines do it, ZipFusion's round trip, and
the KL table on a small model."""
import pytest
import torch

from conftest import tiny_llama
from zipkv.bench.kv_fp8 import E4M3_MAX, fp8_cache_kl, fp8_round_trip, zipfusion_round_trip


def test_e4m3_values_survive_and_others_round_to_the_nearest_e4m3_value():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    assert torch.equal(fp8_round_trip(grid), grid)                      # every e4m3 value is stored as it is
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    got = fp8_round_trip(x)
    nearest = grid[(x[:, None] - grid[None, :]).abs().argmin(1)]
    assert torch.equal(got.abs(), nearest.abs())                           # ties aside, the nearest e4m3 value
    assert 0 < (got - x).abs().max() <= x.abs().max() / 16                 # 3 mantissa bits: at most half an ulp


def test_unit_scale_saturates_and_the_per_layer_scale_keeps_the_largest_value():
    x = torch.tensor([1000.0, -3000.0, 1.0])
    assert fp8_round_trip(x).tolist() == [E4M3_MAX, -E4M3_MAX, 1.0]     # clamped, not NaN
    scaled = fp8_round_trip(x, "per_layer")
    assert scaled[1] == -3000.0 and scaled.isfinite().all()
    assert fp8_round_trip(torch.zeros(3), "per_layer").eq(0).all()


def test_zipfusion_round_trip_is_bit_exact_at_any_length():
    x = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[0, 5, :7] = torch.tensor([float("inf"), -0.0, 1e-40, 3e38, -3e38, 0.0, float("-inf")]).to(torch.bfloat16)
    back = zipfusion_round_trip(x)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scaling="):
        fp8_round_trip(torch.ones(2), "per_head")
    with pytest.raises(TypeError, match="x must be"):
        fp8_round_trip(torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="scalings="):
        fp8_cache_kl(None, [(torch.arange(8), torch.arange(4))], scalings=["nope"])
    with pytest.raises(ValueError, match="windows="):
        fp8_cache_kl(None, [])


def test_the_kl_table_is_zero_for_zipfusion_and_positive_for_fp8():
    model = tiny_llama(head_dim=32)
    g = torch.Generator().manual_seed(2)
    windows = [(torch.randint(0, model.config.vocab_size, (40,), generator=g),
                torch.randint(0, model.config.vocab_size, (8,), generator=g)) for _ in range(2)]
    table = fp8_cache_kl(model, windows, progress=False)
    assert list(table.format.unique()) == ["zipfusion", "fp8_e4m3 unit", "fp8_e4m3 per_layer"]
    ours, fp8 = table[table.format == "zipfusion"], table[table.format != "zipfusion"]
    assert (ours.kl == 0).all() and (ours.rel_error_k == 0).all() and (ours.top1_agreement == 1).all()
    assert (fp8.kl > 0).all() and (fp8.rel_error_k > 0).all() and (fp8.rel_error_v > 0).all()
    assert len(table) == 6 and set(table.window) == {0, 1}
