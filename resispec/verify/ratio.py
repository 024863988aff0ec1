"""The ratio profile of a node: tokens sorted by w = p/q once, with prefix sums, so that

    F(t) = sum_x min(p(x), t q(x)) = P(w < t) + t * Q(w >= t)

costs one binary search per t. The solvers for T* (resispec) and rho* (kseq) evaluate F a few times per
bisection step, so a step is O(n log V) instead of O(n V). Tokens with q = 0 get w = inf: they never count in
F for a finite t (min(p, t * 0) = 0), which is exactly right.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

Tensor = torch.Tensor

# numpy's SIMD sort of int64 is ~4x faster than torch.sort on CPU; it releases the GIL, so row chunks run
# on threads. Only used for float32 CPU input (the packed key below needs 32-bit floats).
_NP_MIN_VOCAB = 4096
_LITTLE_ENDIAN = sys.byteorder == "little"


def _np_sort_rows(key: Tensor) -> Tensor:
    """Sort each row of a CPU int64 [B, V] tensor (ascending) with numpy, rows split over threads."""
    arr = key.numpy()
    if arr.shape[0] == 1:  # one row (the decoder's nodes): no split
        return torch.from_numpy(np.sort(arr, axis=-1))
    out = np.empty_like(arr)
    workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, arr.shape[0]))
    bounds = np.linspace(0, arr.shape[0], workers + 1).astype(int)

    def work(j: int) -> None:
        out[bounds[j] : bounds[j + 1]] = np.sort(arr[bounds[j] : bounds[j + 1]], axis=-1)

    if workers == 1:
        work(0)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(workers)))
    return torch.from_numpy(out)


def sort_by_ratio(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(w, p, q) of every row sorted by increasing w = p/q (q = 0 -> w = inf). p, q [B, V] -> 3 x [B, V].
    Entries with w = inf may carry p = nan; they sit at the end and never enter F for a finite t."""
    w = torch.nan_to_num(p / q, nan=float("inf"), posinf=float("inf"))  # [B, V]; p = q = 0 -> inf as well
    if (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and p.shape[-1] >= _NP_MIN_VOCAB
        and _LITTLE_ENDIAN
    ):
        # w, q >= 0: their float32 bit patterns order like the values, so one int64 key (w bits high, q bits
        # low) sorts by w and carries q along: no argsort and no gathers. p is rebuilt as w * q.
        key = torch.stack([q, w], -1).view(torch.int64)[..., 0]  # [B, V]
        pair = _np_sort_rows(key).view(torch.float32).view(*p.shape, 2)  # [B, V, 2] = (q, w)
        w_s, q_s = pair[..., 1], pair[..., 0]
        return w_s, w_s * q_s, q_s
    w_s, order = torch.sort(w, dim=-1)
    return w_s, p.gather(-1, order), q.gather(-1, order)


@dataclass
class RatioProfile:
    """Sorted ratios and prefix sums of one batch of nodes. Build with `RatioProfile.build(p, q)`."""

    w_sorted: Tensor  # [B, V] increasing p/q
    p_prefix: Tensor  # [B, V + 1] sum of p over the k smallest ratios
    q_prefix: Tensor  # [B, V + 1]
    q_total: Tensor  # [B]
    total: Tensor  # [B] sum p (1 up to rounding)

    @classmethod
    @torch.no_grad()
    def build(cls, p: Tensor, q: Tensor) -> RatioProfile:
        w_s, p_s, q_s = sort_by_ratio(p.detach(), q.detach())
        acc = torch.float64 if p.device.type == "cpu" or p.dtype == torch.float64 else torch.float32
        zero = torch.zeros(p.shape[0], 1, dtype=acc, device=p.device)
        p_prefix = torch.cat(
            [zero, torch.cumsum(p_s, -1, dtype=acc)], -1
        )  # nan past the first w = inf: unused
        q_prefix = torch.cat([zero, torch.cumsum(q_s, -1, dtype=acc)], -1)
        return cls(w_s.contiguous(), p_prefix, q_prefix, q_prefix[:, -1], p.detach().sum(-1, dtype=acc))

    @torch.no_grad()
    def capped_mass(self, t: Tensor) -> Tensor:
        """F(t) = sum_x min(p, t q) for t [B] or [B, k] (t >= 0, finite) -> same shape, in the accumulator dtype."""
        squeeze = t.dim() == 1
        tt = (t[:, None] if squeeze else t).to(self.p_prefix.dtype)  # [B, k]
        k = torch.searchsorted(
            self.w_sorted, tt.to(self.w_sorted.dtype).contiguous(), right=False
        )  # [B, k]: #(w < t)
        f = self.p_prefix.gather(-1, k) + tt * (self.q_total[:, None] - self.q_prefix.gather(-1, k))
        return f[:, 0] if squeeze else f


