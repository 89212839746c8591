"""The engine with pages in the escape format (``Engine(block_format="escape")``, zipkv.memory.escape_pages): greedy
tokens equal ``model.generate``'s on the CPU reference path (which unpacks pages through their escape lists), every
full page's blocks compressed, the stored bytes those of the escape format; bad arguments refused."""
import pytest
import torch

from conftest import tiny_llama
from test_engine import _assert_tokens_of_generate, _generate, _page_bytes
from zipkv import Engine, codecs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)
    m.config._attn_implementation = "zipkv_reference"
    return m


@pytest.mark.parametrize("compress", ["all", "prompt"])
def test_greedy_tokens_equal_generate_with_escape_pages(model, compress):
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 83))]
    n = 10
    ref = _generate(model, prompts, n)
    budget = 10 * _page_bytes(model)
    esc = Engine(model, budget, compress=compress, pages_per_chunk=2, block_format="escape",
                 attention="reference")
    seen = []
    free = esc.memory.free

    def counted(rid):                    # the escapes a request's pages list, just before they are freed
        pages = torch.tensor(esc.memory.requests[rid].pages, dtype=torch.int64)
        seen.append(int((esc.memory.pages.esc_all[:, pages] & 0x7F).sum()))
        return free(rid)
    esc.memory.free = counted
    res = esc.generate(prompts, n)
    _assert_tokens_of_generate(res.outputs, ref)
    zf = Engine(model, budget, compress=compress, pages_per_chunk=2,
                attention="reference").generate(prompts, n)
    assert res.outputs == zf.outputs
    assert res.stats["frac_compressed_k"] > zf.stats["frac_compressed_k"]     # blocks ZipFusion's format leaves raw
    assert res.stats["frac_compressed_v"] >= zf.stats["frac_compressed_v"]
    assert max(seen) > 0                                                         # escapes were listed and read back
    mem = res.stats["memory"]
    assert mem["running"] == 0 and mem["outstanding"] == 0 and esc.memory.used_bytes() == 0


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="block_format"):
        Engine(model, 10 * _page_bytes(model), block_format="huffman")
    with pytest.raises(ValueError, match="block_format='escape'"):
        Engine(model, 10 * _page_bytes(model), compress="prompt", block_format="escape", restore=codecs.Huffman())
    if not torch.cuda.is_available():               # the fused kernel that reads escape lists is the mma layouts' one
        with pytest.raises(ValueError, match="Gluon"):
            Engine(model, 10 * _page_bytes(model), block_format="escape", attention="kernel")
