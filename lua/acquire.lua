-- acquire.lua: take a slot of a per-key limit for one run of a task, if fewer than `max`
-- hold one. The holders are a sorted set scored by when each lease runs out; leases that
-- ran out are dropped here first, in the same step, so a worker that died holding a slot
-- gives it back once its lease is over (nobody else has to notice).
-- KEYS[1]  the key's holders   <prefix>:limit:{<digest>}  (sorted set: holder -> expiry ms)
-- ARGV[1]  the holder id (one per run of a task: a duplicate run is another holder)
-- ARGV[2]  max: the most holders at once
-- ARGV[3]  the lease, ms
-- ARGV[4]  now, ms ("": the Redis server's clock, one clock for every worker; the model
--          test passes its own)
-- returns  {"acquired", n}         a slot is this holder's until now + lease; n hold one now
--          {"held", n}             the holder had one already: its lease starts again
--          {"busy", n, left_ms}    n (>= max) hold one: nothing changed but the expired
--                                  leases dropped; the first lease runs out in left_ms
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local lease = tonumber(ARGV[3])
redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", now)
local verdict = "acquired"
if redis.call("ZSCORE", KEYS[1], ARGV[1]) then
  verdict = "held"
else
  local n = redis.call("ZCARD", KEYS[1])
  if n >= tonumber(ARGV[2]) then
    local first = redis.call("ZRANGE", KEYS[1], 0, 0, "WITHSCORES")
    return {"busy", tostring(n), tostring(tonumber(first[2]) - now)}
  end
end
redis.call("ZADD", KEYS[1], now + lease, ARGV[1])
-- The key goes with its last lease: a key nobody uses again leaves nothing behind.
local last = redis.call("ZRANGE", KEYS[1], -1, -1, "WITHSCORES")
redis.call("PEXPIRE", KEYS[1], math.max(1, tonumber(last[2]) - now))
return {verdict, tostring(redis.call("ZCARD", KEYS[1]))}
