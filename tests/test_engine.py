"""zipkv.engine: batch greedy decoding over zipkv.memory equals model.generate.

The engine's decode attention is fp32 over the bf16 cache (the torch reference on the CPU, the fused
kernel's fp32 accumulation on the GPU); Hugging Face's default bf16 attention rounds differently, which
flips near-tied greedy choices after a few tokens. So ``model.generate`` runs here with an attention
function of the same arithmetic as ``zipkv.kernels.reference`` (registered below): any remaining
difference is the engine's -- its pages, compression, admission, positions and retraction.
"""
import math
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from zipkv.engine import Engine, Prefix, kv_budget_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """fp32 attention over bf16 K/V, output rounded to bf16 once: ``decode_attention_reference``'s
    arithmetic (einsum per KV head group) for one query token, causal fp32 attention for prefill."""
    B, HQ, T, D = query.shape
    H = key.shape[1]
    q = query.float().reshape(B, H, HQ // H, T, D)
    s = torch.einsum("bhgqd,bhtd->bhgqt", q, key.float()) * scaling
    if T > 1:
        S = key.shape[2]
        s = s + torch.full((T, S), float("-inf"), device=s.device).triu(S - T + 1)
    o = torch.einsum("bhgqt,bhtd->bhgqd", s.softmax(-1), value.float()).reshape(B, HQ, T, D)
    return o.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("zipkv_reference", reference_attention)


def _generate(model, prompts, n):
    """``model.generate``'s greedy tokens per prompt (batch 1) and, per new token, its logits' top-2 ``(values,
    indices)``."""
    out = []
    dev = next(model.parameters()).device
    for p in prompts:
        g = model.generate(torch.tensor([p], device=dev), max_new_tokens=n, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
        out.append((g.sequences[0, len(p):].tolist(), [s[0].float().topk(2) for s in g.scores]))
    return out


def _assert_tokens_of_generate(outputs, ref):
    """The engine's greedy tokens equal ``generate``'s (``ref`` from :func:`_generate`) up to the first step where
    generate's own top-2 logits are within two bf16 steps of a tie; there the engine must have taken the other of
    generate's top-2 tokens (both are right; the continuations then differ). A batched decode step multiplies the
    weights by a ``[batch, hidden]`` matrix, generate by ``[1, hidden]``: matrix libraries need not give bit-equal
    rows for the two (on this project's AVX512-BF16 CPU they do not: an exact tie, 22.375 / 22.375, broke the
    other way)."""
    for got, (want, top2) in zip(outputs, ref):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            assert got == want
            continue
        values, indices = top2[first]
        step = 2.0 ** (math.floor(math.log2(abs(float(values[0])))) - 7)        # bf16 spacing there
        assert got[first] in indices.tolist(), (first, got[first], indices.tolist())     # an exact tie: either order
        assert float(values[0] - values[1]) <= 2 * step, (first, values.tolist())


def _page_bytes(model):
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 32 * cfg.head_dim


@pytest.fixture(scope="module")
def smollm():
    from zipkv import data, models
    model, tok = models.load_model(dtype=torch.bfloat16)
    model.config._attn_implementation = "zipkv_reference"
    ws = data.windows(tok, data.load_books(limit=4), n=4, context=64, continuation=0)
    prompts = [w.context_ids[:n].tolist() for w, n in zip(ws, (5, 40, 23, 17))]
    return model, prompts


@pytest.mark.slow
@pytest.mark.parametrize("compress,layouts", [("all", "token"), ("none", "token"), ("all", "mma"), ("none", "mma")])
def test_greedy_tokens_equal_generate(smollm, compress, layouts):
    """Four requests of 5-40 prompt tokens under a budget of 6 pages per layer: two run at first, the
    others are admitted at later steps as pages free up; pages compress as they fill (or never). ``"mma"``:
    the Gluon kernel's layouts, the engine's default on a GPU, compressed or not (written, packed and read here by
    the torch code)."""
    model, prompts = smollm
    n = 12
    ref = _generate(model, prompts, n)
    kw = dict(k_layout="k_mma", v_layout="v_mma") if layouts == "mma" else {}
    eng = Engine(model, kv_budget_bytes=6 * _page_bytes(model), compress=compress, pages_per_chunk=2, **kw)
    assert eng.memory.layouts == (("k_mma", "v_mma") if layouts == "mma" else ("token", "token"))
    res = eng.generate(prompts, n)
    _assert_tokens_of_generate(res.outputs, ref)
    assert max(s["batch"] for s in res.stats["steps"]) < len(prompts)
    assert len(set(res.stats["admitted_at"])) > 1                       # admitted at different steps
    mem = res.stats["memory"]
    assert mem["running"] == 0 and mem["outstanding"] == 0
    if compress == "all":
        assert res.stats["frac_compressed_k"] > 0.3                     # the prompts' full pages compressed
    else:
        assert res.stats["frac_compressed_k"] == 0.0


@pytest.mark.slow
def test_retraction_and_distilled_prefix_positions(smollm):
    """Half reservations make decode steps run out of pages: requests are retracted and requeued, and
    finish with generate's tokens. A prefix given as KV (cache length apart from position) continues
    like the full prompt."""
    model, prompts = smollm
    n = 40
    ref = _generate(model, prompts[:2], n)
    eng = Engine(model, kv_budget_bytes=6 * _page_bytes(model), compress="none", pages_per_chunk=1, reserve_ratio=0.2)
    res = eng.generate(prompts[:2], n)
    assert res.stats["retracted"] > 0
    _assert_tokens_of_generate(res.outputs, ref)
    # a prefix of 30 cached pairs that stands for tokens 0..29: the same as prefilling them
    n = 12
    p = prompts[1]
    out = model(torch.tensor([p[:30]]), use_cache=True)
    kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    eng = Engine(model, kv_budget_bytes=8 * _page_bytes(model), compress="all", pages_per_chunk=2)
    res = eng.generate([p[30:]], n, prefixes=[Prefix(kv, 30, n_tokens=30)])
    _assert_tokens_of_generate(res.outputs, [(ref[1][0][:n], ref[1][1][:n])])


@pytest.mark.slow
@pytest.mark.parametrize("compress,reserve", [("all", 1.0), ("none", 0.2)])
def test_overlapped_steps_give_the_sequential_tokens(smollm, compress, reserve, monkeypatch):
    """``overlap=True`` launches each step on the device tokens of the one in flight: with stop tokens met at
    different steps (the stopped request runs one step more, whose token is dropped), requests admitted later
    and, under short reservations, retracted while a step is in flight, every request gets the tokens of
    ``overlap=False`` -- which end at their first stop token -- and the memory comes back empty. The stop token
    is one that a run without stops makes; that run is no oracle for the stopping runs' tokens: its batches differ
    from theirs step by step, and bf16 matrix products need not give bit-equal rows for different batch sizes (on
    this project's AMD EPYC machine a near-tie broke the other way at a request's 40th token)."""
    from zipkv import runner
    model, prompts = smollm
    n = 24 if reserve == 1 else 40
    carried = []
    run = runner.StepGraph.run

    def counting_run(self, key, host_inputs, carry=None):
        carried.append(carry is not None)
        return run(self, key, host_inputs, carry)
    monkeypatch.setattr(runner.StepGraph, "run", counting_run)
    kw = dict(kv_budget_bytes=6 * _page_bytes(model), compress=compress, pages_per_chunk=1 if reserve < 1 else 2,
              reserve_ratio=reserve)
    free = Engine(model, eos_token_id=None, overlap=False, **kw).generate(prompts, n).outputs
    stop = free[2][5]                                    # a token request 2 makes: requests stop at different steps
    runs = {}
    for overlap in (False, True):
        carried.clear()
        eng = Engine(model, eos_token_id=stop, overlap=overlap, **kw)
        res = eng.generate(prompts, n)
        runs[overlap] = res
        assert res.outputs == runs[False].outputs, overlap
        assert any(carried) == overlap                   # the device-token path ran only when overlapping
        mem = res.stats["memory"]
        assert mem["running"] == 0 and mem["outstanding"] == 0
        assert all(s["seconds"] > 0 for s in res.stats["steps"])
    assert (runs[True].stats["retracted"] > 0) == (reserve < 1)
    want = runs[False].outputs
    assert all(stop not in o[:-1] and (len(o) == n or o[-1] == stop) for o in want)   # each ends at its first stop
    assert len({len(o) for o in want}) > 1 and any(len(o) < n for o in want)         # met at different steps


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["splitzip", "huffman"])
def test_restore_baselines_greedy_tokens_equal_generate(smollm, codec):
    """The restore-before-attention backends: each request's full prompt pages kept as a codec payload (the
    codecs' torch decoders on the CPU), restored into the one shared buffer before every layer's attention,
    its payload's bytes held out of the same budget; four requests admitted at different steps give
    generate's tokens, and every held chunk and buffer page comes back."""
    from zipkv import codecs
    model, prompts = smollm
    n = 12
    ref = _generate(model, prompts, n)
    with torch.no_grad():
        calib = model(torch.tensor([prompts[0][:3] + prompts[2]]), use_cache=True).past_key_values.layers[1].keys
    c = codecs.SplitZip.calibrate(calib.bfloat16()) if codec == "splitzip" else codecs.Huffman()
    per_layer = _page_bytes(model) // model.config.num_hidden_layers
    eng = Engine(model, kv_budget_bytes=6 * _page_bytes(model) + 3 * per_layer, compress="prompt", restore=c,
                 restore_buffer_pages=3, pages_per_chunk=1)
    res = eng.generate(prompts, n)
    _assert_tokens_of_generate(res.outputs, ref)
    assert len(set(res.stats["admitted_at"])) > 1 and max(s["batch"] for s in res.stats["steps"]) < len(prompts)
    assert max(s["chunks_held"] for s in res.stats["steps"]) > 0
    assert eng.memory.stats()["chunks_held"] == 0 and eng.restore.extents == [[0, 3]] and not eng.restore.entries


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel's fp32 interpreter path; on a GPU see the bf16 test below")
@pytest.mark.parametrize("restore", [None, "splitzip", "huffman"])
def test_fused_kernel_engine_equals_reference_engine(restore):
    """The engine through the fused Triton decode kernel and pack kernel -- or, for a restore baseline, the
    codec's Triton decoder into the shared buffer and the raw decode kernel -- (under TRITON_INTERPRET=1 on the
    CPU, fp32 arithmetic) gives the reference engine's tokens, compressed pages included."""
    from zipkv import codecs
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=3).to(torch.bfloat16)
    prompts = [[1, 5, 9, 33, 2] * 4, [7] * 3, list(range(40, 75))]
    budget = 10 * 2 * 2 * 2 * 32 * 32
    kw = dict(pages_per_chunk=2, eos_token_id=None)
    if restore:
        codec = codecs.SplitZip(list(range(118, 134)), chunk=64) if restore == "splitzip" else codecs.Huffman(lanes=2, per_lane=32)
        kw.update(restore=codec, compress="prompt", restore_buffer_pages=4)
    ref = Engine(model, budget, attention="reference", **kw).generate(prompts, 6)
    got = Engine(model, budget, attention="kernel", **kw).generate(prompts, 6)
    assert got.outputs == ref.outputs
    assert (got.stats["frac_compressed_k"] > 0) == (restore is None)
    if restore is None:                          # a fixed split-KV factor reaches the kernel's plans (the merge path)
        split = Engine(model, budget, attention="kernel", num_splits=2, **kw)
        assert split.generate(prompts, 6).outputs == ref.outputs and split.runner.attention.plans[0].num_splits == 2


