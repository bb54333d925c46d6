"""Kernel tests run the real Triton kernels: compiled on a GPU host, through Triton's
interpreter on CPU-only hosts (CI). The kernels pick their mode at call time, so setting
TRITON_INTERPRET here, per test, is enough, and it does not leak into other test packages."""
import pytest
import torch

CUDA = torch.cuda.is_available()
# Where the kernels run in this session: the GPU when there is one, else the CPU interpreter.
KERNEL_DEVICES = ["cuda"] if CUDA else ["cpu"]


@pytest.fixture(autouse=True)
def _interpret_triton_on_cpu(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=KERNEL_DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the suite's ``rng`` (printed; RESIDENCY_TEST_SEED replays)."""
    return torch.Generator().manual_seed(rng.randrange(1 << 62))
