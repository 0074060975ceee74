"""The workloads behind ``kvown bench`` (issue 12). They live in the package so an installed wheel runs them
with no checkout; ``kvown.apps.bench`` is the launcher and holds the registry.

Modules:
  common    shared helpers: percentiles, environment and UCX transport, progress bars, JSON, plots
  cost      in-process engine cost per session (both drivers over real NIXL, one thread, CPU time),
            scale (per-operation cost at 100 vs 10,000 live sessions) and 1,000,000 fences
  world     W1 happy path, W2 cancellation sweep, W3 fan-in, W4 descriptor sweep, against B0 (raw NIXL)
            and B1 (timeout), in one mpirun world per workload, with the RTT and WRITE yardsticks
  raw       B0 / B1 of ``world``: raw NIXL between a second agent per rank, and the MPI wait helpers
  slow      slow sessions: counted and reported by the workloads, never a crash of the world
  frozen    W5: SIGSTOP a writer mid-transfer under load; deadline -> world gone; nothing retired early
  suite     ``kvown bench`` with no name: every workload above, one JSON object with ``metrics``
  control   NIXL notification RTT vs ZeroMQ, WRITE post -> DONE (two spawned processes)
  kernels   NVFP4 and checksum kernels vs torch's copy bandwidth
"""
