"""Training data that needs no network.

``stdlib``: the source files of the Python standard library on this machine, read as bytes
(vocabulary 256). Files are taken in sorted order; every tenth file goes to the validation
split, so both splits sample the whole library. The token files are cached as
``data/stdlib/{train,val}.bin`` (uint8; uint16 when the vocabulary exceeds 256) next to
``meta.json``, relative to this script, and reused on later runs. ``{train,val}_docs.npy`` hold
the offset of each file (document) in its split, for training on packed documents.

``python prepare.py [--max_bytes=N] [--force]`` writes them; ``train.py`` does it on its own
when they are missing. The long-range task (``passkey``) is generated on the fly by
``passkey.py`` and needs no preparation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
VAL_EVERY = 10  # every tenth file goes to the validation split


def stdlib_sources(stdlib_dir: Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library (site-packages excluded), in sorted order."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise RuntimeError(f"the standard library directory {str(root)!r} does not exist")
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    if not files:
        raise RuntimeError(f"no .py files found under {str(root)!r}")
    return files


def token_dtype(vocab_size: int) -> np.dtype:
    """uint8 for byte vocabularies, uint16 up to 65536 tokens."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"vocab_size {vocab_size} does not fit uint16")


def prepare_stdlib(
    data_dir: Path | None = None,
    max_bytes: int = 0,
    force: bool = False,
    stdlib_dir: Path | None = None,
) -> Path:
    """Write ``train.bin``, ``val.bin`` and ``meta.json`` for the ``stdlib`` corpus; returns the directory.

    ``max_bytes`` > 0 caps the corpus (the first files in sorted order). Existing files are
    reused unless ``force``.
    """
    out = Path(data_dir or DATA_DIR / "stdlib")
    meta_path = out / "meta.json"
    cached = [out / n for n in ("train.bin", "val.bin", "train_docs.npy", "val_docs.npy")]
    if meta_path.exists() and all(p.exists() for p in cached) and not force:
        meta = json.loads(meta_path.read_text())
        if meta.get("max_bytes", 0) == max_bytes:
            logger.info("using the cached corpus in %s", out)
            return out
    t0 = time.time()
    files = stdlib_sources(stdlib_dir)
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    starts: dict[str, list[int]] = {"train": [], "val": []}  # each document's offset in its split
    sizes = {"train": 0, "val": 0}
    for i, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError as e:  # unreadable file: skip it, say so
            logger.warning("skipping %s: %s", path, e)
            continue
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
        (val_parts if split == "val" else train_parts).append(data)
        if data:
            starts[split].append(sizes[split])
            sizes[split] += len(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
    val = np.frombuffer(b"".join(val_parts), dtype=np.uint8)
    if len(val) == 0 or len(train) == 0:
        raise RuntimeError(
            f"corpus too small: {len(train)} train and {len(val)} val bytes (max_bytes={max_bytes})"
        )
    out.mkdir(parents=True, exist_ok=True)
    # Write to temporary names, then rename: a concurrent reader never sees a half-written file.
    for name, arr in (("train", train), ("val", val)):
        tmp = out / f"{name}.bin.tmp{os.getpid()}"
        arr.astype(token_dtype(256)).tofile(tmp)
        os.replace(tmp, out / f"{name}.bin")
        tmp = out / f"{name}_docs.tmp{os.getpid()}.npy"
        np.save(tmp, np.asarray(starts[name], dtype=np.int64))
        os.replace(tmp, out / f"{name}_docs.npy")
    meta: dict[str, Any] = {
        "vocab_size": 256,
        "dtype": "uint8",
        "tokenizer": "bytes",
        "source": str(sysconfig.get_paths()["stdlib"]),
        "files": len(files),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "max_bytes": max_bytes,
    }
    tmp = out / f"meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    logger.info(
        "wrote %s: %d train and %d val tokens from %d files in %.1fs",
        out,
        len(train),
        len(val),
        len(files),
        time.time() - t0,
    )
    return out


def load_meta(data_dir: Path) -> dict[str, Any]:
    """The dataset's ``meta.json``; without one, nanoGPT's convention (uint16 GPT-2 tokens)."""
    meta_path = Path(data_dir) / "meta.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    return {"vocab_size": 50304, "dtype": "uint16", "tokenizer": "gpt2"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    max_bytes, force = 0, False
    for arg in argv:
        if arg == "--force":
            force = True
        elif arg.startswith("--max_bytes="):
            value = arg.split("=", 1)[1]
            try:
                max_bytes = int(value)
            except ValueError:
                raise SystemExit(f"--max_bytes must be an int, got {value!r}") from None
            if max_bytes < 0:
                raise SystemExit(f"--max_bytes must be >= 0, got {max_bytes}")
        else:
            raise SystemExit(f"unknown argument {arg!r}; usage: python prepare.py [--max_bytes=N] [--force]")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = prepare_stdlib(max_bytes=max_bytes, force=force)
    print(json.dumps(load_meta(out), indent=1))


if __name__ == "__main__":
    main()
