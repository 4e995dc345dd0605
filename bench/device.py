"""`tandem bench device`: one prepared check of Tandem against mlx_lm.server on a lent GPU.

    tandem bench device [--out DIR] [--dry-run] [--budget-s 480] [--only STAGES]
        [--models-dir DIR] [--print-plan]

Every speed figure so far comes from a 2-core CPU, where a verify of 8 tokens costs
about two plain steps; a GPU machine is lent now and then, for minutes, with no
network. This runs, in one call and one time budget, each stage a subprocess bounded
in time (a slow stage is stopped, the next one runs, the summary says which ran):

  models          random-weight bfloat16 models built on the device (`bench.device_models`)
  verify-*        a verify's cost against a plain step, 1-16 tokens x 1-16 rows
                  (`bench.device_verify`)
  drafters-1b     one proposal of each downloaded-drafter kind (DFlash, EAGLE-3) against a
                  plain step, 1-16 rows (`bench.drafter_cost`)
  single-*        one stream: Tandem's draft model against mlx-lm's
                  `speculative_generate_step` at each fixed k (`tandem bench spec`)
  hybrid-pld-1b   `tandem bench hybrid` with prompt lookup on output that repeats
                  (a looping model), hybrid vs hybrid with drafting off, beside mlx_lm.server
  hybrid-draft-*  `tandem bench hybrid` with the aligned draft, beside mlx_lm.server and
                  mlx_lm.server --draft-model, c = 1, 2, 4, 8, 16
  tests           the greedy-equality suite's speculative and batched tests (pytest)
  hybrid-mtp-1b   the hybrid with its MTP head under load, beside mlx_lm.server

It writes to --out (default $OUT, else ./device-out) at most the eight files the device
tool brings back: summary.txt (what `bench/device_check.sh` prints), device.json
(environment, plan, every stage's status and parsed results), stages.log, hybrid.png,
verify.png and results.tar.gz (every stage's own JSON, PNG, log and junit XML).
`--dry-run` does the same at toy sizes and two concurrency levels on the CPU in about a
minute (tests/test_device_check.py runs it), so the script never rots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.device_report import environment, plot_hybrid, plot_verify, summarise

SPEED_TESTS = (
    "tests/test_speculative.py",
    "tests/test_batched_speculation.py",
    "tests/test_batched_mtp.py",
    "tests/test_batched_hybrid.py",
    "tests/test_rollback.py",
    "tests/test_plain_decoding.py",
)
DRY_TESTS = (
    "tests/test_plain_decoding.py::test_greedy_equals_mlx_lm_generate_step_across_chunked_prefill",
)
MIN_STAGE_S = 15.0  # a stage is not started with less left than this
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sizes:
    """What a profile measures: full on a GPU, dry on this CPU in about a minute."""

    models: str
    concurrency: str
    max_tokens: int
    prompts_per_level: int
    switch_tokens: int
    verify_tokens: str
    verify_rows: str
    verify_context: int
    verify_repeats: int
    spec_limit: int
    spec_max_tokens: int
    peer_ks: str
    large: bool  # the ~8B stages
    tests: tuple[str, ...]


FULL = Sizes(
    "full", "1,2,4,8,16", 64, 1, 96, "1,2,4,8,16", "1,2,4,8,16", 256, 5, 3, 128, "2,3,4,6,8",
    True, SPEED_TESTS,
)  # fmt: skip
DRY = Sizes("dry", "1,2", 8, 1, 12, "1,2,4", "1,2", 16, 1, 1, 12, "2,4", False, DRY_TESTS)


@dataclass
class Stage:
    """One bounded step: its command, the files it writes, and what became of it."""

    name: str
    budget_s: float
    command: list[str]
    outputs: list[str]
    needs: tuple[str, ...] = ()
    status: str = "not run"
    seconds: float = 0.0
    returncode: int | None = None
    log: str = ""
    result: dict | list | None = field(default=None, repr=False)


def plan(sizes: Sizes, models: Path, work: Path) -> list[Stage]:
    """The stages in the order they run, most wanted first, each with its budget (s)."""
    python, tandem = sys.executable, str(Path(sys.executable).parent / "tandem")
    stages = [
        Stage(
            "models",
            150,
            [python, "-m", "bench.device_models", str(models), "--profile", sizes.models],
            [str(models / "models.json")],
        )
    ]
    sizes_to_run = ["1b", "8b"] if sizes.large else ["1b"]
    for size in sizes_to_run:
        target = str(models / f"llama-{size}")
        out = work / f"verify-{size}.json"
        stages.append(
            Stage(
                f"verify-{size}",
                30 if size == "1b" else 45,
                [
                    python,
                    "-m",
                    "bench.device_verify",
                    target,
                    "--tokens",
                    sizes.verify_tokens,
                    "--rows",
                    sizes.verify_rows,
                    "--context",
                    str(sizes.verify_context),
                    "--repeats",
                    str(sizes.verify_repeats),
                    "--json",
                    str(out),
                ],
                [str(out)],
                (f"llama-{size}",),
            )  # fmt: skip
        )
    out = work / "drafters-1b.json"  # each downloaded-drafter kind's proposal vs a step
    stages.append(
        Stage(
            "drafters-1b",
            25,
            [
                python,
                "-m",
                "bench.drafter_cost",
                str(models / "llama-1b"),
                "--rows",
                sizes.verify_rows,
                "--context",
                str(sizes.verify_context),
                "--repeats",
                str(sizes.verify_repeats),
                "--json",
                str(out),
            ],
            [str(out)],
            ("llama-1b",),
        )  # fmt: skip
    )
    for size in sizes_to_run:
        out = work / f"single-{size}.json"
        limit = sizes.spec_limit if size == "1b" else max(1, sizes.spec_limit - 1)
        stages.append(
            Stage(
                f"single-{size}",
                50 if size == "1b" else 75,
                [
                    tandem,
                    "bench",
                    "spec",
                    str(models / f"llama-{size}"),
                    "--draft-model",
                    str(models / f"llama-{size}-draft"),
                    "--sets",
                    "novel",
                    "--limit",
                    str(limit),
                    "--max-tokens",
                    str(sizes.spec_max_tokens),
                    "--configs",
                    "mlx-lm,mlx-lm+draft,plain,draft",
                    "--peer-k",
                    sizes.peer_ks,
                    "--json",
                    str(out),
                ],
                [str(out)],
                (f"llama-{size}", f"llama-{size}-draft"),
            )  # fmt: skip
        )
    stages.append(hybrid_stage("hybrid-pld-1b", 60, sizes, models / "llama-1b-loop", None,
                               "hybrid,hybrid-nodraft", work))  # fmt: skip
    for size in sizes_to_run:
        target, draft = models / f"llama-{size}", models / f"llama-{size}-draft"
        budget = 80 if size == "1b" else 150
        stages.append(hybrid_stage(f"hybrid-draft-{size}", budget, sizes, target, draft,
                                   "hybrid", work))  # fmt: skip
    junit = work / "tests.xml"
    stages.append(
        Stage(
            "tests",
            150,
            [
                python,
                "-m",
                "pytest",
                "-v",
                "--timeout",
                "90",
                "-p",
                "no:cacheprovider",
                *sizes.tests,
                "--junitxml",
                str(junit),
            ],
            [str(junit)],
        )  # fmt: skip
    )
    stages.append(hybrid_stage("hybrid-mtp-1b", 60, sizes, models / "hybrid-mtp-1b", None,
                               "hybrid,batch-only", work))  # fmt: skip
    return stages


def hybrid_stage(
    name: str, budget: float, sizes: Sizes, model: Path, draft: Path | None, modes: str, work: Path
) -> Stage:
    out = work / f"{name}.json"
    tandem = str(Path(sys.executable).parent / "tandem")
    command = [
        tandem, "bench", "hybrid", str(model), *(["--draft-model", str(draft)] if draft else []),
        "--modes", modes, "--concurrency", sizes.concurrency, "--max-tokens",
        str(sizes.max_tokens), "--prompts-per-level", str(sizes.prompts_per_level),
        "--switch-tokens", str(sizes.switch_tokens), "--output", str(out),
        "--plot", str(out.with_suffix(".png")),
    ]  # fmt: skip
    needs = (model.name, *([draft.name] if draft else []))
    return Stage(name, budget, command, [str(out), str(out.with_suffix(".png"))], needs)


def run_stage(stage: Stage, timeout_s: float, log_dir: Path, models: Path) -> None:
    """Run `stage` in its own process group, stopped (the group: servers it started
    too) at `timeout_s`; status, seconds, log and parsed JSON go on the stage."""
    missing = [name for name in stage.needs if not (models / name / "config.json").exists()]
    if missing:
        stage.status = f"skipped: model {', '.join(missing)} not built"
        return
    log = log_dir / f"{stage.name}.log"
    stage.log = str(log)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with log.open("w") as out:
        out.write(f"$ {' '.join(stage.command)}\n")
        out.flush()
        proc = subprocess.Popen(
            stage.command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        try:
            stage.returncode = proc.wait(timeout=timeout_s)
            stage.status = "ok" if stage.returncode == 0 else f"failed (exit {stage.returncode})"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            stage.status = f"timed out after {timeout_s:.0f} s"
    stage.seconds = round(time.monotonic() - started, 1)
    stage.result = read_result(stage)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's whole process group, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_result(stage: Stage) -> dict | list | None:
    """The stage's first output, parsed: JSON, or a pytest junit XML's counts."""
    path = Path(stage.outputs[0])
    if path.suffix == ".xml":
        return junit_counts(path) if path.exists() else verbose_counts(Path(stage.log))
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def verbose_counts(log: Path) -> dict | None:
    """What a pytest -v run stopped before its junit XML had finished: the outcome
    lines it printed (`path::test PASSED  [ 4%]`)."""
    if not log.exists():
        return None
    outcomes = re.findall(
        r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", log.read_text(), re.M
    )
    if not outcomes:
        return None
    count = {
        kind: sum(1 for _, o in outcomes if o == kind) for kind in ("FAILED", "ERROR", "SKIPPED")
    }
    failed = [test for test, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    passed = len(outcomes) - sum(count.values())
    return {
        "tests": len(outcomes),
        "passed": passed,
        "failures": count["FAILED"],
        "errors": count["ERROR"],
        "skipped": count["SKIPPED"],
        "failed": failed,
        "unfinished": True,
    }


def junit_counts(path: Path) -> dict:
    """Tests, failures, errors and skips of a junit XML, and the failed tests' ids."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in
              ("tests", "failures", "errors", "skipped")}  # fmt: skip
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed": failed}  # fmt: skip


