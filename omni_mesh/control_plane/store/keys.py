"""The whole Redis key schema of the control plane. Nothing else builds a key or channel name.

    omni:inst:{instance_id}          hash    one instance record (fields: see INSTANCE_FIELDS)
    omni:pool:{pipeline}:{stage_id}  set     ids of every instance of one stage pool, any state
    omni:api:{pipeline}              set     ids of the pipeline's API servers that run no stage
                                             (--api-only): listed by status, never routed to
    omni:pipelines                   set     pipeline names that have (or had) instances
    omni:leases                      zset    instance_id -> lease deadline (Redis server ms)
    omni:evict                       zset    instance_id -> eviction deadline (ms) of dead records
    omni:version:{pipeline}          string  pool version, bumped on every membership/state change
    omni:epoch                       string  registration epoch counter (global)
    omni:sweeper:lock                string  owner token of the liveness sweeper (SET NX PX)
    omni:changes:{pipeline}          channel pub/sub hint: the pipeline's new version
    omni:scale:stages                set     "{pipeline}:{stage_id}" of every autoscaled stage,
                                             "{pipeline}:{stage_id}:prefill" of every split
                                             stage whose prefill pool autoscales
    omni:scale:policy:{p}:{s}        string  the stage's AutoscaleConfig (JSON), no expiry
    omni:scale:decision:{p}:{s}      string  the last ScaleDecision (JSON), written by the
                                             sweeper-lock holder only (checked in Lua)
    omni:scale:wake:{p}:{s}          string  requests waiting for a stage at zero (PX expiry)
    omni:scale:{policy,decision,wake}:{p}:{s}:prefill
                                             the same for a split stage's prefill pool
    omni:fingerprint:{pipeline}      hash    pipeline-wide settings its pods agree on (async_chunk,
                                             a digest of the stage list); replaced by the next
                                             registration once no instance of the pipeline holds
                                             a live lease (its last one left or expired)
    omni:session:{session_id}        hash    one realtime session (fields: see SESSION_FIELDS and
                                             "item:{item_id}" per item); PX expiry: 120 s while
                                             owned (renewed by writes and touches), the release
                                             TTL once released
    omni:sessions:{pipeline}         zset    session_id -> expiry deadline (Redis server ms) of
                                             the pipeline's sessions; entries past it are pruned

The Lua scripts compute instance, pool and version keys from ids they read inside the script
(a heartbeat knows only the instance id). They receive the prefixes below as arguments
(:meth:`KeySchema.lua_prefixes`), so the formats still live only here. This targets a single
Redis (or a primary with replicas), not Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_mesh.control_plane.schema import ScalePool

DEFAULT_PREFIX = "omni:"

# Version of the instance record layout stored in the hash's "schema" field.
RECORD_SCHEMA_VERSION = 1

INSTANCE_FIELDS: tuple[str, ...] = (
    "schema",
    "pipeline",
    "stage_id",
    "address",
    "host_id",
    "capacity",
    "labels",  # JSON object
    "state",
    "reason",
    "epoch",
    "registered_at_ms",
    "last_heartbeat_ms",
    "load",  # JSON object (LoadReport), "" until the first heartbeat
    "isolated_at_ms",  # when a probe isolated it (reason unreachable); absent otherwise
    "pool",  # the set it is a member of (a stage pool, or the pipeline's API servers)
    "settings",  # JSON object: its pipeline-wide settings, checked again when it is readmitted
)

# Fields of a session hash besides its items ("item:{item_id}", see SESSION_ITEM_PREFIX).
SESSION_FIELDS: tuple[str, ...] = (
    "pipeline",
    "owner",  # the API server instance id that holds it, "" once released
    "epoch",  # fencing token: bumped by every claim
    "config",  # JSON object
    "order",  # JSON list of the item ids, in conversation order
    "size",  # bytes of config + order + items (the limit is checked against it)
    "updated_ms",  # Redis server time of the last write
)
SESSION_ITEM_PREFIX = "item:"


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Key and channel names under one prefix (``omni:`` unless a test isolates itself)."""

    prefix: str = DEFAULT_PREFIX

    # ---- per-instance / per-pool ---------------------------------------------------------

    @property
    def instance_prefix(self) -> str:
        return f"{self.prefix}inst:"

    def instance(self, instance_id: str) -> str:
        return f"{self.instance_prefix}{instance_id}"

    @property
    def pool_prefix(self) -> str:
        return f"{self.prefix}pool:"

    def pool(self, pipeline: str, stage_id: int) -> str:
        return f"{self.pool_prefix}{pipeline}:{stage_id}"

    def api_pool(self, pipeline: str) -> str:
        """The pipeline's API servers without an engine: registered, never in a stage pool."""
        return f"{self.prefix}api:{pipeline}"

    @property
    def version_prefix(self) -> str:
        return f"{self.prefix}version:"

    def version(self, pipeline: str) -> str:
        return f"{self.version_prefix}{pipeline}"

    @property
    def channel_prefix(self) -> str:
        return f"{self.prefix}changes:"

    def channel(self, pipeline: str) -> str:
        return f"{self.channel_prefix}{pipeline}"

    @property
    def channel_pattern(self) -> str:
        return f"{self.channel_prefix}*"

    def pipeline_of_channel(self, channel: str) -> str | None:
        if channel.startswith(self.channel_prefix):
            return channel[len(self.channel_prefix) :]
        return None

    # ---- global --------------------------------------------------------------------------

    @property
    def pipelines(self) -> str:
        return f"{self.prefix}pipelines"

    @property
    def leases(self) -> str:
        return f"{self.prefix}leases"

    @property
    def evict(self) -> str:
        return f"{self.prefix}evict"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}epoch"

    @property
    def sweeper_lock(self) -> str:
        return f"{self.prefix}sweeper:lock"

    # ---- autoscaling ---------------------------------------------------------------------

    @property
    def scale_stages(self) -> str:
        return f"{self.prefix}scale:stages"

    @staticmethod
    def scale_member(pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE) -> str:
        """The member of :attr:`scale_stages` naming one autoscaled pool."""
        return f"{pipeline}:{stage_id}{_pool_suffix(pool)}"

    @staticmethod
    def parse_scale_member(member: str) -> tuple[str, int, ScalePool] | None:
        """(pipeline, stage id, pool) of a :attr:`scale_stages` member; None if malformed."""
        pool, suffix = ScalePool.STAGE, _pool_suffix(ScalePool.PREFILL)
        if member.endswith(suffix):  # a stage pool's member ends in the stage id's digits
            pool, member = ScalePool.PREFILL, member.removesuffix(suffix)
        pipeline, _, stage = member.rpartition(":")
        return (pipeline, int(stage), pool) if pipeline and stage.isdigit() else None

    def scale_policy(self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE) -> str:
        return f"{self.prefix}scale:policy:{pipeline}:{stage_id}{_pool_suffix(pool)}"

    def scale_decision(
        self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE
    ) -> str:
        return f"{self.prefix}scale:decision:{pipeline}:{stage_id}{_pool_suffix(pool)}"

    def scale_wake(self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE) -> str:
        return f"{self.prefix}scale:wake:{pipeline}:{stage_id}{_pool_suffix(pool)}"

    # ---- pipeline-wide settings -----------------------------------------------------------

    @property
    def fingerprint_prefix(self) -> str:
        return f"{self.prefix}fingerprint:"

    def fingerprint(self, pipeline: str) -> str:
        return f"{self.fingerprint_prefix}{pipeline}"

    # ---- realtime sessions -----------------------------------------------------------------

    @property
    def session_prefix(self) -> str:
        return f"{self.prefix}session:"

    def session(self, session_id: str) -> str:
        return f"{self.session_prefix}{session_id}"

    @property
    def sessions_prefix(self) -> str:
        return f"{self.prefix}sessions:"

    def sessions(self, pipeline: str) -> str:
        """The pipeline's sessions by expiry deadline."""
        return f"{self.sessions_prefix}{pipeline}"

    def lua_prefixes(self) -> tuple[str, str, str, str]:
        """(instance, pool, version, channel) prefixes, in the order the scripts expect."""
        return (self.instance_prefix, self.pool_prefix, self.version_prefix, self.channel_prefix)


def _pool_suffix(pool: ScalePool) -> str:
    """What a pool adds to its stage's scale keys: nothing for the stage's own pool."""
    return "" if pool is ScalePool.STAGE else f":{pool}"
