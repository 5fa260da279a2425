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

ADVERTISE_HOST = "PHALANX_ADVERTISE_HOST"
"""The address this process gives its peers (its rendezvous store, its process
groups, the controller's URL): an IP, a host name, or ``iface:NAME`` for the
first IPv4 address of a network interface. Unset: loopback, which is right on one
machine. ``--advertise-host`` on ``phalanx controller|replica|agent|run`` sets it
for the process and everything it starts."""

CA_FILE = "PHALANX_CA_FILE"
"""A PEM file of the certificate authorities that clients trust for the
controller's HTTPS (``--ca-file``). Unset: the system's."""

RUN_DIR = "PHALANX_RUN_DIR"
"""The run directory of the job a replica belongs to. The launchers set it for their
replicas; tokenized training data is cached under it (``data-cache``) unless
``train.data.cache_dir`` says otherwise, so a restarted replica finds it."""

REPLICA_NAME = "PHALANX_REPLICA_NAME"
"""The stable name of a replica started by a launcher that is not ``phalanx replica``
(torchrun-style): :class:`phalanx.Replica` registers under it (default
``policy-<pid>``)."""

CONFIG = "PHALANX_CONFIG"
"""The job TOML that :class:`phalanx.Replica` reads its timeouts, checkpoint root and
seed from, when nothing passes it a config (torchrun-style launchers)."""
