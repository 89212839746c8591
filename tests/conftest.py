import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # Without a GPU the Triton kernels run only in Triton's interpreter, chosen before triton is
    # imported (zipkv itself never sets it: see zipkv/kernels/__init__.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist's workers share the cores: torch's intra-op threads divided among them, not multiplied
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct in fp32 on the CPU, loaded once per test session."""
    from zipkv.models import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(embedded):
    return embedded[1]


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny matrices run several times faster on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llama(*, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seed: int = 0, sharpen_logits: bool = False):
    """A 2-layer random Llama with sharper attention than the 0.02-std init (Q/K/V weights × 20),
    so distillation problems are not uniform attention; ``sharpen_logits`` also scales the LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=q_heads * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(20.0)
        if sharpen_logits:
            model.lm_head.weight.mul_(20.0)
    return model
