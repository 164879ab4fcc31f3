"""Pure-numpy reference backend: a tiny decoder with KV and recurrent rollback semantics, plus toy
proposers with controllable acceptance. The test bed for the core and for adapter authors."""

from power_core.reference.model import ReferenceCheckpoint, ReferenceModel, ReferenceTarget
from power_core.reference.proposers import DraftModelProposer, NoisyProposer, ProposerWrapper

__all__ = ["DraftModelProposer", "NoisyProposer", "ProposerWrapper", "ReferenceCheckpoint", "ReferenceModel", "ReferenceTarget"]
