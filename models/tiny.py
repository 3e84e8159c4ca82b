"""Tiny random-weight models: what tests and benchmarks run when the model's quality does not
matter (front overhead, scheduling, wire formats, engine oracles). The one factory of them.

`tiny_config(**overrides)` is a 2-layer Llama's ModelConfig (default: hidden 64, vocabulary
1024, the benchmarks' tiny server model); any ModelConfig field can be overridden.
`TEST_SHAPE` / `TEST_INIT_SCALE` are the test suite's engine model (hidden 32, vocabulary 211,
init scale 0.5: tests/support/engine_fixtures.py), which the soak and
`bench_grpc_overhead.py --model tiny` serve too. `random_model(cfg)` gives that config random
weights and a tokenizer as a LoadedModel; `write_tiny_checkpoint(dir, cfg)` saves the weights
as an HF folder that `jaxserve serve --model DIR` loads.

`save_word_tokenizer` writes a word-level tokenizer ("<unk>", "<s>", "</s>", "w3", "w4", ...:
one id per word, so a prompt's token count is its word count) with a plain chat template;
`word_tokenizer` is that tokenizer loaded from a temporary folder (benchmarks that run the
engine on a fake runner need only it and `tiny_config`).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ModelConfig
    from .families import ModelParams
    from .loading import LoadedModel
    from .tokenizer import Tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")

# The test suite's engine model (`tiny_config(**TEST_SHAPE)`, weights at TEST_INIT_SCALE):
# 4 query / 2 KV heads of 8 dims. The large init scale makes sharp distributions, so greedy
# argmaxes are far from ties.
TEST_SHAPE: dict[str, Any] = {"vocab_size": 211, "hidden_size": 32, "intermediate_size": 64,
                              "head_dim": 8, "max_position_embeddings": 512}
TEST_INIT_SCALE = 0.5


def save_word_tokenizer(out_dir: pathlib.Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids ('<unk>', '<s>', '</s>', 'w3', ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """`save_word_tokenizer`'s tokenizer, written to a fresh temporary folder and loaded."""
    from .tokenizer import Tokenizer

    d = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-words-"))
    save_word_tokenizer(d, vocab_size)
    return Tokenizer.from_hf_dir(d)


def tiny_config(**overrides: Any) -> ModelConfig:
    """A 2-layer Llama, by default hidden 64, 4 query / 2 KV heads of 16 dims, vocabulary 1024,
    2048 positions, the word tokenizer's special ids (BOS 1, EOS 2); `overrides` replace any
    ModelConfig field."""
    from .config import ModelConfig

    base: dict[str, Any] = {
        "model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "attention_bias": False, "qk_norm": False,
        "bos_token_id": 1, "eos_token_ids": (2,)}
    return ModelConfig(**(base | overrides))


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02, dtype: Any = None,
                  jit: bool = False) -> ModelParams:
    """The family's `init_random_params(cfg, key(seed), dtype (default float32), scale)`; `jit`: as
    one compiled program, the weights made on the device (large models)."""
    import jax
    import jax.numpy as jnp

    from .families import family

    init = family(cfg).init_random_params
    dtype = jnp.float32 if dtype is None else dtype
    if jit:
        return jax.jit(lambda k: init(cfg, k, dtype, scale))(jax.random.key(seed))
    return init(cfg, jax.random.key(seed), dtype, scale)


def random_model(cfg: ModelConfig | None = None, *, seed: int = 0, scale: float = 0.02,
                 dtype: Any = None, tokenizer: Tokenizer | None = None,
                 jit: bool = False) -> LoadedModel:
    """`cfg` (default `tiny_config()`) with `random_params` and `tokenizer` (default
    `word_tokenizer(cfg.vocab_size)`), as the LoadedModel `LLM(loaded=...)` / `build_engine`
    take (source "tiny", format "hf")."""
    from .loading import LoadedModel

    cfg = tiny_config() if cfg is None else cfg
    params = random_params(cfg, seed, scale, dtype, jit)
    if tokenizer is None:
        tokenizer = word_tokenizer(cfg.vocab_size)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer,
                       source=pathlib.Path("tiny"), format="hf")


def write_tiny_checkpoint(out: pathlib.Path, cfg: ModelConfig | None = None, *, seed: int = 0,
                          scale: float = 0.02) -> None:
    """`cfg` (default `tiny_config()`) with float32 `random_params` + `save_word_tokenizer`
    over its vocabulary, as an HF folder."""
    from .hf_loader import save_hf_dir

    cfg = tiny_config() if cfg is None else cfg
    save_hf_dir(out, cfg, random_params(cfg, seed, scale))
    save_word_tokenizer(out, cfg.vocab_size)
