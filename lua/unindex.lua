-- unindex.lua: take ids out of an index only where each entry's score is still at most the
-- one given: an entry with a later score is a newer program of the same id, indexed since the
-- caller saw its program gone (submitted again after a purge or an expiry), and stays.
-- KEYS[1]  an index: <prefix>:index:created | <prefix>:index:ended (no program's key)
-- ARGV     id, score, id, score, ...
-- returns  how many were taken out
local removed = 0
for i = 1, #ARGV, 2 do
  local score = redis.call("ZSCORE", KEYS[1], ARGV[i])
  if score and tonumber(score) <= tonumber(ARGV[i + 1]) then
    removed = removed + redis.call("ZREM", KEYS[1], ARGV[i])
  end
end
return removed
