"""The Mosaic GPU kernel against the jnp reference, interpreted on CPU (races detected) or
compiled where a GPU is present: the helpers the GPU kernel tests share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import gpu, ragged_paged_attention_reference, write_kv
from support.numerics import assert_close, kernel_attention_tolerance
from support.pallas_run import interpret_params, races_found

# Each interpreted test also runs compiled when a GPU is present (``device`` marker).
MODES = pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=pytest.mark.device)], ids=["interpret", "device"])


def mode(interpret: bool):  # noqa: ANN201 - the interpreter's params, or False
    if not interpret and jax.default_backend() != "gpu":
        pytest.skip(f"the compiled GPU kernel needs a GPU; this is {jax.default_backend()}")
    return interpret_params("pallas_gpu") if interpret else False


def check_against_reference(batch, pages, *, md=None, window=None, cap=None,  # noqa: ANN001
                            interpret=True, **tuning) -> np.ndarray:
    """The kernel against the reference, both outputs in q's dtype: within what the kernel
    rounds (bfloat16 / q's 16-bit MMA operands) besides float32 arithmetic,
    support.numerics.kernel_attention_tolerance."""
    md = md or batch.md
    d = batch.q.shape[-1]
    opts = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(jnp.asarray(ragged_paged_attention_reference(batch.q, pages, md, **opts),
                                  jnp.float32))
    got = gpu.ragged_paged_attention_gpu(batch.q, pages, md, interpret=mode(interpret),
                                         **opts, **tuning)
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert not (interpret and races_found("pallas_gpu")), "the interpreter reported a data race"
    live = int(np.asarray(md.cu_q_lens)[int(np.asarray(md.num_seqs)[0])])
    tol = kernel_attention_tolerance("pallas_gpu", batch, jnp.dtype(batch.q.dtype).name,
                                     roundings=2, **opts)
    assert_close(got[:live], want[:live], **tol)
    assert np.isfinite(got).all() and not got[live:].any(), "padding rows must be zeros"
    return got


def written(batch):  # noqa: ANN001, ANN201 - a RaggedBatch -> its pages after write_kv
    return write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
