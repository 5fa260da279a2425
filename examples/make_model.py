"""Build a causal LM and its tokenizer from nothing: the ~20M-parameter Qwen2 model of
``examples/pretrain_code.toml``, trained on the corpus of ``examples/make_corpus.py``,
or a small one for running the math examples offline when you have no checkpoint
(point ``rl.model.path`` and ``rl.task.tokenizer_path`` at the directory it writes,
or at a real checkpoint's directory instead).

    python examples/make_model.py [--corpus data/stdlib] [OUT_DIR]   # models/qwen2-20m
    python examples/make_model.py OUT_DIR [--arch qwen2|llama] [--data FILE.jsonl]
        [--vocab 512] [--hidden 128] [--layers 4] [--heads 4] [--kv-heads 4]
        [--intermediate 512] [--max-len 512] [--seed 0]

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the ``text`` field
of ``--corpus``'s ``train.jsonl`` (all of it, or its first ``--tokenizer-mb`` MB of
files in a fixed order), on the text of ``--data`` (every string field of every
row) or, without either, on a few built-in sentences, with ``<pad>``, ``<bos>``,
``<eos>`` and a ChatML chat template (``<|im_start|>role ... <|im_end|>``). The model
is a ``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` built from config with random
weights (seeded), vocabulary padded above the tokenizer's to a multiple of 64, head
size ``hidden / heads`` (vLLM's CPU attention needs 32, 64, 80, 96, 112, 128, ...),
both written with ``save_pretrained``: any tool that loads a Hugging Face checkpoint
loads it (``AutoTokenizer`` and ``AutoModelForCausalLM``, ``local_files_only=True``).

With ``--corpus`` the shape defaults to the ~20M model (``CODE_SHAPE``: vocabulary
8192, hidden 384, 8 layers, 6 heads, 2 KV heads, MLP 1536, 1024 positions, tied
embeddings); without it, to the small one (``SMALL_SHAPE``). Any flag overrides.
With no arguments at all, it builds ``models/qwen2-20m`` from ``data/stdlib``.

``--agentic`` writes a tokenizer for multi-turn episodes with tools
(``examples/agentic_code.toml``): ``<|im_end|>`` is its EOS, so the engine stops
at the end of each turn, its chat template renders tools and tool calls in the
Hermes format (:data:`phalanx.rl.agentic.template.TOOL_CHATML`), and it also
learns from the built-in coding environment's prompts and a little Python.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


CODE_SHAPE = dict(
    vocab=8192, hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1536, max_len=1024
)
"""The model of examples/pretrain_code.toml: ~20M parameters (3.2M of them the embedding)."""
SMALL_SHAPE = dict(vocab=512, hidden=128, layers=4, heads=4, max_len=512)
"""The math examples' model (KV heads: as many as heads; MLP: 4 x hidden)."""
CODE_OUT = Path("models/qwen2-20m")
CODE_CORPUS = Path("data/stdlib")


def corpus_texts(corpus: Path, limit_mb: float) -> list[str]:
    """The ``text`` of every row of ``corpus/train.jsonl``, or of its first rows up to
    ``limit_mb`` MB (0: all)."""
    out, size = [], 0
    with (corpus / "train.jsonl").open() as f:
        for line in f:
            text = json.loads(line).get("text")
            if isinstance(text, str):
                out.append(text)
                size += len(text)
                if limit_mb and size >= limit_mb * 1e6:
                    break
    return out


def texts(data: Path | None) -> list[str]:
    if data is None:
        return BUILTIN_TEXT * 50
    out = []
    for line in data.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out += [str(v) for v in row.values() if isinstance(v, str | int | float)]
    return out + BUILTIN_TEXT


# What transformers' Qwen2Tokenizer splits text with before byte-level BPE: AutoTokenizer
# rebuilds a Qwen2 directory's tokenizer from its vocabulary and merges with this
# normalizer and pre-tokenizer (whatever tokenizer.json says), so the merges must be
# learnt under the same split or the loaded tokenizer cuts text into more tokens.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_EXTRA = ["<|endoftext|>"]
"""The token Qwen2Tokenizer adds as its unknown token when the vocabulary lacks it."""


