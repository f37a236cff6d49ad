"""Lua scripts of the Redis prefix index (``cache/redis_index.py`` documents the layout).

Every script builds its keys from the namespace and the hashes it is given, so the index needs
a standalone Redis or one cluster slot. Records and scores are packed so that Redis keeps them
in its compact encodings (listpack hashes and sorted sets of at most 128 small entries):

- block record (a field of ``ns:h<bits>:<prefix>``, keyed by the hash bytes the key does not
  already hold): the reuse count ``f`` (1 byte below 128, else 4 bytes big-endian with the top
  bit set), then one entry per holder: 2 bytes replica id, or (provisional) the id + 32768
  followed by 6 bytes "provisional until" (ms). A ghost (held by nobody, ``f`` kept for
  ``ghost_ttl_s``) is ``f``, ``\\xff\\xff`` and 6 bytes expiry (ms).
- eviction scores are integers (``cache.index.quantize``): a listpack stores them in 1-9 bytes
  where a fractional score would take its 17-digit decimal string.
"""

from __future__ import annotations

# Pure helpers: big-endian unsigned integers, bucket prefixes, block records.
_LIB = r"""
local function u(s, i, n)
  local v = 0
  for j = i, i + n - 1 do v = v * 256 + string.byte(s, j) end
  return v
end
local function be(v, n)
  local t = {}
  for j = n, 1, -1 do
    t[j] = string.char(v % 256)
    v = math.floor(v / 256)
  end
  return table.concat(t)
end
local function prefix(member, bits)
  if bits == 0 then return '' end
  local nb = math.ceil(bits / 8)
  local keep = 2 ^ (8 - (bits - 8 * (nb - 1)))
  local last = string.byte(member, nb)
  return string.sub(member, 1, nb - 1) .. string.char(last - last % keep)
end
local function fcount(rec)
  local b = string.byte(rec, 1)
  if b < 128 then return b, 2 end
  return u(rec, 1, 4) - 2147483648, 5
end
local function decode(rec)
  if not rec then return 0, {}, 0, nil end
  local f, i = fcount(rec)
  if #rec == i + 7 and string.sub(rec, i, i + 1) == '\255\255' then return f, {}, 0, u(rec, i + 2, 6) end
  local hs, n = {}, 0
  while i < #rec do
    local id = u(rec, i, 2)
    if id >= 32768 then
      hs[id - 32768] = u(rec, i + 2, 6)
      i = i + 8
    else
      hs[id] = 0
      i = i + 2
    end
    n = n + 1
  end
  return f, hs, n, nil
end
local function fbytes(f)
  if f < 128 then return string.char(f) end
  return be(f + 2147483648, 4)
end
local function encode(f, hs)
  local t = {fbytes(f)}
  for r, p in pairs(hs) do
    local hi, lo = math.floor(r / 256), r % 256
    if p == 0 then t[#t + 1] = string.char(hi, lo) else t[#t + 1] = string.char(hi + 128, lo) .. be(p, 6) end
  end
  return table.concat(t)
end
local function q(x) return math.floor(x * 1000000 + 0.5) end
"""

# Shared by the write scripts. ARGV: replica, now_ms, ns, block bucket bits, ghost_ms, cap, ...
_STATE = r"""
local rep, now, ns, hb, ghost_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local cap = tonumber(ARGV[6])
local lkey, top, gq = ns .. ':c:' .. rep, ns .. ':s:' .. rep, ns .. ':gq'
local st = redis.call('HMGET', lkey, 'c', 'n', 'k')
local clock, count, kb = tonumber(st[1] or '0'), tonumber(st[2] or '0'), tonumber(st[3])
if kb == nil then
  kb = 0
  while kb < 16 and cap / 2 ^ kb > 64 do kb = kb + 1 end
  redis.call('HSET', lkey, 'k', kb)
end
local hs0 = 1 + math.floor(hb / 8)
local function hkey(member) return ns .. ':h' .. hb .. ':' .. prefix(member, hb), string.sub(member, hs0) end
local function rkey(member)
  local p = prefix(member, kb)
  return top .. ':' .. p, p
end
local function put(hk, fld, member, f, hs, n)
  if n > 0 then
    redis.call('HSET', hk, fld, encode(f, hs))
  elseif f >= 2 then
    local exp = be(now + ghost_ms, 6)
    redis.call('HSET', hk, fld, fbytes(f) .. '\255\255' .. exp)
    redis.call('RPUSH', gq, member .. exp)
  else
    redis.call('HDEL', hk, fld)
  end
end
local function release(member)
  local hk, fld = hkey(member)
  local rec = redis.call('HGET', hk, fld)
  if rec and #rec == 3 and string.byte(rec, 2) * 256 + string.byte(rec, 3) == rep and string.byte(rec, 1) < 128 then
    put(hk, fld, member, string.byte(rec, 1), {}, 0)  -- the common case: this replica was the only holder
    return
  end
  local f, hs, n = decode(rec)
  if hs[rep] ~= nil then
    hs[rep] = nil
    put(hk, fld, member, f, hs, n - 1)
  end
end
for _ = 1, 16 do
  local head = redis.call('LINDEX', gq, 0)
  if not head or u(head, 9, 6) > now then break end
  redis.call('LPOP', gq)
  local m = string.sub(head, 1, 8)
  local hk, fld = hkey(m)
  local _, _, _, gexp = decode(redis.call('HGET', hk, fld))
  if gexp ~= nil and gexp <= now then redis.call('HDEL', hk, fld) end
end
"""

