"""Deliberately broken or slow backends for the runner's tests (loaded by ``module:Class`` specs)."""

from __future__ import annotations

import os
import time

from parity.backends.reference import TorchEmulated


class Raiser(TorchEmulated):
    name = "fake-raiser"
    description = "raises on every call"
    has_backward = False

    def _forward(self, inputs):
        raise RuntimeError("boom: this backend always fails")


class SilentRaiser(TorchEmulated):
    name = "fake-silent-raiser"
    description = "raises a RuntimeError with no message (as some kernels do)"
    has_backward = False

    def _forward(self, inputs):
        raise RuntimeError()


class NaNer(TorchEmulated):
    name = "fake-nan"
    description = "writes one NaN into o"
    has_backward = False
    value, index = float("nan"), 0

    def _forward(self, inputs):
        o, ht, impl = super()._forward(inputs)
        o = o.contiguous().clone()
        o.view(-1)[self.index] = self.value
        return o, ht, f"fake/{self.value}"


class Sleeper(TorchEmulated):
    """Takes ``seconds`` (30) per call (a slow compile)."""

    name = "fake-sleeper"
    description = "sleeps 30 s per call"
    has_backward = False
    seconds = 30

    def _forward(self, inputs):
        time.sleep(self.seconds)
        return super()._forward(inputs)


class LongSleeper(Sleeper):
    """Takes 10 min per call: a run that is surely still going when a test interrupts it."""

    name = "fake-long-sleeper"
    description = "sleeps 600 s per call"
    seconds = 600


ONCE_DIR = "GDN_FAKE_FAULT_ONCE_DIR"


def fault_fires(name: str) -> bool:
    """True, or, with $GDN_FAKE_FAULT_ONCE_DIR set, only the first time (a marker file there per backend): a fault
    that a resumed run no longer meets."""
    folder = os.environ.get(ONCE_DIR)
    if not folder:
        return True
    mark = os.path.join(folder, name)
    if os.path.exists(mark):
        return False
    open(mark, "w").close()
    return True


class Crasher(TorchEmulated):
    """Kills its process (like an illegal memory access would) on cases with T == 65."""

    name = "fake-crasher"
    description = "exits the process on T=65"
    has_backward = False

    def _forward(self, inputs):
        if inputs.q.shape[1] == 65 and fault_fires(self.name):
            os._exit(7)
        return super()._forward(inputs)


class Unavailable(TorchEmulated):
    name = "fake-unavailable"

    def available(self):
        return False, "fake: never available"


class InstalledLater(TorchEmulated):
    """Unavailable until ``$GDN_FAKE_INSTALLED`` is "1" (a package installed between a run and its resume)."""

    name = "fake-installed-later"

    def available(self):
        if os.environ.get("GDN_FAKE_INSTALLED") == "1":
            return True, ""
        return False, "fake: not installed yet"


class WrongShape(TorchEmulated):
    name = "fake-wrong-shape"
    has_backward = False

    def _forward(self, inputs):
        o, ht, impl = super()._forward(inputs)
        return o[:, :-1], ht, "fake/shape"


# Fault injection: each backend below breaks one way; tests/test_faults.py runs them through ``parity run`` and
# checks that nothing else is lost.


class Hanger(TorchEmulated):
    """Hangs (sleeps an hour) on cases with T == 65: a cell that runs past --cell-timeout."""

    name = "fake-hanger"
    description = "hangs on T=65"
    has_backward = False

    def _forward(self, inputs):
        if inputs.q.shape[1] == 65 and fault_fires(self.name):
            time.sleep(3600)
        return super()._forward(inputs)


class Infer(NaNer):
    name = "fake-inf"
    description = "writes one +Inf into o"
    value, index = float("inf"), -1


class Biased(TorchEmulated):
    """Adds 2% of o's RMS to every element of o: finite, plausible, and wrong."""

    name = "fake-biased"
    description = "o off by a small constant bias"
    has_backward = False

    def _forward(self, inputs):
        o, ht, impl = super()._forward(inputs)
        return o + 0.02 * o.float().pow(2).mean().sqrt().to(o.dtype), ht, "fake/biased"


class RaisingSupports(TorchEmulated):
    name = "fake-raising-supports"
    description = "supports() raises"
    has_backward = False

    def supports(self, case, device):
        raise RuntimeError("supports exploded")


class RaisingAvailable(TorchEmulated):
    name = "fake-raising-available"
    description = "available() raises"
    has_backward = False

    def available(self):
        raise RuntimeError("available exploded")
