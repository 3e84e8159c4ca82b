"""The multi-host wire: the operations process 0 announces and the one collective that carries
them (`multihost.py` runs the steps, `multihost_spec.py` a speculative drafter's rounds).

Every announcement starts with a header i32[7] whose first entry is the operation; the
arrays that follow are shaped by the header, so every process's broadcasts have the same
shapes in the same order (each shape compiles its collective once, at warmup).
"""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils

STEP, ARM, STOP, KEEPALIVE, ROUND = 1, 2, 3, 4, 5


def broadcast(arrays: list[np.ndarray], is_source: bool) -> list[np.ndarray]:
    """`arrays` from process 0 on every process (the source passes its own, the others
    molds of the same shapes)."""
    # bool does not survive a psum: ship it as uint8.
    wire = [a.astype(np.uint8) if a.dtype == np.bool_ else a for a in arrays]
    out = multihost_utils.broadcast_one_to_all(wire, is_source=is_source)
    return [np.asarray(o).astype(np.bool_) if a.dtype == np.bool_ else np.asarray(o)
            for a, o in zip(arrays, out)]
