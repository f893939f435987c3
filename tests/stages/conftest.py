import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matmuls run faster on one intra-op thread than on two (and far faster when
    the two cores are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
