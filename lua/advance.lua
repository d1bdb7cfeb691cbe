-- advance.lua: compare-and-advance a program's cursor; the only way a program moves or ends.
-- KEYS[1]  state hash   <prefix>:{<wf>}:state
-- ARGV[1]  expected cursor: the leaf that just finished ("" for start)
-- ARGV[2]  new cursor: the next leaf ("" when the program ends)
-- ARGV[3]  new status: running | completed | failed | compensating (a failure of a program that
--          names compensations: it stays live, `cause` failed, until they ran)
-- ARGV[4]  field for the payload: "result", "error" or "" for none
-- ARGV[5]  payload JSON
-- ARGV[6]  the new leaf's shape: "task", "bag:<size>", or "" when the program ends; complete
--          and fail refuse reports that do not fit it
-- ARGV[7]  retention in ms: when the program ends, every key it owns expires after this
--          ("0" or absent: kept forever)
-- ARGV[8]  a loop iteration to drop, as a path prefix ("3/iter:4/"), or "": the new leaf
--          starts a new iteration and the loop keeps only its last ones (its keys, and its
--          fields in <prefix>:{<wf>}:attempts)
-- ARGV[9]  the run (epoch) the message belongs to (a start's: the run its owner read), or
--          "" (not checked): a message of another run (before a redrive, see redrive.lua)
--          is stale
-- ARGV[10] the scope whose cursor moves: "" for the program's own, or a parallel branch
--          (`2/branch:1`: member 1 of the bag at step 2), whose cursor, from, leaf and
--          updated_ms are the hash <prefix>:{<wf>}:cur:<scope>. In a branch, status running
--          with the new cursor "" ends the branch: ARGV[5] is its output, recorded as its
--          member's in the bag's barrier; failed ends the whole program (its cursor, the
--          outermost bag, is kept as `from`, so a redrive runs that bag again). A branch
--          moves only while the scope around it (the program's cursor, or the enclosing
--          branch's) stands at its bag: else the advance is stale (a replay still answers
--          replay)
--          The scope `saga` is the compensations' cursor, <prefix>:{<wf>}:cur:saga (absent:
--          cursor "", not started): it moves only while the status is compensating, from
--          "" to the first group's leaf (`saga:<step>`), group to group, and to "" with the
--          end status (compensated, compensation_failed, or the cause when nothing was to
--          undo); the state's cursor, from and prior stay where the failure left them
-- ARGV[11] JSON list of the branches the new leaf opens (a bag with branches), nested ones
--          too: [[scope, its first leaf's path, that leaf's shape], ...]
-- When the program ends, the cursor before the last one is kept as `prior` (redrive reruns
-- from the last cursor, whose prev is the output of `prior`).
-- KEYS[2..] outputs, with their JSON in ARGV[12..] (KEYS[n] <- ARGV[n + 10]), written (latest
--          wins) and registered only when the advance applies: those of steps that other
--          steps read, <prefix>:{<wf>}:ref:<id> (the steps the new cursor moved past that carry
--          a referenced id), and last, for a single task whose worker left it to the owner,
--          the finished leaf's own, <prefix>:{<wf>}:out:<ARGV[1]>: what this transition used
-- The program's other keys are named in its registry <prefix>:{<wf>}:keys; all share the
-- program's hash tag, so they live in KEYS[1]'s cluster slot.
-- returns  {verdict, status, cursor, joined, elapsed} where joined is "1" when a branch's end
--          (now, or before: a replay) found every member of its bag finished, elapsed (applied
--          only) the ms since the moving cursor reached ARGV[1] (its updated_ms; "" if none:
--          the owner's step timings, on Redis's clock), and verdict is
--   applied  the transition happened now: publish what it produces
--   replay   it already happened (cursor moved from ARGV[1]; for a redriven run's start, the
--            cursor still at where it put it): a redelivery publishes again
--   stale    the message is older than the program's state: ignore it
--   missing  no such program
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "from", "epoch", "updated_ms")
local status, cursor, from, since = s[1], s[2], s[3], s[5]
if not status then
  return {"missing", "", ""}
end
local epoch = ARGV[9] or ""
if epoch ~= "" and epoch ~= (s[4] or "0") then
  return {"stale", status, cursor}
end
local base = string.sub(KEYS[1], 1, -6)  -- "<prefix>:{<wf>}:" without "state"
local registry = base .. "keys"
local scope = ARGV[10] or ""
local here = KEYS[1]  -- the hash whose cursor moves
local bag, member, barrier, size, inside = "", "", "", 0, true
local saga = scope == "saga"
if saga then
  here = base .. "cur:saga"
  local b = redis.call("HMGET", here, "cursor", "from", "updated_ms")
  cursor, from, since = b[1] or "", b[2], b[3]
