-- cancel.lua: end a program that is still pending or running, wherever its cursor stands.
-- Used for `shardflow cancel` and for a program's deadline. Nothing moves a program after it.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  end status: cancelled | failed
-- ARGV[2]  reason, recorded as the program's error
-- ARGV[3]  retention in ms: every key of the program expires after this ("0": kept forever;
--          see advance.lua)
-- ARGV[4]  the run (epoch) a deadline belongs to, or "" (a user's cancel: whatever run)
-- ARGV[5]  "1" when the program names compensations: it becomes compensating instead (its
--          `cause` ARGV[1]; no expiry yet), and its owner runs them (saga compensation).
--          A cancel or deadline of a compensating program changes nothing ("ended"): its
--          compensations go on (a cancel that races a failure, or is retried, is harmless)
-- ARGV[6]  "1": stop the compensations (`shardflow cancel --stop-compensations`): a
--          compensating program ends compensation_failed, `saga_error` naming the reason;
--          any other program is cancelled as without it
-- returns  {"applied", status, owner}  ended now
--          {"ended", status, owner}    it had already ended: nothing changes
--          {"stale", status, owner}    live, but in another run than ARGV[4]: nothing changes
--          {"missing", "", ""}         no such program
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "owner", "from", "epoch")
local status, cursor, owner = s[1], s[2], s[3]
if not status then
  return {"missing", "", ""}
end
local epoch = ARGV[4] or ""
local base = string.sub(KEYS[1], 1, -6)
local keep_ms = tonumber(ARGV[3] or "0") or 0
local function expire()
  if keep_ms > 0 then
    for _, key in ipairs(redis.call("SMEMBERS", base .. "keys")) do
      redis.call("PEXPIRE", key, keep_ms)
    end
    redis.call("PEXPIRE", base .. "keys", keep_ms)
    redis.call("PEXPIRE", base .. "plan", keep_ms)
    redis.call("PEXPIRE", KEYS[1], keep_ms)
  end
end
local t = redis.call("TIME")
local now = string.format("%d", t[1] * 1000 + math.floor(t[2] / 1000))
if status == "compensating" and ARGV[6] == "1" then
  redis.call("HSET", KEYS[1], "status", "compensation_failed", "saga_error",
    "compensations stopped by a cancel: " .. ARGV[2], "updated_ms", now, "ended_ms", now)
  expire()
  return {"applied", "compensation_failed", owner}
end
if status ~= "pending" and status ~= "running" then
  return {"ended", status, owner}
end
if epoch ~= "" and epoch ~= (s[5] or "0") then
  return {"stale", status, owner}
end
if ARGV[5] == "1" then
  redis.call("HSET", KEYS[1], "status", "compensating", "cause", ARGV[1], "error", ARGV[2],
    "cursor", "", "from", cursor, "updated_ms", now, "prior", s[4] or "")
  return {"applied", "compensating", owner}
end
redis.call("HSET", KEYS[1], "status", ARGV[1], "error", ARGV[2], "cursor", "", "from", cursor,
  "updated_ms", now, "ended_ms", now, "prior", s[4] or "")
expire()
return {"applied", ARGV[1], owner}
