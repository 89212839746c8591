"""zipkv.engine as a server: sampling (zipkv.sampling) inside the decode step, stop tokens and strings, streaming, text
in and out, the progress bar, and arguments refused before any work.

The engine tests run a tiny random Llama whose matrix products give bit-equal rows whatever the batch (on this CPU at
hidden size 128), so that a request's logits -- not only the sampler, which is per row by construction -- are the same
alone and in a batch; :func:`test_the_sampler_is_per_row` checks the sampler's part on its own.
"""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from test_engine import reference_attention  # noqa: E402, F401  (registers the "zipkv_reference" attention)
import numpy as np  # noqa: E402

from zipkv.engine import Engine, Prefix, StreamOutput  # noqa: E402
from zipkv.sampling import SamplingParams, TextStream, gumbel_noise, sample, step_inputs, stream_key  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(70, 75))]


def _rows(n, temperature=1.0, top_k=0, top_p=1.0):
    """Per-row sampler inputs for ``n`` rows of one setting: ``(temperature, top_k, top_p)`` tensors."""
    return (torch.full((n,), temperature, dtype=torch.float64), torch.full((n,), top_k),
            torch.full((n,), top_p, dtype=torch.float64))


def _expected(logits, temperature, top_k, top_p):
    """softmax(logits / T) over the top_k largest logits, then over the fewest largest of those whose probability
    (renormalised over the top k, as vLLM and Hugging Face do) reaches top_p (fp64; distinct logits)."""
    p = (logits.double() / temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    p = torch.where(torch.isin(torch.arange(len(p)), torch.tensor(order[:top_k or len(p)])), p, 0.0)
    p = p / p.sum()
    keep, total = [], 0.0
    for i in order:
        if total >= top_p:
            break
        keep.append(i)
        total += float(p[i])
    p = torch.where(torch.isin(torch.arange(len(p)), torch.tensor(keep)), p, 0.0)
    return p / p.sum()


def _chi2_critical(df: int, z: float = 4.75) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile ``z`` (Wilson-Hilferty;
    z = 4.75: a false alarm about once in a million runs)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, expected):
    n = counts.sum()
    kept = expected > 0
    return float(((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum()), int(kept.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 1.25, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]).to(torch.bfloat16)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.75), (1.5, 6, 0.9), (0.7, 0, 0.5),
    (0.7, 0, 0.3)])
@pytest.mark.parametrize("vary", ["key", "position"])
def test_the_sampler_draws_softmax_of_logits_over_temperature_within_top_k_and_top_p(temperature, top_k, top_p, vary):
    """40,000 draws on fixed logits -- one per stream key, or one per position of one key -- have the frequencies of
    ``softmax(logits / T)`` restricted by top-k and top-p (a chi-square test at about one false alarm in a million),
    never a token outside them; the same test rejects the unfiltered T = 1 distribution wherever that differs."""
    n = 40_000
    keys = torch.arange(n) if vary == "key" else torch.full((n,), stream_key(0, 5, 2))
    positions = torch.full((n,), 17) if vary == "key" else torch.arange(n)
    t, k, p = _rows(n, temperature, top_k, top_p)
    tokens = sample(LOGITS.expand(n, -1), keys, positions, t, k, p)
    counts = torch.bincount(tokens, minlength=LOGITS.numel()).double()
    want = _expected(LOGITS, temperature, top_k, top_p)
    assert (counts[want == 0] == 0).all(), counts
    stat, df = _chi2(counts, want)
    assert stat < _chi2_critical(df) if df else counts[want > 0] == n, (stat, counts.tolist(), (n * want).tolist())
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        plain = _expected(LOGITS, 1.0, 0, 1.0)
        stat, df = _chi2(counts, plain) if (want > 0).all() else (float("inf"), 1)
        assert stat > _chi2_critical(df), "the test cannot tell the distributions apart"


