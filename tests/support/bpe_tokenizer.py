"""A byte-level BPE tokenizer trained in the test process (no model hub): the tokenizer of the
structured-output tests, where a grammar needs a vocabulary that can spell any JSON text.

Every byte is a token (the byte alphabet is seeded), plus merges learned from `CORPUS`, so a
text is reachable in several ways, as with a real model's tokenizer.
"""

from __future__ import annotations

import json
import pathlib

from jaxserve.models.tiny import CHAT_TEMPLATE
from jaxserve.models.tokenizer import Tokenizer

CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "true false null 0123456789",
          "hello world, the quick brown fox", '{"a": [1, 2.5, -3e4]}', "yes no maybe"] * 20
EOS = "<eos>"


def train_bpe_tokenizer(directory: pathlib.Path, vocab_size: int = 400,
                        chat_template: str = CHAT_TEMPLATE) -> Tokenizer:
    """Train, save under `directory` (tokenizer.json + tokenizer_config.json naming EOS and
    the chat template: by default the tiny models' plain one) and load it the way a served
    model's tokenizer is loaded."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "chat_template": chat_template}))
    return Tokenizer.from_hf_dir(directory)
