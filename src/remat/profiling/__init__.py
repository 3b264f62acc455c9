"""The profiling wing: ``remat.profile`` (``profile``), its data (``_types``: the peak
model), the traced run (``_profile_run``, ``_trace``, ``_segment``, ``_crossing_ledger``),
the profile put together from the runs (``_assemble``), the fake-tensor run (``_fake``,
``targets``), block finding (``_blocks``) and plain-text formatting (``_format``)."""
