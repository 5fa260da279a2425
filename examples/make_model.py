"""Build a small causal LM and its tokenizer, for running the math examples
offline when you have no checkpoint: point ``rl.model.path`` and
``rl.task.tokenizer_path`` at the directory it writes (or at a real
checkpoint's directory instead).

    python examples/make_model.py OUT_DIR [--arch qwen2|llama] [--data FILE.jsonl]
        [--vocab 512] [--hidden 128] [--layers 4] [--heads 4] [--max-len 512] [--seed 0]

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the text of
``--data`` (every string field of every row) or, without it, on a few built-in
sentences, with ``<pad>``, ``<bos>``, ``<eos>`` and a ChatML chat template
(``<|im_start|>role ... <|im_end|>``). The model is a ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` built from config with random weights (seeded), vocabulary
padded above the tokenizer's to a multiple of 64, head size ``hidden / heads`` (vLLM's CPU attention
needs 32, 64, 80, 96, 112, 128, ...), both written with ``save_pretrained``:
any tool that loads a Hugging Face checkpoint loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_TEXT = [
    "Ana has 7 pears and gets 5 more. How many pears does Ana have now? #### 12",
    "The answer is \\boxed{42}. Let me think step by step: 6 times 7 is 42.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) .",
]


def texts(data: Path | None) -> list[str]:
    if data is None:
        return BUILTIN_TEXT * 50
    out = []
    for line in data.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out += [str(v) for v in row.values() if isinstance(v, str | int | float)]
    return out + BUILTIN_TEXT


def build_tokenizer(corpus: list[str], vocab: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.chat_template = CHATML
    return fast


def build_model(arch: str, tok, hidden: int, layers: int, heads: int, max_len: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    # Padded to a multiple of 64, as real checkpoints are: a loader may add a token or
    # two (AutoTokenizer gives a Qwen2 directory Qwen2's <|endoftext|>).
    common = dict(
        vocab_size=(len(tok) + 64) // 64 * 64,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    ap.add_argument("--data", type=Path, help="JSONL whose text trains the tokenizer")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.data is not None and not a.data.is_file():
        print(f"make_model: --data must be an existing JSONL file: got {str(a.data)!r}.")
        return 2
    if a.hidden % a.heads:
        print(f"make_model: --hidden must be divisible by --heads: got {a.hidden}, {a.heads}.")
        return 2
    tok = build_tokenizer(texts(a.data), a.vocab)
    model = build_model(a.arch, tok, a.hidden, a.layers, a.heads, a.max_len, a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"wrote a {a.arch} model of {n:,} parameters and a {len(tok)}-token tokenizer to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
