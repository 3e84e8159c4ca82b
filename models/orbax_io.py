"""Orbax checkpoints of the params pytree (current `orbax.checkpoint.v1` API).

Data flow (save): a family's params pytree -> `ocp.save(DIR/params)`. Data flow (restore):
the config's family (`families.family(cfg)`) gives `abstract_params` (shapes, dtype) -> each
leaf gets its target sharding (one for all, or one per leaf: the tensor-parallel
`placement.param_shardings`) -> `ocp.load` reads for each device only the part of the array
its sharding puts there, so a sharded restore never materialises a split leaf whole on one
device (under multi-process, each process reads its own devices' parts).
The saved arrays are unreplicated: when tensor parallelism replicates KV heads, `loading`
restores the K/V projections onto one local device and `placement` slices each device's
repeated head from there (see `models/loading.py`). The surrounding jaxserve checkpoint
directory (config.json, tokenizer files, the `jaxserve.json` marker) is written by
`models/loading.py`.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from orbax.checkpoint import v1 as ocp

from .config import ModelConfig
from .families import family
from .safetensors_io import CheckpointError


def save_params(path: pathlib.Path, params: Any, overwrite: bool = False) -> None:
    ocp.save(path, params, overwrite=overwrite)


def restore_params(path: pathlib.Path, cfg: ModelConfig, dtype: jnp.dtype,
                   sharding: jax.sharding.Sharding | Any | None = None) -> Any:
    """Restore onto `sharding`, cast to `dtype`.

    `sharding`: one Sharding for every leaf, the family's params of one Sharding per leaf (e.g.
    `placement.param_shardings`), or None for the first local device.
    """
    if not path.is_dir():
        raise CheckpointError(f"{path}: no Orbax params directory")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    saved = _saved_tree(path)
    fam = family(cfg)
    target = fam.abstract_params(cfg, dtype)
    want = {_dotted(k): v for k, v in jax.tree_util.tree_leaves_with_path(target)}
    have = {_dotted(k): v for k, v in jax.tree_util.tree_leaves_with_path(saved)}
    for name, leaf in want.items():
        if name not in have:
            raise CheckpointError(f"{path}: tensor {name} is missing from the checkpoint")
        if tuple(have[name].shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(have[name].shape)}, expected "
                f"{list(leaf.shape)} for this config")
    # Restore in the saved dtype, then cast: orbax casts too, but this keeps it explicit.
    if isinstance(sharding, fam.Params):
        shardings = sharding
    else:
        shardings = jax.tree.map(lambda _: sharding, target)
    restore_target = jax.tree.map(
        lambda t, s, sh: jax.ShapeDtypeStruct(t.shape, s.dtype, sharding=sh), target,
        _like(target, have), shardings)
    params = _load(path, restore_target)
    # An elementwise cast keeps each array's sharding: per device, no gather.
    return jax.tree.map(lambda a: a.astype(dtype), params)


def _saved_tree(path: pathlib.Path) -> object:
    try:
        tree = ocp.metadata(path).metadata
    except Exception as e:  # noqa: BLE001 - orbax raises many types for a broken directory
        raise CheckpointError(f"{path}: not a readable Orbax checkpoint ({_first_line(e)})") from e
    for key, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(getattr(leaf, "shape", None), tuple):
            raise CheckpointError(f"{path}: Orbax metadata for {_dotted(key)} is not an array's "
                                  f"({type(leaf).__name__})")
    return tree


def _load(path: pathlib.Path, target: Any) -> Any:
    """`ocp.load`, with a corrupt or missing array file reported as a CheckpointError.

    Orbax/TensorStore raise bare `Exception`s (and json/unicode errors from its metadata files)
    for damaged data; device errors (out of memory, ...) are not the checkpoint's fault and
    pass through unchanged.
    """
    try:
        return ocp.load(path, target)
    except jax.errors.JaxRuntimeError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise CheckpointError(f"{path}: cannot restore the Orbax arrays, the checkpoint is "
                              f"damaged or incomplete ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    """An exception's first line, cut short: TensorStore messages run to pages."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def _dotted(key_path: tuple[object, ...]) -> str:
    """'layers.wq' for both dataclass (attribute) and dict (metadata) key paths."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in key_path)


def _like(target: Any, have: dict[str, object]) -> Any:
    """The saved leaves' metadata arranged in `target`'s tree structure."""
    leaves = [have[_dotted(k)] for k, _ in jax.tree_util.tree_leaves_with_path(target)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)
