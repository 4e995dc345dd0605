"""`tandem bench prefill-sharing MODEL`: does a decoding stream keep getting tokens while
another request's long prompt prefills (issue 42, "prefill that shares the machine")?

Against a real `tandem serve MODEL` on 127.0.0.1 (prefix cache on disk off, every long
prompt unique so the prefix cache cannot serve it):

1. the long prompt alone (max_tokens 1, streaming): its time to first token;
2. a greedy stream (short prompt, `ignore_eos`) decodes; after its first few chunks the
   long prompt (another one) arrives: its time to first token beside the stream, and the
   stream's gaps between SSE chunks before, during and after that prefill (chunk arrival
   gaps: a speculating engine may send several tokens in one chunk);
3. after the server stopped, in this process: mlx-lm's `generate_step` time to first
   token of the same long prompt at several `prefill_step_size`s, beside Tandem's lone one.

The issue's targets: the stream's largest gap <= 3x its median, the shared time to first
token <= 1.3x the lone one, the lone one no slower than mlx-lm's best chunk size.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVED = "bench"
STREAM_PROMPT = "Count from one to ten thousand in words, one number a line:\none\ntwo\nthree\n"
STEP_SIZES = (256, 512, 1024, 2048)
# files whose text makes the long prompts: prose, code and config, in this order
CORPUS = ("README.md", "docs/design.md", "engines", "scheduler", "server", "bench")


@dataclass(frozen=True)
class Settings:
    model: str
    model_name: str
    prompt_tokens: int
    before_chunks: int  # stream chunks before the long prompt is sent
    after_chunks: int  # stream chunks read after the long prompt's first token
    step_sizes: tuple[int, ...]
    output: Path | None
    text_output: Path | None


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(prog="tandem bench prefill-sharing", description=__doc__)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--short", action="store_true", help="the tiny model, a short run")
    parser.add_argument("--prompt-tokens", type=int, default=2600)
    parser.add_argument("--before-chunks", type=int, default=10)
    parser.add_argument("--after-chunks", type=int, default=20)
    parser.add_argument("--step-sizes", default=",".join(map(str, STEP_SIZES)))
    parser.add_argument("--output", type=Path, help="the result as JSON")
    parser.add_argument("--text-output", type=Path, help="the printed report, also to a file")
    args = parser.parse_args(argv)
    name = "agent-tiny" if args.short else args.model
    from bench.agent import resolve

    return Settings(
        model=resolve(name),
        model_name=name,
        prompt_tokens=args.prompt_tokens,
        before_chunks=args.before_chunks,
        after_chunks=args.after_chunks,
        step_sizes=tuple(int(s) for s in args.step_sizes.split(",")),
        output=args.output,
        text_output=args.text_output,
    )


# --- prompts ----------------------------------------------------------------------------


def corpus_text() -> str:
    """Varied text (this repository's prose, code and configs), the same every run."""
    parts = []
    for name in CORPUS:
        path = ROOT / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        parts += [f.read_text(errors="replace") for f in files if f.is_file()]
    return "\n\n".join(parts)


def long_prompt(tokenizer, corpus: str, phase: int, tokens: int) -> list[int]:
    """`tokens` ids: a tag unique to this run and phase first (so no cached prefix
    matches), then the corpus from a phase's own offset."""
    start = (phase * 40_000) % max(1, len(corpus) - 200_000)
    tag = f"Request {phase}, run {time.time_ns()}: read this and summarise it.\n\n"
    ids = tokenizer.encode(tag + corpus[start : start + tokens * 8])
    if len(ids) < tokens:
        raise SystemExit(f"the corpus gave {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


# --- the server side --------------------------------------------------------------------


@dataclass
class StreamLog:
    """SSE chunk arrival times of the decoding stream (monotonic seconds), and each
    chunk's text."""

    arrivals: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    finish: str | None = None


def completion_body(prompt: Any, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    return {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
    }


def chunks(response: httpx.Response):
    """Each SSE data event's JSON that carries a choice (keep-alive comments skipped)."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if event.get("choices"):
            yield event


def first_token_s(base: str, ids: list[int]) -> float:
    """Time from sending `ids` (max_tokens 1, streaming) to its first chunk."""
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=completion_body(ids, 1), timeout=900
    ) as response:
        response.raise_for_status()
        for _ in chunks(response):
            return time.monotonic() - started
    raise RuntimeError("the long prompt's stream ended without a token")


def run_stream(base: str, max_tokens: int, log: StreamLog) -> None:
    """The decoding stream, read until `log.stop` (the connection then closes: the
    server cancels it) or its end."""
    body = completion_body(STREAM_PROMPT, max_tokens, ignore_eos=True)
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=900) as response:
            response.raise_for_status()
            for event in chunks(response):
                log.arrivals.append(time.monotonic())
                log.texts.append(event["choices"][0].get("text") or "")
                log.started.set()
                log.finish = event["choices"][0].get("finish_reason") or log.finish
                if log.stop.is_set():
                    return
    except Exception as error:  # reported, not raised: the thread's end is the result
        log.error = f"{type(error).__name__}: {error}"
    finally:
        log.started.set()


def shared_phase(
    base: str, ids: list[int], settings: Settings, count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    """The stream decodes; after `before_chunks` of it the long prompt arrives.
    `count_tokens`: the model tokenizer's count of a text (the stream's tokens a second
    in each window, since one chunk may carry several tokens)."""
    log = StreamLog()
    thread = threading.Thread(target=run_stream, args=(base, 4096, log), daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while len(log.arrivals) < settings.before_chunks and thread.is_alive():
        if time.monotonic() > deadline:
            raise SystemExit("the stream gave no tokens in 600 s")
        time.sleep(0.005)
    sent = time.monotonic()
    ttft = first_token_s(base, ids)
    first = sent + ttft
    while len([t for t in log.arrivals if t > first]) < settings.after_chunks:
        if not thread.is_alive() or time.monotonic() > first + 600:
            break
        time.sleep(0.005)
    log.stop.set()
    thread.join(60)
    arrivals = list(log.arrivals)
    figures = gap_figures(arrivals, sent, first)
    figures["tokens_per_s"] = window_rates(arrivals, list(log.texts), sent, first, count_tokens)
    # each chunk's arrival, seconds from when the long prompt was sent
    figures["arrivals_s"] = [round(t - sent, 4) for t in arrivals]
    return {"ttft_s": ttft, **figures, "error": log.error}


def gap_figures(arrivals: list[float], sent: float, first: float) -> dict[str, Any]:
    """The stream's chunk gaps (its first chunk, its own prefill, left out): before the
    long prompt was sent, overlapping its prefill, after its first token."""
    gaps = [(a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]

    def median(selected: list[tuple[float, float]]) -> float | None:
        return statistics.median(b - a for a, b in selected) if selected else None

    before = [(a, b) for a, b in gaps if b <= sent]
    during = [(a, b) for a, b in gaps if b > sent and a < first]
    after = [(a, b) for a, b in gaps if a >= first]
    largest = max((b - a for a, b in gaps), default=None)
    overall, undisturbed = median(gaps), median(before + after)
    return {
        "chunks": len(arrivals),
        "chunks_during_prefill": len([t for t in arrivals if sent < t <= first]),
        "gaps": {"before": len(before), "during": len(during), "after": len(after)},
        "median_gap_s": {
            "all": overall,
            "before": median(before),
            "during": median(during),
            "after": median(after),
            "undisturbed": undisturbed,
        },
        "largest_gap_s": largest,
        "largest_during_s": max((b - a for a, b in during), default=None),
        "largest_over_median": largest / overall if largest and overall else None,
        # against the stream's own pace without a prefill beside it (before and after)
        "largest_over_undisturbed": largest / undisturbed if largest and undisturbed else None,
    }


def window_rates(
    arrivals: list[float],
    texts: list[str],
    sent: float,
    first: float,
    count_tokens: Callable[[str], int],
) -> dict[str, float | None]:
    """The stream's tokens a second before the long prompt was sent, during its prefill
    and after its first token: the tokens of the chunks that arrived in the window (the
    text re-tokenized as a whole) over the time from the chunk before them to the last."""

    def rate(low: float, high: float) -> float | None:
        inside = [i for i, t in enumerate(arrivals) if low < t <= high and i > 0]
        if not inside:
            return None
        seconds = arrivals[inside[-1]] - arrivals[inside[0] - 1]
        text = "".join(texts[i] for i in inside)
        return count_tokens(text) / seconds if seconds > 0 else None

    return {
        "before": rate(float("-inf"), sent),
        "during": rate(sent, first),
        "after": rate(first, float("inf")),
    }


def measure_server(
    settings: Settings, prompts: list[list[int]], count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    from bench.agent import start_tandem
    from bench.blas_probe import server_blas
    from bench.single_stream import free_port, stop_server

    port = free_port()
    tandem = str(Path(sys.executable).parent / "tandem")
    flags = ["--prefix-cache-disk-gb", "0"]
    command = [tandem, "serve", settings.model, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", SERVED, "--log-level", "warning", *flags]
    log = Path(tempfile.gettempdir()) / f"tandem-bench-prefill-sharing-{port}.log"
    proc = start_tandem(command, port, log)
    try:
        base = f"http://127.0.0.1:{port}"
        # first-call costs (allocation, a first long forward) are no phase's: a short
        # request and a shorter long prompt first
        httpx.post(f"{base}/v1/completions", json={**completion_body("hi", 2), "stream": False})
        first_token_s(base, prompts[0])
        alone = first_token_s(base, prompts[1])
        shared = shared_phase(base, prompts[2], settings, count_tokens)
        blas = server_blas(base, None)
    finally:
        stop_server(proc)
    from scheduler.config import SchedulerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    return {
        "command": ["tandem", "serve", settings.model, *flags],
        # the engine's prefill chunk (no flag sets it): alone, and the ceiling beside
        # decoding rows, where the pacer sizes it by time
        "prefill_step_size": defaults["prefill_step_size"],
        "batch_prefill_step_size": defaults["batch_prefill_step_size"],
        "blas": blas,
        "alone_ttft_s": alone,
        "shared": shared,
        "shared_over_alone": shared["ttft_s"] / alone,
    }


# --- mlx-lm in this process ---------------------------------------------------------------


def measure_mlx_lm(settings: Settings, ids: list[int]) -> dict[str, Any]:
    """`generate_step`'s time to its first token of `ids` at each prefill step size."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from engines.platform.blas import describe_blas

    model, _ = load(settings.model)
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})

    def ttft(prompt: list[int], step: int) -> float:
        started = time.monotonic()
        next(generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=step))
        return time.monotonic() - started

    ttft(ids[:64], 64)  # first-call costs
    by_step = {step: ttft(ids, step) for step in settings.step_sizes}
    best = min(by_step, key=by_step.get)
    return {
        "dtype": dtypes,
        "device": str(mx.default_device()),
        "blas": describe_blas(),
        "ttft_s_by_step": by_step,
        "best_step": best,
        "best_ttft_s": by_step[best],
    }


