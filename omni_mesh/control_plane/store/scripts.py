"""Lua scripts: every multi-key change of the control plane, each one atomic.

Time comes from ``redis.call('TIME')`` so that several omni-cp hosts agree on leases whatever
their clocks say. Every membership or state change of a pipeline increments its version and
PUBLISHes the new version on its channel, inside the same script. A version counter (and the
epoch counter) that does not exist yet starts at the server time in µs and is INCR'd by one per
change. No Redis does more than one change per µs, so a counter never runs ahead of the clock:
after Redis lost its data the new counter starts above every version handed out before, and a
watcher's old version can never be mistaken for a current one. (µs since 1970 stay below 2**53:
exact in Lua's doubles and in JSON.)

Key prefixes come in as ARGV (see ``keys.KeySchema.lua_prefixes``); scripts only append ids.
"""

from __future__ import annotations

_PRELUDE = """
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return math.floor(us / 1000), us
end
local function ms(n)
  return string.format('%d', n)
end
local function next_counter(key, now_us)
  if redis.call('EXISTS', key) == 0 then
    redis.call('SET', key, ms(now_us))
  end
  return redis.call('INCR', key)
end
local function bump(version_key, channel, now_us)
  local v = next_counter(version_key, now_us)
  redis.call('PUBLISH', channel, ms(v))
  return v
end
"""

# KEYS: inst, pool (its stage pool, or the pipeline's API servers), leases, version, epoch,
#       pipelines, evict, fingerprint, every pool of the pipeline (stages, API servers)
# ARGV: id, pipeline, stage_id, address, host_id, capacity, labels_json, load_json,
#       lease_ttl_ms, channel, instance_prefix, record_schema, settings_json, state (healthy, or
#       standby: a warm replica that stays out of the pool until promoted; its record keeps
#       standby=1 until then, so a lapsed lease or a readmit returns it to standby)
# Returns {epoch, version, now_ms, {superseded ids}}, or {'conflict', setting, theirs, ours} when
# a pipeline-wide setting disagrees with the fingerprint of the pipeline's live instances (any
# instance whose lease has not lapsed, but the one this registration replaces). With no live
# instance the fingerprint is replaced by this one's. An instance already registered in the
# same pool with the same address is replaced (a restarted replica must not be listed twice).
REGISTER = (
    _PRELUDE
    + """
local now, now_us = clock()
local wanted = cjson.decode(ARGV[13])
local names = {}
for name, _ in pairs(wanted) do table.insert(names, name) end
table.sort(names)
if #names > 0 then
  local live = false
  for i = 9, #KEYS do
    for _, other in ipairs(redis.call('SMEMBERS', KEYS[i])) do
      local same = KEYS[i] == KEYS[2]
        and redis.call('HGET', ARGV[11] .. other, 'address') == ARGV[4]
      local deadline = redis.call('ZSCORE', KEYS[3], other)
      if not same and deadline and tonumber(deadline) >= now then
        live = true
        break
      end
    end
    if live then break end
  end
  if live then
    for _, name in ipairs(names) do
      local theirs = redis.call('HGET', KEYS[8], name)
      if theirs and theirs ~= wanted[name] then
        return {'conflict', name, theirs, wanted[name]}
      end
    end
  else
    redis.call('DEL', KEYS[8])
  end
  for _, name in ipairs(names) do
    redis.call('HSET', KEYS[8], name, wanted[name])
  end
end
local superseded = {}
for _, other in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local okey = ARGV[11] .. other
  if redis.call('HGET', okey, 'address') == ARGV[4] then
    redis.call('DEL', okey)
    redis.call('SREM', KEYS[2], other)
    redis.call('ZREM', KEYS[3], other)
    redis.call('ZREM', KEYS[7], other)
    table.insert(superseded, other)
  end
end
local epoch = next_counter(KEYS[5], now_us)
redis.call('HSET', KEYS[1],
  'schema', ARGV[12], 'pipeline', ARGV[2], 'stage_id', ARGV[3], 'address', ARGV[4],
  'host_id', ARGV[5], 'capacity', ARGV[6], 'labels', ARGV[7], 'state', ARGV[14],
  'standby', ARGV[14] == 'standby' and '1' or '0',
  'reason', '', 'epoch', ms(epoch), 'registered_at_ms', ms(now),
  'last_heartbeat_ms', ms(now), 'load', ARGV[8], 'pool', KEYS[2], 'settings', ARGV[13])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[6], ARGV[2])
redis.call('ZADD', KEYS[3], ms(now + tonumber(ARGV[9])), ARGV[1])
local version = bump(KEYS[4], ARGV[10], now_us)
return {ms(epoch), ms(version), ms(now), superseded}
"""
)