def test_the_noise_is_uniform_and_tied_to_key_position_and_index():
    """The Gumbel noise's mean and variance (Euler's constant, pi^2 / 6) over a million entries of consecutive keys and
    positions; it is the same on a second call and for a row alone, and changes with the key, the position and the
    index."""
    keys, positions = torch.arange(1000) * 3, torch.arange(1000) // 7
    g = gumbel_noise(keys, positions, 1000)
    assert torch.isfinite(g).all()
    assert abs(g.double().mean() - 0.5772157) < 0.01 and abs(g.double().var() - math.pi ** 2 / 6) < 0.02
    assert torch.equal(g, gumbel_noise(keys, positions, 1000))
    assert torch.equal(g[5:6], gumbel_noise(keys[5:6], positions[5:6], 1000))
    assert not torch.equal(g[5], gumbel_noise(keys[5:6] + 1, positions[5:6], 1000)[0])
    assert not torch.equal(g[5], gumbel_noise(keys[5:6], positions[5:6] + 1, 1000)[0])
    assert (g[:, 1:] != g[:, :-1]).float().mean() > 0.999
    assert 0 <= stream_key(0, 2**70, -1) < 2**62 and stream_key(1, 3) != stream_key(0, 3) != stream_key(0, 3, 0)


def test_the_sampler_is_per_row():
    """A batch of mixed settings gives each row the token it gets alone (bit for bit: every op is per row); greedy rows
    are the logits' argmax, and a tiny temperature or top_k = 1 is greedy too."""
    torch.manual_seed(0)
    B, V = 9, 300
    logits = (torch.randn(B, V) * 3).to(torch.bfloat16)
    keys, positions = torch.arange(B) * 1_000_003, torch.arange(B) + 40
    t = torch.tensor([0.0, 1.0, 0.7, 1e-6, 1.0, 2.0, 0.0, 1.0, 0.9], dtype=torch.float64)
    k = torch.tensor([0, 0, 5, 0, 1, 40, 3, 0, 7])
    p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5, 0.2, 0.01, 0.95], dtype=torch.float64)
    got = sample(logits, keys, positions, t, k, p)
    alone = torch.cat([sample(logits[i:i + 1], keys[i:i + 1], positions[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1])
                       for i in range(B)])
    assert torch.equal(got, alone)
    greedy = logits.argmax(-1)
    assert torch.equal(got[[0, 3, 4, 6, 7]], greedy[[0, 3, 4, 6, 7]])     # T = 0, T = 1e-6, top_k = 1, top_p ~ 0
    assert not torch.equal(got, greedy)


def test_the_step_inputs_carry_each_request_s_parameters_through_an_int64_buffer():
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.85, top_k=12, seed=4)]
    rows = torch.tensor(list(zip(*(p.step_column(stream_key(1, i)) for i, p in enumerate(params)))))
    buffer = torch.cat([torch.zeros(4, 2, dtype=torch.int64), rows])            # the decode step's [8, batch]
    keys, top_k, temperature, top_p = step_inputs(buffer[4:])
    assert keys.tolist() == [stream_key(1, 0), stream_key(1, 1)] and top_k.tolist() == [0, 12]
    assert temperature.tolist() == [0.0, 0.7] and top_p.tolist() == [1.0, 0.85]


