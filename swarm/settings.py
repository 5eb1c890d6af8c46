"""A peer's own settings: ``SWARM_*`` environment variables, a ``.env`` file, then flags (pydantic-settings).

What every peer of a run must agree on is the run's spec (:class:`swarm.config.RunSpec`); these are what each
machine decides for itself: where its caches and key live, its ports, its name, its device and kernels."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Role(StrEnum):
    SERVER = "server"
    TRAINER = "trainer"


class PeerSettings(BaseSettings):
    """Settings of one peer machine, read from ``SWARM_*`` environment variables, a ``.env`` file, then flags."""

    model_config = SettingsConfigDict(env_prefix="SWARM_", env_file=".env", extra="ignore")

    cache_dir: Path = Field(
        Path.home() / ".cache" / "swarm",
        description="Identity, tokenizer, corpus and throughput cache. Mount it as a volume in containers.",
    )
    host: str = Field("0.0.0.0", description="Address the P2P daemon listens on (127.0.0.1 for loopback-only swarms).")
    port: int = Field(0, ge=0, le=65535, description="TCP port of the P2P daemon; 0 picks a free one.")
    announce_host: Optional[str] = Field(None, description="Public address to announce when behind port forwarding.")
    client_mode: bool = Field(False, description="Do not accept incoming connections (behind NAT); implies trainer.")
    relay: Literal["auto", "off"] = Field(
        "auto", description="auto: if the swarm cannot reach this peer, be reached through another peer's libp2p "
        "circuit relay (slower; the log and `status` say 'relayed'); off: never (on a firewalled host, "
        "SWARM_CLIENT_MODE then makes it a trainer).",
    )
    name: str = Field("", max_length=64, description="Public name shown in the run's monitoring (e.g. your handle).")
    val_every_s: float = Field(
        300.0, ge=0, description="Trainers: seconds between validation-loss measurements through the swarm "
        "(4 held-out micro-batches, forward only; 0: never).",
    )
    identity_file: Optional[Path] = Field(None, description="Ed25519 key of this peer (default "
                                          "<state_dir>/identity.key, or <cache_dir>/identity.key without a state_dir).")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0: this peer's share of the machine's cores "
                         "among the servers and trainers running on it (the log says which). Set it when other "
                         "work shares the machine, or to give one peer more.")
    fragment_max_bytes: int = Field(
        2 << 30, gt=0, description="Disk budget (bytes) for checkpoint fragments this peer holds for the swarm.",
    )
    fragment_dir: Optional[Path] = Field(
        None, description="Where held fragments live (default <state_dir>/fragments, or <cache_dir>/fragments "
        "without a state_dir). Keep it across restarts: the swarm resumes from these files if every peer dies.",
    )
    state_dir: Optional[Path] = Field(
        None, description="This peer's own folder: its key (identity.key), held fragments (fragments/), heartbeat "
        "(peer-status.json) and commands (peer-control.json); default <cache_dir>. Several peers on one machine "
        "share the cache (corpus, tokenizer) and each need their own state_dir: a second peer on a folder in use "
        "is refused (exit 6).",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port serving Prometheus metrics at /metrics (0: off; containers use 9100).",
    )
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="Where a server computes its stage: auto picks the "
        "first CUDA GPU torch sees, else the CPU; cpu, cuda or cuda:N force one (cuda:1 for a second GPU, one "
        "server per GPU). Activations on the wire, averaging and checkpoints go through the CPU either way.",
    )
    kernels: Literal["auto", "reference", "torch", "compiled", "triton"] = Field(
        "auto", description="Kernel backend of this peer's stage (swarm.kernels): auto picks 'triton' on a CUDA GPU "
        "with Triton installed, else 'torch' (plain PyTorch, the last stage's loss fused to save memory); "
        "'compiled' adds torch.compile (measure it with bench/kernels.py first: on small CPUs it is slower); "
        "'reference' is the unfused eager code (to rule kernels out when results look wrong). The log says which.",
    )
    invite: Optional[str] = Field(
        None, max_length=128, description="An invite code of a run that admits by invite ([admission] policy = "
        "'invite'; `swarm-coordinator invite` prints it): redeemed at join for this peer's ticket when it holds "
        "none. `swarm-peer join --invite CODE` sets it.",
    )
    join_timeout_s: float = Field(
        120.0, ge=0, description="Seconds a server or trainer keeps trying to reach the run address's peers before "
        "giving up (a peer started before its coordinator, or through a peer that just left, gets in when one "
        "answers). Raise it for a container that may start long before the run; 0 tries once.",
    )

    def identity_path(self) -> Path:
        return self.identity_file or self.state_path() / "identity.key"

    def state_path(self) -> Path:
        return self.state_dir or self.cache_dir

    def fragment_path(self) -> Path:
        return self.fragment_dir or self.state_path() / "fragments"
