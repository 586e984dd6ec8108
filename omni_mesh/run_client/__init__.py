"""``omni-run``: the reference ``/v1/run`` client (DESIGN §5). It loops ``/v1/run`` across the
stages of a pipeline (fixed URLs or replicas discovered through the control plane), follows
chunks and joins them.

- :mod:`~omni_mesh.run_client.client` - :class:`RunClient`, the loop (it follows joins too).
- :mod:`~omni_mesh.run_client.bodies` - ``/v1/run`` request and answer bodies, JSON and msgpack.
- :mod:`~omni_mesh.run_client.resolvers` - where each call goes (URLs, control-plane discovery).
- :mod:`~omni_mesh.run_client.errors` - the client's errors.
- :mod:`~omni_mesh.run_client.outputs` - the client-side join of chunk outputs; output files.
- :mod:`~omni_mesh.run_client.cli` - the ``omni-run`` flags; parses, sets up logging, delegates.

Imports ``configs``, ``data_plane`` and ``control_plane.client`` only; never the pod (``sidecar``).
"""
