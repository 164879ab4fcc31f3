"""power-suffix: model-free speculation from a suffix index over the prompt, the output and the
session's earlier requests, with the draft length chosen per round."""

from power_suffix.index import SuffixIndex
from power_suffix.proposer import SuffixProposer

__all__ = ["SuffixIndex", "SuffixProposer"]
