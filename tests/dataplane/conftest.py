import pytest

from tests.dataplane.helpers_dataplane import ENGINE_DEVICES, make_engine


@pytest.fixture(params=ENGINE_DEVICES)
def engine_device(request):
    return request.param


@pytest.fixture
def engine(tmp_path, engine_device):
    e = make_engine(tmp_path / "disk", device=engine_device)
    yield e
    e.check_integrity()
    e.close()
