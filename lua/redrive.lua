-- redrive.lua: open an ended (failed or cancelled) program for a new run, in one step.
-- The run that ended is kept in the state's history; the epoch goes up, so every message of
-- the earlier run is stale from now on (advance, complete, fail and cancel compare it). The
-- program becomes pending with no cursor: its owner's `start` then runs it again from
-- `rerun` (its prev read from the output of `prior`), as a start runs a new program.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  the epoch the caller read ("0" when absent): another one means it changed since
-- ARGV[2]  the path to run again ("" for the first step), kept as `rerun`
-- ARGV[3]  the leaf whose output is its prev ("" for none), kept as `prior`
-- ARGV[4]  the ended run's record, kept as the field run:<epoch>
-- ARGV[5]  runs kept in the history (older records go)
-- ARGV[6]  step paths whose keys go, space-separated: a key goes when its path is one of
--          them or under one ("2" takes out:2, out:2/bag:0, err:2, 2/iter:0/..., blob:2)
-- returns  {"applied", status, epoch, owner}  a new run: pending, to be started by its owner
--          {"refused", status, epoch, owner}  live or completed: nothing changes
--          {"changed", status, epoch, owner}  ended, but not in the epoch the caller read
--          {"missing", "", "", ""}            no such program (or it expired, or was purged)
local s = redis.call("HMGET", KEYS[1], "status", "epoch", "owner")
local status, epoch, owner = s[1], s[2] or "0", s[3] or "0"
if not status then
  return {"missing", "", "", ""}
end
if status ~= "failed" and status ~= "cancelled" then
  return {"refused", status, epoch, owner}
end
if epoch ~= ARGV[1] then
  return {"changed", status, epoch, owner}
end
local t = redis.call("TIME")
local now = string.format("%d", t[1] * 1000 + math.floor(t[2] / 1000))
local n = tonumber(epoch)
local keep = tonumber(ARGV[5]) or 1
redis.call("HSET", KEYS[1], "run:" .. epoch, ARGV[4])
if n - keep >= 0 then
  redis.call("HDEL", KEYS[1], "run:" .. string.format("%d", n - keep))
end
local next_epoch = string.format("%d", n + 1)
redis.call("HSET", KEYS[1], "status", "pending", "epoch", next_epoch, "cursor", "", "from", "",
  "rerun", ARGV[2], "prior", ARGV[3], "updated_ms", now)
redis.call("HDEL", KEYS[1], "error", "result", "ended_ms")
local base = string.sub(KEYS[1], 1, -6)  -- "<prefix>:{<wf>}:" without "state"
local registry = base .. "keys"
local roots = {}
for root in string.gmatch(ARGV[6], "%S+") do
  roots[#roots + 1] = root
end
local function goes(path)
  for _, root in ipairs(roots) do
    if path == root or string.sub(path, 1, #root + 1) == root .. "/" then
      return true
    end
  end
  return false
end
for _, key in ipairs(redis.call("SMEMBERS", registry)) do
  local name = string.sub(key, #base + 1)
  local path = string.match(name, "^%a+:(.*)$") or ""
  if key ~= base .. "attempts" and goes(path) then
    redis.call("DEL", key)
    redis.call("SREM", registry, key)
  else
    redis.call("PERSIST", key)
  end
end
local marks = base .. "attempts"
for _, name in ipairs(redis.call("HKEYS", marks)) do
  if goes(name) then
    redis.call("HDEL", marks, name)
  end
end
redis.call("PERSIST", registry)
redis.call("PERSIST", base .. "plan")
redis.call("PERSIST", KEYS[1])
return {"applied", "pending", next_epoch, owner}
