"""Environment variables phalanx reads. Each is declared once, here.

Only launch identity and documented overrides live in the environment;
everything else is in the job config.
"""

TOKEN = "PHALANX_TOKEN"
"""The job token. Overrides the state dir's ``token`` file on the controller and
on replicas."""

CONTROLLER = "PHALANX_CONTROLLER"
"""Where a replica finds the controller: its URL, or its state dir (whose ``url``
file is re-read when the controller moves)."""
