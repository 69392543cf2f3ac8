import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models: torch's thread pool only adds synchronisation (and spins on a busy machine)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
