"""The deployment files in deploy/: they parse, say what the README says, pass their tools'
own checks where the tool is installed (systemd-analyze, promtool), pass their `tandem serve`
arguments through the real CLI parser, and chart only metrics the server exports."""

from __future__ import annotations

import configparser
import fnmatch
import json
import plistlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
README = DEPLOY / "README.md"

# Every metric name the server exports (histograms without their _bucket/_sum/_count
# series). The dashboard may reference only these; cross-check against a live /metrics.
EXPORTED_METRICS = frozenset(
    {
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "tandem_engine_mode",
        "tandem_mode_switches_total",
        "tandem_mode_switch_seconds",
        "tandem_spec_draft_tokens_total",
        "tandem_spec_accepted_tokens_total",
        "tandem_spec_gate_trips_total",
        "tandem_batch_size",
        "tandem_spec_draft_tokens_per_row",
        "tandem_spec_batch_size",
        "tandem_step_model_seconds",
        "tandem_step_overhead_seconds",
        "tandem_memory_bytes",
        "tandem_blas_info",
        "tandem_speculation_supported",
        "tandem_drafter_active",
        "tandem_ranks",
        "tandem_spec_verify_cost_ratio",
        "tandem_spec_draft_step_cost_ratio",
        "tandem_request_errors_total",
        "tandem_client_disconnects_total",
        "tandem_server_tools_not_offered_total",
        "tandem_images_omitted_total",
        "tandem_kv_preemptions_total",
        "tandem_suffix_index",
        "tandem_suffix_evicted_sequences_total",
        "tandem_prefix_cache_hits_total",
        "tandem_prefix_cache_disk_bytes",
        "tandem_prefill_follows_total",
    }
)
HISTOGRAMS = frozenset(
    {
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "tandem_mode_switch_seconds",
        "tandem_batch_size",
        "tandem_spec_draft_tokens_per_row",
        "tandem_spec_batch_size",
        "tandem_step_model_seconds",
        "tandem_step_overhead_seconds",
    }
)
GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "tandem_engine_mode",
        "tandem_memory_bytes",
        "tandem_blas_info",
        "tandem_speculation_supported",
        "tandem_drafter_active",
        "tandem_ranks",
        "tandem_spec_verify_cost_ratio",
        "tandem_spec_draft_step_cost_ratio",
        "tandem_suffix_index",
        "tandem_prefix_cache_disk_bytes",
    }
)
METRIC_RE = re.compile(r"\b(vllm:[a-z0-9_:]+|tandem_[a-z0-9_]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
MODEL_FILTER = 'model_name=~"$model_name"'


def base_metric(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name


def parse_serve_args(argv: list[str]):
    """`tandem serve ARGS` through the real CLI parser; a clear failure on a bad flag."""
    import contextlib
    import io

    from server.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(["serve", *argv])
    except SystemExit:
        pytest.fail(f"`tandem serve {shlex.join(argv)}` is rejected by the CLI:\n{err.getvalue()}")


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def readme_text() -> str:
    return README.read_text()


def readme_commands() -> list[str]:
    """Shell commands from the README's code blocks, continuation lines joined."""
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", readme_text(), flags=re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line.split(" #", 1)[0].strip())
    return commands


# --- launchd ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plist() -> dict:
    with open(DEPLOY / "com.tandem.server.plist", "rb") as f:
        return plistlib.load(f)


def test_plist_runs_tandem_serve_on_loopback_with_a_key_file(plist):
    assert plist["Label"] == "com.tandem.server"
    argv = plist["ProgramArguments"]
    assert argv[0].startswith("/") and Path(argv[0]).name == "tandem"
    assert argv[1] == "serve"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8000"
    assert (flag_value(argv, "--api-key-file") or "").startswith("/usr/local/etc/tandem/")
    assert "--api-key" not in argv, "a key on the command line is visible in ps"


def test_plist_arguments_parse_with_the_cli(plist):
    args = parse_serve_args(plist["ProgramArguments"][2:])
    assert args.model and not args.demo
    assert args.host == "127.0.0.1" and args.port == 8000


def test_plist_lifecycle_keys(plist):
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(plist["ThrottleInterval"], int) and plist["ThrottleInterval"] > 0
    assert plist["ProcessType"] in {"Interactive", "Adaptive"}
    drain = float(flag_value(plist["ProgramArguments"], "--shutdown-timeout") or 30)
    assert plist["ExitTimeOut"] >= 30
    assert plist["ExitTimeOut"] > drain, "launchd would SIGKILL before the drain ends"
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("/usr/local/var/log/tandem/")
    assert plist["StandardOutPath"] != plist["StandardErrorPath"]
    assert plist["EnvironmentVariables"]["HF_HOME"].startswith("/")


# --- systemd ----------------------------------------------------------------------------

UNIT = DEPLOY / "tandem.service"


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def unit_values(key: str) -> list[str]:
    """All values of a (possibly repeated) key in [Service], continuations joined."""
    text = re.sub(r"\\\n\s*", " ", UNIT.read_text())
    section, values = None, []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line.startswith(key + "="):
            values.append(line.split("=", 1)[1].strip())
    return values


def exec_start(unit) -> list[str]:
    return shlex.split(re.sub(r"\\\n\s*", " ", unit["Service"]["ExecStart"]))


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min)?", value.strip())
    assert match, f"unsupported systemd time span: {value!r}"
    return float(match[1]) * (60 if match[2] == "min" else 1)


def test_unit_runs_tandem_serve_from_the_venv(unit):
    assert unit["Service"]["Type"] == "simple"
    argv = exec_start(unit)
    assert argv[0] == "/opt/tandem/.venv/bin/tandem" and argv[1] == "serve"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8000"
    assert flag_value(argv, "--api-key-file") == "/etc/tandem/api-key"
    assert "--api-key" not in argv
    args = parse_serve_args(argv[2:])
    assert args.model and args.host == "127.0.0.1"


def test_unit_restart_and_stop_policy(unit):
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert seconds(service["RestartSec"]) > 0
    assert service["KillSignal"] == "SIGTERM"
    drain = flag_value(exec_start(unit), "--shutdown-timeout")
    assert drain is not None, "ExecStart should state the drain timeout"
    assert seconds(service["TimeoutStopSec"]) > float(drain), "SIGKILL before the drain ends"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_unit_hardening(unit):
    service = unit["Service"]
    assert service["User"] == "tandem" and service["Group"] == "tandem"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
    }.items():
        assert service.get(key) == value, key
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    writable = [p.lstrip("-") for v in unit_values("ReadWritePaths") for p in v.split()]
    assert "/var/lib/tandem" in writable
    env = dict(
        item.split("=", 1) for value in unit_values("Environment") for item in shlex.split(value)
    )
    assert any(env["HF_HOME"].startswith(path + "/") for path in writable), (
        "HF_HOME must be writable under ProtectSystem=strict"
    )


