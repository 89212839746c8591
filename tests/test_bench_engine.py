"""zipkv.bench.engine: the decode-step breakdown (the GPU part runs in the throughput chapter)."""
def test_kernel_kind_sorts_a_step_s_kernels():
    from zipkv.bench.engine import kernel_kind
    names = {"_pipelined_kernel": "attention", "_decode_kernel": "attention", "_merge_kernel": "attention",
             "_splitzip_words_kernel": "restore", "_huffman_kernel": "restore",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_128x64": "gemm",
             "void at::native::index_put_kernel_impl": "kv_write", "triton_poi_fused_mul_0": "other"}
    assert {n: kernel_kind(n) for n in names} == names
