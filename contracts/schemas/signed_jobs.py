"""The learner's signature on a job: what it signs (`job_message`), signing, and checking that a
group or an evaluation result carries a job it signed (`contracts/signing.py` holds the keys)."""

from __future__ import annotations

import json

from contracts.schemas.messages import EvalResult, PromptJob, RolloutGroup
from contracts.schemas.parsing import SchemaError
from contracts.signing import SigningKey, WeightKey, sign, signature_holds


def job_message(job: PromptJob) -> bytes:
    """What the learner signs of a job: every field but the signature, as canonical JSON (the
    same bytes from the job as issued and from its copy inside a group, whoever re-encoded it)."""
    fields = job.model_dump(mode="json", exclude={"sig"})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_job(job: PromptJob, key: SigningKey) -> PromptJob:
    return job.model_copy(update={"sig": sign(key, job_message(job))})


def check_job_signature(message: RolloutGroup | EvalResult, key: WeightKey) -> None:
    """SchemaError unless the job of a group or an evaluation result carries the learner's
    signature (`PromptJob.sig`)."""
    job = message.job
    if not signature_holds(key, job_message(job), job.sig or None):
        what = "evaluation result" if isinstance(message, EvalResult) else "group"
        raise SchemaError(
            f"{what} {job.group_id}: its job is not signed by this run's learner (a job, a "
            "prompt or a ground truth written by someone else)"
        )