elseif scope ~= "" then
  here = base .. "cur:" .. scope
  local b = redis.call("HMGET", here, "cursor", "from", "updated_ms")
  cursor, from, since = b[1], b[2], b[3]
  if not cursor then
    return {"stale", status, ""}  -- no such branch was opened
  end
  bag, member = string.match(scope, "^(.*)/branch:(%d+)$")
  if not bag then
    return {"stale", status, ""}
  end
  -- the bag's size, as the scope around it recorded its leaf (`bag:<size>`), and whether
  -- that scope still stands at the bag: a branch moves only while its bag is open
  local outer = string.match(bag, "^(.*/branch:%d+)/")
  local holder = outer and (base .. "cur:" .. outer) or KEYS[1]
  local held = redis.call("HMGET", holder, "leaf", "cursor")
  size = tonumber(string.match(held[1] or "", "^bag:(%d+)$") or "0")
  inside = held[2] == bag
  barrier = base .. "bar:" .. bag
end
local function joined()
  if scope ~= "" and ARGV[2] == "" and size > 0 and redis.call("SCARD", barrier) >= size then
    return "1"
  end
  return "0"
end
local live = status == "pending" or status == "running"
if saga then
  live = status == "compensating"
end
-- ends the program: its keys expire (compensating does not: the compensations run first)
local ending = ARGV[3] ~= "running" and ARGV[3] ~= "compensating"
if live and cursor == ARGV[1] then
  if not inside then  -- the bag was left (a stray `next`): its branches move no more
    return {"stale", status, cursor}
  end
  local t = redis.call("TIME")
  local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  local now = string.format("%d", now_ms)
  local elapsed = ""
  if tonumber(since or "") then
    elapsed = string.format("%d", math.max(now_ms - tonumber(since), 0))
  end
  local came_from = ARGV[1]
  if ARGV[1] == "" and scope == "" then
    -- a start: a redriven run comes from the step before its rerun (its `prior`), so a cancel
    -- or failure before it moves on keeps that step as `prior` for the next redrive
    came_from = redis.call("HGET", KEYS[1], "prior") or ""
  end
  redis.call("HSET", here, "cursor", ARGV[2], "from", came_from, "leaf", ARGV[6],
    "updated_ms", now)
  if saga then
    redis.call("SADD", registry, here)
    if ending then
      redis.call("HSET", KEYS[1], "status", ARGV[3], "updated_ms", now)
    end
  elseif scope == "" then
    redis.call("HSET", KEYS[1], "status", ARGV[3])
  elseif ARGV[3] ~= "running" then  -- a branch ends the program: from its outermost bag
    redis.call("HSET", KEYS[1], "status", ARGV[3], "cursor", "", "from", s[2], "leaf", "",
      "updated_ms", now)
    from = s[3]
  elseif ARGV[2] == "" then  -- the branch is over: its output is its bag member's
    if redis.call("SADD", barrier, member) == 1 then
      local out = base .. "out:" .. bag .. "/bag:" .. member
      redis.call("SET", out, ARGV[5])
      redis.call("SADD", registry, barrier, out)
    end
  end
  if status == "pending" then
    redis.call("HSET", KEYS[1], "started_ms", now)
  end
  if ARGV[4] ~= "" then
    redis.call("HSET", KEYS[1], ARGV[4], ARGV[5])
  end
  if ending then
    redis.call("HSET", KEYS[1], "ended_ms", now)
  end
  if ARGV[3] ~= "running" and not saga then
    redis.call("HSET", KEYS[1], "prior", from or "")
  end
  if ARGV[3] == "compensating" and not saga then
    redis.call("HSET", KEYS[1], "cause", "failed")
  end
  for _, opened in ipairs(cjson.decode(ARGV[11] or "[]")) do
    local key = base .. "cur:" .. opened[1]
    redis.call("HSET", key, "cursor", opened[2], "from", "", "leaf", opened[3],
      "updated_ms", now)
    redis.call("SADD", registry, key)
  end
  for i = 2, #KEYS do
    redis.call("SET", KEYS[i], ARGV[i + 10])
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
  if ending and keep_ms > 0 then
    for _, key in ipairs(redis.call("SMEMBERS", registry)) do
      redis.call("PEXPIRE", key, keep_ms)
    end
    redis.call("PEXPIRE", registry, keep_ms)
    redis.call("PEXPIRE", base .. "plan", keep_ms)
    redis.call("PEXPIRE", KEYS[1], keep_ms)
  end
  return {"applied", ARGV[3], ARGV[2], joined(), elapsed}
end
if from == ARGV[1] then
  return {"replay", status, cursor, joined()}
end
-- a redriven run's start came from its `prior` (above), not from "": redelivered while the
-- cursor still stands where it put it, it is a replay too, or what it owes is never sent
if ARGV[1] == "" and scope == "" and cursor ~= "" and cursor == ARGV[2]
    and from == (redis.call("HGET", KEYS[1], "prior") or "") then
  return {"replay", status, cursor, joined()}
end
return {"stale", status, cursor}