@pytest.mark.parametrize("compress", ["prompt", "none"])
def test_a_blocked_request_is_checked_again_only_after_space_returns(compress):
    """More requests than the budget holds: the first that does not fit is checked again only once memory has given
    space back (``KVMemory.space_returns`` moved), not at every step -- at Llama-8B's shape a packed request's check
    takes milliseconds of host time. All requests still finish."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)
    prompts = [list(range(3 + i, 40 + i)) for i in range(5)]
    eng = Engine(model, 8 * 2 * 2 * 2 * 32 * 32, attention="reference", compress=compress, pages_per_chunk=2,
                 eos_token_id=None)
    failed = []

    def counted(check):
        def wrapped(req):
            ok = check(req)
            if not ok:
                failed.append((req.rid, eng.memory.space_returns))
            return ok
        return wrapped
    # a refusal comes from the host-only check before the engine waits for its steps, or from the admission itself
    eng._may_admit, eng._admit = counted(eng._may_admit), counted(eng._admit)
    res = eng.generate(prompts, 24)
    assert [len(o) for o in res.outputs] == [24] * 5
    assert len(res.stats["steps"]) > 24 and failed                    # later requests waited
    assert len(failed) == len(set(failed)), "a blocked request was checked twice without space coming back"
    assert len(failed) < len(res.stats["steps"]) // 2


@pytest.fixture(scope="module")
def tiny_engine_model():
    return tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernel, CUDA graphs and overlapped steps need CUDA"))])
@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_an_interrupted_generate_leaves_the_engine_usable(where, device):
    """A KeyboardInterrupt (Jupyter's stop button) at the fifth decode step's launch or in the second prefill (on CUDA
    with a step in flight and captured graphs): every page of the run is freed, and the next ``generate`` on the same
    engine gives the tokens of an uninterrupted one."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(device, torch.bfloat16)
    eng = Engine(model, 10 * _page_bytes(model), pages_per_chunk=2, eos_token_id=None)
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(70, 75))]
    want = eng.generate(prompts, 12).outputs
    name = "run" if where == "decode" else "prefill"
    owner = eng.runner.graphs if where == "decode" else eng.runner
    original, calls = getattr(owner, name), []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == (5 if where == "decode" else 2):
            raise KeyboardInterrupt
        return original(*args)
    setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts, 12)
    setattr(owner, name, original)
    assert not eng.memory.requests and eng.memory.used_bytes() == 0
    assert eng.generate(prompts, 12).outputs == want


def test_a_distilled_cache_is_served_as_a_prefix():
    """``Prefix.from_cache`` of ``zipkv.compress``'s cache: kept whole (k + m = N, exact pairs), the engine's tokens are
    ``generate``'s on the whole context; distilled to half, each token the engine picks is, within two bf16 steps,
    the top of the logits that Hugging Face's forward gives over the same DistilledCache and the tokens before it.
    Caches the engine cannot hold (adaptive budgets, a logit bias, appended tokens) are refused."""
    import zipkv
    from zipkv.cache import DistilledCache
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(2))
    prompt, n = [7, 8, 9], 10
    budget = 16 * _page_bytes(model)

    whole = zipkv.compress(model, ids, kept_fraction=1.0, method="attention_score", m=8)
    model.config._attn_implementation = "zipkv_reference"
    ref = _generate(model, [ids.tolist() + prompt], n)
    res = Engine(model, budget, pages_per_chunk=2).generate([prompt], n, prefixes=[Prefix.from_cache(whole)])
    _assert_tokens_of_generate(res.outputs, ref)

    model.set_attn_implementation("eager")
    half = zipkv.compress(model, ids, kept_fraction=0.5, m=8, steps=5, method="kvsculpt")
    prefix = Prefix.from_cache(half)
    assert (prefix.length, prefix.position) == (24, 48)
    out = Engine(model, budget, pages_per_chunk=2, eos_token_id=None).generate([prompt], n, prefixes=[prefix]).outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]]), past_key_values=half).logits[0, len(prompt) - 1:].float()
    half.reset()
    top = logits.max(-1).values
    picked = logits.gather(-1, torch.tensor(out)[:, None])[:, 0]
    step = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)
    assert bool((top - picked <= 2 * step).all()), (top - picked).tolist()

    pilot = DistilledCache.from_padded([(layer.keys[0, :, :layer.cached], layer.values[0, :, :layer.cached],
                                         layer.valid.clone()) for layer in half.layers], 48)
    pilot.layers[0].valid[0, 0] = False
    with pytest.raises(ValueError, match="pairs per layer and KV head"):
        Prefix.from_cache(pilot)
    biased = DistilledCache.from_padded([(layer.keys[0, :, :layer.cached], layer.values[0, :, :layer.cached],
                                          layer.valid, torch.full(layer.valid.shape, 0.5)) for layer in half.layers], 48)
    with pytest.raises(ValueError, match="layer 0 adds a logit bias"):
        Prefix.from_cache(biased)
    with pytest.raises(TypeError, match="DistilledCache"):
        Prefix.from_cache([])


@pytest.mark.parametrize("compress,reserve,pages,pages_per_chunk,new", [("all", 1.0, 7, 2, 20), ("all", 0.2, 7, 2, 40),
                                                                      ("none", 0.2, 6, 1, 40)])
def test_the_reference_keeps_unpacked_pages_only_while_they_are_current(tiny_engine_model, compress, reserve, pages,
                                                                       pages_per_chunk, new, monkeypatch):
    """The reference engine unpacks a page once and keeps it until it changes (``runner.UnpackedPages``): in every
    layer of every step its attention equals, bit for bit, the reference's over pages unpacked afresh -- while pages
    fill, compress in place and move into compressed chunks that other layers gave back, requests are admitted
    between steps, retracted (short reservations) and their page ids handed to others, and through a second generate
    over the same engine's pages."""
    from zipkv import runner
    from zipkv.kernels.reference import decode_attention_reference

    model = tiny_engine_model
    kept = []
    run = runner.StepAttention.run

    def checked_run(self, layer, q):
        got = run(self, layer, q)
        want = decode_attention_reference(q, self.caches[layer], *self.table, softmax_scale=self.scale).to(q.dtype)
        kept.append(self.unpacked is not None)
        assert torch.equal(got, want), layer
        return got
    monkeypatch.setattr(runner.StepAttention, "run", checked_run)
    eng = Engine(model, pages * _page_bytes(model), attention="reference", compress=compress,
                 pages_per_chunk=pages_per_chunk, reserve_ratio=reserve, eos_token_id=None)
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(70, 75)), list(range(5, 38))]
    first = eng.generate(prompts, new)
    assert eng.generate(prompts, new).outputs == first.outputs
    assert kept and all(kept)
    assert len(set(first.stats["admitted_at"])) > 1 and (first.stats["retracted"] > 0) == (reserve < 1)
    assert (max(s["reassigned"] for s in first.stats["steps"]) > 0) == (compress == "all")


@pytest.mark.parametrize("compress", ["prompt", "all"])
def test_a_request_whose_packed_pages_find_no_chunk_is_admitted_raw(tiny_engine_model, compress):
    """A budget of one 16-page chunk per layer: packed pages need a compressed chunk of their own beside the raw
    one that holds every request's last page, so no request fits packed -- each is admitted raw instead (its full
    pages then compressed in place), as many at once as without compression, with the same (lossless) tokens."""
    from zipkv.engine import kv_budget_for

    model = tiny_engine_model
    prompts = [list(range(3 + i, 43 + i)) for i in range(4)]
    budget = kv_budget_for(model.config, 2, 40 + 16)
    assert budget == 16 * _page_bytes(model)                                          # one chunk per layer
    kw = dict(attention="reference", eos_token_id=None)
    raw = Engine(model, budget, compress="none", **kw).generate(prompts, 16)
    got = Engine(model, budget, compress=compress, **kw).generate(prompts, 16)
    assert got.outputs == raw.outputs and [len(o) for o in got.outputs] == [16] * 4
    assert got.stats["admitted_raw"] == 4 and raw.stats["admitted_raw"] == 0
    assert got.stats["max_batch"] == raw.stats["max_batch"] > 1
    assert got.stats["frac_compressed_k"] > 0.3                              # the prompts' full pages, in place
    assert got.stats["memory"]["running"] == 0 and got.stats["memory"]["outstanding"] == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pages=st.integers(2, 40), pages_per_chunk=st.sampled_from([1, 2, 4, 16]), new=st.integers(1, 12),
       reserve=st.sampled_from([1.0, 0.5, 0.2]), prompts=st.lists(st.lists(st.integers(1, 119), min_size=1, max_size=60),
                                                                  min_size=1, max_size=5))
