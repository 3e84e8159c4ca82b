"""Tiny random-weight checkpoints on disk: what benchmarks and tests serve when the model's
quality does not matter (front overhead, scheduling, wire formats).

`save_word_tokenizer` writes a word-level tokenizer ("<unk>", "<s>", "</s>", "w3", "w4", ...:
one id per word, so a prompt's token count is its word count) with a plain chat template;
`write_tiny_checkpoint` adds a random 2-layer Llama next to it as an HF folder that
`jaxserve serve --model DIR` loads. `tiny_config` is that model's architecture and
`word_tokenizer` the tokenizer loaded from a temporary folder (benchmarks that run the
engine on a fake runner need only these two).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig
    from .tokenizer import Tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


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


def word_tokenizer(vocab_size: int) -> "Tokenizer":
    """`save_word_tokenizer`'s tokenizer, written to a fresh temporary folder and loaded."""
    from .tokenizer import Tokenizer

    d = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-words-"))
    save_word_tokenizer(d, vocab_size)
    return Tokenizer.from_hf_dir(d)


def tiny_config(vocab: int = 1024, max_position_embeddings: int = 2048) -> "ModelConfig":
    """A 2-layer Llama, hidden 64, 4 query / 2 KV heads of 16 dims (EOS id 2)."""
    from .config import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                       bos_token_id=1, eos_token_ids=(2,))


def write_tiny_checkpoint(out: pathlib.Path, vocab: int = 1024, seed: int = 0) -> None:
    """A random 2-layer Llama (hidden 64) + `save_word_tokenizer`, as an HF folder."""
    import jax
    import jax.numpy as jnp

    from . import llama
    from .hf_loader import save_hf_dir

    cfg = tiny_config(vocab)
    save_hf_dir(out, cfg, llama.init_random_params(cfg, jax.random.key(seed), jnp.float32))
    save_word_tokenizer(out, vocab)
