"""power-dflash: DFlash v1 drafts (llama.cpp `dflash` arch, no selector/conv/Markov parts): validator and strategy registration."""

from power_dflash.validate import validate_dflash

__all__ = ["validate_dflash"]
