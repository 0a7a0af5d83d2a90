"""The fan-out cost model: what N backplane readers cost the stream's server, fitted on
``bench.fanout``'s measurements and checked on points the fit did not see.

Reads: a blocking XREAD loop reads once per entry while entries come further apart than
a read's round trip, and once per ``block`` seconds when none come:

    X (XREAD calls/s) = N x E            (E > 0; below saturation)
                      = N / block        (E = 0)

Bytes out: every read that returns an entry sends the reply header (the stream's name)
and the entry; an idle read sends the 5-byte nil array:

    B = N x E x (header + entry bytes)  +  N / block x 5

Server CPU (cores; 1.0 = one core, all a single-threaded Redis can give). A read costs
``a`` when the server is busy and ``a + u`` when it was asleep and must wake up for it
(epoll_wait, a context switch, cold caches); a share 1 - CPU of the reads find it
asleep, so a busier server is cheaper per read (measured: ~22 µs per read at 5 % of a
core, ~13 µs at 63 %). With ``w`` per entry appended (Redis: the XADD and the wake-ups
around it) or read upstream (a relay: its own XREAD through redis-py):

    CPU = d + w x E + X x (a + u x (1 - CPU))
        = (d + w x E + (a + u) x X) / (1 + u x X)

Bytes do not appear: on loopback, 10 keys per entry cost Redis no more CPU than 1
(measured), the reads do. The same formula with its own constants gives a relay's CPU
(X: its readers' reads); the Redis node behind R relays is the formula at N = R. One
core is reached at X = (1 - d - w x E) / a.

Latency (delivery p50 / p99, ms): an entry wakes the N readers one after the other, so
the q-th percentile reader waits for about q x N replies before its own:

    p_q = l_q + s_q x N
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CpuModel", "Fit", "fit_all", "report"]

BLOCK_S = 1.0
NIL_BYTES = 5  # "*-1\r\n": a read that timed out
FIT_MAX_N = 200  # fit on N <= 200; every larger N validates (an extrapolation in N)
RELAY_FIT_MAX_READERS = 50  # relays: fit on <= 50 readers per relay, check above
SMALL_CPU = 0.02  # below 2 % of a core the error is stated in points, not percent
SATURATED = 0.9  # a server at 90 % of its core or more is past what the model describes
MACHINE_BUSY = 0.8  # bench processes using 80 % of all cores: the machine is the limit


def header_bytes(stream: str) -> int:
    """The XREAD reply around one stream's entries: ``*1 *2 $len stream *n``."""
    return len(b"*1\r\n*2\r\n") + len(b"$%d\r\n\r\n" % len(stream)) + len(stream) + len(b"*1\r\n")


def reads_per_s(n: float, e: float) -> float:
    return n * e if e > 0 else n / BLOCK_S


def bytes_per_s(n: float, e: float, entry: float, header: float) -> float:
    return n * e * (entry + header) if e > 0 else n / BLOCK_S * NIL_BYTES


@dataclass
class CpuModel:
    """CPU = (d + w E + (a + u) X) / (1 + u X), in cores (module docstring)."""

    d: float = 0.0
    w: float = 0.0
    a: float = 0.0
    u: float = 0.0

    def cpu(self, e: float, x: float) -> float:
        return (self.d + self.w * e + (self.a + self.u) * x) / (1 + self.u * x)

    def at(self, n: float, e: float) -> float:
        """Predicted CPU for N readers at E entries/s."""
        return self.cpu(e, reads_per_s(n, e))

    def saturation_n(self, e: float) -> float:
        """The N at which this model reaches one core (inf if it never does)."""
        if self.a <= 0:
            return math.inf
        reads = (1.0 - self.d - self.w * e) / self.a
        return reads / e if e > 0 else reads * BLOCK_S

    def describe(self) -> str:
        return (f"d = {self.d * 100:.2f} % of a core, w = {self.w * 1e6:.0f} µs per entry, a = {self.a * 1e6:.1f} µs per XREAD served busy, a + u = "
                f"{(self.a + self.u) * 1e6:.1f} µs per XREAD that wakes the server")  # fmt: skip


