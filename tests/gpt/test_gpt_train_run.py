"""The example's training script as a user meets it: device errors, what resume shows and refuses,
the MFU peak measured once, and progress lines averaged over a window."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gpt_example import data_dir, one_thread, tiny_train_args, train  # noqa: F401  (fixtures)


def _run(args: list[str]) -> tuple[dict, list[str]]:
    lines: list[str] = []
    return train.main(args, log=lines.append), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(data_dir, tmp_path):  # noqa: F811  (the fixture)
    with pytest.raises(
        ValueError, match=r"'cuda' was asked for, but CUDA is not available here.*--device=cpu"
    ):
        train.main(tiny_train_args(data_dir, tmp_path, device="cuda"), log=lambda *_: None)


def test_resume_shows_the_real_shape_and_refuses_another_pattern(data_dir, tmp_path):  # noqa: F811
    common = {"max_iters": 2, "eval_interval": 2, "always_save_checkpoint": True}
    _run(tiny_train_args(data_dir, tmp_path, **common))
    # The config says 3 layers and 4 heads; the checkpoint has 2 and 2: the log shows the model's.
    out, lines = _run(
        tiny_train_args(data_dir, tmp_path, init_from="resume", n_layer=3, n_head=4, max_iters=3)
    )
    (model_line,) = [line for line in lines if line.startswith("model ")]
    assert "2 layers, 2 heads, 32 dims, block 64" in model_line, model_line
    assert out["iter_num"] == 3
    with pytest.raises(ValueError, match=r"segment_lengths=\[16, 64\], dilation_rates=\[1, 2\] differ"):
        _run(
            tiny_train_args(
                data_dir, tmp_path, init_from="resume", segment_lengths="16,64", dilation_rates="1,2"
            )
        )
    with pytest.raises(ValueError, match="trained with dilated attention, the config asks for dense"):
        _run(tiny_train_args(data_dir, tmp_path, init_from="resume", attention_backend="dense"))
    # Another backend computes the same function: allowed.
    _run(tiny_train_args(data_dir, tmp_path, init_from="resume", attention_backend="sdpa", max_iters=4))


def test_mfu_peak_is_measured_once_and_kept_on_resume(data_dir, tmp_path):  # noqa: F811
    common = {"max_iters": 2, "eval_interval": 2, "always_save_checkpoint": True, "peak_flops": 0}
    _, lines = _run(tiny_train_args(data_dir, tmp_path, **common))
    first = re.search(r"MFU peak ([0-9.]+) TFLOP/s per device \((.*)\)", "\n".join(lines))
    assert first and "measured (at the start" in first.group(2)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["peak_flops"] > 0 and f"{saved['peak_flops'] / 1e12:.3f}" == first.group(1)
    _, lines = _run(tiny_train_args(data_dir, tmp_path, **{**common, "max_iters": 3}, init_from="resume"))
    again = re.search(r"MFU peak ([0-9.]+) TFLOP/s per device \((.*)\)", "\n".join(lines))
    assert again and again.group(1) == first.group(1) and "kept in the checkpoint" in again.group(2)


def test_a_peak_measured_too_low_is_measured_again(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """A peak measured while the machine was busy is below what the training then reaches: the
    first progress line that would print an MFU above 100% measures the peak again, and no line
    prints more than 100%."""
    monkeypatch.setattr(train, "peak_flops", lambda *a: (1e3, "float32 1024x1024 matmul measured (busy)"))
    monkeypatch.setattr(train, "measure_peak", lambda *a: 1e15)
    _, lines = _run(tiny_train_args(data_dir, tmp_path, max_iters=9, eval_interval=100, log_interval=4))
    assert any(line.startswith("MFU peak measured again: 1000.000 TFLOP/s") for line in lines), lines
    mfus = [float(m) for m in re.findall(r"mfu ([0-9.]+)%", "\n".join(lines))]
    assert mfus and max(mfus) <= 100, lines


def test_progress_lines_average_over_the_window(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """Every iteration takes 1 s on a fake clock except one that takes 7 s: the line after it
    reports the mean over the window since the previous line, not the last iteration alone."""
    clock = {"t": 0.0, "calls": 0}
    real_step = train.torch.nn.utils.clip_grad_norm_

    def slow_step(*args, **kwargs):  # called once per iteration, between the clock readings
        clock["calls"] += 1
        clock["t"] += 7.0 if clock["calls"] == 5 else 1.0
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train.time, "time", lambda: clock["t"])
    monkeypatch.setattr(train.torch.nn.utils, "clip_grad_norm_", slow_step)
    _, lines = _run(
        tiny_train_args(data_dir, tmp_path, max_iters=9, eval_interval=100, log_interval=4, peak_flops=1e12)
    )
    progress = [line for line in lines if line.startswith("iter ")]
    assert [line.split(":")[0] for line in progress] == ["iter 0", "iter 4", "iter 8"]
    assert "-- ms/iter | -- tok/s | mfu --" in progress[0]  # iteration 0 warms up, untimed
    # iterations 2..4 (iterations 0 and 1 warm up): 1 s, 1 s, 7 s -> 3 s each on average
    assert "3000 ms/iter" in progress[1], progress[1]
    tokens_per_iter = 4 * 64
    assert f"{tokens_per_iter / 3.0:,.0f} tok/s" in progress[1]
    assert "1000 ms/iter" in progress[2], progress[2]  # iterations 5..8


def test_resume_keeps_the_checkpoints_block_size(data_dir, tmp_path):  # noqa: F811
    """A block_size other than the checkpoint's is one of the shape keys resume takes from the
    checkpoint: a note says so, and the run trains at the checkpoint's length."""
    _run(tiny_train_args(data_dir, tmp_path, max_iters=2, eval_interval=2, always_save_checkpoint=True))
    out, lines = _run(tiny_train_args(data_dir, tmp_path, init_from="resume", block_size=128, max_iters=3))
    assert "resume: block_size = 64 from the checkpoint (config said 128)" in lines, lines
    (model_line,) = [line for line in lines if line.startswith("model ")]
    assert "block 64" in model_line, model_line
    assert out["iter_num"] == 3 and out["evals"][-1]["seq_len"] == 64
    assert out["config"].block_size == 64


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--beta1=-1", r"beta1 must be in \[0, 1\), got -1"),
        ("--beta2=1.5", r"beta2 must be in \[0, 1\), got 1.5"),
        ("--learning_rate=nan", r"--learning_rate=nan: learning_rate must be a finite float, got 'nan'"),
        ("--max_minutes=inf", r"--max_minutes=inf: max_minutes must be a finite float, got 'inf'"),
        ("--weight_decay=1e999", r"weight_decay must be a finite float, got '1e999'"),
        ("--dropout=1.5", r"dropout must be in \[0, 1\), got 1.5"),
        ("--n_layer=0", r"n_layer must be a positive int, got 0"),
        ("--n_head=3", r"n_embd \(128\) must be a multiple of n_head \(3\)"),
        ("--device=banana", r"device must be .* got 'banana'"),
        ("-x", r"unknown option '-x'"),
    ],
)
def test_bad_values_are_config_errors_that_name_the_key(arg, message):
    with pytest.raises(train.configurator.ConfigError, match=message):
        train.parse_config([arg])


def test_a_float_key_from_a_config_file_must_be_finite(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("beta1 = float('nan')\n")
    with pytest.raises(train.configurator.ConfigError, match=r"beta1 must be a finite number, got nan"):
        train.parse_config([str(f)])


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_lists_every_key_with_its_default(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_config(["--batch_size=3", flag])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: train.py")
    defaults = train.TrainConfig()
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        assert f"--{f.name}={shown} " in text, f.name
    assert "--beta1=0.9 " in text and "--segment_lengths=64,128,256 " in text


def test_command_line_exit_status():
    """As a command: --help exits 0, a bad value exits 2 with one error line and no traceback."""
    script = str(Path(train.__file__))
    ok = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--learning_rate=0.002" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, script, "--beta2=1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == "train.py: error: beta2 must be in [0, 1), got 1.5"
