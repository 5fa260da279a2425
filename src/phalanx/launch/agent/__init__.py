"""``phalanx agent``: the elastic agent, one per node and replica.

- :mod:`~phalanx.launch.agent.supervisor`: the agent itself (start, watch, report,
  restart, relayout) and its CLI entry;
- :mod:`~phalanx.launch.agent.options`: its options and the workers' environment
  (pure: nothing is started, nothing heavy imported);
- :mod:`~phalanx.launch.agent.args`: its command line as those options (config
  overrides included), each checked in one line;
- :mod:`~phalanx.launch.agent.files`: the run dir's control files (pid, resize);
- :mod:`~phalanx.launch.agent.workers`: one generation of worker processes;
- :mod:`~phalanx.launch.agent.nodes`: a replica across nodes (the agents'
  rendezvous: which generation runs, and the port of its rank-0 store);
- :mod:`~phalanx.launch.agent.track`: the job's metrics, from one agent.
"""
