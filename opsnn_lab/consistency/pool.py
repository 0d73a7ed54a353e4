"""``SeedPool``: stable per-name seeds from one base seed (BLAKE2b of (seed, step, name)), and ``SeedStream``, the
seeds of one name step after step. What ``make_reproducible`` (``seed_pool``) keys every stream with."""

from __future__ import annotations

import hashlib
import struct

import torch

from opsnn_lab._checks import check_positive, check_type

__all__ = ["SeedPool", "SeedStream"]

_MASK63 = (1 << 63) - 1
_PERSON = b"opsnn-seedpool"  # BLAKE2b personalisation: these hashes are ours alone


def _check_seed(name: str, seed) -> int:
    check_type(name, seed, int)
    if isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {seed!r}")
    return seed


def _check_step(step) -> int:
    check_positive("step", step, allow_zero=True, integer=True)
    if step >= 1 << 63:
        raise ValueError(f"step must be < 2**63, got {step}")
    return step


class SeedStream:
    """The seeds of one name, step after step: ``next(stream)`` or ``stream.at(step)``."""

    def __init__(self, pool: SeedPool, name: str, step: int = 0):
        self.pool, self.name, self.step = pool, name, _check_step(step)

    def at(self, step: int) -> int:
        return self.pool.seed_for(self.name, step)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        seed = self.at(self.step)
        self.step += 1
        return seed

    def __repr__(self):
        return f"SeedStream(name={self.name!r}, step={self.step})"


class SeedPool:
    """Stable per-name seeds derived from one base ``seed``.

    >>> pool = SeedPool(0)
    >>> pool.seed_for("encoder.layer.3.dropout") == SeedPool(0).seed_for("encoder.layer.3.dropout")
    True
    """

    def __init__(self, seed: int = 0):
        self.seed = _check_seed("seed", seed)
        self._key = struct.pack("<Q", self.seed)

    def seed_for(self, name: str, step: int = 0) -> int:
        """A seed in ``[0, 2**63)`` for op ``name`` at ``step``: BLAKE2b of (seed, step, name)."""
        check_type("name", name, str)
        h = hashlib.blake2b(struct.pack("<Q", _check_step(step)) + name.encode("utf-8"),
                            digest_size=8, key=self._key, person=_PERSON)
        return int.from_bytes(h.digest(), "little") & _MASK63

    def stream(self, name: str, start: int = 0) -> SeedStream:
        """The seeds of ``name`` at steps ``start, start + 1, ...``."""
        check_type("name", name, str)
        return SeedStream(self, name, start)

    def generator(self, name: str = "data", step: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
        """A ``torch.Generator`` seeded from ``(name, step)``: data shuffling, augmentation, init."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed_for(name, step))
        return g

    def shuffle(self, n: int, epoch: int = 0, name: str = "data") -> torch.Tensor:
        """The permutation of ``range(n)`` for ``epoch`` (int64): the same in every run and process."""
        check_positive("n", n, allow_zero=True, integer=True)
        return torch.randperm(n, generator=self.generator(name, epoch))

    def __repr__(self):
        return f"SeedPool(seed={self.seed})"

    def __eq__(self, other):
        return isinstance(other, SeedPool) and other.seed == self.seed

    def __hash__(self):
        return hash(("SeedPool", self.seed))


# --------------------------------------------------------------------------- make_reproducible
