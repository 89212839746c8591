"""zipkv.kernels.fused_ops: the decode step's fused norm, rotary and SiLU-product kernels give what the Hugging Face
modules they replace give, bit for bit.

On the CPU they run under TRITON_INTERPRET=1 against the modules' CPU arithmetic; on a GPU against their CUDA
arithmetic (where RMSNorm's fp32 sum of squares may differ in order: at most one BF16 step, rarely)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

from zipkv.kernels import fused_ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def same_bits(a, b):
    """Equal BF16 bit patterns, any NaN equal to any NaN (PyTorch's CPU and CUDA conversions spell NaN
    differently)."""
    nan = a.isnan() & b.isnan()
    return (a.view(torch.int16) == b.view(torch.int16)) | nan


def bf16_steps(a, b):
    """How many BF16 steps apart ``a`` and ``b`` are (finite values of one sign, or equal)."""
    ia, ib = (t.view(torch.int16).int() for t in (a, b))
    return torch.where(same_bits(a, b), 0, (ia - ib).abs())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy overflows on the inf/nan patterns, as intended
def test_the_residual_add_rounds_every_bf16_pattern_as_pytorch_does():
    """``h + delta`` over all 65,536 BF16 patterns of ``h`` against deltas that make ties, overflows, NaNs and
    cancellations: rounding to nearest even, to +-inf past the largest value, NaN for NaN."""
    h = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(64, 1024).to(DEV)
    for delta in (1.0, 2.0 ** -8, 3 * 2.0 ** -9, -1.5, 3.0e38, -3.0e38, float("inf"), float("nan"), 1e-40):
        d = torch.full_like(h, delta)
        d[::2] = torch.randn(32, 1024, device=DEV).bfloat16() * abs(delta if delta == delta else 1.0)
        out, _ = fused_ops.add_rms_norm(h, d, torch.ones(1024, dtype=torch.bfloat16, device=DEV), 1e-6)
        ref = h + d
        ok = same_bits(out, ref)
        assert ok.all(), f"delta {delta}: {(~ok).sum().item()} sums differ, e.g. {h[~ok][:3]} + {d[~ok][:3]}"


@pytest.mark.parametrize("hidden", [576, 4096])
def test_add_rms_norm_is_llama_rmsnorm_of_the_residual_sum(hidden):
    g = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(DEV, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    h = (torch.randn(7, hidden, generator=g) * 4).bfloat16().to(DEV)
    d = (torch.randn(7, hidden, generator=g) * torch.logspace(-3, 3, 7)[:, None]).bfloat16().to(DEV)
    h_out, x = fused_ops.add_rms_norm(h, d, norm.weight.data, norm.variance_epsilon)
    assert torch.equal(h_out, h + d)
    with torch.no_grad():
        ref = norm(h + d)
    steps = bf16_steps(x, ref)
    assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.999, steps.max()
    same_h, x0 = fused_ops.add_rms_norm(h, None, norm.weight.data, norm.variance_epsilon)
    assert same_h is h and bf16_steps(x0, norm(h).detach()).max() <= 1


@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 32)])
def test_rotary_is_apply_rotary_pos_emb_bit_for_bit(q_heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k = ((torch.randn(5, h, head_dim, generator=g) * 3).bfloat16().to(DEV) for h in (q_heads, kv_heads))
    angle = torch.randn(5, head_dim, generator=g) * 100
    cos, sin = angle.cos().bfloat16().to(DEV), angle.sin().bfloat16().to(DEV)
    q_out, k_out = fused_ops.rotary(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy overflows on the inf/nan patterns, as intended
def test_silu_mul_is_the_llama_mlp_product():
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(6, 1536, generator=g) * torch.logspace(-2, 1.5, 6)[:, None]).bfloat16().to(DEV)
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    up = (torch.randn(6, 1536, generator=g) * 2).bfloat16().to(DEV)
    out = fused_ops.silu_mul(gate, up)
    steps = bf16_steps(out, torch.nn.functional.silu(gate) * up)
    assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.999, steps.max()


@pytest.mark.parametrize("call, error, match", [
    (lambda t: fused_ops.add_rms_norm(t.float(), None, t[0], 1e-5), ValueError, "h must be a contiguous bf16"),
    (lambda t: fused_ops.add_rms_norm(t, t[:, :8].contiguous(), t[0], 1e-5), ValueError, r"delta must have shape \(4, 16\)"),
    (lambda t: fused_ops.add_rms_norm(t, None, t[0, :8], 1e-5), ValueError, r"weight must have shape \(16,\)"),
    (lambda t: fused_ops.add_rms_norm(t, None, t[0], float("nan")), ValueError, "eps must be a finite number"),
    (lambda t: fused_ops.add_rms_norm(t.t(), None, t[:, 0], 1e-5), ValueError, "not contiguous"),
    (lambda t: fused_ops.rotary(t.view(4, 2, 8), t.view(4, 2, 8)[:, :, :4], t[:, :8], t[:, :8]), ValueError,
     "k must be"),
    (lambda t: fused_ops.rotary(t.view(4, 4, 4)[:, :, :3].contiguous(), t.view(4, 4, 4)[:, :, :3].contiguous(),
                                t[:, :3].contiguous(), t[:, :3].contiguous()), ValueError, "power of two"),
    (lambda t: fused_ops.rotary(t.view(4, 2, 8), t.view(4, 2, 8), t[:3, :8].contiguous(), t[:, :8]), ValueError,
     r"cos must have shape \(4, 8\)"),
    (lambda t: fused_ops.silu_mul(t, t[:2]), ValueError, r"up must have shape \(4, 16\)"),
    (lambda t: fused_ops.silu_mul(t.tolist(), t), TypeError, "gate must be a torch.Tensor, got list"),
])
def test_bad_input_is_refused_before_launching(call, error, match):
    t = torch.ones(4, 16, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(error, match=match):
        call(t)
