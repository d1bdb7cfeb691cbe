-- renew.lua: a holder still running its task starts its lease again.
-- KEYS[1]  the key's holders   <prefix>:limit:{<digest>}
-- ARGV[1]  the holder id
-- ARGV[2]  the lease, ms
-- ARGV[3]  now, ms ("": the Redis server's clock)
-- returns  {"renewed"}  the lease runs until now + lease
--          {"lost"}     the holder is not in the set: its lease ran out and an acquire
--                       dropped it (its slot may be another's now): nothing is written
-- A lease past its expiry that is still in the set is renewed: no acquire ran since it ran
-- out (each drops the expired first), so nobody counted its slot as free.
local now = tonumber(ARGV[3])
if not now then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
if not redis.call("ZSCORE", KEYS[1], ARGV[1]) then
  return {"lost"}
end
redis.call("ZADD", KEYS[1], "XX", now + tonumber(ARGV[2]), ARGV[1])
local last = redis.call("ZRANGE", KEYS[1], -1, -1, "WITHSCORES")
redis.call("PEXPIRE", KEYS[1], math.max(1, tonumber(last[2]) - now))
return {"renewed"}
