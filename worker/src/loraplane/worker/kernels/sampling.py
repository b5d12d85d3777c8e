"""The sampler of a step's logits in one to three Triton launches; reference:
``engine.sampling``.

``engine.sampling``'s torch path is about 40 launches a step (a ``topk`` of 1024 candidates,
softmaxes, cumsums, a sort when a nucleus runs past the candidates). On an H200 at bs 128 and
a 128k vocabulary it takes 0.65-0.83 ms a step for top_p / top_k rows. Here one
program samples one row, in a few passes over its logits. In a small batch (``chunking``),
two launches before it race the rows without a top_k in chunks, and check the winner
against the nucleus once (``_race_chunks_kernel``, ``_check_chunks_kernel``); the row's
program combines the chunks' records and goes on from there. Each thread keeps its own running
values across a pass (a max, a sum, a best ratio per lane); the lanes are combined once, at
the end of the pass, so the loop carries no reduction across warps:

1. with a top_k: the row's largest score ``m`` (score: ``logits / temperature``, NaN as
   -inf, +inf as the largest float, as the torch path has them), the range of its scores'
   order keys (a float's bits as an int that sorts as the float does) and each lane's
   largest key;
2. with a top_k: its candidates. The k-th largest of the lanes' largest keys is at or below
   the row's k-th (k lanes each hold a token at or above it), so the tokens at or above it
   hold every kept token. A second pass writes their ids to the row's scratch
   (``CANDIDATES`` of them at most). When they fit (a language model's top_k of 50 has 50 to
   a few hundred), steps 3 to 5 run on them in registers (``_sample_candidates``), with no
   more passes over the row; when they do not (a top_k past the lanes, thousands of ties),
   over the row, from that bound;
3. with a top_k: the k-th largest score, by a radix search over the keys (a histogram of
   ``BINS`` buckets a step, four steps for 32-bit keys at most); every token tied with the
   k-th is kept, as in the torch path;
4. the exponential race ``argmax(exp(score - m) / q)`` over the kept tokens, ``q ~ Exp(1)``
   hashed from the row's key and the token id (``engine.sampling.seeded_exponential``'s
   hash), which draws token ``t`` with probability ``p[t]``. The same pass sums the kept
   tokens' ``exp(score - m)``: ``z``, the softmax's denominator over them. Without a top_k
   this is the row's first pass: each lane keeps a running max and rescales its best ratio
   and its sum when the max grows (``_race_online``);
5. with a top_p: the winner is checked against the nucleus. A token is in it when the mass of
   the kept tokens scoring strictly above it is below ``top_p * z``. The next pass races the
   tokens above the winner and sums their mass: that mass decides whether the winner is in
   the nucleus; if it is not, no token at or below it is either, and that pass's winner
   (same noise) is the next to check. The noise being the same, the token that comes out is
   the race's winner over the nucleus: the torch path's token for the same key, with no sort
   and no threshold search. Most rows of a language model end after one check; each round
   drops the winner and every token below it.

Equal to the torch path up to rounding: the same kept sets (ties included), the same noise,
the same race. Sums run in another order and ``exp`` / ``log`` are the GPU's, so a token on a
tie of the race or a mass on the edge of ``top_p`` to within a few ulps may differ.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_tensor,
    next_power_of_2,
)

__all__ = ["TABLE_COLUMNS", "sample_table"]

# The columns of the parameter table, one int64 row per sampled row of the logits: the row's
# index, its top_k (0: none), the float32 bits of its temperature and of its top_p
# (sign-extended), its noise key (63 bits: ``engine.sampling.draw_seed`` for a seeded row).
TABLE_COLUMNS = 5
_COLUMNS = tl.constexpr(TABLE_COLUMNS)  # (what a kernel may read of it)

# Tokens per loop step of a pass, and buckets per radix pass of the top_k search.
BLOCK = 4096
BINS = 256
# Rows without a top_k in a small batch are raced, and checked once against the nucleus, in
# chunks of at least CHUNK_MIN tokens (a multiple of CHUNK_BLOCK), one program of CHUNK_WARPS
# each, until a launch has about CHUNK_PROGRAMS programs: one program a row left most of an
# H200's 132 multiprocessors idle below bs 128.
CHUNK_MIN = 8192
CHUNK_BLOCK = 1024
CHUNK_WARPS = 4
CHUNK_PROGRAMS = 512
# Fewer chunks than this did not pay for their two launches: at bs 128 (4 chunks) top_p rows
# took 1.11-1.21x the time of one program a row, at bs 64 (8 chunks) 0.82-0.89x.
CHUNKS_MIN = 8
# Token ids a top_k row may keep as its candidates (at most BLOCK): the tokens at or above the
# k-th largest of its lanes' largest scores. When they fit, the row's k-th score, race and
# nucleus checks run on them in registers: two passes over the row instead of up to nine.
CANDIDATES = 4096
# Nucleus checks a row may take (each drops the winner and every token below it; a language
# model's row takes one or two). Past them the row takes its best token: in the nucleus, but
# not a draw from it. Each miss has at most the probability of the mass outside the nucleus,
# so no real row gets here; the cap keeps a program from spinning on a bug or a bad value.
MAX_ROUNDS = 64
# Warps per program: ptxas (sm_90) gives the kernel 104-114 registers and no spills at 16
# (178 at 8, 255 at 4).
NUM_WARPS = 16
FLOAT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _scores(row_ptr, offs, vocab, temperature):
    """A block's scores as the torch path computes them: ``logits.float() / temperature``,
    NaN as -inf, +inf as the largest float; -inf past the vocabulary."""
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, temperature)
    s = tl.where(s != s, float("-inf"), s)
    s = tl.where(s == float("inf"), FLOAT_MAX, s)
    return s, valid


@triton.jit
def _order_key(s):
    """An int64 that sorts as the float32 ``s`` does (+0 and -0 equal)."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == 0.0, 0, key).to(tl.int64)