# ---------------------------------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def model():
    """The tiny Llama with test_engine's fp32 reference attention in its own forward (the prefill's), the engine's
    decode arithmetic."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)
    model.config._attn_implementation = "zipkv_reference"
    return model


def _page_bytes(model):
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 32 * cfg.head_dim


def _engine(model, pages=10, **kw):
    return Engine(model, pages * _page_bytes(model), **{**dict(attention="reference", pages_per_chunk=2,
                                                               eos_token_id=None), **kw})


def test_sampled_tokens_are_reproducible_whatever_the_batch_retraction_or_overlap(model):
    """With a fixed seed a request's sampled tokens are the same on a second run, alone in every step
    (``max_batch=1``), without overlap, and under a budget that retracts and requeues requests (each re-prefilled,
    its prefill sampling the next position with the same key); another seed gives other tokens. A request with a seed
    of its own samples the same tokens alone and at another index beside other requests."""
    kw = dict(temperature=1.0, top_p=0.95, top_k=40, seed=7)
    want = _engine(model).generate(PROMPTS, 12, **kw)
    assert want.stats["seed"] == 7 and [len(o) for o in want.outputs] == [12] * 3
    assert _engine(model).generate(PROMPTS, 12, **kw).outputs == want.outputs
    assert _engine(model, max_batch=1).generate(PROMPTS, 12, **kw).outputs == want.outputs
    assert _engine(model, overlap=False).generate(PROMPTS, 12, **kw).outputs == want.outputs
    grow = [list(range(3, 17)), list(range(20, 34)), list(range(40, 54))]       # one page each, three at the end
    roomy = _engine(model, pages=20, pages_per_chunk=1).generate(grow, 20, **kw)
    for overlap in (True, False):
        tight = _engine(model, pages=5, pages_per_chunk=1, reserve_ratio=0.2, overlap=overlap).generate(grow, 20, **kw)
        assert tight.stats["retracted"] > 0 and tight.outputs == roomy.outputs
    other = _engine(model).generate(PROMPTS, 12, **{**kw, "seed": 8}).outputs
    assert all(a != b for a, b in zip(other, want.outputs))

    own = SamplingParams(temperature=0.8, seed=11)
    alone = _engine(model).generate([PROMPTS[1]], 12, own).outputs[0]
    beside = _engine(model).generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], 12,
                                     [SamplingParams(), SamplingParams(temperature=1.0, seed=3), own]).outputs
    assert beside[2] == alone and alone != want.outputs[1]


def test_greedy_is_the_default_and_the_limit_of_sampling(model):
    """temperature 0 or None (or a default SamplingParams) is the greedy step, token for token; so are a tiny
    temperature and top_k = 1. Greedy requests beside sampled ones keep their greedy tokens. Without a seed, one is
    drawn and reported, and reproduces the run."""
    eng = _engine(model)
    greedy = eng.generate(PROMPTS, 12)
    assert greedy.stats["seed"] is None
    for kw in (dict(temperature=0), dict(temperature=None, seed=3), dict(sampling_params=SamplingParams()),
               dict(temperature=1e-4, seed=1), dict(temperature=1.0, top_k=1, seed=2)):
        assert eng.generate(PROMPTS, 12, **kw).outputs == greedy.outputs, kw
    mixed = eng.generate(PROMPTS, 12, [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()], seed=4)
    assert mixed.outputs[0] == greedy.outputs[0] and mixed.outputs[2] == greedy.outputs[2]
    assert mixed.outputs[1] != greedy.outputs[1]
    drawn = eng.generate(PROMPTS, 12, temperature=1.0)
    assert isinstance(drawn.stats["seed"], int)
    assert eng.generate(PROMPTS, 12, temperature=1.0, seed=drawn.stats["seed"]).outputs == drawn.outputs


def test_each_sampled_token_is_the_sampler_s_draw_from_the_model_s_logits(model):
    """Every token the engine samples -- the prefill's and the decode steps' -- is :func:`sample` of the model's own
    forward logits over the request's tokens before it, with the request's stream key and the position of its last
    token: the step samples the distribution of the right position."""
    seed, params = 9, SamplingParams(temperature=0.9, top_p=0.9)
    out = _engine(model).generate(PROMPTS, 8, params, seed=seed).outputs
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, out)):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]                   # [8, V]: the logits each token had
        n = len(tokens)
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        got = sample(logits, torch.full((n,), stream_key(0, seed, i)), positions, *_rows(n, 0.9, 0, 0.9))
        assert got.tolist() == tokens, i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and overlapped steps need CUDA")
def test_sampling_runs_inside_the_captured_decode_step_on_the_gpu():
    """On CUDA the sampler runs inside each composition's captured decode step (captured and replayed, no capture
    error: nothing in it syncs with the host), and gives the tokens of eager steps and of steps without overlap; on
    fixed logits the GPU's sampler draws the CPU's tokens (integer hashing, fp32 noise)."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to("cuda", torch.bfloat16)
    kw = dict(temperature=1.0, top_p=0.9, top_k=50, seed=3)

    def engine(**extra):
        return Engine(model, 10 * _page_bytes(model), pages_per_chunk=2, eos_token_id=None, **extra)
    res = engine().generate(PROMPTS, 24, **kw)
    assert res.stats["cuda_graphs"] and res.stats["graph_error"] is None
    assert {"capture", "replay"} <= {s["mode"] for s in res.stats["steps"]}
    assert engine(cuda_graphs=False).generate(PROMPTS, 24, **kw).outputs == res.outputs
    assert engine(overlap=False).generate(PROMPTS, 24, **kw).outputs == res.outputs
    torch.manual_seed(1)
    logits = (torch.randn(2048, 5000) * 4).to(torch.bfloat16)
    rows = (torch.arange(2048) * 7919, torch.arange(2048) % 100, *_rows(2048, 0.8, 1000, 0.95))
    cpu = sample(logits, *rows)
    gpu = sample(logits.cuda(), *(r.cuda() for r in rows))
    assert torch.equal(gpu.cpu(), cpu)


