import logging

import pytest
import structlog


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