# ARGV 7..: mode, until_ms, op, hashes (8 B LE each), horizon.  Same arithmetic, in the same order,
# as MemoryIndex._write.
WRITE = (
    _LIB
    + _STATE
    + r"""
local mode, untl, op, blob, reuse_cap = ARGV[7], tonumber(ARGV[8]), ARGV[9], ARGV[10], tonumber(ARGV[11])
local n = #blob / 8
if op == 'drop' or op == 'evict' then  -- drop: provisional entries only; evict (the engine said so): any
  for i = 0, n - 1 do
    local member = string.sub(blob, 8 * i + 1, 8 * i + 8)
    local hk, fld = hkey(member)
    local f, hs, cnt = decode(redis.call('HGET', hk, fld))
    if hs[rep] ~= nil and (hs[rep] ~= 0 or op == 'evict') then
      redis.call('ZREM', rkey(member), member)  -- the bucket's bound in the top set stays a lower bound
      hs[rep] = nil
      put(hk, fld, member, f, hs, cnt - 1)
      count = count - 1
    end
  end
  redis.call('HSET', lkey, 'n', count)
  return 0
end
local floor = nil
for i = n - 1, 0, -1 do
  local member = string.sub(blob, 8 * i + 1, 8 * i + 8)
  local hk, fld = hkey(member)
  local f, hs, cnt, gexp = decode(redis.call('HGET', hk, fld))
  if gexp ~= nil and gexp <= now then f = 0 end
  local v = hs[rep]
  local p = untl
  if op == 'confirm' or v == 0 then p = 0 end
  local bump = (op == 'record') or (v == nil)
  if v == nil then
    cnt = cnt + 1
    count = count + 1
  end
  hs[rep] = p
  local bk, bp = rkey(member)
  if mode == 'lru' then
    if bump then
      local x = q(now / 1000.0 + (n - i) * 1e-6)
      redis.call('ZADD', bk, 'GT', x, member)
      if v == nil then redis.call('ZADD', top, 'LT', x, bp) end
    end
  else
    local s = nil
    if v ~= nil then s = tonumber(redis.call('ZSCORE', bk, member)) else clock = clock + 1 / cap end
    if bump then
      f = f + 1
      local x = q(clock + math.min(f / math.max(1, cnt), reuse_cap) - 1)
      if s == nil or x > s then s = x end
    end
    if s == nil then s = q(clock - 1) end
    if floor ~= nil and floor > s then s = floor end
    redis.call('ZADD', bk, s, member)
    if v == nil then redis.call('ZADD', top, 'LT', s, bp) end  -- scores only rise: a new entry may lower the bound
    floor = s + 1
  end
  redis.call('HSET', hk, fld, encode(f, hs))
end
local evicted = 0
while count > cap do
  -- The top set holds a lower bound of each bucket's lowest score (exact when set; entries that
  -- rose or left may leave it low). The lowest bucket's first entry, once its bound is exact, is
  -- the replica's lowest (equal bounds are ordered by prefix, as one sorted set orders equal
  -- scores by member), and so are the entries after it below the next bucket's bound.
  local lo = redis.call('ZRANGE', top, 0, 1, 'WITHSCORES')
  if not lo[1] then
    count = 0
    break
  end
  local bk = top .. ':' .. lo[1]
  local s2 = tonumber(lo[4])
  local batch = redis.call('ZRANGE', bk, 0, math.min(count - cap, 3), 'WITHSCORES')
  if not batch[1] then
    redis.call('ZREM', top, lo[1])
  elseif tonumber(batch[2]) > tonumber(lo[2]) then
    redis.call('ZADD', top, batch[2], lo[1])
  else
    local k = 1
    while k < count - cap and k * 2 < #batch and (s2 == nil or tonumber(batch[2 * k + 2]) < s2) do k = k + 1 end
    redis.call('ZREMRANGEBYRANK', bk, 0, k - 1)
    if batch[2 * k + 2] then redis.call('ZADD', top, batch[2 * k + 2], lo[1]) end  -- the new exact bound
    for j = 1, k do release(batch[2 * j - 1]) end
    count = count - k
    evicted = evicted + k
  end
end
redis.call('HSET', lkey, 'n', count)
if mode == 'cost' then redis.call('HSET', lkey, 'c', string.format('%.17g', clock)) end
return evicted
"""
)

