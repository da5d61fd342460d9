"""NVLS inside each node, a tree across nodes (after NCCL's NVLSTree)."""
import msc
from msc.dsl.nvls import node_switches, reduce_in_nodes, store_in_nodes, trees_across_nodes

# Tree k's transfers on channel TREE_CHANNEL + k, past the two switch threadblocks' channels (0 and
# 1: msc.dsl.nvls, which says why each tree needs a channel of its own).
TREE_CHANNEL = 2


@msc.algorithm("allreduce", chunk_factor=lambda n, gpus_per_node, trees, btree: gpus_per_node * trees,
               ranks=lambda n, gpus_per_node, trees, btree: gpus_per_node >= 2 and n % gpus_per_node == 0
               and trees >= 1)
def nvls_tree(p: msc.Program, gpus_per_node=8, trees=2, btree=False):
    """NVLS reduce in each node, binary trees across nodes, NVLS multicast.

    Rank = node * g + local (g = gpus_per_node, one NVSwitch domain per
    node); local index l owns chunks l*trees ... l*trees + trees - 1, one
    per tree, and sends them over its own NIC.

    1. In each node, rank l reads the node's sum of its chunks through the
       switch (one reduce-load) into its output.
    2. Across nodes, the ranks of local index l reduce chunk l*trees + k up
       binary tree k of nodes and send the total back down (tree 1 is tree
       0 mirrored, so each node's NIC carries an inner node's load in at
       most one of the two).
    3. In each node, rank l writes its chunks to every rank of its node in
       one multicast store.

    The reduce-loads and the stores run on two switch threadblocks, the
    tree on others: the three phases overlap across tiles, as NCCL's
    NVLSTree pipelines them. With one node it is NVLS with the load and
    the store as two steps. ``btree``: NCCL's double binary tree across the
    nodes instead (as NCCL's NVLSTree connects its heads; an inner node's
    NIC then carries four chunks each way where the heap's carries three).
    """
    reducing, storing = node_switches(p, gpus_per_node)
    reduce_in_nodes(reducing, gpus_per_node, trees)
    trees_across_nodes(p, gpus_per_node, trees, btree=btree, first_channel=TREE_CHANNEL)
    store_in_nodes(p, storing, gpus_per_node, trees)
