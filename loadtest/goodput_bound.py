"""An upper bound on the goodput of any scheduling policy on this engine and sim device, per trace and SLO
pair, computed from the trace and the preset's cost model alone (`loadtest/goodput.py` reports it next to
the measured goodputs).

The device model it relies on (`app/backends/sim.py`, `app/engine/scheduler.py`):
1. Calls run one at a time; a request's tokens are stamped at the end of the call that produced them, and
   no call for a request starts before it arrives.
2. A request's first token comes from a prefill call holding its prompt. A prefill call of m sequences
   costs m x `prefill_s(bucket of its longest prompt)`, so at least the sum of each sequence's own
   `p = prefill_s(context_bucket(prompt), 1)` (the cost grows with the bucket). With prefix caching (a
   trace with repeated prefixes, on a sim artifact with KV blocks), a row may start past a cached prefix
   of whole blocks, at most all but its last token, and the sim charges it `cached_prefill_s` (less the
   more is cached). No cache holds more of a prompt than it shares with another request's prompt (the
   sim's generated tokens are hashes, which the traces' prompts do not resend), whichever was prefilled
   first, so p is the cheaper of its full prefill and its prefill past that much: a valid floor for every
   request, looser than needed for the first of each shared prefix. For an engine that could also
   prefill a prompt in parts (`PrefixCache.partial_prefills`: each part a call ending at a context
   bucket, computed past the parts before it), p is the cheapest such plan's sum.
3. Each later token comes from its own call (one token per sequence per call): a decode step, at least
   `decode_s(smallest batch bucket, token_bucket(position + 1))` (the step is padded to its longest
   sequence), or, where a policy preempts, a recompute prefill, at least the cheapest prefill. So token k
   (k >= 2) of a request with prompt P costs at least `c(P + k - 1)`, the smaller of the two, and the
   request needs at least `D = sum of c(P + k - 1) for k = 2..n` of device time between its first and
   last token on top of any other request's calls in between. Preemption only adds calls.

A request meets its SLOs when TTFT = F - a <= T and TPOT = (L - F) / (n - 1) <= S (a: arrival, F / L:
its first / last token). So an on-time request's prefill lies inside its TTFT window [a, a + T] (a call
of several sequences lies inside each one's window and lasts at least their sum, so it is at least as
much in the way as their one-sequence calls), and a request that meets both has at most
`B = (n - 1) S - D` (its stall budget) of other calls between F and L. A request that misses can be served
after everything else, so it is in no one's way. Lower bounds on the number of requests that miss at a
rate (`misses_floor`), each a set of requests of which at least k miss:
- Alone: p > T, or B < 0.
- TTFT windows: the on-time requests arriving in [s, e - T] prefill inside [s, e]; if their prefills add
  up to more than e - s, as many miss as must be dropped, largest first, to fit.
- Stalls: for i on time, a + p <= F <= a + T and [F, F + D + X] lies inside [F, L], where X is the
  prefills of the on-time requests whose TTFT window lies inside it (a fixed point: each one stalls i
  and so lengthens it). If X exceeds B for every F the arrivals allow, then i or one of them misses.
- Capacity: in [s, e], the on-time requests' prefill calls inside their windows, plus 1 / slots of their
  token calls there (a decode step serves at most `slots` sequences; a recompute prefill serves its own):
  D, less what fits in [F, s] (F >= a + p) and in [e, L] (L <= a + T + (n - 1) S). Work beyond e - s:
  as many miss as must be dropped, largest first.
Each set is a range of requests in arrival order; the most misses from disjoint ranges (weighted interval
scheduling) plus the requests that miss alone is a lower bound on the misses of every policy.

The bound (`goodput_bound`): attainment >= `target` allows at most (1 - target) x requests misses. The TTFT
windows and a coarser capacity floor (`steady_conflicts`) only grow with the rate (arrivals close in), so
the lowest rate at which they forbid the target is found by bisection, and no higher rate reaches it.
Below it the rest is not monotone (an arrival can leave another's window), so the bound is the highest
rate of a 2 % geometric grid down from there at which the whole floor allows the target: no policy
reaches the target at any rate of that grid above it, nor at any rate past the bisection's.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.backends.base import GREEDY, PrefillBatch
from app.backends.sim import CostModel
from app.shapes import ShapeGrid
from loadtest.traces import Trace

EPS = 1e-9  # seconds: every comparison leans towards the policy, so float error never tightens the bound
SPAN = 48  # the most requests a TTFT-window conflict spans (each window starts at an arrival)
CAPACITY_STRIDE = 16  # capacity windows start at every 16th arrival
STEADY_QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)  # of (n - 1) S: the windows' tails past a_hi + T
GRID_STEP = 1.02  # the rate grid scanned down from where the monotone floor forbids the target
RATE_PRECISION = 1.001  # the bisection of the monotone floor (TTFT windows, steady capacity) stops here


@dataclass(frozen=True)
class Floors:
    """Per request: the least device time its first-token prefill (p) and its later tokens (D) take."""

    prefill_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    tokens: tuple[int, ...]
    slots: int  # the most sequences a call serves


@dataclass(frozen=True)
class PrefixCache:
    """What a prefix cache can hold: KV in blocks of `block_size` positions, the prompts' tokens drawn from
    a vocabulary of `vocab` (`Trace.prompt`). `partial_prefills`: the floors of an engine that may also
    prefill a prompt in parts, each ending at a context bucket past where the one before it ended and
    computed past that KV (`prefill_floor`); the parts are separate calls, so everything below holds with
    their sum as the prompt's prefill."""

    block_size: int
    vocab: int
    partial_prefills: bool = False


