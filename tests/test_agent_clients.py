"""Real coding-agent clients, end to end, against a real Tandem server process.

Claude Code and Codex CLI (npm, installed into .agent-clients/ by .ci/run), the
openai-agents SDK and mini-swe-agent (the `dev` extras) each run one scripted session
against `python -m tests.agent_server` on 127.0.0.1: `tandem serve`'s own config,
app and uvicorn, serving a tiny model forced to call the client's own tools
(tests/agent_clients/scripts.py). The client runs its tool, sends the result back, the
model's final answer arrives, the client exits 0, and the file changed as scripted.
Then Codex and Claude Code wait through a prefill longer than their idle timers (the
first token held on the engine thread), kept alive by the events each one counts.

A missing client fails the test (never a skip) with the command that installs it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.agent_clients.agent_model import build_agent_model
from tests.agent_clients.scripts import ANSWER, CALC, DIV, SEEN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
NODE_BIN = ROOT / ".agent-clients" / "node_modules" / ".bin"
NPM_INSTALL = (
    "npm install --prefix .agent-clients --no-audit --no-fund "
    "@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 (see .ci/run)"
)
MODEL = "tiny"
CLIENT_TIMEOUT = 600  # seconds for one client session (a CPU prefills ~17k tokens first)


def node_client(name: str) -> Path:
    path = NODE_BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: install the agent clients with `{NPM_INSTALL}`")
    return path


def python_client(module: str) -> None:
    try:
        __import__(module)
    except ImportError as error:
        pytest.fail(f"{module} is missing ({error}): `pip install -e '.[dev]'`")


class TandemProcess:
    """The launcher in a subprocess: its port, its log, stopped by PID."""

    def __init__(self, command: list[str], log_path: Path, port: int | None = None) -> None:
        """`port`: where `command` listens; None: it prints "PORT <n>" (the launcher)."""
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.url = f"http://127.0.0.1:{port or self.read_port(120)}"
        self.wait_healthy(300)

    def read_port(self, timeout: float) -> int:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            pytest.fail(f"agent server printed no port in {timeout}s:\n{self.log_text()}")
        assert line.startswith("PORT "), line + self.log_text()
        return int(line.split()[1])

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"agent server not healthy in {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-6000:]

    def request_lines(self, surface: str, since: int) -> list[str]:
        """The server's per-request log lines for `surface`, from character `since`."""
        text = self.log_path.read_text()[since:]
        return [line for line in text.splitlines() if f"surface={surface} " in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("agent-work")


def agent_server(model_dir: Path, workdir: Path, log: str) -> TandemProcess:
    """`tests.agent_server` serving `model_dir` with the clients' scripts for `workdir`."""
    command = [sys.executable, "-m", "tests.agent_server", str(workdir), "--seconds", "3000"]
    command += ["--", str(model_dir), "--served-model-name", MODEL]
    return TandemProcess(command, workdir / log)


@pytest.fixture(scope="module")
def tandem(tmp_path_factory, workdir):
    server = agent_server(
        build_agent_model(tmp_path_factory.mktemp("models") / "agent"), workdir, "tandem.log"
    )
    yield server
    server.stop()


def project(workdir: Path, name: str) -> Path:
    """The client's folder, holding calc.py as the scripts expect it."""
    folder = workdir / name
    folder.mkdir()
    (folder / "calc.py").write_text(CALC)
    return folder


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment a client runs in: its own HOME, no keys or proxies from ours."""
    home.mkdir(exist_ok=True)
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    return {**env, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def run_client(
    command: list[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float = CLIENT_TIMEOUT,
    watch: Callable[[], str | None] | None = None,
) -> subprocess.CompletedProcess:
    """Run a client in its own process group; on timeout, or when `watch` (asked every
    few seconds) names a failure, kill that group and fail."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            out, err = proc.communicate(timeout=5)
            return subprocess.CompletedProcess(command, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            failure = watch() if watch else None
            if failure is None and time.monotonic() < deadline:
                continue
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        why = failure or f"ran over {timeout}s"
        pytest.fail(f"{command[0]}: {why}\nstdout:\n{out}\nstderr:\n{err}")


def claude_env(home: Path, url: str) -> dict[str, str]:
    return client_env(
        home,
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="test",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        IS_SANDBOX="1",  # --dangerously-skip-permissions is refused to root otherwise
    )


def codex_env(workdir: Path, url: str, provider_extra: str = "") -> dict[str, str]:
    """A CODEX_HOME under `workdir` whose provider is Tandem's Responses API."""
    home = workdir / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tandem"\n\n'
        '[model_providers.tandem]\nname = "Tandem"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "TANDEM_API_KEY"\n'
        + provider_extra
    )
    return client_env(home, CODEX_HOME=str(home), TANDEM_API_KEY="test")


def codex_command() -> list[str]:
    prompt = "Add a function div(a, b) to calc.py. FORCE:agent-codex"
    codex = node_client("codex")
    return [
        str(codex),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        prompt,
    ]


def claude_command(
    prompt: str = "Add a function div(a, b) to calc.py. FORCE:agent-claude",
) -> list[str]:
    return [
        str(node_client("claude")),
        "-p",
        prompt,
        "--model",
        MODEL,
        "--dangerously-skip-permissions",
    ]


def assert_edited(result: subprocess.CompletedProcess, folder: Path, tandem: TandemProcess) -> str:
    """The session ended well: exit 0, the scripted answer printed, calc.py edited.
    Returns the report later assertions print."""
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\nserver:\n{tandem.log_text()}"
    assert result.returncode == 0, report
    assert ANSWER in result.stdout, report
    assert (folder / "calc.py").read_text() == CALC + DIV, report
    return report


def cached_tokens(line: str) -> int:
    return int(line.split(" cached=")[1].split()[0])


def test_claude_code_edits_a_file(tandem, workdir):
    folder = project(workdir, "claude")
    since = len(tandem.log_path.read_text())
    env = claude_env(workdir / "claude-home", tandem.url)
    result = run_client(claude_command(), folder, env)
    report = assert_edited(result, folder, tandem)
    # Read, Edit, answer: three requests, the later ones served mostly from the prefix cache.
    turns = tandem.request_lines("messages", since)
    assert len(turns) == 3, report
    assert all(cached_tokens(line) > 10000 for line in turns[1:]), turns


@pytest.fixture(scope="module")
def vision_tandem(tmp_path_factory, workdir):
    """The agent server with a vision-language model of the agent model's size."""
    from tests.agent_clients.agent_model import build_agent_vision_model

    model_dir = build_agent_vision_model(tmp_path_factory.mktemp("models") / "agent-vision")
    server = agent_server(model_dir, workdir, "tandem-vision.log")
    yield server
    server.stop()


def test_claude_code_reads_a_screenshot_that_reaches_the_model(vision_tandem, workdir):
    """Claude Code's Read tool returns a PNG as an image block in its tool result; with a
    vision model served, the image's tokens are in the next request's prompt."""
    from tests.vlm_models import png

    folder = workdir / "claude-image"
    folder.mkdir()
    (folder / "shot.png").write_bytes(png(20, (64, 96)))
    env = claude_env(workdir / "claude-image-home", vision_tandem.url)
    command = claude_command("Describe shot.png. FORCE:agent-claude-image")
    result = run_client(command, folder, env)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{vision_tandem.log_text()}"
    assert result.returncode == 0, report
    assert SEEN in result.stdout, report
    turns = vision_tandem.request_lines("messages", 0)
    assert len(turns) == 2, report
    assert "images=" not in turns[0] and " images=1" in turns[1], turns
    assert cached_tokens(turns[1]) > 10000, turns  # the conversation before the image


def test_claude_code_recognises_a_prompt_too_long_for_the_context(tiny_model_dir, workdir):
    """Claude Code's first request (~17k tokens of system prompt and tools) overflows the
    tiny model's 2048: the refusal is worded as Anthropic's ("prompt is too long: N tokens
    > M maximum"), so Claude Code reads it as an overflow (its own message with both
    counts, where it would compact a longer conversation) and not as an API error."""
    from tests.test_process import env_without, running_server

    args = [str(tiny_model_dir), "--served-model-name", MODEL]
    with running_server(args, env_without()) as server:
        folder = project(workdir, "claude-overflow")
        env = claude_env(workdir / "claude-overflow-home", server.url)
        result = run_client(claude_command(), folder, env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Prompt is too long" in output and "(limit 2048)" in output, output
    assert "API Error" not in output, output


def test_codex_edits_a_file(tandem, workdir):
    folder = project(workdir, "codex")
    since = len(tandem.log_path.read_text())
    result = run_client(codex_command(), folder, codex_env(workdir, tandem.url))
    report = assert_edited(result, folder, tandem)
    turns = tandem.request_lines("responses", since)
    assert len(turns) == 2, report
    assert cached_tokens(turns[1]) > 5000, turns


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_openai_agents_sdk_tool_round_trip_streamed(tandem, api):
    python_client("agents")
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=f"{tandem.url}/v1", api_key="test", max_retries=0)
    kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="Use the tools.",
        tools=[get_weather],
        model=kind(model=MODEL, openai_client=client),
    )
    result = Runner.run_streamed(agent, "What is the weather in Paris? FORCE:agent-sdk")
    items = []
    async for event in result.stream_events():
        if event.type == "run_item_stream_event":
            items.append(event.item.type)
    assert calls == ["Paris"]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert result.final_output == "It is sunny in Paris."


