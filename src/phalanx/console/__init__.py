"""Terminal views: ``phalanx run``'s live progress and summary (``view.py``), ``phalanx
status`` once or ``--watch`` (``status_view.py``), and the status poller both use
(``poll.py``)."""