def token_cost(cost: CostModel, grid: ShapeGrid, length: int) -> float:
    """The least a call producing the token after `length` tokens costs: a decode step of the smallest
    batch bucket padded to at least `length`'s token bucket, or a recompute prefill."""
    assert cost.decode_fixed_s >= 0 and cost.decode_per_row_s >= 0 and cost.decode_per_row_token_s >= 0
    step = cost.decode_s(grid.batch_buckets[0], grid.token_bucket(min(length, grid.max_positions)))
    return min(step, min(cost.prefill_s(bucket, 1) for bucket in grid.context_buckets))


def cacheable_tokens(trace: Trace, cache: PrefixCache) -> list[int]:
    """Per request, the most leading prompt tokens any cache could hold at its prefill: the longest prefix
    it shares with another request's prompt, in whole blocks, at most all but its last token."""
    prompts = [tuple(trace.prompt(index, cache.vocab)) for index in range(len(trace))]
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    shared = [0] * len(prompts)
    for a, b in itertools.pairwise(order):  # the longest common prefix is with a neighbour in sorted order
        common = _common_prefix(prompts[a], prompts[b])
        shared[a], shared[b] = max(shared[a], common), max(shared[b], common)
    return [
        min(common, len(prompt) - 1) // cache.block_size * cache.block_size
        for common, prompt in zip(shared, prompts, strict=True)
    ]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:length]) != np.asarray(b[:length]))
    return int(differ[0]) if len(differ) else length


def prefill_floor(cost: CostModel, grid: ShapeGrid, prompt: int, cached: int, parts: bool = False) -> float:
    """The least a prompt's prefill costs with `cached` leading tokens available: computed in full, or
    past them at the sim's cached-prefill cost (less the more is cached); with `parts`, also in parts
    (`PrefixCache.partial_prefills`), from the first token or past the cached ones."""
    if not parts:
        full = _call(cost, grid, prompt, 0)
        return min(full, _call(cost, grid, prompt, cached)) if cached else full

    @functools.cache
    def in_parts(start: int) -> float:
        whole = _call(cost, grid, prompt, start)
        splits = [
            _call(cost, grid, start + bucket, start) + in_parts(start + bucket)
            for bucket in grid.context_buckets
            if start + bucket < prompt
        ]
        return min([whole, *splits])

    return min(in_parts(0), in_parts(cached))


