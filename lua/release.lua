-- release.lua: a holder gives its slot back (its task completed, failed or was cancelled).
-- KEYS[1]  the key's holders   <prefix>:limit:{<digest>}
-- ARGV[1]  the holder id
-- returns  {"released", n}  the slot is free; n hold one now
--          {"gone", n}      the holder held none (its lease ran out and was dropped, or a
--                           duplicate release): nothing changed; n hold one now
-- Only this holder's slot goes: never another's, whatever the order of the set.
local removed = redis.call("ZREM", KEYS[1], ARGV[1])
local n = redis.call("ZCARD", KEYS[1])
if removed == 1 then
  return {"released", tostring(n)}
end
return {"gone", tostring(n)}
