"""serving.build: the process-wide JAX settings are applied once per build, before any
replica is placed; the weights are packed for the CPU dense kernel where dense_impl picks it."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.serving import build


class _Stop(Exception):
    pass


@pytest.mark.parametrize("dp", [1, 3])
def test_runtime_applied_once_before_placing(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                             dp: int) -> None:
    events = []
    monkeypatch.setattr(build, "apply_runtime", lambda cfg: events.append(("runtime", cfg)))
    monkeypatch.setattr(build, "replica_device_rows",
                        lambda dp, tp: [[jax.local_devices()[0]]] * dp)

    def place(config, model, devices):  # noqa: ANN001, ANN202
        events.append(("place", devices))
        if sum(e[0] == "place" for e in events) == dp:
            raise _Stop  # every replica placed; no need to load a model
        return None

    monkeypatch.setattr(build, "_place", place)
    config = EngineConfig(compilation_cache_dir=str(tmp_path / "xla"), data_parallel_size=dp)
    with pytest.raises(_Stop):
        build.build_engines(config, warmup=False)
    assert [e[0] for e in events] == ["runtime"] + ["place"] * dp
    assert events[0][1].compilation_cache_dir == str(tmp_path / "xla")


@pytest.mark.parametrize("dense_impl,dtype,packed", [
    ("auto", "float32", True), ("xla", "float32", False), ("auto", "bfloat16", False),
    ("cpu", "bfloat16", False),  # asked for, but the kernel is float32: XLA's dot, a warning
])
def test_dense_impl_packs_weights_where_it_applies(dense_impl: str, dtype: str,
                                                   packed: bool, caplog) -> None:
    from support.engine_fixtures import tiny_model

    from jaxserve.kernels_pallas import cpu_build
    from jaxserve.models.linear import PackedWeight

    if packed and cpu_build.dense_kernel_target() is None:
        pytest.skip("the CPU kernels could not be built here (see the log)")
    model = tiny_model()
    if dtype != "float32":
        model = dataclasses.replace(model, params=jax.tree.map(
            lambda a: a.astype(dtype), model.params))
    config = EngineConfig(dense_impl=dense_impl, dtype=dtype, max_num_seqs=4,
                          max_num_batched_tokens=16, max_model_len=64,
                          kv_cache_memory=1 << 20)
    engine = build.build_engine(config, model, warmup=False)
    params = engine.runner.params
    assert isinstance(params.layers.w_up, PackedWeight) is packed
    assert isinstance(params.lm_head, PackedWeight) is packed
    assert isinstance(model.params.layers.w_up, jax.Array)  # the caller's model is untouched
    assert ("using XLA's dot instead" in caplog.text) is (dense_impl == "cpu")


def test_dense_impl_is_validated() -> None:
    with pytest.raises(ValueError, match="dense_impl='blas' must be one of"):
        EngineConfig(dense_impl="blas")
    with pytest.raises(ValueError, match="dense_isa='sse2' must be one of"):
        EngineConfig(dense_isa="sse2")


def test_dense_isa_reaches_every_packed_weight() -> None:
    """config.dense_isa forces the kernel's variant on every packed weight (the figures and
    tests of the other path); one this CPU cannot run fails at load, naming it."""
    from support.engine_fixtures import tiny_model

    from jaxserve.kernels_pallas import cpu_build
    from jaxserve.models.linear import PackedWeight

    isas = cpu_build.dense_isas()
    if not isas:
        pytest.skip("the CPU kernels could not be built here (see the log)")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              kv_cache_memory=1 << 20)
    engine = build.build_engine(EngineConfig(dense_isa=isas[-1], **kw), tiny_model(),
                                warmup=False)
    packed = [w for w in jax.tree_util.tree_leaves(
        engine.runner.params, is_leaf=lambda x: isinstance(x, PackedWeight))
        if isinstance(w, PackedWeight)]
    assert packed and {w.isa for w in packed} == {isas[-1]}
    missing = [isa for isa, _ in cpu_build.dense_variants() if isa not in isas]
    for isa in missing:
        with pytest.raises(ValueError, match=f"isa='{isa}': this CPU runs only"):
            build.build_engine(EngineConfig(dense_isa=isa, **kw), tiny_model(), warmup=False)


def _model_cfg(head_dim: int):  # noqa: ANN202 - a ModelConfig, GQA 4
    from jaxserve.models.config import ModelConfig
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=64,
                       num_layers=1, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False, qk_norm=False)


@pytest.mark.parametrize("platform,impl,head_dim,page_size,kv,want", [
    ("gpu", "auto", 80, 16, None, ("pallas_gpu", 128)),       # padded pages: the kernel runs
    ("gpu", "auto", 256, 32, None, ("pallas_gpu", 256)),      # float32 (issue #29)
    ("gpu", "auto", 128, 16, "int8", ("reference", None)),    # 8-bit pages of 16: fallback
    ("tpu", "auto", 64, 16, "fp8", ("reference", None)),
    ("tpu", "auto", 80, 32, "int8", ("pallas_tpu", 128)),
    ("gpu", "pallas_gpu", 128, 16, "int8", "page_size=16"),    # named: refused, with why
    ("tpu", "pallas_tpu", 128, 16, "fp8", "page_size 16"),
])
def test_attention_impl_asks_the_kernel_about_the_models_pages(
        monkeypatch: pytest.MonkeyPatch, caplog, platform: str, impl: str, head_dim: int,
        page_size: int, kv: str | None, want: object) -> None:
    """The engine's kernel choice passes the model's page geometry (head dim as the kernel
    allocates it, page size, KV dtype, GQA) to select_impl: 'auto' falls back to the
    reference with a warning where the platform's kernel cannot run it."""
    from jaxserve.kernels_pallas import selector
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(selector, "_gpu_kernel_supported", lambda: True)
    monkeypatch.setattr(selector, "_ptxas_unsafe", lambda: False)
    selector._warn_fallback.cache_clear()
    config = EngineConfig(attention_impl=impl, page_size=page_size, kv_cache_dtype=kv,
                          dtype="float32")
    kv_dtype = build.kv_cache_dtype(config)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=f"'{impl}'.*{want}"):
            build._attention_impl(config, _model_cfg(head_dim), kv_dtype)
        return
    assert build._attention_impl(config, _model_cfg(head_dim), kv_dtype) == want
    assert ("using the jnp reference" in caplog.text) is (want[0] == "reference")
