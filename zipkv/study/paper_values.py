"""The papers' published numbers, printed beside ours in every reproduced table.

These are transcriptions of the papers (``shared/papers/``), not results of this study; each
constant names the table or section it comes from.
"""
from __future__ import annotations

import pandas as pd

KVSCULPT_MODEL = "Qwen2.5-1.5B-Instruct"
ZIPFUSION_GPU = "H100"
KVSCULPT_GPU = "A100"
"""§7: the card of KVSculpt's timings (its seconds per context)."""

# KVSculpt Table 1 (tab:main): mean KL over 5 PG19 sequences, N = 2048, m = 256.
KVSCULPT_TABLE1 = {
    "random": {0.3: 2.50, 0.5: 1.80, 0.7: 1.54},
    "attention_score": {0.3: 2.54e-1, 0.5: 2.04e-1, 0.7: 1.39e-1},
    "select_fit": {0.3: 2.33e-1, 0.5: 1.86e-1, 0.7: 1.25e-1},
    "joint_opt": {0.3: 2.24e-1, 0.5: 1.80e-1, 0.7: 1.15e-1},
    "kvsculpt": {0.3: 5.75e-2, 0.5: 4.63e-2, 0.7: 3.58e-2},
}
# Its last row, "vs. Select+Fit" (as printed, rounded by the authors).
KVSCULPT_TABLE1_IMPROVEMENT = {0.3: 4.1, 0.5: 4.0, 0.7: 3.5}

# KVSculpt Table 2 (tab:per_seq): per-sequence KL at r = 0.3, with the paper's easy/hard labels.
KVSCULPT_TABLE2 = pd.DataFrame({
    "window": [0, 1, 2, 3, 4],
    "label": ["easy", "hard", "hard", "easy", "easy"],
    "select_fit": [1.28e-1, 1.39e-1, 2.61e-1, 3.92e-1, 2.46e-1],
    "kvsculpt": [8.1e-3, 1.17e-1, 1.43e-1, 9.7e-3, 9.6e-3],
    "improvement": [15.8, 1.2, 1.8, 40.5, 25.5],
})
KVSCULPT_EASY_KL = 0.01
"""§5.1: a sequence is *easy* when KVSculpt's KL at r = 0.3 is below this."""
KVSCULPT_SELECT_FIT_ABOVE = 0.1
"""§5.1: "Select+Fit remains at KL > 0.1 for all sequences, including the easy ones" (r = 0.3)."""
KVSCULPT_ADAM_KL_RANGE = (8, 15)
"""§5.2: Adam's per-layer MSE "translates to 8–15× worse end-to-end KL on easy sequences"."""

KVSCULPT_TABLE1_SEQUENCES = 5
"""Table 1 and Table 2 average over 5 PG19 sequences."""

# KVSculpt Appendix A (tab:full_baseline): KL mean ± std over 20 sequences.
KVSCULPT_APPENDIX_SEQUENCES = 20
KVSCULPT_APPENDIX = {
    "random": {0.1: (3.43, 1.21), 0.3: (2.60, 0.45), 0.5: (2.06, 0.62), 0.7: (1.83, 0.57)},
    "attention_score": {0.1: (0.322, 0.105), 0.3: (0.198, 0.084), 0.5: (0.137, 0.065), 0.7: (0.086, 0.056)},
    "select_fit": {0.1: (0.322, 0.107), 0.3: (0.185, 0.076), 0.5: (0.129, 0.057), 0.7: (0.080, 0.050)},
    "joint_opt": {0.1: (0.311, 0.113), 0.3: (0.182, 0.073), 0.5: (0.121, 0.058), 0.7: (0.073, 0.047)},
}

# KVSculpt §7: seconds to compress one 2048-token context (A100).
KVSCULPT_SECONDS_PER_CONTEXT = 170.0

# ZipFusion §IV-B / Fig. 4: decode attention at 8192 tokens, batch 64 (µs, H100).
ZIPFUSION_ATTENTION_8192x64 = {
    "Llama-3.1-8B": {"flashinfer": 704.6, "zipfusion": 562.7},
    "Qwen3-8B": {"flashinfer": 704.8, "zipfusion": 562.5},
}
ZIPFUSION_SPEEDUP_RANGE = (1.23, 1.25)
"""§IV-B: speedup over FlashInfer across both models, contexts 2048/8192 and batches 32/64/96."""
ZIPFUSION_COMPRESSED_BYTES_FRACTION = 0.75
"""§III-B: an eligible 512-value block takes 768 of 1024 bytes (excluding metadata)."""

