"""power-dflash2: DFlash2 drafts (`dflash` arch + selector and per-layer convolution tensors): validator and strategy registration."""

from power_dflash2.validate import validate_dflash2

__all__ = ["validate_dflash2"]
