"""A tiny random Gemma 3 for the CPU tests (no download): sliding-window and global layers, one RoPE per
layer type, ``query_pre_attn_scalar`` ≠ ``head_dim``, like Gemma-3-270M's structure at toy size."""
import torch

WINDOW = 16
"""Its sliding layers' window: a query at ``p`` sees keys at positions ``> p − 16``."""


def tiny_gemma(*, seed: int = 0, kv_heads: int = 2):
    """Three layers (sliding, global, sliding), 4 query heads over ``kv_heads`` KV heads of 16 dims, RoPE base
    10,000 on sliding and 1,000,000 on global layers, queries scaled by ``24^-1/2`` (not ``16^-1/2``); q/k norm
    weights raised so that attention is not near-uniform."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(2.0)   # Gemma's RMSNorm scales by (1 + weight)
            layer.self_attn.k_norm.weight.fill_(2.0)
    return model
