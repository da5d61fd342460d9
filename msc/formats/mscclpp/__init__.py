"""MSCCL++ execution plans (JSON, read by microsoft/mscclpp's executor,
src/core/executor/execution_plan.cc): the executor's limits (``limits``),
reading a plan into the one-sided model (``reader``, msc.ir.onesided),
writing one from an msc plan (``export``), and reading back a plan of the
shape the exporter writes as an msc plan (``lift``)."""
