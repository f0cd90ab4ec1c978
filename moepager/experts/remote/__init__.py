"""OD-MoE's worker side of the engine: routed experts computed by worker processes over torch.distributed (gloo on
the CPU). Rank 0, the main rank, keeps the dense weights and the KV cache and runs the model; ranks 1..W are workers
that hold routed experts and compute them on demand; with --shadow, rank 1 is the shadow (runtime/shadow.py).

- protocol.py: the typed messages every rank sends (`Op`, one dataclass per message);
- placement.py: which worker holds each expert (`Placement`), the ranks' process groups (`Links`);
- executor.py: the main rank's executor (`RemoteExecutor`), failover;
- worker.py: a worker rank (`ExpertWorker`).
The ranks' launch and roles: distributed/roles.py and cli/launch.py `spawn_ranks`.
"""
