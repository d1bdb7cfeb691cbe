-- complete.lua: record a step's outputs: one task's, or any members of a bag at once (a chunk
-- that ran together), each with its place in the join barrier.
-- The first output recorded for a member wins; a re-run or duplicate changes nothing.
-- A single task:
--   KEYS[1]    state hash          <prefix>:{<wf>}:state
--   KEYS[2]    its output          <prefix>:{<wf>}:out:<path>
--   ARGV[1]    the leaf's path (must be the program's cursor)
--   ARGV[2]    the run (epoch) of the task: another run's output is stale (see redrive.lua)
--   ARGV[3]    output JSON
-- A bag:
--   KEYS[1]    state hash
--   KEYS[2]    barrier set         <prefix>:{<wf>}:bar:<path>
--   KEYS[3..]  every member's output key, in bag order: ...:out:<path>/bag:<i>
--   ARGV[1]    the leaf's path
--   ARGV[2]    the run (epoch) of the task
--   ARGV[3..]  pairs: member index (from 0), its output JSON
-- returns  {"fire", output...}   this call completed the step (the barrier fires once):
--                                every output, in bag order
--          {"again", output...}  the step was already complete: the same outputs, so a
--                                redelivered task can report what a crash may have lost
--          {"wait"}              other members are still running
--          {"stale", status, cursor}  the program is elsewhere or ended: nothing recorded
--          {"missing"}           no such program
--          {"invalid", reason}   the report does not fit the leaf (its shape recorded by
--                                advance.lua, an index out of range, or a member that is a
--                                parallel branch: its end is advance.lua's): nothing recorded
--          {"late"}              the program is compensating from this step (it failed or
--                                was cancelled there) and the report is of a member started
--                                before (lua/begin.lua): its output is recorded, to be undone
-- "fire" and "again" carry no outputs when together they exceed INLINE bytes: the owner reads
-- them from Redis then (orchestrator/messages.py INLINE_BYTES is the same number).
-- Every key written is named in the program's registry (see advance.lua).
-- A leaf in a parallel branch (a path with `/branch:K/`) is compared with its branch's
-- cursor and leaf, in <prefix>:{<wf>}:cur:<scope> (see advance.lua); status and epoch are the
-- program's. A compensation's leaf (`saga:<step>`) is compared with the saga's cursor,
-- <prefix>:{<wf>}:cur:saga, and only while the program is compensating.
local INLINE = 65536
local base = string.sub(KEYS[1], 1, -6)
local registry = base .. "keys"
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "leaf", "epoch", "from")
if not s[1] then
  return {"missing"}
end
local started = base .. "started:" .. ARGV[1]  -- see lua/begin.lua
local function in_bag(k)  -- pair k names a member of a bag of #KEYS - 2 with an output
  local i = tonumber(ARGV[k])
  return i and i == math.floor(i) and i >= 0 and i < #KEYS - 2 and ARGV[k + 1] ~= nil
end
if s[1] == "compensating" and s[5] == ARGV[1] and ARGV[2] == (s[4] or "0") then
  -- a member started before the failure or cancel: recorded, so its compensation runs
  local late = false
  if #KEYS == 2 then
    if redis.call("HDEL", started, "0") == 1 then
      late = true
      if redis.call("SET", KEYS[2], ARGV[3], "NX") then
        redis.call("SADD", registry, KEYS[2])
      end
    end
  else
    for k = 3, #ARGV, 2 do
      if in_bag(k) and redis.call("HDEL", started, ARGV[k]) == 1 then
        late = true
        if redis.call("SADD", KEYS[2], ARGV[k]) == 1 then
          redis.call("SET", KEYS[3 + tonumber(ARGV[k])], ARGV[k + 1])
          redis.call("SADD", registry, KEYS[2], KEYS[3 + tonumber(ARGV[k])])
        end
      end
    end
  end
  if late then
    return {"late"}
  end
end
local scope = string.match(ARGV[1], "^(.*/branch:%d+)/")
local live = "running"
if string.match(ARGV[1], "^saga:%d+$") then  -- a compensation: the saga's cursor, while compensating
  scope, live = "saga", "compensating"
end
if scope then
  local b = redis.call("HMGET", base .. "cur:" .. scope, "cursor", "leaf")
  s[2], s[3] = b[1], b[2]
end
if s[1] ~= live or s[2] ~= ARGV[1] or ARGV[2] ~= (s[4] or "0") then
  return {"stale", s[1], s[2] or ""}
end
-- a leaf in a parallel branch counts only while its bag is open: the scope around the bag
-- (the program's cursor, or the enclosing branch's) still stands at it, as advance.lua checks
if scope and scope ~= "saga" then
  local bag = string.match(scope, "^(.*)/branch:%d+$")
  local outer = string.match(bag, "^(.*/branch:%d+)/")
  local holder = outer and (string.sub(KEYS[1], 1, -6) .. "cur:" .. outer) or KEYS[1]
  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left: record nothing
    return {"stale", s[1], s[2] or ""}
  end
end
local leaf = s[3] or ""  -- "" for a program started before leaves were recorded
if #KEYS == 2 then
  if leaf ~= "" and leaf ~= "task" then
    return {"invalid", "step " .. ARGV[1] .. " is a " .. leaf .. ", not a single task"}
  end
  local verdict = "again"
  if redis.call("SET", KEYS[2], ARGV[3], "NX") then
    verdict = "fire"
    redis.call("SADD", registry, KEYS[2])
  end
  redis.call("HDEL", started, "0")  -- recorded: nothing to wait for
  if redis.call("STRLEN", KEYS[2]) > INLINE then
    return {verdict}
  end
  return {verdict, redis.call("GET", KEYS[2])}
end
local size = #KEYS - 2
if leaf ~= "" and leaf ~= "bag:" .. size then
  return {"invalid", "step " .. ARGV[1] .. " is a " .. leaf .. ", not a bag of " .. size}
end
for k = 3, #ARGV, 2 do  -- every index checked before anything is written
  if not in_bag(k) then
    return {"invalid", "bag member " .. ARGV[k] .. ": a bag of " .. size .. " has 0.." .. (size - 1)}
  end
  -- a branch member (its cursor opened with the bag) ends by its own advance, never here
  if redis.call("EXISTS", base .. "cur:" .. ARGV[1] .. "/branch:" .. ARGV[k]) == 1 then
    return {"invalid", "bag member " .. ARGV[k] .. " of step " .. ARGV[1] .. " is a branch"}
  end
end
local verdict = "again"
for k = 3, #ARGV, 2 do
  if redis.call("SADD", KEYS[2], ARGV[k]) == 1 then
    redis.call("SET", KEYS[3 + tonumber(ARGV[k])], ARGV[k + 1])
    redis.call("SADD", registry, KEYS[2], KEYS[3 + tonumber(ARGV[k])])
    verdict = "fire"
  end
  redis.call("HDEL", started, ARGV[k])  -- recorded: nothing to wait for
end
if redis.call("SCARD", KEYS[2]) < size then
  return {"wait"}
end
local total = 0
for k = 3, #KEYS do
  total = total + redis.call("STRLEN", KEYS[k])
end
if total > INLINE then
  return {verdict}
end
local outputs = redis.call("MGET", unpack(KEYS, 3, #KEYS))
return {verdict, unpack(outputs)}
