-- purge.lua: delete an ended program now, with every key it owns; never a live one.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  statuses that may go, comma-separated ("completed,failed,cancelled")
-- ARGV[2]  only if it ended at or before this time (ms since the epoch)
-- returns  "purged" | "live" | "kept" (status or age did not match) | "missing"
local s = redis.call("HMGET", KEYS[1], "status", "ended_ms")
local status, ended = s[1], tonumber(s[2] or "")
if not status then
  return "missing"
end
if status == "pending" or status == "running" or status == "compensating" then
  return "live"
end
if not string.find("," .. ARGV[1] .. ",", "," .. status .. ",", 1, true) then
  return "kept"
end
if not ended or ended > tonumber(ARGV[2]) then
  return "kept"
end
local base = string.sub(KEYS[1], 1, -6)
for _, key in ipairs(redis.call("SMEMBERS", base .. "keys")) do
  redis.call("DEL", key)
end
redis.call("DEL", base .. "keys", base .. "plan", KEYS[1])
return "purged"