def _call(cost: CostModel, grid: ShapeGrid, end: int, start: int) -> float:
    """One prefill call computing positions start .. end - 1, past the KV of those before `start`."""
    if not start:
        return cost.prefill_s(grid.context_bucket(end), 1)
    call = PrefillBatch((0,), ((0,) * end,), (GREEDY,), grid.context_bucket(end - start), (start,))
    return cost.cached_prefill_s(call)


def floors(cost: CostModel, grid: ShapeGrid, trace: Trace, cache: PrefixCache | None = None) -> Floors:
    """Each request's floors; with `cache`, its prefill may start past what any cache could hold."""
    assert all(
        cost.prefill_s(a, 1) <= cost.prefill_s(b, 1) for a, b in itertools.pairwise(grid.context_buckets)
    ), "a prefill's cost must grow with its bucket (a call's cost is at least its sequences' own)"
    costs = [token_cost(cost, grid, length) for length in range(grid.max_positions + 1)]
    cached = cacheable_tokens(trace, cache) if cache is not None else [0] * len(trace)
    prefill, decode, tokens = [], [], []
    for prompt, output, hit in zip(trace.prompt_lens, trace.output_lens, cached, strict=True):
        n = min(output, grid.max_positions - prompt)  # the scheduler stops a sequence at max_positions
        prefill.append(prefill_floor(cost, grid, prompt, hit, cache is not None and cache.partial_prefills))
        decode.append(sum(costs[prompt + k - 1] for k in range(2, n + 1)))
        tokens.append(n)
    return Floors(tuple(prefill), tuple(decode), tuple(tokens), grid.num_slots)


def drops(parts: list[float], room: float) -> int:
    """How many of `parts` must go, largest first, for the rest to fit in `room`."""
    total, count = sum(parts), 0
    for part in sorted(parts, reverse=True):
        if total <= room + EPS:
            break
        total -= part
        count += 1
    return count


Conflict = tuple[int, int, int]  # (first, last request index, misses at least)


def window_conflicts(
    arrivals: Sequence[float], prefill: Sequence[float], live: Sequence[bool], ttft: float
) -> list[Conflict]:
    """TTFT windows [arrival of lo, arrival of hi + T]: each on-time request of lo..hi prefills inside."""
    n = len(arrivals)
    conflicts = []
    for lo in range(n):
        start, inside, parts = arrivals[lo], 0.0, []
        for hi in range(lo, min(n, lo + SPAN)):
            if live[hi]:
                parts.append(prefill[hi])
                inside += prefill[hi]
            room = arrivals[hi] + ttft - start
            if inside > room + EPS:
                conflicts.append((lo, hi, drops(parts, room)))
    return conflicts


def stall_conflicts(
    arrivals: Sequence[float], floors_: Floors, live: Sequence[bool], ttft: float, tpot: float
) -> list[Conflict]:
    """For each request i: the least stall its first token's time F allows, against its budget."""
    conflicts = []
    for i in range(len(arrivals)):
        if not live[i] or floors_.tokens[i] < 2:
            continue
        budget = (floors_.tokens[i] - 1) * tpot - floors_.decode_s[i]
        earliest = arrivals[i] + floors_.prefill_s[i]
        first = bisect.bisect_left(arrivals, earliest, lo=i + 1)
        last_first = bisect.bisect_left(arrivals, arrivals[i] + ttft, lo=first)
        # F lies in [a + p, a + T]; with requests m.. arriving at or after it, F is at least the later of
        # a + p and the arrival of m - 1
        reach = 0
        for m in range(first, last_first + 1):
            start = earliest if m == first else arrivals[m - 1]
            stall, j = _stall(arrivals, floors_, live, ttft, budget, start + floors_.decode_s[i], m)
            reach = max(reach, j - 1)
            if stall <= budget + EPS:
                break
        else:
            conflicts.append((i, max(i, reach), 1))
    return conflicts