def run_plan(stages: list[Stage], budget_s: float, log_dir: Path, models: Path) -> None:
    """Each stage in turn with min(its budget, what is left); none starts with less
    than MIN_STAGE_S left."""
    deadline = time.monotonic() + budget_s
    for stage in stages:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            stage.status = f"skipped: {left:.0f} s of the budget left"
            continue
        print(f"[device] {stage.name}: up to {min(stage.budget_s, left):.0f} s", flush=True)
        run_stage(stage, min(stage.budget_s, left), log_dir, models)
        print(f"[device] {stage.name}: {stage.status} ({stage.seconds} s)", flush=True)


def write_outputs(out: Path, work: Path, stages: list[Stage], report: dict) -> str:
    """The files the device tool brings back (at most 8): summary, JSON, logs, plots,
    and a tarball of every stage's own files."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(report, stages)
    (out / "summary.txt").write_text(summary + "\n")
    (out / "device.json").write_text(json.dumps(report, indent=2, default=str))
    with (out / "stages.log").open("w") as log:
        for stage in stages:
            if stage.log and Path(stage.log).exists():
                text = Path(stage.log).read_text(errors="replace")
                log.write(f"===== {stage.name}: {stage.status}\n{text[-400_000:]}\n")
    for draw, name in ((plot_hybrid, "hybrid.png"), (plot_verify, "verify.png")):
        try:  # a plot that fails must not cost the numbers, written above
            draw(stages, out / name)
        except Exception as error:  # noqa: BLE001
            print(f"[device] no {name}: {error!r}")
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="device-results")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="tandem bench device", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "device-out"))
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--budget-s", type=float, help="all stages together (480; dry 150)")
    parser.add_argument("--only", help="comma-separated stage names (default: all)")
    parser.add_argument("--models-dir", type=Path, help="where models are built (reused)")
    parser.add_argument("--work-dir", type=Path, help="stages' own files (default: a temp dir)")
    parser.add_argument("--print-plan", action="store_true", help="print the stages and exit")
    args = parser.parse_args(argv)

    sizes = DRY if args.dry_run else FULL
    budget = args.budget_s or (150.0 if args.dry_run else 480.0)
    models = args.models_dir or Path("/tmp") / f"tandem-device-models-{sizes.models}"
    if args.work_dir:
        work = args.work_dir.resolve()
    else:
        work = Path("WORK") if args.print_plan else Path(tempfile.mkdtemp(prefix="tandem-device-"))
    stages = plan(sizes, models, work)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {stage.name for stage in stages}
        if unknown:
            parser.error(f"unknown stages {sorted(unknown)}; stages: {[s.name for s in stages]}")
        stages = [stage for stage in stages if stage.name in wanted]
    if args.print_plan:
        for stage in stages:
            print(f"{stage.name} ({stage.budget_s:.0f} s): {' '.join(stage.command)}")
        return {"plan": [asdict(stage) for stage in stages]}
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run_plan(stages, budget, work, models)
    report = {
        "profile": sizes.models,
        "sizes": asdict(sizes),
        "budget_s": budget,
        "seconds": round(time.monotonic() - started, 1),
        "environment": environment(),
        "stages": {stage.name: asdict(stage) for stage in stages},
    }
    summary = write_outputs(args.out, work, stages, report)
    print(summary)
    return report


if __name__ == "__main__":
    main()
