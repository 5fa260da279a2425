"""Generation engines: the interface in ``base.py``, one module per mechanism."""
