"""The web page's server side: its files and headers, GET /ui/status, who may see what,
and the chat stream's opt-in `token_sources` (exact: each token tagged by its source)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from engines.token_sources import TARGET, SourcedSpecStats
from server.cli import build_parser
from server.serve import build_config
from server.ui.page import load_static
from tests.clients import forced_scheduler
from tests.conftest import make_client, start_scheduler

ECHO = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"
PROMPT = "def add(a, b):\n    return a + b\n" * 3


@pytest.fixture(scope="module")
def twin_scheduler(tiny_model_dir):
    """The draft is the target itself: greedy drafts are always accepted, so which
    tokens came from the draft model is certain (suffix decoding off: the tests ask
    the same prompt again, which it would draft from the earlier answer)."""
    scheduler = start_scheduler(
        tiny_model_dir, draft_model=str(tiny_model_dir), suffix_tokens_per_key=0
    )
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def echo_scheduler(tiny_model_dir, reference):
    """No draft model; the model is made to write ECHO, which the prompt holds, so
    prompt lookup drafts it and the drafts are accepted."""
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, {"echo": ECHO})


def sse_chunks(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


async def stream_chat(client, content: str, **extra) -> list[dict]:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return sse_chunks(response.text)


def content_of(chunks: list[dict]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )


def sources_of(chunks: list[dict]) -> list[dict]:
    return [entry for c in chunks for entry in c.get("token_sources", [])]


def final_of(chunks: list[dict], key: str) -> dict:
    return next(c[key] for c in chunks if c.get(key) is not None)


# ---- token sources -----------------------------------------------------------------


def test_a_verify_tags_its_accepted_drafts_then_the_target_token():
    spec = SourcedSpecStats()
    spec.sources.add("a")  # a plain step
    spec.record("draft", 3, 2)  # two drafts accepted, then the target's correction
    for text in "bcd":
        spec.sources.add(text)
    spec.record("pld", 4, 0)  # nothing accepted: only the target's token
    spec.sources.add("e")
    tagged = spec.sources.take(5)
    assert tagged == [(TARGET, "a"), ("draft", "b"), ("draft", "c"), (TARGET, "d"), (TARGET, "e")]
    assert spec.sources.take(0) == [] and spec.accepted_tokens == 2


def draft_runs(sources: list[dict], method: str = "draft") -> list[int]:
    """Lengths of the runs of `method`-tagged tokens, in order."""
    tags = "".join("D" if s["source"] == method else "T" for s in sources)
    return [len(run) for run in tags.split("T") if run]


def assert_twin_tags_exact(sources: list[dict], spec: dict) -> None:
    """With the target as its own draft every draft is accepted whole, so each verify
    commits its drafts (tagged "draft") and then the target's bonus token ("target"):
    one run of draft tags per verify, each run but the last (a stop or max_tokens can
    cut it) exactly as long as a draft, the bonus after each; no draft tag elsewhere."""
    runs = draft_runs(sources)
    assert spec["accepted_tokens"] == spec["draft_tokens"] > 0
    assert len(runs) == spec["drafts"]
    assert sum(runs) <= spec["accepted_tokens"]
    lengths = sorted(runs[:-1])
    # accepted_per_position[i]: verifies that accepted more than i drafts
    per_position = spec["accepted_per_position"]
    for i, count in enumerate(per_position):
        full = sum(length > i for length in lengths)
        assert full <= count <= full + 1, (runs, per_position)
    assert {s["source"] for s in sources} <= {"draft", TARGET}


async def test_draft_model_tokens_are_tagged_exactly_and_change_nothing(twin_scheduler):
    async with make_client(twin_scheduler) as client:
        plain = await stream_chat(client, PROMPT, enable_pld=False)
        tagged = await stream_chat(client, PROMPT, enable_pld=False, tandem_token_sources=True)
    assert not any("token_sources" in c for c in plain)
    assert content_of(tagged) == content_of(plain)
    sources = sources_of(tagged)
    usage, spec = final_of(tagged, "usage"), final_of(tagged, "speculation")
    assert len(sources) == usage["completion_tokens"]
    assert "".join(s["text"] for s in sources) == content_of(tagged)
    assert_twin_tags_exact(sources, spec)


async def test_prompt_lookup_tokens_are_tagged_pld(echo_scheduler):
    async with make_client(echo_scheduler) as client:
        chunks = await stream_chat(
            client, f"Repeat: {ECHO} FORCE:echo", max_tokens=64, tandem_token_sources=True
        )
    sources = sources_of(chunks)
    spec = final_of(chunks, "speculation")
    pld = [s for s in sources if s["source"] == "pld"]
    # accepted drafts past the script's end (EOS) are counted but never committed
    assert 5 < len(pld) <= spec["by_method"]["pld"]["accepted_tokens"]
    assert len(draft_runs(sources, "pld")) <= spec["by_method"]["pld"]["drafts"]
    assert {s["source"] for s in sources} == {"pld", TARGET}
    assert "".join(s["text"] for s in sources) == content_of(chunks) == ECHO


async def test_non_streamed_chat_carries_token_sources_only_when_asked(twin_scheduler):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0}
    async with make_client(twin_scheduler) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        asked = await client.post(
            "/v1/chat/completions", json={**body, "tandem_token_sources": True}
        )
        wrong = await client.post(
            "/v1/chat/completions", json={**body, "tandem_token_sources": "yes"}
        )
    assert "token_sources" not in plain
    asked = asked.json()
    sources = asked["token_sources"]
    assert len(sources) == asked["usage"]["completion_tokens"]
    assert "".join(s["text"] for s in sources) == asked["choices"][0]["message"]["content"]
    assert_twin_tags_exact(sources, asked["speculation"])
    assert wrong.status_code == 400 and "tandem_token_sources" in wrong.text


async def test_token_sources_are_exact_inside_a_batch(twin_scheduler):
    """Three streams at once: the batched engine verifies the drafts, and each stream's
    draft-tagged tokens are its own accepted ones."""
    async with make_client(twin_scheduler) as client:
        runs = await asyncio.gather(
            *(
                stream_chat(client, PROMPT + str(i), enable_pld=False, tandem_token_sources=True)
                for i in range(3)
            )
        )
        stats = (await client.get("/v1/stats")).json()
    assert stats["batched_engine_started"]
    for chunks in runs:
        sources = sources_of(chunks)
        spec = final_of(chunks, "speculation")
        assert len(sources) == final_of(chunks, "usage")["completion_tokens"]
        assert_twin_tags_exact(sources, spec)


# ---- the page ----------------------------------------------------------------------


async def test_page_and_files_are_served_with_a_strict_policy(scheduler):
    async with make_client(scheduler) as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "'unsafe-inline'" not in policy
        assert "frame-ancestors 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        html = page.text
        assert "<style" not in html and " style=" not in html
        assert all(src for src in re.findall(r"<script([^>]*)>", html) if "src=" in src)
        assert len(re.findall(r"<script", html)) == len(re.findall(r"<script src=", html))
        assert not re.search(r"https?://", html)
        linked = re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', html)
        assert {"/ui/static/app.js", "/ui/static/app.css"} <= set(linked)
        for path in linked:
            response = await client.get(path)
            assert response.status_code == 200, path
            assert "content-security-policy" in response.headers
        for name in load_static():
            text = (await client.get(f"/ui/static/{name}")).text
            html_sinks = r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|eval\("
            assert not re.search(html_sinks, text), name
            assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
        assert (await client.get("/ui/static/nope.js")).status_code == 404
        assert (await client.get("/ui/static/..%2Fpage.py")).status_code == 404


def test_the_page_is_on_unless_no_ui_is_given():
    def config(*flags: str):
        return build_config(build_parser().parse_args(["serve", "/models/m", *flags]))

    assert config().ui is True
    assert config("--no-ui").ui is False


async def test_no_ui_serves_no_page(scheduler):
    async with make_client(scheduler, ui=False) as client:
        assert (await client.get("/")).status_code == 404
        assert (await client.get("/ui/status")).status_code == 404
        assert (await client.get("/ui/static/app.js")).status_code == 404


async def test_status_reports_the_model_and_live_counters(twin_scheduler):
    async with make_client(twin_scheduler) as client:
        before = (await client.get("/ui/status")).json()
        chunks = await stream_chat(client, PROMPT + " status")
        after = (await client.get("/ui/status")).json()
    assert after["model"] == "tiny" and after["state"] == "ready"
    assert after["engine"] in ("single stream", "batched") and after["blas"]
    assert "cpu" in after["device"].lower() or "gpu" in after["device"].lower()
    completion = final_of(chunks, "usage")["completion_tokens"]
    assert after["tokens"]["generated"] - before["tokens"]["generated"] == completion
    assert after["ttft"]["count"] == before["ttft"]["count"] + 1
    assert after["speculation"]["accepted"] > before["speculation"]["accepted"]
    assert "draft" in after["speculation"]["by_method"]
    assert after["speculation"]["per_position"][0] > 0
    assert after["yours"][0]["id"] == chunks[0]["id"]
    assert after["yours"][0]["completion_tokens"] == completion
    assert "def add" not in json.dumps(after)  # no prompt, no output


async def test_keyed_status_needs_a_key_and_lists_only_its_own_requests(scheduler):
    keys = ("key-alice-0123456789", "key-bob-0123456789ab")
    async with make_client(scheduler, api_keys=keys) as client:
        assert (await client.get("/")).status_code == 200  # the page asks for the key
        assert (await client.get("/ui/static/app.js")).status_code == 200
        assert (await client.get("/ui/status")).status_code == 401
        wrong = await client.get("/ui/status", headers={"Authorization": "Bearer nope-nope"})
        assert wrong.status_code == 401
        alice = {"Authorization": f"Bearer {keys[0]}"}
        bob = {"Authorization": f"Bearer {keys[1]}"}
        body = {"messages": [{"role": "user", "content": "secret plan"}], "max_tokens": 4}
        done = await client.post("/v1/chat/completions", json=body, headers=alice)
        assert done.status_code == 200
        request_id = done.json()["id"]
        seen_by_alice = (await client.get("/ui/status", headers=alice)).json()
        seen_by_bob = (await client.get("/ui/status", headers=bob)).json()
    assert [r["id"] for r in seen_by_alice["yours"]][:1] == [request_id]
    assert request_id not in json.dumps(seen_by_bob)
    for seen in (seen_by_alice, seen_by_bob):
        text = json.dumps(seen)
        assert seen["keys"] is True
        assert "secret plan" not in text and not any(key in text for key in keys)


async def test_status_obeys_the_host_and_cors_rules(scheduler):
    async with make_client(
        scheduler, allowed_hosts=(), allowed_origins=("http://app.example",)
    ) as client:
        for path in ("/", "/ui/status"):
            refused = await client.get(path, headers={"Host": "rebound.example"})
            assert refused.status_code == 421, path
        ok = await client.get(
            "/ui/status", headers={"Host": "127.0.0.1", "Origin": "http://app.example"}
        )
        other = await client.get(
            "/ui/status", headers={"Host": "127.0.0.1", "Origin": "http://evil.example"}
        )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    assert "access-control-allow-origin" not in other.headers
