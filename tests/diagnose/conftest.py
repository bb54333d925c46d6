import pytest

from tests.diagnose.ledgers import Ledger, fresh_seed


@pytest.fixture
def L() -> Ledger:
    return Ledger(fresh_seed())
