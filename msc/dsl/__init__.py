"""Writing a collective algorithm: the DSL (``program``), the collectives as
pre- and postconditions (``collectives``), loading algorithm files (``loader``)
and the rank orders NCCL lays its rings and trees in (``nccl_orders``, for the
library's NCCL-grade baselines). The names users need are re-exported by ``msc``
itself."""
