"""Time without a GPU: topologies and their cost model (``topology``), the
simulator (``simulate`` over the plan's arrays ``sim_plan``, engines ``fast``
and ``events``), lower bounds from cuts (``cut_bound``) and the tuner (``tune``)."""