# KEYS: inst, leases, evict
# ARGV: id, load_json, lease_ttl_ms, version_prefix, channel_prefix, unreachable_reason,
#       readmit_grace_ms, fingerprint_prefix
# Returns {0} when unknown, {2, setting, theirs, ours} when the instance comes back (its lease
# had lapsed, or it is readmitted) with a pipeline-wide setting that disagrees with the
# pipeline's fingerprint (replaced while it was away: nothing is changed, the lease is not
# renewed), else {1, epoch, state, reason, revived, previous_reason}. An instance isolated only
# because its lease lapsed is healthy again (standby, if it was never promoted), and so is one
# isolated because a probe could not
# reach it, once ``readmit_grace_ms`` have passed since (a heartbeat sent just before the process
# died may arrive after the isolation: it must not readmit a dead instance). Operator isolation
# and draining are kept.
HEARTBEAT = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0}
end
local now, now_us = clock()
local f = redis.call('HMGET', KEYS[1], 'state', 'reason', 'epoch', 'pipeline', 'isolated_at_ms',
  'settings', 'standby')
local state, reason, revived = f[1], f[2], 0
local readmit = false
if state == 'isolated' then
  if reason == 'lease_expired' then
    readmit = true
  elseif reason == ARGV[6] then
    readmit = now >= (tonumber(f[5]) or 0) + tonumber(ARGV[7])
  end
end
local lease = redis.call('ZSCORE', KEYS[2], ARGV[1])
if (readmit or not lease or tonumber(lease) < now) and f[6] and f[6] ~= '' then
  local ours = cjson.decode(f[6])
  local names = {}
  for name, _ in pairs(ours) do table.insert(names, name) end
  table.sort(names)
  local fingerprint = ARGV[8] .. f[4]
  for _, name in ipairs(names) do
    local theirs = redis.call('HGET', fingerprint, name)
    if theirs and theirs ~= ours[name] then
      return {2, name, theirs, ours[name]}
    end
  end
  for _, name in ipairs(names) do
    redis.call('HSET', fingerprint, name, ours[name])
  end
end
redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ms(now), 'load', ARGV[2])
redis.call('ZADD', KEYS[2], ms(now + tonumber(ARGV[3])), ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if readmit then
  local home = f[7] == '1' and 'standby' or 'healthy'
  redis.call('HSET', KEYS[1], 'state', home, 'reason', '')
  bump(ARGV[4] .. f[4], ARGV[5] .. f[4], now_us)
  state, reason, revived = home, '', 1
end
return {1, f[3], state, reason, revived, f[2]}
"""
)

# KEYS: inst, leases, evict
# ARGV: id, pool_prefix, version_prefix, channel_prefix
# Returns {0} when unknown, else {1, pipeline, stage_id, version}.
DEREGISTER = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0}
end
local now, now_us = clock()
local f = redis.call('HMGET', KEYS[1], 'pipeline', 'stage_id', 'pool')
redis.call('DEL', KEYS[1])
redis.call('SREM', f[3] or (ARGV[2] .. f[1] .. ':' .. f[2]), ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local version = bump(ARGV[3] .. f[1], ARGV[4] .. f[1], now_us)
return {1, f[1], f[2], ms(version)}
"""
)

# KEYS: inst, leases
# ARGV: id, action (isolate | readmit | drain | promote), reason, version_prefix, channel_prefix
# Returns {0} when unknown, else {1, state, reason, changed}. Readmitting an instance whose
# lease has lapsed leaves it isolated with reason lease_expired: its next heartbeat readmits it.
# A readmitted standby that was never promoted is a standby again. Promote turns a standby into
# a healthy instance for good; it changes nothing in any other state.
SET_STATE = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0}
end
local now, now_us = clock()
local f = redis.call('HMGET', KEYS[1], 'state', 'reason', 'pipeline', 'standby')
local action = ARGV[2]
local state, reason
if action == 'isolate' then
  state, reason = 'isolated', ARGV[3]
elseif action == 'drain' then
  state, reason = 'draining', ARGV[3]
elseif action == 'promote' then
  state, reason = f[1], f[2]
  if f[1] == 'standby' then
    state, reason = 'healthy', ''
    redis.call('HSET', KEYS[1], 'standby', '0')
  end
else
  local lease = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if lease and tonumber(lease) > now then
    state, reason = f[4] == '1' and 'standby' or 'healthy', ''
  else
    state, reason = 'isolated', 'lease_expired'
  end
end
local changed = 0
if state ~= f[1] or reason ~= f[2] then
  redis.call('HSET', KEYS[1], 'state', state, 'reason', reason)
  bump(ARGV[4] .. f[3], ARGV[5] .. f[3], now_us)
  changed = 1
