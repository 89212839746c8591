import pytest
import torch


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