def test_compression_never_changes_what_a_budget_generates(tiny_engine_model, pages, pages_per_chunk, new, reserve,
                                                           prompts):
    """Any budget, chunk size, reservation and prompts: the engine with compression (prompt pages only, or every
    full page) gives the uncompressed engine's greedy tokens (the format is lossless), or refuses the same input
    with the same ValueError -- never an error of its own."""
    model = tiny_engine_model
    budget = pages * _page_bytes(model)
    kw = dict(attention="reference", pages_per_chunk=pages_per_chunk, reserve_ratio=reserve, eos_token_id=None)
    got = {}
    for compress in ("none", "prompt", "all"):
        try:
            got[compress] = Engine(model, budget, compress=compress, **kw).generate(prompts, new).outputs
        except ValueError as err:
            got[compress] = str(err)
    assert got["prompt"] == got["none"] and got["all"] == got["none"]


def test_auto_layouts_are_the_mma_layouts_only_where_the_gluon_kernel_reads_the_pages():
    """``k_layout="auto"``: the mma layouts under the fused kernel on CUDA at head_dim 64 / 128 within the Gluon
    kernel's group size, compressed or not; the token layouts on the CPU, for the reference, the restore baselines,
    other head_dims and larger groups. An explicit layout is kept."""
    from zipkv.engine import default_layouts
    from zipkv.kernels import decode_mma
    mma, token = ("k_mma", "v_mma"), ("token", "token")
    assert default_layouts("kernel", "cuda", None, 64, 3) == mma          # SmolLM2
    assert default_layouts("kernel", "cuda:0", None, 128, 4) == mma       # Llama-3.1-8B
    assert default_layouts("kernel", "cuda", None, 64, decode_mma.MAX_GROUP[64]) == mma
    assert default_layouts("kernel", "cuda", None, 64, decode_mma.MAX_GROUP[64] + 1) == token
    assert default_layouts("kernel", "cuda", None, 32, 2) == token
    assert default_layouts("kernel", "cuda", object(), 128, 4) == token
    assert default_layouts("reference", "cuda", None, 128, 4) == token
    assert default_layouts("kernel", "cpu", None, 128, 4) == token
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=64).to(torch.bfloat16)
    if torch.cuda.is_available():           # without the interpreter the Triton kernel refuses CPU tensors
        assert Engine(model.cuda(), 10**6, attention="kernel").memory.layouts == mma
        model = model.cpu()
    else:
        assert Engine(model, 10**6, attention="kernel").memory.layouts == token   # the CPU: token layouts
    assert Engine(model, 10**6, attention="reference", v_layout="v_mma").memory.layouts == ("token", "v_mma")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernel's interpreter path (token layouts)")
def test_page_kinds_follow_every_descriptor_change():
    """Under the Triton kernel (whose routed launches read the page kinds) the engine recomputes the kinds only for
    the pages whose descriptors changed (new pages, compressed, moved, admitted packed): after every step's plan
    each layer's kinds equal a full recomputation. The reference reads no kinds and recomputes none."""
    from zipkv.paged import PagedKVCache, page_kinds_of
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=4).to(torch.bfloat16)
    prompts = [[1, 5, 9, 33, 2] * 7, [7] * 3, list(range(40, 90)), [3, 4] * 20]
    budget = 12 * 2 * 2 * 2 * 32 * 32
    refreshed = []
    refresh = PagedKVCache.refresh
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PagedKVCache, "refresh", lambda self, *a, **k: refreshed.append(1) or refresh(self, *a, **k))
        ref = Engine(model, budget, attention="reference", pages_per_chunk=2, eos_token_id=None)
        assert not ref.runner.attention.reads_kinds and ref.generate(prompts, 20).stats["frac_compressed_k"] > 0
    assert not refreshed
    eng = Engine(model, budget, attention="kernel", pages_per_chunk=2, eos_token_id=None)
    assert eng.runner.attention.reads_kinds
    plan, checked = eng.runner.attention.plan, []

    def checked_plan(rids):
        key = plan(rids)
        for c in eng.runner.attention.caches:
            assert torch.equal(c.page_kinds(), page_kinds_of(c.desc))
        checked.append(len(rids))
        return key
    eng.runner.attention.plan = checked_plan
    res = eng.generate(prompts, 20)
    assert len(checked) == len(res.stats["steps"]) > 20
    assert res.stats["frac_compressed_k"] > 0 and set(map(len, res.outputs)) == {20}


def _tiny_model(model_type, **extra):
    """A 2-layer random bf16 ``model_type`` model (4 query / 2 KV heads of 32 dims), Q/K/V weights × 20 so that
    attention is far from uniform, with this file's fp32 reference attention."""
    import transformers
    torch.manual_seed(3)
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(20.0)
    model.config._attn_implementation = "zipkv_reference"
    return model.to(torch.bfloat16)


FAMILY_EXTRAS = {"mistral": dict(sliding_window=None), "mixtral": dict(sliding_window=None, num_local_experts=4,
                                                                        num_experts_per_tok=2)}


@pytest.mark.parametrize("fused_ops", [False, True], ids=["modules", "fused"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma"])
def test_every_decoder_family_the_engine_takes_gives_generates_tokens(model_type, fused_ops, monkeypatch):
    """Each model type of ``DECODE_MODEL_TYPES``: the engine's decode steps, with pages compressed as they fill, give
    ``model.generate``'s greedy tokens -- through the model's modules, and through the fused step kernels
    (``fused_ops=True``: in Triton's interpreter, or on the GPU where there is one), which replace exactly the norms and MLPs that compute
    Llama's: not Gemma's (its norm scales by ``1 + weight``, its MLP is GELU) nor Mixtral's expert MLP."""
    from zipkv.engine import DECODE_MODEL_TYPES
    from zipkv.kernels import fused_ops as kernels
    assert model_type in DECODE_MODEL_TYPES
    calls = {name: 0 for name in ("add_rms_norm", "rotary", "silu_mul")}
    for name in calls:
        def spy(*args, _name=name, _f=getattr(kernels, name)):
            calls[_name] += 1
            return _f(*args)
        monkeypatch.setattr(kernels, name, spy)
    model = _tiny_model(model_type, **FAMILY_EXTRAS.get(model_type, {}))
    if fused_ops and torch.cuda.is_available():       # where there is a GPU, Triton does not interpret: its kernels run
        model = model.cuda()
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(70, 75))]
    ref = _generate(model, prompts, 12)
    res = Engine(model, 8 * _page_bytes(model), compress="all", pages_per_chunk=2,
                 fused_ops=fused_ops).generate(prompts, 12)
    _assert_tokens_of_generate(res.outputs, ref)
    assert res.stats["frac_compressed_k"] > 0
    used = {name for name, n in calls.items() if n}
    expected = set() if not fused_ops else {"rotary"} | ({"add_rms_norm"} if model_type != "gemma" else set()) \
        | ({"silu_mul"} if model_type not in ("gemma", "mixtral") else set())
    assert used == expected


@pytest.mark.parametrize("model_type, extra", [
    ("gemma2", {}),                                                    # logit soft-capping, extra norms
    ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015)),
    ("olmo2", {}),                                                     # norms after the blocks
    ("phi3", {}),                                                      # fused QKV, partial RoPE
])
def test_a_model_whose_decoder_layer_the_engine_does_not_compute_is_refused(model_type, extra):
    """The prefill runs the model's own forward but a decode step the Llama-family layer: for these models the two
    differ (Granite's multipliers gave other tokens than ``generate`` from the second one on), so the engine refuses
    them before allocating anything."""
    import transformers
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=128, hidden_size=128, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with pytest.raises(ValueError, match=f"model_type '{model_type}'"):
        Engine(model, 10**6)


def test_a_sliding_window_model_serves_requests_inside_its_window_and_refuses_longer_ones():
    """Mistral's ``sliding_window`` applies to every layer; the engine attends to the whole cache, which is the
    model's attention as long as no query is more than the window past the first key."""
    model = _tiny_model("mistral", sliding_window=24)
    eng = Engine(model, 8 * _page_bytes(model), compress="all", pages_per_chunk=2)
    prompts = [list(range(3, 16)), list(range(50, 61))]                  # 13 + 12 - 1 = 24 tokens: inside
    _assert_tokens_of_generate(eng.generate(prompts, 12).outputs, _generate(model, prompts, 12))
    with pytest.raises(ValueError, match=r"prompts\[1\]: its last decode step queries position 24, .* window of 24"):
        eng.generate([[5, 6], list(range(3, 17))], 12)
    assert not eng.memory.requests and eng.memory.used_bytes() == 0


@pytest.mark.parametrize("call, match", [
    (lambda e: e.generate([[1, 2, 3]], 0), "max_new_tokens"),
    (lambda e: e.generate([[1, 2, 3]], -1), "max_new_tokens"),
    (lambda e: e.generate([[1, 2, 3], []], 4), "prompts\\[1\\] is empty"),
    (lambda e: e.generate([[1, 2], list(range(100)) * 20], 4), r"request 'prompts\[1\]': 2000 prompt \+ 4 new tokens .* holds at most"),
    (lambda e: e.generate([[1, 2, 300]], 4), r"token ids in \[0, 128\), got 300"),
    (lambda e: e.generate([[1, 2.0]], 4), r"integer token ids .* got 2.0"),
    (lambda e: e.generate([torch.tensor([[1, 2, 3]])], 4), r"1-D sequence .* shape \(1, 3\)"),
    (lambda e: e.generate([[1, 2, 3]], 4, max_decode_steps=0), r"max_decode_steps must be an int >= 1 or None, got 0"),
    (lambda e: e.generate([[1, 2, 3]], 4, max_decode_steps=True), r"max_decode_steps .* got True"),
    (lambda e: e.generate([[1, 2, 3]], 4, max_decode_steps="3"), r"max_decode_steps .* got '3'"),
    (lambda e: e.generate([[1, 2, 3], None], 4), r"prompts\[1\] must be a sequence of token ids, got NoneType"),
    (lambda e: e.generate([5], 4), r"prompts\[0\] must be a sequence of token ids, got int"),
    (lambda e: e.generate([[1, 2]], 4, prefixes=Prefix(_pairs(), 30)), r"prefixes must be a list .* got Prefix"),
])
def test_bad_input_is_refused_before_anything_runs(call, match):
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32).to(torch.bfloat16)
    eng = Engine(model, 10 * 2 * 2 * 2 * 32 * 32, attention="reference")
    with pytest.raises((ValueError, TypeError), match=match):
        call(eng)
    assert not eng.memory.requests and eng.memory.used_bytes() == 0