# --- the report ---------------------------------------------------------------------------


def fmt(value: float | None, unit: str = "s", scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.3f}{unit}" if unit else f"{value:.2f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "NOT met"


def report_text(result: dict[str, Any]) -> str:
    server, mlx, s = result["tandem"], result["mlx_lm"], result["settings"]
    shared = server["shared"]
    med, ratio = shared["median_gap_s"], shared["largest_over_median"]
    ratio_undisturbed = shared["largest_over_undisturbed"]
    lone_vs_mlx = result["lone_over_mlx_best"]
    lines = [
        f"tandem bench prefill-sharing  {result['date']}",
        f"model: {result['model']['name']} ({result['model']['path']})",
        f"dtype: {', '.join(mlx['dtype'])}  device: {mlx['device']}",
        f"BLAS: server {server['blas'].get('blas')}, this process (mlx-lm) {mlx['blas']}",
        f"machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in result['load_average_start'])} (start), "
        f"{' '.join(f'{x:.2f}' for x in result['load_average_end'])} (end)",
        f"server: {' '.join(server['command'])} (defaults otherwise: prefill chunk "
        f"{server['prefill_step_size']} alone, at most {server['batch_prefill_step_size']} "
        "beside decoding rows, sized by time)",
        f"long prompt: {s['prompt_tokens']} tokens of varied text, unique per phase, "
        "max_tokens 1, streamed /v1/completions (token ids)",
        f"stream: {s['stream_prompt_tokens']}-token prompt, greedy, ignore_eos; long prompt "
        f"sent after {s['before_chunks']} chunks; gaps are SSE chunk arrival gaps",
        "",
        "1. long prompt alone",
        f"   time to first token: {fmt(server['alone_ttft_s'])}",
        "2. long prompt while the stream decodes",
        f"   time to first token: {fmt(shared['ttft_s'])}  "
        f"(shared / alone {server['shared_over_alone']:.2f})",
        f"   stream chunks: {shared['chunks']} read, {shared['chunks_during_prefill']} arrived "
        f"during the prefill; gaps before/during/after: {shared['gaps']['before']}/"
        f"{shared['gaps']['during']}/{shared['gaps']['after']}",
        f"   stream median gap: all {fmt(med['all'], 'ms', 1000)}, before "
        f"{fmt(med['before'], 'ms', 1000)}, during {fmt(med['during'], 'ms', 1000)}, after "
        f"{fmt(med['after'], 'ms', 1000)}, before and after {fmt(med['undisturbed'], 'ms', 1000)}",
        "   stream tokens/s: "
        + ", ".join(f"{k} {fmt(v, '')}" for k, v in shared["tokens_per_s"].items())
        + " (a chunk may carry several tokens)",
        f"   stream largest gap: {fmt(shared['largest_gap_s'], 'ms', 1000)} (during the "
        f"prefill {fmt(shared['largest_during_s'], 'ms', 1000)}); largest / median "
        f"{fmt(ratio, '')}, / median before and after {fmt(ratio_undisturbed, '')}",
    ]
    if shared["error"]:
        lines.append(f"   stream error: {shared['error']}")
    steps = "  ".join(f"{k}: {fmt(v)}" for k, v in mlx["ttft_s_by_step"].items())
    lines += [
        "3. mlx-lm generate_step, same long prompt, in this process (server stopped)",
        f"   time to first token by prefill_step_size: {steps}",
        f"   best: {mlx['best_step']} at {fmt(mlx['best_ttft_s'])}; Tandem alone "
        f"{fmt(server['alone_ttft_s'])} (Tandem / mlx-lm best {lone_vs_mlx:.2f})",
        "",
        "targets (issue 42):",
        f"   stream largest gap <= 3x its median (all gaps): {fmt(ratio, '')}x  "
        f"{verdict(_le(ratio, 3.0))}",
        f"   stream largest gap <= 3x its median without a prefill beside it (before and "
        f"after): {fmt(ratio_undisturbed, '')}x  {verdict(_le(ratio_undisturbed, 3.0))}",
        f"   shared TTFT <= 1.3x alone: {server['shared_over_alone']:.2f}x  "
        f"{verdict(server['shared_over_alone'] <= 1.3)}",
        f"   lone TTFT <= mlx-lm best: {lone_vs_mlx:.2f}x  {verdict(lone_vs_mlx <= 1.0)}",
    ]
    return "\n".join(lines)


def _le(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def main(argv: list[str]) -> None:
    # SIGTERM (`timeout`, a CI's cancel) unwinds like Ctrl-C, so the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = parse_args(argv)
    load_start = os.getloadavg()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    corpus = corpus_text()
    warm = long_prompt(tokenizer, corpus, 0, min(512, settings.prompt_tokens))
    prompts = [warm, *(long_prompt(tokenizer, corpus, p, settings.prompt_tokens) for p in (1, 2))]

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    server = measure_server(settings, prompts, count_tokens)
    mlx = measure_mlx_lm(settings, prompts[1])
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "model": {"name": settings.model_name, "path": settings.model},
        "settings": {
            "prompt_tokens": settings.prompt_tokens,
            "stream_prompt_tokens": len(tokenizer.encode(STREAM_PROMPT)),
            "before_chunks": settings.before_chunks,
            "after_chunks": settings.after_chunks,
            "step_sizes": list(settings.step_sizes),
        },
        "tandem": server,
        "mlx_lm": mlx,
        "lone_over_mlx_best": server["alone_ttft_s"] / mlx["best_ttft_s"],
    }
    text = report_text(result)
    print(text)
    if settings.text_output:
        settings.text_output.write_text(text + "\n")
    if settings.output:
        settings.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
