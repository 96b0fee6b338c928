"""The example GPT (examples/gpt): model, KV cache, FLOP count, configurator, data, training loop.

Attention inside the model is checked against the float64 dense reference (tests/reference.py);
cached decoding against a full forward in float64; training runs a tiny model a few steps with
each attention backend that can be constructed here.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from reference import multiplicity, reference_attention

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(GPT_DIR))

import configurator
import longcontext
import passkey
import prepare
import recall
import sample
import train
from model import DILATED_BACKENDS, GPT, GPTConfig, attention_pairs

from dilated_attention import DilatedKVCache

SLOW = os.environ.get("DILATED_ATTENTION_SLOW") == "1"

# (n_head, n_kv_head, block_size, segment_lengths, dilation_rates)
MODEL_SHAPES = [
    pytest.param(4, 4, 48, (8, 16, 32), (1, 2, 4), id="three-branches-ragged"),
    pytest.param(4, 2, 40, (6, 12), (1, 3), id="gqa-ragged"),
    pytest.param(2, 1, 24, (8,), (4,), id="uncovered-rows"),  # r > n_head: some (p, h) read nothing
    pytest.param(2, 2, 20, (32, 4), (2, 1), id="w-greater-than-N"),
]


def tiny_config(
    n_head: int = 4,
    n_kv_head: int = 4,
    block_size: int = 48,
    segs=(8, 16, 32),
    rates=(1, 2, 4),
    backend: str = "native",
) -> GPTConfig:
    return GPTConfig(
        block_size=block_size,
        vocab_size=64,
        n_layer=2,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=8 * n_head,
        dropout=0.0,
        bias=True,
        attention_backend=backend,
        segment_lengths=segs,
        dilation_rates=rates,
    )


def backend_can_run(name: str) -> bool:
    """Whether the backend layer accepts this name (possibly falling back) on float64 CPU inputs."""
    if name == "dense":
        return True
    from dilated_attention.backends import select_backend

    q = torch.zeros(1, 8, 2, 4, dtype=torch.float64)
    try:
        select_backend(name, q, q)
    except (ValueError, RuntimeError, NotImplementedError):
        return False
    return True


ALL_BACKENDS = [*list(DILATED_BACKENDS), "dense"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models here are tiny: one thread is faster, and steady on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Attention inside the model, and what the KV cache reads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_head,n_kv_head,T,segs,rates", MODEL_SHAPES)
def test_attention_block_matches_reference(n_head, n_kv_head, T, segs, rates):
    """The block's attention (q, k, v split, heads, causal dilated attention) against the float64
    dense reference applied to the same projections."""
    torch.manual_seed(0)
    cfg = tiny_config(n_head, n_kv_head, T, segs, rates)
    attn = GPT(cfg).double().transformer.h[0].attn
    x = torch.randn(2, T, cfg.n_embd, dtype=torch.float64)
    C, kvd = cfg.n_embd, n_kv_head * cfg.head_dim
    q, k, v = attn.c_attn(x).split([C, kvd, kvd], dim=2)
    ref, _ = reference_attention(
        q.reshape(2, T, n_head, -1),
        k.reshape(2, T, n_kv_head, -1),
        v.reshape(2, T, n_kv_head, -1),
        segs,
        rates,
        is_causal=True,
    )
    expected = attn.c_proj(ref.reshape(2, T, C))
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("n_head,n_kv_head,T,segs,rates", MODEL_SHAPES)
def test_kv_cache_decoding_equals_full_forward(backend, n_head, n_kv_head, T, segs, rates):
    """Prefill a prompt, then decode token by token: the logits at every position equal those
    of one full forward pass (float64)."""
    if not backend_can_run(backend):
        pytest.skip(f"the backend layer cannot run {backend!r} here")
    torch.manual_seed(1)
    model = GPT(tiny_config(n_head, n_kv_head, T, segs, rates, backend)).double().eval()
    idx = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        full = model.forward_all(idx)  # (B, T, V)
        prompt = 5
        cache = model_cache(model, 2)
        logits, _ = model(idx[:, :prompt], kv_cache=cache)
        steps = [logits[:, 0]]
        for p in range(prompt, T):
            logits, _ = model(idx[:, p : p + 1], kv_cache=cache)
            steps.append(logits[:, 0])
    cached = torch.stack(steps, dim=1)  # (B, T - prompt + 1, V)
    torch.testing.assert_close(cached, full[:, prompt - 1 :], rtol=1e-10, atol=1e-10)


def model_cache(model: GPT, batch_size: int) -> DilatedKVCache:
    c = model.config
    return DilatedKVCache(c.n_layer, batch_size, c.block_size, c.n_kv_head, c.head_dim, dtype=torch.float64)


def test_generate_with_and_without_cache_agree():
    torch.manual_seed(2)
    model = GPT(tiny_config(block_size=64)).double().eval()
    prompt = torch.randint(0, 64, (1, 3))
    a = model.generate(prompt, 40, use_cache=True, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 40, use_cache=False, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    # Past the block size the cache is rebuilt from the last half block; it still runs.
    c = model.generate(prompt, 100, use_cache=True, generator=torch.Generator().manual_seed(7))
    assert c.shape == (1, 103)


def test_decode_past_the_block_size_is_an_error():
    model = GPT(tiny_config()).eval()
    cache = model_cache(model, 1)
    model(torch.zeros(1, 46, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="length 49: block size is only 48"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)


# ---------------------------------------------------------------------------------------------
# FLOPs (SPEC section 3)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "N,H,segs,rates",
    [(48, 4, (8, 16, 32), (1, 2, 4)), (37, 3, (5, 64), (2, 4)), (20, 2, (8,), (4,)), (1, 1, (4,), (2,))],
)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_pairs_count_the_reference_mask(N, H, segs, rates, causal):
    expected = int(multiplicity(N, H, segs, rates, causal).sum())
    assert attention_pairs(N, H, segs, rates, is_causal=causal) == expected
    dense = H * (N * (N + 1) // 2 if causal else N * N)
    assert attention_pairs(N, H, segs, rates, is_causal=causal, dense=True) == dense


def test_flops_per_sequence():
    cfg = tiny_config()
    model = GPT(cfg)
    T = cfg.block_size
    pairs = int(multiplicity(T, cfg.n_head, cfg.segment_lengths, cfg.dilation_rates, True).sum())
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    expected = 6 * n_params * T + 3.5 * 4 * cfg.head_dim * pairs * cfg.n_layer
    assert model.flops_per_sequence(T) == pytest.approx(expected, rel=1e-12)


def test_gpt_config_checks():
    GPTConfig(attention_backend="flash_attn_2", n_layer=1, n_head=2, n_embd=16)  # the seeds' name, accepted
    with pytest.raises(ValueError, match=r"attention_backend.*'bogus'"):
        GPTConfig(attention_backend="bogus")
    with pytest.raises(ValueError, match="dilation_rates"):
        GPTConfig(segment_lengths=(8, 16), dilation_rates=(1,))
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3, n_embd=32)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(3)
    cfg = tiny_config()
    model = GPT(cfg).double()
    idx = torch.randint(0, 64, (2, cfg.block_size))
    grads = []
    for ckpt in (False, True):
        model.config.gradient_checkpointing = ckpt
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Configurator
# ---------------------------------------------------------------------------------------------


def test_config_file_and_typed_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nbatch_size = 3\nlearning_rate = 1\nsegment_lengths = [16, 32]\n_private = 5\n")
    cfg = configurator.load_config(
        train.TrainConfig,
        [
            str(f),
            "--batch_size=5",
            "--learning_rate=3e-4",
            "--compile=True",
            "--bias=false",
            "--attention_backend=sdpa",
            "--out_dir='out x'",
            "--dilation_rates=1,2",
            "--segment_lengths=[8, 64]",
        ],
    )
    assert cfg.batch_size == 5 and isinstance(cfg.batch_size, int)
    assert cfg.learning_rate == 3e-4
    assert cfg.compile is True and cfg.bias is False
    assert cfg.attention_backend == "sdpa" and cfg.out_dir == "out x"
    assert cfg.dilation_rates == (1, 2) and cfg.segment_lengths == (8, 64)
    cfg = configurator.load_config(train.TrainConfig, [str(f), "--dilation_rates=(1, 2)"])
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)  # int accepted for a float
    assert cfg.segment_lengths == (16, 32) and cfg.dilation_rates == (1, 2)
    cfg = configurator.load_config(train.TrainConfig, ["--segment_lengths=128", "--dilation_rates=2"])
    assert cfg.segment_lengths == (128,) and cfg.dilation_rates == (2,)


def test_config_files_resolve_relative_to_the_script(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = configurator.load_config(train.TrainConfig, ["config/train_gpt2.py"], base_dir=GPT_DIR)
    assert cfg.n_layer == 12 and cfg.n_embd == 768


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--batch_sise=4", r"unknown config key 'batch_sise'; did you mean 'batch_size'"),
        ("--no_such_key=1", r"unknown config key 'no_such_key'"),
        ("--batch_size=four", r"--batch_size=four: batch_size must be int, got 'four'"),
        ("--batch_size=4.5", r"batch_size must be int, got 4.5"),
        ("--batch_size=True", r"batch_size must be int, got True"),
        ("--learning_rate=fast", r"learning_rate must be float, got 'fast'"),
        ("--compile=maybe", r"compile must be a bool \(True/False\), got 'maybe'"),
        ("--segment_lengths=[8, 1.5]", r"segment_lengths must be a tuple of ints, got \[8, 1.5\]"),
        ("--segment_lengths=abc", r"segment_lengths must be a tuple of ints, got 'abc'"),
        ("--batch_size", r"must have the form --key=value"),
        ("no_such_file.py", r"config file 'no_such_file.py' not found"),
    ],
)
def test_config_errors_name_the_key_and_value(arg, message):
    with pytest.raises(configurator.ConfigError, match=message):
        configurator.load_config(train.TrainConfig, [arg], base_dir=GPT_DIR)


@pytest.mark.parametrize(
    "text,message",
    [
        ("batch_sise = 4\n", r"unknown config key 'batch_sise'"),
        ("batch_size = '4'\n", r"batch_size must be int, got '4'"),
        ("compile = 1\n", r"compile must be bool, got 1"),
        ("dilation_rates = 'ab'\n", r"dilation_rates must be a tuple of ints"),
    ],
)
def test_config_file_errors(tmp_path, text, message):
    f = tmp_path / "bad.py"
    f.write_text(text)
    with pytest.raises(configurator.ConfigError, match=message):
        configurator.load_config(train.TrainConfig, [str(f)])


def test_every_config_file_parses():
    for f in sorted((GPT_DIR / "config").glob("*.py")):
        cfg = configurator.load_config(train.TrainConfig, [str(f)])
        cfg.validate()
        GPTConfig(
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_kv_head=cfg.n_kv_head,
            n_embd=cfg.n_embd,
            block_size=cfg.block_size,
            attention_backend=cfg.attention_backend,
            segment_lengths=cfg.segment_lengths,
            dilation_rates=cfg.dilation_rates,
        )


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prepare.prepare_stdlib(d / "stdlib", max_bytes=400_000)
    return d


def test_stdlib_corpus(data_dir):
    import numpy as np

    out = data_dir / "stdlib"
    meta = prepare.load_meta(out)
    train_tok = np.fromfile(out / "train.bin", dtype=np.uint8)
    val_tok = np.fromfile(out / "val.bin", dtype=np.uint8)
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes"
    assert len(train_tok) + len(val_tok) == 400_000 and len(val_tok) > 0
    files = prepare.stdlib_sources()
    first = files[0].read_bytes()  # file 0 goes to train, file VAL_EVERY-1 to val
    assert bytes(train_tok[: len(first)]) == first[: len(train_tok)]
    val_first = files[prepare.VAL_EVERY - 1].read_bytes()
    assert bytes(val_tok[: min(len(val_first), len(val_tok))]) == val_first[: len(val_tok)]
    mtime = (out / "train.bin").stat().st_mtime_ns
    prepare.prepare_stdlib(out, max_bytes=400_000)  # cached: not rewritten
    assert (out / "train.bin").stat().st_mtime_ns == mtime


def test_passkey_sample():
    gen = torch.Generator().manual_seed(0)
    for seq_len in (passkey.min_seq_len(5), 300, 2048):
        s = passkey.passkey_sample(seq_len, 5, gen)
        text = bytes(s.tokens.tolist()).decode("ascii")
        assert len(text) == seq_len + 1
        assert text[s.key_pos : s.key_pos + 5] == s.key and s.key.isdigit()
        assert text.endswith(passkey.QUESTION + s.key)
        assert text[s.answer_pos :] == s.key
        assert text.count(s.key) >= 3  # twice in the key sentence, once as the answer
    ends = [passkey.passkey_sample(2000, 4, gen, depth=d).key_pos for d in (0.0, 0.5, 1.0)]
    assert ends[0] < 30 and 900 < ends[1] < 1100 and ends[2] > 1800
    depths = [passkey.passkey_sample(1000, 5, gen).key_pos for _ in range(50)]
    assert min(depths) < 300 and max(depths) > 600  # spread over the filler
    a = passkey.passkey_sample(500, 5, torch.Generator().manual_seed(9))
    b = passkey.passkey_sample(500, 5, torch.Generator().manual_seed(9))
    assert torch.equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match="seq_len must be an int >="):
        passkey.passkey_sample(20, 5, gen)
    with pytest.raises(ValueError, match="depth"):
        passkey.passkey_sample(500, 5, gen, depth=1.5)


def test_passkey_batch_targets_only_the_answer():
    x, y, key_pos = passkey.passkey_batch(3, 400, 6, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (3, 400) and key_pos.shape == (3,)
    assert (y[:, :-6] == -1).all() and (y[:, -6:] >= ord("0")).all() and (y[:, -6:] <= ord("9")).all()
    for b in range(3):  # the answer is the key, and x is y shifted
        assert torch.equal(y[b, -6:], x[b, key_pos[b] : key_pos[b] + 6])
        assert torch.equal(x[b, -5:], y[b, -6:-1])
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), 256).float()
    assert passkey.answer_accuracy(perfect, y) == (1.0, 1.0)
    wrong = torch.nn.functional.one_hot(torch.zeros_like(y), 256).float()
    assert passkey.answer_accuracy(wrong, y) == (0.0, 0.0)


def test_passkey_receptive_field():
    """One layer's graph is the reference mask (any head); short segments cannot reach far keys."""
    T, H, segs, rates = 40, 2, (8, 16), (1, 4)
    one = passkey.attention_graph(T, H, segs, rates)
    assert torch.equal(one, multiplicity(T, H, segs, rates, True).sum(0) > 0)
    field = passkey.receptive_field(T, 3, H, segs, rates)
    ref = one | torch.eye(T, dtype=torch.bool)
    reach = ref.clone()
    for _ in range(2):  # paths of up to 3 steps, by explicit composition
        reach = torch.einsum("px,xy->py", reach.long(), ref.long()) > 0
    assert torch.equal(field, reach)
    short = passkey.reachable_fraction(1024, 4, 4, (64, 256), (1, 2), samples=100)
    full = passkey.reachable_fraction(1024, 4, 4, (64, 256, 1024), (1, 2, 4), samples=100)
    dense = passkey.reachable_fraction(1024, 4, 4, (1,), (1,), dense=True, samples=100)
    assert short < 0.5 and full == 1.0 and dense == 1.0


