"""`tandem bench grammar MODEL`: what --tool-call-grammar auto costs per token.

The grammar "free text, or tagged tool calls valid for their tools" is a logits
processor like any constraint. This measures, on the model's real vocabulary:
compiling it (once per request, in the request's worker thread); the processor's own
time per generated token (llguidance's mask plus applying it to the logits), over free
text and inside a tagged call; and greedy decoding with and without it on a tool prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench.models import resolve_model
from engines.sample.constraints import GrammarCompiler

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
FREE_TEXT = "The weather in Paris is usually mild in spring, with rain and sun. " * 4
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QUESTION = "What's the weather in Paris right now? Use the tool."


def many_tools(n: int) -> list[dict]:
    return [{**WEATHER, "name": f"tool_{i}"} for i in range(n - 1)] + [WEATHER]


def compile_ms(compiler: GrammarCompiler, functions: list[dict], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiler.text_or_tool_calls(functions, "<tool_call>", "</tool_call>")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def processor_us(compiler: GrammarCompiler, tokenizer, text: str, vocab: int) -> float:
    """Median time of the processor per token of `text`, the masked logits evaluated,
    less evaluating the same logits untouched."""
    constraint = compiler.text_or_tool_calls([WEATHER], "<tool_call>", "</tool_call>")
    processor = compiler.processor(constraint, 0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    with_grammar, without = [], []
    for step in range(len(ids)):
        history = mx.array(ids[:step])
        start = time.perf_counter()
        mx.eval(processor(history, logits))
        with_grammar.append(time.perf_counter() - start)
        start = time.perf_counter()
        mx.eval(logits + 0)
        without.append(time.perf_counter() - start)
    return (statistics.median(with_grammar) - statistics.median(without)) * 1e6


def decode_ms(model, prompt: list[int], processors: list, tokens: int) -> float:
    """Milliseconds per generated token after the first (prefill excluded)."""
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=tokens,
        sampler=make_sampler(0.0),
        logits_processors=processors,
    )
    stamps = [time.perf_counter() for _ in steps]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench grammar", description=__doc__)
    parser.add_argument("model", help="a model folder, hub id or packaged name")
    parser.add_argument("--tokens", type=int, default=24, help="tokens to decode per run")
    parser.add_argument("--repeats", type=int, default=3, help="decode runs of each kind")
    args = parser.parse_args(argv)
    model, tokenizer = load(resolve_model(args.model))
    compiler = GrammarCompiler(tokenizer)
    vocab = compiler.ll_tokenizer.vocab_size
    print(f"vocabulary: {vocab:,} tokens")
    for n in (1, 8, 32):
        print(f"compile, {n:2d} tools: {compile_ms(compiler, many_tools(n)):7.1f} ms")
    for label, text in (("free text", FREE_TEXT), ("in a call", CALL)):
        cost = processor_us(compiler, tokenizer, text, vocab)
        print(f"processor, {label}: {cost:7.0f} us/token")
    tools = [{"type": "function", "function": WEATHER}]
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    constraint = compiler.text_or_tool_calls([WEATHER], "<tool_call>", "</tool_call>")
    plain, grammar = [], []
    for _ in range(args.repeats):  # alternated, so drift in machine load hits both alike
        plain.append(decode_ms(model, prompt, [], args.tokens))
        processor = compiler.processor(constraint, len(prompt))
        grammar.append(decode_ms(model, prompt, [processor], args.tokens))
    plain_ms, grammar_ms = statistics.median(plain), statistics.median(grammar)
    print(f"decode, no grammar: {plain_ms:7.1f} ms/token (median of {args.repeats} runs)")
    print(f"decode, grammar:    {grammar_ms:7.1f} ms/token ({grammar_ms / plain_ms - 1:+.1%})")