def fit_cpu(rows: Sequence[tuple[float, float, float]], per_entry: bool) -> CpuModel:
    """Least squares on relative error over (E, X, cpu) rows, of the linear form
    CPU = d + w E + (a + u) X - u X CPU; ``per_entry``: fit w (else 0). A term that
    comes out negative is dropped (0) and the rest refitted."""
    target = np.array([cpu for *_, cpu in rows])
    features = np.array([[1.0, e, x, -x * cpu] for e, x, cpu in rows])
    active = [0, 1, 2, 3] if per_entry else [0, 2, 3]
    weight = 1.0 / np.maximum(target, SMALL_CPU)
    while True:
        solution, *_ = np.linalg.lstsq(features[:, active] * weight[:, None], target * weight,
                                       rcond=None)  # fmt: skip
        if all(v >= 0 for v in solution) or len(active) == 1:
            break
        active = [i for i, v in zip(active, solution, strict=True) if v >= 0]
    d, w, a_plus_u, u = (max(0.0, float(solution[active.index(i)])) if i in active else 0.0
                         for i in range(4))  # fmt: skip
    return CpuModel(d, w, max(0.0, a_plus_u - u), u)


@dataclass
class LatencyModel:
    """p_q = l + s x N (ms), one per percentile."""

    l50: float = 0.0
    s50: float = 0.0
    l99: float = 0.0
    s99: float = 0.0

    def p50(self, n: float) -> float:
        return self.l50 + self.s50 * n

    def p99(self, n: float) -> float:
        return self.l99 + self.s99 * n


def _line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Intercept and slope, least squares on relative error."""
    x, y = np.array(xs, dtype=float), np.array(ys, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-3)
    matrix = np.stack([np.ones_like(x), x], axis=1) * weight[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(matrix, y * weight, rcond=None)
    return float(intercept), float(slope)


def fit_latency(points: Sequence[Any]) -> LatencyModel:
    """Against the readers each server (Redis, or a leaf relay) fans out to."""
    busy = [p for p in points if p.e > 0 and not math.isnan(p.p50_ms)]
    if not busy:
        return LatencyModel()
    fan_out = [_latency_n(p) for p in busy]
    l50, s50 = _line_fit(fan_out, [p.p50_ms for p in busy])
    l99, s99 = _line_fit(fan_out, [p.p99_ms for p in busy])
    return LatencyModel(l50, s50, l99, s99)


@dataclass
class Fit:
    """The fitted models, and which points fitted them (the rest check them)."""

    redis: CpuModel
    latency: LatencyModel
    header: float
    relay: CpuModel | None = None
    relay_latency: LatencyModel | None = None
    fit_points: list[Any] = field(default_factory=list)
    check_points: list[Any] = field(default_factory=list)

    def predict_redis(self, p: Any) -> float:
        """The Redis node's CPU at point ``p``, whichever mode (never fitted on relays)."""
        return self.redis.at(_upstream_readers(p), p.e)

    def predict_relay(self, p: Any) -> float | None:
        """CPU of one leaf relay (N / R readers) at point ``p``."""
        if self.relay is None or p.mode == "direct":
            return None
        return self.relay.at(p.n / p.relays, p.e)

    def predict_top(self, p: Any) -> float | None:
        """CPU of one top relay of a tree (its readers: the leaves)."""
        if self.relay is None or p.mode != "tree":
            return None
        return self.relay.at(p.relays / _upstream_readers(p), p.e)

    def predict_latency(self, p: Any) -> tuple[float, float] | None:
        """(p50, p99) ms. Behind relays: the relay model at N / R readers; a tree adds the
        top relay's hop (its fan-out to the leaves, and its own base latency)."""
        if p.e <= 0:
            return None
        if p.mode == "direct":
            return self.latency.p50(p.n), self.latency.p99(p.n)
        model = self.relay_latency
        if model is None:
            return None
        p50, p99 = model.p50(p.n / p.relays), model.p99(p.n / p.relays)
        if p.mode == "tree":
            hop = p.relays / _upstream_readers(p)
            p50 += model.p50(hop) - self.latency.l50
            p99 += model.p99(hop) - self.latency.l99
        return p50, p99