def _collect(stream):
    """The stream's deltas per request (tokens, text, how many deltas, the finished flags) and its return value."""
    per = {}
    while True:
        try:
            d = next(stream)
        except StopIteration as done:
            return per, done.value
        assert isinstance(d, StreamOutput)
        tokens, text, n, flags = per.get(d.index, ([], "", 0, []))
        per[d.index] = (tokens + d.token_ids, text + (d.text or ""), n + 1, flags + [d.finished])


def test_streaming_gives_generate_s_tokens_as_steps_are_read(model):
    """The deltas of each request add up to ``generate``'s tokens for the same seed; they come step by step (a
    request's tokens over many deltas, the requests' deltas interleaved), each request's last delta alone finished;
    the stream's return value is ``generate``'s result."""
    kw = dict(temperature=1.0, seed=21)
    want = _engine(model).generate(PROMPTS, 12, **kw)
    order = []
    per, result = _collect(_recording(_engine(model).stream(PROMPTS, 12, **kw), order))
    assert {i: v[0] for i, v in per.items()} == dict(enumerate(want.outputs))
    assert result.outputs == want.outputs and result.texts is None
    assert all(v[2] >= 6 and v[3][-1] and not any(v[3][:-1]) for v in per.values())
    assert order[:3] == [0, 1, 2] and len(set(order[:6])) == 3                 # interleaved, not request after request


def _recording(stream, order):
    """``stream``, recording each delta's request index in ``order``; its return value passed on."""
    while True:
        try:
            d = next(stream)
        except StopIteration as done:
            return done.value
        order.append(d.index)
        yield d


def test_stop_token_ids_end_a_request_at_the_token(model):
    """``stop_token_ids`` beside ``eos_token_id``: a request ends at its first stop token, kept as its last token, the
    others run on; streamed the same."""
    eng = _engine(model, max_batch=1)
    free = eng.generate(PROMPTS, 16, temperature=1.0, seed=5).outputs
    stop = free[2][5]
    got = eng.generate(PROMPTS, 16, temperature=1.0, seed=5, stop_token_ids=[stop])
    for o, f in zip(got.outputs, free):
        assert o == (f[:f.index(stop) + 1] if stop in f else f)
    assert len(got.outputs[2]) <= 6
    per, _ = _collect(eng.stream(PROMPTS, 16, temperature=1.0, seed=5, stop_token_ids=stop))
    assert [per[i][0] for i in range(3)] == got.outputs


@pytest.fixture(scope="module")
def tokenized(model, tokenizer):
    """The tiny model's sampled tokens as the embedded model's tokenizer reads them (ids 0-127: special tokens, ASCII
    characters, lone UTF-8 bytes), without stop strings."""
    eng = _engine(model, tokenizer=tokenizer, max_batch=1)
    res = eng.generate(PROMPTS, 40, temperature=1.0, seed=13)
    return eng, res


