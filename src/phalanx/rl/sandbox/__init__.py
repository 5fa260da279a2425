"""Running model-written code: a sandbox and the tools RL environments call.

- ``base.py``    the Sandbox interface, its limits and its RunResult
- ``bwrap.py``   the bubblewrap sandbox (namespaces, read-only binds, rlimits)
- ``process.py`` the host side of a run: deadline, output cap, process-group kill
- ``tools.py``   ``run_python`` and ``unit_test_score``, plain functions on a default sandbox

No import of verifiers here: environments wrap these functions themselves.
"""
