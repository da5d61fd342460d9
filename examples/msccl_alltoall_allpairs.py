"""All-pairs alltoall written in MSCCLang, run by msc through msc.compat.msccl.

Every input chunk goes straight to the rank and index the collective wants
it at (MSCCLang's get_dst_rank/get_dst_index). With --via-scratch each chunk
first lands in a scratch buffer on its destination (index -1: appended)
and is then copied locally into place.

    msc verify examples/msccl_alltoall_allpairs.py -- 8 1 Simple
"""
import argparse

from msc.compat.msccl import *


def alltoall(num_ranks, instances, protocol, via_scratch):
    topology = fully_connected(num_ranks)
    collective = AllToAll(num_ranks, 1, inplace=False)
    with MSCCLProgram("alltoall_allpairs", topology, collective, instances, protocol=protocol):
        for rank in range(num_ranks):
            for index in range(num_ranks):
                c = chunk(rank, Buffer.input, index)
                dst, dst_index = c.get_dst_rank(), c.get_dst_index()
                if via_scratch and dst != rank:
                    c = c.copy(dst, Buffer.scratch)
                c.copy(dst, Buffer.output, dst_index)
        XML()
        Check()


parser = argparse.ArgumentParser()
parser.add_argument("num_gpus", type=int, help="number of gpus")
parser.add_argument("instances", type=int, help="number of instances")
parser.add_argument("protocol", nargs="?", default="Simple", choices=["Simple", "LL", "LL128"],
                    help="NCCL protocol (default: Simple)")
parser.add_argument("--via-scratch", action="store_true", help="stage remote chunks in a scratch buffer")
args = parser.parse_args()

alltoall(args.num_gpus, args.instances, args.protocol, args.via_scratch)
