"""Conformance kit for proposal adapters (``pip install power-core[testing]``).

Subclass :class:`AdapterConformance`, supply your strategy, and pytest runs every standard check::

    from power_core.testing import AdapterConformance

    class TestMyAdapter(AdapterConformance):
        strategy_name = "my-adapter"

Opting out of a check requires overriding it with ``@pytest.mark.xfail(reason=...)``; a guard test
fails on any silent override.
"""

from power_core.testing.conformance import AdapterConformance
from power_core.testing.faults import FaultInjector

__all__ = ["AdapterConformance", "FaultInjector"]
