"""The simulator's runs overlap the rest of the suite (see ``test_cuda_simulator.py``)."""

from __future__ import annotations

import pytest

SIMULATED = "test_cuda_simulator.py"


def _simulated(items: list[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if item.path.name == SIMULATED]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The simulator's tests last, so that its background runs have the session to finish."""
    simulated = _simulated(items)
    if simulated:
        items[:] = [item for item in items if item.path.name != SIMULATED] + simulated


def pytest_collection_finish(session: pytest.Session) -> None:
    simulated = _simulated(session.items)
    if simulated and not session.config.option.collectonly:
        simulated[0].module.RUNS.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for item in _simulated(session.items)[:1]:
        item.module.RUNS.stop()