def test_a_run_cut_short_by_max_decode_steps_gives_its_pages_back():
    """Requests that ``max_decode_steps`` leaves unfinished keep the tokens they have, and the engine frees their pages
    when ``generate`` returns, so the next call starts clean (before: 'request 0 is already running')."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32).to(torch.bfloat16)
    eng = Engine(model, 10 * _page_bytes(model), attention="reference", pages_per_chunk=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    short = eng.generate(prompts, 8, max_decode_steps=2)
    assert [len(o) for o in short.outputs] == [3, 3]                      # the prefill's token and two steps'
    assert not eng.memory.requests and eng.memory.used_bytes() == 0
    full = eng.generate(prompts, 8)
    assert [o[:3] for o in full.outputs] == short.outputs


def test_numpy_integers_are_integers():
    """kv_budget_bytes=np.int64(...) was "must be an int, got int64", max_new_tokens=np.int64(2) and a Prefix length
    from a numpy count were refused too, where kv_budget_for and the data loader take them."""
    import numpy as np

    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32).to(torch.bfloat16)
    plain = Engine(model, 10 * _page_bytes(model), attention="reference", pages_per_chunk=2)
    numpy = Engine(model, np.int64(10 * _page_bytes(model)), attention="reference", pages_per_chunk=np.int64(2))
    pairs = _pairs()
    prefix = lambda n: [None, Prefix(pairs, n)]                                                  # noqa: E731
    want = plain.generate([[1, 2, 3], [4, 5]], 4, prefixes=prefix(30)).outputs
    assert numpy.generate([[1, 2, 3], [4, 5]], np.int64(4), prefixes=prefix(np.int64(30))).outputs == want
    assert type(numpy.kv_budget_bytes) is int


def _pairs(heads=2, n=30, dim=32, layers=2):
    return [(torch.randn(heads, n, dim).to(torch.bfloat16), torch.randn(heads, n, dim).to(torch.bfloat16))
            for _ in range(layers)]


@pytest.mark.parametrize("prefix, error, match", [
    (Prefix(_pairs(), 40), ValueError, r"prefixes\[1\]: prefix layer 0: expected .* \[2, 40, 32\] .* got shapes \[\(2, 30, 32\)"),
    (Prefix(_pairs(), 20), ValueError, r"\[2, 20, 32\]"),
    (Prefix(_pairs(heads=3), 30), ValueError, r"got shapes \[\(3, 30, 32\)"),
    (Prefix(_pairs(dim=16), 30), ValueError, r"got shapes \[\(2, 30, 16\)"),
    (Prefix(_pairs(layers=1), 30), ValueError, r"prefixes\[1\].kv must hold one \(keys, values\) per layer: 2 layers, got 1"),
    (Prefix([k for k, _ in _pairs()], 30), ValueError, r"got shapes \[\(2, 30, 32\)\]"),
    (Prefix(_pairs(), 0), ValueError, r"prefixes\[1\].length must be an int >= 1"),
    (Prefix(_pairs(), 30, n_tokens=0), ValueError, r"prefixes\[1\].n_tokens must be None or an int >= 1"),
    ("30 pairs", TypeError, r"prefixes\[1\] must be a zipkv.engine.Prefix or None, got str"),
    (Prefix(lambda l: _pairs()[l], 40), ValueError, r"prefix layer 0: expected .* \[2, 40, 32\]"),   # built at prefill
])
def test_a_prefix_the_engine_cannot_serve_is_refused(prefix, error, match):
    """Pairs that are not ``[kv_heads, length, head_dim]`` per layer (before: a length that the tensors did not have
    ran silently with the wrong cache length) and lengths that are not positive. A prefix built per layer on demand is
    checked as each layer is built, in the prefill; the run's pages are freed then."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32).to(torch.bfloat16)
    eng = Engine(model, 10 * _page_bytes(model), pages_per_chunk=2)
    with pytest.raises(error, match=match):
        eng.generate([[1, 2, 3], [4, 5]], 4, prefixes=[None, prefix])
    assert not eng.memory.requests and eng.memory.used_bytes() == 0


def test_the_fused_kernel_on_a_cpu_without_the_interpreter_is_refused_when_the_engine_is_built(monkeypatch):
    import zipkv.kernels

    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32).to(torch.bfloat16)
    monkeypatch.setattr(zipkv.kernels, "interpreted", lambda kernel: False)       # as if started without it
    with pytest.raises(ValueError, match="attention='kernel': the model is on cpu: .* TRITON_INTERPRET=1"):
        Engine(model, 10**6, attention="kernel")
    Engine(model, 10**6, attention="reference")