def test_stop_strings_end_the_tokens_and_the_text_before_them(tokenized):
    """A stop string cuts a request's text right before its first appearance and its tokens before the token in which
    it begins; a request whose text never holds it runs to the end. The stop string here is request 0's first pair of
    one-character tokens after a third, not seen before in its text. The stream gives the same tokens and text, and
    never gives out what the stop string then takes back."""
    eng, free = tokenized
    tok, out0 = eng.tokenizer, free.outputs[0]
    ascii_ = lambda t: 17 <= t <= 110                                                 # noqa: E731
    j = next(j for j in range(4, len(out0) - 1) if all(map(ascii_, out0[j - 1:j + 2]))
             and tok.decode(out0[j:j + 2]) not in tok.decode(out0[:j + 1], skip_special_tokens=True))
    stop = tok.decode(out0[j:j + 2])
    got = eng.generate(PROMPTS, 40, temperature=1.0, seed=13, stop=[stop, "\x00never"])
    assert got.outputs[0] == out0[:j] and got.texts[0] == tok.decode(out0[:j], skip_special_tokens=True)
    for out, text, f_out, f_text in zip(got.outputs, got.texts, free.outputs, free.texts):
        if stop not in f_text:
            assert (out, text) == (f_out, f_text)
            continue
        assert text == f_text[:f_text.index(stop)] and out == f_out[:len(out)]
        assert text.startswith(tok.decode(out, skip_special_tokens=True))
    per, result = _collect(eng.stream(PROMPTS, 40, temperature=1.0, seed=13, stop=[stop, "\x00never"]))
    assert [per[i][0] for i in range(3)] == got.outputs and [per[i][1] for i in range(3)] == got.texts
    assert result.texts == got.texts


def test_text_is_decoded_incrementally_as_the_whole_output_decodes(tokenized, tokenizer):
    """The texts read token by token are the outputs' decoded text (lone UTF-8 bytes included), and the stream's text
    deltas add up to them. A stream holds back the text a stop string may still take back."""
    eng, free = tokenized
    assert free.texts == [tokenizer.decode(o, skip_special_tokens=True) for o in free.outputs]
    per, _ = _collect(eng.stream(PROMPTS, 40, temperature=1.0, seed=13))
    assert [per[i][1] for i in range(3)] == free.texts
    ts = TextStream(tokenizer, [65], stop=["~@"])
    assert ts.update([110], False) is None and ts.streamable() == 0            # "~" may start the stop string
    assert ts.update([110, 48], False) == 0 and ts.text == ""                  # "~@": no token lies before it


def test_text_prompts_are_the_tokenizer_s_ids(model, tokenizer):
    """With a tokenizer, strings are prompts -- ``tokenizer(text).input_ids`` -- beside token ids."""
    eng = _engine(model, tokenizer=tokenizer)
    words = ["Q~Z", "Zq~X", "#@!"]
    ids = [tokenizer(w).input_ids for w in words]
    assert eng.generate(words, 6).outputs == eng.generate(ids, 6).outputs
    assert eng.generate([words[0], ids[1]], 6).outputs[1] == eng.generate(ids, 6).outputs[1]


@pytest.mark.slow
def test_the_embedded_model_serves_text_in_and_out(tokenizer):
    """SmolLM2 in bf16 with its tokenizer: strings in, greedy and sampled texts out, the texts the tokens' decoding,
    the stream's text deltas the same texts, a stop string cutting the text."""
    from zipkv import models
    model, _ = models.load_model(dtype=torch.bfloat16)
    eng = Engine(model, 64 * _page_bytes(model), attention="reference", max_batch=1, tokenizer=tokenizer)
    prompts = ["The capital of France is", "Once upon a time"]
    res = eng.generate(prompts, 12, temperature=0.8, seed=1, progress=False)
    assert res.texts == [tokenizer.decode(o, skip_special_tokens=True) for o in res.outputs]
    per, _ = _collect(eng.stream(prompts, 12, temperature=0.8, seed=1))
    assert [per[i][1] for i in range(2)] == res.texts
    word = res.texts[1].split()[2]
    cut = eng.generate(prompts, 12, temperature=0.8, seed=1, stop=word, progress=False)
    assert cut.texts[1] == res.texts[1][:res.texts[1].index(word)]


