"""Which fast BLAS the server preloads: apt's OpenBLAS first, else the `mkl` wheel that
the install brings on x86_64 Linux (so a fresh venv without apt is fast too), and
`TANDEM_BLAS=mkl` to prefer MKL."""

from __future__ import annotations

import os
import platform
import sys

import pytest

import engines.platform.blas
from engines.platform.blas import computes_on_cpu, find_fast_blas
from tests.test_process import BLAS_PRELOAD, env_without, running_server

# The mkl wheel is a dependency on x86_64 Linux only, and only MLX's CPU backend uses it
# (on a GPU the server says "BLAS: gpu", tests/test_process.py).
mkl_wheel_in_use = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64")
    or not computes_on_cpu(),
    reason="the mkl wheel serves MLX's CPU backend on x86_64 Linux only",
)


@pytest.fixture
def fake_libraries(tmp_path, monkeypatch):
    """An apt-style OpenBLAS path and a venv whose lib/ holds the MKL wheel's library."""
    openblas = tmp_path / "usr" / "libopenblas.so.0"
    openblas.parent.mkdir()
    mkl = tmp_path / "venv" / "lib" / "libmkl_rt.so.3"
    mkl.parent.mkdir(parents=True)
    monkeypatch.setattr(engines.platform.blas, "_OPENBLAS_CANDIDATES", (str(openblas),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(engines.platform.blas.sysconfig, "get_config_var", lambda name: None)
    monkeypatch.delenv("TANDEM_BLAS", raising=False)
    return openblas, mkl


def test_openblas_first_then_the_mkl_wheel_then_none(fake_libraries):
    openblas, mkl = fake_libraries
    assert find_fast_blas() is None
    mkl.touch()
    assert find_fast_blas() == str(mkl), "without apt's OpenBLAS the wheel's MKL is found"
    openblas.touch()
    assert find_fast_blas() == str(openblas), "OpenBLAS stays preferred where present"
    assert find_fast_blas("mkl") == str(mkl)
    os.environ["TANDEM_BLAS"] = "mkl"
    try:
        assert find_fast_blas() == str(mkl)
    finally:
        del os.environ["TANDEM_BLAS"]


@mkl_wheel_in_use
def test_the_install_brings_mkl_and_the_server_preloads_it(tiny_model_dir):
    """The venv's own MKL (no apt): the server re-execs with it and says so."""
    env = env_without(*BLAS_PRELOAD, TANDEM_BLAS="mkl")
    with running_server([str(tiny_model_dir)], env) as proc:
        line = proc.wait_for_log(r"BLAS: (\w+)")
        assert line.group(1) == "mkl", proc.log()
        assert "libmkl_rt" in proc.log()


@mkl_wheel_in_use
def test_an_in_process_bench_preloads_a_fast_blas_too(tiny_model_dir, tmp_path):
    """`tandem bench draft-ceiling` runs MLX in its own process: started without a
    preload it re-execs with one, as the server does, and its header names it."""
    import json
    import subprocess

    from tests.test_process import TANDEM

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}))
    command = [TANDEM, "bench", "draft-ceiling", str(tiny_model_dir), "--draft-model"]
    command += [str(tiny_model_dir), "--sets", str(prompts), "--max-tokens", "4", "--rounds", "1"]
    env = env_without(*BLAS_PRELOAD, "TANDEM_NO_BLAS_PRELOAD", TANDEM_BLAS="mkl")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "BLAS mkl" in done.stdout.splitlines()[0], done.stdout
