"""Placements: every way of placing and computing a run's routed experts, one plug-in each (its own file, its
`build` from a `BuildContext`: base.py), found by name here as policies are. The composition root
(runtime/builder.py) resolves the run's placement once (`resolve`) and builds it; nothing outside this folder names
one (tests/test_architecture.py), except OD-MoE's other ranks, which build what `remote` places on them.

- `resident` (resident.py): every expert in one arena on the device;
- `paged` (paged.py): through the expert store (--expert-memory); the store's construction: stores.py;
- `hybrid` (hybrid.py): SMoE's, a miss computed on the CPU unless copying it pays;
- `cpu-experts` (cpu_experts.py): every expert on the CPU (llama.cpp's --cpu-moe);
- `remote` (remote.py): OD-MoE's worker processes (--workers).
"""

from __future__ import annotations

from moepager.config import EngineConfig, Execution
from moepager.placements.base import PlacementPlugin
from moepager.placements.cpu_experts import CpuExperts
from moepager.placements.hybrid import Hybrid
from moepager.placements.paged import Paged
from moepager.placements.remote import Remote
from moepager.placements.resident import Resident

PLACEMENTS: dict[str, PlacementPlugin] = {p.name: p for p in (Resident(), Paged(), Hybrid(), CpuExperts(), Remote())}


def resolve(config: EngineConfig, execution: Execution) -> PlacementPlugin:
    """The run's placement: worker processes when there are any, else where `execution` (--execution, auto already
    made concrete) computes experts, else through the store when a budget pages them, else resident."""
    if config.remote.workers:
        return PLACEMENTS["remote"]
    if execution in PLACEMENTS:
        return PLACEMENTS[execution]
    return PLACEMENTS["paged" if config.store.paged else "resident"]
