-- begin.lua: tasks of a step whose members name compensations start; they are noted as
-- started, so that when the program fails or is cancelled they run to the end and record
-- their outputs before its compensations start (what a started task did is undone too).
-- A task of any other step is checked by a plain read instead (the worker's `_current`).
-- KEYS[1]  state hash     <prefix>:{<wf>}:state
-- KEYS[2]  started hash   <prefix>:{<wf>}:started:<path>: member index ("0": a single task)
--          -> the latest attempt of it that started
-- ARGV[1]  the step's path (a top-level step: compensations are named nowhere else)
-- ARGV[2]  the run (epoch) of the tasks
-- ARGV[3]  their attempt (a message's tasks share it)
-- ARGV[4..] the indexes of the members the message carries ("0" for a single task)
-- returns  {"go", index...}         the members to run: every one while the program runs at
--                                   the step; once it is compensating from this step (the
--                                   cursor it failed or was cancelled at, `from`), only those
--                                   whose latest started attempt is this one: a redelivery
--                                   after a crash runs them again
--          {"stale", status, cursor} the program is elsewhere, ended, or in another run
--          {"missing"}               no such program
--          {"invalid", reason}       an index the step's leaf does not have: nothing noted
-- complete.lua takes a member out when its output is recorded, fail.lua when its latest
-- attempt fails (a stale report of an earlier attempt leaves it in); the owner starts the
-- compensations once the hash of the step they start from is empty. Two copies of one
-- attempt (a duplicate message) share a mark: the first to end settles the member.
local MAX_MEMBERS = 1000  -- orchestrator/program.py MAX_BAG: bounds the loops below
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "leaf", "epoch", "from")
if not s[1] then
  return {"missing"}
end
if ARGV[2] ~= (s[4] or "0") then
  return {"stale", s[1], s[2] or ""}
end
local attempt = tonumber(ARGV[3])
if not attempt or attempt ~= math.floor(attempt) or attempt < 0 then
  return {"invalid", "attempt " .. ARGV[3] .. ": a whole number from 0"}
end
if #ARGV - 3 > MAX_MEMBERS then
  return {"invalid", "a message of more than " .. MAX_MEMBERS .. " members"}
end
if s[1] == "running" and s[2] == ARGV[1] then
  local leaf = s[3] or ""
  local size = tonumber(string.match(leaf, "^bag:(%d+)$") or "1")
  for k = 4, #ARGV do
    local i = tonumber(ARGV[k])
    if not i or i ~= math.floor(i) or i < 0 or i >= size then
      return {"invalid", "member " .. ARGV[k] .. ": step " .. ARGV[1] .. " has 0.." .. (size - 1)}
    end
  end
  for k = 4, #ARGV do
    local latest = tonumber(redis.call("HGET", KEYS[2], ARGV[k]) or "-1")
    if attempt > latest then  -- a late copy of an earlier attempt leaves the mark as it is
      redis.call("HSET", KEYS[2], ARGV[k], ARGV[3])
    end
  end
  if #ARGV > 3 then
    -- named in the program's registry, so it expires (and a redrive drops it) with the rest
    redis.call("SADD", string.sub(KEYS[1], 1, -6) .. "keys", KEYS[2])
  end
  return {"go", unpack(ARGV, 4, #ARGV)}
end
if s[1] == "compensating" and s[5] == ARGV[1] then
  local going = {"go"}
  for k = 4, #ARGV do
    if tonumber(redis.call("HGET", KEYS[2], ARGV[k]) or "-1") == attempt then
      going[#going + 1] = ARGV[k]
    end
  end
  if #going > 1 then
    return going
  end
end
return {"stale", s[1], s[2] or ""}
