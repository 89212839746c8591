"""The engine's few-long-requests run (the latency chapter's panel in the engine), on the CPU at a tiny Llama shape."""
from zipkv.study.experiments import throughput

TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=1000)


def test_few_requests_rows_per_context_batch_and_method_with_provenance():
    t = throughput.few_requests(device="cpu", contexts=(80,), batches=(1, 2), new_tokens=4, embedded=False,
                                kv_windows=1, kv_window_context=256, model_overrides=TINY, progress=False)
    assert list(zip(t.batch, t.method)) == [(1, "uncompressed"), (1, "zipfusion"), (2, "uncompressed"), (2, "zipfusion")]
    assert (t.context == 80).all() and (t.tokens_per_s > 0).all() and t.device.notna().all()
    z, u = t[t.method == "zipfusion"], t[t.method == "uncompressed"]
    assert (z.frac_compressed_k > 0).all() and (u.frac_compressed_k == 0).all()   # the prefix compressed, or not
    assert (t.kv_budget_bytes.values[::2] == t.kv_budget_bytes.values[1::2]).all()  # one budget per point
