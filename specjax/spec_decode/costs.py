"""The adaptive controller's step costs: the wall time of each step kind, measured at warmup and in real steps
(see :class:`CostModel`)."""

from __future__ import annotations

import collections
import math


RELATION_MIN_STEPS = 8
"""Real measurements of a kind that its relation to the other kinds needs (see :class:`CostModel`)."""


def _median(values) -> float:
    """The median of a few numbers (statistics.median's checks cost more than the sort here)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _mean(values) -> float:
    """The mean of a few numbers; 0 for none (or None)."""
    return sum(values) / len(values) if values else 0.0


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

    A kind measured in real steps costs the median of its recent ones; a drafting kind with fewer than
    ``RELATION_MIN_STEPS`` of them no more than its scaled warmup time (below): timing noise is one-sided, and a
    kind chosen seldom (an explored neighbour) would otherwise be kept dear by one slow step and never chosen to be
    measured again. Warmup measures every kind on
    all-padding rows, which do not cost what real rows cost (they all read one KV block; measured 1.6x faster
    at 32 rows, slower at 1); a kind not yet seen in real steps costs its warmup time scaled by the real /
    warmup ratio of the kinds of its bucket that were (else a kind the controller keeps choosing would be
    compared in real time against the others in warmup time).

    A step right after a step of another kind (or a prefill) runs cold: its executable's code and buffers are
    out of the caches (shipped pair, draft_model at batch 1, greedy, medians: K = 3 steps cost 2.12 ms right
    after another kind, 1.96 ms after a K = 3 step; the K = 4 steps it explored, all right after others, 2.56
    ms, where a fixed K = 4 ran 0.26 ms dearer than a fixed K = 3). Plans hold, so a chosen
    kind runs in runs; its cost is what a step costs in one. Such cold steps count only for a kind that has
    not been measured in a run (a kind the controller only ever visits for one step is compared at what one
    step costs), and its first step in a run replaces them; the controller explores a neighbouring K for two
    steps in a row (see ``SpeculationController._explore``).

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
    with it), where fixed K = 2 ran 1.2x plain.

    Measurements of a kind not chosen for ``max_age`` real steps of its bucket expire, so a kind measured in a
    slow moment is tried again. Its estimate is then its warmup time x the bucket's scale x the relation its
    real / warmup ratio had to the median of the bucket's other measured kinds' when last read while it was
    chosen, with ``RELATION_MIN_STEPS`` measurements or more in its window (none: 1; fewer may be one slow
    moment). Warmup's all-padding steps time kinds unevenly, and the bucket's scale then comes from the kinds
    still chosen: shipped pair, eagle3 at batch 1 T 0.8, after a long detached stretch the drafting K = 2 fell
    back to 6.4 ms, 2.5x the target alone, where the fixed K = 2 system's steps implied ~5 ms. (Scaling plain
    and drafting kinds apart, tried before, estimated the target alone from the attached plain step's ratio
    where it was measured itself; see benchmarks/README.md.) A kind with neither goes by its twin of the other
    sampling where that one was measured (:meth:`_twin_seconds`)."""

    def __init__(self, window: int, max_age: int = 0):
        self.window = window
        self.max_age = max_age
        self.frozen = False
        """Ignore new measurements (tests pin a table with :meth:`set`)."""
        self._seconds: dict[tuple, float] = {}  # each kind's cost before the cap (see the class docstring)
        self._dirty: dict[tuple, set] = {}  # (rows, sampled) -> its (kind, warmup) measured since the last read
        self._stale: dict[tuple, set] = {}  # (rows, sampled) -> its kinds with new real measurements: its costs
        # are recomputed (``_refresh``) before they are next read
        self._real: dict[tuple, collections.deque] = {}
        self._warm: dict[tuple, collections.deque] = {}
        self._median: dict[tuple, float] = {}  # (kind, warmup) -> median of its deque
        self._kinds: dict[tuple, set] = {}  # (rows, sampled) -> the kinds measured in that bucket
        self._capped: dict[tuple, float] = {}  # seconds capped by the kinds that do more work (the envelope)
        self._clock: dict[tuple, int] = {}  # (rows, sampled) -> real steps measured in that bucket
        self._stamp: dict[tuple, int] = {}  # kind -> its bucket's clock at its last real measurement (kept after
        # its measurements expire: the kinds ever measured in a real step, or set)
        self._planning: dict[tuple, collections.deque] = {}  # (rows, sampled) -> planning seconds per step
        self._full_plans: dict[tuple, collections.deque] = {}  # (rows, sampled) -> seconds of each full plan
        self._overhead: dict[tuple, collections.deque] = {}  # (rows, sampled) -> host seconds between steps
        self._overhead_median: dict[tuple, float] = {}  # (rows, sampled) -> median of its deque (read lazily)
        self._relative: dict[tuple, float] = {}  # kind -> its real / warmup ratio over its bucket's other kinds'
        # (median), as last read while it was chosen with RELATION_MIN_STEPS or more measurements
        self._in_run: set[tuple] = set()  # kinds whose current real measurements come from runs of them

    def _window(self, values=()) -> collections.deque:
        """A kind's (or a bucket's planning) measurements: the last ``window`` of them."""
        return collections.deque(values, maxlen=self.window)

    def observe(self, key: tuple, seconds: float, *, warmup: bool = False, switched: bool = False) -> None:
        """One measured step of kind ``key``; ``warmup``: an all-padding step timed at warmup; ``switched``: the
        step before it was of another kind (or a prefill), so it ran cold (see the class docstring).

        Runs every step, so it only records: medians and the envelope are recomputed when a cost is next read
        (plans are made far less often than steps run)."""
        if self.frozen:
            return
        bucket = (key[0], key[3])
        store = self._warm if warmup else self._real
        times = store.get(key)
        if not warmup:
            if times is not None and key in self._warm and self.age(key) >= self.max_age > 0:
                times = None  # stale (as the next refresh would find it): the new measurement starts over
            if times is None:
                self._in_run.discard(key)
            elif switched and key in self._in_run:  # a cold step of a kind timed in runs: not what a run costs
                self._clock[bucket] = self._clock.get(bucket, 0) + 1
                return
            if not switched and key not in self._in_run:  # its first step in a run replaces its cold ones
                times = None
                self._in_run.add(key)
        if times is None:
            times = store[key] = self._window()
        times.append(seconds)
        _entry(self._dirty, bucket, set).add((key, warmup))
        _entry(self._kinds, bucket, set).add(key)
        if not warmup:
            self._clock[bucket] = self._stamp[key] = self._clock.get(bucket, 0) + 1

    def set(self, key: tuple, seconds: float) -> None:
        """Replace a kind's measurements by one real value."""
        bucket = (key[0], key[3])
        self._real[key] = self._window([seconds])
        self._in_run.add(key)
        _entry(self._dirty, bucket, set).add((key, False))
        _entry(self._kinds, bucket, set).add(key)
        self._stamp[key] = self._clock.get(bucket, 0)

    @property
    def seconds(self) -> dict[tuple, float]:
        """Each kind's cost before the cap (see the class docstring)."""
        self._flush()
        return self._seconds

    def _flush(self, bucket: tuple | None = None) -> None:
        """Bring the medians of every kind measured since the last read up to date, and the costs of ``bucket`` =
        (rows, sampled) (None: of every bucket) where its kinds, or its twin's real ones, were measured since it
        was last refreshed (see :meth:`_twin_seconds`). Buckets not read wait: a plan reads one (a refresh of
        both the greedy and the sampled bucket took ~30 us of each batch-1 plan)."""
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for (rows, sampled), changed in dirty.items():
                for key, warmup in changed:
                    self._median[key, warmup] = _median((self._warm if warmup else self._real)[key])
                real = {key for key, warmup in changed if not warmup}
                _entry(self._stale, (rows, sampled), set).update(real)
                if real and (rows, not sampled) in self._kinds:
                    _entry(self._stale, (rows, not sampled), set)
        if bucket is None:
            stale, self._stale = self._stale, {}
            for b, keys in stale.items():
                self._refresh(b, keys)
        elif (keys := self._stale.pop(bucket, None)) is not None:
            self._refresh(bucket, keys)

    def _refresh(self, bucket: tuple, measured: set = frozenset()) -> None:
        """Recompute the costs of ``bucket`` = (rows, sampled), then their cap: a suffix minimum in work order
        (detached K=0, then attached K=0, 1, ...). ``measured``: its kinds with new real measurements."""
        kinds = self._kinds[bucket]
        med = self._median
        if self.max_age and not self.frozen:
            clock = self._clock.get(bucket, 0)
            for kk in kinds:
                if kk in self._real and kk in self._warm and clock - self._stamp[kk] >= self.max_age:
                    # Stale: its scaled warmup time stands in until it is chosen again (with its last relation).
                    del self._real[kk]
                    self._in_run.discard(kk)
        real = {kk: med[kk, False] for kk in kinds if kk in self._real}
        ratios = {kk: real[kk] / med[kk, True] for kk in real if kk in self._warm}
        scale = _median(ratios.values()) if ratios else 1.0
        for kk in measured & ratios.keys():
            # Its relation to the bucket's other measured kinds, while it is chosen and enough measurements back
            # it (fewer may be one slow moment).
            others = [r for k2, r in ratios.items() if k2 != kk]
            if others and len(self._real[kk]) >= min(self.window, RELATION_MIN_STEPS):
                self._relative[kk] = ratios[kk] / _median(others)
        for kk in kinds:
            if kk in real:
                self._seconds[kk] = real[kk]
                if kk[1] and kk in self._warm and len(self._real[kk]) < RELATION_MIN_STEPS:
                    # A drafting kind with few real measurements is taken at its scaled warmup time if that is
                    # lower: one slow step must not keep a kind from being chosen (and measured) again.
                    self._seconds[kk] = min(real[kk], med[kk, True] * scale * self._relative.get(kk, 1.0))
            elif kk not in self._relative and (twin := self._twin_seconds(kk)) is not None:
                self._seconds[kk] = twin
            else:
                self._seconds[kk] = med[kk, True] * scale * self._relative.get(kk, 1.0)
        low = math.inf
        for kk in sorted(kinds, key=lambda kk: (not kk[2], kk[1]), reverse=True):
            low = min(low, self._seconds[kk])
            self._capped[kk] = low

    def _twin_seconds(self, key: tuple) -> float | None:
        """A kind never measured in a real step of its bucket, from its twin (the same kind with greedy and
        sampled swapped) where that one has current real measurements: the twin's real time x the ratio of the
        two kinds' warmup times (None where there is no twin to go by). Warmup times the sampler's extra work
        for the same executable fairly, while its all-padding rows are off by a different factor for each kind.
        Shipped pair, draft_model at batch 8 (bench_adaptive at db5803e): after a greedy load ran detached at
        2.93 ms, the sampled load read a detached step at 4.25 ms from its bucket's drafting kinds' scale, drafted
        K = 1 in 93% of its steps and ran 0.90x plain. In a shorter run of the same loads (greedy detached 2.50
        ms real / 1.73 warmup; sampled detached warmup 2.01) the twin's rule gives 2.90 ms where the sampled load,
        which detached there, measured 2.91."""
        twin = (*key[:3], not key[3])
        if twin not in self._real or key not in self._warm or twin not in self._warm or self.age(twin) >= (
                self.max_age or math.inf):
            return None
        return self._median[twin, False] * self._median[key, True] / self._median[twin, True]

    def get(self, key: tuple) -> float | None:
        return self.seconds.get(key)

    def seen(self, key: tuple) -> bool:
        """Kind ``key`` ran in a real step at least once (its estimate is not warmup time alone)."""
        return key in self._stamp

    def age(self, key: tuple) -> float:
        """Real steps of ``key``'s bucket since ``key`` was last measured in one (inf: never)."""
        if key not in self._real:
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
