"""``phalanx run --chaos``: faults a launcher delivers to its own job, seeded and
logged, so that anyone can watch the job survive them and audit it afterwards.

- :mod:`.spec`: the ``--chaos`` grammar (every kind and option);
- :mod:`.schedule`: seeded draws of each fault's time and target (no I/O);
- :mod:`.faults`: the actions, on the launcher's own process handles;
- :mod:`.runner`: what the launcher's loop calls, the slow thread, and the check
  that refuses a kind the job cannot take;
- :mod:`.log`: the ``chaos:`` lines and ``RUN_DIR/chaos.jsonl``.
"""

from phalanx.launch.chaos.spec import Chaos

__all__ = ["Chaos"]
