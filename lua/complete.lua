-- complete.lua: record a step's outputs: one task's, or any members of a bag at once (a chunk
-- that ran together), each with its place in the join barrier.
-- The first output recorded for a member wins; a re-run or duplicate changes nothing.
-- A single task:
--   KEYS[1]    state hash          <prefix>:{<wf>}:state
--   KEYS[2]    its output          <prefix>:{<wf>}:out:<path>
--   ARGV[1]    the leaf's path (must be the program's cursor)
--   ARGV[2]    output JSON
-- A bag:
--   KEYS[1]    state hash
--   KEYS[2]    barrier set         <prefix>:{<wf>}:bar:<path>
--   KEYS[3..]  every member's output key, in bag order: ...:out:<path>/bag:<i>
--   ARGV[1]    the leaf's path
--   ARGV[2..]  pairs: member index (from 0), its output JSON
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
  if redis.call("SET", KEYS[2], ARGV[2], "NX") then
    verdict = "fire"
  end
  return {verdict, redis.call("GET", KEYS[2])}
end
local verdict = "again"
for k = 2, #ARGV, 2 do
  if redis.call("SADD", KEYS[2], ARGV[k]) == 1 then
    redis.call("SET", KEYS[3 + tonumber(ARGV[k])], ARGV[k + 1])
    verdict = "fire"
  end
end
if redis.call("SCARD", KEYS[2]) < #KEYS - 2 then
  return {"wait"}
end
local outputs = redis.call("MGET", unpack(KEYS, 3, #KEYS))
return {verdict, unpack(outputs)}