# ZipFusion §I / §II-B: Llama-3.1-8B, 2048-token inputs, batch 32, one H100, each codec restoring one layer
# into a shared buffer before FlashInfer attention: decompression per decode step, and the rest of the
# instrumented time (near-constant across the three codecs).
ZIPFUSION_RESTORE_MS_RANGE = (5.3, 30.8)
ZIPFUSION_RESTORE_OTHER_MS = 10.9
ZIPFUSION_RESTORE_FRACTION_RANGE = (0.327, 0.738)
"""§I: decompression's share of decode time in that configuration (32.7 % to 73.8 %)."""
# SplitZip (arXiv 2605.01708), as its abstract reports on real BF16 KV (Triton codec, its GPU).
SPLITZIP_ENCODE_GBPS = 613.3
SPLITZIP_DECODE_GBPS = 2181.8
SPLITZIP_BITS_PER_VALUE = 12.0
"""Its dense format: a 4-bit code + the sign/mantissa byte (escapes extra)."""
DFLOAT11_BITS_PER_VALUE = 11.0
"""DFloat11 (arXiv 2504.11651): about 11 bits per value on BF16 weights; it prints no single decode GB/s."""
ZIPFUSION_BITS_PER_VALUE = 12
"""§III-B: an eligible block stores 12 bits per value (low byte + 4-bit code), metadata excluded."""

# ZipFusion §IV-C / Fig. 5: decode throughput, 8192 input + 256 output tokens, same memory budget.
ZIPFUSION_MAX_BATCH = {"Llama-3.1-8B": {"uncompressed": 46, "zipfusion": 57},
                       "Qwen3-8B": {"uncompressed": 40, "zipfusion": 50}}
ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH = {"Llama-3.1-8B": 0.263, "Qwen3-8B": 0.258}
"""Tokens/s of ZipFusion at its largest batch over uncompressed SGLang at its largest batch, minus 1."""
ZIPFUSION_VS_BEST_LOSSLESS_BASELINE = {"Llama-3.1-8B": 2.76, "Qwen3-8B": 2.61}
"""Abstract / §I: throughput at each method's largest batch over the best lossless-compression baseline."""
ZIPFUSION_TOKENS_PER_S_BATCH32 = {"Llama-3.1-8B": 2044, "Qwen3-8B": 1882}
ZIPFUSION_GAIN_BATCH32 = {"Llama-3.1-8B": 0.153, "Qwen3-8B": 0.152}
"""§IV-C: at batch 32, tokens/s over uncompressed SGLang, minus 1."""
ZIPFUSION_VS_SPLITZIP_BATCH32 = {"Llama-3.1-8B": 2.51, "Qwen3-8B": 2.57}

# --- KVSculpt analyses: abstract, §3.3, Tables 3-8, Appendix B, §6 ------------------------------------------

KVSCULPT_LAYER_PILOT_MSE_SPREAD = 100.0
"""Abstract: per-layer pilot MSE varies by up to 100× across layers."""

# KVSculpt §3.3: statistics of de-RoPE'd query content vectors.
KVSCULPT_QUERY_STATS = {
    "consecutive_cosine": (0.91, 0.93),
    "decode_variance_captured": (0.81, 0.86),
    "captured_decay_per_2048": 0.02,
    "effective_dim": 60,
    "head_dim": 128,
}

# KVSculpt Table 3 (tab:optimizer): per-layer MSE at r = 0.3 (Qwen2.5-1.5B layers 2, 14, 26);
# oracle = best of 100 random restarts.
KVSCULPT_TABLE3 = pd.DataFrame({
    "layer": [2, 14, 26],
    "adam": [1.78e-3, 7.97e-2, 1.14e-1],
    "lbfgs": [1.05e-4, 1.28e-3, 1.20e-3],
    "oracle": [9.67e-5, 1.20e-3, 1.18e-3],
    "gap": [0.08, 0.07, 0.02],
})
KVSCULPT_TABLE3_RESTARTS = 100
KVSCULPT_TABLE3_ADAM_RANGE = (17, 95)
"""§5.2: Adam's per-layer MSE is 17–95× L-BFGS's."""
KVSCULPT_TABLE3_GAP_RANGE = (0.02, 0.08)
"""§5.2: one L-BFGS run is within 2–8 % of the 100-restart oracle."""

# KVSculpt Table 4 (tab:query_ablation): attention cosine at near (128) and far (4096 tokens) horizons.
KVSCULPT_TABLE4 = pd.DataFrame({
    "strategy": ["bootstrap", "uniform", "random", "kmeans", "farthest"],
    "near": [0.950, 0.948, 0.948, 0.947, 0.925],
    "far": [0.737, 0.759, 0.756, 0.756, 0.758],
})
KVSCULPT_TABLE4_HORIZONS = {"near": 128, "far": 4096}