def systemd_verify(path: Path) -> tuple[int, str]:
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # The venv does not exist here: point ExecStart at an executable, keep everything else.
    text = UNIT.read_text().replace("/opt/tandem/.venv/bin/tandem", "/bin/true")
    copy = tmp_path / "tandem.service"
    copy.write_text(text)
    rc, output = systemd_verify(copy)
    assert rc == 0 and not output, output


@needs_systemd_analyze
def test_unit_verify_only_misses_the_venv_binary():
    rc, output = systemd_verify(UNIT)
    binary = "/opt/tandem/.venv/bin/tandem"
    if Path(binary).exists():
        assert rc == 0 and not output, output
        return
    complaints = [line for line in output.splitlines() if line.strip()]
    assert complaints, "systemd-analyze should notice the missing binary"
    for line in complaints:
        assert binary in line and "not executable" in line, output


# --- Docker -----------------------------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{name} ends inside a continuation"
    return instructions


def only(instructions, keyword: str) -> str:
    found = [rest for kw, rest in instructions if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def env_vars(instructions) -> dict[str, str]:
    env = {}
    for kw, rest in instructions:
        if kw == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def apt_packages(instructions) -> set[str]:
    packages = set()
    for kw, rest in instructions:
        if kw != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                packages.update(w for w in words[2:] if not w.startswith("-"))
    return packages


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_entrypoint_and_default_command(name):
    instructions = dockerfile(name)
    assert json.loads(only(instructions, "ENTRYPOINT")) == ["tandem", "serve"]
    cmd = json.loads(only(instructions, "CMD"))
    assert cmd == ["--demo", "--host", "0.0.0.0"]
    args = parse_serve_args(cmd)
    assert args.demo and args.host == "0.0.0.0" and not args.allow_unauthenticated
    assert only(instructions, "EXPOSE") == str(args.port) == "8000"
    user = only(instructions, "USER")
    assert user not in {"root", "0"}
    keywords = [kw for kw, _ in instructions]
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_default_command_needs_a_key(name, monkeypatch):
    """Published on a LAN by mistake, the image must not serve anyone who asks."""
    from server.serve import load_api_keys

    args = parse_serve_args(json.loads(only(dockerfile(name), "CMD")))
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert not load_api_keys(args) and not args.allow_unauthenticated
    monkeypatch.setenv("TANDEM_API_KEY", "a-key-from-the-environment")
    assert load_api_keys(args) == ("a-key-from-the-environment",)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_healthcheck_polls_health(name):
    health = only(dockerfile(name), "HEALTHCHECK")
    options, _, command = health.partition(" CMD ")
    assert "--start-period=" in options
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"]
    assert "urllib" in argv[2] and "http://127.0.0.1:8000/health" in argv[2]
    compile(argv[2], "healthcheck", "exec")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_copies_what_pip_install_needs(name):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = set()
    for kw, rest in dockerfile(name):
        if kw == "COPY":
            *sources, _dest = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the build context"
                copied.add(source.rstrip("/"))
    assert {"pyproject.toml", project["project"]["readme"]} <= copied
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert package in copied, f"package {package} is not copied"
    runs = " && ".join(rest for kw, rest in dockerfile(name) if kw == "RUN")
    assert "pip install ." in runs


def test_cpu_dockerfile_base_and_openblas():
    instructions = dockerfile("Dockerfile")
    assert only(instructions, "FROM") == "python:3.11-slim-bookworm"
    runs = " ".join(rest for kw, rest in instructions if kw == "RUN")
    assert "apt-get install -y --no-install-recommends libopenblas0-pthread" in runs
    assert apt_packages(instructions) == {"libopenblas0-pthread"}
    preload = env_vars(instructions)["LD_PRELOAD"]
    assert preload.startswith("/") and "libopenblas" in preload
    if not preload.startswith("/usr/lib/"):  # a stable link made in a RUN step
        link = re.search(r'ln -s "\$\(ls (\S+) \| head -n 1\)"\s+(\S+)', runs)
        assert link and link[2] == preload, f"nothing creates {preload}"
        pattern = link[1]
    else:
        pattern = preload
    from engines.platform.blas import _OPENBLAS_CANDIDATES

    # The file the image preloads is one the server would find and preload itself.
    assert any(fnmatch.fnmatch(path, pattern) for path in _OPENBLAS_CANDIDATES), pattern


def test_cuda_dockerfile_swaps_the_mlx_backend():
    instructions = dockerfile("Dockerfile.cuda")
    assert only(instructions, "FROM").startswith("nvidia/cuda:")
    runs = " && ".join(rest for kw, rest in instructions if kw == "RUN")
    install, uninstall, cuda = (
        runs.index("pip install ."),
        runs.index("pip uninstall -y mlx-cpu"),
        runs.index('pip install "mlx[cuda'),
    )
    assert install < uninstall < cuda, "mlx-cpu and mlx-cuda must not be installed together"
    assert "CUDA_HOME" in env_vars(instructions)


def test_readme_docker_commands_match_the_dockerfiles():
    text = readme_text()
    commands = readme_commands()
    builds = [shlex.split(c) for c in commands if c.startswith("docker build")]
    assert ["docker", "build", "-f", "deploy/Dockerfile", "-t", "tandem", "."] in builds
    tags = set()
    for argv in builds:
        dockerfile_path = argv[argv.index("-f") + 1]
        assert (ROOT / dockerfile_path).is_file(), dockerfile_path
        assert argv[-1] == ".", "build from the repository root"
        tags.add(argv[argv.index("-t") + 1])
        # The Dockerfile's own header shows the same command.
        assert shlex.join(argv) in (ROOT / dockerfile_path).read_text()
    assert {"tandem", "tandem-cuda"} <= tags
    runs = [shlex.split(c) for c in commands if c.startswith("docker run")]
    assert len(runs) >= 3
    takes_value = {"-p", "-v", "-e", "--name", "--stop-timeout", "--gpus", "--cpus", "--user"}
    for argv in runs:
        i = 2
        while argv[i].startswith("-"):
            i += 2 if argv[i] in takes_value else 1
        image, args = argv[i], argv[i + 1 :]
        assert image in tags, f"docker run of an image the README does not build: {image}"
        assert flag_value(argv, "--stop-timeout") == "35", shlex.join(argv)
        assert "--gpus" in argv if image == "tandem-cuda" else "--gpus" not in argv
        if args:
            parsed = parse_serve_args(args)
            if parsed.host != "127.0.0.1":
                assert "--api-key-file" in args or "--allow-unauthenticated" in args
    # What the image installs and sets, the README explains.
    for package in apt_packages(dockerfile("Dockerfile")):
        assert package in text
    assert "LD_PRELOAD" in text and "OPENBLAS_NUM_THREADS" in text
    assert "untested" in text.lower() and "Dockerfile.cuda" in text


def test_readme_names_every_deploy_file_and_links_resolve():
    text = readme_text()
    for path in DEPLOY.iterdir():
        if path.name != "README.md":
            assert path.name in text, f"deploy/README.md does not mention {path.name}"
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (DEPLOY / target).exists(), target


def test_readme_install_steps():
    text = readme_text()
    for needle in (
        "~/Library/LaunchAgents",
        "/Library/LaunchDaemons",
        "launchctl bootstrap",
        "launchctl bootout",
        "launchctl kickstart",
        "useradd",
        "/opt/tandem/.venv",
        "apt-get install -y --no-install-recommends python3-venv libopenblas0-pthread",
        "chmod 600",
        "systemctl daemon-reload",
        "systemctl enable --now tandem",
        "journalctl -u tandem",
        "pip install mkl",
        "--no-blas-preload",
        "TANDEM_NO_BLAS_PRELOAD=1",
        "--metrics-api-key",
        "--allow-unauthenticated",
        "127.0.0.1",
    ):
        assert needle in text, needle
    # The paths the service files use are the ones the install steps create.
    plist_text = (DEPLOY / "com.tandem.server.plist").read_text()
    for path in ("/usr/local/etc/tandem/api-key", "/usr/local/var/log/tandem"):
        assert path in plist_text and path in text
    unit_text = UNIT.read_text()
    for path in ("/etc/tandem/api-key", "/var/lib/tandem", "/opt/tandem/.venv"):
        assert path in unit_text and path in text


# --- Prometheus -------------------------------------------------------------------------

PROMETHEUS = DEPLOY / "prometheus.yml"


def uncommented_auth(text: str, credentials: Path) -> str:
    """prometheus.yml with its commented bearer-auth example switched on."""
    lines, out = text.splitlines(), []
    for line in lines:
        match = re.match(r"^(\s*)# ?(authorization:|  type:|  credentials_file:)(.*)$", line)
        out.append(f"{match[1]}{match[2]}{match[3]}" if match else line)
    result = "\n".join(out) + "\n"
    return re.sub(r"(credentials_file:\s*)\S+", rf"\g<1>{credentials}", result)


def test_prometheus_scrape_config():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tandem"]
    assert job["metrics_path"] == "/metrics"
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == "5s"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert "authorization" not in job


def test_prometheus_bearer_example_is_valid_yaml(tmp_path):
    yaml = pytest.importorskip("yaml")
    key = tmp_path / "metrics-key"
    config = yaml.safe_load(uncommented_auth(PROMETHEUS.read_text(), key))
    (job,) = config["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(key)}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_prometheus_config_passes_promtool(tmp_path):
    key = tmp_path / "metrics-key"
    key.write_text("secret\n")
    variant = tmp_path / "with-auth.yml"
    variant.write_text(uncommented_auth(PROMETHEUS.read_text(), key))
    for path in (PROMETHEUS, variant):
        proc = subprocess.run(
            ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


# --- Grafana ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana-dashboard.json").read_text())


def all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return panels


def all_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def test_dashboard_shape(dashboard):
    assert dashboard["title"] == "Tandem"
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    charts = [p for p in panels if p["type"] != "row"]
    assert len(charts) >= 20
    assert {p["type"] for p in charts} <= {"timeseries", "stat", "table"}
    for panel in charts:
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    # No two panels overlap on the 24-column grid.
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["includeAll"] and model["allValue"] == ".*"
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    (metric,) = METRIC_RE.findall(query)
    assert metric in EXPORTED_METRICS
    assert [i["name"] for i in dashboard.get("__inputs", [])] in ([], ["DS_PROMETHEUS"])


def test_dashboard_references_only_exported_metrics(dashboard):
    referenced = set()
    for title, expr in all_exprs(dashboard):
        names = METRIC_RE.findall(expr)
        assert names, f"{title}: no metric in {expr}"
        for name in names:
            base = base_metric(name)
            assert base in EXPORTED_METRICS, f"{title}: {name} is not exported"
            if name != base:
                assert name.endswith("_bucket") or "rate(" in expr, (title, name)
            referenced.add(base)
    assert referenced == EXPORTED_METRICS, f"not charted: {EXPORTED_METRICS - referenced}"


def test_dashboard_queries_are_well_formed(dashboard):
    for title, expr in all_exprs(dashboard):
        # Every selector filters on the Model variable.
        for match in METRIC_RE.finditer(expr):
            rest = expr[match.end() :]
            assert rest.startswith("{") and MODEL_FILTER in rest[: rest.index("}")], (
                f"{title}: {match[0]} without {MODEL_FILTER}"
            )
        # rate() over counters and histogram series only, never over a gauge.
        for name in re.findall(r"rate\((\S+?)\{", expr):
            assert name.endswith("_total") or base_metric(name) != name, (title, name)
        for name in METRIC_RE.findall(expr):
            if name in GAUGES:
                assert f"rate({name}" not in expr, (title, name)
        # histogram_quantile over _bucket series aggregated by le.
        for call in re.finditer(r"histogram_quantile\(", expr):
            inner = expr[call.end() :]
            assert re.match(r"0?\.\d+, sum by \(le\b", inner), f"{title}: {expr}"
            assert re.search(r"_bucket\{", inner), f"{title}: {expr}"
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced {expr}"


def test_dashboard_charts_the_requested_views(dashboard):
    exprs = " ".join(expr for _, expr in all_exprs(dashboard))
    for fragment in (
        "rate(vllm:generation_tokens_total{",
        "rate(vllm:prompt_tokens_total{",
        "histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:time_to_first_token",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:inter_token_latency",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:e2e_request_latency",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:request_queue_time",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(tandem_mode_switch_seconds",
        "sum by (method) (rate(tandem_spec_accepted_tokens_total{",
        "sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{",
        "max by (mode) (tandem_engine_mode{",
        "sum by (from, to) (rate(tandem_mode_switches_total{",
        "sum by (gate) (rate(tandem_spec_gate_trips_total{",
        "sum by (kind) (tandem_memory_bytes{",
        "sum by (finished_reason) (rate(vllm:request_success_total{",
        "sum by (kind) (rate(tandem_request_errors_total{",
    ):
        assert fragment in exprs, fragment


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_dashboard_queries_parse_as_promql(dashboard, tmp_path):
    """promtool parses every query (Grafana variables filled in) as a recording rule."""
    yaml = pytest.importorskip("yaml")
    rules = [
        {"record": f"tandem:dashboard_query_{i}", "expr": expr.replace("$model_name", ".*")}
        for i, (_title, expr) in enumerate(all_exprs(dashboard))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