def test_leaving_a_stream_early_frees_its_pages_and_one_call_runs_at_a_time(model):
    eng = _engine(model)
    want = eng.generate(PROMPTS, 12, temperature=1.0, seed=2).outputs
    stream = eng.stream(PROMPTS, 12, temperature=1.0, seed=2)
    next(stream), next(stream)
    with pytest.raises(RuntimeError, match="running another generate or stream call"):
        eng.generate(PROMPTS, 12)
    stream.close()
    assert not eng.memory.requests and eng.memory.used_bytes() == 0
    assert eng.generate(PROMPTS, 12, temperature=1.0, seed=2).outputs == want


def test_the_progress_bar_waits_a_second_by_default(model, monkeypatch):
    """The tokens' bar is made with tqdm's ``delay=1`` (it shows only once the run has taken a second), at once with
    ``progress=True``, never with ``progress=False`` (the default of ``stream``); a request stopped early takes its
    missing tokens off the bar's total."""
    import tqdm.auto
    bars = []

    class Bar:
        def __init__(self, total, delay, **kw):
            self.total, self.delay, self.n = total, delay, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def refresh(self):
            pass

        def close(self):
            pass
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    eng = _engine(model)
    eng.generate(PROMPTS, 4)
    eng.generate(PROMPTS, 4, progress=True)
    eng.generate(PROMPTS, 4, progress=False)
    list(eng.stream(PROMPTS, 4))
    assert [b.delay for b in bars] == [1, 0] and all(b.n == b.total == 12 for b in bars)
    free = eng.generate(PROMPTS, 8, progress=False).outputs
    res = eng.generate(PROMPTS, 8, stop_token_ids=[free[2][2]])
    assert bars[-1].n == bars[-1].total == sum(map(len, res.outputs)) < 24


