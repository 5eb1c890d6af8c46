"""Ed25519 identities, peer ids, signatures and the self-certifying run id.

A peer id is the lowercase base32 of the first 10 bytes of SHA-256(public key): 16 characters, stable for
as long as the identity file is kept. The run id is ``<name>-<16 chars>``, the same digest taken over the
coordinator's public key and the spec hash, so a run id alone pins both who signs the spec and what it says.

**One key per peer.** A peer's libp2p identity (the key its p2pd daemon authenticates its connections with)
is the same Ed25519 key: its libp2p id (``12D3KooW...``) is the identity multihash of the public key (libp2p
peer-ids spec, "Ed25519 keys are inlined"), so :func:`public_key_of_p2p_id` recovers the key from the id
alone. A record or accusation naming a libp2p id is therefore checkable by anyone, offline, with no
challenge round trip: the id *is* the key, and libp2p's handshake proves that whoever speaks for the id holds
it (:func:`swarm.net.dht.spawn_dht` starts the daemon with the key).
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import sys
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class SignatureError(ValueError):
    """A signature or key that does not verify."""


class IdentityInUse(RuntimeError):
    """Another process on this machine already runs as this identity (two peers would share one libp2p id), or
    uses this peer's own folder (:func:`claim_folder`)."""


_CLAIMED: dict[str, socket.socket] = {}


def claim_identity(identity: "Identity") -> None:
    """Make this process the only one on this machine that runs as ``identity``, until it exits.

    The claim is an abstract Unix socket named after the peer id (Linux; released by the kernel when the
    process dies, even on SIGKILL, and it leaves no file behind). A process may claim its own identity again.
    Elsewhere this is a no-op.

    :raises IdentityInUse: another live process holds the claim.
    """
    _claim(f"swarm-peer-{identity.peer_id}", lambda: IdentityInUse(
        f"another process on this machine already runs as peer {identity.peer_id} (libp2p id {identity.p2p_id}); "
        "two peers cannot share a key. Give each peer on this machine its own SWARM_STATE_DIR (its key, "
        "fragments and heartbeat then live there), or its own SWARM_IDENTITY_FILE"))


STATE_CLAIM = "swarm-state-"
"""Prefix of a peer's claim of its state folder: one per server or trainer process on the machine
(:func:`swarm.host.peers_on_host` counts them)."""


def claim_folder(path: Path, setting: str, kind: str = "folder") -> None:
    """Make this process the only one on this machine that uses ``path`` (a peer's own folder: its state or
    its fragments), until it exits; the same claim as :func:`claim_identity`, named after the folder's real path.

    :param setting: the setting that chooses the folder (named in the error, with how to pick another).
    :param kind: what the folder is (``state``: :data:`STATE_CLAIM`, ``fragments``), in the claim's name.
    :raises IdentityInUse: another live process uses the folder.
    """
    real = os.path.realpath(path)
    _claim(f"swarm-{kind}-" + hashlib.sha256(real.encode()).hexdigest()[:32], lambda: IdentityInUse(
        f"another peer process on this machine already uses {real} ({setting}); two peers would overwrite each "
        f"other's files there. Give each peer on this machine its own SWARM_STATE_DIR (its key, fragments and "
        f"heartbeat then default there), or set {setting}"))


def claim_local_state(identity: "Identity", settings, fragments: bool) -> None:
    """Claim what a peer process keeps to itself on this machine: its identity, its state folder and (a fragment
    holder) its fragment folder (``settings``: its :class:`~swarm.settings.PeerSettings`).

    :raises IdentityInUse: another live process holds one of them (the message names the setting to change).
    """
    claim_identity(identity)
    claim_folder(settings.state_path(), "SWARM_STATE_DIR", "state")
    if fragments:
        claim_folder(settings.fragment_path(), "SWARM_FRAGMENT_DIR", "fragments")


def _claim(name: str, error) -> None:
    """Bind the abstract Unix socket ``name`` for the life of this process (no-op if it already did, or off
    Linux); raises ``error()`` if another process holds it."""
    if name in _CLAIMED or not sys.platform.startswith("linux"):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0{name}")
    except OSError:
        sock.close()
        raise error() from None
    _CLAIMED[name] = sock


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


def _libp2p_public_key(public_key: bytes) -> bytes:
    return crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public_key).SerializeToString()


def p2p_id_of(public_key: bytes) -> str:
    """The libp2p peer id (base58, ``12D3KooW...``) of a raw 32-byte Ed25519 public key: the identity multihash
    (code 0x00) of the key's libp2p protobuf encoding."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"public key has {len(public_key)} bytes, expected {PUBLIC_KEY_BYTES} (Ed25519 raw)")
    encoded = _libp2p_public_key(public_key)
    return PeerID(bytes([0x00, len(encoded)]) + encoded).to_base58()


def public_key_of_p2p_id(p2p_id: str) -> bytes:
    """The raw Ed25519 public key inlined in a libp2p peer id (inverse of :func:`p2p_id_of`).

    :raises SignatureError: not base58, or not an Ed25519 identity-multihash id (e.g. an RSA peer's ``Qm...``
        hash, which no peer of this project has).
    """
    try:
        raw = PeerID.from_base58(p2p_id).to_bytes()
        if raw[0] != 0x00 or raw[1] != len(raw) - 2:
            raise ValueError("not an identity multihash")
        key = crypto_pb2.PublicKey.FromString(raw[2:])
    except Exception as e:
        raise SignatureError(f"libp2p id {p2p_id[:64]!r} does not inline an Ed25519 key ({e})") from None
    if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"libp2p id {p2p_id[:64]!r} does not inline an Ed25519 key")
    return bytes(key.data)


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
        self.p2p_id: str = p2p_id_of(self.public_key)
        self.ticket: bytes = b""
        """The sealed ticket admitting this peer (signed by the run key or a delegate; ``[admission] policy``
        "allowlist" or "invite"), carried in every record it seals; empty in an open run
        (:mod:`swarm.trust.tickets`)."""
        self.delegation: bytes = b""
        """The run key's sealed delegation naming this key while it issues tickets for it, embedded in each ticket
        it signs; empty otherwise (:mod:`swarm.trust.delegates`)."""

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

    def libp2p_private_key(self) -> bytes:
        """This key in libp2p's protobuf encoding (the file format of p2pd's ``-id``); a secret like the key."""
        raw = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw + self.public_key).SerializeToString()

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of ``message``."""
        return self._key.sign(message)
