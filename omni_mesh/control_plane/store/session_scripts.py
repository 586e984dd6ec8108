"""Lua scripts of the realtime-session state (``sessions.py``), each one atomic.

A session hash carries the fields of ``keys.SESSION_FIELDS`` and one ``item:{id}`` field per
item. Every write sets the key's PX expiry and the session's score in its pipeline's
``sessions`` zset to the same deadline (Redis server time), so counting by zset and expiry
agree. The zset key is built from the prefix passed in ARGV and the pipeline read from the
hash (a claim knows only the session id). Item ids match ``^[A-Za-z0-9_.:-]+$`` (checked by
the API), so the order list is written as JSON without escaping.

Writes answer a summary ``{'ok', pipeline, owner, epoch, item_count, size, updated_ms, ttl_ms}``
or a refusal ``{'missing'}``, ``{'exists'}``, ``{'fenced', epoch, owner}``,
``{'too_large', size}``, ``{'too_many', count}``, ``{'bad_order', item_id, why}``.
"""

from __future__ import annotations

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function fmt(n)
  return string.format('%d', n)
end
local function order_json(ids)
  if #ids == 0 then return '[]' end
  return '["' .. table.concat(ids, '","') .. '"]'
end
local function stamp(key, sessions_prefix, id, pipeline, ttl, now)
  redis.call('HSET', key, 'updated_ms', fmt(now))
  redis.call('PEXPIRE', key, ttl)
  redis.call('ZADD', sessions_prefix .. pipeline, fmt(now + ttl), id)
end
local function summary(key, ttl)
  local f = redis.call('HMGET', key, 'pipeline', 'owner', 'epoch', 'order', 'size', 'updated_ms')
  local count = #cjson.decode(f[4])
  return {'ok', f[1], f[2], tonumber(f[3]), count, tonumber(f[5]), tonumber(f[6]), ttl}
end
"""

# KEYS: session, sessions (of its pipeline)
# ARGV: session_id, pipeline, owner, config_json, owned_ttl_ms, released_ttl_ms, max_bytes
CREATE = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'exists'}
end
local size = #ARGV[4] + 2
if size > tonumber(ARGV[7]) then
  return {'too_large', size}
end
local now = now_ms()
local ttl = tonumber(ARGV[6])
if ARGV[3] ~= '' then ttl = tonumber(ARGV[5]) end
redis.call('HSET', KEYS[1], 'pipeline', ARGV[2], 'owner', ARGV[3], 'epoch', '1',
  'config', ARGV[4], 'order', '[]', 'size', fmt(size), 'updated_ms', fmt(now))
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now))
redis.call('ZADD', KEYS[2], fmt(now + ttl), ARGV[1])
return summary(KEYS[1], ttl)
"""
)

# KEYS: session
# ARGV: session_id, owner, owned_ttl_ms, sessions_prefix
# Answers the summary followed by config, order and every item's JSON in order.
CLAIM = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
local now = now_ms()
local ttl = tonumber(ARGV[3])
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
local pipeline = redis.call('HGET', KEYS[1], 'pipeline')
stamp(KEYS[1], ARGV[4], ARGV[1], pipeline, ttl, now)
local out = summary(KEYS[1], ttl)
local config_order = redis.call('HMGET', KEYS[1], 'config', 'order')
table.insert(out, config_order[1])
table.insert(out, config_order[2])
for _, item_id in ipairs(cjson.decode(config_order[2])) do
  table.insert(out, redis.call('HGET', KEYS[1], 'item:' .. item_id) or 'null')
end
return out
"""
)

# KEYS: session
# ARGV: session_id, epoch, owned_ttl_ms, sessions_prefix, max_bytes, max_items,
#       has_config ('0'/'1'), config_json, has_order, order_json, n_put,
#       then n_put (item_id, item_json) pairs, then the ids to delete
PATCH = (
    _PRELUDE
    + """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  return {'missing'}
end
local f = redis.call('HMGET', key, 'epoch', 'owner', 'order', 'size', 'pipeline')
if f[1] ~= ARGV[2] or f[2] == '' then
  return {'fenced', tonumber(f[1]), f[2]}