def test_budget_and_model_errors():
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32)
    with pytest.raises(TypeError, match="bfloat16"):
        Engine(model, 10**6)
    model = model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="smaller than one page per layer"):
        Engine(model, 2 * 2 * 2 * 32 * 32 - 1)
    with pytest.raises(ValueError, match="compress"):
        Engine(model, 10**6, compress="sometimes")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            Engine(model, 10**6, num_splits=bad)
    with pytest.raises(TypeError, match="fused_ops must be a bool or None, got str"):
        Engine(model, 10**6, fused_ops="yes")
    for bad, error, match in ((1, ValueError, "compress must be"), ([], ValueError, "compress must be")):
        with pytest.raises(error, match=match):
            Engine(model, 10**6, compress=bad)
    with pytest.raises(TypeError, match="reserve_ratio must be a number"):
        Engine(model, 10**6, reserve_ratio="1")
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        Engine(model, 10**6, max_batch=True)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got str"):
        Engine(model, 10**6, cuda_graphs="no")
    for bad in ("eos", [1.5], -1, 10**9, []):
        with pytest.raises(ValueError, match=r"eos_token_id must be 'model', None, or token ids in \[0, 128\)"):
            Engine(model, 10**6, eos_token_id=bad)
    assert Engine(model, 10**6, eos_token_id=[3, 7]).eos == {3, 7}
    for kw, match in ((dict(requests=0), "requests must be an int >= 1, got 0"),
                      (dict(tokens_per_request=2.5), "tokens_per_request must be an int >= 1, got 2.5"),
                      (dict(pages_per_chunk=0), "pages_per_chunk must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=match):
            kv_budget_for(model.config, **{**dict(requests=2, tokens_per_request=64), **kw})
    with pytest.raises(TypeError, match="model_config must be a Hugging Face model config"):
        kv_budget_for(None, 2, 64)
    from zipkv import codecs
    with pytest.raises(TypeError, match="restore must be"):
        Engine(model, 10**6, compress="prompt", restore="splitzip")
    with pytest.raises(ValueError, match="compress='prompt'"):
        Engine(model, 10**6, compress="all", restore=codecs.Huffman())
    with pytest.raises(ValueError, match="restore_buffer_pages"):
        Engine(model, 10**6, compress="prompt", restore=codecs.Huffman(), restore_buffer_pages=10**6)
    eng = Engine(model, 10**6, compress="prompt", restore=codecs.Huffman(), restore_buffer_pages=2, attention="reference")
    with pytest.raises(ValueError, match="restore buffer"):                 # 100 tokens: 6 pages to restore
        eng.generate([[1, 2], list(range(100))], 4)
    assert not eng.memory.requests and eng.memory.used_bytes() == 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are CUDA's")
@pytest.mark.parametrize("compress", ["prompt", "none"])
def test_overlapped_steps_prepare_and_launch_without_a_host_sync(compress, monkeypatch):
    """Once a composition's graph replays, the host work of an overlapped step -- slot allocation, the page table
    (pages opening included), the launch, its token copy -- never waits for the GPU (``torch.cuda``'s sync debug
    mode raises inside each of them): it runs while the step before is computed. The throughput chapter's two
    settings: ZipFusion's packed prefixes with raw new KV, and the uncompressed cache."""
    from zipkv import data, memory, models, runner
    model, tok = models.load_model(dtype=torch.bfloat16, device="cuda")
    ws = data.windows(tok, data.load_books(limit=4), n=4, context=100, continuation=0)
    prompts = [w.context_ids.tolist() for w in ws]               # one length: the composition never changes
    armed, checked = [False], []

    def watched(fn):
        def call(*args, **kw):
            if not armed[0]:
                return fn(*args, **kw)
            checked.append(fn.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return call
    for owner, name in ((memory.KVMemory, "alloc"), (runner.StepAttention, "plan"), (runner.StepGraph, "run"),
                        (runner.StepInFlight, "__init__"), (memory.KVMemory, "keep_raw")):
        monkeypatch.setattr(owner, name, watched(getattr(owner, name)))
    read = runner.StepInFlight.read

    def read_and_arm(self):
        out = read(self)
        armed[0] = armed[0] or self.mode == "replay"
        return out
    monkeypatch.setattr(runner.StepInFlight, "read", read_and_arm)
    eng = Engine(model, kv_budget_bytes=64 * _page_bytes(model), compress=compress, eos_token_id=None)
    res = eng.generate(prompts, 40)                              # tokens 100..139: pages open at 112 and 128
    assert res.stats["overlap"] and {s["mode"] for s in res.stats["steps"]} == {"warmup", "capture", "replay"}
    assert checked.count("plan") >= 30 and checked.count("run") >= 30


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel's bf16 path needs a CUDA GPU")
@pytest.mark.parametrize("compress", ["all", "all-token", "none", "none-token", "splitzip"])
def test_fused_kernel_greedy_tokens_on_gpu(compress):
    """On the GPU the engine runs the fused kernel (bf16 tensor-core dots, bf16 P for P @ V) -- or, for
    ``"splitzip"``, the restore baseline: Triton decoder into the shared buffer, raw decode kernel -- with each
    batch composition's decode step captured in a CUDA graph, and ``model.generate`` Hugging Face's bf16
    attention: neither is the other's arithmetic, so tokens are generate's up to a near-tie
    (:func:`_assert_tokens_of_generate`). The H200 run of ee8fe49 diverged so at token 2 of one request, top-2
    logits 18.875 / 18.75 (one bf16 step). ``"all"`` and ``"none"`` take the default layouts (the mma layouts and the
    Gluon kernel at SmolLM2's head_dim 64, group 3), ``"all-token"`` and ``"none-token"`` the Triton kernel's."""
    from zipkv import codecs, data, models
    model, tok = models.load_model(dtype=torch.bfloat16, device="cuda")
    ws = data.windows(tok, data.load_books(limit=4), n=4, context=256, continuation=0)
    prompts = [w.context_ids[:n].tolist() for w, n in zip(ws, (5, 200, 97, 31))]
    n = 32
    kw = dict(compress=compress)
    if compress.endswith("-token"):
        kw = dict(compress=compress.removesuffix("-token"), k_layout="token", v_layout="token")
    if compress == "splitzip":
        with torch.no_grad():
            calib = model(torch.tensor([ws[3].context_ids.tolist()], device="cuda"), use_cache=True).past_key_values.layers[2].keys
        kw = dict(compress="prompt", restore=codecs.SplitZip.calibrate(calib), restore_buffer_pages=16)
    # 20 pages: not all four requests fit at once (their pages at full length: 3 + 15 + 8 + 4)
    eng = Engine(model, kv_budget_bytes=20 * _page_bytes(model), pages_per_chunk=2, **kw)
    assert eng.memory.layouts == (("k_mma", "v_mma") if compress in ("all", "none") else ("token", "token"))
    res = eng.generate(prompts, n)
    assert len(set(res.stats["admitted_at"])) > 1
    assert res.stats["cuda_graphs"] and res.stats["graph_error"] is None
    assert {s["mode"] for s in res.stats["steps"]} == {"warmup", "capture", "replay"}
    _assert_tokens_of_generate(res.outputs, _generate(model, prompts, n))


def test_decode_throughput_fixed_and_largest_batch():
    """The chapter's measurement on a 16-layer model of Llama-8B's head shape with real-looking prefixes (16 layers:
    the restore baselines' shared buffer, one layer's worth, is a small share of a request, as at Llama's 32): the budget
    holds exactly 8 uncompressed requests; ZipFusion's compressed prefixes and the restore baselines' payloads fit
    more (the restore buffer sized by restore_buffer_pages); a fixed batch stays fixed; the run is the decode
    steps after the first token."""
    from zipkv.study.experiments import throughput as tp
    torch.manual_seed(0)
    model = tp.random_llama("cpu", num_hidden_layers=16, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, vocab_size=300)
    x = (torch.randn(4000, 512) * 0.3).bfloat16()                       # narrow exponents: blocks compress
    budget = tp.largest_batch_budget(model.config, 8, 256 + 6 - 1, pages_per_chunk=16)
    # the restore baselines hold their payloads in whole chunks: small ones here, where a request is a few chunks
    rows = {m: tp.decode_throughput(model, m, kv_budget_bytes=budget, blocks=(x, x), context=256, new_tokens=6,
                                    pages_per_chunk=2 if m in tp.RESTORE else 16,
                                    codec=tp.make_codec(m, (x[:100], x[100:200])) if m in tp.RESTORE else None)
            for m in tp.METHODS}
    assert rows["uncompressed"]["batch"] == 8 and rows["uncompressed"]["frac_compressed_k"] == 0
    assert rows["uncompressed"]["stored_bits_per_value"] == pytest.approx(16 * 17 * 16 / 257)   # 257 tokens in 17 raw pages
    assert rows["zipfusion"]["batch"] > 8 and rows["zipfusion"]["frac_compressed_k"] > 0.8
    assert rows["zipfusion"]["timed_steps"] == 5 and rows["zipfusion"]["tokens_per_s"] > 0
    for m in tp.RESTORE:
        assert rows[m]["batch"] > 8, rows[m]
        assert rows[m]["stored_bits_per_value"] < 0.9 * rows["uncompressed"]["stored_bits_per_value"], rows[m]
    fixed = tp.decode_throughput(model, "huffman", kv_budget_bytes=budget, blocks=(x, x), context=256, new_tokens=6,
                                 batch=2, pages_per_chunk=2, codec=tp.make_codec("huffman"))
    assert {s["batch"] for s in fixed["stats"]["steps"]} == {2}
    with pytest.raises(ValueError, match="codec"):
        tp.decode_throughput(model, "splitzip", kv_budget_bytes=budget, blocks=(x, x), context=256, new_tokens=6)


def test_packed_capacity_is_what_the_memory_admits_with_the_bytes():
    """packed_capacity places only the blocks' sizes (the memory on the meta device); packing the same real-KV
    prefixes' bytes into a CPU memory admits the same requests, and the first one refused lacks the same chunks,
    in every layout pair."""
    from zipkv import format as fmt
    from zipkv.study.experiments import throughput as tp
    from zipkv.memory import KVMemory
    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=64, hidden_size=256)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(600, 512, generator=gen) * 0.3
    x[::6] *= torch.exp2(torch.randint(-20, 20, (100, 512), generator=gen).float())      # blocks that do not compress
    blocks = (x.bfloat16(), x.flip(0).bfloat16())
    context, new, ppc = 160, 20, 2
    budget = kv_budget_for(cfg, 6, context + new - 1, pages_per_chunk=ppc)
    layouts = (("token", "token"), ("channel", "v_mma"), ("k_mma", "channel"))
    table = tp.packed_capacity(blocks, cfg, budget, context=context, new_tokens=new, pages_per_chunk=ppc, layouts=layouts,
                               progress=False)
    for (kl, vl), row in zip(layouts, table.itertuples()):
        mem = KVMemory(2, 2, 64, budget, pages_per_chunk=ppc, k_layout=kl, v_layout=vl)
        comp, i = torch.zeros(2), 0
        while True:
            prefix = tp.real_prefix(blocks, cfg, context, i)
            packed = mem.pack([prefix.kv(layer) for layer in range(2)])
            if mem.admit_packed(i, packed, new) is None:
                break
            comp += torch.stack([(m >> 7)[:, kv].sum() for m in packed.meta for kv in (0, 1)]).reshape(2, 2).sum(0)
            i += 1
        assert (row.k_layout, row.v_layout, row.max_batch) == (kl, vl, i) and i >= 6
        assert row.chunks_short == mem.chunks_short(packed, new) > 0
        assert [row.frac_compressed_k, row.frac_compressed_v] == pytest.approx((comp / (i * 2 * 10 * 2 * fmt.n_blocks(64))).tolist())
        assert 0.2 < row.frac_compressed_k < 0.9 and row.bits_per_value == pytest.approx(
            16 - 2 * (row.frac_compressed_k + row.frac_compressed_v))
    assert len(set(table.frac_compressed_k)) > 1, "the layouts group the same values into different blocks"
    assert table.max_batch.max() > 6, "compressed prefixes make room for more requests than raw ones"


def test_token_agreement_counts_requests_and_first_differences():
    from zipkv.study.experiments.throughput import token_agreement
    from zipkv.study.chapters.throughput import agreement_text

    a = token_agreement([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 0]])
    assert a == dict(identical=1, requests=3, first_difference=[1, 2])
    assert "zipfusion 1 of 3 (the others first differ at new token 1, 2)" in agreement_text({"zipfusion": a})


def test_token_agreement_measures_how_near_a_tie_each_first_difference_was():
    from conftest import tiny_llama
    from zipkv.study.experiments.throughput import divergence_gap, token_agreement
    from zipkv.study.chapters.throughput import agreement_text

    model = tiny_llama()
    prompts = [[3, 4, 5], [6, 7]]
    reference = [[10, 11, 12], [20, 21]]
    outputs = [[10, 99, 12], [20, 21]]
    a = token_agreement(outputs, reference, model=model, prompts=prompts)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 4, 5, 10]])).logits[0, -1]
    assert a["first_difference"] == [1] and a["logit_gap"] == [pytest.approx(float((logits[11] - logits[99]).abs()))]
    assert divergence_gap(model, [3, 4, 5, 10], 11, 11) == 0.0
    assert f"{a['logit_gap'][0]:.3g} to {a['logit_gap'][0]:.3g} apart" in agreement_text({"zipfusion": a})


def test_throughput_verdict_states_the_step_time_the_tokens_bar_needs():
    import pandas as pd

    from zipkv.study import paper_values as pv
    from zipkv.study.chapters import throughput as chapter

    big = pd.DataFrame({"method": ["uncompressed", "uncompressed", "zipfusion", "zipfusion"], "batch": [32, 40, 32, 50],
                        "max_batch": [40, 40, 50, 50], "tokens_per_s": [1000.0, 1200.0, 900.0, 1400.0],
                        "kv_budget_bytes": [2**30] * 4, "frac_compressed_k": [0, 0, 0.8, 0.8],
                        "frac_compressed_v": [0, 0, 0.9, 0.9], "stored_bits_per_value": [16.0, 16.0, 12.8, 12.8],
                        "step_ms": [20.0, 25.0, 21.0, 30.0]})
    c = chapter.bar_checks(big, 32)
    assert c["kv_requests"] == 50 * 12.8 / 16 and c["step_needed_ms"] == 25.0 * 50 / (40 * 1.25)
    # the bits per prefix value the batch bar needs are those at which the budget holds exactly that batch
    # (8192-token context: at the first decode step the 512 packed pages and one raw page of 16 slots for 8193 tokens)
    stored = (c["bits_needed"] * 8192 + 16 * 16) / 8193
    at_needed = chapter.bar_checks(big.assign(stored_bits_per_value=[16.0, 16.0, stored, stored]), 32)
    assert c["batch_needed"] == 50 and abs(at_needed["prefix_bits"] - c["bits_needed"]) < 1e-9
    assert abs(at_needed["capacity_bound"] - 50) < 1e-9
    # at the measured bits, the budget that holds the needed batch; budgets below one more raw request's bytes
    # still hold the uncompressed batch (40 requests of 528 pages of 16 tokens at 128 KiB per token)
    grown = chapter.bar_checks(big.assign(kv_budget_bytes=c["budget_needed"]), 32)
    assert abs(grown["capacity_bound"] - c["batch_needed"]) < 1e-9
    assert c["budget_top"] == 41 * 528 * 16 * 2 * 2 * 32 * 8 * 128
    assert f"a budget {c['budget_needed'] / 2**30 - 1:+.2%} larger" in chapter.bars_need_text(big, 32)
    text, kind = chapter.verdict(big, 32)
    assert "**missed by" in text and kind == "warning"
    # the misses are of this project's targets, said apart from the paper's numbers
    assert "missed" not in text.split("*This project's own targets*")[0]
    assert "SplitZip-style's" not in text                        # no SplitZip row at batch 32: nothing said
    with_sz = pd.concat([big, big.iloc[[0]].assign(method="splitzip", tokens_per_s=300.0, max_batch=32)], ignore_index=True)
    paper_gain, paper_sz = pv.ZIPFUSION_GAIN_BATCH32["Llama-3.1-8B"], pv.ZIPFUSION_VS_SPLITZIP_BATCH32["Llama-3.1-8B"]
    assert (f"at batch 32 it is {900 / 1000:.3f}× uncompressed's (paper +{paper_gain:.1%}) and {900 / 300:.2f}× "
            f"SplitZip-style's (paper {paper_sz}×)") in chapter.verdict(with_sz, 32)[0]
    # a ratio a hair under the bar (1.2498 tokens/s here) is not printed as "missed by 0.000"
    hair = big.assign(tokens_per_s=[1000.0, 1200.0, 900.0, 1200.0 * 1.2498])
    text, _ = chapter.verdict(hair, 32)
    assert "**missed by 0.0002** (1.2498×)" in text and "missed by 0.000**" not in text
    assert "needs a decode step ≤ 25.0 ms there: measured 30.0 ms" in chapter.bars_need_text(big, 32)
    assert chapter.bars_need_text(big, 32).startswith(
        "One run per method and batch, no spread.\n\n**What the batch target needs.** ZipFusion stores")
    assert "ran sequentially" in chapter.bars_need_text(big, 32)              # a table from before the column
    assert "overlapped scheduler (SGLang's" in chapter.bars_need_text(big.assign(overlap=True), 32)
    assert "3 of 4 rows" in chapter.bars_need_text(big.assign(overlap=[True, True, True, False]), 32)