@dataclass
class HostRatioProfile:
    """The ratio profile of ONE row as numpy arrays: what the decoder verifies on CPU, one node per call. There
    every torch call costs a few microseconds whatever its size, and the solvers' grid and bisection make a few
    hundred of them per node; numpy's cost per call is a fraction of that (T* at V = 8k, n = 4: ~0.2 ms against
    ~1 ms). Same contract as RatioProfile (t [1] or [1, K] -> F(t), float64), same sorted ratios; the solvers and
    plans of iid.py run on either (`build_profile` picks)."""

    w_sorted: np.ndarray  # [V] increasing p/q, in p's dtype
    p_prefix: np.ndarray  # [V + 1] float64
    q_prefix: np.ndarray  # [V + 1]
    q_total: np.ndarray  # [1]
    total: np.ndarray  # [1] sum p

    @classmethod
    @torch.no_grad()
    def build(cls, p: Tensor, q: Tensor) -> HostRatioProfile:
        w_s, p_s, q_s = (x[0].numpy() for x in sort_by_ratio(p.detach(), q.detach()))
        p_prefix, q_prefix = np.zeros((2, w_s.shape[0] + 1))
        np.cumsum(p_s, dtype=np.float64, out=p_prefix[1:])  # nan past the first w = inf: unused
        np.cumsum(q_s, dtype=np.float64, out=q_prefix[1:])
        total = p.detach().sum(-1, dtype=torch.float64).numpy()
        return cls(np.ascontiguousarray(w_s), p_prefix, q_prefix, q_prefix[-1:], total)

    def capped_mass(self, t: np.ndarray) -> np.ndarray:
        """F(t) = sum_x min(p, t q) for t [1] or [1, K] (float64, t >= 0, finite) -> same shape."""
        k = np.searchsorted(self.w_sorted, t.astype(self.w_sorted.dtype), side="left")  # #(w < t)
        return self.p_prefix[k] + t * (self.q_total - self.q_prefix[k])


def on_host(p: Tensor) -> bool:
    """One float32/float64 row on CPU (the decoder's verify calls): the profiles' numpy variants serve it, torch
    everything else (batches, GPUs, half precisions numpy lacks)."""
    return p.shape[0] == 1 and p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)


def build_profile(p: Tensor, q: Tensor) -> RatioProfile | HostRatioProfile:
    """The ratio profile the solvers work on: numpy for one row on CPU (`on_host`), torch otherwise."""
    return HostRatioProfile.build(p, q) if on_host(p) else RatioProfile.build(p, q)


# Bins of the histogram profiles on [0, n]. The T (or rho) they locate loses no measurable acceptance against the
# sorted profile's: plans located on 256, 1024 or 16384 bins accept within 3e-5 of the closed form alike (V = 300 to
# 128k; what is left is the bisection bracket, ResiSpecRule.verify_halvings), while fewer bins make the prefix sums
# and the working set small: at V = 128k, B = 64, resispec's verification went from 1.54x / 1.45x rrs's time at
# n = 2 / 4 with 16384 bins to 1.44x / 1.38x with 1024.
HISTOGRAM_BINS = 1024


