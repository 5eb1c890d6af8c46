"""Ed25519 identities, peer ids, signatures and the self-certifying run id.

A peer id is the lowercase base32 of the first 10 bytes of SHA-256(public key): 16 characters, stable for
as long as the identity file is kept. The run id is ``<name>-<16 chars>``, the same digest taken over the
coordinator's public key and the spec hash, so a run id alone pins both who signs the spec and what it says.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class SignatureError(ValueError):
    """A signature or key that does not verify."""


def _digest16(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return base64.b32encode(h.digest()[:10]).decode().lower()


def peer_id_of(public_key: bytes) -> str:
    """Peer id (16 chars) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"public key has {len(public_key)} bytes, expected {PUBLIC_KEY_BYTES} (Ed25519 raw)")
    return _digest16(b"swarm-peer", public_key)


def derive_run_id(name: str, public_key: bytes, spec_hash: str) -> str:
    """Run id ``<name>-<digest>`` from the coordinator's raw public key and the spec's SHA-256 hex."""
    return f"{name}-{_digest16(b'swarm-run', public_key, bytes.fromhex(spec_hash))}"


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raise :class:`SignatureError` unless ``signature`` is ``public_key``'s Ed25519 signature of ``message``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as e:
        raise SignatureError(f"bad signature ({type(e).__name__}); the record was forged or corrupted") from None


class Identity:
    """An Ed25519 key pair with its peer id; signs records and messages."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> "Identity":
        """Load a PEM (PKCS#8) Ed25519 key from ``path``.

        :raises FileNotFoundError: no such file.
        :raises ValueError: the file is not an unencrypted Ed25519 PEM key.
        """
        path = Path(path)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"identity file {path} is not an unencrypted PEM key ({e}); move it away to create a new one") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"identity file {path} holds a {type(key).__name__}, not Ed25519; move it away to create a new one")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | Path) -> "Identity":
        """Load a PEM (PKCS#8) key from ``path`` (:meth:`load`), creating it (mode 0600) if it does not exist.

        :raises ValueError: the file exists but is not an unencrypted Ed25519 PEM key.
        """
        path = Path(path)
        if path.exists():
            return cls.load(path)
        ident = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = ident._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return ident

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of ``message``."""
        return self._key.sign(message)
