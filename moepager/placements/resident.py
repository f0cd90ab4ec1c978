"""The placement `resident`: every routed expert read once into one arena on the run's device (the default; the
smallest placement, and the example of docs/architecture.md)."""

from __future__ import annotations

from moepager.loading.build import resident_executor
from moepager.placements.base import BuildContext, Placed


class Resident:
    name = "resident"
    splits = True
    configurable = False
    option = ""

    def build(self, ctx: BuildContext) -> Placed:
        opened = ctx.opened
        make = resident_executor(opened.device, ctx.config.expert_kernel)
        return Placed(make(opened.reader, opened.paging, ctx.progress), None)
