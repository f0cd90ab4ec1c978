"""OD-MoE's multi-process run: `torchrun --nproc-per-node N -m moepager.distributed generate ...` (or `moepager generate
--workers N-1`, which starts it): rank 0 runs the model, ranks 1..N-1 hold and compute the routed experts
(experts/remote/)."""
