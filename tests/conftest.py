"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lantern.testing import single_thread


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: intra-op threads only add synchronisation on a shared 2-core machine. A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with single_thread():
        yield
