import numpy as np
import numpy.typing as npt

def walk(lattice: npt.NDArray[np.float32], top_k: int, m: int, p_min: float) -> npt.NDArray[np.int32]: ...
