"""Time without a GPU: topologies and their cost model (``topology``), the
simulator (``simulate`` over the plan's arrays ``arrays``, engines ``fast``
and ``events``), lower bounds (``bound``) and the tuner (``tune``)."""
