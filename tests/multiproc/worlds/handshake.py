"""2-rank world where rank 1 differs from rank 0 (argv[1]: "geometry" or "version"): both must refuse."""

import sys

from mpi4py import MPI

import kvown.adapters.transport as transport
from kvown import ConfigError, KVLayout, TransferConfig, connect_mpi

comm = MPI.COMM_WORLD
head_dim = 128 if (sys.argv[1] == "geometry" and comm.rank == 1) else 64
if sys.argv[1] == "version" and comm.rank == 1:
    transport.PROTOCOL_VERSION = 2  # a peer from a future release
layout = KVLayout.standard(num_layers=2, num_blocks=8, tokens_per_block=16, num_kv_heads=2, head_dim=head_dim,
                           dtype="bfloat16")
try:
    connect_mpi(comm, layout=layout, config=TransferConfig())
except ConfigError as exc:  # start-up is collective: every rank hears why, and nothing started
    print(f"REFUSED rank={comm.rank} step={exc.field} message={exc}", flush=True)
    sys.exit(3)
print(f"ACCEPTED rank={comm.rank}", flush=True)
