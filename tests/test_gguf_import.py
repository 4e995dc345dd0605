"""GGUF import: a GGUF written from the tiny llama model (q/k permuted as llama.cpp
stores them, one tensor quantized to Q8_0, the tokenizer and chat template in the
metadata) imports into a folder that mlx-lm loads and that computes what the
original computes; unsupported files are refused with a message that says why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from engines.model.gguf_import import GGUFImportError, import_gguf
from tests.test_process import TANDEM, env_without, running_server

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
QUANTIZED = "mlp.down_proj.weight"  # stored as Q8_0, to go through dequantization


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to llama q/k rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, *rest = name.split(".")
    part, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def write_gguf(model_dir: Path, out: Path, architecture: str = "llama") -> dict[str, np.ndarray]:
    """A GGUF of the model in `model_dir`; returns the weights it stores, as the
    importer should read them back (Q8_0 round trip included)."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), architecture)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    tokens = [added.get(i, token) for i, (token, _) in enumerate(vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    writer.add_add_bos_token(True)  # the tiny tokenizer starts every text with <s>
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    stored = {}
    for name, value in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        array = np.array(value.astype(mx.float32))
        if name.endswith(QUANTIZED):
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            array = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = array
            continue
        stored[name] = array
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(tiny_model_dir, path)


def test_an_imported_gguf_computes_what_the_original_computes(tiny_gguf, tiny_model_dir, tmp_path):
    path, stored = tiny_gguf
    folder = import_gguf(path, tmp_path / "cache", dtype="float32")
    imported, imported_tokenizer = load(str(folder))
    original, tokenizer = load(str(tiny_model_dir))
    original.load_weights([(name, mx.array(value)) for name, value in stored.items()])
    text = "Once upon a time <|im_start|> there was a robot"
    ids = tokenizer.encode(text)
    assert imported_tokenizer.encode(text) == ids
    messages = [{"role": "user", "content": "hi"}]
    assert imported_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = mx.array(ids)[None]
    assert mx.allclose(imported(tokens), original(tokens), atol=1e-4).item()


def test_a_second_import_reuses_the_folder(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    first = import_gguf(path, tmp_path, dtype="float32")
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(path, tmp_path, dtype="float32") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert import_gguf(path, tmp_path, dtype="float16") != first  # dtype is part of the key


def test_unsupported_architectures_and_broken_files_are_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other.gguf"
    write_gguf(tiny_model_dir, other, architecture="gemma3")
    refusal = r"'gemma3' is not supported; supported: llama, qwen2"
    with pytest.raises(GGUFImportError, match=refusal):
        import_gguf(other, tmp_path / "cache")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(GGUFImportError, match="not a readable GGUF"):
        import_gguf(broken, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*/tandem_gguf.json")), "no half-imported folder"


def test_tandem_serve_takes_a_gguf_file(tiny_gguf, tmp_path):
    """`tandem serve FILE.gguf` imports the file into the cache and serves it under
    the file's stem."""
    path, _ = tiny_gguf
    with running_server([str(path)], env_without(XDG_CACHE_HOME=str(tmp_path))) as proc:
        response = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        models = httpx.get(f"{proc.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
    assert list((tmp_path / "tandem" / "gguf").glob("*-float32/tandem_gguf.json"))


def test_tandem_convert_writes_a_folder_mlx_lm_loads(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "converted"
    result = subprocess.run(
        [TANDEM, "convert", str(path), str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    model, tokenizer = load(str(out))
    assert model(mx.array(tokenizer.encode("hi"))[None]).shape[-1] > 0
    refused = subprocess.run(
        [TANDEM, "convert", str(tmp_path / "missing.gguf"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "tandem convert:" in refused.stderr


@pytest.mark.slow
def test_the_demo_is_a_real_model_that_answers(tmp_path):
    """`tandem serve --demo` (the README's first command): SmolLM2-135M-Instruct from
    its package on the registry, imported once; it knows the capital of France."""
    with running_server(["--demo"], env_without()) as proc:
        response = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={
                "model": "tandem-demo",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 20,
                "temperature": 0,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]


def test_a_file_changed_in_place_is_imported_afresh(tiny_model_dir, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(tiny_model_dir, path)
    first = import_gguf(path, tmp_path / "cache", dtype="float32")
    assert import_gguf(path, tmp_path / "cache", dtype="float32") == first
    write_gguf(tiny_model_dir, path, architecture="gemma3")  # new content, same path
    with pytest.raises(GGUFImportError, match="'gemma3' is not supported"):
        import_gguf(path, tmp_path / "cache", dtype="float32")
