-- submit.lua: record a new program once; submitting an existing id changes nothing.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- KEYS[2]  plan string  <prefix>:{<wf>}:plan   (JSON: program, input, owner)
-- ARGV[1]  plan JSON
-- ARGV[2]  owner shard
-- ARGV[3]  program name
-- ARGV[4]  digest of the program and its input: the same id with another digest is refused
-- returns  {"created"|"exists"|"conflict", status, owner}
local found = redis.call("HMGET", KEYS[1], "status", "owner", "digest")
if found[1] then
  if found[3] and found[3] ~= ARGV[4] then
    return {"conflict", found[1], found[2]}
  end
  return {"exists", found[1], found[2]}
end
local t = redis.call("TIME")
local now = string.format("%d", t[1] * 1000 + math.floor(t[2] / 1000))
redis.call("SET", KEYS[2], ARGV[1])
redis.call("HSET", KEYS[1], "status", "pending", "owner", ARGV[2], "cursor", "", "from", "",
  "name", ARGV[3], "digest", ARGV[4], "created_ms", now)
return {"created", "pending", ARGV[2]}
