"""A Llama for real vLLM on a CPU whose weights take seconds to read and little to compute:
the tiny model's tokenizer, 2 layers of hidden 1024, and an embedding of 1,500,000 rows (3.1 GB
of random bf16) that the LM head shares. The files hold the head's copy too (the model is
built on the meta device, which unties it at save): 6.1 GB in all, every byte read at load,
half of it kept. An embedding costs one row per token and the head one product per sampled
token, so a load's time is the weights' and the engine's, not the model's arithmetic. Nothing
is downloaded.

    VENV/bin/python tests/realvllm/make_big_model.py TINY_MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(tiny: Path, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    base = LlamaConfig.from_pretrained(tiny)
    config = LlamaConfig(
        vocab_size=1_500_000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=512,
        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=None,
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="500MB")
    print(out, sorted(p.name for p in out.glob("*.safetensors")))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
