"""Test suites every implementation of an interface must pass, run from the unit and the
integration tests alike (nothing here is collected on its own: no `test_*` modules)."""

import pytest

# Shared suites are not test modules: without this their asserts would say only "False".
pytest.register_assert_rewrite("tests.contract.runtime_contract")
