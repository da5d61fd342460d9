"""Writing a collective algorithm: the DSL (``program``), the collectives as
pre- and postconditions (``collectives``) and loading algorithm files (``loader``).
The names users need are re-exported by ``msc`` itself."""
