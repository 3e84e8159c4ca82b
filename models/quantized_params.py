"""A whole model's weights quantized at load: params -> params with `QuantizedWeight`s.

Data flow (`load_model`, before the leaves are placed on devices): params whose leaves are
host sources (the lazy checkpoint views of `host_arrays`, or arrays of a model already loaded)
and a `WeightQuant` -> per linear field (wq, wk, wv, wo, w_gate, w_up, w_down), one layer at a
time (the linear fields are the family's `LINEAR_FIELDS`):
  - stored tensors whose quantization maps exactly onto the asked scheme and group size (or
    any, under "auto") become that scheme's values and scales as stored: GGUF Q8_0 / Q4_0 /
    Q4_1 / Q4_K / Q6_K blocks (`gguf_quant`, numpy arrays) and compressed-tensors FP8 / INT8
    weights (`compressed_tensors`, values left a lazy view of the file): no float round trip.
    A compressed-tensors checkpoint made for dynamic fp8 activations keeps them under "auto"
    where the platform has fp8 matmuls (`WeightQuant.fp8_matmuls`), else runs weight-only;
  - a field of compressed-tensors layers and float ones (layers the checkpoint's `ignore`
    names), under "auto" or its own scheme: the stored layers as they are, the float ones
    quantized per column to that scheme (a log line);
  - else, if a scheme is asked, the layer is read as float and quantized (`quant.quantize_weight`;
    a stored quantization is thereby dequantized and requantized, with a log line);
    under "auto", a stored quantization with no exact mapping (Q5_*, Q2_K, mixed types) is
    dequantized and quantized to int8 in groups of 32, with a log line;
  - else the field stays as it is (a float checkpoint under "auto"; "none": the float views).
The expert stacks of an MoE model [L, E, in, out] follow the same rules per expert
(`quantize_experts`: scales per expert and column or group, read one expert at a time;
always weight-only).
The layers are stacked into one QuantizedWeight (host peak: one field's quantized stack plus one
float layer), which placement then puts on the devices like any leaf.
The lm_head and the embedding follow the same rules, but an explicit scheme quantizes them only
with `WeightQuant.lm_head`; a quantized embedding is stored transposed ([hidden, vocab], the
tied lm_head's layout), which `blocks.embed` reads by columns.

A model already loaded (its leaves device arrays, some of them `QuantizedWeight`s, as
`load_model` returns it) goes through the same function when an engine is built from it with
another quantization (`serving/build.py`): a QuantizedWeight leaf is kept where no scheme is
asked or where it already is the asked scheme and group size, else dequantized one layer at a
time and quantized to the asked scheme (a log line). `dequantized_params` is the way back for
quantization="none".
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from .compressed_tensors import CompressedTensor, quantized_weight
from .gguf_quant import block_group, block_scheme, quantized_blocks
from .host_arrays import LazyLeaf
from .moe import ExpertStack
from .families import ModelParams, family_of_params
from .quant import QuantizedWeight, WeightQuant, quantize_weight

log = logging.getLogger(__name__)

_FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
FALLBACK_GROUP = 32  # int8 groups for stored quantizations with no exact mapping


def _stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    zeros = None if first.zeros is None else np.stack([p.zeros for p in parts])
    return QuantizedWeight(np.stack([p.values for p in parts]),
                           np.stack([p.scales for p in parts]), zeros, first.scheme,
                           first.act_fp8)


def _stored(leaf: object) -> list[object] | None:
    """The checkpoint tensors behind a lazy leaf (one per layer, or one), else None."""
    return list(leaf.parts) if isinstance(leaf, LazyLeaf) else None


def _is_quantized_storage(tensor: object) -> bool:
    if isinstance(tensor, CompressedTensor):
        return True
    name = getattr(tensor, "type_name", None)
    return name is not None and name not in _FLOAT_GGUF_TYPES


def _exact_kind(tensor: object) -> tuple[str, int] | None:
    """(scheme, group size) a stored tensor maps onto exactly, else None."""
    if isinstance(tensor, CompressedTensor):
        return tensor.scheme, tensor.shape[1]  # one scale per output column
    scheme = block_scheme(tensor)
    return None if scheme is None else (scheme, block_group(tensor))


def _act_fp8(parts: list[CompressedTensor], wq: WeightQuant) -> bool:
    """Whether compressed-tensors fp8 weights run W8A8: as asked under an explicit "fp8", as
    the checkpoint was made (dynamic fp8 activations) under "auto" where fp8 dots run."""
    made_for_fp8 = all(t.activations == "fp8" for t in parts)
    act = wq.act_fp8 if wq.quantizes else made_for_fp8 and wq.fp8_matmuls
    return act and parts[0].scheme == "fp8"


def _exact(stored: list[object], wq: WeightQuant, stacked: bool, name: str) -> QuantizedWeight:
    """The stored quantization as it is (`_exact_kind` says which, the same for every part)."""
    if isinstance(stored[0], CompressedTensor):
        return quantized_weight(stored, stacked, name, _act_fp8(stored, wq))
    layers = [quantized_blocks(t) for t in stored]
    return _stack(layers) if stacked else layers[0]


def _partly_compressed(leaf: object, stored: list[object], wq: WeightQuant, want: str | None,
                       name: str) -> QuantizedWeight | None:
    """A field whose layers are partly compressed-tensors of one scheme, partly float (layers
    the checkpoint's `ignore` names): the stored layers as they are, the float ones quantized
    per column to that scheme, in one stack (read whole here: no lazy values). Else None."""
    comp = [t for t in stored if isinstance(t, CompressedTensor)]
    schemes = {t.scheme for t in comp}
    if (not comp or len(comp) == len(stored) or len(schemes) != 1 or wq.group_size is not None
            or want not in (None, *schemes) or any(
                _is_quantized_storage(t) for t in stored if not isinstance(t, CompressedTensor))):
        return None
    scheme, act = schemes.pop(), _act_fp8(comp, wq)
    layers = []
    for i, t in enumerate(stored):
        if isinstance(t, CompressedTensor):
            values = np.ascontiguousarray(np.asarray(t.values[...]).T)
            layers.append(QuantizedWeight(values, t.scale[None, :], None, scheme, act))
        else:
            layer = np.asarray(leaf[i:i + 1], np.float32)[0]
            layers.append(quantize_weight(layer, scheme, None, act, name))
    log.info("%s: %d of %d layers stored as %s, the others float (the checkpoint's ignore list): "
             "those quantized to %s per column", name, len(comp), len(stored),
             comp[0].type_name, scheme)
    return _stack(layers)


def _float_layers(leaf: object, stacked: bool, transpose: bool) -> list[np.ndarray]:
    """The leaf as float32 [in, out] weights, one per layer (read one at a time)."""
    n = leaf.shape[0] if stacked else 1
    out = []
    for i in range(n):
        a = np.asarray(leaf[i:i + 1] if stacked else leaf[...], np.float32)
        a = a[0] if stacked else a
        out.append(np.ascontiguousarray(a.T) if transpose else a)
    return out


def _requantized(leaf: QuantizedWeight, wq: WeightQuant, want: str | None, name: str,
                 stacked: bool) -> QuantizedWeight | None:
    """A field that is already a QuantizedWeight (a model loaded before): None to keep it
    (no scheme asked, or the asked scheme and group size), the same values with the asked
    activation mode, or each layer dequantized and quantized to `want`.

    A quantized embedding is already stored transposed ([hidden, vocab]), the layout the
    quantizers take, so it needs no transpose here."""
    if want is None:
        return None
    if want == leaf.scheme and wq.group_size in (None, leaf.group_size):
        if leaf.act_fp8 == wq.act_fp8:
            return None
        return leaf.replace(act_fp8=wq.act_fp8)
    log.info("%s: already quantized as %s (group size %d); dequantized and quantized to %s "
             "(group size %s)", name, leaf.scheme, leaf.group_size, want,
             wq.group_size or "default")
    n = leaf.values.shape[0] if stacked else 1
    layers = []
    for i in range(n):
        one = jax.tree.map(lambda a: a[i], leaf) if stacked else leaf
        w = np.asarray(one.dequantize(jnp.float32))
        layers.append(quantize_weight(w, want, wq.group_size, wq.act_fp8, name))
    return _stack(layers) if stacked else layers[0]


def quantize_leaf(leaf: object, wq: WeightQuant, name: str, stacked: bool = True,
                  transpose: bool = False, asked: bool = True) -> QuantizedWeight | None:
    """One field as a QuantizedWeight of numpy arrays, or None to leave it as it is.

    `transpose`: the leaf is [out, in] (an embedding); `asked`: an explicit scheme applies
    to this field (False: the lm_head / embedding without `WeightQuant.lm_head`)."""
    if wq.scheme == "none":
        return None
    if isinstance(leaf, QuantizedWeight):
        return _requantized(leaf, wq, wq.scheme if wq.quantizes and asked else None, name,
                            stacked)
    stored = _stored(leaf) or []
    kinds = {_exact_kind(t) for t in stored}
    kind = kinds.pop() if len(kinds) == 1 else None  # every layer maps onto this scheme
    want = wq.scheme if wq.quantizes and asked else None
    exact = kind is not None and (want is None or (
        want == kind[0] and wq.group_size in (None, kind[1])))
    if want is not None or wq.scheme == "auto":
        if exact:
            return _exact(stored, wq, stacked, name)
        partly = _partly_compressed(leaf, stored, wq, want, name)
        if partly is not None:
            return partly
    scheme, group = want, wq.group_size
    types = "/".join(sorted({getattr(t, "type_name", "?") for t in stored
                             if _is_quantized_storage(t)}))
    if scheme is None:
        if wq.scheme != "auto" or not types:
            return None
        scheme, group = "int8", FALLBACK_GROUP
        log.info("%s: stored as %s, which maps onto no jaxserve scheme exactly; dequantized "
                 "and quantized to int8 in groups of %d", name, types, group)
    elif types:
        log.info("%s: stored as %s; dequantized and quantized to %s (quantization=%s, "
                 "group size %s)", name, types, scheme, wq.scheme, group or "default")
    layers = [quantize_weight(w, scheme, group, wq.act_fp8, name)
              for w in _float_layers(leaf, stacked, transpose)]
    return _stack(layers) if stacked else layers[0]


def _expert_layers(leaf: object) -> list[list[object] | None]:
    """Per layer of an expert field: its E stored tensors (an `ExpertStack`'s parts), or None
    for a layer without experts (a dense layer's zeros)."""
    if not isinstance(leaf, LazyLeaf):
        return []
    return [list(p.parts) if isinstance(p, ExpertStack) else None for p in leaf.parts]


def _stored_expert(t: object) -> QuantizedWeight:
    """One expert's stored tensor [out, in] as it is: GGUF blocks, or compressed-tensors
    values and per-row scales (read here: the stacks are built on the host)."""
    if isinstance(t, CompressedTensor):
        values = np.ascontiguousarray(np.asarray(t.values[...]).T)
        return QuantizedWeight(values, t.scale[None, :].astype(np.float32), None, t.scheme)
    return quantized_blocks(t)  # type: ignore[arg-type]


def quantize_experts(leaf: object, wq: WeightQuant, name: str) -> QuantizedWeight | None:
    """An expert field [L, E, in, out] as one QuantizedWeight of numpy arrays (scales per
    expert and output column, or per group of input rows), or None to leave it as it is:
    the rules of `quantize_leaf` per expert (GGUF blocks as stored where they map exactly,
    and compressed-tensors int8 / fp8 experts as stored where they map exactly, else read as
    float one expert at a time and quantized; under "auto" a float checkpoint
    stays float). Always weight-only: the grouped matmul (`moe_block`) converts and scales
    the values; a dense layer's zeros (a model mixing dense and sparse layers) are quantized
    zeros of the same layout."""
    if wq.scheme == "none":
        return None
    want = wq.scheme if wq.quantizes else None
    if isinstance(leaf, QuantizedWeight):
        return _requantized(leaf, dataclasses.replace(wq, act_fp8=False), want, name, True)
    layers = _expert_layers(leaf)
    stored = [t for layer in layers if layer for t in layer]
    kinds = {_exact_kind(t) for t in stored}
    kind = kinds.pop() if len(kinds) == 1 else None
    num_layers, num_experts, k, n = leaf.shape  # type: ignore[attr-defined]
    if kind is not None and (want is None or (want == kind[0]
                                              and wq.group_size in (None, kind[1]))):
        zero = quantize_weight(np.zeros((num_experts, k, n), np.float32), *kind)
        return _stack([_stack([_stored_expert(t) for t in layer]) if layer else zero
                       for layer in layers])
    scheme, group = want, wq.group_size
    types = "/".join(sorted({getattr(t, "type_name", "?") for t in stored
                             if _is_quantized_storage(t)}))
    if scheme is None:
        if wq.scheme != "auto" or not types:
            return None
        scheme, group = "int8", FALLBACK_GROUP
        log.info("%s: stored as %s, which maps onto no jaxserve scheme exactly; dequantized "
                 "and quantized to int8 in groups of %d", name, types, group)
    elif types:
        log.info("%s: stored as %s; dequantized and quantized to %s (group size %s)", name,
                 types, scheme, group or "default")
    return _stack([_stack([
        quantize_weight(np.asarray(leaf[i:i + 1, e:e + 1], np.float32)[0, 0],  # type: ignore[index]
                        scheme, group, False, name) for e in range(num_experts)])
        for i in range(num_layers)])


def _note_activations(params: ModelParams, wq: WeightQuant) -> None:
    """A log line when a compressed-tensors checkpoint was made for quantized activations."""
    fields = family_of_params(params).LINEAR_FIELDS
    leaves = [getattr(params.layers, f) for f in fields] + [params.lm_head]
    acts = {t.activations for leaf in leaves for t in _stored(leaf) or []
            if isinstance(t, CompressedTensor)}
    if "fp8" in acts and wq.scheme == "auto":
        if wq.fp8_matmuls:
            log.info("checkpoint made for dynamic fp8 activations: activations quantized per "
                     "token to fp8, fp8 x fp8 dots (W8A8)")
        else:
            log.info("checkpoint made for dynamic fp8 activations (W8A8), but this platform "
                     "has no fp8 matmuls (or fp8_activations=off): fp8 weights, activations "
                     "in the model dtype")
    if "int8" in acts:
        log.info("checkpoint made for dynamic int8 activations (W8A8), which jaxserve does not "
                 "run: int8 activations are not implemented, the weights serve weight-only")


def quantize_params(params: ModelParams, wq: WeightQuant) -> ModelParams:
    """`params` with each dense weight quantized as `wq` says (module docstring)."""
    if wq.scheme == "none":
        return params
    fam = family_of_params(params)
    experts = [f for f in getattr(fam, "EXPERT_FIELDS", ())
               if getattr(params.layers, f) is not None]
    if experts and wq.quantizes and getattr(params.layers, "be_gate", None) is not None:
        # gpt-oss's biased experts run `moe_biased`'s grouped MLP, which takes float stacks;
        # quantizing only the attention would serve a mostly float model under this name.
        raise ValueError(f"quantization={wq.scheme!r}: gpt-oss's biased expert weights "
                         f"(layers.{', layers.'.join(experts)}) are not quantized yet (their "
                         "grouped MLP takes float stacks); serve it with quantization 'auto' "
                         "or 'none'")
    _note_activations(params, wq)
    layers = params.layers
    for field in family_of_params(params).LINEAR_FIELDS:
        if getattr(layers, field) is None:  # a field this model lacks (MoE: a shared expert)
            continue
        q = quantize_leaf(getattr(layers, field), wq, f"layers.{field}")
        if q is not None:
            layers = layers.replace(**{field: q})
    for field in experts:
        q = quantize_experts(getattr(layers, field), wq, f"layers.{field}")
        if q is not None:
            layers = layers.replace(**{field: q})
    if experts and wq.act_fp8 and isinstance(getattr(layers, experts[0]), QuantizedWeight):
        log.info("fp8 activations (W8A8) apply to the dense linears; the experts' fp8 weights "
                 "run weight-only (activations in the model dtype)")
    params = params.replace(layers=layers)
    if params.lm_head is not None:
        head = quantize_leaf(params.lm_head, wq, "lm_head", stacked=False, asked=wq.lm_head)
        if head is not None:
            params = params.replace(lm_head=head)
    tied = params.lm_head is None
    embed = quantize_leaf(params.embed, wq, "embed", stacked=False, transpose=True,
                          asked=wq.lm_head and tied)
    return params if embed is None else params.replace(embed=embed)


def dequantized_params(params: ModelParams, dtype: jnp.dtype) -> ModelParams:
    """`params` with every QuantizedWeight leaf back to a `dtype` array (quantization="none"
    on a model loaded quantized); a quantized embedding is transposed back to [vocab, hidden].
    Other leaves are returned as they are."""
    def dq(w: object) -> object:
        return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w

    fam = family_of_params(params)
    fields = fam.LINEAR_FIELDS + tuple(getattr(fam, "EXPERT_FIELDS", ()))
    layers = params.layers.replace(**{f: dq(getattr(params.layers, f)) for f in fields})
    embed = params.embed
    if isinstance(embed, QuantizedWeight):
        embed = embed.dequantize(dtype).T
    head = None if params.lm_head is None else dq(params.lm_head)
    return params.replace(layers=layers, embed=embed, lm_head=head)