end
return {1, state, reason, changed}
"""
)

# KEYS: inst
# ARGV: id, reason, version_prefix, channel_prefix
# Returns {0} when unknown, else {1, state, reason, changed}. Isolates the instance with
# ``reason`` only if it is healthy now (a draining or already isolated instance keeps its state
# and reason: a probe failure must not overwrite an operator's decision), and notes when.
ISOLATE_IF_HEALTHY = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0}
end
local f = redis.call('HMGET', KEYS[1], 'state', 'reason', 'pipeline')
if f[1] ~= 'healthy' then
  return {1, f[1], f[2], 0}
end
local now, now_us = clock()
redis.call('HSET', KEYS[1], 'state', 'isolated', 'reason', ARGV[2], 'isolated_at_ms', ms(now))
bump(ARGV[3] .. f[3], ARGV[4] .. f[3], now_us)
return {1, 'isolated', ARGV[2], 1}
"""
)

# KEYS: sweeper_lock, leases, evict
# ARGV: token, lock_ttl_ms, evict_after_ms, limit, instance_prefix, pool_prefix,
#       version_prefix, channel_prefix
# Returns {0} when the caller does not hold the lock (nothing done), else
# {1, {{kind, id, pipeline, stage_id, previous_state}, ...}} with kind "expired" or "evicted".
# Renews the lock. Every instance whose lease lapsed is scheduled for eviction; healthy and
# draining ones become isolated (lease_expired); operator-isolated ones keep their reason.
SWEEP = (
    _PRELUDE
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0}
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local now, now_us = clock()
local limit = tonumber(ARGV[4])
local events, touched = {}, {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ms(now), 'LIMIT', 0, limit)) do
  redis.call('ZREM', KEYS[2], id)
  local key = ARGV[5] .. id
  if redis.call('EXISTS', key) == 1 then
    local f = redis.call('HMGET', key, 'state', 'pipeline', 'stage_id')
    redis.call('ZADD', KEYS[3], ms(now + tonumber(ARGV[3])), id)
    if f[1] ~= 'isolated' then
      redis.call('HSET', key, 'state', 'isolated', 'reason', 'lease_expired')
      touched[f[2]] = true
      table.insert(events, {'expired', id, f[2], f[3], f[1]})
    end
  end
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ms(now), 'LIMIT', 0, limit)) do
  redis.call('ZREM', KEYS[3], id)
  local key = ARGV[5] .. id
  if redis.call('EXISTS', key) == 1 then
    local f = redis.call('HMGET', key, 'state', 'pipeline', 'stage_id', 'pool')
    redis.call('DEL', key)
    redis.call('SREM', f[4] or (ARGV[6] .. f[2] .. ':' .. f[3]), id)
    redis.call('ZREM', KEYS[2], id)
    touched[f[2]] = true
    table.insert(events, {'evicted', id, f[2], f[3], f[1]})
  end
end
for pipeline, _ in pairs(touched) do
  bump(ARGV[7] .. pipeline, ARGV[8] .. pipeline, now_us)
end
return {1, events}
"""
)

# KEYS: lock.  ARGV: token, ttl_ms.  Takes the lock if free, renews it if the caller holds it;
# returns 1 when the caller holds it afterwards.
ACQUIRE_LOCK = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lock.  ARGV: token.  Deletes the lock only if the caller holds it.
RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: version, pool_1 .. pool_n
# ARGV: instance_prefix, healthy_only ("1" or "0")
# Returns {version, now_ms, {pool_1 records}, ..., {pool_n records}}; a record is
# {id, field, value, field, value, ...}. One consistent read of version and pools.
SNAPSHOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local version = redis.call('GET', KEYS[1]) or '0'
local out = {version, now}
for i = 2, #KEYS do
  local records = {}
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    local key = ARGV[1] .. id
    if ARGV[2] == '0' or redis.call('HGET', key, 'state') == 'healthy' then
      local h = redis.call('HGETALL', key)
      if #h > 0 then
        table.insert(h, 1, id)
        table.insert(records, h)
      end
    end
  end
  table.insert(out, records)
end
return out
"""

# KEYS: sweeper_lock, scale_policy, scale_decision
# ARGV: token, decision_json, policy_json
# Returns 1 when written, 0 when ``token`` does not hold the sweeper lock (only its holder
# decides), -1 when the policy was removed or replaced since it was read (decided on stale
# knobs: the next tick decides again).
SAVE_SCALE_DECISION = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return -1
end
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""

# KEYS: scale_stages, scale_policy, scale_decision
# ARGV: member, policy_json, initial_decision_json
# Stores the policy; the initial decision only where the stage has none yet (a repeated PUT
# keeps the current decision). Returns 1 when the initial decision was stored, else 0.
PUT_SCALE_POLICY = """
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SET', KEYS[3], ARGV[3])
  return 1
end
return 0
"""
