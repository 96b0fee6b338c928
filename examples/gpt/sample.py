"""Generate text from a checkpoint of ``train.py`` (nanoGPT's ``sample.py``).

    python sample.py                                   # out-stdlib/ckpt.pt, prompt "\\n"
    python sample.py --out_dir=out-stdlib --start="def " --num_samples=2 --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --attention_backend=sdpa

Decoding uses the library's bounded key/value cache (``dilated_attention.decode.BoundedDilatedKVCache``):
per layer, branch and kv head it keeps only the current segment's keys at the phases of the heads
that read them, and each new token runs the fused decode step. ``--bounded_kv_cache=False`` uses the
full cache of ``GPT.generate`` (``dilated_attention.DilatedKVCache``) instead, and
``--use_kv_cache=False`` recomputes the whole context every step. With either cache, a new token
reads only the cached keys of its segment and head phase in each branch, so the result equals a
full recompute.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import configurator
from model import ATTENTION_BACKENDS, GPT, GPTConfig
from prepare import load_meta
from train import DTYPES, auto_dtype, resolve_device

from dilated_attention.decode import BoundedDilatedKVCache

logger = logging.getLogger("sample")


@dataclass
class SampleConfig:
    out_dir: str = "out-stdlib"  # relative to this script's directory
    data_dir: str = "data"
    start: str = "\n"  # the prompt, or "FILE:path" to read it from a file
    num_samples: int = 2
    max_new_tokens: int = 400
    temperature: float = 0.8
    top_k: int = 0  # 0 = no top-k filtering
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    use_kv_cache: bool = True
    bounded_kv_cache: bool = True  # the bounded cache and fused step (False: GPT.generate's full cache)
    attention_backend: str = ""  # "" = the checkpoint's


def cache_kind(cfg: SampleConfig) -> str:
    return "off" if not cfg.use_kv_cache else "bounded" if cfg.bounded_kv_cache else "full"


def generate_bounded(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """``GPT.generate`` with the bounded cache: the same sampling, the cache rebuilt from the last
    ``block_size // 2`` tokens when the context reaches the block size (the position embeddings')."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    c = getattr(model, "_orig_mod", model).config
    segs, rates = (
        ([c.block_size], [1]) if c.attention_backend == "dense" else (c.segment_lengths, c.dilation_rates)
    )
    p = next(model.parameters())
    bs = c.block_size
    cache: BoundedDilatedKVCache | None = None
    for _ in range(max_new_tokens):
        if cache is None or int(cache.seqlens.max()) >= bs:
            ctx = idx[:, -(bs // 2 if cache is not None else bs) :]
            cache = BoundedDilatedKVCache(
                c.n_layer, idx.shape[0], c.n_head, c.n_kv_head, c.head_dim, segs, rates,
                max_seqlen=bs, dtype=p.dtype, device=p.device,
            )  # fmt: skip
            logits, _ = model(ctx, kv_cache=cache)
        else:
            logits, _ = model(idx[:, -1:], kv_cache=cache)
        logits = logits[:, -1, :].float() / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        probs = torch.nn.functional.softmax(logits, dim=-1)
        idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def load_model(ckpt_path: Path, device: torch.device, attention_backend: str = "") -> tuple[GPT, dict]:
    """The model of a checkpoint (in eval mode) and the checkpoint's training config."""
    if not ckpt_path.exists():
        raise FileNotFoundError(f"no checkpoint at {ckpt_path}; train one first (python train.py ...)")
    checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
    args = dict(checkpoint["model_args"])
    if attention_backend:
        args["attention_backend"] = attention_backend
    args["gradient_checkpointing"] = False
    model = GPT(GPTConfig(**args))
    model.load_state_dict(checkpoint["model"])
    model.eval().to(device)
    return model, checkpoint.get("config", {})


def encode_decode(train_config: dict, data_dir: Path):
    """Tokenizer of the checkpoint's dataset: bytes, or GPT-2 BPE (needs tiktoken)."""
    dataset = train_config.get("dataset", "stdlib")
    tokenizer = "bytes" if dataset == "passkey" else load_meta(data_dir / dataset).get("tokenizer", "bytes")
    if tokenizer == "bytes":
        return (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    if tokenizer == "gpt2":
        try:
            import tiktoken
        except ImportError:
            raise RuntimeError(
                "this checkpoint uses GPT-2 tokens; install tiktoken to sample from it"
            ) from None
        enc = tiktoken.get_encoding("gpt2")
        return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode
    raise ValueError(f"unknown tokenizer {tokenizer!r} in the dataset's meta.json")


def main(argv: list[str] | None = None) -> list[str]:
    argv = sys.argv[1:] if argv is None else argv
    cfg = configurator.load_config(SampleConfig, argv, base_dir=HERE)
    if cfg.attention_backend and cfg.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {list(ATTENTION_BACKENDS)} or '', "
            f"got {cfg.attention_backend!r}"
        )
    if cfg.dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {cfg.dtype!r}")
    for name in ("num_samples", "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.top_k < 0 or cfg.temperature <= 0:
        raise ValueError(
            f"need top_k >= 0 and temperature > 0, got top_k={cfg.top_k}, temperature={cfg.temperature}"
        )
    device = resolve_device(cfg.device)
    ptdtype = auto_dtype(device) if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    ctx = (
        nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type=device.type, dtype=ptdtype)
    )
    torch.manual_seed(cfg.seed)

    model, train_config = load_model((HERE / cfg.out_dir) / "ckpt.pt", device, cfg.attention_backend)
    if cfg.compile:
        model = torch.compile(model)
    encode, decode = encode_decode(train_config, (HERE / cfg.data_dir).resolve())
    start = cfg.start
    if start.startswith("FILE:"):
        start = Path(start[5:]).read_text(encoding="utf-8")
    ids = encode(start)
    if not ids:
        raise ValueError("the prompt (start) must not be empty")
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, :]

    texts = []
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with torch.no_grad(), ctx:
        for _ in range(cfg.num_samples):
            t0 = time.time()
            if cfg.use_kv_cache and cfg.bounded_kv_cache:
                y = generate_bounded(model, x, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, gen)
            else:
                y = model.generate(
                    x,
                    cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_k=cfg.top_k or None,
                    use_cache=cfg.use_kv_cache,
                    generator=gen,
                )
            dt = time.time() - t0
            text = decode(y[0].tolist())
            texts.append(text)
            print(text)
            print(
                f"---------------  ({cfg.max_new_tokens} tokens in {dt:.2f}s, "
                f"{cfg.max_new_tokens / dt:.0f} tokens/s, kv cache {cache_kind(cfg)}, "
                f"attention {model.config.attention_backend})"
            )
    return texts


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except (configurator.ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
