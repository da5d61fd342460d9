"""Compatibility layers that let programs written for other collective DSLs
run on msc (``msc.compat.msccl``: MSCCLang from microsoft/msccl-tools)."""
