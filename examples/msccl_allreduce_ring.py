"""Ring allreduce written in MSCCLang, run by msc through msc.compat.msccl.

Chunk i is summed around the ring starting at rank i (reduce-scatter), so
the full sum of chunk i lands on rank i-1, which passes it on around the
ring (allgather). With --channels C, chunk i uses channel and threadblock
i % C on every rank (manual threadblock assignment).

    msc verify examples/msccl_allreduce_ring.py -- 8 1 Simple
"""
import argparse

from msc.compat.msccl import *


def allreduce_ring(size, instances, protocol, channels):
    topology = fully_connected(size)
    collective = AllReduce(size, size, True)
    with MSCCLProgram("allreduce_ring", topology, collective, instances, protocol=protocol,
                      threadblock_policy=ThreadblockPolicy.manual):
        # Reduce-scatter: after size-1 steps rank i-1 holds the sum of chunk i.
        for step in range(size - 1):
            for index in range(size):
                rank = (index + step) % size
                next_rank = (index + step + 1) % size
                channel = index % channels
                c = chunk(next_rank, Buffer.input, index)
                c.reduce(chunk(rank, Buffer.input, index), sendtb=channel, recvtb=channel, ch=channel)
        # Allgather: pass each fully reduced chunk on around the ring.
        for step in range(-1, size - 2):
            for index in range(size):
                rank = (index + step) % size
                next_rank = (index + step + 1) % size
                channel = index % channels
                c = chunk(rank, Buffer.input, index)
                c.copy(next_rank, Buffer.input, index, sendtb=channel, recvtb=channel, ch=channel)
        XML()
        Check()


parser = argparse.ArgumentParser()
parser.add_argument("num_gpus", type=int, help="number of gpus")
parser.add_argument("instances", type=int, help="number of instances")
parser.add_argument("protocol", nargs="?", default="Simple", choices=["Simple", "LL", "LL128"],
                    help="NCCL protocol (default: Simple)")
parser.add_argument("--channels", type=int, default=1, help="channels to spread the ring's chunks over")
args = parser.parse_args()

allreduce_ring(args.num_gpus, args.instances, args.protocol, args.channels)