def _upstream_readers(p: Any) -> int:
    """Readers of the Redis node itself: the instances, the relays, or a tree's top level."""
    if p.mode == "direct":
        return int(p.n)
    return int(p.relays) if p.mode == "relay" else max(1, round(math.sqrt(p.relays)))


def _cpu_rows(points: Sequence[Any]) -> list[tuple[float, float, float]]:
    return [(p.xadd_per_s, p.xread_per_s, p.redis_cpu) for p in points]


def leaf_cpu(p: Any) -> float:
    """The mean CPU of a point's leaf relays (the relays the readers use)."""
    leaves = p.relay_cpu[-p.relays :]
    return float(sum(leaves) / len(leaves))


def top_cpu(p: Any) -> float:
    """The mean CPU of a tree's top relays (listed first)."""
    tops = p.relay_cpu[: len(p.relay_cpu) - p.relays]
    return float(sum(tops) / len(tops))


def _relay_rows(points: Sequence[Any]) -> list[tuple[float, float, float]]:
    """Per leaf relay: entries read upstream, its readers' reads, its CPU."""
    return [(p.xadd_per_s, p.reader_reads_per_s / p.relays, leaf_cpu(p)) for p in points]


def fit_all(points: Sequence[Any], stream: str) -> Fit:
    """Redis on direct points with N <= 200; relays on relay points with at most 50
    readers per relay. Every other point checks the fit, except those past the model:
    readers batching, or a server at 90 % of its core (``beyond``)."""
    header = float(header_bytes(stream))
    fitting = [p for p in points if _fits(p)]
    direct = [p for p in fitting if p.mode == "direct"]
    checking = [p for p in points if not _fits(p) and not beyond(p)]
    # Redis behind relays (a few readers) is what shows its cost per XADD (w).
    redis_rows = _cpu_rows([p for p in fitting if p.mode in ("direct", "relay")])
    fit = Fit(fit_cpu(redis_rows, per_entry=True), fit_latency(direct), header,
              fit_points=fitting, check_points=checking)  # fmt: skip
    relayed = [p for p in fitting if p.mode == "relay" and p.relay_cpu]
    if relayed:
        fit.relay = fit_cpu(_relay_rows(relayed), per_entry=True)
        fit.relay_latency = fit_latency(relayed)
    return fit


def beyond(p: Any) -> bool:
    """Past what the model describes, or what one machine can tell: the readers batch,
    a server is saturated, or Redis, relays and readers together kept 80 % of the
    machine's cores busy (they share them: latency is then the machine's queueing)."""
    busy = p.redis_cpu + p.reader_cpu + sum(p.relay_cpu)
    return (batching(p) or max([p.redis_cpu, *p.relay_cpu]) >= SATURATED
            or busy >= MACHINE_BUSY * (os.cpu_count() or 2))  # fmt: skip


def batching(p: Any) -> bool:
    """Whether the readers got several entries per read (fewer than 90 % of N x E reads):
    the server or the readers fell behind, and the model (one read per entry) does not
    apply. Such points are shown, but neither fit nor check the model."""
    return bool(p.e > 0 and p.reader_reads_per_s < 0.9 * p.n * p.xadd_per_s)


def _fits(p: Any) -> bool:
    if beyond(p):
        return False
    if p.mode == "direct":
        return bool(p.n <= FIT_MAX_N)
    return bool(p.mode == "relay" and p.n / p.relays <= RELAY_FIT_MAX_READERS)


# -- error and tables -------------------------------------------------------------------


def error(predicted: float, measured: float) -> tuple[float, bool]:
    """(error, in_points): relative, or in points of a core when the measurement is small."""
    if measured < SMALL_CPU:
        return (predicted - measured) * 100, True
    return (predicted - measured) / measured * 100, False


@dataclass
class Errors:
    """The largest errors over the check points: CPU relative (%) for points >= 2 % of
    a core, absolute (points of a core) below; latency relative (%)."""

    cpu_relative: float = 0.0
    cpu_points: float = 0.0
    p50: float = 0.0
    p99: float = 0.0
    count: int = 0

    def add_cpu(self, predicted: float | None, measured: float) -> None:
        if predicted is None:
            return
        value, in_points = error(predicted, measured)
        if in_points:
            self.cpu_points = max(self.cpu_points, abs(value))
        else:
            self.cpu_relative = max(self.cpu_relative, abs(value))

    def describe(self) -> str:
        return (f"{self.count} check points: CPU within +-{self.cpu_relative:.0f} % "
                f"(points >= {SMALL_CPU * 100:.0f} % of a core) and +-{self.cpu_points:.2f} points "
                f"of a core below; p50 within +-{self.p50:.0f} %, p99 within +-{self.p99:.0f} %")  # fmt: skip