def test_mini_swe_agent_completes_a_step(tandem, workdir):
    python_client("minisweagent")
    folder = project(workdir, "mini")
    trajectory = workdir / "mini-trajectory.json"
    env = client_env(
        workdir / "mini-home",
        OPENAI_API_KEY="test",
        MSWEA_CONFIGURED="true",
        MSWEA_COST_TRACKING="ignore_errors",  # a local model has no price
    )
    prompt = "Add a function div(a, b) to calc.py. FORCE:agent-mini"
    command = [sys.executable, "-m", "minisweagent", "-m", f"openai/{MODEL}", "-t", prompt]
    command += ["--yolo", "--exit-immediately", "-o", str(trajectory), "-c", "mini.yaml"]
    command += ["-c", f"model.model_kwargs.api_base={tandem.url}/v1"]
    result = run_client(command, folder, env)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\nserver:\n{tandem.log_text()}"
    assert result.returncode == 0, report
    assert (folder / "calc.py").read_text() == CALC + DIV, report
    info = json.loads(trajectory.read_text())["info"]
    assert info["exit_status"] == "Submitted", info
    assert info["model_stats"]["api_calls"] == 2, info


@pytest.fixture(scope="module")
def slow_tandem(tmp_path_factory):
    """The launcher whose first request's first token takes `HELD` seconds (a long
    prefill, as a client sees it), sending keep-alives every `KEEPALIVE` seconds."""

    def start(held: float, keepalive: float) -> TandemProcess:
        workdir = tmp_path_factory.mktemp("slow-agent-work")
        model_dir = build_agent_model(tmp_path_factory.mktemp("models") / "slow-agent")
        command = [sys.executable, "-m", "tests.agent_server", str(workdir)]
        command += ["--seconds", "1500", "--hold-first-token", str(held), "--", str(model_dir)]
        command += ["--served-model-name", MODEL, "--stream-keepalive", str(keepalive)]
        server = TandemProcess(command, workdir / "tandem.log")
        server.workdir = workdir  # the scripts' tool calls edit files under it
        return server

    started: list[TandemProcess] = []
    yield lambda held, keepalive: started.append(start(held, keepalive)) or started[-1]
    for server in started:
        server.stop()


