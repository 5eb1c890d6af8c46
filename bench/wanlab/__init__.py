"""The WAN lab: hosts in network namespaces on emulated internet links (:mod:`.lab`, :mod:`.switch`, :mod:`.probe`)."""

from bench.wanlab.lab import OBSERVER_IP, Lab, LabError, Profile, leftovers, sweep

__all__ = ["Lab", "LabError", "OBSERVER_IP", "Profile", "leftovers", "sweep"]
