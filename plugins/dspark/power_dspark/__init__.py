"""power-dspark: DSpark drafts (`dflash` backbone + Markov head, optional confidence head): validator and strategy registration."""

from power_dspark.validate import validate_dspark

__all__ = ["validate_dspark"]