@dataclass
class HistogramProfile:
    """A ratio profile without a sort, for locating T* at large V: w = p/q binned on [0, upper] (`bins` equal
    bins, plus one overflow bin for w >= upper and q = 0), with prefix sums over the bins. O(V) to build (two
    scatter-adds) instead of an O(V log V) sort.

    F(t) = P(w < t) + t Q(w >= t) is EXACT at every bin edge t = j * upper / bins (bin j holds the w with
    floor(w / width) = j, so "w < edge j" is "bin < j") and linearly interpolated in between, where the error is at
    most width x (q mass in that bin). That is enough to LOCATE T* (HISTOGRAM_BINS); a T off costs acceptance,
    never exactness (iid.py's run-time guard), and the plan itself is built on exact masses (DirectMass), never on
    this interpolation."""

    width: Tensor  # [B, 1] bin width
    p_cum: Tensor  # [B, bins + 1]: sum of p over w < j * width
    q_cum: Tensor  # [B, bins + 1]
    q_total: Tensor  # [B]
    total: Tensor  # [B] sum p
    bins: int

    @classmethod
    @torch.no_grad()
    def build(cls, p: Tensor, q: Tensor, upper: float, bins: int = HISTOGRAM_BINS) -> HistogramProfile:
        """bins is capped at V (memory B x bins stays below the input's B x V)."""
        p, q = p.detach(), q.detach()
        bins = max(1, min(bins, p.shape[-1]))
        acc = torch.float64 if p.device.type == "cpu" or p.dtype == torch.float64 else torch.float32
        width = upper / bins
        # bin index floor(w / width), in place on one buffer: q = 0 gives inf (or nan when p = 0 too) -> overflow
        x = torch.div(p, q).mul_(1.0 / width)
        idx = torch.fmin(x, torch.tensor(float(bins), dtype=x.dtype), out=x).long()  # fmin: nan -> bins too
        shape = (p.shape[0], bins + 1)
        # per-bin sums in the input dtype (they only locate T), prefix sums in the accumulator dtype
        hp = torch.zeros(shape, dtype=p.dtype, device=p.device).scatter_add_(-1, idx, p)
        hq = torch.zeros(shape, dtype=q.dtype, device=p.device).scatter_add_(-1, idx, q)
        zero = torch.zeros(p.shape[0], 1, dtype=acc, device=p.device)
        p_cum = torch.cat([zero, torch.cumsum(hp[:, :bins], -1, dtype=acc)], -1)
        q_cum = torch.cat([zero, torch.cumsum(hq[:, :bins], -1, dtype=acc)], -1)
        width_t = torch.full((p.shape[0], 1), width, dtype=acc, device=p.device)
        return cls(width_t, p_cum, q_cum, hq.sum(-1, dtype=acc), p.sum(-1, dtype=acc), bins)

    @torch.no_grad()
    def capped_mass(self, t: Tensor) -> Tensor:
        """F(t) for t [B] or [B, k] in [0, upper], exact at bin edges, linear in between -> same shape."""
        squeeze = t.dim() == 1
        x = (t[:, None] if squeeze else t).to(self.p_cum.dtype) / self.width  # [B, k] in bin units
        j = x.floor().clamp(0, self.bins - 1).long()
        frac = (x - j).clamp(0, 1)

        def edge(k: Tensor) -> Tensor:
            return self.p_cum.gather(-1, k) + k * self.width * (
                self.q_total[:, None] - self.q_cum.gather(-1, k)
            )

        lo = edge(j)
        f = lo + frac * (edge(j + 1) - lo)
        return f[:, 0] if squeeze else f


@dataclass
class DirectMass:
    """Exact F(t) = sum_x min(p, t q) by one O(V) pass per t [B] (the plan needs a handful of them): the masses
    mu_i that verification uses must be the actual ones, whatever profile located T."""

    p: Tensor
    q: Tensor
    total: Tensor

    @classmethod
    def build(cls, p: Tensor, q: Tensor) -> DirectMass:
        acc = torch.float64 if p.device.type == "cpu" or p.dtype == torch.float64 else torch.float32
        return cls(p.detach(), q.detach(), p.detach().sum(-1, dtype=acc))

    @torch.no_grad()
    def capped_mass(self, t: Tensor) -> Tensor:
        """t [B] -> [B] in the accumulator dtype."""
        capped = torch.mul(self.q, t[:, None].to(self.p.dtype))
        return torch.minimum(capped, self.p, out=capped).sum(-1, dtype=self.total.dtype)


@functools.lru_cache(maxsize=16)
def _bin_edges(upper: float, bins: int) -> np.ndarray:
    """j * upper / bins for j = 0..bins (read-only: shared by every profile of that shape)."""
    edges = np.arange(bins + 1) * (upper / bins)
    edges.flags.writeable = False
    return edges


