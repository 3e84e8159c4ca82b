"""PEFT LoRA adapter directories -> `LoraAdapter`: host numpy arrays in the layout of the
device's adapter slots (`models/lora.py`), scaling folded in. Never unpickles, never imports
torch.

Data flow: `adapter_config.json` -> `peft_config.parse_peft_config` (options checked, rank /
alpha patterns compiled); `adapter_model.safetensors` -> `safetensors_io` (header checked,
memory-mapped) -> each tensor name parsed into (layer i, module path, A or B); then for every
target field (wq wk wv wo w_gate w_up w_down) and layer, the family's own map from a layer's
checkpoint tensor to the stacked per-layer leaf (`HF_LAYER_NAMES`, and `hf_layer_part` where
layers differ in shape: Gemma 4's narrower heads, its K-as-V layers, MoE models' dense-only
layers) says which module's LoRA that layer's field takes and its expected [out, in] shape (a
Gemma 4 K-as-V layer's wv takes k_proj's, as its base wv is k_proj's weight).
The module's A [r, in] and B [out, r] are checked against it, transposed to a [in, r] and
b [r, out] (times PEFT's scaling), and laid onto the stacked layout: run on an index probe,
the family's map tells which checkpoint row / column each stacked entry comes from (or that it
is padding: zero), so a padded or repeated head gets exactly what the base weight got.
A field whose modules' ranks differ (rank_pattern) is zero-padded to its largest; layers the
adapter leaves alone are zero.

Every problem is a `LoraError` naming the adapter directory and what is wrong: missing files,
bad JSON, unsupported options (`peft_config`), a rank over `max_rank`, modules the model lacks
or this engine does not adapt (embeddings, the LM head, MoE experts), shapes that do not fit
the base model, layer indices out of range, tensors of unknown names, non-float dtypes,
non-finite values.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from types import ModuleType
from typing import Callable, Mapping

import numpy as np

from .config import ModelConfig
from .families import family as family_of
from .host_arrays import normalize_box
from .peft_config import LoraError, PeftLoraConfig, parse_peft_config, short
from .safetensors_io import CheckpointError, read_safetensors

# Layer-params fields an adapter may modify (PEFT q_proj k_proj v_proj o_proj gate_proj
# up_proj down_proj), in the order the device stacks them.
TARGET_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_FLOATS = ("float32", "float16", "bfloat16", "float64")
# "base_model.model.model.layers.{i}.{module}.lora_{A|B}[.{adapter name}].weight"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])"
                  r"(?:\.[A-Za-z0-9_\-]+)?\.weight")
_NOT_ADAPTED = "embed_tokens, lm_head and MoE experts are not adapted by this engine"


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One loaded adapter on the host, read-only arrays."""

    # field -> (a f32[L, in, r_f] = lora_A.T, b f32[L, r_f, out] = lora_B.T * scaling);
    # r_f: the field's largest module rank (smaller ones zero-padded); untouched layers zero
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]]
    rank: int  # the largest rank over the adapter's modules
    target_fields: tuple[str, ...]  # the keys of `weights`, in TARGET_FIELDS order
    nbytes: int  # bytes of all arrays of `weights`
    path: str  # the adapter directory


