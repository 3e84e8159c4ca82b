"""`jaxserve generate --lora NAME`: the completion of one prompt with a --lora-modules adapter.
Oracle: transformers' greedy decoding of the tiny HF model with the PEFT adapter merged."""

from __future__ import annotations

import pathlib

import pytest
from support.hf_models import build_hf_model, hf_greedy, save_tiny_tokenizer
from support.tiers import slow

from jaxserve import cli

FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--page-size", "8",
         "--max-model-len", "64", "--kv-cache-memory", "1MiB", "--attention-impl", "reference",
         "--token-buckets", "32", "--temperature", "0", "--max-tokens", "5", "--ignore-eos"]


def test_lora_must_name_a_registered_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything loads: --lora without --enable-lora, or naming no module."""
    assert cli.main(["generate", "w5", "--lora", "x", *FLAGS]) != 0
    assert "--lora 'x' must name one of --lora-modules" in capsys.readouterr().err
    assert cli.main(["generate", "w5", "--lora", "x", "--enable-lora", "--lora-modules",
                     "y=/nowhere", *FLAGS]) != 0
    assert "--lora 'x'" in capsys.readouterr().err


@slow("builds a tiny HF model, a PEFT adapter and an engine (~10 s); the offline API's LoRA "
      "path is compared with the merged HF model in tests/serving/test_lora_llm.py")
def test_generate_with_an_adapter(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    from support.lora_adapters import make_peft_adapter, merged_model

    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "")
    model = build_hf_model("llama2_mha", tmp_path / "base")
    save_tiny_tokenizer(tmp_path / "base", 211)
    adapter = make_peft_adapter(model, tmp_path / "sql", rank=4, seed=5)
    prompt = [5, 9, 33, 7]
    text = " ".join(f"w{t}" for t in prompt)
    assert cli.main(["generate", text, "--model", str(tmp_path / "base"), "--enable-lora",
                     "--lora-modules", f"sql={adapter}", "--max-lora-rank", "4",
                     "--lora", "sql", *FLAGS]) == 0
    want = hf_greedy(merged_model(model, adapter), prompt, 5)
    base = hf_greedy(model, prompt, 5)
    assert want != base
    # The word tokenizer prints id t as "w<t>"; special ids (< 3) are not printed.
    printed = [int(w[1:]) for w in capsys.readouterr().out.split()]
    assert printed == [t for t in want if t > 2]