@triton.jit
def _mix32(x):
    """MurmurHash3's 32-bit finalizer on uint32 values (``engine.sampling._mix32``, which
    computes it in int64 and masks: the same low 32 bits)."""
    x = (x ^ (x >> 16)) * 0x85EBCA6B
    x = (x ^ (x >> 13)) * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _noise(offs, key_lo, key_hi):
    """``Exp(1)`` noise of tokens ``offs`` for the row's key (``seeded_exponential``), in
    uint32 arithmetic (it wraps as the reference's masks do)."""
    x = _mix32(offs.to(tl.uint32) * 0x9E3779B1 + key_lo)
    x = _mix32(x ^ key_hi)
    u = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (0, 1), 23 bits, exact
    return -tl.log(u)


@triton.jit
def _ratio(e, offs, key_lo, key_hi):
    """The race's ``e / q`` of tokens ``offs`` (``e``: ``exp(s - m)`` of a kept token, -1 of
    the others, whose ratio is -1)."""
    q = tl.maximum(_noise(offs, key_lo, key_hi), 1.1754943508222875e-38)
    return tl.where(e >= 0.0, e / q, -1.0)


@triton.jit
def _pick_top(ratio, ids, sel, vocab):
    """The race's winner among ``sel`` and its ratio: the largest ratio (the lowest id of a
    tie); -1 and -1 if no ratio there is at least 0."""
    top = tl.max(tl.where(sel, ratio, -1.0), axis=0)
    winner = tl.min(tl.where(sel & (ratio == top), ids, vocab), axis=0)
    return tl.where(top >= 0.0, winner, -1), top


@triton.jit
def _pick(ratio, ids, sel, vocab):
    """``_pick_top``'s winner."""
    winner, _ = _pick_top(ratio, ids, sel, vocab)
    return winner


@triton.jit
def _fold(e, offs, key_lo, key_hi, best, best_at, mass):
    """One block into the lanes' race: ``e`` is ``exp(s - m)`` of a kept token, -1 of the
    others. Each lane keeps its best ``e / q`` (the first of its ties) and its sum of ``e``."""
    ratio = _ratio(e, offs, key_lo, key_hi)
    better = ratio > best
    return tl.where(better, ratio, best), tl.where(better, offs, best_at), mass + tl.maximum(e, 0.0)


@triton.jit
def _race_span(row_ptr, first, end, temperature, cols, floor, above, m, key_lo, key_hi):
    """The race over the tokens of ``[first, end)`` with ``key >= floor`` and ``key > above``:
    the winner of ``exp(s - m) / q`` (the first of a tie; -1 if there is no such token), its
    ratio and the mass ``sum(exp(s - m))`` of those tokens. Per lane across the pass,
    combined at its end."""
    best = tl.full(cols.shape, -1.0, tl.float32)
    best_at = tl.zeros(cols.shape, tl.int32)
    mass = tl.zeros(cols.shape, tl.float32)
    for start in range(first, end, cols.shape[0]):
        offs = start + cols
        s, valid = _scores(row_ptr, offs, end, temperature)
        key = _order_key(s)
        e = tl.where(valid & (key >= floor) & (key > above), tl.exp(s - m), -1.0)
        best, best_at, mass = _fold(e, offs, key_lo, key_hi, best, best_at, mass)
    winner, top = _pick_top(best, best_at, best >= 0.0, end)
    return winner, top, tl.sum(mass, axis=0)


@triton.jit
def _race(row_ptr, vocab, temperature, cols, floor, above, m, key_lo, key_hi):
    """``_race_span`` over the whole row: the winner and the mass."""
    winner, _, mass = _race_span(
        row_ptr, 0, vocab, temperature, cols, floor, above, m, key_lo, key_hi
    )
    return winner, mass


