"""Gradient-magnitude statistics: per-parameter log2|g| histograms and fp16/bf16 range fractions.

``GradientStats(model)`` records, after each backward, one histogram of ``floor(log2|g|)`` per
parameter on FIXED octave bins, plus zeros and non-finite elements counted apart. Octave bins make
a loss scale of ``2**k`` an exact shift by ``k`` bins, so a recorded ``GradientTrace`` answers "what
fraction would underflow / land in subnormals / overflow in fp16 or bf16 at scale s" for any
power-of-two scale without the gradients (fractional log2 scales interpolate inside one bin).

The bin of an element is the exponent field of its float32 bits (exact, no log rounding at powers of
two; Inf/NaN fall in the non-finite bin by construction; the rare float32 subnormals are re-binned
with ``torch.frexp``), and every parameter's histogram comes out of ONE ``torch.bincount`` over
``param_id * n_bins + bin`` of all gradients concatenated: about eight passes over the gradient bytes
and a fixed number of kernel launches per step, whatever the number of parameters.

Range thresholds (the value after scaling, ``|g * s|``):

======  ==================  ===================  =====================================
format  underflow           subnormal            overflow (rounds to inf)
======  ==================  ===================  =====================================
fp16    < 2**-24            [2**-24, 2**-14)     >= 2**16 in the histogram; exact flag:
                                                 amax * s >= 65520 (half-way to 2**16)
bf16    < 2**-133           [2**-133, 2**-126)   >= 2**128; flag: >= (2 - 2**-8) * 2**127
======  ==================  ===================  =====================================

"Underflow" is below the smallest subnormal: such a value flushes to zero or rounds to the smallest
subnormal with up to 100% error. Fractions are of the nonzero finite elements (zeros are exact in
any format and are reported as ``zero_fraction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from opsnn_lab._callbacks import Callback
from opsnn_lab._checks import check_choice, check_positive, check_type

__all__ = ["GradientStats", "GradientTrace", "FORMATS", "EXP_MIN", "EXP_MAX"]

EXP_MIN, EXP_MAX = -149, 127  # floor(log2|x|) of the smallest float32 subnormal and of float32 max
N_EXP = EXP_MAX - EXP_MIN + 1  # 277 octave bins
NONFINITE_BIN, ZERO_BIN = N_EXP, N_EXP + 1  # float32 exponent field 255 lands on N_EXP by itself
_BIAS = 127 + EXP_MIN  # bin of a normal float32 = exponent field - _BIAS; field 0 (subnormal) -> bin 22
N_BINS = N_EXP + 2
DEFAULT_BINS = (-48, 20)  # display octaves kept per parameter: fp16 stays exact for scales 2**-4 .. 2**24


@dataclass(frozen=True)
class Format:
    """A low-precision format's range in log2 terms (thresholds on the scaled magnitude)."""

    name: str
    min_subnormal_log2: int
    min_normal_log2: int
    overflow_log2: int
    overflow_value: float  # smallest magnitude that rounds to inf (round to nearest even)


FORMATS = {
    "fp16": Format("fp16", -24, -14, 16, 65520.0),
    "bf16": Format("bf16", -133, -126, 128, (2 - 2**-8) * 2.0**127),
}
KINDS = ("underflow", "subnormal", "overflow")


def _fmt(name: str) -> Format:
    check_choice("fmt", name, FORMATS)
    return FORMATS[name]


def range_fractions(counts: torch.Tensor, log2_scale, fmt: str = "fp16") -> dict[str, torch.Tensor]:
    """Underflow/subnormal/overflow fractions from full exponent histograms ``(..., N_BINS)``.

    ``log2_scale`` is a float or a tensor broadcastable to ``counts.shape[:-1]``. Fractions are of the
    nonzero finite elements; an integer ``log2_scale`` is exact, a fractional one interpolates
    linearly in log2 inside the one bin the threshold cuts.
    """
    return _fractions(*_cumulative(counts), log2_scale, _fmt(fmt))