def test_the_batch_paragraph_says_what_the_memory_manager_admits_per_block_arrangement(tmp_path):
    """With the capacity side table, the batch paragraph says how many requests ZipFusion's arrangement holds and
    what the next one lacks, and whether any arrangement reaches the target (here 50 of 40: one does, then none);
    a run without the Llama-shape rows shows the committed table, a run with them saves its own beside its results."""
    import pandas as pd

    from zipkv.study.chapters import throughput as chapter
    big = pd.DataFrame({"method": ["uncompressed", "zipfusion"] * 2, "batch": [32, 32, 40, 49], "max_batch": [40, 49] * 2,
                        "tokens_per_s": [900.0, 950.0, 1000.0, 1200.0], "kv_budget_bytes": [2**30] * 4,
                        "frac_compressed_k": [0, 0.8] * 2, "frac_compressed_v": [0, 0.9] * 2,
                        "stored_bits_per_value": [16.0, 12.6] * 2, "step_ms": [18.0, 19.0, 20.0, 21.0]})
    cap = pd.DataFrame({"k_layout": ["k_mma", "channel"], "v_layout": ["v_mma", "v_mma"], "frac_compressed_k": [0.77, 0.79],
                        "frac_compressed_v": [0.92, 0.92], "bits_per_value": [12.62, 12.58], "max_batch": [49, 50],
                        "chunks_short": [115, 3], "frac_budget_short": [0.0024, 0.0001], "device": "cpu", "commit": "abc",
                        "date": "2026-12-05"})
    text = chapter.bars_need_text(big, 32, capacity=cap)
    assert "holds 49 requests, and request 50 lacks 115 of the budget's chunks (0.24% of it)" in text
    assert "keys channel and values tensor-core (mma) reach 50 requests." in text
    assert "| channel | tensor-core (mma) | 79.00% |" in text
    short = chapter.bars_need_text(big, 32, capacity=cap.assign(max_batch=[49, 49]))
    assert "No arrangement of the format's blocks in the table below reaches 50: the closest, keys channel" in short
    assert "regrouping the format's blocks closes 112 of the 115 chunks." in short
    assert "Placed by the memory manager" not in chapter.bars_need_text(big, 32)
    main = tmp_path / "throughput.csv"
    assert chapter.capacity_table(cap, main) is cap and pd.read_csv(tmp_path / "throughput_capacity.csv").max_batch.tolist() == [49, 50]
    assert chapter.capacity_table(None, None, None) is None


def test_the_committed_throughput_runs_admitted_every_zipfusion_prefix_packed():
    """The paper's setup (§IV-A: prefixes pre-compressed) held in the committed GPU run: no ZipFusion request fell
    back to raw admission, and its rows carry the compressed fractions of the real-KV prefixes."""
    import pandas as pd

    from zipkv.study.book import REPO_ROOT

    table = pd.read_csv(REPO_ROOT / "results/paper/zipfusion_throughput.csv")
    zf = table[table.method == "zipfusion"]
    assert len(zf) and (table.admitted_raw == 0).all(), table[["model", "method", "batch", "admitted_raw"]]
    assert (zf.frac_compressed_k > 0.5).all() and (zf.frac_compressed_v > 0.5).all()


def test_the_committed_capacity_table_agrees_with_the_engine_s_largest_batch():
    """The memory manager's placement of the chapter's real-KV prefixes (the committed capacity side table) holds as
    many requests in ZipFusion's arrangement as the engine admitted in the committed GPU run, under that run's budget;
    each row's share of the budget is its chunks over the budget's."""
    import pandas as pd

    from zipkv.study.book import REPO_ROOT
    from zipkv.study.chapters import throughput as chapter
    from zipkv import format as fmt
    from zipkv.study.committed import side_table

    main = REPO_ROOT / "results/paper/zipfusion_throughput.csv"
    table, cap = pd.read_csv(main), pd.read_csv(side_table(main, chapter.CAPACITY_SIDE))
    z = chapter.largest_batch_rows(table[table.model == chapter.THROUGHPUT_PAPER_MODEL], "zipfusion").iloc[0]
    eng = cap[(cap.k_layout == "k_mma") & (cap.v_layout == "v_mma")].iloc[0]
    assert eng.max_batch == z.batch and (cap.kv_budget_bytes == z.kv_budget_bytes).all()
    chunk = 16 * 2 * 8 * fmt.page_bytes(128)                    # 16 pages of Llama-3.1-8B's 8 KV heads, K and V
    assert cap.frac_budget_short.tolist() == pytest.approx((cap.chunks_short * chunk / cap.kv_budget_bytes).tolist())


def test_paper_rows_fall_back_to_the_committed_gpu_table(tmp_path):
    import pandas as pd

    from zipkv.study.chapters import throughput as chapter
    from zipkv.study.settings import THROUGHPUT_PAPER_MODEL

    e2e = pd.DataFrame({"model": ["SmolLM2"], "method": ["zipfusion"], "kv_budget_bytes": [2**20]})
    gpu = pd.DataFrame({"model": [THROUGHPUT_PAPER_MODEL, "SmolLM2"], "method": ["zipfusion", "zipfusion"]})
    gpu.to_csv(tmp_path / "t.csv", index=False)
    rows, note = chapter.paper_rows(e2e, tmp_path / "t.csv")
    assert rows.model.tolist() == [THROUGHPUT_PAPER_MODEL] and "committed GPU run" in note
    rows, note = chapter.paper_rows(pd.concat([gpu, e2e]), tmp_path / "t.csv")
    assert len(rows) == 1 and note == ""
    assert "SmolLM2, 3 PG19 windows" in chapter.e2e_text(
        e2e, {"zipfusion": dict(identical=3, requests=3, first_difference=[])}, requests=3, context=64, new_tokens=8)


def test_the_chapter_table_and_the_end_to_end_speed_read_the_committed_rows():
    """The chapter shows a compact table (ratios at the same batch kind, the paper's numbers where printed) and says
    how fast each method decoded end to end, with the cache's share of the step where a GPU bandwidth is known."""
    import pandas as pd

    from zipkv.study import paper_values as pv
    from zipkv.study.experiments import throughput
    from zipkv.study.book import REPO_ROOT
    from zipkv.study.chapters import throughput as chapter

    table = pd.read_csv(REPO_ROOT / "results" / "paper" / "zipfusion_throughput.csv")
    compact = chapter.compact_table(table).data.set_index(["model", "method", "batch"])
    largest = lambda m: table[(table.method == m) & (table.batch == table.max_batch)                # noqa: E731
                              & (table.model == throughput.THROUGHPUT_PAPER_MODEL)]
    z = compact.loc[(throughput.THROUGHPUT_PAPER_MODEL, "ZipFusion", int(largest("zipfusion").batch.iloc[0]))]
    u = largest("uncompressed")
    assert z["vs uncompressed"] == pytest.approx(z["tokens/s"] / u.tokens_per_s.iloc[0])
    assert z["paper max batch"] == pv.ZIPFUSION_MAX_BATCH["Llama-3.1-8B"]["zipfusion"] and len(compact.columns) <= 12
    e2e = chapter.e2e_rows(table).set_index("method")
    assert set(e2e.model) == {"SmolLM2-135M-Instruct"}
    text = chapter.e2e_speed_text(table, copy_tbps=4.0)
    assert f"zipfusion {e2e.tokens_per_s['zipfusion']:,.0f} ({e2e.tokens_per_s['zipfusion'] / e2e.tokens_per_s['uncompressed']:.2f}×)" in text
    assert f"{e2e.kv_budget_bytes['uncompressed'] / 4e6:.0f} µs at 4.00 TB/s" in text
    assert "TB/s" not in chapter.e2e_speed_text(table)                       # no GPU bandwidth: no such sentence


