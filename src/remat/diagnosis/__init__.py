"""The diagnosis wing: ``remat.doctor`` (``doctor``), its checks (``_checks``), where it
intercepts checkpointing (``_intercept``) and the Python state it watches (``_python_state``)."""
