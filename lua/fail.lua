-- fail.lua: record one failed attempt of a task once, and say whether it may be tried again.
-- KEYS[1]  state hash     <prefix>:{<wf>}:state
-- KEYS[2]  failures hash  <prefix>:{<wf>}:err:<path>   field "<index>:<attempt>" = error
-- ARGV[1]  the leaf's path (must be the program's cursor)
-- ARGV[2]  member index ("0" for a single task)
-- ARGV[3]  attempt that failed, from 0
-- ARGV[4]  error text
-- ARGV[5]  max attempts
-- returns  {"retry"}                 first report of this attempt: schedule attempt + 1
--          {"exhausted", error...}   first report of the last attempt: every attempt's error
--          {"again", ...}            this attempt was reported before (same reply otherwise)
--          {"stale", status, cursor} the program is elsewhere or ended: nothing recorded
local s = redis.call("HMGET", KEYS[1], "status", "cursor")
if s[1] ~= "running" or s[2] ~= ARGV[1] then
  return {"stale", s[1] or "", s[2] or ""}
end
local attempt = tonumber(ARGV[3])
local first = redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4]) == 1
local verdict = "again"
if attempt + 1 < tonumber(ARGV[5]) then
  if first then verdict = "retry" end
  return {verdict}
end
if first then verdict = "exhausted" end
local errors = {verdict}
for a = 0, attempt do
  errors[#errors + 1] = redis.call("HGET", KEYS[2], ARGV[2] .. ":" .. a) or "?"
end
return errors
