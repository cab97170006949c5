"""The learner's Ed25519 key: what signs the weight-sync announcements and the prompt jobs.

The learner alone holds the private key (`DAPO_WEIGHTS_KEY`); the rollout replicas and the
reward workers hold its public key (`DAPO_WEIGHTS_PUBLIC_KEY`), which verifies and cannot sign.
So a credential of any other service, or a compromised replica with every secret it holds, can
neither make a replica join a rendezvous of its choosing (`contracts.weight_sync`) nor choose
the prompts or the ground truths that get scored and trained (`contracts.schemas.job_message`).

Torch-free: the reward stage imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from contracts.config import ConfigError

KEY_ENV = "DAPO_WEIGHTS_KEY"
"""The environment variable holding the learner's private key (the learner only): an Ed25519
key as 64 hex characters (`dapo secrets` makes one)."""
PUBLIC_KEY_ENV = "DAPO_WEIGHTS_PUBLIC_KEY"
"""The environment variable holding its public key (the replicas and the reward workers), 64 hex
characters."""


class WeightKeyError(ConfigError):
    """The weight-sync key is missing or malformed (a configuration error: exit 2)."""


SigningKey = Ed25519PrivateKey
VerifyKey = Ed25519PublicKey
WeightKey = Ed25519PrivateKey | Ed25519PublicKey
"""Either half: what signs (the learner's private key) or only verifies (the public key)."""


def new_weights_key() -> tuple[str, str]:
    """A fresh (private, public) pair, each as 64 hex characters."""
    private = Ed25519PrivateKey.generate()
    return private.private_bytes_raw().hex(), private.public_key().public_bytes_raw().hex()


def public_key_text(private_hex: str) -> str:
    """The public half of a private key given as hex (WeightKeyError if it is not one)."""
    return _private(private_hex, KEY_ENV).public_key().public_bytes_raw().hex()


def _raw(value: str, name: str) -> bytes:
    try:
        raw = bytes.fromhex(value.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        problem = "is not set" if not value else "is not 64 hex characters"
        raise WeightKeyError(
            f"{name} {problem}: the learner signs its weight announcements with an Ed25519 key "
            f"({KEY_ENV}, the learner only) and the replicas accept only what its public key "
            f"({PUBLIC_KEY_ENV}) verifies. `dapo secrets` makes a pair; `dapo run` makes one "
            "itself."
        )
    return raw


def _private(value: str, name: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_raw(value, name))


def weights_key(env: Mapping[str, str] | None = None) -> Ed25519PrivateKey:
    """The learner's signing key from `DAPO_WEIGHTS_KEY`; WeightKeyError naming the fix."""
    return _private((os.environ if env is None else env).get(KEY_ENV, ""), KEY_ENV)


def weights_public_key(env: Mapping[str, str] | None = None) -> Ed25519PublicKey:
    """A replica's key from `DAPO_WEIGHTS_PUBLIC_KEY`; WeightKeyError naming the fix."""
    value = (os.environ if env is None else env).get(PUBLIC_KEY_ENV, "")
    return Ed25519PublicKey.from_public_bytes(_raw(value, PUBLIC_KEY_ENV))


def held_key(env: Mapping[str, str] | None = None) -> WeightKey | None:
    """The key this process checks the learner's signatures with: the private one (the learner),
    else the public one, else None (a process given neither)."""
    env = os.environ if env is None else env
    if env.get(KEY_ENV):
        return weights_key(env)
    return weights_public_key(env) if env.get(PUBLIC_KEY_ENV) else None


def sign(key: WeightKey, message: bytes) -> str:
    """The Ed25519 signature of `message`, hex; only a private key signs."""
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError("only the learner's private key signs weight-sync messages")
    return key.sign(message).hex()


def signature_holds(key: WeightKey, message: bytes, signature: bytes | str | None) -> bool:
    """True when `signature` (hex) is the learner's signature of `message`."""
    if signature is None:
        return False
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    text = signature.decode("ascii", "replace") if isinstance(signature, bytes) else signature
    try:
        public.verify(bytes.fromhex(text), message)
    except (ValueError, InvalidSignature):
        return False
    return True