def test_recall_batch():
    """Records are whole rows of one token standing for (key, value), queries ask for keys of the
    table, the targets are the values and are never inputs."""
    B, T, P, Q, row = 3, 256, 6, 20, 4
    x, y, rec, qpos = recall.recall_batch(B, T, P, Q, row, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (B, T) and rec.shape == qpos.shape == (B, Q)
    assert ((x >= 0) & (x < recall.VOCAB_SIZE)).all()
    for b in range(B):
        assert (y[b] >= 0).sum() == Q and torch.equal(qpos[b], torch.arange(T - Q, T))
        assert (rec[b] % row == 0).all() and (rec[b] < T - Q).all()
        record = x[b, rec[b]] - recall.RECORDS
        assert ((record >= 0) & (record < recall.N_KEYS * recall.N_VALUES)).all()
        for j in range(1, row):  # the record fills its row
            assert torch.equal(x[b, rec[b] + j], x[b, rec[b]])
        assert torch.equal(x[b, qpos[b]], record // recall.N_VALUES)  # the query is the record's key
        assert torch.equal(y[b, qpos[b]], recall.N_KEYS + record % recall.N_VALUES)  # its value
        table = x[b, : T - Q]
        is_record = table != recall.BLANK
        assert is_record.sum() == P * row and (table[is_record] >= recall.RECORDS).all()
        keys = (table[is_record] - recall.RECORDS) // recall.N_VALUES
        assert len(set(keys.tolist())) == P  # distinct keys
        assert (x[b, T - Q :] < recall.N_KEYS).all()
        assert not ((x[b] >= recall.N_KEYS) & (x[b] < recall.RECORDS)).any()  # answers never inputs
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), recall.VOCAB_SIZE).float()
    assert recall.answer_accuracy(perfect, y) == 1.0
    assert recall.answer_accuracy(torch.zeros_like(perfect), y) == 0.0  # argmax 0 is a key
    a = recall.recall_batch(2, 128, 4, 8, 8, torch.Generator().manual_seed(5))
    b = recall.recall_batch(2, 128, 4, 8, 8, torch.Generator().manual_seed(5))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="seq_len 40 is too short"):
        recall.recall_batch(1, 40, 6, 8, 8)
    with pytest.raises(ValueError, match="n_pairs must be <="):
        recall.recall_batch(1, 4096, recall.N_KEYS + 1, 8, 8)
    with pytest.raises(ValueError, match="row must be >= 2"):
        recall.recall_batch(1, 256, 4, 8, 1)


