"""Run under torchrun by tests/distributed/test_workers.py: rank 0 generates greedy tokens from token-id prompts on
each checkpoint with its experts on the other ranks, and writes them to OUT; the workers serve each checkpoint in turn.
MOEPAGER_TEST_FAULT=die|hang|stop makes rank 2 (MOEPAGER_TEST_FAULT_RANK) exit, stop answering, or stop (SIGSTOP, as
`kill -STOP` does) at its third layer call (hang-shadow: the shadow rank, at its third pass); MOEPAGER_TEST_ON_LOSS is
the run's --on-worker-loss (stop by default), MOEPAGER_TEST_PREDICTOR its --predictor, MOEPAGER_TEST_SHADOW=1 makes
rank 1 the shadow (--shadow), MOEPAGER_TEST_ALIGN its --align-period, MOEPAGER_TEST_KV_ALIGN its --kv-align-period,
MOEPAGER_TEST_ASSIGN its --worker-assign, MOEPAGER_TEST_PREFILL its --worker-prefill, MOEPAGER_TEST_MAX_SEQS its
--max-num-seqs (1: one token a decode pass), MOEPAGER_TEST_LINK_TIMEOUT the links' timeout (20 s by default; the layer
calls' is 3 s)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moepager.config import EngineConfig, PrefetchConfig, RemoteConfig, SchedulerConfig
from moepager.distributed.roles import stop_workers
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Links
from moepager.experts.remote.protocol import SHADOW_RANK
from moepager.experts.remote.worker import ExpertWorker
from moepager.loading.build import read_config
from moepager.placements.remote import expert_worker, placement
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.shadow import Shadow

PROMPTS = [[3, 11, 5, 7], [7, 1, 2], [2, 2, 9, 4, 6]]


def main() -> int:
    out, group, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    links = Links.open(world, float(os.environ.get("MOEPAGER_TEST_LINK_TIMEOUT", "20")),
                       SHADOW_RANK if os.environ.get("MOEPAGER_TEST_SHADOW") else None)
    fault = os.environ.get("MOEPAGER_TEST_FAULT")
    if fault == "hang-shadow" and rank == SHADOW_RANK:
        run, passes = Shadow._run, [0]

        def stuck(self, *args):  # noqa: ANN001, ANN202
            passes[0] += 1
            if passes[0] == 3:
                time.sleep(60)
            return run(self, *args)
        Shadow._run = stuck
    elif fault in ("die", "hang", "stop") and rank == int(os.environ.get("MOEPAGER_TEST_FAULT_RANK", "2")):
        compute, calls = ExpertWorker.compute, [0]

        def faulty(self, *args):  # noqa: ANN001, ANN202
            calls[0] += 1
            if calls[0] == 3:
                if fault == "die":
                    os._exit(1)
                if fault == "stop":  # as `kill -STOP`: the process answers nothing, takes nothing
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(60)
            return compute(self, *args)
        ExpertWorker.compute = faulty
    results = {}
    for path in paths:
        shadow = bool(os.environ.get("MOEPAGER_TEST_SHADOW"))
        remote = RemoteConfig(workers=world - 1 - shadow, worker_group=group, worker_timeout_s=3.0,
                              worker_memory=os.environ.get("MOEPAGER_TEST_WORKER_MEMORY"),
                              on_worker_loss=os.environ.get("MOEPAGER_TEST_ON_LOSS", "stop"),
                              shadow=bool(os.environ.get("MOEPAGER_TEST_SHADOW")),
                              align_period=int(os.environ.get("MOEPAGER_TEST_ALIGN", "1")),
                              kv_align_period=int(os.environ.get("MOEPAGER_TEST_KV_ALIGN", "0")),
                              worker_assign=os.environ.get("MOEPAGER_TEST_ASSIGN"),
                              worker_prefill=os.environ.get("MOEPAGER_TEST_PREFILL"))
        scheduler = SchedulerConfig(max_num_seqs=int(os.environ.get("MOEPAGER_TEST_MAX_SEQS", "0"))
                                    or SchedulerConfig().max_num_seqs)
        config = EngineConfig(model=path, threads=1, prefetch=PrefetchConfig(os.environ.get("MOEPAGER_TEST_PREDICTOR")),
                              remote=remote, scheduler=scheduler)
        if rank == 0:
            try:
                llm = LLM(config=config, show_progress=False, links=links)
                params = SamplingParams(max_tokens=6, ignore_eos=True)
                results[path] = [c.token_ids for c in llm.generate(PROMPTS, params)]
                results[path + " lost"] = llm.loaded.experts.lost
                results[path + " crowded"] = [llm.loaded.experts.calls, llm.loaded.experts.crowded]
                results[path + " shadow lost"] = any(getattr(part, "lost", False) is True
                                                     for part in llm.wiring.placement_parts
                                                     if part is not llm.loaded.experts)
                kv = llm.last_stats.sections.get("kv alignment")
                results[path + " kv alignment"] = kv.to_dict() if kv is not None else None
            except MoepagerError as e:
                with open(out, "w") as f:
                    json.dump({"error": str(e)}, f)
                stop_workers(world, 3.0, links)
                return 1
            results[path + " workers"] = list(stop_workers(world, 3.0, links).values())
        elif shadow and rank == SHADOW_RANK:
            Shadow(config, Path(path), placement(config, read_config(path)), links).serve()
        else:
            expert_worker(config, Path(path), rank, links).serve()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
