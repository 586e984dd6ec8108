"""Instance liveness: the sweeper that isolates expired leases and evicts the dead (``sweeper``),
and the probe of replicas that senders report as suspect (``suspects``)."""
