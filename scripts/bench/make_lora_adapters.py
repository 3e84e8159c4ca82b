"""Random LoRA adapters in PEFT's on-disk format, for the multi-LoRA benchmark.

    python scripts/bench/make_lora_adapters.py HF_DIR OUT --num 8 --rank 16

HF_DIR: the base model's HF config (`jaxserve convert bundled HF_DIR --format hf` writes the
bundled model's); OUT/lora<i>/ gets `adapter_config.json` and `adapter_model.safetensors`
(PEFT's key names, lora_A [r, in] and lora_B [out, r], every attention and MLP projection of
every layer), seeded per adapter. The values are small (a ~ N(0, 1 / in), b ~ N(0, 0.02^2 / r)):
the output changes but stays text-like; the benchmark runs with --ignore-eos anyway, so output
lengths match the base model's. numpy + safetensors only (no torch, no peft).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of a Llama-family layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(cfg: dict, out: pathlib.Path, rank: int, alpha: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (fan_in, fan_out) in shapes(cfg).items():
            stem = f"base_model.model.model.layers.{layer}.{MODULES[mod]}.{mod}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(
                0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(
                0, 0.02 * rank ** -0.5, (fan_out, rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": sorted(MODULES), "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": cfg.get("_name_or_path", "base")}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", type=pathlib.Path)
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    args = p.parse_args()
    cfg = json.loads((args.hf_dir / "config.json").read_text())
    for i in range(args.num):
        write_adapter(cfg, args.out / f"lora{i}", args.rank, args.alpha, seed=i)
        print(args.out / f"lora{i}")


if __name__ == "__main__":
    main()