def stated_errors(fit: Fit, modes: Sequence[str]) -> Errors:
    """The errors the model states, from the check points of ``modes``."""
    errors = Errors()
    for p in fit.check_points:
        if p.mode not in modes:
            continue
        errors.count += 1
        errors.add_cpu(fit.predict_redis(p), p.redis_cpu)
        if p.relay_cpu:
            errors.add_cpu(fit.predict_relay(p), leaf_cpu(p))
        if p.mode == "tree":
            errors.add_cpu(fit.predict_top(p), top_cpu(p))
        latency = fit.predict_latency(p)
        if latency is not None and not math.isnan(p.p50_ms):
            errors.p50 = max(errors.p50, abs(latency[0] / p.p50_ms - 1) * 100)
            errors.p99 = max(errors.p99, abs(latency[1] / p.p99_ms - 1) * 100)
    return errors


def _fmt_err(predicted: float, measured: float) -> str:
    value, in_points = error(predicted, measured)
    return f"{value:+.2f} pt" if in_points else f"{value:+.0f} %"


def measured_table(points: Sequence[Any], fit: Fit) -> tuple[list[str], list[list[str]]]:
    columns = ["mode", "N", "R", "E/s", "k", "XREAD/s", "MB/s out", "Redis CPU", "model",
               "error", "relay CPU (leaf)", "model ", "p50 ms", "model  ", "p99 ms", "model   ",
               "readers' CPU", "set"]  # fmt: skip
    rows = []
    for p in points:
        latency = fit.predict_latency(p)
        relay = fit.predict_relay(p)
        leaves = p.relay_cpu[-p.relays :] if p.relays else []
        predicted = fit.predict_redis(p)
        rows.append([
            p.mode, str(p.n), str(p.relays or "-"), f"{p.e:g}", str(p.k), f"{p.xread_per_s:,.0f}",
            f"{p.redis_bytes_out_per_s / 1e6:.2f}", f"{p.redis_cpu * 100:.1f} %",
            f"{predicted * 100:.1f} %", _fmt_err(predicted, p.redis_cpu),
            f"{sum(leaves) / len(leaves) * 100:.1f} %" if leaves else "-",
            f"{relay * 100:.1f} %" if relay is not None else "-",
            _ms(p.p50_ms), _ms(latency[0]) if latency else "-",
            _ms(p.p99_ms), _ms(latency[1]) if latency else "-",
            f"{p.reader_cpu * 100:.0f} %",
            "fit" if p in fit.fit_points else "check" if p in fit.check_points else "beyond",
        ])  # fmt: skip
    return columns, rows


def docs_table(points: Sequence[Any], fit: Fit) -> tuple[list[str], list[list[str]]]:
    """The operations guide's table: measured / model per point, k = 1 and idle."""
    columns = ["design", "N", "E/s", "Redis CPU", "relay CPU (each leaf)", "p50 ms", "p99 ms",
               "readers' CPU"]  # fmt: skip
    rows = []
    for p in points:
        if p.k != 1:
            continue
        latency = fit.predict_latency(p)
        relay = fit.predict_relay(p)
        leaves = p.relay_cpu[-p.relays :] if p.relays else []
        design = {"direct": "today", "relay": f"{p.relays} relay(s)",
                  "tree": f"tree, {p.relays} leaves"}.get(p.mode, p.mode)  # fmt: skip
        checked = " (check)" if p in fit.check_points else " (beyond)" if beyond(p) else ""
        rows.append([
            design, f"{p.n}{checked}", f"{p.e:g}",
            f"{p.redis_cpu * 100:.1f} / {fit.predict_redis(p) * 100:.1f} %",
            (f"{sum(leaves) / len(leaves) * 100:.1f} / "
             + (f"{relay * 100:.1f} %" if relay is not None else "-")) if leaves else "-",
            _pair(p.p50_ms, latency[0] if latency else None),
            _pair(p.p99_ms, latency[1] if latency else None),
            f"{p.reader_cpu * 100:.0f} %",
        ])  # fmt: skip
    return columns, rows


