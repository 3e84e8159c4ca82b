"""LoRA adapters for the serving-layer tests (servers, batch jobs) without a model on a device.

`write_peft_dir` writes a small PEFT adapter directory for the test model's config
(`engine_fixtures.tiny_model_config`) with numpy + safetensors (no torch), plus a marker file
with the adapter's arithmetic `offset`. `PeftCheckedLoader` is the engine's loader for the
fake runner: it reads and checks the directory with the real PEFT loader
(`models.lora_loader.load_peft_adapter`, so a bad adapter is refused with its real message),
then hands the fake runner a `FakeLora(offset)`: every token of a request under that adapter
is the arithmetic token shifted by `offset` (`fake_runner`), which `lora_oracle` predicts.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner, FakeLora, arithmetic_next_token
from jaxserve.engine.sizing import plan_engine
from jaxserve.lora_config import LoRAConfig
from jaxserve.models.lora_loader import load_peft_adapter

OFFSET_FILE = "fake_offset"  # beside the PEFT files: the FakeLora offset of this adapter
EOS = 2


def write_peft_dir(out: pathlib.Path, offset: int, rank: int = 4, seed: int = 0,
                   std: float = 0.1) -> pathlib.Path:
    """A PEFT LoRA directory (q_proj and v_proj of every layer of the test model) at `out`,
    A and B entries ~ N(0, std^2) (a real engine's greedy tokens change at std 0.5)."""
    cfg = tiny_model_config()
    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "v_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for mod, (fan_in, fan_out) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, std, (rank, fan_in)).astype(
                np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, std, (fan_out, rank)).astype(
                np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": sorted(shapes), "bias": "none"}))
    (out / OFFSET_FILE).write_text(str(offset))
    return out


class PeftCheckedLoader:
    """The engine's `load(lora_path)`: the real PEFT checks, then a FakeLora."""

    def __init__(self, max_rank: int):
        self.max_rank = max_rank
        self.reads: list[str] = []

    def __call__(self, path: str) -> FakeLora:
        self.reads.append(path)
        load_peft_adapter(path, tiny_model_config(), self.max_rank)
        return FakeLora(int((pathlib.Path(path) / OFFSET_FILE).read_text()))


def lora_fake_engine(modules: tuple[tuple[str, str], ...] = (), max_loras: int = 2,
                     max_lora_rank: int = 8, runner: ArithmeticRunner | None = None,
                     loader: PeftCheckedLoader | None = None, **cfg: object) -> Engine:
    """An engine over the arithmetic fake runner (`runner`: a subclass) with LoRA on
    (`modules`: --lora-modules; `loader`: default a PeftCheckedLoader)."""
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128,
                attention_impl="reference")
    base.update(cfg)
    config = EngineConfig(**base, lora_config=LoRAConfig(  # type: ignore[arg-type]
        max_loras=max_loras, max_lora_rank=max_lora_rank, lora_modules=modules))
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    return Engine(config, plan, runner or ArithmeticRunner(VOCAB), tiny_tokenizer(), (EOS,),
                  lora_loader=loader or PeftCheckedLoader(max_lora_rank))


def lora_oracle(prompt: list[int], max_tokens: int, offset: int = 0) -> list[int]:
    """The fake runner's greedy tokens for `prompt` under an adapter of `offset` (0: base)."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB, offset))
    return seq[len(prompt):]


def oracle_text(prompt: list[int], max_tokens: int, offset: int = 0) -> str:
    return tiny_tokenizer().decode(lora_oracle(prompt, max_tokens, offset))
