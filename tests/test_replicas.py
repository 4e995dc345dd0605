"""Two `tandem serve` replicas behind a real nginx running deploy/nginx-replicas.conf, all on
127.0.0.1: load spreads over both and nothing is lost or run twice, streams pass through
unbuffered, a session header keeps a conversation on the replica that caches its prefix,
keys and client addresses reach the replicas, a replica's SIGTERM drains without losing a
request, and a real Prometheus labels every replica (deploy/prometheus-replicas.yml)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.single_stream import free_port
from tests.replica_cluster import (
    AUTH,
    DASHBOARD,
    KEY,
    METRICS_KEY,
    NGINX_CONF,
    PROMETHEUS_CONF,
    REPLICA,
    SESSION,
    SHIPPED_REPLICAS,
    Balancer,
    Cluster,
    Stream,
    address,
    assert_bench_lost_nothing,
    bench_command,
    chat_body,
    metric,
    post_chat,
    running_cluster,
    wait_until,
)
from tests.test_deploy import uncommented_auth
from tests.test_metrics import prometheus_binary
from tests.test_process import ServerProcess


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("nginx")) as running:
        yield running


# --- the shipped files ------------------------------------------------------------------


def test_both_pools_name_the_same_replicas():
    text = NGINX_CONF.read_text()
    pools = dict(re.findall(r"^upstream (\w+) \{\n(.*?)^\}", text, flags=re.S | re.M))
    assert set(pools) == {"tandem_least_conn", "tandem_affinity"}
    assert "least_conn;" in pools["tandem_least_conn"]
    assert "hash $http_x_session_affinity consistent;" in pools["tandem_affinity"]
    servers = {
        name: re.findall(r"^\s*server (.+);", body, flags=re.M) for name, body in pools.items()
    }
    assert servers["tandem_least_conn"] == servers["tandem_affinity"]
    assert [line.split()[0] for line in servers["tandem_affinity"]] == list(SHIPPED_REPLICAS)


def test_replicas_prometheus_config_passes_promtool(tmp_path):
    yaml = pytest.importorskip("yaml")
    promtool = shutil.which("promtool")
    if promtool is None:
        prometheus_binary()  # fails in CI, where .ci/run installs it
        pytest.skip("promtool not installed")
    key = tmp_path / "metrics-key"
    key.write_text(METRICS_KEY + "\n")
    variant = tmp_path / "with-auth.yml"
    variant.write_text(uncommented_auth(PROMETHEUS_CONF.read_text(), key))
    (job,) = yaml.safe_load(variant.read_text())["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(key)}
    for path in (PROMETHEUS_CONF, variant):
        proc = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_live_replica_answers_a_json_503_with_retry_after(tmp_path):
    """Nothing listens on either replica port: nginx's own 502 becomes a 503 in Tandem's
    error shape, which SDKs retry after Retry-After."""
    balancer = Balancer([f"127.0.0.1:{free_port()}" for _ in range(2)], tmp_path / "nginx")
    try:
        balancer.wait_listening()
        for _ in range(2):  # refused twice, then both marked failed: "no live upstreams"
            response = httpx.post(
                f"{balancer.url}/v1/chat/completions", json=chat_body("hi", 4), headers=AUTH
            )
            assert response.status_code == 503, balancer.logs()
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["type"] == "server_unavailable"
    finally:
        balancer.stop()


# --- two replicas behind nginx ----------------------------------------------------------


def test_bench_at_concurrency_8_uses_both_replicas_and_runs_each_request_once(cluster, tmp_path):
    before = [metric(replica, "vllm:request_success_total") for replica in cluster.replicas]
    output = tmp_path / "bench.json"
    proc = subprocess.run(
        bench_command(cluster, output, num_prompts=32, max_tokens=16),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_bench_lost_nothing(output, num_prompts=32, max_tokens=16)
    served = [
        metric(replica, "vllm:request_success_total") - count
        for replica, count in zip(cluster.replicas, before, strict=True)
    ]
    assert all(count > 0 for count in served), served
    assert sum(served) == 32, f"requests run twice or lost: {served}"


def test_stream_events_pass_through_unbuffered(cluster):
    """A stream's first event (the assistant role) reaches the client while its request
    still waits for a slot on the replica: nginx passes each event on as it is written."""
    replica = cluster.replicas[0]
    session = cluster.session_key(replica)
    blockers: list[httpx.Response] = []

    def block() -> None:  # one of the replica's two slots, for a few seconds
        body = chat_body("Once upon a time", 1200, ignore_eos=True)
        url = f"{cluster.url}/v1/chat/completions"
        headers = {**AUTH, SESSION: session}
        blockers.append(httpx.post(url, json=body, headers=headers, timeout=120))

    threads = [threading.Thread(target=block) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_until(lambda: metric(replica, "vllm:num_requests_running") == 2, "both slots busy")
    stream = Stream(cluster, session, max_tokens=8)
    stream.wait_started()
    assert metric(replica, "vllm:num_requests_waiting") == 1, "the stream should be queued"
    assert all(thread.is_alive() for thread in threads), "the first event came too late"
    assert json.loads(stream.events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert stream.finish() == ("length", 8)
    assert stream.replica == address(replica)
    for thread in threads:
        thread.join(120)
    assert [response.status_code for response in blockers] == [200, 200]


def test_session_header_keeps_a_conversation_on_the_replica_that_caches_it(cluster):
    home, other = cluster.replicas

    def turn(messages: list[dict], replica: ServerProcess) -> tuple[int, int, str]:
        """(prompt tokens, cached tokens, reply) of one turn sent with `replica`'s session."""
        client = openai.OpenAI(
            base_url=f"{cluster.url}/v1",
            api_key=KEY,
            default_headers={SESSION: cluster.session_key(replica)},
            max_retries=0,
        )
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=16, temperature=0
        )
        assert raw.headers[REPLICA] == address(replica), "not the session's replica"
        completion = raw.parse()
        usage = completion.usage
        reply = completion.choices[0].message.content
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, reply

    def user(content: str) -> dict:
        return {"role": "user", "content": content}

    def assistant(content: str) -> dict:
        return {"role": "assistant", "content": content}

    # A first message no replica has seen, long enough that reuse cannot be mistaken.
    document = " ".join(uuid.uuid4().hex[:8] for _ in range(60))
    conversation = [user(f"Summarise: {document}")]
    first_prompt, _, reply = turn(conversation, home)
    conversation += [assistant(reply), user("Shorter, please.")]
    second_prompt, cached, reply = turn(conversation, home)
    assert cached >= first_prompt, "the follow-up should reuse the whole first turn"
    # The same follow-up on the replica that never saw this conversation: only the chat
    # template's first few tokens are shared with anything it has cached.
    _, cached_elsewhere, _ = turn(conversation, other)
    assert cached_elsewhere < first_prompt // 4, (cached_elsewhere, first_prompt)
    conversation += [assistant(reply), user("And in one word?")]
    _, cached, _ = turn(conversation, home)
    assert cached >= second_prompt, "the third turn should reuse the whole second one"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="binds 127.0.0.2 and .3")
