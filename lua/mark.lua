-- mark.lua: write one field of a program's mark for `explain` (a failed attempt, a wait for a
-- slot), named in its registry, only while the program is there. A late mark (its program
-- purged or expired since the caller looked) wrote a registry with no expiry, for good.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- KEYS[2]  the mark     <prefix>:{<wf>}:attempts | <prefix>:{<wf>}:limits (a hash)
-- ARGV[1]  field, ARGV[2] value
-- returns  "marked" | "missing" (no such program: nothing written)
if not redis.call("HGET", KEYS[1], "status") then
  return "missing"
end
local registry = string.sub(KEYS[1], 1, -6) .. "keys"
redis.call("HSET", KEYS[2], ARGV[1], ARGV[2])
redis.call("SADD", registry, KEYS[2])
-- An ended program expires with its state: the mark and the registry go with it (the registry
-- is new when no key was registered before the end). A live one's state has no expiry.
local left = redis.call("PTTL", KEYS[1])
if left > 0 then
  redis.call("PEXPIRE", KEYS[2], left)
  redis.call("PEXPIRE", registry, left)
end
return "marked"
