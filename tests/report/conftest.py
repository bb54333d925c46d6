from tests.diagnose.conftest import L  # noqa: F401  (the hand-built ledger fixture)