def test_keys_pass_through_and_replicas_see_each_clients_address(cluster):
    url = cluster.url
    assert httpx.get(f"{url}/v1/models").status_code == 401, "the balancer adds no key"
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).status_code == 200

    def client_at(host: str) -> httpx.Client:
        transport = httpx.HTTPTransport(local_address=host)
        return httpx.Client(transport=transport, base_url=url, timeout=30)

    with client_at("127.0.0.2") as guesser, client_at("127.0.0.3") as neighbour:
        locked_out_by = set()
        for _ in range(40):  # 10 wrong keys lock an address out of a replica
            wrong = {"Authorization": "Bearer wrong-key-0123456789"}
            response = guesser.get("/v1/models", headers=wrong)
            assert response.status_code in (401, 429)
            if response.status_code == 429:
                locked_out_by.add(response.headers[REPLICA])
            if len(locked_out_by) == 2:
                break
        assert locked_out_by == set(cluster.addresses)
        # Only the guesser: the replicas saw each client's address, not the balancer's.
        for _ in range(4):
            assert neighbour.get("/v1/models", headers=AUTH).status_code == 200
        assert guesser.get("/v1/models", headers=AUTH).status_code == 429


def test_bodies_tandem_accepts_pass_and_larger_ones_get_its_413(cluster):
    url, headers = f"{cluster.url}/v1/completions", {**AUTH, "content-type": "application/json"}
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    # 3 MiB: past nginx's in-memory body buffer (1 MiB), within Tandem's 4 MiB.
    padded = body[:-1] + b" " * (3 << 20) + b"}"
    assert httpx.post(url, content=padded, headers=headers, timeout=60).status_code == 200
    # Past Tandem's limit, within nginx's 5 MiB: the replica refuses it.
    refused = httpx.post(url, content=b"{" + b" " * (4 << 20), headers=headers, timeout=60)
    assert refused.status_code == 413 and refused.headers[REPLICA] in cluster.addresses
    assert refused.json()["error"]["code"] == "request_too_large"
    # Past nginx's limit: refused there, in the same shape.
    refused = httpx.post(url, content=b"{" + b" " * (6 << 20), headers=headers, timeout=60)
    assert refused.status_code == 413 and REPLICA not in refused.headers
    assert refused.json()["error"]["code"] == "request_too_large"


