"""Generate the tiny model the real-engine tests serve, deterministically.

A 2-layer Llama (hidden 128, 4 heads, max positions 8192, bf16) with
seeded random weights, and a byte-level BPE tokenizer trained here on a
seeded pseudo-English corpus, with a ChatML chat template. No model hub is
needed: both come from `transformers` and `tokenizers` in the vLLM
virtualenv. The weights are random, so the model's text is noise; the
tests ask for `max_tokens` with `ignore_eos` and look only at routing,
caching and metrics. It takes about 10 s.

The GGUF file llama.cpp serves is converted from this folder by
llama.cpp's own `convert_hf_to_gguf.py` (scripts/engines/install_llama.py).

Usage: python scripts/engines/tiny_model.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

VOCAB = 3400
# The pseudo-English of the tests' prompts (tests/e2e/engines): words made
# of common syllables, so the BPE learns merges that tokenize them compactly.
SYLLABLES = (
    "the an re in on er at en es or ti te al ar is it ed st nd ou ing ion "
    "con pro per com ver ter ment tion able ness ly ous ive ful"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out = []
    for _ in range(lines):
        n = rng.randint(8, 40)
        out.append(" ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "?", "!", ","]))
    # Digits and punctuation the tests' prompts use.
    out += [" ".join(str(rng.randint(0, 99999)) for _ in range(20)) for _ in range(200)]
    return out


def build_tokenizer(out: Path, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, seed: int, vocab: int, tok) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stamp = a.out / ".kvroute-tiny-model"
    want = json.dumps({"seed": a.seed, "vocab": VOCAB, "layers": 2, "hidden": 128})
    if stamp.exists() and stamp.read_text() == want:
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(a.out, a.seed)
    build_model(a.out, a.seed, len(tok), tok)
    stamp.write_text(want)
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    print(f"tiny model in {a.out}: vocab {len(tok)}, a short chat prompt is {n} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