def test_recall_length_curriculum():
    """The training length starts short, doubles (whole rows, up to the block) each time the running
    answer accuracy reaches the threshold, and the batch keeps the tokens of a full one."""
    c = recall.LengthCurriculum(2048, 2, start=128, grow_at=0.8, row=8, min_len=64)
    assert c.shape() == (32, 128)
    assert not any(c.update(0.79) for _ in range(200))  # never reaches 0.8
    lengths = [c.seq_len]
    for _ in range(1000):
        if c.update(1.0):
            lengths.append(c.seq_len)
    assert lengths == [128, 256, 512, 1024, 2048] and c.shape() == (2, 2048)
    assert not c.update(1.0) and c.seq_len == 2048  # stays at the block
    odd = recall.LengthCurriculum(1000, 3, start=100, row=8, min_len=120)
    assert odd.shape() == (25, 120)  # at least the task's shortest, whole rows
    while odd.seq_len < 1000:
        assert odd.seq_len % 8 == 0 and odd.shape()[0] * odd.seq_len <= 3 * 1000
        odd.update(1.0)
    assert recall.LengthCurriculum(2048, 4).shape() == (4, 2048)  # no curriculum: full length
    assert recall.LengthCurriculum(2048, 4, start=4096).shape() == (4, 2048)
    with pytest.raises(ValueError, match="grow_at must be in"):
        recall.LengthCurriculum(2048, 4, start=128, grow_at=0.0)
    with pytest.raises(ValueError, match="answer_acc must be finite"):
        c.update(float("nan"))


