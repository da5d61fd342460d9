"""Ring allgather written in MSCCLang, run by msc through msc.compat.msccl.

Each rank first places its own input in its output (dropped in place, where
input chunk i of rank r already is output chunk r*k+i), then every block of
k chunks travels size-1 hops around the ring.

    msc verify examples/msccl_allgather_ring.py -- 8 1 Simple
    msc verify examples/msccl_allgather_ring.py -- 8 1 LL --chunks 2 --out-of-place
"""
import argparse

from msc.compat.msccl import *


def allgather_ring(size, instances, protocol, chunks, inplace):
    topology = fully_connected(size)
    collective = AllGather(size, chunks, inplace)
    with MSCCLProgram("allgather_ring", topology, collective, instances, protocol=protocol):
        for rank in range(size):
            chunk(rank, Buffer.input, 0, chunks).copy(rank, Buffer.output, rank * chunks)
        for step in range(size - 1):
            for origin in range(size):
                rank = (origin + step) % size
                next_rank = (origin + step + 1) % size
                c = chunk(rank, Buffer.output, origin * chunks, chunks)
                c.copy(next_rank, Buffer.output, origin * chunks)
        XML()
        Check()


parser = argparse.ArgumentParser()
parser.add_argument("num_gpus", type=int, help="number of gpus")
parser.add_argument("instances", type=int, help="number of instances")
parser.add_argument("protocol", nargs="?", default="Simple", choices=["Simple", "LL", "LL128"],
                    help="NCCL protocol (default: Simple)")
parser.add_argument("--chunks", type=int, default=1, help="chunks per rank")
parser.add_argument("--out-of-place", action="store_true", help="separate input and output buffers")
args = parser.parse_args()

allgather_ring(args.num_gpus, args.instances, args.protocol, args.chunks, not args.out_of_place)