def test_repeated_largest_batch_runs_show_their_median_and_spread():
    """figure5's repeats: the row is the median run (its own step time, not a mean of runs), every run's tokens/s is
    kept, the text gives each round's ratio and the figure whiskers from the slowest to the fastest run; an even or
    non-positive count is refused before anything runs."""
    import json

    import matplotlib
    import pandas as pd

    from zipkv.study.experiments import throughput

    from zipkv.study.chapters import throughput as chapter

    matplotlib.use("Agg")
    runs = [dict(method="zipfusion", batch=50, max_batch=50, tokens_per_s=t, step_ms=ms)
            for t, ms in ((1400.0, 30.0), (1300.0, 32.0), (1500.0, 28.0))]
    mid = throughput.median_run(runs)
    assert (mid["tokens_per_s"], mid["step_ms"]) == (1400.0, 30.0)
    assert json.loads(mid["tokens_per_s_runs"]) == [1400.0, 1300.0, 1500.0]
    u = throughput.median_run([dict(method="uncompressed", batch=40, max_batch=40, tokens_per_s=t, step_ms=25.0)
                               for t in (1000.0, 1100.0, 1200.0)])
    big = pd.DataFrame([dict(method="uncompressed", batch=32, max_batch=40, tokens_per_s=900.0, step_ms=20.0), u,
                        dict(method="zipfusion", batch=32, max_batch=50, tokens_per_s=950.0, step_ms=19.0), mid])
    text = chapter.runs_text(big)
    assert "ran 3 times" in text and "1.400, 1.182, 1.250×" in text and "spread 1.182–1.400×" in text
    assert "median of 3 runs" in chapter.runs_caption(big)
    assert chapter.runs_text(big.drop(columns="tokens_per_s_runs")) == "One run per method and batch, no spread."
    fig = chapter.plot_throughput(big, {}, 32)
    caps = [float(y) for line in fig.axes[1].lines for y in line.get_ydata()]   # the whiskers' caps
    assert sorted(caps) == [1000.0, 1200.0, 1300.0, 1500.0]                    # slowest and fastest runs
    for bad in (2, 0, True):
        with pytest.raises(ValueError, match="repeats must be an odd int"):
            throughput.figure5(shape=None, repeats=bad)


def test_repeated_runs_alternate_the_methods_and_replace_only_their_largest_batch_rows():
    from zipkv.study.experiments import throughput

    first = [dict(model="m", method=m, batch=b, max_batch=mb, tokens_per_s=t)
             for m, b, mb, t in (("uncompressed", 32, 40, 900.0), ("uncompressed", 40, 40, 1000.0),
                                 ("zipfusion", 32, 50, 950.0), ("zipfusion", 50, 50, 1300.0),
                                 ("splitzip", 52, 52, 400.0))]
    calls, speeds = [], {"uncompressed": iter([1200.0, 1100.0]), "zipfusion": iter([1500.0, 1400.0])}

    def run(method):
        calls.append(method)
        return dict(method=method, batch=40 if method == "uncompressed" else 50, tokens_per_s=next(speeds[method]),
                    stats={"steps": []})
    out = throughput.repeat_largest(first, run, 3)
    assert calls == ["uncompressed", "zipfusion", "uncompressed", "zipfusion"]
    assert [r["tokens_per_s"] for r in out] == [900.0, 1100.0, 950.0, 1400.0, 400.0]
    assert out[1]["tokens_per_s_runs"] == "[1000.0, 1200.0, 1100.0]" and "stats" not in out[3]
    assert out[3]["model"] == "m" and "tokens_per_s_runs" not in out[4]
    with pytest.raises(RuntimeError, match="admission should not depend on the run"):
        throughput.repeat_largest(first, lambda m: dict(method=m, batch=39, tokens_per_s=1.0), 3)


def test_the_power_paragraph_compares_the_fused_and_the_modules_step_kernels():
    import pandas as pd

    from zipkv.study.experiments import throughput

    from zipkv.study.chapters import throughput as chapter
    from zipkv.study.settings import THROUGHPUT_UNFUSED_MODEL

    def rows(tps, step, power, clock, capped):
        return pd.DataFrame({"method": ["uncompressed", "zipfusion"], "batch": [46, 57], "max_batch": [46, 57],
                             "tokens_per_s": tps, "step_ms": step, "power_w": power, "power_w_max": [p + 3 for p in power],
                             "sm_clock_mhz": clock, "frac_power_capped": capped})
    fused = rows([2600.0, 3200.0], [17.7, 17.8], [630.0, 694.0], [1980.0, 1905.0], [0.0, 0.4])
    modules = rows([2300.0, 2990.0], [20.0, 19.1], [575.0, 652.0], [1980.0, 1980.0], [0.0, 0.0])
    text = chapter.power_text(fused, modules.assign(model=THROUGHPUT_UNFUSED_MODEL))
    assert "694 W (largest sample 697 W), SM clock 1905 MHz, the power cap lowering the clock in 40% of the samples" in text
    assert "ratio is then 1.300×, against 1.231× fused" in text and "reaches the power cap" in text
    assert "1.13× and 1.07× the tokens/s" in text
    calm = chapter.power_text(fused.assign(frac_power_capped=0.0), modules)
    assert "reaches the power cap" not in calm and calm.endswith("652 W (largest sample 655 W), SM clock 1980 MHz, "
                                                                 "the power cap lowering the clock in 0% of the samples.")
    assert chapter.power_text(fused.drop(columns="power_w")) == ""
    # an unfused run whose samples were mostly idle (median 125 W, largest 692 W): said so, and no conclusion from it
    idle = modules.assign(power_w=[575.0, 125.0], power_w_max=[578.0, 692.0], frac_power_capped=[0.0, 0.3])
    text = chapter.power_text(fused, idle)
    assert ("125 W (largest sample 692 W), SM clock 1980 MHz, the power cap lowering the clock in 30% of the samples -- a "
            "median below half the largest sample: most samples fell outside the decode steps") in text
    assert "reaches the power cap" not in text
    table = pd.concat([fused.assign(model=throughput.THROUGHPUT_PAPER_MODEL), modules.assign(model=THROUGHPUT_UNFUSED_MODEL)])
    got, note = chapter.paper_rows(table, None, THROUGHPUT_UNFUSED_MODEL)
    assert got.tokens_per_s.tolist() == [2300.0, 2990.0] and note == ""


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon kernel needs a CUDA GPU")
@pytest.mark.parametrize("compress", ["all", "prompt"])
def test_compressed_engine_gives_the_uncompressed_tokens_through_the_same_kernel(compress):
    """ZipFusion's engine and the uncompressed engine, both in their default layouts (the mma layouts, the Gluon
    kernel) at the same split count, under a budget that holds every request at once: the same greedy tokens, every
    one -- the kernel reads packed pages into its raw pages' bits (test_decode_mma), so compression changes nothing.
    (An uncompressed engine in the token layouts reads through the Triton kernel: another summation order.)"""
    from zipkv import data, models
    from zipkv.engine import kv_budget_for
    model, tok = models.load_model(dtype=torch.bfloat16, device="cuda")
    ws = data.windows(tok, data.load_books(limit=4), n=4, context=512, continuation=0)
    prompts = [w.context_ids[:n].tolist() for w, n in zip(ws, (512, 300, 97, 200))]
    n = 48
    budget = kv_budget_for(model.config, len(prompts), 512 + n)
    kw = dict(eos_token_id=None, num_splits=2)
    raw = Engine(model, budget, compress="none", **kw)
    got = Engine(model, budget, compress=compress, **kw)
    assert got.memory.layouts == raw.memory.layouts == ("k_mma", "v_mma")
    want, res = raw.generate(prompts, n), got.generate(prompts, n)
    assert res.stats["frac_compressed_k"] > 0.3 and res.stats["max_batch"] == want.stats["max_batch"] == 4
    assert res.outputs == want.outputs


def test_the_chapter_compares_zipfusion_with_the_engines_own_uncompressed_default_too():
    """The chapter's uncompressed baseline is pinned to the token layouts (the Triton kernel, SGLang's FlashInfer
    stand-in) whatever the engine's default; the mma-layout uncompressed rows (the engine's default on a GPU) get
    their own sentence -- the ratio over them, whether the tokens/s bar holds against them -- and one in the
    verdict, while the end-to-end rows leave them out."""
    import pandas as pd

    from zipkv.study.experiments import throughput

    from zipkv.study.chapters import throughput as chapter
    from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL

    assert throughput.engine_settings("uncompressed") == dict(compress="none", k_layout="token", v_layout="token")
    assert throughput.engine_settings("zipfusion") == dict(compress="prompt")
    big = pd.DataFrame({"method": ["uncompressed", "zipfusion"] * 2, "batch": [32, 32, 46, 57], "max_batch": [46, 57] * 2,
                        "tokens_per_s": [2200.0, 2450.0, 2600.0, 3250.0], "step_ms": [14.5, 13.1, 17.7, 17.5],
                        "kv_budget_bytes": [2**30] * 4, "frac_compressed_k": [0, 0.8] * 2, "frac_compressed_v": [0, 0.9] * 2,
                        "stored_bits_per_value": [16.0, 12.6] * 2})
    mma = throughput.median_run([dict(model=THROUGHPUT_MMA_BASELINE_MODEL, method="uncompressed", batch=46, max_batch=46,
                                      tokens_per_s=t, step_ms=ms) for t, ms in ((2650.0, 17.36), (2640.0, 17.42), (2660.0, 17.3))])
    mma = pd.DataFrame([mma])
    text = chapter.mma_baseline_text(big, mma)
    assert "the median of 3 runs: 2,650, 2,640, 2,660 tokens/s) it takes 17.36 ms per step against 17.70 ms" in text
    assert "**1.226×** its 2,650 (over the token layouts: 1.250×)" in text and text.endswith("missed by 0.024.")
    assert chapter.mma_baseline_text(big, mma.assign(tokens_per_s=2500.0)).endswith("target is met.")
    assert chapter.mma_baseline_text(big, mma.iloc[:0]).endswith("This run did not time the engine in the tensor-core layouts.")
    verdict, _ = chapter.verdict(big, 32, mma_rows=mma)
    assert "(the mma layouts, the Gluon kernel's raw path; batch 46): **1.226×** tokens/s." in verdict
    assert "Gluon" not in chapter.verdict(big, 32)[0]
    table = pd.concat([big.assign(model="SmolLM2"), mma])
    assert chapter.e2e_rows(table).model.unique().tolist() == ["SmolLM2"]


