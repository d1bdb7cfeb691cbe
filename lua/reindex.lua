-- reindex.lua: a new program of an id whose index entry was an earlier program's (expired or
-- purged, then submitted again) takes its own time there: never an earlier one, and again if
-- a purge took the entry out meanwhile. ZADD GT would do it, but needs Redis 6.2.
-- KEYS[1]  <prefix>:index:created (no program's key)
-- ARGV[1]  id, ARGV[2] the new program's creation time in ms
-- returns  1 when the entry moved (or came back), else 0
local score = redis.call("ZSCORE", KEYS[1], ARGV[1])
if score and tonumber(score) >= tonumber(ARGV[2]) then
  return 0
end
redis.call("ZADD", KEYS[1], ARGV[2], ARGV[1])
return 1
