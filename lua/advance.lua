-- advance.lua: compare-and-advance a program's cursor; the only way a program moves or ends.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  expected cursor: the leaf that just finished ("" for start)
-- ARGV[2]  new cursor: the next leaf ("" when the program ends)
-- ARGV[3]  new status: running | completed | failed
-- ARGV[4]  field for the payload: "result", "error" or "" for none
-- ARGV[5]  payload JSON
-- ARGV[6]  the new leaf's shape: "task", "bag:<size>", or "" when the program ends; complete
--          and fail refuse reports that do not fit it
-- returns  {verdict, status, cursor} where verdict is
--   applied  the transition happened now: publish what it produces
--   replay   it already happened (cursor moved from ARGV[1]): a redelivery publishes again
--   stale    the message is older than the program's state: ignore it
--   missing  no such program
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "from")
local status, cursor, from = s[1], s[2], s[3]
if not status then
  return {"missing", "", ""}
end
local live = status == "pending" or status == "running"
if live and cursor == ARGV[1] then
  local t = redis.call("TIME")
  local now = string.format("%d", t[1] * 1000 + math.floor(t[2] / 1000))
  redis.call("HSET", KEYS[1], "status", ARGV[3], "cursor", ARGV[2], "from", ARGV[1],
    "leaf", ARGV[6], "updated_ms", now)
  if status == "pending" then
    redis.call("HSET", KEYS[1], "started_ms", now)
  end
  if ARGV[4] ~= "" then
    redis.call("HSET", KEYS[1], ARGV[4], ARGV[5], "ended_ms", now)
  end
  return {"applied", ARGV[3], ARGV[2]}
end
if from == ARGV[1] then
  return {"replay", status, cursor}
end
return {"stale", status, cursor}