def test_figure5_runs_the_mma_layout_baseline_repeats_times_and_keeps_the_end_to_end_runs(monkeypatch):
    """figure5(mma_baseline=True), its runs stubbed: uncompressed runs ``repeats`` more times in the mma layouts at
    its largest batch, the median a row of THROUGHPUT_MMA_BASELINE_MODEL; the chapter's other rows and the end-to-end
    runs come back untouched."""
    import pandas as pd

    from zipkv import data
    from zipkv.study.experiments import throughput
    from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL

    e2e_runs, cols = {"zipfusion": object()}, dict(kv_budget_bytes=2**30, frac_compressed_k=0.0, frac_compressed_v=0.0)
    monkeypatch.setattr(throughput, "_e2e", lambda *a, **k: ([dict(model="SmolLM2", method="uncompressed", batch=4,
                                                                   max_batch=4, tokens_per_s=1.0, **cols)], e2e_runs, {}, (None, None)))
    monkeypatch.setattr(data, "load_books", lambda *a, **k: [])
    monkeypatch.setattr(throughput, "real_kv_blocks", lambda *a, **k: None)
    monkeypatch.setattr(throughput, "make_codec", lambda *a, **k: None)
    monkeypatch.setattr(throughput, "_llama_setting", lambda *a, **k: (SimpleNamespace(config=None), dict(blocks=None, kv_budget_bytes=2**30)))
    monkeypatch.setattr(throughput, "packed_capacity",
                        lambda blocks, config, budget, **k: pd.DataFrame({"kv_budget_bytes": [budget]}))
    calls, mma_speeds = [], iter([2650.0, 2640.0, 2660.0])

    def run(model, method, batch=None, **kw):
        calls.append((method, batch, kw.get("k_layout")))
        tps = next(mma_speeds) if kw.get("k_layout") == "k_mma" else 1000.0 + len(calls)
        return dict(method=method, batch=batch or 46, tokens_per_s=tps, stats={}, **cols)
    monkeypatch.setattr(throughput, "decode_throughput", run)
    out = throughput.figure5(device="cpu", mma_baseline=True, repeats=3)
    mma_calls = [c for c in calls if c[2] == "k_mma"]
    assert mma_calls == [("uncompressed", None, "k_mma")] * 3 and calls[-3:] == mma_calls
    t = out["table"]
    row = t[t.model == THROUGHPUT_MMA_BASELINE_MODEL]
    assert len(row) == 1 and row.tokens_per_s.iloc[0] == 2650.0 and row.tokens_per_s_runs.iloc[0] == "[2650.0, 2640.0, 2660.0]"
    assert out["e2e_runs"] is e2e_runs and (t.model == "SmolLM2").sum() == 1
    cap = out["capacity"]              # the Llama-shape setting's budget, with the run's provenance
    assert cap.kv_budget_bytes.tolist() == [2**30] and {"device", "commit", "date"} <= set(cap.columns)
    assert throughput.figure5(device="cpu", shape=None)["capacity"] is None
    assert len(t[t.model == throughput.THROUGHPUT_PAPER_MODEL]) == 2 * len(throughput.METHODS)


def test_figure5_runs_only_the_methods_it_is_given_and_refuses_a_set_without_the_bars_two(monkeypatch):
    """figure5(methods=...) (the paper's card, whose memory does not hold the restore baselines' buffers): the
    Llama-shape rows are those methods' only; methods without the tokens/s bar's two, or unknown ones, are refused
    before anything runs."""
    import pandas as pd

    from zipkv import data
    from zipkv.study.experiments import throughput

    cols = dict(kv_budget_bytes=2**30, frac_compressed_k=0.0, frac_compressed_v=0.0)
    e2e = [dict(model="SmolLM2", method="uncompressed", batch=4, max_batch=4, tokens_per_s=1.0, **cols)]
    monkeypatch.setattr(throughput, "_e2e", lambda *a, **k: (e2e, {}, {}, (None, None)))
    monkeypatch.setattr(data, "load_books", lambda *a, **k: [])
    monkeypatch.setattr(throughput, "real_kv_blocks", lambda *a, **k: None)
    monkeypatch.setattr(throughput, "_llama_setting", lambda *a, **k: (SimpleNamespace(config=None), dict(blocks=None, kv_budget_bytes=2**30)))
    monkeypatch.setattr(throughput, "packed_capacity", lambda *a, **k: pd.DataFrame())
    calls = []

    def run(model, method, batch=None, **kw):
        calls.append(method)
        return dict(method=method, batch=batch or 46, tokens_per_s=1000.0, stats={}, **cols)
    monkeypatch.setattr(throughput, "decode_throughput", run)
    t = throughput.figure5(device="cpu", methods=("zipfusion", "uncompressed"))["table"]
    assert sorted(set(calls)) == ["uncompressed", "zipfusion"] and len(calls) == 4
    assert sorted(t[t.model == throughput.THROUGHPUT_PAPER_MODEL].method.unique()) == ["uncompressed", "zipfusion"]
    for bad in (("zipfusion",), ("uncompressed", "zipfusion", "lz4"), ()):
        with pytest.raises(ValueError, match="methods must be names of"):
            throughput.figure5(device="cpu", methods=bad)
    assert len(calls) == 4


def test_the_end_to_end_paragraph_takes_the_copy_bandwidth_measured_at_the_embedded_models_shape(tmp_path):
    """The latency chapter measures the copy bandwidth per shape (it depends on the bytes copied): the end-to-end
    paragraph takes the embedded model's rows, not a median over both shapes (which no run measured)."""
    import pandas as pd

    from zipkv.study.chapters import throughput as chapter

    csv = tmp_path / "lat.csv"
    pd.DataFrame({"shape": ["llama3.1-8b"] * 3 + ["smollm2-135m"] * 3,
                  "copy_bw_tbps": [4.3, 4.31, 4.3, 3.85, 3.86, 3.85]}).to_csv(csv, index=False)
    assert chapter.measured_copy_bandwidth(csv) == 3.85
    assert chapter.measured_copy_bandwidth(csv, "llama3.1-8b") == 4.3
    assert chapter.measured_copy_bandwidth(tmp_path / "absent.csv") is None


def test_the_chapters_row_sets_and_its_cpu_verdict():
    import pandas as pd

    from zipkv.study.chapters import throughput as chapter
    from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL

    table = pd.DataFrame({"model": [THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL, THROUGHPUT_MMA_BASELINE_MODEL] + ["SmolLM2"] * 4,
                          "method": ["zipfusion", "zipfusion", "uncompressed", "uncompressed", "zipfusion", "splitzip", "huffman"],
                          "batch": [57, 57, 46, 2, 3, 3, 2]})
    big, modules, mma, note = chapter.setting_rows(table)
    assert (big.model.tolist(), modules.model.tolist(), mma.model.tolist(), note) == (
        [THROUGHPUT_PAPER_MODEL], [THROUGHPUT_UNFUSED_MODEL], [THROUGHPUT_MMA_BASELINE_MODEL], "")
    text = chapter.e2e_verdict(table, {"zipfusion": dict(identical=4, requests=4, first_difference=[])})
    assert "largest batch 2 (uncompressed) → 3 (ZipFusion), 3 (SplitZip), 2 (Huffman)" in text


def test_each_gpu_run_of_the_chapter_joins_its_table_of_runs(tmp_path):
    """A GPU run appends one row (its bars' ratios, step times, clocks, board) to the side table beside its main
    table, keeping the rows already there; the chapter reads that table beside this run's table, else beside the
    committed one, and states the ratio's range over the runs (in the verdict, too) and how many meet the bar."""
    import pandas as pd

    from zipkv.study.chapters import throughput as chapter

    big = pd.DataFrame({"method": ["uncompressed", "zipfusion"] * 2, "batch": [32, 32, 46, 57], "max_batch": [46, 57] * 2,
                        "tokens_per_s": [2200.0, 2450.0, 2600.0, 3250.0], "step_ms": [14.5, 13.1, 17.7, 17.5],
                        "kv_budget_bytes": [2**30] * 4, "frac_compressed_k": [0, 0.8] * 2, "frac_compressed_v": [0, 0.9] * 2,
                        "stored_bits_per_value": [16.0, 12.6] * 2, "sm_clock_mhz": [1980.0, 1980.0, 1950.0, 1830.0],
                        "frac_power_capped": [0.0, 0.1, 0.5, 0.75]})
    record = {"date": "2026-12-05 17:53 UTC", "commit": "abc1234", "device": "NVIDIA H200 (CUDA 13.0)"}
    main = tmp_path / "zipfusion_throughput.csv"
    assert chapter.gpu_runs(main, None).empty
    chapter.append_gpu_run(main, big, None, 32, record=record)
    slower = big.assign(tokens_per_s=[2200.0, 2450.0, 2600.0, 3100.0], step_ms=[14.5, 13.1, 17.7, 18.4])
    chapter.append_gpu_run(main, slower, None, 32, record={**record, "gpu_uuid": "GPU-9f3e"})
    runs = chapter.gpu_runs(main, None)
    assert chapter.gpu_runs(None, main, append=(big, None, 32)).equals(runs)   # nowhere to append: nothing added
    (tmp_path / "run").mkdir()    # a results folder without a table of runs yet: this run's row starts one
    fresh = chapter.gpu_runs(tmp_path / "run" / "zipfusion_throughput.csv", main, append=(big, None, 32))
    assert len(fresh) == 1 and fresh.commit.iloc[0] and fresh.tokens_per_s_ratio.round(4).tolist() == [1.25]
    assert list(runs.commit) == ["abc1234"] * 2 and list(runs.gpu_uuid) == ["unrecorded", "GPU-9f3e"]
    assert list(runs.zipfusion_max_batch) == [57, 57] and runs.tokens_per_s_ratio_mma_baseline.isna().all()
    assert list(runs.tokens_per_s_ratio.round(4)) == [1.25, 1.1923] and list(runs.zipfusion_sm_clock_mhz) == [1830.0] * 2
    assert list(runs.uncompressed_frac_power_capped) == [0.5, 0.5]
    assert chapter.gpu_runs(tmp_path / "elsewhere.csv", main).equals(runs)      # no table here: the committed one's
    text = chapter.gpu_runs_text(runs)
    assert "2 GPU runs" in text and "1 board identified, 1 run from before the board was recorded" in text
    assert "between 1.192× and 1.250×" in text and "the tokens/s target is met in 1 of them" in text
    assert chapter.gpu_runs_text(runs.iloc[:1]) == ""
    assert "Over this chapter's 2 GPU runs the tokens/s ratio ranges 1.192–1.250×" in chapter.verdict(big, 32, runs=runs)[0]
    assert "GPU runs" not in chapter.verdict(big, 32, runs=runs.iloc[:1])[0]
    text_shown, table_shown = chapter.gpu_runs_section(runs)
    assert text_shown.data == text and "1.192×" in table_shown.to_html()
    assert chapter.gpu_runs_section(runs.iloc[:1]) == []
