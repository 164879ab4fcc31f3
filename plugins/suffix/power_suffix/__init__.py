"""power-suffix: model-free speculation from suffix indexes over the request, earlier requests of
its tenant and a corpus, with the draft length chosen per round."""

from __future__ import annotations

from typing import TYPE_CHECKING

from power_core.errors import ArtifactMismatch, ConfigError
from power_suffix.index import SuffixIndex
from power_suffix.memory import MemoryStats, StoreStats, SuffixMemory
from power_suffix.proposer import SuffixProposer

if TYPE_CHECKING:
    from power_core import Session

__all__ = ["MemoryStats", "StoreStats", "SuffixIndex", "SuffixMemory", "SuffixProposer", "share_memory"]


def share_memory(memory: SuffixMemory | None, *sessions: Session) -> None:
    """Have the suffix proposers of ``sessions`` (e.g. ``*engine.sessions``, of one engine or several)
    consult and teach ``memory`` (``None``: none); call it while they run no request. A session whose strategy
    is not suffix is :class:`ConfigError`; one whose model has another vocabulary than the memory's
    :class:`ArtifactMismatch`. Nothing changes unless every session qualifies."""
    from power_suffix.plugin import vocabulary_digest

    proposers: list[SuffixProposer] = []
    for session in sessions:
        proposer = session.proposer
        if not isinstance(proposer, SuffixProposer):
            raise ConfigError("spec_mode", session.strategy_name, "'suffix'",
                              "only a suffix session's proposer uses a SuffixMemory")
        if memory is not None and vocabulary_digest(session.opened) != memory.vocab_digest:
            raise ArtifactMismatch("this session's model has another vocabulary than the SuffixMemory's; its token "
                                   "ids would mean other text", reason="suffix_memory_mismatch",
                                   evidence="vocab_sha256")
        proposers.append(proposer)
    for proposer in proposers:
        proposer.attach(memory)