@triton.jit
def _race_online(row_ptr, first, end, temperature, cols, key_lo, key_hi):
    """``_race_span`` over every token of ``[first, end)`` when their largest score is not
    known yet (no top_k: no first pass for it). Each lane keeps its own running max and
    rescales its best ratio and mass when the max grows (as an online softmax does); the
    lanes are put on the span's max ``m`` at the end (0 where every score is -inf). Returns
    the winner, its ratio, the mass, the span's largest score (-inf included) and key."""
    m = tl.full(cols.shape, float("-inf"), tl.float32)
    best = tl.full(cols.shape, -1.0, tl.float32)
    best_at = tl.zeros(cols.shape, tl.int32)
    mass = tl.zeros(cols.shape, tl.float32)
    hi = tl.full(cols.shape, -(2**62), tl.int64)
    for start in range(first, end, cols.shape[0]):
        offs = start + cols
        s, valid = _scores(row_ptr, offs, end, temperature)
        hi = tl.maximum(hi, tl.where(valid, _order_key(s), -(2**62)))
        new_m = tl.maximum(m, s)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        scale = tl.exp(m - safe)
        best = tl.where(best >= 0.0, best * scale, best)
        mass = mass * scale
        e = tl.where(valid, tl.exp(s - safe), -1.0)
        best, best_at, mass = _fold(e, offs, key_lo, key_hi, best, best_at, mass)
        m = new_m
    span_m = tl.max(m, axis=0)
    row_m = tl.where(span_m == float("-inf"), 0.0, span_m)
    lane = tl.exp(tl.where(m == float("-inf"), row_m, m) - row_m)
    best = tl.where(best >= 0.0, best * lane, best)
    winner, top = _pick_top(best, best_at, best >= 0.0, end)
    return winner, top, tl.sum(mass * lane, axis=0), span_m, tl.max(hi, axis=0)


@triton.jit
def _key_at(row_ptr, i, vocab, temperature):
    """The order key of token ``i``'s score."""
    s, _ = _scores(row_ptr, i, vocab, temperature)
    return _order_key(s)


@triton.jit
def _bucket_shift(floor, top, BINS: tl.constexpr):
    """Buckets ``2**shift`` keys wide: the fewest bits that put ``[floor, top]`` in ``BINS``
    of them (a shift: an int64 division per token made the radix passes 3x slower on an
    H200)."""
    shift = tl.full((), 0, tl.int64)
    while ((top - floor) >> shift) >= BINS:
        shift += 1
    return shift


@triton.jit
def _narrow(counts, above, floor, top, shift, top_k, BINS: tl.constexpr):
    """One radix step: of the buckets of ``[floor, top]`` (``counts``; ``above`` tokens lie
    past ``top``), the highest whose tokens and those above it reach ``top_k`` holds the
    k-th key. Returns the new ``above, floor, top``."""
    bins = tl.arange(0, BINS)
    reach = above + tl.cumsum(counts, axis=0, reverse=True)
    b = tl.max(tl.where(reach >= top_k, bins, 0), axis=0)
    above += tl.sum(tl.where(bins > b, counts, 0), axis=0)
    width = tl.full((), 1, tl.int64) << shift
    floor = floor + b.to(tl.int64) * width
    return above, floor, tl.minimum(top, floor + width - 1)


@triton.jit
def _kth_key(keys, inside, top_k, BINS: tl.constexpr):
    """The ``top_k``-th largest of ``keys[inside]`` (at least ``top_k`` of them), by radix
    steps over the registers."""
    floor = tl.min(tl.where(inside, keys, 2**62), axis=0)
    top = tl.max(tl.where(inside, keys, -(2**62)), axis=0)
    above = tl.full((), 0, tl.int32)
    while floor < top:
        shift = _bucket_shift(floor, top, BINS)
        within = inside & (keys >= floor) & (keys <= top)
        bucket = tl.where(within, (keys - floor) >> shift, 0).to(tl.int32)
        counts = tl.histogram(bucket, BINS, mask=within)
        above, floor, top = _narrow(counts, above, floor, top, shift, top_k, BINS)
    return floor


@triton.jit
def _kth_key_of_row(row_ptr, vocab, temperature, cols, floor, top, top_k, BINS: tl.constexpr):
    """The row's ``top_k``-th largest key, at least ``floor`` (``top``: its largest), by radix
    steps of one pass over the row each (four at most for 32-bit keys)."""
    above = tl.full((), 0, tl.int32)
    while floor < top:
        shift = _bucket_shift(floor, top, BINS)
        counts = tl.zeros([BINS], tl.int32)
        for start in range(0, vocab, cols.shape[0]):
            offs = start + cols
            s, valid = _scores(row_ptr, offs, vocab, temperature)
            key = _order_key(s)
            within = valid & (key >= floor) & (key <= top)
            bucket = tl.where(within, (key - floor) >> shift, 0).to(tl.int32)
            counts += tl.histogram(bucket, BINS, mask=within)
        above, floor, top = _narrow(counts, above, floor, top, shift, top_k, BINS)
    return floor


