-- reindex.lua: put ids in the creation index at their program's time where the entry is
-- missing or older than that by more than `slack`: a new program of an id whose entry was an
-- earlier program's (expired or purged, then submitted again) takes its own time, never an
-- earlier one, and again if a purge took the entry meanwhile. The router sends its submit's
-- time with no slack once the program is recorded; the sweep's repair sends each live
-- program's `created_ms` with a minute's (the router indexes just before it records, on its
-- own clock), so one whose router failed between the two is moved too. ZADD GT needs 6.2.
-- KEYS[1]  <prefix>:index:created (no program's key)
-- ARGV[1]  slack in ms; ARGV[2..] id, time in ms, id, time, ... (a page: at most 256)
-- returns  how many entries were written
local moved = 0
local slack = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local at = tonumber(ARGV[i + 1])
  local score = redis.call("ZSCORE", KEYS[1], ARGV[i])
  if not score or tonumber(score) < at - slack then
    redis.call("ZADD", KEYS[1], at, ARGV[i])
    moved = moved + 1
  end
end
return moved
