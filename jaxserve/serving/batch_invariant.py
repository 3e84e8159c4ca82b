"""What `EngineConfig.batch_invariant` changes in an engine's build, and what it refuses.

Data flow (called by `build._make_runner` / `build._attention_impl`, only with the mode on):
  `check_model`: the model's config -> a ValueError for what cannot be invariant (experts);
  `attention_impl`: the attention implementation `selector.select_impl` picked -> the one
    the mode runs ('auto': the jnp reference in place of a Pallas kernel; a Pallas kernel
    named explicitly: a ValueError naming attention_impl);
  `fixed_shapes`: (attention implementation, placed params) -> whether every step must run
    one (tokens, seqs) shape (`sizing.plan_engine(fixed_shapes=...)`).
The runner itself gets `batch_invariant` for its logprobs (`blocks.log_softmax`).

Why fixed shapes: a row's result is the same in every step shape only where the kernels
compute each row alone in one order. The CPU attention kernel (C++, fixed 1,024-key range
cuts, one rounding for short and tall tiles) and the C++ dense kernels are such kernels
(tests/kernels/test_attention_cpu_invariance.py, tests/models/test_step_invariance.py,
tests/models/test_quant.py). XLA's dot, XLA's reductions in the jnp reference attention
and the GPU kernel's split-KV (its factor comes from the bucket) may order a row's sums by
the shape, which a fixed shape fixes; where a row sits in that shape does not change its
sums (checked on CPU with the reference attention and XLA's dot:
tests/serving/test_batch_invariant.py). docs/batch-invariance.md has the audit per backend.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.models.families import ModelParams
from jaxserve.models.linear import PackedWeight

log = logging.getLogger(__name__)

# Row-invariant attention implementations: a query row's output bits do not depend on the
# step's shape or neighbours. The Pallas kernels are not here: not run on a device yet in
# this mode, and the GPU kernel's split-KV splits each tile's own key range (a row's keys are
# summed in chunks that depend on its tile's span), so a prefill row and the same row decoded
# would differ even at one fixed shape.
ROW_INVARIANT_ATTENTION = ("cpu",)
REFUSED_ATTENTION = ("pallas_tpu", "pallas_gpu")


def check_model(config: EngineConfig, cfg: ModelConfig) -> None:
    """A ValueError when the model cannot run batch invariant: mixture-of-experts layers (an
    expert's row count, and so its grouped matmul's tiling, depends on how every token in the
    step routes; the grouped kernels are not checked row invariant)."""
    if any(spec.moe is not None for spec in cfg.layer_specs):
        raise ValueError(f"batch_invariant=True: {config.model or 'the model'} has "
                         "mixture-of-experts layers, whose grouped expert matmuls are not "
                         "batch invariant (each expert's rows depend on the whole step's "
                         "routing); serve it without batch_invariant")


def attention_impl(config: EngineConfig, picked: str) -> str:
    """The attention implementation of the mode, given the one `select_impl` picked: the
    reference as 'reference_invariant' (decodes in the prefill pass's tiles, so a token's
    attention has one einsum shape however it is run), the CPU kernel as it is."""
    if picked == "reference":
        return "reference_invariant"
    if picked not in REFUSED_ATTENTION:
        return picked
    if config.attention_impl != "auto":
        raise ValueError(f"attention_impl={config.attention_impl!r} cannot run with "
                         "batch_invariant=True: the Pallas kernels are not checked batch "
                         "invariant (pallas_gpu's split-KV splits each query tile's own key "
                         "range); use attention_impl='reference' (one fixed step shape) or "
                         "'cpu' on a CPU host")
    log.info("batch_invariant: attention %s -> the jnp reference at one fixed step shape "
             "(the Pallas kernels are not checked batch invariant)", picked)
    return "reference_invariant"


def fixed_shapes(attn_impl: str, params: ModelParams) -> bool:
    """Whether the mode must run every step at one shape: unless the attention and every
    dense projection run the row-invariant CPU kernels (the params packed for them)."""
    packed = any(isinstance(leaf, PackedWeight) for leaf in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, PackedWeight)))
    return not (attn_impl in ROW_INVARIANT_ATTENTION and packed)
