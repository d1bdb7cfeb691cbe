-- advance.lua: compare-and-advance a program's cursor; the only way a program moves or ends.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  expected cursor: the leaf that just finished ("" for start)
-- ARGV[2]  new cursor: the next leaf ("" when the program ends)
-- ARGV[3]  new status: running | completed | failed
-- ARGV[4]  field for the payload: "result", "error" or "" for none
-- ARGV[5]  payload JSON
-- ARGV[6]  the new leaf's shape: "task", "bag:<size>", or "" when the program ends; complete
--          and fail refuse reports that do not fit it
-- ARGV[7]  retention in ms: when the program ends, every key it owns expires after this
--          ("0" or absent: kept forever)
-- ARGV[8]  a loop iteration to drop, as a path prefix ("3/iter:4/"), or "": the new leaf
--          starts a new iteration and the loop keeps only its last ones (its keys, and its
--          fields in <prefix>:{<wf>}:attempts)
-- ARGV[9]  the run (epoch) the message belongs to, or "" (a start: any run): a message of
--          another run (before a redrive, see redrive.lua) is stale
-- When the program ends, the cursor before the last one is kept as `prior` (redrive reruns
-- from the last cursor, whose prev is the output of `prior`).
-- KEYS[2..] the outputs of steps that other steps read, <prefix>:{<wf>}:ref:<id>, with their
--          JSON in ARGV[10..] (KEYS[n] <- ARGV[n + 8]): the steps the new cursor moved past
--          that carry a referenced id; written (latest wins) and registered only when the
--          advance applies
-- The program's other keys are named in its registry <prefix>:{<wf>}:keys; all share the
-- program's hash tag, so they live in KEYS[1]'s cluster slot.
-- returns  {verdict, status, cursor} where verdict is
--   applied  the transition happened now: publish what it produces
--   replay   it already happened (cursor moved from ARGV[1]): a redelivery publishes again
--   stale    the message is older than the program's state: ignore it
--   missing  no such program
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "from", "epoch")
local status, cursor, from = s[1], s[2], s[3]
if not status then
  return {"missing", "", ""}
end
local epoch = ARGV[9] or ""
if epoch ~= "" and epoch ~= (s[4] or "0") then
  return {"stale", status, cursor}
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
  if ARGV[3] ~= "running" then
    redis.call("HSET", KEYS[1], "prior", from or "")
  end
  local base = string.sub(KEYS[1], 1, -6)  -- "<prefix>:{<wf>}:" without "state"
  local registry = base .. "keys"
  for i = 2, #KEYS do
    redis.call("SET", KEYS[i], ARGV[i + 8])
    redis.call("SADD", registry, KEYS[i])
  end
  local drop = ARGV[8] or ""
  if drop ~= "" then
    for _, key in ipairs(redis.call("SMEMBERS", registry)) do
      local name = string.sub(key, #base + 1)
      local path = string.match(name, "^%a+:(.*)$") or ""
      if string.sub(path .. "/", 1, #drop) == drop then  -- "3/iter:4" (a wait) goes too
        redis.call("DEL", key)
        redis.call("SREM", registry, key)
      end
    end
    -- the owner's marks of failed attempts (orchestrator/marks.py) go with their iteration
    local marks = base .. "attempts"
    for _, name in ipairs(redis.call("HKEYS", marks)) do
      if string.sub(name, 1, #drop) == drop then
        redis.call("HDEL", marks, name)
      end
    end
  end
  local keep_ms = tonumber(ARGV[7] or "0") or 0
  if ARGV[3] ~= "running" and keep_ms > 0 then
    for _, key in ipairs(redis.call("SMEMBERS", registry)) do
      redis.call("PEXPIRE", key, keep_ms)
    end
    redis.call("PEXPIRE", registry, keep_ms)
    redis.call("PEXPIRE", base .. "plan", keep_ms)
    redis.call("PEXPIRE", KEYS[1], keep_ms)
  end
  return {"applied", ARGV[3], ARGV[2]}
end
if from == ARGV[1] then
  return {"replay", status, cursor}
end
return {"stale", status, cursor}
