import pytest

from tests.dataplane.helpers_dataplane import MOVER_DEVICES, make_mover


@pytest.fixture(params=MOVER_DEVICES)
def mover_device(request):
    return request.param


@pytest.fixture
def mover(tmp_path, mover_device):
    e = make_mover(tmp_path / "disk", device=mover_device)
    yield e
    e.check_integrity()
    e.close()
