"""`--peer mlx_lm`: a real `mlx_lm.server` started next to a real `tandem serve` on the
tiny model and loaded by the same harness (rows, ratios, BLAS, plot), and the
best-of-the-peers ratio logic on hand-made numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import hybrid, serve
from bench.peer import compare, comparison_lines, peer_configs, peer_env
from bench.serve_dataset import DATA_DIR
from tests.test_process import BLAS_PRELOAD, env_without, running_server

MAX_TOKENS, PROMPTS = 8, 4


def row(tok_s: float, ttft_ms: float, tokens: int = 32) -> dict:
    return {"output_throughput": tok_s, "p50_ttft_ms": ttft_ms, "total_output_tokens": tokens}


# --- the comparison on hand-made numbers -----------------------------------------------


def test_tandem_is_compared_with_the_faster_peer_at_each_concurrency():
    tandem = {1: row(60.0, 50.0), 2: row(80.0, 100.0), 4: row(90.0, 200.0)}
    peers = {
        "mlx_lm": {1: row(30.0, 40.0), 2: row(100.0, 80.0)},
        "mlx_lm+draft": {1: row(40.0, 100.0), 2: row(50.0, 900.0)},
    }
    comparison = compare(tandem, peers)
    assert list(comparison) == [1, 2]  # no peer ran c=4: nothing to compare
    assert comparison[1]["best_peer"] == "mlx_lm+draft"
    assert comparison[1]["output_throughput_ratio"] == pytest.approx(60 / 40)
    assert comparison[1]["p50_ttft_ratio"] == pytest.approx(50 / 100)
    assert comparison[2]["best_peer"] == "mlx_lm"
    assert comparison[2]["output_throughput_ratio"] == pytest.approx(0.8)
    assert comparison[2]["p50_ttft_ratio"] == pytest.approx(100 / 80)
    assert all(cmp["same_output_tokens"] for cmp in comparison.values())
    lines = comparison_lines("hybrid", comparison, list(peers))
    assert lines[0] == (
        "hybrid / best(mlx_lm, mlx_lm+draft) at c=1: 1.50x tok/s, 0.50x TTFT p50 "
        "(best peer: mlx_lm+draft)"
    )
    assert "UNEQUAL" not in "".join(lines)


def test_a_peer_that_stopped_early_is_flagged_as_unequal_work():
    comparison = compare({1: row(50.0, 10.0, tokens=32)}, {"mlx_lm": {1: row(50.0, 10.0, 27)}})
    assert comparison[1]["same_output_tokens"] is False
    (line,) = comparison_lines("tandem", comparison, ["mlx_lm"])
    assert line.endswith("UNEQUAL WORK: 32 vs 27 output tokens")


def test_missing_latency_gives_no_ratio_rather_than_a_crash():
    comparison = compare({1: row(50.0, None)}, {"mlx_lm": {1: row(25.0, 10.0)}})
    assert comparison[1]["p50_ttft_ratio"] is None
    assert "- TTFT p50" in comparison_lines("t", comparison, ["mlx_lm"])[0]


def test_hybrid_report_lists_peer_rows_their_blas_and_ratios_to_the_best_peer():
    def mode(tok_s: float, ttft: float) -> dict:
        level = {**row(tok_s, ttft), "median_ttft_ms": ttft, "p50_itl_ms": 5.0}
        return {"levels": {1: {**level, "p99_itl_ms": 9.0}}}

    def peer(tok_s: float, ttft: float) -> dict:
        blas = {"blas": "openblas", "library": "/usr/lib/libopenblas.so.0"}
        return {**mode(tok_s, ttft), "blas": blas, "peer": {"command": ["mlx_lm.server"]}}

    results = {
        "model": "m",
        "draft": "d",
        "blas": "openblas",
        "modes": {name: mode(60.0, 50.0) for name in ("hybrid", "batch-only", "spec-only")},
        "peers": {"mlx_lm": peer(30.0, 40.0), "mlx_lm+draft": peer(40.0, 45.0)},
    }
    peer_levels = {name: data["levels"] for name, data in results["peers"].items()}
    results["peer_comparison"] = {
        "hybrid": compare(results["modes"]["hybrid"]["levels"], peer_levels)
    }
    text = hybrid.report(results, [1])
    assert "mlx_lm+draft    1       40.0" in text
    assert "BLAS openblas (/usr/lib/libopenblas.so.0)" in text
    assert "hybrid / best(mlx_lm, mlx_lm+draft) at c=1: 1.50x tok/s" in text


def test_with_a_draft_both_peer_configurations_run():
    assert peer_configs(None) == peer_configs(None, 5)
    assert [c.name for c in peer_configs(None)] == ["mlx_lm"]
    plain, drafting = peer_configs("/d", num_draft_tokens=5)
    assert plain.flags == ()
    assert drafting.flags == ("--draft-model", "/d", "--num-draft-tokens", "5")
    assert peer_configs("/d")[1].flags == ("--draft-model", "/d")


def test_peer_gets_the_fast_blas_tandem_would_preload(monkeypatch):
    import engines.platform.blas

    monkeypatch.setattr(engines.platform.blas, "find_fast_blas", lambda: "/opt/libopenblas.so.0")
    monkeypatch.setattr(engines.platform.blas, "computes_on_cpu", lambda: True)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("TANDEM_NO_BLAS_PRELOAD", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    assert peer_env()["LD_PRELOAD"] == "/opt/libopenblas.so.0:/x/libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libopenblas.so.0")
    assert peer_env()["LD_PRELOAD"] == "/usr/lib/libopenblas.so.0"
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    monkeypatch.setenv("TANDEM_NO_BLAS_PRELOAD", "1")  # tandem serve would not preload
    assert peer_env()["LD_PRELOAD"] == "/x/libfoo.so"
    monkeypatch.delenv("TANDEM_NO_BLAS_PRELOAD")
    monkeypatch.setattr(engines.platform.blas, "computes_on_cpu", lambda: False)  # MLX on a GPU
    assert peer_env()["LD_PRELOAD"] == "/x/libfoo.so"


def test_peer_options_need_a_peer_and_a_peer_needs_its_model():
    with pytest.raises(SystemExit, match="need --peer"):
        serve.settings_from_args(serve.parse_args(["--peer-model", "/m"]))
    with pytest.raises(SystemExit, match="needs --peer-model"):
        serve.settings_from_args(serve.parse_args(["--peer", "mlx_lm"]))


# --- a real mlx_lm.server next to a real tandem serve ----------------------------------


def prompts_without_eos(reference, count: int) -> list[str]:
    """Dataset prompts whose greedy continuation (plain mlx-lm) has no EOS within
    MAX_TOKENS: mlx_lm.server ignores `ignore_eos`, so only these give both servers
    the same work."""
    lines = [
        json.loads(line)
        for name in ("novel", "mixed", "echo")
        for line in (DATA_DIR / f"{name}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    texts = [line["prompt"] for line in lines if "prompt" in line]
    tokenizer = reference.tokenizer
    full = [
        t
        for t in texts
        if len(reference.greedy_until_eos(tokenizer.encode(t), MAX_TOKENS)) == MAX_TOKENS
    ]
    assert len(full) >= count, "too few prompts run to max_tokens on the tiny model"
    return full[:count]


@pytest.fixture(scope="module")
def peer_run(tiny_model_dir, tiny_draft_dir, reference, tmp_path_factory) -> tuple[dict, Path]:
    """`tandem bench serve --peer mlx_lm --peer-model M --peer-draft-model D` at c=1,2."""
    out = tmp_path_factory.mktemp("peer")
    output, plot = out / "tandem.json", out / "tandem.png"
    dataset = out / "prompts.jsonl"
    lines = [json.dumps({"prompt": text}) for text in prompts_without_eos(reference, 2)]
    dataset.write_text("\n".join(lines) + "\n")
    args = [str(tiny_model_dir), "--served-model-name", "tiny"]
    with running_server(args, env_without(*BLAS_PRELOAD)) as server:
        serve.main(
            ["--base-url", server.url, "--concurrency", "1,2", "--num-prompts", str(PROMPTS)]
            + ["--max-tokens", str(MAX_TOKENS), "--dataset", str(dataset)]
            + ["--endpoint", "completions", "--ignore-eos", "--peer", "mlx_lm"]
            + ["--peer-model", str(tiny_model_dir)]
            + ["--peer-draft-model", str(tiny_draft_dir)]
            + ["--output", str(output), "--plot", str(plot)]
        )
    return json.loads(output.read_text()), plot


@pytest.mark.slow
def test_peer_rows_are_measured_like_tandems(peer_run, tiny_model_dir, tiny_draft_dir):
    result, _ = peer_run
    peers = result["peers"]
    assert list(peers) == ["mlx_lm", "mlx_lm+draft"]
    assert peers["mlx_lm"]["peer"]["command"] == ["mlx_lm.server", "--model", str(tiny_model_dir)]
    assert peers["mlx_lm+draft"]["peer"]["command"][-2:] == ["--draft-model", str(tiny_draft_dir)]
    for name, peer in peers.items():
        assert peer["model"] == "default_model"
        assert peer["settings"] == result["settings"] | {"peer": "none"}, name
        assert [level["concurrency"] for level in peer["levels"]] == [1, 2]
        for level in peer["levels"]:
            assert (level["completed"], level["failed"]) == (PROMPTS, 0), level["errors"]
            assert level["usage_reported"] == PROMPTS
            assert level["output_throughput"] > 0
            assert 0 < level["p50_ttft_ms"] <= level["p50_e2el_ms"]
            assert level["total_input_tokens"] > 0


@pytest.mark.slow
def test_both_servers_produced_every_token_so_the_work_is_equal(peer_run):
    result, _ = peer_run
    rows = [result, *result["peers"].values()]
    for level in (level for r in rows for level in r["levels"]):
        assert level["total_output_tokens"] == MAX_TOKENS * PROMPTS
    for comparison in result["peer_comparison"].values():
        assert comparison["same_output_tokens"] is True


@pytest.mark.slow
def test_ratios_are_against_the_better_peer_row(peer_run):
    result, _ = peer_run
    assert sorted(result["peer_comparison"]) == ["1", "2"]
    for level in result["levels"]:
        concurrency = level["concurrency"]
        cmp = result["peer_comparison"][str(concurrency)]
        peer_rows = {
            name: next(r for r in peer["levels"] if r["concurrency"] == concurrency)
            for name, peer in result["peers"].items()
        }
        best = max(peer_rows, key=lambda name: peer_rows[name]["output_throughput"])
        assert cmp["best_peer"] == best
        expected = level["output_throughput"] / peer_rows[best]["output_throughput"]
        assert cmp["output_throughput_ratio"] == pytest.approx(expected)
        assert cmp["p50_ttft_ratio"] > 0


@pytest.mark.slow
def test_peer_runs_on_the_same_blas_as_tandem(peer_run):
    from engines.platform.blas import computes_on_cpu, find_fast_blas

    result, _ = peer_run
    tandem_blas = result["server"]["blas"]["blas"]
    for peer in result["peers"].values():
        assert peer["server"]["blas"]["blas"] == tandem_blas
    if sys.platform.startswith("linux") and not computes_on_cpu():
        assert tandem_blas == "gpu"
    elif sys.platform.startswith("linux") and find_fast_blas() is not None:
        assert tandem_blas in ("openblas", "mkl")


@pytest.mark.slow
def test_plot_draws_a_line_per_server(peer_run):
    from bench.plot import with_peers

    result, plot = peer_run
    assert plot.read_bytes().startswith(b"\x89PNG")
    labels = [label for label, _ in with_peers("tandem", result)]
    assert labels == ["tandem", "tandem: mlx_lm", "tandem: mlx_lm+draft"]


@pytest.mark.slow
def test_bench_hybrid_runs_the_peers_next_to_the_modes(
    tiny_model_dir, perturbed_draft_dir, tmp_path
):
    output = tmp_path / "hybrid.json"
    results = hybrid.main(
        [str(tiny_model_dir), "--draft-model", str(perturbed_draft_dir), "--concurrency", "1,2"]
        + ["--max-tokens", str(MAX_TOKENS), "--prompts-per-level", "2", "--dataset", "novel"]
        + ["--output", str(output), "--modes", "hybrid,hybrid-wait,batch-only,spec-only"]
        + ["--rounds", "2"]
    )
    assert list(results["modes"]) == ["hybrid", "hybrid-wait", "batch-only", "spec-only"]
    for server in [*results["modes"].values(), *results["peers"].values()]:
        rounds = server["rounds_output_throughput"]
        assert all(len(rates) == 2 and min(rates) > 0 for rates in rounds.values())
        for level, row in server["levels"].items():  # the median round, of two the slower
            assert row["output_throughput"] == min(rounds[level])
    assert list(results["peers"]) == ["mlx_lm", "mlx_lm+draft"]
    for peer in results["peers"].values():
        assert set(peer["levels"]) == {1, 2}
        assert all(row["completed"] == 4 and row["failed"] == 0 for row in peer["levels"].values())
        assert peer["blas"]["blas"] == results["blas"]
    assert set(results["peer_comparison"]) == {"hybrid", "hybrid-wait"}
    for comparison in results["peer_comparison"].values():
        assert all(cmp["output_throughput_ratio"] > 0 for cmp in comparison.values())
    assert json.loads(output.read_text())["peer_comparison"]["hybrid"]["1"]["best_peer"]
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
