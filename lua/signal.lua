-- signal.lua: keep a signal's data for the program's signal step of that name; steps take
-- them first in, first out (take.lua). A signal id already seen changes nothing, so a sender
-- (or the ingress after a redelivery) may send the same signal again safely.
-- KEYS[1]  state hash         <prefix>:{<wf>}:state
-- KEYS[2]  the signal's list  <prefix>:{<wf>}:sig:<name>
-- KEYS[3]  ids seen           <prefix>:{<wf>}:sigids  (sorted set: id -> sequence)
-- ARGV[1]  data JSON
-- ARGV[2]  the signal's id ("" for none: never a duplicate)
-- ARGV[3]  most signals kept, per name, not yet taken
-- ARGV[4]  most ids remembered (the oldest go first)
-- returns  {"kept", n}        kept, n waiting for that name now
--          {"duplicate", ""}  that id was sent already (even if the program has ended since)
--          {"full", n}        n are waiting already: nothing kept
--          {"ended", status}  the program has ended: nothing kept
--          {"missing", ""}    no such program
local status = redis.call("HGET", KEYS[1], "status")
if not status then
  return {"missing", ""}
end
-- A resend of a signal already kept is a duplicate even once the program has ended: a sender
-- that lost the first answer learns it was delivered, not that it came too late.
if ARGV[2] ~= "" and redis.call("ZSCORE", KEYS[3], ARGV[2]) then
  return {"duplicate", ""}
end
if status ~= "pending" and status ~= "running" then
  return {"ended", status}
end
local waiting = redis.call("LLEN", KEYS[2])
if waiting >= tonumber(ARGV[3]) then
  return {"full", tostring(waiting)}
end
local registry = string.sub(KEYS[1], 1, -6) .. "keys"
if ARGV[2] ~= "" then
  local seq = redis.call("HINCRBY", KEYS[1], "signals", 1)
  redis.call("ZADD", KEYS[3], seq, ARGV[2])
  redis.call("ZREMRANGEBYRANK", KEYS[3], 0, -1 - tonumber(ARGV[4]))
  redis.call("SADD", registry, KEYS[3])
end
waiting = redis.call("RPUSH", KEYS[2], ARGV[1])
redis.call("SADD", registry, KEYS[2])
return {"kept", tostring(waiting)}
