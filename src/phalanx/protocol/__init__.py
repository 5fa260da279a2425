"""The wire contract between replicas (and tools) and the controller.

Typed, bounded request and reply models that both :mod:`phalanx.client` and
:mod:`phalanx.controller` import; the controller's OpenAPI spec is generated
from them. One module per part of the API:

- ``base.py``        the strict base model, bounded field types, the reply envelope, errors
- ``membership.py``  register, heartbeat, lifeline, quorum, failure reports, deregister
- ``quorum.py``      what a replica learns of a quorum: a brief per round, members per change
- ``commands.py``    commands to replicas, operator actions, checkpoint reports
- ``rl.py``          prompt leases, rollouts and their payloads, batches, weight syncs
- ``status.py``      the job's status and the dashboard's overview
- ``replay.py``      the seeded draw of a batch's replayed rollouts (both sides make it)
"""
