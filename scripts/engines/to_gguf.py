"""Convert the tiny model to GGUF for llama-server, with llama.cpp's own
converter (`convert_hf_to_gguf.py` from the source tree that
scripts/engines/install_llama.py unpacked).

The converter names a BPE tokenizer's pre-tokenizer by hashing how it
splits a probe text, and knows only published tokenizers' hashes; the
tiny model's tokenizer is trained locally, so the lookup is replaced by
"gpt-2" (byte-level BPE with GPT-2's split rules, which is what
`tokenizers`' ByteLevel pre-tokenizer applies).

Usage: python scripts/engines/to_gguf.py LLAMA_SRC MODEL_DIR OUT.gguf
(run with the vLLM virtualenv's python: it has torch, numpy and
transformers).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, model, out = (Path(a).resolve() for a in sys.argv[1:])
    if out.exists() and out.stat().st_mtime >= (model / "model.safetensors").stat().st_mtime:
        return 0
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))
    import convert_hf_to_gguf  # noqa: PLC0415 - from the llama.cpp tree
    from conversion.base import TextModel  # noqa: PLC0415

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    tmp = out.with_suffix(".part")
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(tmp), "--outtype", "f32"]
    convert_hf_to_gguf.main()
    tmp.rename(out)
    print(f"{out}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