def _stall(
    arrivals: Sequence[float],
    floors_: Floors,
    live: Sequence[bool],
    ttft: float,
    budget: float,
    end: float,
    j: int,
) -> tuple[float, int]:
    """The prefills of the requests from j on whose TTFT window ends by `end`, which each push `end` on (a
    fixed point), until they exceed `budget`; and the index after the last one counted."""
    stall = 0.0
    while j < len(arrivals) and arrivals[j] + ttft <= end and stall <= budget + EPS:
        if live[j]:
            stall += floors_.prefill_s[j]
            end += floors_.prefill_s[j]  # it stalls i before its last token, which comes later still
        j += 1
    return stall, j


def steady_conflicts(
    arrivals: Sequence[float], floors_: Floors, live: Sequence[bool], ttft: float, tpot: float
) -> list[Conflict]:
    """Device time in [a_lo, a_hi + T + K] against the work of the requests lo..hi inside: each one's
    prefill and 1 / slots of its token calls, less what may come after the window (L <= a + T + (n - 1) S,
    counted as if it arrived at a_hi). Independent of the rate but for the window's length, so the floor
    these give only grows with the rate. Each conflict: at least the excess over the largest such work."""
    a = np.asarray(arrivals)
    alive = np.asarray(live)
    slack = (np.asarray(floors_.tokens) - 1).clip(0) * tpot
    conflicts = []
    for extra in np.quantile(slack, STEADY_QUANTILES):
        work = np.where(
            alive,
            np.asarray(floors_.prefill_s)
            + np.maximum(0.0, np.asarray(floors_.decode_s) - np.maximum(0.0, slack - extra)) / floors_.slots,
            0.0,
        )
        total = np.concatenate([[0.0], np.cumsum(work)])
        for lo in range(0, len(a), CAPACITY_STRIDE):
            excess = total[lo + 1 :] - total[lo] - (a[lo:] - a[lo] + ttft + extra)
            largest = np.maximum.accumulate(work[lo:])
            counts = np.ceil(np.where(excess > EPS, excess, 0.0) / np.maximum(largest, EPS))
            conflicts.extend((lo, lo + hi, int(k)) for hi, k in enumerate(counts.tolist()) if k > 0)
    return conflicts


def capacity_conflicts(
    arrivals: Sequence[float], floors_: Floors, live: Sequence[bool], ttft: float, tpot: float
) -> list[Conflict]:
    """Device time in [s, e] (s an arrival, e a TTFT deadline or a latest last token) against the work the
    on-time requests must do inside: each one's forced prefill part and 1 / slots of its token calls
    there (a decode step serves at most `slots` sequences), which are D less what fits in [F, s]
    (F >= a + p) and in [e, L] (L <= a + T + (n - 1) S)."""
    a = np.asarray(arrivals)
    alive = np.asarray(live)
    p = np.where(alive, np.asarray(floors_.prefill_s), 0.0)
    d = np.where(alive, np.asarray(floors_.decode_s), 0.0)
    latest = a + ttft + (np.maximum(np.asarray(floors_.tokens), 1) - 1) * tpot
    ends = np.unique(np.concatenate([a + ttft, latest]))
    conflicts = []
    for lo in range(0, len(a), CAPACITY_STRIDE):
        start = a[lo]
        e = ends[ends > start][None, :]
        room = e[0] - start
        prefill = np.maximum(
            0.0,
            np.minimum(
                np.minimum(p[:, None], e - start),
                np.minimum((a + p - start)[:, None], e - (a + ttft - p)[:, None]),
            ),
        )
        tokens = d[:, None] - np.maximum(0.0, start - a - p)[:, None] - np.maximum(0.0, latest[:, None] - e)
        work = np.where(alive[:, None], prefill + np.maximum(0.0, tokens) / floors_.slots, 0.0)
        total = work.sum(axis=0)
        over = np.nonzero(total > room + EPS)[0]
        if not len(over):
            continue
        work, total, room = work[:, over], total[over], room[over]
        largest = -np.sort(-work, axis=0)
        before = np.cumsum(largest, axis=0) - largest  # dropped before each, largest first
        counts = (total - before > room + EPS).sum(axis=0)
        busy = work > 0
        firsts = busy.argmax(axis=0)
        lasts = len(a) - 1 - busy[::-1].argmax(axis=0)
        conflicts.extend(zip(firsts.tolist(), lasts.tolist(), counts.tolist(), strict=True))
    return conflicts