def build_tokenizer(
    corpus: list[str], vocab: int, arch: str = "qwen2", agentic: bool = False
):  # -> PreTrainedTokenizerFast
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    if arch == "qwen2":
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS + (QWEN2_EXTRA if arch == "qwen2" else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer)
    eos = "<|im_end|>" if agentic else "<eos>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token=eos
    )
    fast.chat_template = CHATML
    if agentic:
        from phalanx.rl.agentic.template import TOOL_CHATML

        fast.chat_template = TOOL_CHATML
    return fast


def agentic_texts() -> list[str]:
    """What the --agentic tokenizer also learns from: the coding environment's prompts
    and tests, tool-call markup, and a little Python."""
    from phalanx.rl.agentic.code_env import PROBLEMS, SYSTEM

    code = [
        "def f(x):\n    return x + 1\n",
        "for i in range(10):\n    print(i)\n",
        "```python\ndef add(a, b):\n    return a + b\n```",
        '<tool_call>{"name": "run_python", "arguments": {"code": "print(1)"}}</tool_call>',
        "tests passed. Fix the function. Traceback (most recent call last): Error",
    ]
    return [SYSTEM] + [f"{n} {w} {t}" for n, w, t in PROBLEMS] + code


def build_model(
    arch: str,
    tok,
    hidden: int,
    layers: int,
    heads: int,
    max_len: int,
    seed: int,
    kv_heads: int | None = None,
    intermediate: int | None = None,
):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    # Padded to a multiple of 64, as real checkpoints are: a loader may add a token or
    # two (AutoTokenizer gives a Qwen2 directory Qwen2's <|endoftext|>).
    common = dict(
        vocab_size=(len(tok) + 64) // 64 * 64,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
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
    ap.add_argument(
        "out", type=Path, nargs="?", help=f"output directory ({CODE_OUT} with --corpus)"
    )
    ap.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    ap.add_argument("--corpus", type=Path, help="a make_corpus.py directory: the ~20M code model")
    ap.add_argument(
        "--tokenizer-mb",
        type=float,
        default=0,
        help="--corpus text the tokenizer learns from, in MB (0: all)",
    )
    ap.add_argument("--data", type=Path, help="JSONL whose text trains the tokenizer")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    ap.add_argument("--intermediate", type=int, help="MLP width")
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--agentic", action="store_true", help="EOS <|im_end|>, a chat template with tools"
    )
    a = ap.parse_args()
    if a.out is None and a.corpus is None and a.data is None:
        a.corpus = CODE_CORPUS  # no arguments: the code model of pretrain_code.toml
    shape = CODE_SHAPE if a.corpus is not None else SMALL_SHAPE
    for k, v in shape.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        if a.corpus is None:
            print("make_model: OUT_DIR must be given without --corpus: got none.")
            return 2
        a.out = CODE_OUT
    if a.corpus is not None and a.data is not None:
        print("make_model: --corpus and --data must not both be given: pick one text source.")
        return 2
    if a.corpus is not None and not (a.corpus / "train.jsonl").is_file():
        print(
            f"make_model: --corpus must be a directory with train.jsonl: got {str(a.corpus)!r}. "
            f"Write one with: python examples/make_corpus.py --out {a.corpus}"
        )
        return 2
    if a.data is not None and not a.data.is_file():
        print(f"make_model: --data must be an existing JSONL file: got {str(a.data)!r}.")
        return 2
    if a.hidden % a.heads:
        print(f"make_model: --hidden must be divisible by --heads: got {a.hidden}, {a.heads}.")
        return 2
    if a.kv_heads is not None and a.heads % a.kv_heads:
        print(f"make_model: --heads must be divisible by --kv-heads: got {a.heads}, {a.kv_heads}.")
        return 2
    start = time.monotonic()
    corpus = corpus_texts(a.corpus, a.tokenizer_mb) if a.corpus is not None else texts(a.data)
    if a.agentic:
        corpus = corpus + agentic_texts() * 20
    tok = build_tokenizer(corpus, a.vocab, a.arch, a.agentic)
    learnt = time.monotonic() - start
    model = build_model(
        a.arch, tok, a.hidden, a.layers, a.heads, a.max_len, a.seed, a.kv_heads, a.intermediate
    )
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    size = sum(len(t) for t in corpus) / 1e6
    print(
        f"wrote a {a.arch} model of {n:,} parameters and a {len(tok)}-token tokenizer (learnt "
        f"from {len(corpus)} texts, {size:.1f} MB, in {learnt:.0f} s) to {a.out} in "
        f"{time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
