-- take.lua: the signal step at the program's cursor takes the first signal kept for its name,
-- once: the data becomes the step's output, recorded like a task's.
-- KEYS[1]  state hash           <prefix>:{<wf>}:state
-- KEYS[2]  the step's output    <prefix>:{<wf>}:out:<path>
-- KEYS[3]  the signal's list    <prefix>:{<wf>}:sig:<name>
-- ARGV[1]  the step's path
-- ARGV[2]  the run (epoch) the caller read its cursor in; "" or absent: not checked
-- returns  {"taken"}    the step has its output: taken now, or before (a replay after a
--                       crash finds it again, whatever the cursor is now, and never takes a
--                       second signal)
--          {"waiting"}  no signal of that name yet
--          {"stale"}    the program is elsewhere or ended: nothing taken
--          {"missing"}  no such program
-- A leaf in a parallel branch (a path with `/branch:K/`) is compared with its branch's
-- cursor and leaf, in <prefix>:{<wf>}:cur:<scope> (see advance.lua), and is stale once its
-- bag was left (advance.lua's fence); the status checked is the program's. The run is
-- checked first: an owner that stalled after reading the cursor must not take a signal for
-- a run redriven meanwhile (its `next` would be stale, and the signal gone with it).
local s = redis.call("HMGET", KEYS[1], "status", "cursor", "leaf", "epoch")
if not s[1] then
  return {"missing"}
end
local epoch = ARGV[2] or ""
if epoch ~= "" and epoch ~= (s[4] or "0") then
  return {"stale"}
end
if redis.call("EXISTS", KEYS[2]) == 1 then
  return {"taken"}
end
local scope = string.match(ARGV[1], "^(.*/branch:%d+)/")
if scope then
  local b = redis.call("HMGET", string.sub(KEYS[1], 1, -6) .. "cur:" .. scope, "cursor", "leaf")
  s[2], s[3] = b[1], b[2]
end
if s[1] ~= "running" or s[2] ~= ARGV[1] or s[3] ~= "signal" then
  return {"stale"}
end
-- a branch's leaf takes only while its bag is open: the scope around the bag (the program's
-- cursor, or the enclosing branch's) still stands at it, as advance.lua checks; else a late
-- take would consume a signal that a later step waits for
if scope then
  local bag = string.match(scope, "^(.*)/branch:%d+$")
  local outer = string.match(bag, "^(.*/branch:%d+)/")
  local holder = outer and (string.sub(KEYS[1], 1, -6) .. "cur:" .. outer) or KEYS[1]
  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left
    return {"stale"}
  end
end
local data = redis.call("LPOP", KEYS[3])
if not data then
  return {"waiting"}
end
redis.call("SET", KEYS[2], data)
redis.call("SADD", string.sub(KEYS[1], 1, -6) .. "keys", KEYS[2])
return {"taken"}
