"""Energy counters: Intel RAPL (``/sys/class/powercap``) or NVIDIA NVML; otherwise "unavailable", never a guess."""

from __future__ import annotations

import glob
import time
from pathlib import Path

POWERCAP = "/sys/class/powercap"


def _rapl_zones() -> list[Path]:
    # top-level package zones only (intel-rapl:N); subzones (intel-rapl:N:M) are contained in them
    return [Path(p) for p in sorted(glob.glob(f"{POWERCAP}/intel-rapl:*")) if p.count(":") == 1]


def _read_rapl_uj(zones: list[Path]) -> int | None:
    try:
        return sum(int((z / "energy_uj").read_text()) for z in zones)
    except (OSError, ValueError):
        return None


def _nvml_handle():
    try:
        import pynvml  # not a dependency: used only where it is installed
    except ImportError:
        return None, "pynvml not installed"
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0), None
    except Exception as exc:  # no driver, no device
        return None, f"NVML: {exc}"


class EnergyMeter:
    """Joules between :meth:`start` and :meth:`stop` from the first counter this machine exposes."""

    def __init__(self) -> None:
        self.source, self.reason = None, None
        self._zones = _rapl_zones()
        if self._zones and _read_rapl_uj(self._zones) is not None:
            self.source = "rapl"
        else:
            handle, why = _nvml_handle()
            if handle is not None:
                self.source, self._nvml = "nvml", handle
            else:
                self.reason = f"no readable RAPL counter under {POWERCAP}; {why}"
        self._start = self._t0 = None

    def _joules(self) -> float | None:
        if self.source == "rapl":
            uj = _read_rapl_uj(self._zones)
            return None if uj is None else uj / 1e6
        if self.source == "nvml":
            import pynvml

            return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._nvml) / 1e3
        return None

    def start(self) -> None:
        """Read the counter now."""
        self._start, self._t0 = self._joules(), time.perf_counter()

    def stop(self, rollouts: int, actions: int) -> dict:
        """Energy since :meth:`start`: total, per rollout, per action, average power — or unavailable."""
        end, seconds = self._joules(), time.perf_counter() - (self._t0 or time.perf_counter())
        if self.source is None or end is None or self._start is None:
            return {"available": False, "reason": self.reason or "counter could not be read", "joules": "unavailable",
                    "joules_per_rollout": "unavailable", "joules_per_action": "unavailable",
                    "average_watts": "unavailable"}
        joules = end - self._start  # RAPL wraps around; a negative difference is reported, not corrected silently
        return {"available": True, "source": self.source, "joules": joules, "seconds": seconds,
                "joules_per_rollout": joules / max(rollouts, 1), "joules_per_action": joules / max(actions, 1),
                "average_watts": joules / seconds if seconds > 0 else None}
