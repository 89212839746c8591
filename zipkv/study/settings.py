"""Settings defined once: the papers' experimental settings and this project's own targets.

Notebooks, profiles' documentation and benchmarks import these names instead of retyping numbers.
*Paper settings* are the papers' own (``shared/papers/``); *project targets* are bars this project
set itself (issues), never the papers' claims — chapters label them as ours.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVSculptSetting:
    """KVSculpt §4: context N, retain zone m, synthetic queries, L-BFGS steps, continuation tokens."""

    context: int = 2048
    m: int = 256
    n_synthetic: int = 128
    steps: int = 100
    continuation: int = 128

    def matches(self, **params) -> bool:
        """True when every given parameter equals this setting's value (unknown names are ignored)."""
        mine = asdict(self)
        return all(mine[k] == v for k, v in params.items() if k in mine)


KVSCULPT_PAPER = KVSculptSetting()
"""The setting of KVSculpt's Tables 1–8 (N = 2048, m = 256, 128 synthetic queries, 100 L-BFGS steps)."""


@dataclass(frozen=True)
class ZipFusionBenchmark:
    """ZipFusion §IV-B: decode attention timed at 2 contexts × 3 batches; latencies printed at one anchor."""

    contexts: tuple[int, ...] = (2048, 8192)
    batches: tuple[int, ...] = (32, 64, 96)
    anchor_context: int = 8192
    anchor_batch: int = 64


ZIPFUSION_PAPER = ZipFusionBenchmark()

PAPER_CARD = "zipfusion_paper_card"
"""The chapter that times Fig. 4's points and runs Fig. 5's setting on ZipFusion's own card, an H100: its results stem
(``<PAPER_CARD>.csv``: the latency table's columns; ``<PAPER_CARD>_throughput.csv``: Fig. 5's rows)."""

THROUGHPUT_PAPER_MODEL = "Llama-3.1-8B shapes (random weights)"
"""``model`` of the rows of ``zipfusion_throughput.csv`` in the paper's Fig. 5 setting (§IV-A); the chapter's other
rows are the same setting with the modules' step kernels (:data:`THROUGHPUT_UNFUSED_MODEL`), the uncompressed engine
in the mma layouts (:data:`THROUGHPUT_MMA_BASELINE_MODEL`) and the embedded model
end to end (a smaller budget, every full page compressed as it fills)."""

THROUGHPUT_UNFUSED_MODEL = "Llama-3.1-8B shapes, modules' step kernels"
"""``model`` of the rows of ``zipfusion_throughput.csv`` in the Fig. 5 setting run with the model's own modules for the
decode step's norms, rotary embedding and MLP product (``Engine(fused_ops=False)``) instead of the fused kernels."""

THROUGHPUT_MMA_BASELINE_MODEL = "Llama-3.1-8B shapes, uncompressed in the mma layouts"
"""``model`` of the rows of ``zipfusion_throughput.csv`` in the Fig. 5 setting where the uncompressed engine stores its
pages in the mma layouts, read by the Gluon kernel's all-raw path (the engine's default on a GPU), instead of the
chapter's uncompressed baseline, the token layouts read by the Triton kernel's (``zipkv.study.experiments.throughput.BASELINE_LAYOUTS``)."""


@dataclass(frozen=True)
class ProjectTargets:
    """This project's own bars (issues 13, 15 and 18), not the papers' claims: chapters label them as ours."""

    speedup_vs_flashinfer_tc: float = 1.35
    """Gluon kernel over FlashInfer's tensor-core decode at the anchor, all blocks compressible (issue 13)."""
    mix_speedup_vs_flashinfer_tc: float = 1.20
    """The same on the measured real-KV mix at the anchor (issue 13)."""
    mix_speedup_other_points: float = 1.15
    """The measured mix at every other Llama-shape point of the latency chapter (issue 13)."""
    smollm2_speedup_vs_fastest: float = 1.20
    """SmolLM2 shape at the anchor, all blocks compressible, over the fastest of FlashInfer TC, FlashInfer
    CUDA-core and SDPA (issue 13)."""
    smollm2_mix_speedup_vs_fastest: float = 1.10
    """The same on the measured mix (issue 13)."""
    roofline_fraction: float = 0.90
    """Compressed kernel's latency within this fraction of its bytes at the measured copy bandwidth."""
    uncompressed_within: float = 0.05
    """The same kernel on raw pages within this relative distance of FlashInfer TC."""
    max_batch_vs_uncompressed: float = 1.25
    """ZipFusion's largest batch over uncompressed's under one KV budget, Fig. 5 setting (issue 15; paper 57/46)."""
    tokens_per_s_vs_uncompressed: float = 1.25
    """ZipFusion's decode tokens/s over uncompressed's, each at its largest batch (issue 15; paper +26.3 %)."""
    tokens_per_s_vs_best_restore: float = 2.5
    """ZipFusion's decode tokens/s over the best restore-before-attention baseline's, each at its largest batch
    (issue 15; paper 2.76x)."""
    escape_bits_per_value: float = 12.1
    """Every block compressible (issue 66): real KV stored at this many bits per value or fewer, keys and values
    each, metadata and escape list included (ZipFusion's format: 12.8 on the embedded model's keys)."""
    escape_speedup_vs_flashinfer_tc: float = 1.30
    """The fused kernel on escape-format pages of real KV over FlashInfer's tensor-core decode at the anchor, 8192 x 64
    (issue 66; ZipFusion's format on the same mix: 1.256x on the H200)."""
    escape_max_batch: int = 60
    """Largest batch under Fig. 5's budget with escape-format pages (issue 66; ZipFusion's format: 57, uncompressed
    46)."""
    pack_input_tbps: float = 2.0
    """Pack kernel: terabytes per second of BF16 input."""
    distill_seconds_per_context: float = 8.5
    """Qwen2.5-1.5B-shaped context at the paper setting (≥ 20× under the paper's 170 s)."""
    solver_loss_within: float = 0.02
    """Batched solver's median final loss within this relative distance of the reference's."""
    solver_kl_within: float = 0.05
    """Batched solver's end-to-end KL within this relative distance of the reference's."""


PROJECT_TARGETS = ProjectTargets()


def scaled_down_note(**params) -> str:
    """An empty string at the KVSculpt paper setting, else a sentence saying the run is scaled down."""
    if KVSCULPT_PAPER.matches(**params):
        return ""
    return " **A scaled-down run (not the paper's setting): its numbers are not comparable with the paper's.**"


def setting_line(model: str, n_windows: int, context: int, continuation: int, m: int, n_synthetic: int, steps: int,
                 solver: str) -> str:
    """One sentence naming a KVSculpt chapter's model and setting (windows, N, continuation, m, synthetic queries,
    steps, solver), flagging a scaled-down run."""
    return (f"{model}: {n_windows} window{'s' if n_windows != 1 else ''} of N = {context} + {continuation} tokens; m = {m}, {n_synthetic} synthetic "
            f"queries, {steps} KVSculpt steps, {solver} solver."
            + scaled_down_note(context=context, m=m, n_synthetic=n_synthetic, steps=steps))