@pytest.mark.parametrize("kw, error, match", [
    (dict(temperature=-1), ValueError, r"temperature must be a finite number >= 0 \(0 or None: greedy\), got -1"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be .* got nan"),
    (dict(temperature="hot"), ValueError, r"temperature must be .* got 'hot'"),
    (dict(top_p=0), ValueError, r"top_p must be a number in \(0, 1\] \(1: no top-p\), got 0"),
    (dict(top_p=1.5), ValueError, r"top_p must be a number in \(0, 1\] .* got 1.5"),
    (dict(top_k=-1), ValueError, r"top_k must be an int >= 0 \(0: no top-k\), got -1"),
    (dict(top_k=2.5), TypeError, r"top_k must be an int >= 0 .* got float 2.5"),
    (dict(seed="1"), TypeError, r"seed must be an int or None, got str '1'"),
    (dict(seed=1.5), TypeError, r"seed must be an int or None, got float 1.5"),
    (dict(stop=5), TypeError, r"stop must be a str or a list of str, got 5"),
    (dict(stop=["a", 3]), TypeError, r"stop must be a str or a list of str, got \['a', 3\]"),
    (dict(stop=""), ValueError, r"stop strings must not be empty"),
    (dict(stop="ab"), ValueError, r"stop=\['ab'\]: stop strings need the tokenizer, Engine\(model, \.\.\., tokenizer="),
    (dict(stop_token_ids=[200]), ValueError, r"stop_token_ids must be token ids in \[0, 128\), got 200"),
    (dict(stop_token_ids="a"), ValueError, r"stop_token_ids must be token ids .* got 'a'"),
    (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids must be token ids \(ints >= 0"),
    (dict(sampling_params=SamplingParams(), temperature=1.0), ValueError,
     r"either in sampling_params or in keywords, not both: got sampling_params and temperature"),
    (dict(sampling_params=[SamplingParams()]), TypeError, r"a list of one per prompt \(2\), got list of 1"),
    (dict(sampling_params={"temperature": 1.0}), TypeError, r"sampling_params must be .* got dict"),
    (dict(progress="yes"), TypeError, r"progress must be a bool or None, got str 'yes'"),
    (dict(prompts=["hello", [1, 2]]), TypeError, r"prompts\[0\] is a str: text prompts need the tokenizer"),
    (dict(prompts="hello"), ValueError, r"prompts must be a non-empty list .* got str"),
    (dict(prompts=[{1: 2}, [3]]), TypeError, r"prompts\[0\] must be a sequence of token ids, got dict"),  # its keys
    (dict(prompts=[[1], {3, 2}]), TypeError, r"prompts\[1\] must be a sequence of token ids, got set"),   # unordered
    (dict(prefixes=[Prefix([(torch.ones(2, 3, 32, dtype=torch.long),) * 2] * 2, 3), None]), TypeError,
     r"prefixes\[0\]: prefix layer 0: expected \(keys, values\) as floating-point torch tensors .* torch.int64"),
    (dict(prefixes=[Prefix([(np.ones((2, 3, 32), np.float32),) * 2] * 2, 3), None]), TypeError,
     r"prefixes\[0\]: prefix layer 0: .* got \['ndarray float32', 'ndarray float32'\]"),   # an AttributeError late
])
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_bad_arguments_are_refused_before_any_work(model, kw, error, match, call):
    """Each bad argument is a ``TypeError`` / ``ValueError`` naming it, what was given and what is expected -- raised
    by ``stream`` when called, not when first iterated -- before any prefill."""
    eng = _engine(model)
    prefill = eng.runner.prefill
    eng.runner.prefill = lambda req: pytest.fail("a prefill ran")
    kw = dict(kw)
    prompts = kw.pop("prompts", [[1, 2, 3], [4, 5]])
    with pytest.raises(error, match=match):
        getattr(eng, call)(prompts, 4, **kw)
    eng.runner.prefill = prefill
    assert not eng.memory.requests and eng.memory.used_bytes() == 0 and not eng.busy


def test_a_model_or_tokenizer_the_engine_cannot_use_says_how_to_fix_it(model):
    fp32 = tiny_llama(q_heads=4, kv_heads=2, head_dim=32)
    with pytest.raises(TypeError, match=r"got torch.float32: load it with zipkv.load_model\(dtype=torch.bfloat16\), "
                                        r"or convert it with model.to\(torch.bfloat16\)"):
        Engine(fp32, 10**6)
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer .* got str"):
        Engine(model, 10**6, tokenizer="gpt2")


def test_constructor_arguments_that_would_be_ignored_or_never_fit_are_refused(model):
    """``restore_buffer_pages`` without ``restore`` was silently ignored; a budget past the machine's memory spent
    hours building the memory's chunk bookkeeping (a hang) before the pool's allocation could fail."""
    import time

    with pytest.raises(ValueError, match=r"restore_buffer_pages=3 sizes the restore baseline's buffer: it needs "
                                         r"restore="):
        _engine(model, restore_buffer_pages=3)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"kv_budget_bytes=1000000000000000 is more than the whole memory of cpu"):
        Engine(model, 10**15, attention="reference")
    assert time.perf_counter() - started < 5


def test_layouts_no_kernel_reads_are_refused_for_the_kernel_and_read_by_the_reference():
    """A k_mma/token pair, which no decode kernel reads, failed at the first decode step, after the prefill, under
    either attention: now the kernel's engine refuses it when made, and the reference reads any pair of layouts (the
    greedy tokens of the token layouts)."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=64, seed=5).to(torch.bfloat16)
    model.config._attn_implementation = "zipkv_reference"
    with pytest.raises(ValueError, match=r"k_layout/v_layout: the mma layouts go together .* got k_layout='k_mma', "
                                         r"v_layout='token'"):
        Engine(model, 10**6, attention="kernel", k_layout="k_mma", v_layout="token")
    want = _engine(model, 20).generate(PROMPTS, 6).outputs
    for layouts in (("token", "v_mma"), ("k_mma", "channel")):
        eng = _engine(model, 20, k_layout=layouts[0], v_layout=layouts[1])
        assert eng.memory.layouts == layouts and eng.generate(PROMPTS, 6).outputs == want