def test_codex_waits_through_a_long_prefill(slow_tandem):
    """Codex's idle timer (here 3 s) counts events, not SSE comments: the server's
    response.in_progress keep-alives carry it through an 8 s prefill without a retry."""
    tandem = slow_tandem(held=8, keepalive=1)
    folder = project(tandem.workdir, "codex")
    idle = "stream_idle_timeout_ms = 3000\nstream_max_retries = 0\n"
    result = run_client(codex_command(), folder, codex_env(tandem.workdir, tandem.url, idle))
    report = assert_edited(result, folder, tandem)
    assert len(tandem.request_lines("responses", 0)) == 2, report  # no retry


@pytest.mark.timeout(1200)
def test_claude_code_waits_through_a_prefill_longer_than_its_watchdog(slow_tandem):
    """Claude Code aborts and re-sends a stream that brings no event but ping for 300 s
    (its SDK drops pings): it cancelled an 18.8k-token Qwen2.5-Coder prefill after 8.5
    minutes. The usage-only message_delta keep-alives carry it through 320 s."""
    tandem = slow_tandem(held=320, keepalive=10)
    folder = project(tandem.workdir, "claude")
    env = claude_env(tandem.workdir / "claude-home", tandem.url)

    def resent() -> str | None:
        cancelled = [x for x in tandem.request_lines("messages", 0) if "cancelled" in x]
        return f"Claude Code gave up and re-sent:\n{cancelled[0]}" if cancelled else None

    result = run_client(claude_command(), folder, env, 900, watch=resent)
    report = assert_edited(result, folder, tandem)
    assert len(tandem.request_lines("messages", 0)) == 3, report  # Read, Edit, answer
