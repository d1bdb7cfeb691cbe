-- stash.lua: keep large values a task message refers to instead of carrying them: the
-- program's input, or a leaf's prev. Written once (NX): a replay stores the same value.
-- KEYS[1]     state hash   <prefix>:{<wf>}:state
-- KEYS[2..]   blob keys    <prefix>:{<wf>}:blob:<name>
-- ARGV[1..]   their values, in the same order
-- returns  "ok"     stored (or already there), and named in the program's registry
--          "ended"  the program has ended or does not exist: nothing stored, nothing to run
local status = redis.call("HGET", KEYS[1], "status")
if status ~= "pending" and status ~= "running" and status ~= "compensating" then
  return "ended"
end
local registry = string.sub(KEYS[1], 1, -6) .. "keys"
for k = 2, #KEYS do
  redis.call("SET", KEYS[k], ARGV[k - 1], "NX")
  redis.call("SADD", registry, KEYS[k])
end
return "ok"
