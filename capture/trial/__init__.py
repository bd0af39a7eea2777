"""The staged trial (shared/guide/staged-trial.md), one module per stage.

- :mod:`config`: the run, defined before the card (TOML, checked key by key).
- :mod:`workload`: the model, optimizer, scheduler and resumable data the trial trains.
- :mod:`memory`: the memory budget estimated before running, term by term.
- :mod:`measure`, :mod:`devmem`: step clocks and memory readings (allocator, NVML/amdsmi, RSS).
- :mod:`fit`: out-of-memory as a result ("does not fit"), the largest micro-batch, the catalog.
- :mod:`cost`: wall time per phase, cost per trained token, projections.
- :mod:`recorder`: the same statistics around a user's own training loop.
- :mod:`runner`: runs the stages in order and writes the signed manifest.
"""
