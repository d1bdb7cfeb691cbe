-- fail.lua: record one failed attempt of a task once, and say whether it may be tried again.
-- KEYS[1]  state hash     <prefix>:{<wf>}:state
-- KEYS[2]  failures hash  <prefix>:{<wf>}:err:<path>   field "<index>:<attempt>" = error
-- ARGV[1]  the leaf's path (must be the program's cursor)
-- ARGV[2]  member index ("0" for a single task)
-- ARGV[3]  attempt that failed, from 0
-- ARGV[4]  error text
-- ARGV[5]  max attempts (1..100)
-- ARGV[6]  the run (epoch) of the failed task ("0" when absent): another run's is stale
-- returns  {"retry"}                 first report of this attempt: schedule attempt + 1
--          {"exhausted", error...}   first report of the last attempt: every attempt's error
--          {"again", ...}            this attempt was reported before (same reply otherwise)
--          {"stale", status, cursor} the program is elsewhere or ended: nothing recorded
--          {"late"}                  the program is compensating from this step (it failed or
--                                    was cancelled there) and the member had started before
--                                    (lua/begin.lua): recorded, never retried
--          {"missing"}               no such program
--          {"invalid", reason}       index or attempt out of range: nothing recorded
-- A leaf in a parallel branch (a path with `/branch:K/`) is compared with its branch's
-- cursor and leaf, in <prefix>:{<wf>}:cur:<scope> (see advance.lua); status and epoch are the
-- program's. A compensation's leaf (`saga:<step>`) is compared with the saga's cursor,
-- <prefix>:{<wf>}:cur:saga, and only while the program is compensating.
local MAX_ATTEMPTS = 100  -- bounds the loop below, whatever a caller sends
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "leaf", "epoch", "from")
if not s[1] then
  return {"missing"}
end
local started = string.sub(KEYS[1], 1, -6) .. "started:" .. ARGV[1]  -- see lua/begin.lua
-- whether this is the latest started attempt of the member (lua/begin.lua)
local latest = redis.call("HGET", started, ARGV[2]) == ARGV[3]
if s[1] == "compensating" and s[5] == ARGV[1] and (ARGV[6] or "0") == (s[4] or "0")
    and latest then
  -- a member started before the failure or cancel ended: no compensation waits for it now
  redis.call("HDEL", started, ARGV[2])
  redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4])
  redis.call("SADD", string.sub(KEYS[1], 1, -6) .. "keys", KEYS[2])
  return {"late"}
end
local scope = string.match(ARGV[1], "^(.*/branch:%d+)/")
local live = "running"
if string.match(ARGV[1], "^saga:%d+$") then  -- a compensation: the saga's cursor, while compensating
  scope, live = "saga", "compensating"
end
if scope then
  local b = redis.call("HMGET", string.sub(KEYS[1], 1, -6) .. "cur:" .. scope, "cursor", "leaf")
  s[2], s[3] = b[1], b[2]
end
if s[1] ~= live or s[2] ~= ARGV[1] or (ARGV[6] or "0") ~= (s[4] or "0") then
  return {"stale", s[1], s[2] or ""}
end
-- a leaf in a parallel branch counts only while its bag is open: the scope around the bag
-- (the program's cursor, or the enclosing branch's) still stands at it, as advance.lua checks
if scope and scope ~= "saga" then
  local bag = string.match(scope, "^(.*)/branch:%d+$")
  local outer = string.match(bag, "^(.*/branch:%d+)/")
  local holder = outer and (string.sub(KEYS[1], 1, -6) .. "cur:" .. outer) or KEYS[1]
  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left: no retry
    return {"stale", s[1], s[2] or ""}
  end
end
local index, attempt, most = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if not most or most ~= math.floor(most) or most < 1 or most > MAX_ATTEMPTS then
  return {"invalid", "max attempts " .. ARGV[5] .. ": from 1 to " .. MAX_ATTEMPTS}
end
if not attempt or attempt ~= math.floor(attempt) or attempt < 0 or attempt >= most then
  return {"invalid", "attempt " .. ARGV[3] .. ": from 0 to " .. (most - 1)}
end
local leaf = s[3] or ""
if leaf == "sleep" or leaf == "signal" then
  return {"invalid", "step " .. ARGV[1] .. " is a " .. leaf .. ": no task to fail"}
end
local size = 1
if string.sub(leaf, 1, 4) == "bag:" then
  size = tonumber(string.sub(leaf, 5))
elseif leaf == "" then
  size = index and index + 1 or 1  -- a program started before leaves were recorded
end
if not index or index ~= math.floor(index) or index < 0 or index >= size then
  return {"invalid", "member " .. ARGV[2] .. ": step " .. ARGV[1] .. " has 0.." .. (size - 1)}
end
local first = redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4]) == 1
if latest then  -- this attempt ended (a retry starts anew); an earlier one's report does not count
  redis.call("HDEL", started, ARGV[2])
end
-- named in the program's registry, so it expires with the program (see advance.lua)
redis.call("SADD", string.sub(KEYS[1], 1, -6) .. "keys", KEYS[2])
local verdict = "again"
if attempt + 1 < most then
  if first then verdict = "retry" end
  return {verdict}
end
if first then verdict = "exhausted" end
local errors = {verdict}
for a = 0, attempt do
  errors[#errors + 1] = redis.call("HGET", KEYS[2], ARGV[2] .. ":" .. a) or "?"
end
return errors