@triton.jit
def _compact(row_ptr, first, end, temperature, cols, bound, ids_ptr, cap):
    """The ids of the tokens of ``[first, end)`` whose key is at least ``bound``, in order, to
    ``ids_ptr`` (the first ``cap`` of them); returns how many there are."""
    count = tl.full((), 0, tl.int32)
    for start in range(first, end, cols.shape[0]):
        offs = start + cols
        s, valid = _scores(row_ptr, offs, end, temperature)
        take = valid & (_order_key(s) >= bound)
        at = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(ids_ptr + at, offs, mask=take & (at < cap))
        count += tl.sum(take.to(tl.int32), axis=0)
    return count


@triton.jit
def _sample_candidates(
    row_ptr, vocab, temperature, ids, inside, top_k, top_p, m, key_lo, key_hi, max_rounds,
    BINS: tl.constexpr,
):  # fmt: skip
    """The token of a top_k row from its candidates (the token ids ``ids[inside]``, every
    kept token among them), in registers: the k-th key, the race over the kept tokens and
    the nucleus checks, as the passes over the row do them."""
    s, _ = _scores(row_ptr, ids, vocab, temperature)
    key = _order_key(s)
    kept = inside & (key >= _kth_key(key, inside, top_k, BINS))
    e = tl.where(kept, tl.exp(s - m), -1.0)
    ratio = _ratio(e, ids, key_lo, key_hi)
    best = _pick(ratio, ids, kept, vocab)
    if top_p < 1.0:
        limit = top_p * tl.sum(tl.maximum(e, 0.0), axis=0)
        checking = tl.full((), 1, tl.int32)
        rounds = tl.full((), 0, tl.int32)
        while (checking != 0) & (rounds < max_rounds):
            above = kept & (key > tl.max(tl.where(inside & (ids == best), key, -(2**62)), axis=0))
            nxt = _pick(ratio, ids, above, vocab)
            fits = (tl.sum(tl.where(above, e, 0.0), axis=0) < limit) | (nxt < 0)
            checking = tl.where(fits, 0, 1)
            best = tl.where(fits, best, nxt)
            rounds += 1
        if checking != 0:
            best = _pick(
                ratio, ids, kept & (key >= tl.max(tl.where(kept, key, -(2**62)), axis=0)), vocab
            )
    return best


