"""power-mtp: Native MTP (nextn) heads carried by the target GGUF: validator and strategy registration."""

from power_mtp.validate import validate_mtp

__all__ = ["validate_mtp"]
