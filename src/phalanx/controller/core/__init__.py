"""The controller's pure core: the state machine of one job, with no I/O.

Ids and randomness are passed in, clocks are arguments (``now``, ``wall``),
and every durable change is written to a :class:`~.base.ChangeLog` that the
service journals. :class:`~.state.ControllerState` composes the parts:
``membership.py``, ``quorum.py``, ``commands.py``, ``ledger/`` (with ``rl.py``
for its requests); ``overview.py``, ``event_text.py`` and
``status.py`` derive what the status shows.
"""