def _pair(measured: float, model: float | None) -> str:
    if math.isnan(measured):
        return "-"
    return f"{measured:.2f} / {model:.2f}" if model is not None else f"{measured:.2f}"


def _latency_n(p: Any) -> float:
    return float(p.n if p.mode == "direct" else p.n / p.relays)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


EXTRAPOLATE_N = (1_000, 10_000)
EXTRAPOLATE_E = (10.0, 100.0, 1_000.0)


def extrapolation(fit: Fit, entry: float, relays_per: int = 50) -> tuple[list[str], list[list[str]]]:
    """Predicted per-node CPU and bytes/s at 1,000 and 10,000 readers (k = 1 entries),
    today and with one relay per ``relays_per`` instances."""
    columns = ["N", "E/s", "Redis CPU today", "bytes/s out today", "p99 today",
               f"Redis CPU, R = N/{relays_per} relays", f"each relay ({relays_per} readers)"]  # fmt: skip
    rows = []
    for n in EXTRAPOLATE_N:
        for e in EXTRAPOLATE_E:
            today = fit.redis.at(n, e)
            relays = n // relays_per
            relay = fit.relay.at(relays_per, e) if fit.relay else None
            rows.append([
                f"{n:,}", f"{e:,.0f}", _cores(today),
                _rate_bytes(bytes_per_s(n, e, entry, fit.header)),
                f"{fit.latency.p99(n):,.0f} ms",
                _cores(fit.redis.at(relays, e)),
                _cores(relay) if relay is not None else "pending",
            ])  # fmt: skip
    return columns, rows


def _cores(value: float) -> str:
    return "saturated" if value >= 1.0 else f"{value * 100:.1f} %"


def _rate_bytes(value: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B/s"


def _table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def summary(fit: Fit, entry: float) -> list[str]:
    lines = [
        f"Redis: {fit.redis.describe()}",
        f"today's design, {stated_errors(fit, ['direct']).describe()} (N > {FIT_MAX_N})",
        f"latency: p50 = {fit.latency.l50:.2f} + {fit.latency.s50 * 1000:.2f} µs x N ms, "
        f"p99 = {fit.latency.l99:.2f} + {fit.latency.s99 * 1000:.2f} µs x N ms",
        f"one core at: N = {fit.redis.saturation_n(10):,.0f} (E = 10), "
        f"{fit.redis.saturation_n(100):,.0f} (E = 100), "
        f"{fit.redis.saturation_n(1000):,.0f} (E = 1,000), "
        f"{fit.redis.saturation_n(0):,.0f} (idle)",
    ]
    if fit.relay is not None and fit.relay_latency is not None:
        model = fit.relay_latency
        lines += [
            f"relay: {fit.relay.describe()}",
            f"relays, {stated_errors(fit, ['relay', 'tree']).describe()} "
            f"(> {RELAY_FIT_MAX_READERS} readers per relay, and trees)",
            f"latency behind a relay: p50 = {model.l50:.2f} + {model.s50 * 1000:.2f} µs x N/R ms, "
            f"p99 = {model.l99:.2f} + {model.s99 * 1000:.2f} µs x N/R ms",
        ]
    return lines


def report(points: Sequence[Any], stream: str = "bench-fanout-000000:layered_cache:invalidations",
           plot: Callable[[Fit], str] | None = None) -> str:  # fmt: skip
    """The model fitted on ``points``: constants, error, tables (markdown)."""
    fit = fit_all(points, stream)
    entry = next((p.entry_bytes for p in points if p.k == 1), 120.0)
    out = summary(fit, entry)
    out += ["", "measured / model:", "", _table(*docs_table(points, fit))]
    out += ["", _table(*measured_table(points, fit)), "", _table(*extrapolation(fit, entry))]
    if plot is not None:
        out += ["", f"plot: {plot(fit)}"]
    return "\n".join(out)
