"""worldpipe.measure: timers with named boundaries, memory by category, energy counters."""
