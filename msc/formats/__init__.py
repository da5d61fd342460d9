"""Files msc reads and writes: the plan text (``plan_text``, fast reader
``plan_lines``), MSCCL-IR XML (``xml_export``, ``xml_import``), plan
comparison (``diff``) and whole-or-nothing writes (``files``)."""
