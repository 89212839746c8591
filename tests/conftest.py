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
