"""Benchmarks that reproduce docs/performance.md's tables (``scripts/bench_*.py`` are
their command lines).

- ``collectives``: time and bytes of each collective on a process group, the one
  collective benchmark (``scripts/bench_collectives.py``, and
  ``scripts/bench_slow_link.py --collectives``);
- ``emulated_nodes``, ``link_probes``: two "nodes" on one Linux host (network
  namespaces joined by a rate-limited veth) and the probes of their links;
- ``slow_link``: end-to-end training over that slow link, SDP4Bit vs the exact
  collectives, next to the estimator's prediction (``scripts/bench_slow_link.py``).

Nothing here is imported by the training driver or the patch layer.
"""
