"""Shared fixtures: tiny real models built once per session, a running scheduler,
the ASGI app behind an httpx client, and reference decoding with plain mlx-lm."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engines.gating.measured_costs import CostModel
from engines.model.demo import TinyModelSpec, build_tiny_model
from engines.platform.precision import keep_float32_exact
from scheduler import Scheduler, SchedulerConfig
from server.app import create_app
from server.config import ServerConfig

# As `tandem` does, before the first matrix product (MLX latches the variable then): the
# exactness tests hold on GPUs whose float32 products would otherwise run in TF32.
keep_float32_exact()
# `tandem serve` processes the tests start keep no prefix cache on disk (it would be the
# real ~/.cache, shared across tests); tests of the disk tier give it a tmp_path.
os.environ["TANDEM_PREFIX_CACHE_DISK_GB"] = "0"

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Random 2-layer Llama (hidden 64) with a real BPE tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A smaller random model sharing the target's tokenizer."""
    spec = TinyModelSpec(hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "draft", spec)


@pytest.fixture(scope="session")
def perturbed_draft_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The target with small noise on every layer weight: a well-matched draft whose
    argmax agrees with the target's most of the time, but not always."""
    out = tmp_path_factory.mktemp("models") / "perturbed"
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    weights = mx.load(str(out / "model.safetensors"))
    noise_key = mx.random.key(7)
    perturbed = {}
    for name, value in sorted(weights.items()):
        noise_key, sub = mx.random.split(noise_key)
        if name.startswith("model.layers") and "norm" not in name:
            value = value + 0.02 * value.std() * mx.random.normal(value.shape, key=sub)
        perturbed[name] = value
    mx.save_safetensors(str(out / "model.safetensors"), perturbed)
    return out


@pytest.fixture(scope="session")
def no_template_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its chat template removed."""
    import json

    out = tmp_path_factory.mktemp("models") / "no-template"
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


# SmolLM2-135M-Instruct's template (the demo model's): messages only, no tools section.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A minimal template of our own: user and assistant turns only (system and tool turns,
# tools and calls all dropped).
BARE_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% elif m.role == 'assistant' %}Assistant: {{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def with_chat_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of `model_dir` whose tokenizer has `template` as its chat template."""
    import json

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="session")
def long_context_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with room for 8192 positions: prompts of several thousand tokens,
    replies past 4096."""
    import json

    out = tmp_path_factory.mktemp("models") / "long-context"
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def smollm2_template_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with SmolLM2's chat template, which ignores tools."""
    out = tmp_path_factory.mktemp("models") / "smollm2-template"
    return with_chat_template(tiny_model_dir, out, SMOLLM2_TEMPLATE)


@pytest.fixture(scope="session")
def bare_template_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a minimal template that has no tool section at all."""
    out = tmp_path_factory.mktemp("models") / "bare-template"
    return with_chat_template(tiny_model_dir, out, BARE_TEMPLATE)


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Plain mlx-lm on its own copy of the tiny model: the ground truth."""
    model, tokenizer = load(str(tiny_model_dir))
    return Reference(model, tokenizer)


class Reference:
    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def greedy_tokens(self, prompt_ids: list[int], max_tokens: int, **kwargs) -> list[int]:
        """Exactly `max_tokens` greedy tokens from `mlx_lm.generate_step` (EOS ignored)."""
        steps = generate_step(mx.array(prompt_ids), self.model, max_tokens=max_tokens, **kwargs)
        return [token for token, _ in steps]

    def greedy_until_eos(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        tokens = []
        for token in self.greedy_tokens(prompt_ids, max_tokens):
            tokens.append(token)
            if token in self.tokenizer.eos_token_ids:
                break
        return tokens


def start_scheduler(model_dir: Path, **overrides) -> Scheduler:
    """A running scheduler with a fixed cost model, so gating decisions are repeatable."""
    overrides.setdefault("cost_model", CostModel.assumed(9))
    scheduler = Scheduler(SchedulerConfig(model=str(model_dir), **overrides))
    scheduler.start()
    assert scheduler.wait_loaded(60), scheduler.error
    return scheduler


@pytest.fixture(scope="session")
def scheduler(tiny_model_dir):
    scheduler = start_scheduler(tiny_model_dir)
    yield scheduler
    scheduler.stop()


@pytest.fixture
def follow_scheduler(tiny_model_dir):
    """A scheduler whose requests of one key start from each other's prefill of a prompt
    they share (100 tokens or more): waited for, or copied while it decodes
    (`scheduler/prefill_followers.py`); prompts prefill in 64-token chunks."""
    scheduler = start_scheduler(tiny_model_dir, prefill_step_size=64, prefill_follow_min_tokens=100)
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def spec_scheduler(tiny_model_dir, perturbed_draft_dir):
    """A scheduler whose draft is the perturbed target: speculation with partial
    acceptance on every surface. One per test module, so counters start fresh. Suffix
    decoding is off: the modules ask the same prompts again, which it would draft whole
    from the earlier answers (tests/test_suffix_decoding.py serves it)."""
    scheduler = start_scheduler(
        tiny_model_dir, draft_model=str(perturbed_draft_dir), suffix_tokens_per_key=0
    )
    yield scheduler
    scheduler.stop()


def make_client(scheduler: Scheduler, **config_overrides) -> httpx.AsyncClient:
    config = ServerConfig(
        scheduler=scheduler.config, served_model_name=MODEL_NAME, **config_overrides
    )
    app = create_app(config, scheduler)
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://tandem.test", timeout=60)


@pytest.fixture
async def client(scheduler):
    async with make_client(scheduler) as client:
        yield client