def most_disjoint(n: int, conflicts: list[Conflict]) -> int:
    """The most misses from conflicts with disjoint ranges (weighted interval scheduling)."""
    by_last: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for first, last, k in conflicts:
        by_last[last].append((first, k))
    best = [0] * (n + 1)  # best[x]: using requests before x
    for last in range(n):
        best[last + 1] = max([best[last], *(best[first] + k for first, k in by_last[last])])
    return best[n]


def alone(floors_: Floors, ttft: float, tpot: float) -> list[bool]:
    """Which requests miss whatever the others do."""
    return [
        p > ttft + EPS or (n > 1 and d > (n - 1) * tpot + EPS)
        for p, d, n in zip(floors_.prefill_s, floors_.decode_s, floors_.tokens, strict=True)
    ]


def misses_floor(
    floors_: Floors, arrivals: Sequence[float], ttft: float, tpot: float, monotone: bool = False
) -> int:
    """At least this many requests miss an SLO at these arrivals, under any policy. With `monotone`, only
    the conflicts whose floor grows with the rate (the arrivals scaled down)."""
    missed = alone(floors_, ttft, tpot)
    live = [not m for m in missed]
    conflicts = window_conflicts(arrivals, floors_.prefill_s, live, ttft)
    conflicts += steady_conflicts(arrivals, floors_, live, ttft, tpot)
    if not monotone:
        conflicts += stall_conflicts(arrivals, floors_, live, ttft, tpot)
        conflicts += capacity_conflicts(arrivals, floors_, live, ttft, tpot)
    return sum(missed) + most_disjoint(len(arrivals), conflicts)


def goodput_bound(floors_: Floors, trace: Trace, ttft: float, tpot: float, target: float) -> float:
    """The highest rate at which the miss floor allows `target` attainment (module docstring)."""
    allowed = allowed_misses(len(trace), target)

    def window_fails(rate: float) -> bool:
        return misses_floor(floors_, trace.arrivals(rate), ttft, tpot, monotone=True) > allowed

    if sum(alone(floors_, ttft, tpot)) > allowed:
        return 0.0
    lo = hi = len(trace) / max(trace.arrivals(1.0)[-1], EPS)  # the trace's mean rate at rate 1: 1 /s
    while not window_fails(hi):
        lo, hi = hi, hi * 2
    while window_fails(lo):
        if lo < 1e-6:  # simultaneous arrivals conflict at every rate
            return 0.0
        lo, hi = lo / 2, lo
    while hi / lo > RATE_PRECISION:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if window_fails(mid) else (mid, hi)
    rate = lo
    while not allows(floors_, trace, rate, ttft, tpot, allowed):
        rate /= GRID_STEP
        if rate < lo / 1e3:
            return 0.0
    return rate


def allowed_misses(requests: int, target: float) -> int:
    return math.floor((1 - target) * requests + EPS)


def allows(floors_: Floors, trace: Trace, rate: float, ttft: float, tpot: float, allowed: int) -> bool:
    """Whether the miss floor at `rate` leaves room for at most `allowed` misses."""
    return misses_floor(floors_, trace.arrivals(rate), ttft, tpot) <= allowed
