"""A tiny random Llama for real vLLM on a CPU, made locally (nothing is downloaded): 2 layers,
hidden 128, 4 heads of 32 (the CPU attention needs a head dim of at least 32), saved as about 10
safetensors shards so that vLLM's shard progress has steps, with a word-level tokenizer trained
here and a chat template.

    VENV/bin/python tests/realvllm/make_model.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(400)] + ["the", "a", "kimi", "hello", "world"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok.train_from_iterator(
        [" ".join(words)] * 4, trainers.WordLevelTrainer(special_tokens=special)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )  # fmt: skip
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, torch_dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="60KB")
    print(out, len(list(out.glob("*.safetensors"))), "shards")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
