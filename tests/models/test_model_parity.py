"""Full-sequence logits of jaxserve's models vs HF transformers (torch, CPU, float32).

Each architecture is built at random by transformers, saved as safetensors, loaded by
jaxserve's HF loader, and run on a right-padded batch of several lengths; with the weights as
loaded (XLA's dot) and packed for the CPU dense kernel (models/packing.py), as the engine
runs them on a CPU host.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from support.hf_models import ARCHS, build_hf_model  # noqa: E402
from support.numerics import logits_atol, params_logit_bound, unit_roundoff  # noqa: E402

from jaxserve.kernels_pallas import cpu_build  # noqa: E402
from jaxserve.models import decoder, hf_loader  # noqa: E402
from jaxserve.models.packing import pack_params  # noqa: E402

LENGTHS = [13, 7, 1, 10]


def _batch(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    T = max(LENGTHS)
    tokens = np.zeros((len(LENGTHS), T), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, :n] = rng.integers(0, vocab, n)
    return tokens, np.array(LENGTHS, np.int32)


@pytest.mark.parametrize("packed", [False, True], ids=["xla_dot", "packed"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch: str, packed: bool, tmp_path) -> None:
    if packed and cpu_build.dense_kernel_target() is None:
        pytest.skip("the CPU kernels could not be built here (see the log)")
    hf_model = build_hf_model(arch, tmp_path)
    cfg = hf_loader.read_hf_config(tmp_path)
    params = hf_loader.params_from_hf(cfg, hf_loader.read_hf_tensors(tmp_path), jnp.float32)
    # XLA (or the packed C++ kernel) against torch: another summation order and other
    # transcendental approximations, support.numerics.logits_atol (from the weights).
    tol = logits_atol(cfg, params, max(LENGTHS))
    if packed:
        params = pack_params(params)
    tokens, lengths = _batch(cfg.vocab_size, seed=hash(arch) % 1000)

    ours = np.asarray(decoder.forward_jit(params, jnp.asarray(tokens), jnp.asarray(lengths),
                                          cfg=cfg))
    worst = 0.0
    for b, n in enumerate(LENGTHS):
        # The oracle runs each row unpadded: independent of any padding convention.
        with torch.no_grad():
            ref = hf_model(torch.tensor(tokens[b:b + 1, :n], dtype=torch.long)).logits[0].numpy()
        worst = max(worst, float(np.max(np.abs(ours[b, :n] - ref))))
    print(f"{arch}: max|diff| = {worst:.2e}, {worst / tol:.1e} of its bound {tol:.2e}")
    assert worst <= tol, f"{arch}: logits error {worst:.2e} > {tol:.2e}"


def test_bfloat16_params_close_to_float32(tmp_path) -> None:
    build_hf_model("llama3_gqa_rope_scaling", tmp_path)
    cfg = hf_loader.read_hf_config(tmp_path)
    tensors = hf_loader.read_hf_tensors(tmp_path)
    tokens, lengths = _batch(cfg.vocab_size, seed=3)
    p32 = hf_loader.params_from_hf(cfg, tensors, jnp.float32)
    f32 = decoder.forward_jit(p32, jnp.asarray(tokens), jnp.asarray(lengths), cfg=cfg)
    # Every weight rounded to bfloat16 (u = 2^-8 relative): first order, each stage that
    # multiplies by weights adds u of its magnitude: per layer the two norms, q/k/v, o_proj,
    # gate/up and down (6), then the embedding, the final norm and the lm_head (3); times the
    # logits' a priori magnitude (params_logit_bound), plus the float32 reordering bound.
    tol = ((6 * cfg.num_layers + 3) * unit_roundoff("bfloat16") * params_logit_bound(p32)
           + logits_atol(cfg, p32, max(LENGTHS)))
    p16 = hf_loader.params_from_hf(cfg, tensors, jnp.bfloat16)
    assert p16.embed.dtype == jnp.bfloat16
    b16 = decoder.forward_jit(p16, jnp.asarray(tokens), jnp.asarray(lengths), cfg=cfg)
    assert b16.dtype == jnp.float32
    for b, n in enumerate(LENGTHS):
        ref, got = np.asarray(f32[b, :n]), np.asarray(b16[b, :n])
        assert np.max(np.abs(got - ref)) <= tol
        assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.6


def test_padding_does_not_leak_between_rows(tmp_path) -> None:
    build_hf_model("qwen2_bias", tmp_path)
    cfg = hf_loader.read_hf_config(tmp_path)
    params = hf_loader.params_from_hf(cfg, hf_loader.read_hf_tensors(tmp_path))
    tokens, lengths = _batch(cfg.vocab_size, seed=5)
    full = np.asarray(decoder.forward_jit(params, jnp.asarray(tokens), jnp.asarray(lengths),
                                          cfg=cfg))
    noisy = tokens.copy()
    for b, n in enumerate(LENGTHS):
        noisy[b, n:] = (np.arange(tokens.shape[1] - n) * 7 + 3) % cfg.vocab_size
    again = np.asarray(decoder.forward_jit(params, jnp.asarray(noisy), jnp.asarray(lengths),
                                           cfg=cfg))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(full[b, :n], again[b, :n])