def test_recall_reachability():
    """Dilated branches spanning the block reach every record, in one layer too (the record fills
    its row, so every head phase has a copy), dense attention too; the same branches cut to a
    quarter of the block only the records in the last quarter; a row narrower than the largest
    rate leaves some phases without a copy."""
    T, H, row = 512, 4, 8
    args = {"n_pairs": 8, "n_queries": 32, "row": row, "samples": 16}
    full = recall.reachable_fraction(T, 2, H, (row, 16, T), (1, 2, 4), **args)
    local = recall.reachable_fraction(T, 2, H, (row, 16, T // 4), (1, 2, 2), **args)
    one_layer = recall.reachable_fraction(T, 1, H, (row, 16, T), (1, 2, 4), **args)
    dense = recall.reachable_fraction(T, 1, H, (1,), (1,), dense=True, **args)
    narrow = recall.reachable_fraction(T, 1, H, (2, 16, T), (1, 2, 4), **{**args, "row": 2})
    assert full == 1.0 and dense == 1.0 and one_layer == 1.0
    assert 0.05 < local < 0.5, local
    assert 0.2 < narrow < 0.8, narrow  # a query reads a 2-token row in 2 of its 4 phases


# ---------------------------------------------------------------------------------------------
# Training, checkpoints, sampling
# ---------------------------------------------------------------------------------------------


def tiny_train_args(data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    args = {
        "data_dir": str(data_dir),
        "out_dir": str(out_dir),
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "block_size": 64,
        "batch_size": 4,
        "segment_lengths": "16,32,64",
        "dilation_rates": "1,2,2",
        "learning_rate": 1e-2,
        "warmup_iters": 2,
        "lr_decay_iters": 30,
        "min_lr": 1e-3,
        "max_iters": 30,
        "eval_interval": 30,
        "eval_iters": 4,
        "log_interval": 1,
        "peak_flops": 1e12,
        "bias": True,
    }
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tiny_model_trains(backend, data_dir, tmp_path):
    if not backend_can_run(backend):
        pytest.skip(f"the backend layer cannot run {backend!r} here")
    out = train.main(tiny_train_args(data_dir, tmp_path, attention_backend=backend), log=lambda *_: None)
    losses = [loss for _, loss in out["losses"]]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert losses[0] > math.log(256) - 0.5  # starts near uniform over bytes
    first, last = out["evals"][0], out["evals"][-1]
    assert last["val"] < first["val"] - 1.0, out["evals"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert Path(out["ckpt_path"]).exists()


def test_checkpoint_resume_round_trip(data_dir, tmp_path):
    """3 steps, save, resume for 3 more = 6 steps straight: the same losses and weights."""
    common = {
        "max_iters": 6,
        "lr_decay_iters": 6,
        "eval_interval": 3,
        "always_save_checkpoint": True,
        "dropout": 0.1,
    }
    straight = train.main(tiny_train_args(data_dir, tmp_path / "a", **common), log=lambda *_: None)
    first = train.main(
        tiny_train_args(data_dir, tmp_path / "b", **{**common, "max_iters": 3}), log=lambda *_: None
    )
    assert first["iter_num"] == 3
    resumed = train.main(
        tiny_train_args(data_dir, tmp_path / "b", **common, init_from="resume"), log=lambda *_: None
    )
    assert [it for it, _ in resumed["losses"]] == [3, 4, 5]
    assert resumed["losses"] == straight["losses"][3:]
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # Sampling from the checkpoint: with and without the cache, the same text.
    args = [
        f"--out_dir={tmp_path / 'b'}",
        f"--data_dir={data_dir}",
        "--num_samples=1",
        "--max_new_tokens=20",
        "--start=def ",
    ]
    with_cache = sample.main(args)
    without = sample.main([*args, "--use_kv_cache=False"])
    assert with_cache == without and with_cache[0].startswith("def ")


def test_train_rejects_bad_settings(data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"attention_backend must be one of .* got 'bogus'"):
        train.main(tiny_train_args(data_dir, tmp_path, attention_backend="bogus"), log=lambda *_: None)
    with pytest.raises(ValueError, match="init_from"):
        train.main(tiny_train_args(data_dir, tmp_path, init_from="gpt2-xl"), log=lambda *_: None)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.main(tiny_train_args(data_dir, tmp_path / "empty", init_from="resume"), log=lambda *_: None)
    with pytest.raises(ValueError, match=r"block_size .* too short for the passkey"):
        train.main(tiny_train_args(data_dir, tmp_path, dataset="passkey", block_size=16), log=lambda *_: None)


def test_passkey_training_runs(tmp_path):
    out = train.main(
        tiny_train_args(
            tmp_path, tmp_path, dataset="passkey", block_size=160, max_iters=4, eval_interval=4, eval_iters=2
        ),
        log=lambda *_: None,
    )
    ev = out["evals"][-1]
    assert 0.0 <= ev["val_digit_acc"] <= 1.0 and 0.0 <= ev["val_key_acc"] <= 1.0
    assert math.isfinite(ev["val"])


def test_recall_training_runs(tmp_path):
    out = train.main(
        tiny_train_args(
            tmp_path,
            tmp_path,
            dataset="recall",
            block_size=128,
            recall_pairs=4,
            recall_queries=16,
            recall_row=4,
            recall_start_len=32,
            segment_lengths="4,16,128",
            dilation_rates="1,2,4",
            max_iters=4,
            eval_interval=2,
            eval_iters=2,
        ),
        log=lambda *_: None,
    )
    assert [e["iter"] for e in out["evals"]] == [0, 2, 4]
    assert all(e["seq_len"] in (32, 64, 128) for e in out["evals"])  # the curriculum's length
    assert out["tokens"] == 4 * (16 * 32)  # 4 steps of batch 16 x 32 tokens (4 x 128)
    assert all(0.0 <= e["val_answer_acc"] <= 1.0 and math.isfinite(e["val"]) for e in out["evals"])
    secs = [e["seconds"] for e in out["evals"]]
    assert secs[0] == 0.0 and secs == sorted(secs) and secs[-1] == out["train_seconds"] > 0
    with pytest.raises(ValueError, match="too short for 4 recall records"):
        train.main(
            tiny_train_args(tmp_path, tmp_path, dataset="recall", block_size=32, recall_pairs=4),
            log=lambda *_: None,
        )


def test_mfu_counts_the_length_each_step_trained_at(tmp_path, monkeypatch):
    """With the recall curriculum the steps run 16 sequences of 32 tokens, not 4 of 128: the MFU
    counts the FLOPs of what ran (dense causal attention is quadratic in the length), so it is
    never above what the step did. Every iteration takes 1 s on a fake clock."""
    clock = {"t": 0.0}
    real_step = train.torch.nn.utils.clip_grad_norm_

    def step(*args, **kwargs):  # called once per iteration, between the clock readings
        clock["t"] += 1.0
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train.time, "time", lambda: clock["t"])
    monkeypatch.setattr(train.torch.nn.utils, "clip_grad_norm_", step)
    lines: list[str] = []
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 128}
    train.main(
        tiny_train_args(
            tmp_path,
            tmp_path,
            dataset="recall",
            recall_pairs=4,
            recall_queries=16,
            recall_row=4,
            recall_start_len=32,
            recall_grow_at=1.0,  # the length stays at 32
            attention_backend="dense",
            max_iters=5,
            eval_interval=100,
            log_interval=4,
            grad_clip=1.0,
            peak_flops=1e9,
            **shape,
        ),
        log=lines.append,
    )
    (line,) = [x for x in lines if x.startswith("iter 4:")]
    mfu = float(line.split("mfu ")[1].split("%")[0]) / 100
    model = GPT(GPTConfig(vocab_size=recall.VOCAB_SIZE, bias=True, attention_backend="dense", **shape))
    L, B, D = 32, 16, 32 // 2
    pairs = 2 * L * (L + 1) // 2  # dense causal, 2 heads
    flops = B * (6 * model.get_num_params() * L + 2 * 3.5 * 4 * D * pairs)  # 2 layers
    assert mfu == pytest.approx(flops / 1e9, rel=1e-3), line


def test_max_minutes_stops_training(data_dir, tmp_path):
    """A wall-time budget ends the run early, with a last evaluation."""
    out = train.main(
        tiny_train_args(data_dir, tmp_path, max_iters=10_000, eval_interval=10_000, max_minutes=0.002),
        log=lambda *_: None,
    )
    assert 1 <= out["iter_num"] < 10_000 and out["train_seconds"] >= 0.12
    assert [e["iter"] for e in out["evals"]] == [0, out["iter_num"]]


def test_longcontext_pipeline(tmp_path):
    """The three attentions train a few steps each; the table, curves and plot are written."""
    args = [
        str(GPT_DIR / "config" / "recall.py"),
        f"--results={tmp_path / 'lc'}",
        "--isolate=false",
        "--block_size=256",
        "--recall_pairs=4",
        "--recall_queries=16",
        "--recall_row=8",
        "--batch_size=2",
        "--n_embd=32",
        "--max_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--max_minutes=5",
    ]
    out = longcontext.run(args)
    rows = {r["attention"]: r for r in out["summary"]}
    assert list(rows) == ["dilated", "local", "dense"]
    assert rows["dilated"]["branches"] == "(8,1) (8,2) (256,4)"
    assert rows["local"]["branches"] == "(8,1) (8,2) (64,2)"
    assert rows["dilated"]["reachable"] == rows["dense"]["reachable"] == 1.0
    assert rows["local"]["reachable"] < 0.6
    assert (
        abs(rows["local"]["pairs_per_token_per_head"] / rows["dilated"]["pairs_per_token_per_head"] - 1) < 0.1
    )
    assert rows["dense"]["pairs_vs_dense"] == 1.0 and rows["dilated"]["pairs_vs_dense"] < 0.5
    for r in rows.values():
        assert r["steps"] == 3 and 0.0 <= r["final_val_answer_acc"] <= 1.0
        assert r["tokens_per_second"] > 0 and r["peak_rss_mib"] > 0
        assert r["side_by_side_tokens_per_second"] > 0
    d = tmp_path / "lc"
    for f in ("curves.csv", "summary.csv", "summary.md", "longcontext.png"):
        assert (d / f).stat().st_size > 0, f
    assert len((d / "curves.csv").read_text().splitlines()) == 1 + 3 * 2  # header, 2 evaluations each
    assert (d / "summary.md").read_text().count("\n") == 2 + 3
    # --variants= with --merge: no training, the table again from the saved results
    again = longcontext.run([*args, "--variants=", "--merge=true", "--throughput_rounds=0"])
    assert [r["attention"] for r in again["summary"]] == ["dilated", "local", "dense"]
    assert [r["final_val_answer_acc"] for r in again["summary"]] == [
        r["final_val_answer_acc"] for r in rows.values()
    ]
    with pytest.raises(ValueError, match="'sparse' is not one of"):
        longcontext.run([*args, "--variants=dilated,sparse"])
    with pytest.raises(ValueError, match="trains the recall task"):
        longcontext.run([*args, "--dataset=passkey"])


def test_auto_dtype_on_cpu():
    assert train.auto_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.skipif(not SLOW, reason="DDP under torchrun: set DILATED_ATTENTION_SLOW=1")
def test_ddp_under_torchrun(data_dir, tmp_path):
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(GPT_DIR / "train.py"),
        # the default gradient_accumulation_steps (1) with 2 processes: one micro-batch each
        *tiny_train_args(data_dir, tmp_path, max_iters=10, eval_interval=10),
    ]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x2" in r.stdout and (tmp_path / "ckpt.pt").exists()


# ---------------------------------------------------------------------------------------------
# Packed documents
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["native", "sdpa", "dense"])
def test_packed_documents_are_attended_alone(backend):
    """Every document of a packed row gives the logits of that document run alone."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_head=4, n_kv_head=2, block_size=48, backend=backend)).double().eval()
    idx = torch.randint(0, 64, (2, 40))
    cuts = {0: [0, 7, 30, 40], 1: [0, 1, 25, 40]}
    starts = torch.zeros(2, 40, dtype=torch.bool)
    for b, c in cuts.items():
        starts[b, c[:-1]] = True
    logits, loss = model(idx, torch.zeros_like(idx), doc_starts=starts)
    assert torch.isfinite(loss)
    for b, c in cuts.items():
        for s, e in itertools.pairwise(c):
            alone = model.forward_all(idx[b : b + 1, s:e])
            torch.testing.assert_close(logits[b : b + 1, s:e], alone, rtol=1e-9, atol=1e-9)


def test_packed_batches(data_dir):
    import numpy as np

    cfg = train.TrainConfig(data_dir=str(data_dir), packed=True, batch_size=6, block_size=128)
    batches = train.Batches(cfg, data_dir / "stdlib", torch.device("cpu"))
    x, y, starts = batches.get("train", torch.Generator().manual_seed(0))
    corpus = np.fromfile(data_dir / "stdlib" / "train.bin", dtype=np.uint8)
    docs = np.load(data_dir / "stdlib" / "train_docs.npy")
    ends = np.append(docs[1:], len(corpus))
    assert starts[:, 0].all() and starts.sum().item() >= 2 * 6  # several documents per row
    raw = corpus.tobytes()
    for b in range(6):
        cuts = [*starts[b].nonzero().squeeze(1).tolist(), 128]
        for s, e in itertools.pairwise(cuts):
            # the piece is a window of one document, its targets the next tokens in that document
            piece = bytes(x[b, s:e].tolist())
            at, found = raw.find(piece), False
            while at >= 0 and not found:
                d = np.searchsorted(docs, at, side="right") - 1
                found = at + (e - s) < ends[d]
                at = raw.find(piece, at + 1)
            assert found, (b, s, e)
            assert torch.equal(y[b, s : e - 1], x[b, s + 1 : e])
            assert y[b, e - 1] == -1  # the boundary target is ignored


def test_packed_training_runs(data_dir, tmp_path):
    out = train.main(tiny_train_args(data_dir, tmp_path, packed=True), log=lambda *_: None)
    losses = [loss for _, loss in out["losses"]]
    assert all(math.isfinite(v) for v in losses)
    assert out["evals"][-1]["val"] < out["evals"][0]["val"] - 1.0, out["evals"]
    with pytest.raises(ValueError, match="packed=True needs a corpus"):
        train.main(tiny_train_args(data_dir, tmp_path, packed=True, dataset="passkey"), log=lambda *_: None)


def test_training_forward_reads_nothing_back_from_the_device():
    """The training forward (no cache) needs no value of a device tensor on the host: on a GPU such a
    read is a synchronisation every step, and under torch.compile a graph break."""
    import torch._dynamo

    model = GPT(tiny_config(backend="native"))
    idx = torch.randint(0, 64, (2, 48))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0, explained.break_reasons
