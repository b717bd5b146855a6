"""The parallel layout's error, shared by ``config.py`` and the pure layout arithmetic it validates with
(``pipeline_layout.py``), which must not import the config."""


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work for this world size or model (raised before any collective)."""
