"""power-eagle3: EAGLE3 drafts (llama.cpp ``eagle3`` arch, ``--spec-type draft-eagle3``): validator,
proposer and strategy registration."""

from power_eagle3.validate import Eagle3Head, Eagle3Verified, validate_eagle3

__all__ = ["Eagle3Head", "Eagle3Verified", "validate_eagle3"]