def load_peft_adapter(path: str | pathlib.Path, cfg: ModelConfig, max_rank: int,
                      family: ModuleType | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA directory for the base model `cfg` (its family module by
    default from cfg.model_type); ranks above `max_rank` are refused."""
    root = pathlib.Path(path)
    src = str(root)
    config_path, weights_path = _files(root, src)
    try:
        d = json.loads(config_path.read_bytes())
    except OSError as e:
        raise LoraError(f"{src}: cannot read adapter_config.json ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise LoraError(f"{src}: adapter_config.json is not valid JSON ({short(str(e))})"
                        ) from None
    if not isinstance(d, dict):
        raise LoraError(f"{src}: adapter_config.json must hold a JSON object")
    pc = parse_peft_config(d, src)
    fam = family if family is not None else family_of(cfg)
    modules = _adaptable_modules(fam, cfg)
    _check_targets(pc, modules, cfg, src)
    try:
        tensors = read_safetensors(weights_path)
    except CheckpointError as e:
        raise LoraError(f"{src}: {short(str(e), 400)}") from None
    pairs = _pairs(tensors, cfg, pc, max_rank, src)
    weights = _assemble(fam, cfg, pc, pairs, src)
    rank = max((a.shape[2] for a, _ in weights.values()), default=0)
    return LoraAdapter(weights=weights, rank=rank, target_fields=tuple(weights),
                       nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values()), path=src)


def _files(root: pathlib.Path, src: str) -> tuple[pathlib.Path, pathlib.Path]:
    if not root.is_dir():
        raise LoraError(f"{src}: no such adapter directory")
    config_path = root / "adapter_config.json"
    if not config_path.is_file():
        raise LoraError(f"{src}: no adapter_config.json (not a PEFT adapter directory)")
    weights_path = root / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (root / "adapter_model.bin").exists():
            raise LoraError(f"{src}: only adapter_model.bin is present; loading never unpickles "
                            "(a pickle can run code): save the adapter with "
                            "safe_serialization=True to get adapter_model.safetensors")
        raise LoraError(f"{src}: no adapter_model.safetensors")
    return config_path, weights_path


def _adaptable_modules(fam: ModuleType, cfg: ModelConfig) -> dict[str, str]:
    """Module path inside a layer ("self_attn.q_proj") -> field, for this model's targets."""
    shapes = fam.param_shapes(cfg)
    out = {}
    for field in TARGET_FIELDS:
        if field in fam.HF_LAYER_NAMES and f"layers.{field}" in shapes:
            suffix, transpose = fam.HF_LAYER_NAMES[field]
            if not transpose or not suffix.endswith(".weight"):
                raise LoraError(f"model_type={cfg.model_type!r}: field {field} is not an HF "
                                "linear weight; the LoRA loader cannot map it")
            out[suffix.removesuffix(".weight")] = field
    return out


def _check_targets(pc: PeftLoraConfig, modules: Mapping[str, str], cfg: ModelConfig,
                   src: str) -> None:
    """target_modules given as names: each must be a projection this model adapts (a regex
    is checked through the tensors it produced)."""
    if not isinstance(pc.target_modules, tuple):
        return
    short_names = {m.rsplit(".", 1)[-1] for m in modules}
    bad = sorted({t for t in pc.target_modules if t.rsplit(".", 1)[-1] not in short_names})
    if bad:
        raise LoraError(
            f"{src}: target_modules {short(bad[:6])} are not adaptable in this model "
            f"(model_type={cfg.model_type!r}; adaptable: {', '.join(sorted(short_names))}; "
            f"{_NOT_ADAPTED})")


@dataclasses.dataclass
class _Pair:
    """One module's two tensors in one layer, as stored ([r, in] and [out, r])."""

    key: str  # the module key PEFT matched its patterns on: "model.layers.{i}.{module}"
    rank: int  # from the config (rank_pattern), checked against the tensors
    scaling: float
    a: np.ndarray | None = None
    b: np.ndarray | None = None
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # "A"/"B" -> tensor name


def _pairs(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, pc: PeftLoraConfig,
           max_rank: int, src: str) -> dict[tuple[int, str], _Pair]:
    """The adapter's tensors grouped by (layer, module), names / layers / ranks / dtypes
    checked."""
    if not tensors:
        raise LoraError(f"{src}: adapter_model.safetensors holds no tensors")
    out: dict[tuple[int, str], _Pair] = {}
    for name, t in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise LoraError(f"{src}: tensor {short(name, 120)}: {_unknown_why(name)}")
        i, module, which = int(m.group(1)), m.group(2), m.group(3)
        if i >= cfg.num_layers:
            raise LoraError(f"{src}: tensor {short(name, 120)} is for layer {i}, but the model "
                            f"has {cfg.num_layers} layers")
        if pc.layers_to_transform is not None and i not in pc.layers_to_transform:
            raise LoraError(f"{src}: tensor {short(name, 120)} is for layer {i}, outside "
                            f"layers_to_transform={short(list(pc.layers_to_transform))}")
        if t.dtype.name not in _FLOATS:
            raise LoraError(f"{src}: tensor {short(name, 120)} has dtype {t.dtype.name}; "
                            f"LoRA weights must be one of {', '.join(_FLOATS)}")
        pair = out.get((i, module))
        if pair is None:
            key = f"model.layers.{i}.{module}"
            rank = pc.rank_of(key)
            if rank > max_rank:
                raise LoraError(f"{src}: module {short(key, 120)} has rank {rank}, over the "
                                f"maximum LoRA rank {max_rank} (max_lora_rank)")
            pair = out[(i, module)] = _Pair(key, rank, pc.scaling_of(key))
        setattr(pair, which.lower(), t)
        pair.names[which] = name
    for pair in out.values():
        if pair.a is None or pair.b is None:
            have = next(iter(pair.names.values()))
            raise LoraError(f"{src}: tensor {short(have, 120)} has no lora_"
                            f"{'B' if pair.b is None else 'A'} partner")
    return out


def _unknown_why(name: str) -> str:
    if "lora_embedding_" in name or "embed_tokens" in name:
        return "embedding adapters are not served (" + _NOT_ADAPTED + ")"
    if "lm_head" in name:
        return "an adapter on the LM head is not served (" + _NOT_ADAPTED + ")"
    if "lora_magnitude_vector" in name:
        return "DoRA magnitude vectors are not served"
    if re.search(r"\.lora_[AB](\.[^.]+)?\.bias$", name):
        return "trained LoRA biases (lora_bias) are not served"
    return ("not a LoRA weight this loader knows (expected base_model.model.model.layers.{i}."
            "{module}.lora_A|lora_B.weight)")


def _assemble(fam: ModuleType, cfg: ModelConfig, pc: PeftLoraConfig,
              pairs: Mapping[tuple[int, str], _Pair], src: str
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per target field, the stacked (a, b) of every layer, zero where nothing applies."""
    shapes = fam.param_shapes(cfg)
    layer_part = getattr(fam, "hf_layer_part", None)
    used: set[tuple[int, str]] = set()
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, field in _adaptable_modules(fam, cfg).items():
        L, n_in, n_out = shapes[f"layers.{field}"]
        suffix = fam.HF_LAYER_NAMES[field][0]
        per_layer: list[tuple[int, np.ndarray, np.ndarray]] = []
        for i in range(L):
            asked: list[tuple[str, tuple[int, ...]]] = []

            # `hf_loader`'s fetch contract: the shape asked is the layer's own in the
            # stacked [in, out] layout; the tensor returned is in checkpoint layout [out, in].
            def fetch(sfx: str, shape: tuple[int, ...]) -> _Probe:
                asked.append((sfx, tuple(shape)))
                return _Probe(tuple(shape)[::-1])

            view = (layer_part(cfg, field, i, suffix, fetch) if layer_part is not None
                    else fetch(suffix, (n_in, n_out)))
            if not asked:
                continue  # the layer has no such projection (zeros in the base too)
            if len(asked) != 1 or len(asked[0][1]) != 2 or not asked[0][0].endswith(".weight"):
                raise LoraError(f"model_type={cfg.model_type!r}: field {field} of layer {i} is "
                                "not one linear weight; the LoRA loader cannot map it")
            sfx, (own_in, own_out) = asked[0]
            pair = pairs.get((i, sfx.removesuffix(".weight")))
            if pair is None:
                continue
            used.add((i, sfx.removesuffix(".weight")))
            a, b = _checked(pair, own_in, own_out, src)
            rows, cols = _index_maps(view, own_in, src, pair.key)
            a_full = np.zeros((n_in, pair.rank), np.float32)
            b_full = np.zeros((pair.rank, n_out), np.float32)
            a_full[cols >= 0] = a.T[cols[cols >= 0]]
            b_full[:, rows >= 0] = (b.T * np.float32(pair.scaling))[:, rows[rows >= 0]]
            per_layer.append((i, a_full, b_full))
        if per_layer:
            r_f = max(a.shape[1] for _, a, _ in per_layer)
            a_st = np.zeros((L, n_in, r_f), np.float32)
            b_st = np.zeros((L, r_f, n_out), np.float32)
            for i, a, b in per_layer:
                a_st[i, :, :a.shape[1]] = a
                b_st[i, :b.shape[0], :] = b
            a_st.flags.writeable = b_st.flags.writeable = False
            weights[field] = (a_st, b_st)
    unused = sorted(set(pairs) - used)
    if unused:
        i, module = unused[0]
        why = (_NOT_ADAPTED if ".experts." in f".{module}." else
               f"this model (model_type={cfg.model_type!r}) has no adaptable {module} in layer "
               f"{i}; adaptable: {', '.join(sorted(_adaptable_modules(fam, cfg)))}")
        raise LoraError(f"{src}: module {short(pairs[unused[0]].key, 120)}: {why}"
                        f"{f' ({len(unused)} such modules)' if len(unused) > 1 else ''}")
    return {f: weights[f] for f in TARGET_FIELDS if f in weights}


def _checked(pair: _Pair, own_in: int, own_out: int, src: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """The pair's A [r, in] and B [out, r] as float32, shapes and values checked against the
    base layer's [out, in] projection."""
    out = []
    for which, t, want in (("A", pair.a, (pair.rank, own_in)), ("B", pair.b,
                                                                 (own_out, pair.rank))):
        assert t is not None
        name = short(pair.names[which], 120)
        if tuple(t.shape) != want:
            raise LoraError(
                f"{src}: tensor {name} has shape {list(t.shape)}, expected {list(want)} (rank "
                f"{pair.rank} from the config; the base model's projection is "
                f"[{own_out}, {own_in}]): the adapter does not fit this base model")
        arr = np.asarray(t, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise LoraError(f"{src}: tensor {name} holds non-finite values")
        out.append(arr)
    return out[0], out[1]


class _Probe:
    """Stands in for one layer's checkpoint tensor [out, in]: entry (o, j) holds
    (o + 1) * (in + 1) + (j + 1), so whatever view the family builds over it (padding,
    repeating, selecting) shows where each of its entries comes from; 0 is padding."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(np.float64)  # exact integers up to 2**53

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> np.ndarray:
        rows, cols = normalize_box(index, self.shape, "LoRA index probe")
        o = np.arange(rows.start, rows.stop, dtype=np.float64)[:, None] + 1
        j = np.arange(cols.start, cols.stop, dtype=np.float64)[None, :] + 1
        return o * (self.shape[1] + 1) + j


def _index_maps(view: object, own_in: int, src: str, key: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """(checkpoint row of each stacked output, checkpoint column of each stacked input), -1
    for padding, read from the family's view over a `_Probe`: one column and one row."""
    read: Callable[[tuple[slice, slice]], np.ndarray] = \
        lambda box: np.asarray(view[box], np.float64).astype(np.int64)  # type: ignore[index]
    n_out, n_in = view.shape  # type: ignore[attr-defined]
    col = read((slice(0, n_out), slice(0, 1)))[:, 0]
    if col.any():
        r0 = int(np.flatnonzero(col)[0])
        row = read((slice(r0, r0 + 1), slice(0, n_in)))[0]
    else:  # the first input entry is padding: find a real one on the first output's row
        row = read((slice(0, 1), slice(0, n_in)))[0]
        if not row.any():
            raise LoraError(f"{src}: module {key}: cannot map the base layer's layout")
        c0 = int(np.flatnonzero(row)[0])
        col = read((slice(0, n_out), slice(c0, c0 + 1)))[:, 0]
    m = own_in + 1
    rows = np.where(col > 0, col // m - 1, -1)
    cols = np.where(row > 0, row % m - 1, -1)
    return rows, cols


__all__ = ["LoraAdapter", "LoraError", "TARGET_FIELDS", "load_peft_adapter"]
