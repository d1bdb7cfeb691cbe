-- complete.lua: record one task's output and, for a bag, its place in the join barrier.
-- The first output recorded for a member wins; a re-run or duplicate changes nothing.
-- KEYS[1]      state hash          <prefix>:{<wf>}:state
-- KEYS[2]      this output         <prefix>:{<wf>}:out:<path>  or  ...:out:<path>/bag:<i>
-- KEYS[3]      barrier set         <prefix>:{<wf>}:bar:<path>  (bags only)
-- KEYS[4..]    every member's output key, in bag order (bags only)
-- ARGV[1]      the leaf's path (must be the program's cursor)
-- ARGV[2]      member index in the bag ("0" for a single task)
-- ARGV[3]      output JSON
-- returns  {"fire", output...}   this call completed the step (the barrier fires once):
--                                every output, in bag order
--          {"again", output...}  the step was already complete: the same outputs, so a
--                                redelivered task can report what a crash may have lost
--          {"wait"}              other members are still running
--          {"stale", status, cursor}  the program is elsewhere or ended: nothing recorded
local s = redis.call("HMGET", KEYS[1], "status", "cursor")
if s[1] ~= "running" or s[2] ~= ARGV[1] then
  return {"stale", s[1] or "", s[2] or ""}
end
if #KEYS == 2 then
  local verdict = "again"
  if redis.call("SET", KEYS[2], ARGV[3], "NX") then
    verdict = "fire"
  end
  return {verdict, redis.call("GET", KEYS[2])}
end
local verdict = "again"
if redis.call("SADD", KEYS[3], ARGV[2]) == 1 then
  redis.call("SET", KEYS[2], ARGV[3])
  verdict = "fire"
end
if redis.call("SCARD", KEYS[3]) < #KEYS - 3 then
  return {"wait"}
end
local outputs = redis.call("MGET", unpack(KEYS, 4, #KEYS))
return {verdict, unpack(outputs)}