# Remove every entry of a replica.  ARGV: replica, now_ms, ns, block bucket bits, ghost_ms, cap
FORGET = (
    _LIB
    + _STATE
    + r"""
local total = 0
for _, b in ipairs(redis.call('ZRANGE', top, 0, -1)) do
  local bk = top .. ':' .. b
  for _, m in ipairs(redis.call('ZRANGE', bk, 0, -1)) do
    release(m)
    total = total + 1
  end
  redis.call('DEL', bk)
end
redis.call('DEL', top)
redis.call('HSET', lkey, 'n', 0)
return total
"""
)

# ARGV: now_ms, ns, block bucket bits, hashes (8 B LE each)
#   -> {blocks examined, replica, matched, replica, matched, ...}
LOOKUP = (
    _LIB
    + r"""
local now, hb, blob = tonumber(ARGV[1]), tonumber(ARGV[3]), ARGV[4]
local hprefix, hs0 = ARGV[2] .. ':h' .. hb .. ':', 1 + math.floor(hb / 8)
local alive = nil
local matched = {}
local examined = 0
for i = 1, #blob / 8 do
  examined = i
  local member = string.sub(blob, 8 * i - 7, 8 * i)
  local rec = redis.call('HGET', hprefix .. prefix(member, hb), string.sub(member, hs0))
  local live = {}
  local any = false
  if rec then  -- the holders of a block record (a ghost has none), read in place
    local len, j = #rec, 2
    if string.byte(rec, 1) >= 128 then j = 5 end
    if len == j + 7 and string.byte(rec, j) == 255 and string.byte(rec, j + 1) == 255 then j = len end
    while j < len do
      local hi, lo = string.byte(rec, j, j + 1)
      local r, ok = hi * 256 + lo, true
      if r >= 32768 then
        r, ok = r - 32768, u(rec, j + 2, 6) > now
        j = j + 8
      else
        j = j + 2
      end
      if ok and (alive == nil or alive[r]) then
        live[r] = true
        any = true
      end
    end
  end
  if alive ~= nil then
    for r, _ in pairs(alive) do
      if not live[r] then matched[r] = i - 1 end
    end
  end
  alive = live
  if not any then break end
end
if alive ~= nil then
  for r, _ in pairs(alive) do matched[r] = examined end
end
local out = {examined}
for r, b in pairs(matched) do
  if b > 0 then
    table.insert(out, r)
    table.insert(out, b)
  end
end
return out
"""
)


def prefix(member: bytes, bits: int) -> bytes:
    """The bucket of an 8-byte member: its first ``bits`` bits (the rest zeroed), as the Lua ``prefix``."""
    if bits == 0:
        return b""
    nb = -(-bits // 8)
    keep = 1 << (8 - (bits - 8 * (nb - 1)))
    return member[: nb - 1] + bytes([member[nb - 1] - member[nb - 1] % keep])


def decode(rec: bytes | None) -> tuple[int, dict[int, float], float | None]:
    """A block record: (reuse count, replica -> provisional-until ms (0 = confirmed), ghost expiry ms or None)."""
    if not rec:
        return 0, {}, None
    f, i = (rec[0], 1) if rec[0] < 128 else (int.from_bytes(rec[:4], "big") - 2**31, 4)
    if len(rec) == i + 8 and rec[i : i + 2] == b"\xff\xff":
        return f, {}, float(int.from_bytes(rec[i + 2 :], "big"))
    holders: dict[int, float] = {}
    while i < len(rec):
        rid = int.from_bytes(rec[i : i + 2], "big")
        if rid >= 32768:
            holders[rid - 32768] = float(int.from_bytes(rec[i + 2 : i + 8], "big"))
            i += 8
        else:
            holders[rid] = 0.0
            i += 2
    return f, holders, None