def dashboard_replica_queries() -> list[tuple[str, str]]:
    """(title, expr) of every panel in the dashboard's Replicas row."""
    panels, in_row = [], False
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            in_row = panel["title"] == "Replicas"
            panels += panel.get("panels", []) if in_row else []
        elif in_row:
            panels.append(panel)
    return [
        (p["title"], t["expr"].replace("$model_name", ".*")) for p in panels for t in p["targets"]
    ]


def test_prometheus_labels_every_replica_and_the_dashboard_row_sums_them(cluster, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("prometheus binary not installed locally")
    key = tmp_path / "metrics-key"
    key.write_text(METRICS_KEY + "\n")
    text = uncommented_auth(PROMETHEUS_CONF.read_text(), key)
    shipped = json.dumps(list(SHIPPED_REPLICAS))
    assert shipped in text
    text = text.replace(shipped, json.dumps(cluster.addresses))
    text = re.sub(r"scrape_(interval|timeout): \d+s", r"scrape_\1: 1s", text)
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    port = free_port()
    prom = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def query(expr: str) -> list[dict]:
        try:
            answer = httpx.get(
                f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5
            )
            return answer.json()["data"]["result"]
        except (httpx.TransportError, KeyError, ValueError):
            return []

    def replicas_in(expr: str) -> set[str]:
        return {series["metric"].get("replica") for series in query(expr)}

    try:
        # something to count on each replica: a histogram's labelled series exists only
        # once its replica has served a request
        for replica in cluster.replicas:
            assert post_chat(cluster, cluster.session_key(replica)).status_code == 200
        every = set(cluster.addresses)
        wait_until(
            lambda: replicas_in("sum by (replica) (vllm:request_success_total)") == every,
            "Prometheus to label both replicas",
        )
        queries = dashboard_replica_queries()
        assert len(queries) >= 6
        for title, expr in queries:
            if "by (replica)" in expr or "by (le, replica)" in expr:
                wait_until(lambda e=expr: replicas_in(e) == every, f"{title}: {expr}", 15)
            else:  # a sum over the replicas
                wait_until(lambda e=expr: len(query(e)) == 1, f"{title}: {expr}", 15)
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.mark.slow
def test_sigterm_one_replica_mid_load_drains_it_and_loses_nothing(tiny_model_dir, tmp_path):
    """While `tandem bench serve` runs at c=8 through nginx, one replica gets SIGTERM: its
    in-flight streams run to their end, requests sent while it drains and after it exits
    are served by the other replica, and every benchmark request completes."""
    with running_cluster(tiny_model_dir, tmp_path / "nginx") as cluster:
        leaving, staying = cluster.replicas
        session = cluster.session_key(leaving)
        output = tmp_path / "bench.json"
        bench = subprocess.Popen(
            bench_command(cluster, output, num_prompts=96, max_tokens=64),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_until(lambda: metric(leaving, "vllm:num_requests_running") > 0, "load")
            streams = [Stream(cluster, session, max_tokens=1900) for _ in range(2)]
            for stream in streams:
                stream.wait_started()

            leaving.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{leaving.url}/health").status_code == 503, "the drain")
            assert bench.poll() is None, "the benchmark should still be running"
            # While it drains: the session's replica answers 503 and nginx resends to the
            # other; requests without a session go to the other as well.
            first = post_chat(cluster, session)
            assert first.status_code == 200, first.text
            assert first.headers[REPLICA] == f"{address(leaving)}, {address(staying)}"
            with ThreadPoolExecutor(3) as pool:
                sent = [pool.submit(post_chat, cluster, s) for s in (session, None, None)]
            for response in [future.result() for future in sent]:
                assert response.status_code == 200, response.text
                assert response.headers[REPLICA].endswith(address(staying))
            assert leaving.proc.poll() is None, "these requests were meant to meet the drain"

            for stream in streams:
                assert stream.replica == address(leaving)
                assert stream.finish() == ("length", 1900)
            assert leaving.proc.wait(60) == 0
            # After it exits: refused connections, resent to the other replica.
            for response in [post_chat(cluster, session), post_chat(cluster)]:
                assert response.status_code == 200, response.text
                assert response.headers[REPLICA].endswith(address(staying))

            out, _ = bench.communicate(timeout=180)
            assert bench.returncode == 0, out
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
        assert_bench_lost_nothing(output, num_prompts=96, max_tokens=64)
