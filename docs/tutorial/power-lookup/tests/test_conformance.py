"""The tutorial adapter passes Power's conformance kit exactly as a third party runs it."""

from power_core.testing import AdapterConformance


class TestLookup(AdapterConformance):
    strategy_name = "lookup"
    k = 4

    def prompt(self, seed, n_vocab):
        base = super().prompt(seed, n_vocab)
        return base + base + base[:2]  # repetition gives the lookup something to find