# KVSculpt Table 5 (tab:vnorm): ‖V‖^0.5 per-layer allocation vs uniform, r = 0.3.
KVSCULPT_TABLE5 = pd.DataFrame({
    "window": [0, 1, 2, 3, 4],
    "uniform_kl": [8.1e-3, 1.17e-1, 1.43e-1, 9.7e-3, 9.6e-3],
    "vs_uniform": [1.05, 0.75, 1.73, 0.84, 1.23],
})
KVSCULPT_TABLE5_MEAN = 1.27
"""Table 5's mean row: mean KL with ‖V‖^0.5 over mean uniform KL (5.75e-2)."""

# KVSculpt Table 6 (tab:pilot): 60-step pilot-MSE^0.5 per-layer allocation vs uniform, r = 0.3.
KVSCULPT_TABLE6 = pd.DataFrame({
    "window": [0, 1, 2, 3, 4],
    "uniform_kl": [8.14e-3, 1.170e-1, 1.433e-1, 9.67e-3, 9.59e-3],
    "pilot_kl": [8.93e-3, 7.01e-2, 1.208e-1, 8.64e-3, 7.77e-3],
    "vs_uniform": [1.10, 0.60, 0.84, 0.89, 0.81],
})
KVSCULPT_TABLE6_MEAN = 0.75
KVSCULPT_TABLE6_WINS = (4, 5)
"""Table 6: pilot allocation beats uniform on 4 of 5 sequences."""
KVSCULPT_ADAPTIVE_GAIN = 1.3
"""Abstract and §8: adaptive allocation gives "an additional 1.3× KL reduction" (1 / 0.75)."""

# KVSculpt Table 7 (tab:head_asym): per-head pilot MSE ratio within a layer (2 KV heads).
KVSCULPT_TABLE7 = pd.DataFrame({
    "window": [0, 1, 2, 3, 4],
    "mean_ratio": [21.5, 5.5, 6.1, 3.7, 6.2],
    "max_ratio": [467.0, 31.0, 33.0, 17.0, 56.0],
    "layer_of_max": [0, 15, 15, 15, 15],
})
KVSCULPT_HEAD_PILOT_MSE_MAX_RATIO = float(KVSCULPT_TABLE7.max_ratio.max())
"""Abstract / Table 7: the two KV heads of one layer differ in pilot MSE by up to 467×."""

# KVSculpt Table 8 (tab:perhead): 30-step per-head pilot; per layer vs per layer + head, relative to uniform.
KVSCULPT_TABLE8 = pd.DataFrame({
    "window": [0, 1, 2, 3, 4],
    "per_layer_vs_uniform": [0.82, 1.37, 0.88, 0.87, 1.77],
    "per_layer_head_vs_uniform": [0.81, 1.15, 0.84, 0.86, 0.75],
})
KVSCULPT_TABLE8_MEAN = {"per_layer_vs_uniform": 1.05, "per_layer_head_vs_uniform": 0.92}

# KVSculpt Appendix B (tab:exponent): ‖V‖^α per-layer allocation on Seq 1, r = 0.3 (k_min, k_max: per-layer budgets).
KVSCULPT_APPENDIX_B = pd.DataFrame({
    "alpha": [0.0, 0.3, 0.5, 0.7, 1.0],
    "kl": [1.170e-1, 1.175e-1, 8.83e-2, 1.328e-1, 9.27e-2],
    "vs_uniform": [1.00, 1.00, 0.75, 1.14, 0.79],
    "k_min": [358, 277, 231, 191, 140],
    "k_max": [358, 480, 578, 689, 880],
})
KVSCULPT_BEST_ALPHA = 0.5
KVSCULPT_APPENDIX_B_PILOT = {0.5: 0.75, 1.0: 0.97}
"""Appendix B / §5.4: pilot-MSE^α allocation, mean KL vs uniform over 5 sequences."""

# KVSculpt §6: error propagation and per-token KL concentration.
KVSCULPT_ERROR_GROWTH = {"easy": 220.0, "hard": 5800.0}
"""§6.1: hidden-state MSE grows 220× (easy) to up to 5800× (hard) from the first to the last layer."""
KVSCULPT_TOP5_KL_SHARE = 0.82
"""§6.2: on the hardest sequence at r = 0.3, 82 % of the KL is in 5 of 128 tokens."""
KVSCULPT_TOKEN_KL = {"max": 7.17, "mean": 0.117, "max_over_mean": 61.0}
"""§6.2: the hardest sequence's max and mean per-token KL (a 61× ratio)."""
KVSCULPT_LAYER0_MSE_OVER_MEDIAN = (10.0, 100.0)
"""§3.5 / §5.4: Layer 0's pilot MSE is 10–100× the median layer's."""
KVSCULPT_JOINT_OPT_GAIN = 1.04
"""§7 Discussion: eviction-to-joint-optimization gap (Select+Fit KL over Joint Opt KL)."""
