"""The diagnosis wing: ``remat.doctor`` (``doctor``), its checks (``_checks`` for correctness,
``_cost_checks`` for cost, over the records in ``_findings``), where it intercepts checkpointing
(``_intercept``; the record of each call it sees in ``_calls``) and the Python state it watches
(``_python_state``)."""