def _cumulative(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exp = counts[..., :N_EXP].double()
    return exp, torch.nn.functional.pad(exp.cumsum(-1), (1, 0))  # cum[..., i] = elements in bins < i


def _fractions(exp: torch.Tensor, cum: torch.Tensor, log2_scale, f: Format) -> dict[str, torch.Tensor]:
    total = cum[..., -1]
    ls = torch.as_tensor(log2_scale, dtype=torch.float64, device=exp.device).expand(total.shape)

    def below(log2_threshold: int) -> torch.Tensor:  # elements with log2|g| + log2_scale < threshold
        t = log2_threshold - ls - EXP_MIN  # threshold in bin coordinates
        i = t.floor().clamp(0, N_EXP)
        frac = (t - i).clamp(0, 1)
        whole = cum.gather(-1, i.long().unsqueeze(-1)).squeeze(-1)
        part = exp.gather(-1, i.long().clamp(max=N_EXP - 1).unsqueeze(-1)).squeeze(-1)
        return whole + torch.where(i < N_EXP, frac * part, torch.zeros_like(part))

    under, normal = below(f.min_subnormal_log2), below(f.min_normal_log2)
    over = total - below(f.overflow_log2)
    denom = total.clamp(min=1)
    return {"underflow": under / denom, "subnormal": (normal - under) / denom, "overflow": over / denom}


@dataclass
class GradientTrace:
    """Gradient statistics of a run, one row per recorded step (numpy arrays; save/load as npz).

    ``counts[s]`` is the whole model's exponent histogram (``N_BINS``: octaves ``EXP_MIN..EXP_MAX``,
    then non-finite, then zeros); ``param_hist[s, p]`` is parameter p's histogram on the display bins
    ``bins`` (``[< lo, lo..hi-1, >= hi]``); ``amax`` is the unscaled max |g| (inf/nan on a non-finite
    step); ``scale`` the loss scale in effect when the step was recorded.
    """

    names: list[str]
    bins: tuple[int, int]
    step: np.ndarray
    scale: np.ndarray
    counts: np.ndarray
    amax: np.ndarray
    param_hist: np.ndarray
    param_amax: np.ndarray
    param_zeros: np.ndarray
    param_nonfinite: np.ndarray
    param_numel: np.ndarray
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.step)

    @property
    def edges(self) -> np.ndarray:
        """Display-bin edges in log2 units: ``lo, lo+1, ..., hi``."""
        return np.arange(self.bins[0], self.bins[1] + 1)

    @property
    def nonfinite(self) -> np.ndarray:
        """(S,) bool: the step had an Inf/NaN gradient element (overflows at any scale)."""
        return self.counts[:, NONFINITE_BIN] > 0

    @property
    def zero_fraction(self) -> np.ndarray:
        return self.counts[:, ZERO_BIN] / np.maximum(self.counts.sum(1), 1)

    def _scales(self, scale) -> np.ndarray:
        s = self.scale if scale is None else np.broadcast_to(np.asarray(scale, dtype=np.float64), self.step.shape)
        if np.any(~(s > 0)) or np.any(~np.isfinite(s)):
            raise ValueError("scale must be positive and finite")
        return s

    def overflow(self, scale=None, fmt: str = "fp16") -> np.ndarray:
        """(S,) bool: would the step's gradients hold an Inf after ``g * scale`` is cast to ``fmt``.

        ``scale`` is a number or one per step; None means the scale recorded with each step.
        """
        s = self._scales(scale)
        with np.errstate(invalid="ignore", over="ignore"):
            return self.nonfinite | ~(self.amax * s < _fmt(fmt).overflow_value)

    def fractions(self, scale=None, fmt: str = "fp16") -> dict[str, np.ndarray]:
        """Per-step underflow/subnormal/overflow fractions of the whole model at ``scale``."""
        f = _fmt(fmt)
        if "cum" not in self._cache:  # the cumulative histogram is reused by every replayed scale
            self._cache["cum"] = _cumulative(torch.from_numpy(self.counts))
        out = _fractions(*self._cache["cum"], torch.from_numpy(np.log2(self._scales(scale))), f)
        return {k: v.numpy() for k, v in out.items()}

    def underflow_fraction(self, scale=None, fmt: str = "fp16") -> np.ndarray:
        """(S,) fraction of nonzero gradient elements below ``fmt``'s smallest subnormal at ``scale``."""
        return self.fractions(scale, fmt)["underflow"]

    def layer_fractions(self, index: int, scale=None, fmt: str = "fp16") -> dict[str, np.ndarray]:
        """(P,) per-parameter fractions at row ``index``, from the display bins.

        Exact while the format's thresholds, shifted by log2(scale), fall inside ``bins`` (the default
        (-48, 20) covers fp16 at every scale from 2**-4 to 2**24); elements outside the bins are
        taken to sit in the octave just outside them.
        """
        if not -len(self) <= index < len(self):
            raise ValueError(f"index must be in [{-len(self)}, {len(self)}), got {index}")
        s = float(self.scale[index] if scale is None else scale)
        check_positive("scale", s)
        lo, hi = self.bins
        full = np.zeros((len(self.names), N_BINS), dtype=np.int64)
        hist = self.param_hist[index]
        full[:, lo - EXP_MIN:hi - EXP_MIN] = hist[:, 1:-1]
        full[:, max(lo - 1 - EXP_MIN, 0)] += hist[:, 0]
        full[:, min(hi - EXP_MIN, N_EXP - 1)] += hist[:, -1]
        full[:, NONFINITE_BIN] = self.param_nonfinite[index]
        out = range_fractions(torch.from_numpy(full), math.log2(s), fmt)
        return {k: v.numpy() for k, v in out.items()}

    def max_safe_scale(self, fmt: str = "fp16") -> np.ndarray:
        """(S,) the largest scale at which the step's gradients do not overflow ``fmt`` (0 if non-finite)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            out = _fmt(fmt).overflow_value / self.amax
        return np.where(self.nonfinite | ~np.isfinite(out), np.where(self.nonfinite, 0.0, np.inf), out)

    def events(self) -> list[float]:
        """Per-step unscaled amax (NaN on a non-finite step): ``DynamicScaler(...).replay(trace.events())``."""
        return np.where(self.nonfinite, np.nan, self.amax).tolist()

    @classmethod
    def from_amax(cls, amax, counts=None, scale=1.0, name: str = "model") -> GradientTrace:
        """A whole-model trace from a per-step amax sequence (e.g. ``TrainResult.grad_amax`` maxed over
        parameters), with optional exponent histograms ``counts`` ``(S, N_BINS)``; without them each step
        holds one element at its amax. NaN/Inf amax marks a non-finite step."""
        amax = np.asarray(amax, dtype=np.float64).reshape(-1)
        S = len(amax)
        if counts is None:
            counts = np.zeros((S, N_BINS), dtype=np.int64)
            finite = np.isfinite(amax) & (amax > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                b = np.floor(np.log2(np.where(finite, amax, 1.0))).astype(np.int64) - EXP_MIN
            counts[np.arange(S), np.where(finite, np.clip(b, 0, N_EXP - 1), np.where(amax == 0, ZERO_BIN,
                                                                                         NONFINITE_BIN))] = 1
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (S, N_BINS):
            raise ValueError(f"counts must have shape ({S}, {N_BINS}), got {counts.shape}")
        counts[~np.isfinite(amax), NONFINITE_BIN] = np.maximum(counts[~np.isfinite(amax), NONFINITE_BIN], 1)
        scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), (S,)).copy()
        lo, hi = DEFAULT_BINS
        hist = np.concatenate([counts[:, :lo - EXP_MIN].sum(1, keepdims=True), counts[:, lo - EXP_MIN:hi - EXP_MIN],
                               counts[:, hi - EXP_MIN:N_EXP].sum(1, keepdims=True)], axis=1)
        return cls(names=[name], bins=(lo, hi), step=np.arange(S), scale=scale, counts=counts, amax=amax,
                   param_hist=hist[:, None, :].astype(np.int32), param_amax=amax[:, None].astype(np.float32),
                   param_zeros=counts[:, None, ZERO_BIN], param_nonfinite=counts[:, None, NONFINITE_BIN],
                   param_numel=np.array([int(counts[0].sum()) if S else 0]))

    def by_module(self) -> GradientTrace:
        """The same trace with parameters merged per module (``layers.0.mlp.fc1.weight`` and ``.bias``
        -> ``layers.0.mlp.fc1``): histograms, zeros and non-finite counts summed, amax maxed."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(self.names):
            groups.setdefault(name.rsplit(".", 1)[0] if "." in name else name, []).append(i)
        idx = list(groups.values())
        merge = lambda a, op: np.stack([op(a[:, ix], axis=1) for ix in idx], axis=1) if idx else a
        return GradientTrace(
            names=list(groups), bins=self.bins, step=self.step, scale=self.scale, counts=self.counts, amax=self.amax,
            param_hist=merge(self.param_hist, np.sum), param_amax=merge(self.param_amax, np.max),
            param_zeros=merge(self.param_zeros, np.sum), param_nonfinite=merge(self.param_nonfinite, np.sum),
            param_numel=np.array([self.param_numel[ix].sum() for ix in idx], dtype=np.int64))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"path must end in .npz, got {str(path)!r}")
        arrays = {k: getattr(self, k) for k in _ARRAYS}
        np.savez_compressed(path, names=np.array(self.names, dtype=str), bins=np.array(self.bins), **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> GradientTrace:
        with np.load(Path(path), allow_pickle=False) as z:
            missing = {"names", "bins", *_ARRAYS} - set(z.files)
            if missing:
                raise ValueError(f"path {str(path)!r} is not a GradientTrace file (missing {sorted(missing)})")
            return cls(names=[str(n) for n in z["names"]], bins=tuple(int(b) for b in z["bins"]),
                       **{k: z[k] for k in _ARRAYS})

    def _repr_html_(self) -> str:
        over = int(self.overflow().sum()) if len(self) else 0
        under = float(self.underflow_fraction().mean()) if len(self) else math.nan
        return (f"<b>GradientTrace</b>: {len(self)} steps, {len(self.names)} parameters, "
                f"{over} fp16-overflow steps at the recorded scale, mean fp16 underflow {under:.2%}")


_ARRAYS = ("step", "scale", "counts", "amax", "param_hist", "param_amax", "param_zeros",
           "param_nonfinite", "param_numel")


class GradientStats(Callback):
    """Per-parameter log2|g| histograms and fp16/bf16 range fractions, cheap enough for every step.

    Call ``record(step)`` after backward, or pass the object as a callback to ``ol.train``.
    ``scale`` is the loss scale to evaluate fractions at: a number, an object with a ``.scale``
    attribute (a ``DynamicScaler``), or a callable; it is read at each record. Gradients in ``.grad``
    are taken as unscaled; ``scaled=True`` says they hold ``g * scale`` (backward of a scaled loss)
    and divides it out first (exact for power-of-two scales), so the trace always holds true gradients.
    ``bins=(lo, hi)`` are the octave edges kept per parameter for display; the whole-model
    histogram always spans every float32 exponent.
    """

    def __init__(self, model: nn.Module, bins: tuple[int, int] = DEFAULT_BINS, scale=1.0, every: int = 1,
                 scaled: bool = False):
        check_type("model", model, nn.Module)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no parameters that require grad")
        if (not isinstance(bins, (tuple, list)) or len(bins) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in bins)
                or not EXP_MIN <= bins[0] < bins[1] <= EXP_MAX + 1):
            raise ValueError(f"bins must be two ints (lo, hi) with {EXP_MIN} <= lo < hi <= {EXP_MAX + 1}, got {bins!r}")
        check_positive("every", every, integer=True)
        check_type("scaled", scaled, bool)
        self._scale_of(scale)  # validate now, not at the first step
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.bins = (int(bins[0]), int(bins[1]))
        self.scale = scale
        self.every = every
        self.scaled = scaled
        self._rows: list[tuple] = []
        self._layout_key = None

    @staticmethod
    def _scale_of(scale) -> float:
        value = scale.scale if hasattr(scale, "scale") else scale() if callable(scale) else scale
        if isinstance(value, torch.Tensor):
            value = float(value)
        check_positive("scale", value)
        if not math.isfinite(value):
            raise ValueError(f"scale must be finite, got {value}")
        return float(value)

    def _layout(self, present: tuple[bool, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter index of every element of the concatenated gradients, and its bincount offset."""
        if self._layout_key != (present, device):
            sizes = torch.tensor([p.numel() if ok else 0 for p, ok in zip(self.params, present)], device=device)
            pidx = torch.repeat_interleave(torch.arange(len(self.params), device=device), sizes)
            self._cached = (pidx, (pidx * N_BINS - _BIAS).int())
            self._layout_key = (present, device)
        return self._cached

    @torch.no_grad()
    def record(self, step: int, scale: float | None = None) -> None:
        """Histogram the current ``.grad`` of every parameter (a missing grad counts as no elements)."""
        check_positive("step", step, allow_zero=True, integer=True)
        s = self._scale_of(self.scale if scale is None else scale)
        grads = [p.grad for p in self.params]
        present = tuple(g is not None for g in grads)
        # a sparse gradient (nn.Embedding(sparse=True)) as the dense one it stands for: its rows not drawn are zeros
        live = [(g if g.layout == torch.strided else g.to_dense()).reshape(-1) for g in grads if g is not None]
        device = live[0].device if live else torch.device("cpu")
        P = len(self.params)
        flat = torch.cat([g.float() for g in live]) if live else torch.zeros(0, device=device)
        if self.scaled and s != 1.0:
            flat.div_(s)  # cat made a fresh buffer: dividing in place touches no .grad
        pidx, offset = self._layout(present, device)
        pamax = torch.zeros(P, device=device).scatter_reduce_(0, pidx, flat.abs(), "amax")  # NaN/Inf propagate
        expo = torch.bitwise_right_shift(flat.view(torch.int32), 23).bitwise_and_(255)  # biased exponent
        full = torch.bincount(expo.add_(offset), minlength=P * N_BINS).view(P, N_BINS)
        # Exponent field 0 (bin -_BIAS) holds the zeros and any float32 subnormals. One read-only count
        # tells them apart; with no subnormals (the usual case) the bin is simply the zero count.
        if bool(full[:, -_BIAS].sum() + torch.count_nonzero(flat) == flat.numel()):
            full[:, ZERO_BIN] = full[:, -_BIAS]
            full[:, -_BIAS] = 0
        else:
            expo0 = expo == offset
            expo[expo0 & (flat == 0)] = ZERO_BIN + _BIAS  # the offset is added below
            sub = expo0 & (flat != 0)
            expo[sub] = torch.frexp(flat[sub]).exponent - 1 - EXP_MIN + _BIAS
            expo[expo0] += offset[expo0]
            full = torch.bincount(expo, minlength=P * N_BINS).view(P, N_BINS)
        lo, hi = self.bins[0] - EXP_MIN, self.bins[1] - EXP_MIN
        hist = torch.cat([full[:, :lo].sum(1, keepdim=True), full[:, lo:hi],
                          full[:, hi:N_EXP].sum(1, keepdim=True)], dim=1).int()
        self._rows.append((step, s, full.sum(0), pamax.max(), hist, pamax, full[:, ZERO_BIN],
                           full[:, NONFINITE_BIN]))

    # --- Callback protocol: ol.train(model, task, steps, callbacks=[stats]) records every step
    def on_after_backward(self, step: int, model: nn.Module, loss: torch.Tensor) -> None:
        if step % self.every == 0:
            self.record(step)

    def __len__(self) -> int:
        return len(self._rows)

    def reset(self) -> None:
        self._rows.clear()

    def trace(self) -> GradientTrace:
        """The recorded steps as a ``GradientTrace`` (one host copy of everything recorded)."""
        P, lo, hi = len(self.params), *self.bins
        if not self._rows:
            empty = lambda *shape, dt=np.int64: np.zeros(shape, dtype=dt)
            return GradientTrace(list(self.names), self.bins, empty(0), empty(0, dt=np.float64), empty(0, N_BINS),
                                 empty(0, dt=np.float64), empty(0, P, hi - lo + 2, dt=np.int32),
                                 empty(0, P, dt=np.float32), empty(0, P), empty(0, P),
                                 np.array([p.numel() for p in self.params]))
        cols = list(zip(*self._rows))
        stack = lambda i: torch.stack([t.cpu() for t in cols[i]]).numpy()
        return GradientTrace(
            names=list(self.names), bins=self.bins, step=np.array(cols[0], dtype=np.int64),
            scale=np.array(cols[1], dtype=np.float64), counts=stack(2).astype(np.int64),
            amax=stack(3).astype(np.float64), param_hist=stack(4), param_amax=stack(5).astype(np.float32),
            param_zeros=stack(6), param_nonfinite=stack(7), param_numel=np.array([p.numel() for p in self.params]))

    def save(self, path: str | Path) -> Path:
        return self.trace().save(path)

    def _repr_html_(self) -> str:
        return f"<b>GradientStats</b>: {len(self.params)} parameters, {len(self)} steps recorded, bins {self.bins}"

