"""End-to-end training speed over an emulated slow link (``scripts/bench_slow_link.py``).

- ``presets``: the model, the presets compared, the emulated ranks;
- ``runs``: one training run on the 2 x 2 ranks, its step times and bytes;
- ``study``: every (link rate, preset), interleaved, probed, tabulated;
- ``estimates``: the runs next to ``megatron_sdp4bit.estimate``'s prediction;
- ``report``: the tables, the ``--json`` file and its ``--replay``;
- ``collectives``: the collectives alone at each rate (``--collectives``).
"""
