"""The controllers a launcher runs: one (:class:`~phalanx.launch.supervise.ControllerProcess`,
SQLite in its state dir) or several on an etcd journal, one leading and the others
standing by (:class:`group.ControllerGroup`), with a local etcd when none is given
(:class:`etcd.LocalEtcd`)."""
