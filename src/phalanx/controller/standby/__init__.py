"""Several controllers of one job on an etcd journal: one leads, the others stand by
and take over when it goes (issue 36).

- ``member.py``: one controller's part: take office, or stand by (register, follow,
  probe the leader, campaign) and take over;
- ``follower.py``: a standby's copy of the journal, kept current by an etcd watch;
- ``switch.py``: the ASGI app on the controller's one socket: a standby's 421s, then
  the leader's routes behind the read fence;
- ``token.py``: the job token, shared through the prefix.

:func:`etcd_app` is what :func:`phalanx.controller.server.serve` serves for a job
whose ``controller.journal`` names etcd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.controller.statedir import CannotStart

if TYPE_CHECKING:
    from phalanx.controller.server import Run
    from phalanx.controller.standby.switch import Switch


def etcd_app(run: Run) -> Switch:
    """The app of one controller of ``run``'s job on etcd: the leader's if nobody led
    (built here, so a journal that cannot be read stops it in one line before it
    serves), else a standby's. Raises CannotStart in one line: etcd does not answer,
    another job holds the prefix, or a standby of an RL job whose rollout payloads
    live in the controller (they would not survive a takeover on another host)."""
    # The leader's modules, imported now: a takeover must not wait for them.
    import phalanx.controller.http
    import phalanx.controller.service  # noqa: F401
    from phalanx.config.journal import target_of
    from phalanx.controller.journal.base import JournalUnavailable
    from phalanx.controller.journal.etcd import TIMEOUT_S, EtcdJournal
    from phalanx.controller.journal.etcd_kv import EtcdKV
    from phalanx.controller.journal.leader import LEASE_TTL_S, Leadership
    from phalanx.controller.journal.migrate import carry_over
    from phalanx.controller.standby.member import Member
    from phalanx.controller.standby.token import shared_token
    from phalanx.controller.statedir import JOURNAL

    cfg = run.cfg
    target = target_of(cfg.controller)
    prefix = target.prefix_for(cfg.job.id)
    try:
        kv = EtcdKV(target, TIMEOUT_S)
    except JournalUnavailable as e:
        raise CannotStart(f"{e}. Name a file this user can read.") from None

    def build(leader: Leadership, tables: Any) -> tuple[Any, Any]:
        journal = EtcdJournal(target, cfg.job.id, run.url, leader=leader, tables=tables)
        if (run.state_dir / JOURNAL).exists():  # a job moved from SQLite keeps its state
            try:
                carry_over(run.state_dir / JOURNAL, journal)
            except JournalUnavailable as e:
                journal.close()
                raise CannotStart(
                    f"the SQLite journal in {run.state_dir} could not be carried over to etcd "
                    f"journal {journal.where}: {e}. Start the controller again once etcd answers."
                ) from None
            except BaseException:
                journal.close()
                raise
        return run.build(journal)

    def failed(e: BaseException) -> None:
        run.error = e
        run.stop()

    try:
        kv.call("maintenance/status", {})
    except JournalUnavailable as e:
        raise CannotStart(
            f"controller.journal {target.url()} must name an etcd that answers: {e}. Start "
            f'etcd there, or point controller.journal at a running cluster (or "sqlite").'
        ) from None
    leadership = Leadership(kv, EtcdKV(target, LEASE_TTL_S / 3), prefix, cfg.job.id, run.url)
    try:
        run.token = shared_token(run.state_dir, kv, prefix)
        member = Member(kv, leadership, build, lambda line: print(line, flush=True), failed)
        leader = member.first_try()
    except JournalUnavailable as e:
        raise CannotStart(f"etcd journal {target.url(prefix)} cannot be taken: {e}.") from None
    if leader is not None:
        if cfg.rl is not None and cfg.rl.transport.rollouts == "controller":
            member.follower.close()
            raise CannotStart(
                "rl.transport.rollouts must name a store outside the controller for a job "
                'with standby controllers: got "controller" (payloads in the leader\'s state '
                "dir would not survive a takeover on another host). Set it to a redis:// or "
                "storage URL, or run one controller."
            )
        run.first_line = (
            f"phalanx controller for job {cfg.job.id}: standby (leader: "
            f"{leader.get('url', '?')}) at {run.url}"
        )
    from phalanx.controller.http.hot import Hot

    hot = run.hot = Hot.unarmed()  # the hot routes answer once this controller leads
    member.switch.on_lead = lambda fence: hot.arm(run.built_hot, fence)
    return member.switch