end
local order = cjson.decode(f[3])
local present = {}
for _, item_id in ipairs(order) do present[item_id] = true end
local count = #order
local size = tonumber(f[4])
local n_put = tonumber(ARGV[11])
local first_del = 12 + 2 * n_put
local deleted = {}
for i = first_del, #ARGV do
  local item_id = ARGV[i]
  if present[item_id] then
    size = size - redis.call('HSTRLEN', key, 'item:' .. item_id)
    present[item_id] = nil
    deleted[item_id] = true
    count = count - 1
  end
end
local added = {}
for i = 12, first_del - 1, 2 do
  local item_id = ARGV[i]
  if present[item_id] then
    size = size - redis.call('HSTRLEN', key, 'item:' .. item_id)
  else
    present[item_id] = true
    count = count + 1
    table.insert(added, item_id)
  end
  size = size + #ARGV[i + 1]
end
if count > tonumber(ARGV[6]) then
  return {'too_many', count}
end
local new_order = {}
if ARGV[9] == '1' then
  new_order = cjson.decode(ARGV[10])
  local listed = {}
  for _, item_id in ipairs(new_order) do
    if not present[item_id] then
      return {'bad_order', item_id, 'unknown'}
    end
    listed[item_id] = true
  end
  for item_id, _ in pairs(present) do
    if not listed[item_id] then
      return {'bad_order', item_id, 'missing'}
    end
  end
else
  for _, item_id in ipairs(order) do
    if not deleted[item_id] then table.insert(new_order, item_id) end
  end
  for _, item_id in ipairs(added) do table.insert(new_order, item_id) end
end
local encoded = order_json(new_order)
size = size - #f[3] + #encoded
if ARGV[7] == '1' then
  size = size - redis.call('HSTRLEN', key, 'config') + #ARGV[8]
end
if size > tonumber(ARGV[5]) then
  return {'too_large', size}
end
for item_id, _ in pairs(deleted) do
  redis.call('HDEL', key, 'item:' .. item_id)
end
for i = 12, first_del - 1, 2 do
  redis.call('HSET', key, 'item:' .. ARGV[i], ARGV[i + 1])
end
if ARGV[7] == '1' then
  redis.call('HSET', key, 'config', ARGV[8])
end
redis.call('HSET', key, 'order', encoded, 'size', fmt(size))
local ttl = tonumber(ARGV[3])
stamp(key, ARGV[4], ARGV[1], f[5], ttl, now_ms())
return summary(key, ttl)
"""
)

# KEYS: session
# ARGV: session_id, epoch, ttl_ms, sessions_prefix
# Releasing twice with the same epoch only resets the TTL.
RELEASE = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
local f = redis.call('HMGET', KEYS[1], 'epoch', 'owner', 'pipeline')
if f[1] ~= ARGV[2] then
  return {'fenced', tonumber(f[1]), f[2]}
end
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'owner', '')
stamp(KEYS[1], ARGV[4], ARGV[1], f[3], ttl, now_ms())
return summary(KEYS[1], ttl)
"""
)

# KEYS: one session key per id
# ARGV: owner, owned_ttl_ms, sessions_prefix, then the session ids (in KEYS' order)
# Returns {renewed ids, lost ids}: lost ones are gone or held by someone else (or nobody).
TOUCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local renewed, lost = {}, {}
for i, key in ipairs(KEYS) do
  local id = ARGV[i + 3]
  local f = redis.call('HMGET', key, 'owner', 'pipeline')
  if f[1] == ARGV[1] then
    redis.call('PEXPIRE', key, ttl)
    redis.call('ZADD', ARGV[3] .. f[2], string.format('%d', now + ttl), id)
    table.insert(renewed, id)
  else
    table.insert(lost, id)
  end
end
return {renewed, lost}
"""

# KEYS: session
# ARGV: session_id, sessions_prefix
# Returns 1 when the session existed.
DELETE = """
local pipeline = redis.call('HGET', KEYS[1], 'pipeline')
if not pipeline then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[2] .. pipeline, ARGV[1])
return 1
"""

# KEYS: sessions (of one pipeline)
# ARGV: session_prefix
# Prunes entries past their deadline (or whose hash is gone) and returns {owned, released}.
COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
local owned, released = 0, 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local owner = redis.call('HGET', ARGV[1] .. id, 'owner')
  if not owner then
    redis.call('ZREM', KEYS[1], id)
  elseif owner == '' then
    released = released + 1
  else
    owned = owned + 1
  end
end
return {owned, released}
"""
