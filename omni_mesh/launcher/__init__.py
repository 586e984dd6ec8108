"""``omni-up``: every process of one pipeline on this machine (embedded Redis, omni-cp, the stage
pods), supervised, stopped in order.

- :mod:`~omni_mesh.launcher.cli` - the ``omni-up`` flags; parses, sets up logging, delegates.
- :mod:`~omni_mesh.launcher.local_deploy` - what to start, in which order, and the run loop.
- :mod:`~omni_mesh.launcher.autoscale` - the autoscaled stages' pools follow the control
  plane's desired replica counts (start replicas, retire them by draining).
- :mod:`~omni_mesh.launcher.supervisor` / :mod:`~omni_mesh.launcher.supervised_child` - start,
  restart and stop local children.
- :mod:`~omni_mesh.launcher.local_net` - free ports and readiness probes.

Imports ``configs``, ``control_plane.client``, ``observability`` and the shared-memory janitor
(``data_plane.shm_cleanup``) only; never the pod (``sidecar``): pods are child processes.
"""
