"""NVLS allreduce: the switch reduces and multicasts (NVLink SHARP)."""
import msc


@msc.algorithm("allreduce", chunk_factor=lambda n: n, ranks=lambda n: n >= 2)
def nvls(p: msc.Program):
    """The switch sums each slice and multicasts it (NVLS, one NVSwitch domain).

    Each rank takes 1/n of the data: it reads the sum of every rank's copy
    of its slice in one load through the switch, and writes it to every
    rank's output in one multicast store (NCCL's NVLS algorithm on H100/H200
    with NVSwitch). Each GPU moves its slice once each way instead of a
    ring's 2(n-1) steps.

    Needs GPUs whose buffers the switch can reach (msc.dsl.switch): on
    other machines, and on the MSCCL runtimes, it does not run.
    """
    sw = p.switch()
    for r in range(p.num_ranks):
        sw.reduce(r, "input", r).store("output", r)