@triton.jit
def _entry(table_ptr, entry_id):
    """Entry ``entry_id`` of the table: its row, top_k, temperature, top_p and the halves of
    its noise key."""
    entry = table_ptr + entry_id * _COLUMNS
    row = tl.load(entry)
    top_k = tl.load(entry + 1)
    temperature = tl.load(entry + 2).to(tl.int32).to(tl.float32, bitcast=True)
    top_p = tl.load(entry + 3).to(tl.int32).to(tl.float32, bitcast=True)
    seed_key = tl.load(entry + 4)
    key_lo = (seed_key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((seed_key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return row, top_k, temperature, top_p, key_lo, key_hi


# A chunk's record in the partials buffer: PART_FIELDS int32 per entry and chunk, floats as
# their bits. For a row without a top_k: 0 its largest score (-inf where every score is), 1 the
# mass and 2 the best ratio (both put on that score), 3 the winner, 4 the largest key; then
# its part of the first nucleus check: 5 the best ratio above the winner, 6 the mass above it,
# 7 that race's winner (-1: none). For a row whose top_k is found in chunks: 0 its largest
# score, 1 its bound (the k-th largest of its lanes' largest keys, or NO_BOUND), 4 its largest
# key, 7 how many of its tokens are at or above the row's bound.
PART_FIELDS = tl.constexpr(8)
NO_BOUND = tl.constexpr(-(2**31))  # (below every float32 order key; -inf's is -2139095041)


@triton.jit(do_not_specialize=["chunk", "chunk_k"])
def _race_chunks_kernel(
    logits_ptr, row_stride, vocab, table_ptr, part_ptr, chunk, chunk_k, BLOCK: tl.constexpr,
    BINS: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """Step 4 of the rows without a top_k, over more programs: program ``(i, c)`` races
    chunk ``c`` of entry ``i``'s row (``_race_online``) and writes its record. With
    ``TOP_K``, step 1 of the rows with a top_k of at most ``chunk_k``: the chunk's largest
    score and key, and the k-th largest of its lanes' largest keys (or no bound, where the
    chunk has fewer lanes than k), which is at or below the row's k-th key."""
    entry_id = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row, top_k, temperature, _, key_lo, key_hi = _entry(table_ptr, entry_id)
    first = c * chunk
    end = tl.minimum(first + chunk, vocab)
    at = part_ptr + (entry_id * tl.num_programs(1) + c) * PART_FIELDS
    cols = tl.arange(0, BLOCK)
    if TOP_K:  # noqa: SIM102 (a static branch)
        if (top_k > 0) & (top_k <= chunk_k):
            m = tl.full((BLOCK,), float("-inf"), tl.float32)
            lane_hi = tl.full((BLOCK,), -(2**62), tl.int64)
            for start in range(first, end, BLOCK):
                s, valid = _scores(logits_ptr + row * row_stride, start + cols, end, temperature)
                m = tl.maximum(m, s)
                lane_hi = tl.maximum(lane_hi, tl.where(valid, _order_key(s), -(2**62)))
            bound = tl.full((), NO_BOUND, tl.int64)
            if top_k <= end - first:
                bound = _kth_key(lane_hi, cols < end - first, top_k, BINS)
            tl.store(at, tl.max(m, axis=0).to(tl.int32, bitcast=True))
            tl.store(at + 1, bound.to(tl.int32))
            tl.store(at + 4, tl.max(lane_hi, axis=0).to(tl.int32))
    if top_k <= 0:  # (as the row's program has them: no top_k)
        winner, top, mass, m, hi = _race_online(
            logits_ptr + row * row_stride, first, end, temperature, cols, key_lo, key_hi
        )
        tl.store(at, m.to(tl.int32, bitcast=True))
        tl.store(at + 1, mass.to(tl.int32, bitcast=True))
        tl.store(at + 2, top.to(tl.int32, bitcast=True))
        tl.store(at + 3, winner)
        tl.store(at + 4, hi.to(tl.int32))


@triton.jit
def _combine_races(part_ptr, entry_id, n_chunks, vocab, CHUNKS_P2: tl.constexpr):
    """The row's race from its chunks' records: each chunk's ratios and mass are put on the
    row's largest score ``m`` (0 where every score is -inf). Returns ``m``, the mass, the
    winner and the largest key, as ``_race_online`` over the row does."""
    c = tl.arange(0, CHUNKS_P2)
    ok = c < n_chunks
    at = part_ptr + (entry_id * n_chunks + c) * PART_FIELDS
    m_c = tl.where(ok, tl.load(at, mask=ok, other=0).to(tl.float32, bitcast=True), float("-inf"))
    mass_c = tl.load(at + 1, mask=ok, other=0).to(tl.float32, bitcast=True)
    ratio_c = tl.load(at + 2, mask=ok, other=0).to(tl.float32, bitcast=True)
    winner_c = tl.load(at + 3, mask=ok, other=0)
    hi_c = tl.load(at + 4, mask=ok, other=0).to(tl.int64)
    m = tl.max(m_c, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    # a chunk of -inf scores has mass 0 and ratios 0 (put on 0): scale 0 keeps them there
    scale = tl.where(m_c == float("-inf"), 0.0, tl.exp(m_c - m))
    best = _pick(ratio_c * scale, winner_c, ok, vocab)
    z = tl.sum(tl.where(ok, mass_c * scale, 0.0), axis=0)
    return m, z, best, tl.max(tl.where(ok, hi_c, -(2**62)), axis=0)


@triton.jit(do_not_specialize=["chunk", "chunk_k", "seg"])
def _check_chunks_kernel(
    logits_ptr, row_stride, vocab, table_ptr, part_ptr, chunk, chunk_k, max_rounds, scratch_ptr,
    seg, BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr, CANDIDATES: tl.constexpr,
):  # fmt: skip
    """The first nucleus check of the rows without a top_k, over more programs: program
    ``(i, c)`` combines entry ``i``'s race and races chunk ``c``'s tokens above its winner.
    With ``CANDIDATES``, step 2 of the rows with a top_k of at most ``chunk_k``: chunk ``c``'s
    tokens at or above the row's bound (the largest of its chunks' bounds) go to segment
    ``c`` of the row's scratch (``seg`` ids), in order, their count to its record."""
    entry_id = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row, top_k, temperature, top_p, key_lo, key_hi = _entry(table_ptr, entry_id)
    if CANDIDATES > 0:  # noqa: SIM102 (a static branch)
        if (top_k > 0) & (top_k <= chunk_k):
            row_ptr = logits_ptr + row * row_stride
            k = tl.arange(0, CHUNKS_P2)
            parts = part_ptr + (entry_id * tl.num_programs(1) + k) * PART_FIELDS
            bound = tl.max(tl.load(parts + 1, mask=k < tl.num_programs(1), other=NO_BOUND), axis=0)
            first = c * chunk
            end = tl.minimum(first + chunk, vocab)
            count = _compact(
                row_ptr, first, end, temperature, tl.arange(0, BLOCK), bound,
                scratch_ptr + entry_id * CANDIDATES + c * seg, seg,
            )  # fmt: skip
            tl.store(part_ptr + (entry_id * tl.num_programs(1) + c) * PART_FIELDS + 7, count)
    if (top_k <= 0) & (top_p < 1.0) & (max_rounds > 0):
        row_ptr = logits_ptr + row * row_stride
        m, _, best, _ = _combine_races(part_ptr, entry_id, tl.num_programs(1), vocab, CHUNKS_P2)
        first = c * chunk
        nxt, top, mass = _race_span(
            row_ptr, first, tl.minimum(first + chunk, vocab), temperature, tl.arange(0, BLOCK),
            tl.full((), -(2**62), tl.int64), _key_at(row_ptr, best, vocab, temperature), m,
            key_lo, key_hi,
        )  # fmt: skip
        at = part_ptr + (entry_id * tl.num_programs(1) + c) * PART_FIELDS
        tl.store(at + 5, top.to(tl.int32, bitcast=True))
        tl.store(at + 6, mass.to(tl.int32, bitcast=True))
        tl.store(at + 7, nxt)


@triton.jit
def _combine_checks(part_ptr, entry_id, n_chunks, vocab, CHUNKS_P2: tl.constexpr):
    """The first nucleus check from the chunks' records: the next winner (-1: no token above
    the winner) and the mass above the winner."""
    c = tl.arange(0, CHUNKS_P2)
    ok = c < n_chunks
    at = part_ptr + (entry_id * n_chunks + c) * PART_FIELDS
    ratio_c = tl.load(at + 5, mask=ok, other=0).to(tl.float32, bitcast=True)
    mass_c = tl.load(at + 6, mask=ok, other=0).to(tl.float32, bitcast=True)
    nxt_c = tl.load(at + 7, mask=ok, other=0)
    return _pick(ratio_c, nxt_c, ok, vocab), tl.sum(tl.where(ok, mass_c, 0.0), axis=0)


@triton.jit(do_not_specialize=["n_chunks", "seg", "chunk_k"])
def _sample_kernel(
    logits_ptr,  # [rows, vocab]
    row_stride,
    vocab,
    table_ptr,  # int64 [n, TABLE_COLUMNS]
    out_ptr,  # int64 [rows]: out[row] = its token
    scratch_ptr,  # int32 [n, CANDIDATES]: each entry's candidates (used only when CANDIDATES)
    part_ptr,  # int32 [n, n_chunks, PART_FIELDS]: the chunks' records (read only when CHUNKS)
    n_chunks,
    seg,  # scratch ids per chunk (CHUNK_TOP_K)
    chunk_k,  # the largest top_k a row's steps 1-2 are made in chunks for (CHUNK_TOP_K)
    max_rounds,  # (a runtime value: a constant 0 made Triton 3.6's coalesce pass fail)
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
    CANDIDATES: tl.constexpr,  # at most BLOCK
    CHUNKS: tl.constexpr,  # the rows without a top_k were raced (and checked once) in chunks
    CHUNKS_P2: tl.constexpr,  # a power of two at least n_chunks
    CHUNK_TOP_K: tl.constexpr = False,  # rows with a top_k up to chunk_k: steps 1-2 too
):
    entry_id = tl.program_id(0).to(tl.int64)
    row, top_k, temperature, top_p, key_lo, key_hi = _entry(table_ptr, entry_id)
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)

    # A top_k row's lower bound on its k-th key: the row's least key, then step 1's bound
    # (the lanes' or chunks' k-th largest), then the k-th key itself once step 2 found it on
    # the fallback path. (The radix helpers' own ``floor`` is the low end of their search.)
    floor = tl.full((), -(2**62), tl.int64)
    z = tl.full((), 0.0, tl.float32)
    in_registers = tl.full((), 0, tl.int32)  # the row was sampled from its candidates
    checking = tl.full((), 1, tl.int32)  # the winner's place in the nucleus is not known yet
    rounds = tl.full((), 0, tl.int32)  # nucleus checks made
    if top_k > 0:
        chunked = tl.full((), 0, tl.int32)  # steps 1 and 2 were made in chunks
        count = tl.full((), CANDIDATES + 1, tl.int32)
        m = tl.full((), 0.0, tl.float32)
        hi = tl.full((), 0, tl.int64)
        if CHUNK_TOP_K:  # noqa: SIM102 (a static branch)
            if top_k <= chunk_k:
                # 1 and 2 from the chunks' records
                k = tl.arange(0, CHUNKS_P2)
                parts = part_ptr + (entry_id * n_chunks + k) * PART_FIELDS
                ok = k < n_chunks
                m_c = tl.load(parts, mask=ok, other=0).to(tl.float32, bitcast=True)
                m = tl.max(tl.where(ok, m_c, float("-inf")), axis=0)
                m = tl.where(m == float("-inf"), 0.0, m)
                floor = tl.max(tl.load(parts + 1, mask=ok, other=NO_BOUND), axis=0).to(tl.int64)
                hi = tl.max(tl.load(parts + 4, mask=ok, other=NO_BOUND), axis=0).to(tl.int64)
                counts = tl.load(parts + 7, mask=ok, other=0)
                count = tl.where(tl.max(counts, axis=0) <= seg, 0, CANDIDATES + 1)
                chunked = tl.full((), 1, tl.int32)
        if chunked == 0:
            # 1. the largest score, the keys' range and each lane's largest key
            m_lanes = tl.full((BLOCK,), float("-inf"), tl.float32)
            lo = tl.full((BLOCK,), 2**62, tl.int64)
            hi_lanes = tl.full((BLOCK,), -(2**62), tl.int64)
            for start in range(0, vocab, BLOCK):
                offs = start + cols
                s, valid = _scores(row_ptr, offs, vocab, temperature)
                key = _order_key(s)
                m_lanes = tl.maximum(m_lanes, s)
                lo = tl.minimum(lo, tl.where(valid, key, 2**62))
                hi_lanes = tl.maximum(hi_lanes, tl.where(valid, key, -(2**62)))
            m = tl.max(m_lanes, axis=0)
            m = tl.where(m == float("-inf"), 0.0, m)
            floor = tl.min(lo, axis=0)
            hi = tl.max(hi_lanes, axis=0)

            # 2. the candidates: the k-th largest of the lanes' largest keys is at or below
            # the row's k-th (k lanes hold a token at or above it), so the tokens at or above
            # it hold the kept set. Their ids go to the row's scratch; when they fit, the rest
            # of the row's work runs on them in registers, with no more passes over the row.
            if CANDIDATES > 0:  # noqa: SIM102 (a static branch: a launch with no top_k row compiles without it)
                if top_k <= tl.minimum(vocab, BLOCK):
                    floor = _kth_key(hi_lanes, cols < vocab, top_k, BINS)
                    count = _compact(
                        row_ptr, 0, vocab, temperature, cols, floor,
                        scratch_ptr + entry_id * CANDIDATES, CANDIDATES,
                    )  # fmt: skip
        if count <= CANDIDATES:
            tl.debug_barrier()  # every thread's stores are seen by the loads below
            if chunked != 0:  # segment c of the scratch holds chunk c's candidates
                c = cols // seg
                inside = (c < n_chunks) & (cols - c * seg < tl.load(
                    part_ptr + (entry_id * n_chunks + c) * PART_FIELDS + 7, mask=c < n_chunks,
                    other=0))  # fmt: skip
            else:
                inside = cols < count
            ids = tl.load(
                scratch_ptr + entry_id * CANDIDATES + cols, mask=inside, other=0,
                cache_modifier=".cg",
            ).to(tl.int32)  # fmt: skip
            best = _sample_candidates(
                row_ptr, vocab, temperature, ids, inside, top_k, top_p, m, key_lo, key_hi,
                max_rounds, BINS,
            )  # fmt: skip
            in_registers = 1
        else:
            # 3. the k-th largest key, bucket by bucket from the top of the range
            floor = _kth_key_of_row(row_ptr, vocab, temperature, cols, floor, hi, top_k, BINS)
            # 4. the race over the kept tokens, and their mass
            best, z = _race(row_ptr, vocab, temperature, cols, floor, floor - 1, m, key_lo, key_hi)
    elif CHUNKS:
        # 4 and the first check of 5, from the chunks' records
        m, z, best, hi = _combine_races(part_ptr, entry_id, n_chunks, vocab, CHUNKS_P2)
        if (top_p < 1.0) & (max_rounds > 0):
            nxt, above_mass = _combine_checks(part_ptr, entry_id, n_chunks, vocab, CHUNKS_P2)
            in_nucleus = (above_mass < top_p * z) | (nxt < 0)
            checking = tl.where(in_nucleus, 0, 1)
            best = tl.where(in_nucleus, best, nxt)
            rounds = tl.full((), 1, tl.int32)
    else:
        # 1 and 4 in one pass: every token is kept
        best, _, z, m, hi = _race_online(row_ptr, 0, vocab, temperature, cols, key_lo, key_hi)
        m = tl.where(m == float("-inf"), 0.0, m)

    # 5. top_p: is the winner in the nucleus? The race above it says (its mass) and names the
    # next winner to check if not (same noise). A winner with nothing above it is in it
    # whatever the masses say (a top_p that rounds to 0 in float32, a row of -inf).
    # After MAX_ROUNDS misses the row takes its best token, which is always in the nucleus.
    if (top_p < 1.0) & (in_registers == 0):
        limit = top_p * z
        while (checking != 0) & (rounds < max_rounds):
            nxt, above_mass = _race(
                row_ptr, vocab, temperature, cols, floor, _key_at(row_ptr, best, vocab, temperature),
                m, key_lo, key_hi,
            )  # fmt: skip
            in_nucleus = (above_mass < limit) | (nxt < 0)
            checking = tl.where(in_nucleus, 0, 1)
            best = tl.where(in_nucleus, best, nxt)
            rounds += 1
        if checking != 0:
            best, z = _race(row_ptr, vocab, temperature, cols, hi, hi - 1, m, key_lo, key_hi)
    tl.store(out_ptr + row, best.to(tl.int64))


def chunking(rows: int, vocab: int) -> tuple[int, int]:
    """``(chunks, chunk)``: how many chunks of ``chunk`` tokens the rows without a top_k are
    raced in (1: none; one program a row). Chunks of at least ``CHUNK_MIN`` tokens, until
    the launch has about ``CHUNK_PROGRAMS`` programs; none below ``CHUNKS_MIN`` chunks."""
    want = min(cdiv(vocab, CHUNK_MIN), CHUNK_PROGRAMS // rows)
    if want < max(CHUNKS_MIN, 2):
        return 1, vocab
    chunk = cdiv(cdiv(vocab, want), CHUNK_BLOCK) * CHUNK_BLOCK
    return cdiv(vocab, chunk), chunk


def sample_table(
    logits: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    top_ks: Sequence[int] | None = None,
) -> None:
    """Write into ``out[row]`` the token of each row the ``table`` lists (``TABLE_COLUMNS``).

    ``logits`` ``[rows, vocab]`` (unit stride over the vocabulary), ``table`` int64 ``[n,
    TABLE_COLUMNS]`` on the same device (its top_k 0 or in [1, vocab), its temperature > 0,
    its top_p in (0, 1]), ``out`` int64 ``[rows]``. ``top_ks``: the table's top_k column as
    host ints, which picks the launches (None: any; rows with a top_k take a buffer of
    ``CANDIDATES`` ids each, a small batch takes chunks). No host sync."""
    fn = "sample_table"
    check_tensor(fn, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_tensor(fn, "table", table, ndim=2, dtypes=(torch.int64,), device=logits.device,
                 contiguous=True)  # fmt: skip
    check_tensor(fn, "out", out, ndim=1, dtypes=(torch.int64,), device=logits.device)
    if table.shape[1] != TABLE_COLUMNS:
        raise ValueError(
            f"{fn}: table must have {TABLE_COLUMNS} columns (row, top_k, temperature bits, "
            f"top_p bits, key), got shape {tuple(table.shape)}"
        )
    if out.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{fn}: out must have one entry per row of logits ({logits.shape[0]}), got "
            f"{out.shape[0]}"
        )
    if top_ks is not None and len(top_ks) != table.shape[0]:
        raise ValueError(
            f"{fn}: top_ks must have one entry per table row ({table.shape[0]}), got {len(top_ks)}"
        )
    if table.shape[0] == 0:
        return
    block = min(BLOCK, next_power_of_2(logits.shape[1]))
    top_k = top_ks is None or max(top_ks) > 0
    plain = top_ks is None or min(top_ks) <= 0
    candidates = min(CANDIDATES, block) if top_k else 0
    scratch = (
        torch.empty((table.shape[0], candidates), dtype=torch.int32, device=logits.device)
        if candidates
        else out  # (never read or written)
    )
    n, vocab = table.shape[0], logits.shape[1]
    chunks, chunk = chunking(n, vocab)
    part = out  # (never read or written)
    block_c = min(CHUNK_BLOCK, chunk)
    seg = candidates // chunks  # (a chunk's share of a row's candidates)
    # (one value per model: a batch size that changes the chunk count compiles nothing new)
    chunks_p2 = next_power_of_2(max(chunks, cdiv(vocab, CHUNK_MIN)))
    # A top_k row is found in chunks when its candidates (about k a chunk) fit a chunk's share
    # twice over; a top_k of 1000 in 16 chunks spilled to the passes over the row, 3x slower.
    chunk_k = min(block_c, seg // 2) if chunks > 1 else 0
    chunk_top_k = candidates > 0 and chunk_k > 0
    if chunk_top_k and top_ks is not None:
        chunk_top_k = any(0 < k <= chunk_k for k in top_ks)
    if not (plain or chunk_top_k):
        chunks, chunk_k = 1, 0
    if chunks > 1:
        part = torch.empty((n, chunks, PART_FIELDS.value), dtype=torch.int32, device=out.device)
        common = (logits, logits.stride(0), vocab, table, part, chunk)
        _race_chunks_kernel[(n, chunks)](
            *common, chunk_k, BLOCK=block_c, BINS=BINS, TOP_K=chunk_top_k, num_warps=CHUNK_WARPS
        )
        _check_chunks_kernel[(n, chunks)](
            *common, chunk_k, MAX_ROUNDS, scratch, seg, BLOCK=block_c,
            CHUNKS_P2=chunks_p2, CANDIDATES=candidates if chunk_top_k else 0,
            num_warps=CHUNK_WARPS,
        )  # fmt: skip
    _sample_kernel[(n,)](
        logits, logits.stride(0), vocab, table, out, scratch, part, chunks, seg, chunk_k,
        MAX_ROUNDS, BLOCK=block, BINS=BINS, CANDIDATES=candidates, CHUNKS=chunks > 1,
        CHUNKS_P2=chunks_p2, CHUNK_TOP_K=chunks > 1 and chunk_top_k,
        num_warps=NUM_WARPS,
    )  # fmt: skip
