"""The adaptive controller's step costs: the wall time of each step kind, measured at warmup and in real steps
(see :class:`CostModel`)."""

from __future__ import annotations

import collections
import math


RELATION_MIN_STEPS = 8
"""Real measurements of a kind before its steps move its row bucket's level; the inverse weight of a step right
after another kind's in the offset of a kind with ``window`` measurements (see :class:`CostModel`)."""

LEVEL_RATE = 0.2
"""How far each step of a known kind moves its row bucket's level towards its time (see :class:`CostModel`)."""

RESIDUAL_CLIP = 0.2
"""The most one step's time, in log seconds, moves a level or a relation (see :class:`CostModel`)."""

FIRST_CLIP = 0.5
"""The most a kind's first real measurement, in log seconds, puts it from its prior (see :class:`CostModel`)."""


def _median(values) -> float:
    """The median of a few numbers (statistics.median's checks cost more than the sort here)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _mean(values) -> float:
    """The mean of a few numbers; 0 for none (or None)."""
    return sum(values) / len(values) if values else 0.0


def _clip(x: float, bound: float) -> float:
    """``x`` clipped to [-bound, bound]."""
    return min(bound, max(-bound, x))


def _entry(table: dict, key, new):
    """``table[key]``, made by ``new()`` if missing. (``setdefault(key, new())`` builds the default every call,
    and these run after every step: recording a held step's planning time so took 35 us, median, ngram at batch
    1, T 0.8, where it now takes 3 us; a plain step there takes ~1.3 ms.)"""
    got = table.get(key)
    if got is None:
        got = table[key] = new()
    return got


def _more_work(a: tuple[int, bool], b: tuple[int, bool]) -> bool:
    """Step kind ``b`` = (K, detached) does strictly more work than ``a``: detached plain < attached K=0 < K=1..."""
    return (b[1], -b[0]) < (a[1], -a[0])


class CostModel:
    """Wall time per step kind ``(rows bucket, K, detached, sampled)``, capped by the cost of any kind of the same
    bucket that does more work. ``sampled``: some row samples (the sampler's random path, dearer than argmax,
    runs only then).

    The machine's speed drifts while the controller compares kinds it ran at different moments (shipped pair,
    eagle3 at batch 1 with q8_0 drafts: the chosen K = 4's recent steps went from 1.15 to 1.34 ms within a few
    seconds, while the K = 3 it had last run stood at 1.04 or 1.16 ms depending on when). So a kind's cost is
    the row bucket's *level* times the kind's *relation*, in log seconds: ``log cost = level(rows) +
    offset(kind)``. Every real step pulls both towards its time: the level follows the recent steps of the
    kinds already known (``LEVEL_RATE``, from kinds with ``RELATION_MIN_STEPS`` measurements or more), and the
    kind's offset averages its own residuals (weight ``1 / n``), so a kind chosen seldom (an explored
    neighbour, one timed step per exploration) is priced by what its steps cost next to the steps around them,
    averaged over explorations, not by what one of its steps cost in a slow moment long ago. Once a kind has
    ``window`` measurements, only a step of it right after a step of another kind moves its offset (weight ``1 /
    RELATION_MIN_STEPS``): a long run of one kind says how fast the machine is now, not how the kinds compare
    (else its offset would take a share of every drift, and the kinds not running would be priced off by that
    share), and a kind chosen for long, then explored, must still be re-priced in a few explorations. A step's
    residual counts at most ``RESIDUAL_CLIP`` (one slow step: an interrupt, a collection), and a kind's first
    measurement puts it at most ``FIRST_CLIP`` from its prior. The level is shared by greedy and sampled steps
    of a row bucket (one machine); their kinds are apart.

    Warmup measures every kind on all-padding rows, which do not cost what real rows cost (they all read one KV
    block; measured 1.6x faster at 32 rows, slower at 1): a kind not yet seen in real steps is taken at its
    warmup time times its twin's real / warmup ratio (the same kind with greedy and sampled swapped) where that
    was measured, else the median ratio of the kinds of its bucket that were (none: of the other sampling's;
    neither: its warmup time). Warmup times the sampler's extra work for the same executable fairly, while its
    all-padding rows are off by a different factor for each kind (shipped pair, draft_model at batch 8: after a
    greedy load ran detached at 2.93 ms, the sampled load read a detached step at 4.25 ms from its bucket's
    drafting kinds' scale, drafted K = 1 in 93% of its steps and ran 0.90x plain; the twin's rule gives 2.90 ms
    where the sampled load measured 2.91).

    A step right after a step of another kind (or a prefill) runs cold: its executable's code and buffers are
    out of the caches (shipped pair, draft_model at batch 1, greedy, medians: K = 3 steps cost 2.12 ms right
    after another kind, 1.96 ms after a K = 3 step; the K = 4 steps it explored, all right after others, 2.56
    ms, where a fixed K = 4 ran 0.26 ms dearer than a fixed K = 3). Plans hold, so a chosen kind runs in runs;
    its cost is what a step costs in one. Cold steps count only for a kind never measured in a run (a kind the
    controller only ever visits for one step is compared at what one step costs), and its first step in a run
    replaces them; the controller explores a neighbouring K for two steps in a row (see
    ``SpeculationController._explore``), once per ``cost_max_age`` real steps of the bucket without it (:meth:`age`).

    A step's measurement leaves out the controller's planning before it, which is paid whichever kind the plan
    picks (ngram at batch 1 on the shipped target read plain steps, mostly chosen by full plans, as dear as K =
    4 steps, mostly held ones); the mean planning time per attached step is added to every attached kind's
    estimate instead, as detached steps of stale rows skip planning (without it, draft_model at batch 8 on the
    shipped pair stopped detaching).

    The host time per step outside both (scheduling, the caller's loop, the last step's bookkeeping: from one
    step's measurement to the next one's planning) is paid by every kind alike, and a plain step's share of it is
    larger: the bucket's median is added to every kind's estimate. It is small (0.04-0.05 ms a step at batch 1
    on the shipped target) but tips close comparisons: eagle3 at batch 1, T 0.8 had prefilled a request detached
    with drafting at K = 2 estimated 1.09x the target alone's tokens per second, short of the 1.1x margin (1.12x
    with it), where fixed K = 2 ran 1.2x plain."""

    def __init__(self, window: int):
        self.window = window
        self.frozen = False
        """Ignore new measurements (tests pin a table with :meth:`set`)."""
        self._warm: dict[tuple, collections.deque] = {}  # kind -> its warmup times
        self._warm_log: dict[tuple, float] = {}  # kind -> log of their median (brought up to date lazily)
        self._warm_dirty: set[tuple] = set()  # kinds with warmup times since their median was last taken
        self._level: dict[int, float] = {}  # rows -> the bucket's level (log seconds)
        self._offset: dict[tuple, float] = {}  # kind -> its relation to its level (log), once measured for real
        self._count: dict[tuple, int] = {}  # kind -> real measurements in its offset (since its first in a run)
        self._last: dict[int, tuple] = {}  # rows -> the kind of its last step that counted
        self._in_run: set[tuple] = set()  # kinds measured in a run of them (their cold steps no longer count)
        self._kinds: dict[tuple, set] = {}  # (rows, sampled) -> the kinds measured in that bucket
        self._seconds: dict[tuple, float] = {}  # each kind's cost before the cap
        self._capped: dict[tuple, float] = {}  # seconds capped by the kinds that do more work (the envelope)
        self._stale: set[tuple] = set()  # (rows, sampled) buckets whose costs are recomputed when next read
        self._clock: dict[tuple, int] = {}  # (rows, sampled) -> real steps measured in that bucket
        self._stamp: dict[tuple, int] = {}  # kind -> its bucket's clock at its last real measurement
        self._planning: dict[tuple, collections.deque] = {}  # (rows, sampled) -> planning seconds per step
        self._full_plans: dict[tuple, collections.deque] = {}  # (rows, sampled) -> seconds of each full plan
        self._overhead: dict[tuple, collections.deque] = {}  # (rows, sampled) -> host seconds between steps
        self._overhead_median: dict[tuple, float] = {}  # (rows, sampled) -> median of its deque (read lazily)

    def _window(self, values=()) -> collections.deque:
        """A kind's warmup (or a bucket's planning) measurements: the last ``window`` of them."""
        return collections.deque(values, maxlen=self.window)

    def _touch(self, key: tuple) -> None:
        """``key``'s row bucket changed: both samplings' costs are recomputed when next read (one level)."""
        _entry(self._kinds, (key[0], key[3]), set).add(key)
        self._stale.add((key[0], False))
        self._stale.add((key[0], True))

    def observe(self, key: tuple, seconds: float, *, warmup: bool = False, switched: bool = False) -> None:
        """One measured step of kind ``key``; ``warmup``: an all-padding step timed at warmup; ``switched``: the
        step before it was of another kind (or a prefill), so it ran cold (see the class docstring).

        Runs every step, so it only records: costs and the envelope are recomputed when next read (plans are
        made far less often than steps run)."""
        if self.frozen:
            return
        if warmup:
            _entry(self._warm, key, self._window).append(seconds)
            self._warm_dirty.add(key)
            self._touch(key)
            return
        bucket = (key[0], key[3])
        clock = self._clock[bucket] = self._clock.get(bucket, 0) + 1
        if switched and key in self._in_run:  # a cold step of a kind timed in runs: not what a run costs
            return
        count = self._count.get(key, 0)
        if not switched and key not in self._in_run:  # its first step in a run replaces its cold ones
            self._in_run.add(key)
            count = 0
        self._stamp[key] = clock
        rows, y = key[0], math.log(max(seconds, 1e-9))
        level = self._level.get(rows)
        if level is None:  # the bucket's first real step: it sets the level, the kind keeps its prior relation
            level = self._level[rows] = y - self._prior(key)
        if count == 0:
            self._offset[key] = y - level  # (its prior's bucket median below counts this measurement too)
            if key in self._warm:  # (within FIRST_CLIP of its prior: one slow first step must not price it out)
                prior = self._prior(key)
                self._offset[key] = prior + _clip(y - level - prior, FIRST_CLIP)
        else:
            residual = _clip(y - level - self._offset[key], RESIDUAL_CLIP)
            if count < self.window:
                self._offset[key] += residual / (count + 1)
            elif self._last.get(rows) != key:  # (a long run of one kind says nothing of relations)
                self._offset[key] += residual / RELATION_MIN_STEPS
            if count >= RELATION_MIN_STEPS:
                self._level[rows] = level + LEVEL_RATE * residual
        self._last[rows] = key
        self._count[key] = count + 1
        self._touch(key)

    def set(self, key: tuple, seconds: float) -> None:
        """Pin a kind's cost at one real value (at the bucket's current level)."""
        level = self._level.setdefault(key[0], 0.0)
        self._offset[key] = math.log(seconds) - level
        self._count[key] = self.window
        self._in_run.add(key)
        self._stamp[key] = self._clock.get((key[0], key[3]), 0)
        self._touch(key)

    @property
    def seconds(self) -> dict[tuple, float]:
        """Each kind's cost before the cap (see the class docstring)."""
        self._flush()
        return self._seconds

    def _warm_of(self, key: tuple) -> float | None:
        """Log of ``key``'s median warmup time (None: not timed at warmup)."""
        if self._warm_dirty:
            for kk in self._warm_dirty:
                self._warm_log[kk] = math.log(max(_median(self._warm[kk]), 1e-9))
            self._warm_dirty = set()
        return self._warm_log.get(key)

    def _prior(self, key: tuple) -> float:
        """A kind's offset before it is measured in a real step: its warmup time's, shifted by its twin's real /
        warmup ratio, else its bucket's median (see the class docstring); 0 without warmup times."""
        warm = self._warm_of(key)
        if warm is None:
            return 0.0
        twin = (*key[:3], not key[3])
        if twin in self._offset and (twin_warm := self._warm_of(twin)) is not None:
            return warm + self._offset[twin] - twin_warm
        for bucket in ((key[0], key[3]), (key[0], not key[3])):
            shifts = [self._offset[kk] - w for kk in self._kinds.get(bucket, ())
                      if kk in self._offset and (w := self._warm_of(kk)) is not None]
            if shifts:
                return warm + _median(shifts)
        return warm

    def _flush(self, bucket: tuple | None = None) -> None:
        """Recompute the costs of ``bucket`` = (rows, sampled) (None: of every bucket) if measured since."""
        if bucket is None:
            stale, self._stale = self._stale, set()
            for b in stale:
                self._refresh(b)
        elif bucket in self._stale:
            self._stale.discard(bucket)
            self._refresh(bucket)

    def _refresh(self, bucket: tuple) -> None:
        """Recompute the costs of ``bucket`` = (rows, sampled), then their cap: a suffix minimum in work order
        (detached K=0, then attached K=0, 1, ...)."""
        kinds = self._kinds.get(bucket, ())
        level = self._level.get(bucket[0])
        for kk in kinds:
            offset = self._offset.get(kk)
            if level is None:  # nothing measured for real in this row bucket: warmup's time
                self._seconds[kk] = math.exp(self._warm_of(kk))
            else:
                self._seconds[kk] = math.exp(level + (offset if offset is not None else self._prior(kk)))
        low = math.inf
        for kk in sorted(kinds, key=lambda kk: (not kk[2], kk[1]), reverse=True):
            low = min(low, self._seconds[kk])
            self._capped[kk] = low

    def refresh(self, rows: int, sampled: bool = False) -> None:
        """Recompute the bucket's costs and its overhead median now if measured since (else the next read does):
        the engine calls it while the device computes a step, before a plan will read them."""
        self._flush((rows, sampled))
        self.overhead(rows, sampled)

    def get(self, key: tuple) -> float | None:
        return self.seconds.get(key)

    def seen(self, key: tuple) -> bool:
        """Kind ``key`` ran in a real step at least once (its estimate is not warmup time alone)."""
        return key in self._stamp

    def measurements(self, key: tuple) -> int:
        """Real measurements of ``key`` behind its cost (since its first step in a run)."""
        return self._count.get(key, 0)

    def age(self, key: tuple) -> float:
        """Real steps of ``key``'s bucket since ``key`` was last measured in one (inf: never)."""
        if key not in self._stamp:
            return math.inf
        return self._clock.get((key[0], key[3]), 0) - self._stamp[key]

    def observe_planning(self, bucket: tuple, seconds: float, *, full: bool = True) -> None:
        """The host time the controller's planning took before an attached decoding step of ``bucket`` = (rows,
        sampled): a ``full`` plan, or a held one's few lookups."""
        if self.frozen:
            return
        _entry(self._planning, bucket, self._window).append(seconds)
        if full:
            _entry(self._full_plans, bucket, self._window).append(seconds)

    def full_plan(self, rows: int, sampled: bool = False) -> float:
        """Mean host time of a full plan (not a held one's) before an attached step of the bucket (0 before any
        was measured)."""
        return _mean(self._full_plans.get((rows, sampled)))

    def planning(self, rows: int, sampled: bool = False) -> float:
        """Mean planning time per attached decoding step of the bucket (0 before any was measured)."""
        return _mean(self._planning.get((rows, sampled)))

    def observe_overhead(self, bucket: tuple, seconds: float) -> None:
        """The host time between the last step's measurement and the planning of a decoding step of ``bucket`` =
        (rows, sampled): scheduling, the caller's loop, the last step's bookkeeping."""
        if self.frozen:
            return
        _entry(self._overhead, bucket, self._window).append(seconds)
        self._overhead_median.pop(bucket, None)

    def overhead(self, rows: int, sampled: bool = False) -> float:
        """Median host time per decoding step of the bucket outside its measurement and planning (0 before any
        was measured; see the class docstring)."""
        bucket = (rows, sampled)
        got = self._overhead_median.get(bucket)
        if got is None:
            times = self._overhead.get(bucket)
            got = self._overhead_median[bucket] = _median(times) if times else 0.0
        return got

    def estimate(self, rows: int, k: int, detached: bool, sampled: bool = False) -> float:
        """The measured cost (or a conservative guess when unmeasured), capped by every measured kind of the
        bucket that does more work; with the bucket's host time per step outside the measurement added, and an
        attached kind's planning time per step (see the class docstring)."""
        got = self._estimate(rows, k, detached, sampled) + self.overhead(rows, sampled)
        return got if detached else got + self.planning(rows, sampled)

    def _estimate(self, rows: int, k: int, detached: bool, sampled: bool) -> float:
        self._flush((rows, sampled))
        got = self._capped.get((rows, k, detached, sampled))
        if got is not None:
            return got
        base = self.seconds.get((rows, 0, True, sampled)) or self.seconds.get((rows, 0, False, sampled))
        if base is None:
            got = 1.0 + 0.25 * k  # nothing measured for this row bucket yet: unit costs, K costs extra
        else:  # an unmeasured drafting step is assumed expensive (a verify over K+1 tokens plus drafting)
            got = base * (1.0 + 0.25 * k) if not detached else base
        kind = (k, detached)
        for (r, kk, dd, ss), seconds in self.seconds.items():
            if r == rows and ss == sampled and seconds < got and _more_work(kind, (kk, dd)):
                got = seconds
        return got
