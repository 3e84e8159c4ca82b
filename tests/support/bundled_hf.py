"""transformers' own reading of the bundled GGUF, converted once per test session.

transformers dequantizes a GGUF's tensors and converts its tokenizer in Python, 15-50 s on 2
cores each time, and four test modules use that reading as their oracle (models/
test_bundled_model, test_gguf_loader, test_tokenizer, test_chat_template). The first to ask
loads the GGUF with transformers and saves the loaded model's tensors, config and tokenizer
into the session's scratch directory (conftest's
JAXSERVE_TEST_SESSION_DIR, shared by xdist workers; an exclusive file lock makes the others
wait for it); later callers build the model from that config and load those tensors. The folder holds
exactly what transformers made from the GGUF, so the oracle is the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile
from collections.abc import Iterator

from jaxserve.models.bundled import bundled_model_path


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _session_dir() -> pathlib.Path:
    d = os.environ.get("JAXSERVE_TEST_SESSION_DIR")  # conftest sets it; a bare import not
    return pathlib.Path(d) if d else pathlib.Path(tempfile.gettempdir())


def bundled_hf_dir() -> pathlib.Path:
    """An HF folder with transformers' float32 model and tokenizer read from the bundled
    GGUF (converted on the first call of the session)."""
    import safetensors.torch
    import torch
    import transformers

    out = _session_dir() / "bundled-hf"
    with _locked(_session_dir() / "bundled-hf.lock"):
        if not (out / "done").exists():
            gguf = bundled_model_path()
            tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # The weights as plain tensors (transformers refuses save_pretrained on a model
            # read from a GGUF), next to its config and the tokenizer.
            out.mkdir(parents=True, exist_ok=True)
            safetensors.torch.save_model(model, str(out / "model.safetensors"))
            model.config.save_pretrained(out)
            tok.save_pretrained(out)
            (out / "done").touch()
    return out


def bundled_hf_tokenizer():  # noqa: ANN201 - a transformers tokenizer
    """transformers' tokenizer of the bundled GGUF."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(bundled_hf_dir())


def bundled_hf_model():  # noqa: ANN201 - a transformers model, in eval mode
    """transformers' float32 model of the bundled GGUF."""
    import safetensors.torch
    import torch
    import transformers

    d = bundled_hf_dir()
    config = transformers.AutoConfig.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = safetensors.torch.load_model(model, str(d / "model.safetensors"))
    if missing or unexpected:
        raise RuntimeError(f"bundled HF weights: missing {missing}, unexpected {unexpected}")
    return model.eval()