@dataclass
class HostHistogramProfile:
    """HistogramProfile of ONE row on numpy (`on_host`): the decoder's verify calls locate T* (resispec) and rho*
    (kseq) on it at every V. Building it is O(V) (two weighted bincounts) where the sorted profile sorts V ratios:
    in the decoder, right after the target's forward has evicted the CPU caches, ~0.2 ms a node against ~0.5 for
    the sort (V = 8192, 2-core CPU). Same F as HistogramProfile (exact at the edges, linear in between), here
    precomputed at every edge: a lookup is one np.interp, or a list lookup for one Python float
    (scalar_capped_mass, what the one-row solvers bisect with). The bins are not capped at V (one row)."""

    edges: np.ndarray  # [bins + 1] j * width
    f_edges: np.ndarray  # [bins + 1] F at the edges, float64
    total: np.ndarray  # [1] sum p

    @classmethod
    @torch.no_grad()
    def build(cls, p: Tensor, q: Tensor, upper: float, bins: int = HISTOGRAM_BINS) -> HostHistogramProfile:
        p_row, q_row = p.detach()[0].numpy(), q.detach()[0].numpy()
        edges = _bin_edges(upper, bins)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = p_row / q_row  # q = 0: inf, or nan where p = 0 too -> the overflow bin (fmin skips nan)
        x *= 1.0 / (upper / bins)  # as HistogramProfile: the same bins
        # bin floor(w / width), shifted by one: a prefix sum up to slot j is then the mass of the bins below edge j
        slot = np.fmin(x, bins).astype(np.intp) + 1
        masses = np.stack(
            [np.bincount(slot, weights=r, minlength=bins + 2) for r in (p_row, q_row)]
        )  # float64
        below = torch.cumsum(torch.from_numpy(masses[:, : bins + 1]), -1).numpy()  # ~4x numpy's cumsum on CPU
        f_edges = below[0] + edges * (masses[1].sum() - below[1])
        return cls(edges, f_edges, masses[0].sum(keepdims=True))

    def capped_mass(self, t: np.ndarray) -> np.ndarray:
        """F(t) for t [1] or [1, K] in [0, upper] (float64) -> same shape."""
        return np.interp(t, self.edges, self.f_edges)

    def scalar_capped_mass(self) -> Callable[[float], float]:
        """F as a function of one Python float (t >= 0): the same edges and linear interpolation as capped_mass, at
        ~0.1 us a call where a numpy call costs ~2 us; what the one-row solvers bisect with (iid.py)."""
        f = self.f_edges.tolist()
        bins = len(f) - 1
        per_unit = bins / float(self.edges[-1])

        def capped_mass(t: float) -> float:
            x = t * per_unit
            j = int(x)
            if j >= bins:
                return f[bins]
            return f[j] + (x - j) * (f[j + 1] - f[j])

        return capped_mass


@dataclass
class HostDirectMass:
    """DirectMass of ONE row on numpy (`on_host`): the exact masses the plan is built on, a few numpy calls per t."""

    p: np.ndarray
    q: np.ndarray
    total: np.ndarray  # [1] sum p, float64

    @classmethod
    def build(cls, p: Tensor, q: Tensor) -> HostDirectMass:
        p_row, q_row = p.detach()[0].numpy(), q.detach()[0].numpy()
        return cls(p_row, q_row, np.array([p_row.sum(dtype=np.float64)]))

    def capped_mass(self, t: np.ndarray) -> np.ndarray:
        """t [1] (float64) -> [1] float64."""
        capped = self.q * self.q.dtype.type(t[0])
        return np.array([np.minimum(capped, self.p, out=capped).sum(dtype=np.float64)])


def histogram_profile(p: Tensor, q: Tensor, upper: float) -> HistogramProfile | HostHistogramProfile:
    """The histogram profile on [0, upper]: numpy for one row on CPU (`on_host`), torch otherwise."""
    return HostHistogramProfile.build(p, q, upper) if on_host(p) else HistogramProfile.build(p, q, upper)


def direct_mass(p: Tensor, q: Tensor) -> DirectMass | HostDirectMass:
    """Exact F(t) one pass per t: numpy for one row on CPU (`on_host`), torch otherwise."""
    return HostDirectMass.build(p, q) if on_host(p) else DirectMass.build(p, q)
