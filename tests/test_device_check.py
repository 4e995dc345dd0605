"""The prepared GPU check (`bench/device_check.sh`, `tandem bench device`) keeps working.

No GPU here: the script's dry run builds toy models and runs the real stages -- the
verify grid, `tandem bench spec` against mlx-lm's speculation, `tandem bench hybrid`
against a real mlx_lm.server, pytest -- on the CPU, through the script itself, and the
files it leaves in $OUT are what a device call would bring back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench.device import Stage, run_stage
from bench.device_wheels import file_parts, sha256, stage

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_check.sh"
BROUGHT_BACK = {"summary.txt", "device.json", "stages.log", "hybrid.png", "verify.png",
                "results.tar.gz", "run.log"}  # fmt: skip


def run_script(tmp_path: Path, *args: str, timeout: float) -> tuple[Path, dict, str]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE_PYTHON": sys.executable}
    command = ["bash", str(SCRIPT), "--dry-run", "--models-dir", str(tmp_path / "models"),
               "--work-dir", str(tmp_path / "work"), *args]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "device.json").read_text()), done.stdout


def check_brought_back(out: Path) -> None:
    """What the device tool returns: at most 8 plain files, plainly named, none deep."""
    files = sorted(p.name for p in out.iterdir())
    assert set(files) == BROUGHT_BACK and len(files) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files)
    assert all((out / name).stat().st_size < 16 * 2**20 for name in files)


@pytest.mark.slow
def test_dry_run_measures_every_kind_of_stage_against_mlx_lm(tmp_path):
    started = time.monotonic()
    stages = "models,verify-1b,drafters-1b,single-1b,hybrid-draft-1b,tests"
    out, report, stdout = run_script(tmp_path, "--only", stages, timeout=240)
    check_brought_back(out)
    ran = report["stages"]
    assert {name: s["status"] for name, s in ran.items()} == dict.fromkeys(stages.split(","), "ok")

    models = ran["models"]["result"]["parameters"]
    assert {"llama-1b", "llama-1b-draft", "llama-1b-loop", "hybrid-mtp-1b"} <= set(models)
    assert models["llama-1b-draft"] < models["llama-1b"]

    cells = ran["verify-1b"]["result"]["cells"]
    assert {(c["rows"], c["tokens"]) for c in cells} == {(b, t) for b in (1, 2) for t in (1, 2, 4)}
    one = next(c for c in cells if c["rows"] == 1 and c["tokens"] == 1)
    assert one["vs_plain_step"] == 1.0 and all(c["ms"] > 0 for c in cells)

    drafters = ran["drafters-1b"]["result"]
    assert drafters["kinds"] == ["dflash", "eagle3"]
    assert [row["rows"] for row in drafters["rows"]] == [1, 2]
    assert all(row[kind] > 0 for row in drafters["rows"] for kind in ("target", *drafters["kinds"]))

    novel = ran["single-1b"]["result"]["novel"]
    assert {"mlx-lm", "mlx-lm+draft k=2", "mlx-lm+draft k=4", "plain", "draft"} <= set(novel)
    assert all(row["greedy_mismatches"] == 0 for row in novel.values())
    assert sum(novel["draft"]["accepted"].values()) > 0  # the aligned draft is accepted

    hybrid = ran["hybrid-draft-1b"]["result"]
    assert set(hybrid["peers"]) == {"mlx_lm", "mlx_lm+draft"}
    comparison = hybrid["peer_comparison"]["hybrid"]
    assert sorted(comparison) == ["1", "2"]
    assert all(level["same_output_tokens"] for level in comparison.values())  # no EOS
    assert ran["tests"]["result"]["passed"] == 1 and not ran["tests"]["result"]["failed"]

    summary = (out / "summary.txt").read_text()
    assert summary in stdout
    for line in ("models           ok", "hybrid-draft-1b  ok", "mlx-lm+draft at its best",
                 "hybrid / ", "1 passed, 0 failed"):  # fmt: skip
        assert line in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("hybrid-draft-1b.json") for n in names)
    assert any(n.endswith("tests.xml") for n in names)
    assert time.monotonic() - started < 240


@pytest.mark.slow
def test_whole_dry_run_runs_every_stage_within_its_budget(tmp_path):
    out, report, _ = run_script(tmp_path, "--budget-s", "400", timeout=600)
    check_brought_back(out)
    statuses = {name: s["status"] for name, s in report["stages"].items()}
    assert statuses == dict.fromkeys(
        ["models", "verify-1b", "drafters-1b", "single-1b", "hybrid-pld-1b", "hybrid-draft-1b",
         "tests", "hybrid-mtp-1b"], "ok")  # fmt: skip
    assert report["stages"]["hybrid-mtp-1b"]["result"]["modes"]["hybrid"]["levels"]


def test_full_plan_measures_what_the_issue_asks_for():
    done = subprocess.run(
        [sys.executable, "-m", "bench.device", "--print-plan", "--models-dir", "/m"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )  # fmt: skip
    plan = dict(line.split(" (", 1) for line in done.stdout.splitlines())
    assert list(plan) == ["models", "verify-1b", "verify-8b", "drafters-1b", "single-1b",
                          "single-8b",
                          "hybrid-pld-1b", "hybrid-draft-1b", "hybrid-draft-8b", "tests",
                          "hybrid-mtp-1b"]  # fmt: skip
    assert "--profile full" in plan["models"]
    assert "--tokens 1,2,4,8,16 --rows 1,2,4,8,16" in plan["verify-8b"]
    assert (
        "--draft-model /m/llama-8b-draft" in plan["single-8b"] and "--peer-k" in plan["single-8b"]
    )
    for name in ("hybrid-pld-1b", "hybrid-draft-1b", "hybrid-draft-8b"):
        assert "--concurrency 1,2,4,8,16" in plan[name]
    assert (
        "/m/llama-1b-loop" in plan["hybrid-pld-1b"] and "--draft-model" not in plan["hybrid-pld-1b"]
    )
    assert "tests/test_batched_speculation.py" in plan["tests"]


def test_a_stage_past_its_time_is_stopped_with_what_it_started(tmp_path):
    (tmp_path / "m" / "here").mkdir(parents=True)
    (tmp_path / "m" / "here" / "config.json").write_text("{}")
    child = tmp_path / "child.pid"
    sleeper = (
        "import subprocess, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(child)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)"
    )
    slow = Stage(
        "slow", 2, [sys.executable, "-c", sleeper], [str(tmp_path / "none.json")], ("here",)
    )
    started = time.monotonic()
    run_stage(slow, 2, tmp_path, tmp_path / "m")
    assert slow.status == "timed out after 2 s" and time.monotonic() - started < 15
    pid = int(child.read_text())
    time.sleep(0.5)
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )
    missing = Stage("later", 60, ["true"], [str(tmp_path / "x.json")], ("absent",))
    run_stage(missing, 60, tmp_path, tmp_path / "m")
    assert missing.status == "skipped: model absent not built"


def test_wheels_travel_in_parts_and_join_only_when_all_are_there(tmp_path, capsys):
    wheels = tmp_path / "download"
    wheels.mkdir()
    sizes = {"big-1.0-py3-none-any.whl": 2_500_000, "small-1.0-py3-none-any.whl": 300_000,
             "tiny-1.0-py3-none-any.whl": 20_000}  # fmt: skip
    for name, size in sizes.items():
        (wheels / name).write_bytes(os.urandom(size))
    parts = file_parts(sorted(wheels.iterdir()), tmp_path / "carried", 1_000_000)
    assert len(parts) == 3
    assert all(sum(f.stat().st_size for f in p.iterdir() if f.suffix != ".json") <= 1_000_000
               for p in parts)  # fmt: skip
    device = tmp_path / "device"
    for number, part in enumerate(parts, start=1):  # one device call per part
        call = tmp_path / f"call{number}"
        (call / part.name).mkdir(parents=True)
        for item in part.iterdir():
            (call / part.name / item.name).write_bytes(item.read_bytes())
        complete = stage(call, device)
        assert complete == (number == len(parts))
        if not complete:
            waiting = ", ".join(f"p{n}" for n in range(number + 1, len(parts) + 1))
            assert f"waiting for part(s) {waiting} of 3" in capsys.readouterr().out
    for name in sizes:
        assert sha256(device / "wheels" / name) == sha256(wheels / name)


def test_tests_stopped_at_their_time_limit_still_count_what_finished(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_some.py").write_text(
        "import time\n"
        "def test_one(): pass\n"
        "def test_two(): assert False\n"
        "def test_three(): time.sleep(60)\n"
    )
    junit = tmp_path / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_some.py"),
               "--junitxml", str(junit)]  # fmt: skip
    tests = Stage("tests", 8, command, [str(junit)])
    run_stage(tests, 8, tmp_path, tmp_path)
    assert tests.status == "timed out after 8 s" and not junit.exists()
    result = tests.result
    assert (result["tests"], result["passed"], result["failures"]) == (2, 1, 1)
    assert result["unfinished"] and result["failed"][0].endswith("test_some.py::test_two")
