"""Proving schedules right: the DSL verifier (``program_verifier``, fast path
``program_verifier_fast`` over ``multisets``), the plan verifier (``plan``, fast path
``plan_fast``), the value checks of a plan (``plan_values``), the numpy oracle
(``reference``) and the cache of verified plan texts (``cache``)."""
